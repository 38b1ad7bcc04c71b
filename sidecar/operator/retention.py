"""Lifecycle of what the operator writes (StrataJobs, Checkpoint objects) once its workload is gone.

A StrataJob and its Checkpoints outlive their Job on purpose: a Job resubmitted under the same name
resumes from them. They do not outlive it forever:

- **Retention** (``strata.dev/retention``, default ``168h``): when the workload is deleted (by
  ``kubectl delete``, or by the TTL controller after ``ttlSecondsAfterFinished``) the StrataJob
  records ``status.workloadDeletedAt``; once the retention has passed since then, with no workload
  of that name back, the operator deletes the job's Checkpoint objects (label ``strata.dev/job``)
  and the StrataJob. ``0`` deletes them at once, ``never`` keeps them. A resubmission within the
  retention resumes as before and clears the mark. The setting is copied into
  ``status.retention`` while the workload exists, so it still applies after the workload is gone.
- **Owner references** (``strata.dev/owned-by-workload: "true"``): the StrataJob and the Checkpoints
  get an ownerReference to the workload, so Kubernetes' garbage collector deletes them with it
  (a resubmission then starts a new StrataJob; the bucket keeps its data either way).

The bucket's data follows the sidecar's ``--keep`` as before: nothing here touches storage.

A sweep LISTs the StrataJobs at start and every ``retention_sweep_s`` (hourly): it marks those whose
workload disappeared while no operator watched, and finds the due ones; deletions in between are
timed from the watch's DELETED events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from sidecar.operator import names
from sidecar.operator.annotations import format_retention, parse_retention
from sidecar.operator.gang import WatchedJob, meta_of, now_text, parse_time
from sidecar.operator.kube import ApiError, path
from sidecar.operator.stratajob import STRATAJOBS, StrataJobStatus

__all__ = ["DEFAULT_RETENTION", "Lifecycle", "format_retention", "parse_retention"]

log = logging.getLogger("strata.operator")

DEFAULT_RETENTION = "168h"
#: How often every StrataJob is looked at (deletions seen by the watch are timed on their own).
DEFAULT_RETENTION_SWEEP_S = 3600.0


def _retention_of(status: Mapping[str, Any]) -> float | None:
    try:
        return parse_retention(str(status.get("retention") or DEFAULT_RETENTION))
    except ValueError:
        return parse_retention(DEFAULT_RETENTION)


def _workload_path(namespace: str, workload: Mapping[str, Any]) -> str | None:
    group, _, version = str(workload.get("apiVersion") or "batch/v1").rpartition("/")
    plural = {"Job": "jobs", "JobSet": "jobsets"}.get(str(workload.get("kind")))
    name = workload.get("name")
    return None if plural is None or not name else path(group, version, plural, namespace, str(name))


class Lifecycle(StrataJobStatus):
    """Retention after the workload is gone, and owner references where asked for."""

    def __init__(
        self, api: Any, *, retention_sweep_s: float = DEFAULT_RETENTION_SWEEP_S, **kwargs: Any
    ) -> None:
        super().__init__(api, **kwargs)
        self.retention_sweep_s = retention_sweep_s
        #: Called with (namespace, job) when its objects were deleted (the Checkpoint writer forgets it).
        self.on_expired: Callable[[str, str], None] | None = None
        #: (namespace, name) -> wall time its StrataJob is due for deletion.
        self._retention_due: dict[tuple[str, str], float] = {}
        self._retention_wake = asyncio.Event()
        #: (namespace, name) -> (workload uid, owned) whose owner references are in place.
        self._owned: dict[tuple[str, str], tuple[str, bool]] = {}

    # -- while the workload exists ------------------------------------------------------------------

    def owner_references(self, namespace: str, job_name: str) -> list[dict[str, Any]] | None:
        """The ownerReferences a Checkpoint of this job gets (None: not asked for)."""
        job = self.jobs.get((namespace, job_name))
        if job is None or job.workload is None or not job.settings.owned_by_workload or not job.uid:
            return None
        return [self._owner_reference(job)]

    @staticmethod
    def _owner_reference(job: WatchedJob) -> dict[str, Any]:
        # No blockOwnerDeletion: setting it needs update on the workload's finalizers, which the
        # operator does not hold (and a foreground deletion need not wait for these objects).
        return {
            "apiVersion": str((job.workload or {}).get("apiVersion", "batch/v1")),
            "kind": job.kind,
            "name": job.name,
            "uid": job.uid,
        }

    async def _check_lifecycle(self, job: WatchedJob) -> None:
        """The workload exists: clear a deletion mark (a resubmission within the retention), keep
        the retention setting on the StrataJob, and set or drop the owner references."""
        assert job.status is not None
        changes: dict[str, Any] = {}
        if job.status.get("workloadDeletedAt"):
            changes["workloadDeletedAt"] = None
            self._retention_due.pop(job.key, None)
        wanted = format_retention(job.settings.retention)
        if job.status.get("retention") != wanted:
            changes["retention"] = wanted
        if changes:
            await self._patch_status(job, changes)
        if self._owned.get(job.key) != (job.uid, job.settings.owned_by_workload):
            try:
                await self._own(job)
            except ApiError as exc:
                log.warning("%s/%s: owner references not set: %s; retried", job.namespace, job.name, exc)
            else:
                self._owned[job.key] = (job.uid, job.settings.owned_by_workload)

    async def _own(self, job: WatchedJob) -> None:
        owned = job.settings.owned_by_workload
        reference = self._owner_reference(job)
        stratajob_meta = meta_of(job.stratajob or {})
        held = list(stratajob_meta.get("ownerReferences") or [])
        # References to this workload's earlier incarnations (same kind and name) are replaced.
        kept = [r for r in held if (r.get("kind"), r.get("name")) != (job.kind, job.name)]
        wanted = [*kept, reference] if owned else kept
        had_ours = len(kept) != len(held)
        if wanted != held:
            updated = await self.api.merge_patch(
                self._stratajob_path(job), {"metadata": {"ownerReferences": wanted or None}}
            )
            if job.stratajob is not None:
                job.stratajob["metadata"] = updated.get("metadata") or job.stratajob.get("metadata")
        if not owned and not had_ours:
            return  # never asked for: no Checkpoint carries one
        listing = await self.api.request(
            "GET",
            path(names.GROUP, names.VERSION, "checkpoints", job.namespace),
            params={"labelSelector": f"{names.JOB_LABEL}={job.name}"},
        )
        for item in (listing or {}).get("items") or []:
            refs = list(meta_of(item).get("ownerReferences") or [])
            others = [r for r in refs if (r.get("kind"), r.get("name")) != (job.kind, job.name)]
            target = [*others, reference] if owned else others
            if target != refs:
                with contextlib.suppress(ApiError):  # gone meanwhile (retention): nothing to own
                    await self.api.merge_patch(
                        path(names.GROUP, names.VERSION, "checkpoints", job.namespace, meta_of(item)["name"]),
                        {"metadata": {"ownerReferences": target or None}},
                    )

    # -- once it is gone --------------------------------------------------------------------------

    async def _workload_deleted(self, job: WatchedJob) -> None:
        """The workload's DELETED event: mark the StrataJob, and time its deletion."""
        now = self.clock()
        # Unloaded (no settings read): due at once, which reads the StrataJob's own retention.
        retention = job.settings.retention if job.status is not None else 0.0
        try:
            if job.status is not None:
                stuck = any(
                    c.get("type") == "Stuck" and c.get("status") == "True"
                    for c in job.status.get("conditions") or []
                )
                await self._patch_status(
                    job,
                    {"workloadDeletedAt": now_text(), **({"stuckPods": None} if stuck else {})},
                    condition=("Stuck", "False", "WorkloadDeleted", f"the {job.kind} was deleted")
                    if stuck
                    else None,
                )
            else:
                await self.api.merge_patch(
                    self._stratajob_path(job, "status"), {"status": {"workloadDeletedAt": now_text()}}
                )
        except ApiError as exc:
            if exc.status != 404:  # 404: none, or the garbage collector took it (owned)
                log.warning(
                    "%s/%s: deletion not recorded on the StrataJob (%s); the sweep will",
                    job.namespace,
                    job.name,
                    exc,
                )
            return
        self._owned.pop(job.key, None)
        if retention is not None:
            self._retention_due[job.key] = now + retention
            self._retention_wake.set()

    async def run_retention(self, namespaces: tuple[str, ...] = ()) -> None:
        """Sweep at start and every ``retention_sweep_s``; delete what is due when it is due."""
        while not self._closed:
            try:
                await self.sweep_retention(namespaces)
            except (ApiError, OSError, TimeoutError) as exc:
                log.warning("retention sweep failed (%s); next in %.0f s", exc, self.retention_sweep_s)
            next_sweep = self.clock() + self.retention_sweep_s
            while not self._closed and self.clock() < next_sweep:
                self._retention_wake.clear()
                now = self.clock()
                for key in [k for k, at in self._retention_due.items() if at <= now]:
                    try:
                        await self._expire(*key)
                    except (ApiError, OSError, TimeoutError) as exc:
                        log.warning("%s/%s: retention deletion failed (%s); retried", *key, exc)
                        self._retention_due[key] = now + 30.0
                due = min(self._retention_due.values(), default=next_sweep)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._retention_wake.wait(), max(0.01, min(due, next_sweep) - self.clock())
                    )

    def _watched(self, key: tuple[str, str]) -> bool:
        job = self.jobs.get(key)
        return job is not None and job.workload is not None

    async def sweep_retention(self, namespaces: tuple[str, ...] = ()) -> None:
        """One LIST of StrataJobs (per watched namespace): mark those whose workload is gone, and
        note when each marked one is due."""
        for namespace in namespaces or (None,):
            listing = await self.api.request("GET", path(*STRATAJOBS, namespace))
            for item in (listing or {}).get("items") or []:
                meta = meta_of(item)
                key = (str(meta.get("namespace", "default")), str(meta.get("name")))
                if self._watched(key):
                    continue
                status = item.get("status") or {}
                deleted = parse_time(status.get("workloadDeletedAt"))
                if deleted is None:
                    url = _workload_path(key[0], (item.get("spec") or {}).get("workload") or {})
                    if url is None or await self.api.get(url) is not None or self._watched(key):
                        continue
                    # Gone while no operator watched: the retention counts from now.
                    with contextlib.suppress(ApiError):
                        await self.api.merge_patch(
                            path(*STRATAJOBS, key[0], key[1], "status"),
                            {"status": {"workloadDeletedAt": now_text()}},
                        )
                    deleted = self.clock()
                retention = _retention_of(status)
                if retention is not None:
                    self._retention_due[key] = deleted + retention

    async def _expire(self, namespace: str, name: str) -> None:
        """Delete a job's Checkpoints and its StrataJob if it is still due (marked, past its
        retention, and no workload of that name is back)."""
        key = (namespace, name)
        self._retention_due.pop(key, None)
        if self._watched(key):
            return
        found = await self.api.get(path(*STRATAJOBS, namespace, name))
        if found is None:
            return
        status = found.get("status") or {}
        deleted, retention = parse_time(status.get("workloadDeletedAt")), _retention_of(status)
        if deleted is None or retention is None:
            return
        if self.clock() < deleted + retention:
            self._retention_due[key] = deleted + retention
            return
        url = _workload_path(namespace, (found.get("spec") or {}).get("workload") or {})
        if (url is not None and await self.api.get(url) is not None) or self._watched(key):
            return  # resubmitted: its reconcile clears the mark
        checkpoints = path(names.GROUP, names.VERSION, "checkpoints", namespace)
        listing = await self.api.request(
            "GET", checkpoints, params={"labelSelector": f"{names.JOB_LABEL}={name}"}
        )
        removed = 0
        for item in (listing or {}).get("items") or []:
            removed += await self.api.delete(f"{checkpoints}/{meta_of(item)['name']}")
        meta = meta_of(found)
        try:
            # Preconditions: a resubmission that cleared the mark meanwhile keeps its StrataJob.
            await self.api.delete(
                path(*STRATAJOBS, namespace, name),
                {"preconditions": {"uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")}},
            )
        except ApiError as exc:
            if exc.status != 409:
                raise
            return
        if self.on_expired is not None:
            self.on_expired(namespace, name)
        if self.metrics is not None and hasattr(self.metrics, "retention_deletions"):
            self.metrics.retention_deletions.labels(kind="StrataJob").inc()
            self.metrics.retention_deletions.labels(kind="Checkpoint").inc(removed)
        log.info(
            "%s/%s: retention %s passed since the workload was deleted: "
            "removed the StrataJob and %d Checkpoint(s)",
            namespace,
            name,
            format_retention(retention),
            removed,
        )
