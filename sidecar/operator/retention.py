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

A sweep LISTs the StrataJobs at start and every ``retention_sweep_s`` (hourly), and the Jobs and
JobSets of each namespace that has unwatched ones: it marks those whose name no workload holds any
more (gone while no operator watched), and finds the due ones; deletions in between are timed from
the watch's DELETED events. The name is the StrataJob's own (Checkpoints are keyed by it), and either
kind holding it keeps the data: a workload resubmitted as the other kind resumes from it. An expiry
deletes the StrataJob first (preconditions: a resubmission that cleared the mark keeps it), looks
again, and only then deletes the Checkpoints created before the workload's deletion.

The sweep also LISTs the Checkpoints: those of a name that has neither a StrataJob nor a workload
(left by an operator stopped between those two deletions, or a StrataJob deleted by hand) are
deleted once older than ``orphan_grace_s`` (a new job's first Checkpoint may precede its StrataJob).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from sidecar.operator import names
from sidecar.operator.annotations import format_retention, parse_retention
from sidecar.operator.gang import WatchedJob, meta_of, now_text, parse_time
from sidecar.operator.kube import ApiError, path, transient
from sidecar.operator.stratajob import STRATAJOBS, StrataJobGone, StrataJobStatus

__all__ = ["DEFAULT_RETENTION", "Lifecycle", "format_retention", "parse_retention"]

log = logging.getLogger("strata.operator")

DEFAULT_RETENTION = "168h"
#: How often every StrataJob is looked at (deletions seen by the watch are timed on their own).
DEFAULT_RETENTION_SWEEP_S = 3600.0
#: Checkpoints younger than this are never orphans: a new job's first one may precede its StrataJob.
DEFAULT_ORPHAN_GRACE_S = 600.0
#: Items per page of the sweep's LISTs.
_PAGE = 500


def _retention_of(status: Mapping[str, Any]) -> float | None:
    try:
        return parse_retention(str(status.get("retention") or DEFAULT_RETENTION))
    except ValueError:
        return parse_retention(DEFAULT_RETENTION)


def _kinds(namespace: str) -> tuple[tuple[str, str], ...]:
    """(kind, collection URL) of the workloads a StrataJob's name may belong to."""
    return (
        ("Job", path("batch", "v1", "jobs", namespace)),
        ("JobSet", path(names.JOBSET_API_GROUP, "v1alpha2", "jobsets", namespace)),
    )


def _log_failure(exc: BaseException, what: str, then: str) -> None:
    """A transient failure in one line; anything else with its traceback (a bug to see)."""
    if transient(exc) or isinstance(exc, ApiError):
        log.warning("%s (%r); %s", what, exc, then)
    else:
        log.error("%s unexpectedly; %s", what, then, exc_info=exc)


class Lifecycle(StrataJobStatus):
    """Retention after the workload is gone, and owner references where asked for."""

    def __init__(
        self,
        api: Any,
        *,
        retention_sweep_s: float = DEFAULT_RETENTION_SWEEP_S,
        orphan_grace_s: float = DEFAULT_ORPHAN_GRACE_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(api, **kwargs)
        self.retention_sweep_s = retention_sweep_s
        self.orphan_grace_s = orphan_grace_s
        #: Called with (namespace, job) when its objects were deleted (the Checkpoint writer forgets it).
        self.on_expired: Callable[[str, str], None] | None = None
        #: (namespace, name) -> wall time its StrataJob is due for deletion.
        self._retention_due: dict[tuple[str, str], float] = {}
        self._retention_wake = asyncio.Event()
        #: (namespace, name) -> the workload's deletion time, for a job whose StrataJob is deleted
        #: and whose Checkpoints (created before it) are not all deleted yet.
        self._orphaned: dict[tuple[str, str], float] = {}
        #: (namespace, name) -> (workload uid, owned) whose owner references are in place.
        self._owned: dict[tuple[str, str], tuple[str, bool]] = {}

    # -- while the workload exists ------------------------------------------------------------------

    def owner_references(self, namespace: str, job_name: str) -> list[dict[str, Any]] | None:
        """The ownerReferences a Checkpoint of this job gets (None: not asked for)."""
        job = self.jobs.get((namespace, job_name))
        if job is None or job.workload is None or not job.settings.owned_by_workload or not job.uid:
            return None
        return [self._owner_reference(job)]

    async def _delete_checkpoints(self, namespace: str, name: str, before: float) -> int:
        """Delete the job's Checkpoints created no later than ``before`` (the workload's deletion:
        a later one was written by a resubmission), each with its uid as precondition."""
        checkpoints = path(names.GROUP, names.VERSION, "checkpoints", namespace)
        removed = 0
        async for item in self._list(checkpoints, labelSelector=f"{names.JOB_LABEL}={name}"):
            meta = meta_of(item)
            created = parse_time(meta.get("creationTimestamp"))
            if created is not None and created > before:
                continue
            body = {"preconditions": {"uid": meta["uid"]}} if meta.get("uid") else None
            try:
                removed += await self.api.delete(f"{checkpoints}/{meta['name']}", body)
            except ApiError as exc:
                if exc.status != 409:  # 409: replaced by a newer object of that name
                    raise
        return removed

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
            except StrataJobGone:
                raise
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
            updated = await self._write(
                job, self._stratajob_path(job), {"metadata": {"ownerReferences": wanted or None}}
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
        """Sweep at start and every ``retention_sweep_s``; delete what is due when it is due. Never
        ends on an error (a reset connection, an unexpected answer): the next round tries again."""
        while not self._closed:
            try:
                await self.sweep_retention(namespaces)
            except Exception as exc:  # the loop must outlive any failure, or nothing expires again
                _log_failure(exc, "retention sweep failed", f"next in {self.retention_sweep_s:.0f} s")
            next_sweep = self.clock() + self.retention_sweep_s
            while not self._closed and self.clock() < next_sweep:
                self._retention_wake.clear()
                now = self.clock()
                for key in [k for k, at in self._retention_due.items() if at <= now]:
                    try:
                        await self._expire(*key)
                    except Exception as exc:
                        _log_failure(exc, f"{key[0]}/{key[1]}: retention deletion failed", "retried")
                        self._retention_due[key] = now + 30.0
                due = min(self._retention_due.values(), default=next_sweep)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._retention_wake.wait(), max(0.01, min(due, next_sweep) - self.clock())
                    )

    def _watched(self, key: tuple[str, str]) -> bool:
        job = self.jobs.get(key)
        return job is not None and job.workload is not None

    async def _list(self, url: str, **params: str) -> AsyncIterator[dict[str, Any]]:
        """Every item of a LIST, page by page (``limit``/``continue``): thousands of objects never
        come in one answer."""
        token = ""
        while True:
            query = {**params, "limit": str(_PAGE)}
            if token:
                query["continue"] = token
            page = await self.api.request("GET", url, params=query)
            for item in (page or {}).get("items") or []:
                if isinstance(item, dict):
                    yield item
            token = str(meta_of(page or {}).get("continue") or "")
            if not token:
                return

    async def _names_in_use(self, namespace: str) -> tuple[set[str], frozenset[str]]:
        """The names of every Job and JobSet in ``namespace`` (one paginated LIST per kind), and
        the kinds that could not be listed: 403 (the operator's Role lacks them, so it watches
        none of them either). A kind the apiserver does not serve (404: no JobSet CRD) has none."""
        found: set[str] = set()
        unknown: set[str] = set()
        for kind, url in _kinds(namespace):
            try:
                found.update([str(meta_of(item).get("name")) async for item in self._list(url)])
            except ApiError as exc:
                if exc.status == 403:
                    unknown.add(kind)
                elif exc.status != 404:
                    raise
        return found, frozenset(unknown)

    async def _name_in_use(self, namespace: str, name: str, kind: str | None) -> bool:
        """Whether a Job or a JobSet named ``name`` exists (Checkpoints are keyed by name only: a
        workload resubmitted as another kind resumes from them too), or is watched. A recorded
        ``kind`` (None: unknown, any kind) the operator may not read counts as in use: nothing is
        deleted on a guess."""
        if self._watched((namespace, name)):
            return True
        for each, url in _kinds(namespace):
            try:
                if await self.api.get(f"{url}/{name}") is not None:
                    return True
            except ApiError as exc:
                if exc.status == 403 and kind in (each, None):
                    return True
                if exc.status not in (403, 404):
                    raise
        return self._watched((namespace, name))

    async def sweep_retention(self, namespaces: tuple[str, ...] = ()) -> None:
        """Paginated LISTs of StrataJobs (per watched namespace) and one of Jobs and of JobSets per
        namespace that has candidates: mark those whose workload name is no longer in use, and note
        when each marked one is due. The name checked is the StrataJob's own (``metadata.name``),
        never the user-editable ``spec.workload.name``. A namespace that cannot be checked is left
        for the next sweep; the others go on."""
        candidates: dict[str, list[dict[str, Any]]] = {}
        stratajobs: set[tuple[str, str]] = set()
        for namespace in namespaces or (None,):
            async for item in self._list(path(*STRATAJOBS, namespace)):
                meta = meta_of(item)
                key = (str(meta.get("namespace", "default")), str(meta.get("name")))
                stratajobs.add(key)
                if not self._watched(key):
                    candidates.setdefault(key[0], []).append(item)
        orphans = await self._orphan_checkpoints(namespaces, stratajobs)
        for namespace in {**candidates, **orphans}:
            try:
                in_use, unreadable = await self._names_in_use(namespace)
            except Exception as exc:
                _log_failure(
                    exc, f"{namespace}: workloads not listed", "its StrataJobs wait for the next sweep"
                )
                continue
            for name, checkpoints in orphans.get(namespace, {}).items():
                # Any kind unreadable: the name may be a workload the operator cannot see.
                if name in in_use or unreadable or self._watched((namespace, name)):
                    continue
                try:
                    await self._delete_orphans(namespace, name, checkpoints)
                except Exception as exc:
                    _log_failure(exc, f"{namespace}/{name}: orphaned Checkpoints not deleted", "next sweep")
            items = candidates.get(namespace, [])
            for item in items:
                name = str(meta_of(item).get("name"))
                kind = str(((item.get("spec") or {}).get("workload") or {}).get("kind") or "Job")
                if name in in_use or kind in unreadable or self._watched((namespace, name)):
                    continue
                status = item.get("status") or {}
                deleted = parse_time(status.get("workloadDeletedAt"))
                if deleted is None:
                    # Gone while no operator watched: the retention counts from now.
                    try:
                        await self.api.merge_patch(
                            path(*STRATAJOBS, namespace, name, "status"),
                            {"status": {"workloadDeletedAt": now_text()}},
                        )
                    except Exception as exc:
                        _log_failure(exc, f"{namespace}/{name}: deletion not recorded", "next sweep")
                        continue
                    deleted = self.clock()
                retention = _retention_of(status)
                if retention is not None:
                    self._retention_due[(namespace, name)] = deleted + retention

    async def _orphan_checkpoints(
        self, namespaces: tuple[str, ...], stratajobs: set[tuple[str, str]]
    ) -> dict[str, dict[str, list[dict[str, Any]]]]:
        """namespace -> job name -> its Checkpoints, for names without a StrataJob (paginated LISTs,
        label ``strata.dev/job``), older than the grace. A failed LIST finds none this round."""
        found: dict[str, dict[str, list[dict[str, Any]]]] = {}
        oldest = self.clock() - self.orphan_grace_s
        for namespace in namespaces or (None,):
            url = path(names.GROUP, names.VERSION, "checkpoints", namespace)
            try:
                async for item in self._list(url, labelSelector=names.JOB_LABEL):
                    meta = meta_of(item)
                    key = (
                        str(meta.get("namespace", "default")),
                        str((meta.get("labels") or {}).get(names.JOB_LABEL)),
                    )
                    created = parse_time(meta.get("creationTimestamp"))
                    if key in stratajobs or self._watched(key) or created is None or created > oldest:
                        continue
                    found.setdefault(key[0], {}).setdefault(key[1], []).append(item)
            except Exception as exc:
                _log_failure(exc, f"{namespace or 'all namespaces'}: Checkpoints not listed", "next sweep")
        return found

    async def _delete_orphans(self, namespace: str, name: str, checkpoints: list[dict[str, Any]]) -> None:
        """Delete Checkpoints whose job has no StrataJob and no workload, looking once more first
        (a resubmission since the LISTs resumes from them), each with its uid as precondition."""
        if await self._name_in_use(namespace, name, None):
            return
        if await self.api.get(path(*STRATAJOBS, namespace, name)) is not None:
            return  # a StrataJob since the LIST: the retention rule decides
        url = path(names.GROUP, names.VERSION, "checkpoints", namespace)
        removed = 0
        for item in checkpoints:
            meta = meta_of(item)
            body = {"preconditions": {"uid": meta["uid"]}} if meta.get("uid") else None
            try:
                removed += await self.api.delete(f"{url}/{meta['name']}", body)
            except ApiError as exc:
                if exc.status != 409:  # 409: replaced by a newer object of that name
                    raise
        self._orphaned.pop((namespace, name), None)
        if self.on_expired is not None:
            self.on_expired(namespace, name)
        if self.metrics is not None and hasattr(self.metrics, "retention_deletions"):
            self.metrics.retention_deletions.labels(kind="Checkpoint").inc(removed)
        log.info(
            "%s/%s: removed %d Checkpoint(s) with neither a StrataJob nor a workload of that name",
            namespace,
            name,
            removed,
        )

    async def _expire(self, namespace: str, name: str) -> None:
        """Delete a job's Checkpoints and its StrataJob if it is still due (marked, past its
        retention, and no workload of that name is back)."""
        key = (namespace, name)
        self._retention_due.pop(key, None)
        if self._watched(key):
            return
        found = await self.api.get(path(*STRATAJOBS, namespace, name))
        if found is None:
            if key in self._orphaned and not await self._name_in_use(namespace, name, "Job"):
                await self._delete_checkpoints(namespace, name, self._orphaned[key])
            self._orphaned.pop(key, None)
            return
        status = found.get("status") or {}
        deleted, retention = parse_time(status.get("workloadDeletedAt")), _retention_of(status)
        if deleted is None or retention is None:
            return
        if self.clock() < deleted + retention:
            self._retention_due[key] = deleted + retention
            return
        kind = str(((found.get("spec") or {}).get("workload") or {}).get("kind") or "Job")
        if await self._name_in_use(namespace, name, kind):
            return  # resubmitted: its reconcile clears the mark
        meta = meta_of(found)
        try:
            # First the StrataJob, with preconditions: a resubmission that cleared the mark
            # meanwhile keeps it (409), and one landing after this delete finds none and starts one.
            await self.api.delete(
                path(*STRATAJOBS, namespace, name),
                {"preconditions": {"uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")}},
            )
        except ApiError as exc:
            if exc.status != 409:
                raise
            return
        if await self._name_in_use(namespace, name, kind):
            # Resubmitted between the check and the delete: its Checkpoints are what it resumes from.
            log.info("%s/%s: resubmitted while its retention expired; its Checkpoints stay", namespace, name)
            return
        self._orphaned[key] = deleted  # a failure below is retried without the StrataJob
        removed = await self._delete_checkpoints(namespace, name, deleted)
        self._orphaned.pop(key, None)
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
