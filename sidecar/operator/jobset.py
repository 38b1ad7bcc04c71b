"""JobSets restart their gangs themselves (BlockingRecreate): the controller reflects the restart
attempt, the failures and the end (the JobSet's Completed or Failed condition) in the StrataJob,
adds no retry layer, and fences what blocks JobSet's own restart.

The fence: under BlockingRecreate JobSet deletes the Jobs of the earlier attempt (foreground) and
creates the new ones only once they, and so their pods, are gone. A pod of a lost node hangs in
Terminating until its kubelet returns: the restart would wait for it forever. A pod of an earlier
attempt (``restart-attempt`` below the JobSet's ``status.restarts``) still Terminating
``--fence-margin-seconds`` after its grace period is force-deleted, as an Indexed Job's is. Storage
fences it off: its sidecar's generation is ``<JobSet uid>/<its attempt>``, older than the new
gang's, so it can neither open a new attempt nor have a commit above the new restore step read.
Pods of the current attempt are never fenced here: a replacement would run the same generation
beside a pod that may still be writing on a partitioned node. Only this JobSet's pods count (its
``jobset-uid`` label): those of an earlier JobSet of the same name carry another run's generations,
are neither its attempts to mirror nor its to fence, and JobSet's restart does not wait for them."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sidecar.coordinator import FailureKind
from sidecar.operator import names
from sidecar.operator.classify import classify_pod, is_terminal
from sidecar.operator.gang import (
    WatchedJob,
    last_failure,
    meta_of,
    parse_time,
)
from sidecar.operator.kube import ApiError, path
from sidecar.operator.stopping import GangStopping

__all__ = ["JobSetMirror"]

log = logging.getLogger("strata.operator")

#: Failure kinds that name the first cause (the peers of a lost or evicted pod die after it).
FIRST = (FailureKind.LOST, FailureKind.EVICTED, FailureKind.OOM, FailureKind.DELETED)


def attempt_of(pod: Mapping[str, Any]) -> int | None:
    """The JobSet restart attempt a pod belongs to (its ``restart-attempt`` label)."""
    raw = (meta_of(pod).get("labels") or {}).get(names.JOBSET_RESTART_LABEL)
    return int(raw) if raw is not None and str(raw).isdigit() else None


def jobset_ended(jobset: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The JobSet's Completed or Failed condition once it is True (jobset.x-k8s.io/v1alpha2: the
    controller sets one of them, for good, when the JobSet finishes), else None."""
    for condition in (jobset.get("status") or {}).get("conditions") or []:
        if condition.get("type") in ("Completed", "Failed") and condition.get("status") == "True":
            return condition
    return None


