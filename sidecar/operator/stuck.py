"""Stuck gangs: pods that will not get going on their own (an image that cannot be pulled, a missing
Secret, no node that fits, the injected sidecar crash-looping) and gangs that cannot be completed
(an index the Job controller does not create) are shown on the StrataJob, as Events and as metrics.

A cause counts once it has shown for ``stuck_grace_s`` (default 30 s: ImagePullBackOff and
Unschedulable are often transient, a pull retried or a node added) on the same pod; a gang waits
that long plus the Job controller's own replacement backoff. Then:

- the StrataJob's condition ``Stuck`` is True, reason the first cause (in :data:`CAUSES` order),
  message naming every stuck pod with the kubelet's or the scheduler's words; ``status.stuckPods``
  lists them, with when each was first seen;
- a Warning Event (reason = the cause) on the StrataJob and the workload, once per pod and cause;
- ``strata_operator_stuck_gangs{cause}`` and ``strata_operator_stuck_pods{cause}`` count them.

When no pod shows a cause any more the condition goes False (reason ``Resolved``) with a Normal
Event. Nothing here acts on the gang: a stuck pod is the user's (or the cluster's) to fix.

The pod index comes from the watch, so pod status changes re-check; while a cause waits out its
grace a timer (``_wake``) re-checks when it would count.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.operator import names
from sidecar.operator.classify import is_terminal
from sidecar.operator.gang import WatchedJob, index_of, is_gated, meta_of, parse_time
from sidecar.operator.kube import ApiError
from sidecar.operator.stratajob import StrataJobGone, StrataJobStatus

__all__ = ["CAUSES", "DEFAULT_STUCK_GRACE_S", "StuckGangs", "gang_incomplete", "pod_cause"]

log = logging.getLogger("strata.operator")

#: How long a cause must show on a pod before it counts.
DEFAULT_STUCK_GRACE_S = 30.0
#: The causes, in the order the condition's reason picks one when several show.
CAUSES = (
    "Unschedulable",
    "ImagePullBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
    "SidecarCrashLoop",
    "GangIncomplete",
)
#: The kubelet's waiting reasons, by cause.
_WAITING = {
    "ErrImagePull": "ImagePullBackOff",
    "ImagePullBackOff": "ImagePullBackOff",
    "ErrImageNeverPull": "ImagePullBackOff",
    "InvalidImageName": "ImagePullBackOff",
    "CreateContainerConfigError": "CreateContainerConfigError",
    "CreateContainerError": "CreateContainerError",
}
#: The Job controller delays creating pods after failures (pkg/controller/job, backoff_utils.go):
#: 10 s doubling per failure, capped at 10 min (6 min before 1.27), counted from the last failure.
#: Without backoffLimitPerIndex the count is the Job's failures since its last pod success (every
#: failed pod, those a podFailurePolicy Ignore rule leaves out of status.failed too), and the delay
#: holds every index back; with it, each index counts its own (the failed pod's
#: job-index-failure-count and job-index-ignored-failure-count annotations, plus that failure).
_JOB_BACKOFF_S = 10.0
_JOB_BACKOFF_MAX_S = 600.0
_INDEX_FAILURES = (
    "batch.kubernetes.io/job-index-failure-count",
    "batch.kubernetes.io/job-index-ignored-failure-count",
)
#: What a condition message keeps (the CRD allows 32768; Events keep 1024).
_MESSAGE_MAX = 4096
#: Pods listed in status.stuckPods, and pods per cause with an Event of their own; the rest of a
#: large gang is named in one summary Event per cause at most every _SUMMARY_EVERY_S (a gang going
#: stuck pod by pod would otherwise post one per check: the apiserver aggregates identical Events
#: only, and each summary names other pods).
_LISTED_MAX = 50
_EVENTS_PER_CAUSE = 10
_SUMMARY_EVERY_S = 600.0


def _waiting(status: Mapping[str, Any]) -> Mapping[str, Any]:
    return (status.get("state") or {}).get("waiting") or {}


def pod_cause(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(cause, what the API says) for a released pod that shows one of :data:`CAUSES`, else None.
    Gated, ending and deleting pods show none (the gate is the operator's, the end a failure's)."""
    meta = meta_of(pod)
    if is_gated(pod) or is_terminal(pod) or meta.get("deletionTimestamp"):
        return None
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            return "Unschedulable", str(condition.get("message") or "no node fits the pod")
    init = status.get("initContainerStatuses") or []
    for container in [*init, *(status.get("containerStatuses") or [])]:
        waiting = _waiting(container)
        cause = _WAITING.get(str(waiting.get("reason")))
        if cause is not None:
            said = f": {waiting['message']}" if waiting.get("message") else ""
            return cause, f"container {container.get('name')}: {waiting.get('reason')}{said}"
    for container in init:
        if container.get("name") != names.SIDECAR_CONTAINER:
            continue
        waiting = _waiting(container)
        restarts = int(container.get("restartCount") or 0)
        # Between its crashes a crash-looping sidecar runs without ever becoming ready (its startup
        # probe never passes): still the same loop, not a recovery.
        looping = waiting.get("reason") == "CrashLoopBackOff" or (restarts > 0 and not container.get("ready"))
        if looping:
            last = (container.get("lastState") or {}).get("terminated") or {}
            ended = (
                f"; last exit {last.get('exitCode')}" + (f" ({last['reason']})" if last.get("reason") else "")
                if last
                else ""
            )
            said = f": {waiting['message']}" if waiting.get("message") else ""
            return (
                "SidecarCrashLoop",
                f"container {names.SIDECAR_CONTAINER} restarted {restarts} times{ended}"
                f"{'; ' + str(waiting.get('reason')) + said if waiting else ''}",
            )
    return None


