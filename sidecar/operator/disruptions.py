"""Disruptions are not crashes: a pod evicted (drain, the Eviction API, the kubelet's node-pressure
eviction, the scheduler's preemption), lost with its node, or a Job that Kueue suspends (its
preemption, or ``waitForPodsReady``) restarts the gang without spending ``strata.dev/max-restarts``
and without the crash backoff. They are counted apart (``status.disruptions``), as JobSet's
``RestartJobSetAndIgnoreMaxRestarts`` does, and, as there, without a limit of their own: a
disruption says nothing about the training code, and the cluster that disrupts a gang decides when
it may run again (a storm of them shows in the count, the Events and
``strata_operator_disruptions_total``).

What counts as one: what Kubernetes marks with the ``DisruptionTarget`` pod condition (classified
``evicted`` or ``lost``), the kubelet's eviction (reason Evicted), a node lost (Ready False because
of the node), and a Job's suspension. A pod deleted without any such condition (``kubectl delete
pod``, a controller deleting directly) is a crash: the Job controller counts it against
``backoffLimitPerIndex`` too, and the two budgets must agree.

Also here: indexes the Job controller gave up on (``status.failedIndexes``, past
``backoffLimitPerIndex``) are never re-created, so no whole gang can run again: the job fails
naming them, instead of waiting for them forever.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping
from typing import Any

from sidecar.coordinator import Failure, FailureKind
from sidecar.operator.gang import (
    WatchedJob,
    failed_indexes,
    is_gated,
    last_failure,
    meta_of,
    now_text,
    parse_time,
)
from sidecar.operator.kube import ApiError, path
from sidecar.operator.release import GangRelease

__all__ = ["DISRUPTIONS", "GangDisruptions"]

#: Failure kinds that are disruptions (the cluster's doing), not crashes.
DISRUPTIONS = frozenset({FailureKind.EVICTED, FailureKind.LOST})
#: How soon to look again when a pod's deletion may be a suspension the Job's watch event has not
#: shown yet.
SUSPENSION_RECHECK_S = 1.0


def _suspended(job: WatchedJob) -> bool:
    """The Job is suspended, as its newest known version says (an older watch event is not)."""
    if _generation(job.workload) < job.fresh_generation:
        return False
    return bool(((job.workload or {}).get("spec") or {}).get("suspend"))


def _generation(workload: Mapping[str, Any] | None) -> int:
    value = meta_of(workload or {}).get("generation")
    return value if isinstance(value, int) else 0


def _suspended_since(workload: Mapping[str, Any] | None, started: float | None) -> bool:
    """The Job controller's ``Suspended`` condition changed after ``started`` (whole seconds, as
    condition times are: a change within the release's second is not seen)."""
    for condition in ((workload or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Suspended":
            changed = parse_time(condition.get("lastTransitionTime"))
            return started is not None and changed is not None and changed > started
    return False


class GangDisruptions(GangRelease):
    """Suspension and resume, disruption restarts, and indexes the Job controller gave up on."""

    async def _suspension(self, job: WatchedJob) -> bool:
        """True while the Job is suspended, or when its resume started the next generation here;
        False when nothing of a suspension is left to handle."""
        assert job.status is not None
        status = job.status
        if _suspended(job):
            # The Job controller deletes its pods on purpose: none of that is a failure, and no
            # restart waits while it is suspended.
            job.vanished.clear()
            if status.get("phase") != "Suspended":
                running = status.get("generation") is not None
                message = (
                    "the Job is suspended (Kueue preemption or waitForPodsReady eviction, or by hand): the "
                    "Job controller deletes its pods; "
                    + (
                        "on resume the gang restarts from the newest committed step, counted as a "
                        "disruption, not against strata.dev/max-restarts"
                        if running
                        else "its first gang starts on resume"
                    )
                )
                await self._patch_status(
                    job,
                    {"phase": "Suspended", "pendingRestart": None},
                    condition=("Suspended", "True", "JobSuspended", message),
                )
                await self._event(job, "GangSuspended", message)
            return True
        if status.get("phase") != "Suspended":
            return False
        if status.get("generation") is None:  # suspended before its first gang (Kueue creates it so)
            await self._patch_status(
                job,
                {"phase": "Pending"},
                condition=("Suspended", "False", "JobResumed", "the Job was resumed; its first gang starts"),
            )
            return False
        await self._resumed(job, "the Job was resumed")
        return True

    async def _resumed(self, job: WatchedJob, what: str) -> None:
        """Start the next generation after a suspension: one disruption, no backoff."""
        assert job.status is not None
        status = job.status
        count = int(status.get("disruptions") or 0) + 1
        pending = self._disruption_pending(job, "suspended")
        message = (
            f"{what}: restarting all {job.world} ranks as generation {pending['generation']} "
            f"from the newest committed step (disruption {count}; crash restarts stay "
            f"{int(status.get('restarts') or 0)} of {job.settings.max_restarts})"
        )
        if self.metrics is not None:
            self.metrics.disruptions.labels(reason="suspended").inc()
        self.decisions.append((job.name, time.monotonic()))
        await self._patch_status(
            job,
            {"phase": "Restarting", "disruptions": count, "pendingRestart": pending},
            condition=("Suspended", "False", "JobResumed", message),
        )
        await self._event(job, "GangResumed", message)
        await self._restart(job, self._own_pods(job), pending)

    async def _suspended_meanwhile(self, job: WatchedJob, pod: str) -> bool:
        """Whether the failure of a deleted ``pod`` ("": an index whose pod is gone) is the Job
        controller's doing for a suspension this controller did not see: the Job and pod watches are
        separate streams (the deletions may come before the Job's event), and a suspension may have
        come and gone while the operator was down or its Job event lagged. One GET of the Job,
        only for deleted pods. Still suspended: nothing is decided until the Job's event comes (a
        look again in a second). Suspended and resumed since the current generation was released
        (the Job controller's ``Suspended`` condition changed since): the next generation starts as
        a disruption. Returns True when it handled the failure."""
        seen = job.pods.get(pod)
        if pod and pod not in job.vanished and (seen is None or not meta_of(seen).get("deletionTimestamp")):
            return False
        assert job.status is not None
        started = parse_time(job.status.get("generationStartedAt"))
        workload = job.workload
        if not _suspended_since(workload, started):
            try:
                workload = await self.api.get(path("batch", "v1", "jobs", job.namespace, job.name))
            except ApiError:
                return False
            if workload is None or meta_of(workload).get("uid") != job.uid:
                return False
            job.fresh_generation = max(job.fresh_generation, _generation(workload))
            if (workload.get("spec") or {}).get("suspend"):
                self._wake(job, self.clock() + SUSPENSION_RECHECK_S)
                return True
            if not _suspended_since(workload, started):
                return False
        await self._resumed(
            job,
            f"the Job was suspended and resumed since generation {job.status.get('generation')} was "
            "released (its pods went with the suspension)",
        )
        return True

    def _disruption_pending(self, job: WatchedJob, reason: str) -> dict[str, Any]:
        """A pending restart for a disruption: the next generation, no backoff."""
        return {
            "generation": job.generation(job.restart_count + 1),
            "decidedAt": now_text(),
            "notBefore": datetime.datetime.fromtimestamp(self.clock(), tz=datetime.UTC).strftime(
                "%Y-%m-%dT%H:%M:%S.%fZ"
            ),
            "reason": reason,
            "mode": "pod",
        }

    async def _disrupted(
        self, job: WatchedJob, failure: Failure, running: list[dict[str, Any]], pod: str = ""
    ) -> None:
        """Restart the gang after a disruption: counted in ``disruptions``, never against the crash
        budget, and without the crash backoff (the cluster already chose the moment)."""
        assert job.status is not None
        count = int(job.status.get("disruptions") or 0) + 1
        pending = self._disruption_pending(job, failure.kind.value)
        message = (
            f"{failure.describe()}; a disruption, not a crash: restarting all {job.world} ranks from the "
            f"newest committed step (disruption {count}; crash restarts stay "
            f"{int(job.status.get('restarts') or 0)} of {job.settings.max_restarts})"
        )
        last = last_failure(failure, pod)
        self.decisions.append((job.name, time.monotonic()))
        if self.metrics is not None:
            self.metrics.disruptions.labels(reason=failure.kind.value).inc()
        await self._patch_status(
            job,
            {"phase": "Restarting", "disruptions": count, "pendingRestart": pending, "lastFailure": last},
            condition=("Restarting", "True", "Disruption", message),
        )
        await self._event(job, "GangRestart", message, warning=True, on_workload=True)
        await self._restart(job, self._own_pods(job), pending)

    async def _index_given_up(self, job: WatchedJob, pods: list[dict[str, Any]]) -> bool:
        """The Job controller failed an index (past ``backoffLimitPerIndex``, or a FailIndex rule):
        it never re-creates it, so no whole gang can run again. The job fails naming it, the gang
        stops, and the replacements are released to stop (see ``_release_to_stop``) instead of
        waiting for the index forever."""
        if job.kind != "Job":
            return False
        failed = failed_indexes(job.workload)
        if not failed:
            return False
        assert job.status is not None
        spec = (job.workload or {}).get("spec") or {}
        limit = spec.get("backoffLimitPerIndex")
        which = ", ".join(str(i) for i in failed)
        message = (
            f"the Job controller gave up on index(es) {which} (status.failedIndexes): "
            + (
                f"their pods failed more than spec.backoffLimitPerIndex ({limit}) times"
                if limit is not None
                else "a podFailurePolicy FailIndex rule matched"
            )
            + ", so they are never re-created and no whole gang can run again"
            + (
                "; set backoffLimitPerIndex to at least strata.dev/max-restarts "
                f"({job.settings.max_restarts})"
                if limit is not None and int(limit) < job.settings.max_restarts
                else ""
            )
        )
        if self.metrics is not None:
            self.metrics.jobs_failed.labels(reason="IndexFailed").inc()
        await self._patch_status(
            job,
            {
                "phase": "Failed",
                "pendingRestart": None,
                "lastFailure": {
                    "reason": "IndexFailed",
                    "kind": FailureKind.CONFIG.value,
                    "message": message,
                    "pod": "",
                    "time": now_text(),
                },
            },
            condition=("Failed", "True", "IndexFailed", message),
        )
        await self._event(job, "IndexFailed", message, warning=True, on_workload=True)
        await self._stop_pods(job, [p for p in pods if not is_gated(p)])
        return True