class JobSetMirror(GangStopping):
    """Reflect a JobSet's own restarts and end; fence what blocks its restart."""

    def _restart_limit(self, job: WatchedJob) -> int:
        """A JobSet's restarts are JobSet's: its own limit (``failurePolicy.maxRestarts``)."""
        if job.kind != "JobSet":
            return super()._restart_limit(job)
        policy = ((job.workload or {}).get("spec") or {}).get("failurePolicy") or {}
        return int(policy.get("maxRestarts") or 0)

    async def _reflect_jobset(self, job: WatchedJob) -> None:
        """JobSet restarts its gang itself: record the attempt it runs, why it restarted, how it
        ended; fence pods of earlier attempts that hang in Terminating."""
        assert job.status is not None
        if job.status.get("phase") in ("Succeeded", "Failed"):
            return  # for good: JobSet never runs a finished JobSet again
        pods = self._jobset_pods(job)
        attempts = [a for p in pods.values() if (a := attempt_of(p)) is not None]
        attempt = max(attempts, default=0)
        target = int(((job.workload or {}).get("status") or {}).get("restarts") or 0)
        changes: dict[str, Any] = {}
        condition: tuple[str, str, str, str] | None = None
        if target > attempt:
            # JobSet decided a restart; the new gang waits until every old pod is gone.
            if job.status.get("phase") != "Restarting":
                changes["phase"] = "Restarting"
                condition = (
                    "Restarting",
                    "True",
                    "JobSetRestarting",
                    f"JobSet restarts the gang as restart attempt {target}; it recreates it once every "
                    f"pod of attempt {attempt} is gone",
                )
        elif pods and job.generation(attempt) != job.status.get("generation"):
            changes.update(generation=job.generation(attempt), restarts=attempt, phase="Running")
            if attempt > job.restart_count:
                message = f"JobSet {job.name} restarted its gang (restart attempt {attempt})"
                condition = ("Restarting", "False", "JobSetRecreated", message)
                await self._event(job, "JobSetRestarted", f"{message}; Strata adds no retry of its own")
        elif job.status.get("phase") in ("Pending", "Restarting") and pods:
            changes["phase"] = "Running"
        if target <= attempt:  # what JobSet's own deletion of the old gang ends is no failure
            last = self._first_failure(job, attempt)
            if last is not None:
                changes["lastFailure"] = last
        if changes:
            await self._patch_status(job, changes, condition=condition)
        ended = jobset_ended(job.workload or {})
        if ended is not None:
            await self._jobset_ended(job, ended)
            return
        await self._fence_earlier_attempts(job, target)

    def _first_failure(self, job: WatchedJob, attempt: int) -> dict[str, Any] | None:
        """The failure that ended ``attempt`` (a lost or evicted pod beats the peers that died
        after it), unless one of its pods is recorded already."""
        assert job.status is not None
        pods = {name: p for name, p in self._jobset_pods(job).items() if attempt_of(p) == attempt}
        if (job.status.get("lastFailure") or {}).get("pod") in pods:
            return None
        found = []
        for name, pod in sorted(pods.items()):
            failure = classify_pod(pod, container=self.trainer_container)
            if failure is not None:
                rank = FIRST.index(failure.kind) if failure.kind in FIRST else len(FIRST)
                found.append((rank, name, failure))
        if not found:
            return None
        _, name, failure = min(found, key=lambda f: (f[0], f[1]))
        return last_failure(failure, name)

    async def _jobset_ended(self, job: WatchedJob, condition: Mapping[str, Any]) -> None:
        """The JobSet Completed or Failed: the StrataJob's phase, a condition and an Event say so."""
        succeeded = condition.get("type") == "Completed"
        phase = "Succeeded" if succeeded else "Failed"
        reason = f"JobSet{condition.get('type')}"
        detail = str(condition.get("message") or "").strip()
        message = f"the JobSet reports {condition.get('type')} ({condition.get('reason') or 'no reason'}"
        message += f": {detail})" if detail else ")"
        await self._patch_status(
            job, {"phase": phase, "pendingRestart": None}, condition=(phase, "True", reason, message)
        )
        await self._event(job, reason, f"JobSet {job.name}: {message}", warning=not succeeded)

    async def _fence_earlier_attempts(self, job: WatchedJob, target: int) -> None:
        """Force-delete pods of attempts before ``target`` (the JobSet's ``status.restarts``)
        hanging in Terminating past their grace period plus the margin (see the module's
        docstring); a timer comes back for those not yet due."""
        old = [
            p
            for p in self._jobset_pods(job).values()
            if meta_of(p).get("deletionTimestamp") and (attempt_of(p) or 0) < target
        ]
        # A pod that ended before its node was lost is terminal, yet still there: JobSet waits for
        # it as well. Nothing is left to mark on it: past the deadline it is only deleted.
        await self._wait_gone(job, [p for p in old if not is_terminal(p)])
        now = self.clock()
        for pod in old:
            if not is_terminal(pod):
                continue
            deadline = parse_time(meta_of(pod).get("deletionTimestamp")) or now
            if now < deadline + self.fence_margin_s:
                self._wake(job, deadline + self.fence_margin_s)
                continue
            name = str(meta_of(pod)["name"])
            try:
                await self.api.delete(path("", "v1", "pods", job.namespace, name), {"gracePeriodSeconds": 0})
            except ApiError as exc:
                if exc.status != 404:
                    raise
            if name not in job.fenced:
                job.fenced.add(name)
                await self._event(
                    job,
                    "PodFenced",
                    f"pod {name} of restart attempt {attempt_of(pod)} was still there "
                    f"{now - deadline:.0f} s after its grace period ended: force-deleted it, so JobSet "
                    "can recreate the gang; its attempt is fenced off in storage",
                    warning=True,
                )