def gang_incomplete(job: WatchedJob, pods: Iterable[Mapping[str, Any]]) -> tuple[str, str] | None:
    """(the oldest waiting pod, what is missing) when gated pods wait for indexes that have no pod,
    with no pod of an earlier gang still running or stopping (which a gang restart waits for):
    the Job controller did not create them (a quota, a FailedCreate, an index it gave up on)."""
    waiting, blocking = [], False
    for pod in pods:
        if is_terminal(pod):
            continue
        if is_gated(pod) and not meta_of(pod).get("deletionTimestamp"):
            waiting.append(pod)
        else:
            blocking = True
    if not waiting or blocking:
        return None
    missing = sorted(set(range(job.world)) - {index_of(p) for p in waiting})
    if not missing:
        return None  # complete: the release follows (after the backoff)
    oldest = min(
        waiting, key=lambda p: (str(meta_of(p).get("creationTimestamp") or ""), meta_of(p).get("name"))
    )
    failed = _index_set(str(((job.workload or {}).get("status") or {}).get("failedIndexes") or ""))
    given_up = [i for i in missing if i in failed]
    why = (
        f"the Job controller gave up on index(es) {_indexes(given_up)} (backoffLimitPerIndex)"
        if given_up
        else "the Job controller has not created them (a ResourceQuota, FailedCreate: see the Job's Events)"
    )
    return (
        str(meta_of(oldest).get("name")),
        f"{len(waiting)} pod(s) wait gated for index(es) {_indexes(missing)} of {job.world}, "
        f"which have no pod: {why}",
    )


def _backoff(failures: int) -> float:
    return 0.0 if failures < 1 else min(_JOB_BACKOFF_S * 2 ** min(failures - 1, 16), _JOB_BACKOFF_MAX_S)


def _job_backoff(job: WatchedJob, pods: Iterable[Mapping[str, Any]]) -> float:
    """How long the Job controller may hold back the replacements of a gang restart (see
    _JOB_BACKOFF_S), estimated from above: a gang reported incomplete is one it had time to create."""
    workload = job.workload or {}
    failed_pods = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
    restarts = int((job.status or {}).get("restarts") or 0)
    if ((workload.get("spec") or {}).get("backoffLimitPerIndex")) is not None:
        failures = min(restarts, 1)  # each gang restart fails each index once
        for pod in failed_pods:
            notes = meta_of(pod).get("annotations") or {}
            counted = sum(int(v) for a in _INDEX_FAILURES if (v := str(notes.get(a) or "0")).isdigit())
            failures = max(failures, counted + 1)
    else:
        # status.failed leaves out failures an Ignore rule matched (a gang restart's evictions), which
        # the backoff counts: the failed pods still listed, and each restart failing every index,
        # bound it from below.
        failed = int((workload.get("status") or {}).get("failed") or 0)
        failures = max(failed, len(failed_pods), restarts * job.world)
    return _backoff(failures)


