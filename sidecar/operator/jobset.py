"""JobSets restart their gangs themselves (BlockingRecreate): the controller reflects the restart
attempt and the failures in the StrataJob and adds no retry layer."""

from __future__ import annotations

from typing import Any

from sidecar.operator import names
from sidecar.operator.classify import classify_pod
from sidecar.operator.gang import (
    REASONS,
    WatchedJob,
    meta_of,
    now_text,
)
from sidecar.operator.stratajob import StrataJobStatus

__all__ = ["JobSetMirror"]


class JobSetMirror(StrataJobStatus):
    """Reflect a JobSet's own restarts."""

    async def _reflect_jobset(self, job: WatchedJob) -> None:
        """JobSet restarts its gang itself: record the attempt it runs and why it restarted."""
        assert job.status is not None
        attempts = [
            int(v)
            for p in job.pods.values()
            if (v := (meta_of(p).get("labels") or {}).get(names.JOBSET_RESTART_LABEL)) is not None
            and str(v).isdigit()
        ]
        attempt = max(attempts, default=0)
        changes: dict[str, Any] = {}
        if job.pods and job.generation(attempt) != job.status.get("generation"):
            changes.update(generation=job.generation(attempt), restarts=attempt, phase="Running")
            if attempt > job.restart_count:
                await self._event(
                    job,
                    "JobSetRestarted",
                    f"JobSet {job.name} restarted its gang (restart attempt {attempt}); "
                    "Strata adds no retry of its own",
                )
        if job.status.get("phase") == "Pending" and job.pods:
            changes["phase"] = "Running"
        for pod in job.pods.values():
            labels = meta_of(pod).get("labels") or {}
            if str(labels.get(names.JOBSET_RESTART_LABEL, "0")) != str(attempt):
                continue
            failure = classify_pod(pod, container=self.trainer_container)
            if failure is not None:
                last = {
                    "reason": REASONS.get(failure.kind, "Failed"),
                    "kind": failure.kind.value,
                    "message": failure.describe(),
                    "pod": str(meta_of(pod).get("name")),
                    "time": now_text(),
                }
                known = job.status.get("lastFailure") or {}
                if (known.get("pod"), known.get("reason")) != (last["pod"], last["reason"]):
                    changes["lastFailure"] = last
                break
        if changes:
            await self._patch_status(job, changes)