def _index_set(text: str) -> set[int]:
    """The Job status's index list ("1,3-5") as a set; what does not parse is left out."""
    found: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            found.update(range(int(low), int(high or low) + 1))
    return found


def _indexes(values: list[int]) -> str:
    shown = ", ".join(str(v) for v in values[:10])
    return shown + (f" and {len(values) - 10} more" if len(values) > 10 else "")


def _timestamp(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Stuck:
    """One workload's stuck pods, as this operator process has seen them."""

    uid: str = ""
    #: (pod, cause) -> when first seen showing it (continuously since).
    seen: dict[tuple[str, str], float] = field(default_factory=dict)
    #: (pod, cause) -> the message, for those past their grace.
    active: dict[tuple[str, str], str] = field(default_factory=dict)
    #: (pod, cause) an Event was posted for (or that waits for its cause's next summary).
    announced: set[tuple[str, str]] = field(default_factory=set)
    #: cause -> pods past the Events of their own not yet in a summary Event, and when the last
    #: summary of that cause was posted.
    unsummarized: dict[str, list[str]] = field(default_factory=dict)
    summarized_at: dict[str, float] = field(default_factory=dict)


class StuckGangs(StrataJobStatus):
    """Detect stuck pods and gangs; show them on the StrataJob, in Events and metrics."""

    def __init__(self, api: Any, *, stuck_grace_s: float = DEFAULT_STUCK_GRACE_S, **kwargs: Any) -> None:
        super().__init__(api, **kwargs)
        #: How long a cause must show before it counts (< 0: detection off).
        self.stuck_grace_s = stuck_grace_s
        self._stuck: dict[tuple[str, str], _Stuck] = {}
        if self.metrics is not None and hasattr(self.metrics, "track_stuck"):
            self.metrics.track_stuck(self)

    def stuck_counts(self) -> Iterator[tuple[str, int, int]]:
        """(cause, gangs, pods) for every cause, over the watched workloads (metrics read it)."""
        gangs = dict.fromkeys(CAUSES, 0)
        pods = dict.fromkeys(CAUSES, 0)
        for key, state in list(self._stuck.items()):
            job = self.jobs.get(key)
            if job is None or job.workload is None or job.uid != state.uid:
                continue
            causes = [cause for _, cause in state.active]
            for cause in set(causes):
                gangs[cause] += 1
            for cause in causes:
                pods[cause] += 1
        for cause in CAUSES:
            yield cause, gangs[cause], pods[cause]

    def _grace(self, job: WatchedJob, cause: str) -> float:
        if cause != "GangIncomplete":
            return self.stuck_grace_s
        return self.stuck_grace_s + _job_backoff(job, self._own_pods(job))

    def _observe(self, job: WatchedJob) -> dict[tuple[str, str], str]:
        """What shows now: (pod, cause) -> message."""
        status = job.status or {}
        spec = (job.workload or {}).get("spec") or {}
        if status.get("phase") in ("Succeeded", "Failed") or spec.get("suspend"):
            return {}
        pods = list(self._jobset_pods(job).values()) if job.kind == "JobSet" else self._own_pods(job)
        found: dict[tuple[str, str], str] = {}
        for pod in pods:
            shown = pod_cause(pod)
            if shown is not None:
                found[(str(meta_of(pod).get("name")), shown[0])] = shown[1]
        if job.kind == "Job" and not found:
            incomplete = gang_incomplete(job, pods)
            if incomplete is not None:
                found[(incomplete[0], "GangIncomplete")] = incomplete[1]
        return found

    async def _check_stuck(self, job: WatchedJob) -> None:
        """Bring the Stuck condition, ``status.stuckPods``, the Events and the metrics up to date.
        Never in the restart protocol's way: an API error is logged and retried later."""
        if self.stuck_grace_s < 0 or job.status is None:
            return
        state = self._stuck.get(job.key)
        if state is None or state.uid != job.uid:
            state = self._stuck[job.key] = _Stuck(uid=job.uid)
            # An operator restarted: what the StrataJob already lists keeps its time and its Event.
            for entry in job.status.get("stuckPods") or []:
                key = (str(entry.get("pod")), str(entry.get("cause")))
                state.seen[key] = parse_time(entry.get("since")) or self.clock()
                state.announced.add(key)
        now = self.clock()
        observed = self._observe(job)
        state.seen = {key: state.seen.get(key, now) for key in observed}
        active: dict[tuple[str, str], str] = {}
        due: float | None = None
        for key, message in observed.items():
            counts_at = state.seen[key] + self._grace(job, key[1])
            if now >= counts_at:
                active[key] = message
            else:
                due = counts_at if due is None else min(due, counts_at)
        if due is not None:
            self._wake(job, due)
        live = set(job.pods)
        state.announced = {key for key in state.announced if key[0] in live or key in active}
        try:
            await self._show_stuck(job, state, active)
        except StrataJobGone:
            raise  # the reconcile recreates it
        except ApiError as exc:
            if self.metrics is not None:
                self.metrics.reconcile_errors.inc()
            log.warning("%s/%s: could not record stuck pods: %s; retrying", job.namespace, job.name, exc)
            self._wake(job, now + 5.0)

    async def _show_stuck(self, job: WatchedJob, state: _Stuck, active: dict[tuple[str, str], str]) -> None:
        assert job.status is not None
        listed = {(str(e.get("pod")), str(e.get("cause"))) for e in job.status.get("stuckPods") or []}
        was_stuck = any(
            c.get("type") == "Stuck" and c.get("status") == "True" for c in job.status.get("conditions") or []
        )
        state.active = dict(active)
        ordered = sorted(active.items(), key=lambda kv: (CAUSES.index(kv[0][1]), kv[0][0]))
        shown = ordered[:_LISTED_MAX]  # a whole gang of thousands stuck: the status stays small
        if shown and ({key for key, _ in shown} != listed or not was_stuck):
            entries = [
                {
                    "pod": pod,
                    "cause": cause,
                    "message": message[:1024],
                    "since": _timestamp(state.seen[(pod, cause)]),
                }
                for (pod, cause), message in shown
            ]
            more = f" (and {len(ordered) - len(shown)} more pods)" if len(ordered) > len(shown) else ""
            text = "; ".join(f"pod {pod} {cause}: {message}" for (pod, cause), message in shown)
            await self._patch_status(
                job,
                {"stuckPods": entries},
                condition=("Stuck", "True", ordered[0][0][1], text[: _MESSAGE_MAX - len(more)] + more),
            )
        elif not active and (listed or was_stuck):
            causes = ", ".join(sorted({cause for _, cause in listed})) or "stuck"
            await self._patch_status(
                job,
                {"stuckPods": None},
                condition=(
                    "Stuck",
                    "False",
                    "Resolved",
                    f"no pod shows a stuck cause any more (was: {causes})",
                ),
            )
            await self._event(job, "Unstuck", f"no pod is stuck any more (was: {causes})")
        # One Event per pod and cause; past a few per cause, one Event names the rest together.
        told = {cause: sum(1 for _, c in state.announced if c == cause) for cause in CAUSES}
        rest: dict[str, list[str]] = {}
        for (pod, cause), message in ordered:
            if (pod, cause) in state.announced:
                continue
            state.announced.add((pod, cause))
            if told[cause] >= _EVENTS_PER_CAUSE:
                rest.setdefault(cause, []).append(pod)
                continue
            told[cause] += 1
            grace = self._grace(job, cause)
            await self._event(
                job,
                cause,
                f"pod {pod} is stuck ({cause} for over {grace:g} s): {message}",
                warning=True,
                on_workload=True,
            )
        now = self.clock()
        for cause, pods in rest.items():
            state.unsummarized.setdefault(cause, []).extend(pods)
        for cause, pods in list(state.unsummarized.items()):
            pods = [p for p in pods if (p, cause) in active]
            if not pods:
                del state.unsummarized[cause]
                continue
            state.unsummarized[cause] = pods
            due = state.summarized_at.get(cause, float("-inf")) + _SUMMARY_EVERY_S
            if now < due:
                self._wake(job, due)
                continue
            del state.unsummarized[cause]
            state.summarized_at[cause] = now
            listing = ", ".join(pods[:_EVENTS_PER_CAUSE]) + (
                f" and {len(pods) - _EVENTS_PER_CAUSE} more" if len(pods) > _EVENTS_PER_CAUSE else ""
            )
            total = sum(1 for _, c in active if c == cause)
            await self._event(
                job,
                cause,
                f"{len(pods)} more pods are stuck ({cause}; {total} in all): {listing}",
                warning=True,
                on_workload=True,
            )
