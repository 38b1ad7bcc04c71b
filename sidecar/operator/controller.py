"""The operator's restart protocol: watch opted-in Jobs and their pods, classify failures, restart
the whole gang, and keep the job-level status (a StrataJob) current.

One owner for each thing:
- the Job controller creates pods (gated by the admission logic, so a replacement waits);
- this controller owns the gang generation: it writes ``strata.dev/generation`` on every gated
  pod and lifts the gates only when every pod of the old gang is terminal, or fenced (force-deleted
  after it hung in Terminating past its grace period);
- storage allocates the attempt and the rank-0 sidecar picks the restore step (commit protocol);
  this controller records what the sidecars report.

Decisions live in the StrataJob's status (restarts used, the pending restart and when it may
release, the one-shot rollback applied), so a restarted operator carries on where it stopped.
The pod index comes from the watch, checked against one LIST of the opted-in pods per period (and
soon after kopf lists again: a watch that expired never brings the DELETED events of its gap); a
pod that answers 404 is gone. No other polling: a gang restart costs one eviction and one release
patch per pod, plus a few status writes and Events. A reconcile that fails (a connection reset,
a timeout, 429, 5xx, or anything unexpected) is tried again after a capped exponential backoff
with jitter, never before a Retry-After: no job is left waiting for an event that never comes.

JobSets restart their gangs themselves (``BlockingRecreate``): for them this controller reflects
the restart attempt, classifies failures and records them, and adds no retry layer.

This module holds the inputs (watch events, heartbeats), the loop and the decisions; each part of
a restart lives in a module named for it, a mixin of :class:`Controller`: ``stratajob`` (status,
settings, Events), ``stopping`` (evict, delete, fence), ``release`` (lift the gang gate),
``in_place`` (in-place restarts), ``jobset`` (JobSet mirroring), ``stuck`` (stuck pods and
gangs shown), ``retention`` (StrataJobs and Checkpoints after the workload is gone); ``gang``
holds what is known of a workload and its pods, and ``gates`` the uninstall hook's gate lifting.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from sidecar.coordinator import PERMANENT, Failure, FailureKind, RestartPolicy, RestartTracker
from sidecar.operator import names
from sidecar.operator.admission import opted_in
from sidecar.operator.classify import classify_pod, is_terminal
from sidecar.operator.disruptions import DISRUPTIONS, GangDisruptions
from sidecar.operator.gang import (
    WatchedJob,
    failed_indexes,
    index_of,
    is_gated,
    is_stopping,
    last_failure,
    meta_of,
    now_text,
    owner_uid,
    parse_time,
    without_stale_exits,
)
from sidecar.operator.gates import lift_gates
from sidecar.operator.in_place import InPlaceRestart
from sidecar.operator.inject import Shape, workload_shape
from sidecar.operator.jobset import JobSetMirror
from sidecar.operator.kube import ApiError, path, transient
from sidecar.operator.retention import Lifecycle
from sidecar.operator.stratajob import StrataJobGone
from sidecar.operator.stuck import StuckGangs

__all__ = ["Controller", "lift_gates"]

log = logging.getLogger("strata.operator")

#: lastHeartbeat is written at most this often (each heartbeat would be a write otherwise).
HEARTBEAT_WRITE_S = 60.0
#: A failed reconcile is tried again after RETRY_BASE_S, doubling each time up to RETRY_MAX_S,
#: each delay jittered down to half (jobs that failed together do not retry together); a Retry-After
#: is honoured up to RETRY_AFTER_MAX_S.
RETRY_BASE_S = 0.2
RETRY_MAX_S = 30.0
RETRY_AFTER_MAX_S = 60.0


class Controller(InPlaceRestart, JobSetMirror, GangDisruptions, StuckGangs, Lifecycle):
    """The restart protocol over an :class:`Api`. Feed it watch events (``on_job``, ``on_pod``) and
    heartbeats (``on_heartbeat``); it writes StrataJob status, pods, evictions and Events.

    ``metrics`` is an ``OperatorMetrics`` (or None); ``clock`` is wall time (tests may move it).
    """

    # -- inputs -------------------------------------------------------------------------------------

    def _job(self, namespace: str, name: str) -> WatchedJob:
        key = (namespace, name)
        if key not in self.jobs:
            self.jobs[key] = WatchedJob(namespace, name)
        return self.jobs[key]

    async def on_job(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A Job or JobSet event (kopf's ``on.event``; ``event_type`` None for the initial listing)."""
        if body.get("kind") == "Job" and not opted_in((body.get("spec") or {}).get("template") or {}):
            return
        meta = meta_of(body)
        job = self._job(str(meta.get("namespace", "default")), str(meta["name"]))
        kind = str(body.get("kind", "Job"))
        if job.workload is not None and kind != job.kind and meta.get("uid") != job.uid:
            # A Job and a JobSet may share a name in a namespace: the one watched first is this
            # controller's (admission denies the second where it can); the other is left alone.
            if event_type == "DELETED":
                job.other_kind = None
            else:
                job.other_kind = dict(body)  # taken up once the watched one is deleted
            if event_type != "DELETED" and not job.warned_other_kind:
                job.warned_other_kind = True
                log.warning(
                    "%s/%s: a %s of the same name as the watched %s is ignored (Checkpoints and the "
                    "StrataJob are keyed by name)",
                    job.namespace,
                    job.name,
                    kind,
                    job.kind,
                )
            return
        stale = job.workload is not None and job.uid and meta.get("uid") and meta.get("uid") != job.uid
        if event_type == "DELETED" and stale:
            return  # an earlier incarnation's late event: the watched workload lives on
        if event_type == "DELETED":
            # The StrataJob and the Checkpoints stay: a Job resubmitted under this name finds them.
            # Its pods stay in the index until they are gone: a resubmission waits for them.
            async with job.lock:
                await self._workload_deleted(job)
                if job.timer is not None:
                    job.timer.cancel()
                job.workload = job.status = job.stratajob = job.lost_status = None
                job.warned_other_kind = False
                job.vanished.clear()
                job.warned_earlier_run = job.warned_no_failjob = False
                other, job.other_kind = job.other_kind, None
                self._tidy(job)
            if other is not None:
                await self.on_job("MODIFIED", other)
            return
        job.kind = kind
        job.workload = dict(body)
        self._tidy(job)
        await self.reconcile(job)

    async def on_pod(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """An opted-in pod's event."""
        meta = meta_of(body)
        labels = meta.get("labels") or {}
        owner = labels.get(names.JOBSET_NAME_LABEL) or labels.get(names.JOB_NAME_LABEL)
        if not owner:
            return  # a bare pod: nothing restarts it, nothing to do
        key = (str(meta.get("namespace", "default")), str(owner))
        if event_type == "DELETED" and key not in self.jobs:
            return  # a pod of a job no longer watched (the Job was deleted)
        job = self._job(*key)
        name = str(meta["name"])
        if event_type == "DELETED":
            self._gone(job, name, body)
            if job.workload is None:
                return
        else:
            if event_type is None:
                self.relisted.set()  # listed: after a watch expired, deletions of its gap are unseen
            job.pods[name] = dict(body)
        await self.reconcile(job)

    def _gone(self, job: WatchedJob, name: str, body: Mapping[str, Any] | None = None) -> None:
        """Pod ``name`` no longer exists: its DELETED event, a 404 on a call about it, or absent from
        a list. Dropped from the index; one of the running gang is a failure still (vanished)."""
        last = job.pods.pop(name, None) or dict(body or {})
        uid = meta_of(last).get("uid")
        if uid:
            now = time.monotonic()
            if len(self.tombstones) > 4096:  # without a periodic list to prune them
                self.tombstones = {u: t for u, t in self.tombstones.items() if t > now - 600}
            self.tombstones[str(uid)] = now
        if job.workload is None:
            self._tidy(job)
            return
        generation = (meta_of(last).get("annotations") or {}).get(names.GENERATION_ANNOTATION)
        if (
            job.status is not None
            and generation is not None
            and generation == job.status.get("generation")
            and not is_gated(last)
            and not is_terminal(last)
        ):
            job.vanished[name] = last  # gone before any failure showed: a failure still

    async def resync_pods(self, namespace: str | None = None) -> int:
        """Check the pod index against one LIST of the opted-in pods (of ``namespace``, else of all):
        a pod it holds that the list lacks, and no newer than the list, is gone (as if its DELETED
        event came: a watch that expired and listed again never sends those); a listed pod it lacks
        or holds older is taken. The jobs that changed reconcile. Returns the pods corrected."""
        started = time.monotonic()
        listing = await self.api.request(
            "GET",
            path("", "v1", "pods", namespace),
            params={"labelSelector": f"{names.OPT_IN_LABEL}={names.OPT_IN_VALUE}"},
        )
        listed_at = _version(meta_of(listing or {}).get("resourceVersion"))
        items = [p for p in (listing or {}).get("items") or [] if isinstance(p, dict)]
        present = {(str(meta_of(p).get("namespace")), str(meta_of(p).get("name"))) for p in items}
        changed: dict[tuple[str, str], WatchedJob] = {}
        corrected = 0
        for job in list(self.jobs.values()):
            if namespace is not None and job.namespace != namespace:
                continue
            for name, pod in list(job.pods.items()):
                version = _version(meta_of(pod).get("resourceVersion"))
                # Versions newer than the list (or not comparable) are the watch's to settle.
                if (job.namespace, name) in present or version is None or listed_at is None:
                    continue
                if version > listed_at:
                    continue
                self._gone(job, name)
                changed[job.key] = job
                corrected += 1
        for pod in items:
            meta = meta_of(pod)
            labels = meta.get("labels") or {}
            owner = labels.get(names.JOBSET_NAME_LABEL) or labels.get(names.JOB_NAME_LABEL)
            if not owner or str(meta.get("uid")) in self.tombstones:
                continue  # a bare pod, or one whose deletion this process saw after the list
            key = (str(meta.get("namespace", "default")), str(owner))
            known = self.jobs.get(key)
            stored = known.pods.get(str(meta.get("name"))) if known is not None else None
            newer = (_version(meta.get("resourceVersion")) or 0) > (
                _version(meta_of(stored or {}).get("resourceVersion")) or 0
            )
            if stored is not None and not newer:
                continue
            job = self._job(*key)
            job.pods[str(meta.get("name"))] = pod
            changed[key] = job
            corrected += 1
        # A deletion seen before the list was asked for cannot be in it: no need to remember it.
        self.tombstones = {uid: at for uid, at in self.tombstones.items() if at >= started}
        if changed:
            log.info(
                "the pod list corrected %d pod(s) of the index, of %d job(s): %s",
                corrected,
                len(changed),
                ", ".join(f"{ns}/{name}" for ns, name in sorted(changed)[:5]),
            )
        for job in changed.values():
            await self.reconcile(job)
        return corrected

    async def shape_of(self, namespace: str, pod: Mapping[str, Any]) -> Shape:
        """A pod's world size and rank from its Job or JobSet, for the injection: from the watch
        cache, else one GET (the pod's admission may come before the watch event). Unknown
        (a bare pod, an API error) leaves both to the pod template."""
        labels = meta_of(pod).get("labels") or {}
        jobset = labels.get(names.JOBSET_NAME_LABEL)
        owner = jobset or labels.get(names.JOB_NAME_LABEL)
        if not owner:
            return Shape()
        known = self.jobs.get((namespace, str(owner)))
        workload = known.workload if known is not None else None
        if workload is None:
            url = (
                path(names.JOBSET_API_GROUP, "v1alpha2", "jobsets", namespace, str(owner))
                if jobset
                else path("batch", "v1", "jobs", namespace, str(owner))
            )
            try:
                workload = await asyncio.wait_for(self.api.get(url), timeout=2.0)
            except (TimeoutError, ApiError, OSError, aiohttp.ClientError) as exc:
                log.warning(
                    "%s/%s: world size unknown at admission (%s); template's applies", namespace, owner, exc
                )
                return Shape()
        return workload_shape(workload, pod)

    def _tidy(self, job: WatchedJob) -> None:
        """Drop a job neither watched nor holding pods (its Job was deleted and its pods are gone);
        count the watched ones."""
        if job.workload is None and not job.pods and self.jobs.get(job.key) is job:
            del self.jobs[job.key]
        if self.metrics is not None:
            self.metrics.watched_jobs.set(sum(1 for j in self.jobs.values() if j.workload is not None))

    async def on_heartbeat(self, item: Mapping[str, Any], pod: str | None = None) -> dict[str, Any] | None:
        """A sidecar heartbeat: save progress (for hang detection) and the attempt it runs. Returns
        the instruction the answer to it carries (an in-place restart), or None."""
        job = self.jobs.get((str(item.get("namespace")), str(item.get("job"))))
        if job is None or job.status is None:
            return None
        instruction = self._in_place_answer(job, item, pod)
        if item.get("generation") != job.status.get("generation"):
            return instruction  # a sidecar of an earlier generation, still stopping: not this gang's progress
        rank = int(item.get("rank", 0))
        seen = (item.get("step"), item.get("saves"))
        if job.progress.get(rank) != seen:
            job.progress[rank] = seen
            job.progress_at = self.clock()
        changes: dict[str, Any] = {"lastHeartbeat": now_text()}
        attempt = item.get("attempt")
        newer = isinstance(attempt, int) and attempt >= int(job.status.get("attempt") or 0)
        if newer and (attempt, item.get("restore_step")) != (
            job.status.get("attempt"),
            job.status.get("restoreStep"),
        ):
            changes["attempt"] = attempt
            changes["restoreStep"] = item.get("restore_step")
        stale = self.clock() - job.heartbeat_written > HEARTBEAT_WRITE_S
        if set(changes) - {"lastHeartbeat"} or stale:
            job.heartbeat_written = self.clock()
            try:
                await self._patch_status(job, changes)
            except StrataJobGone:
                self._wake(job, self.clock())  # recreated by the reconcile
                return instruction
        else:
            job.status.update(changes)  # written with the next status change, or within a minute
        return instruction

    def name_taken(self, namespace: str, name: str, kind: str) -> str | None:
        """The kind of the watched workload named ``name`` when it is not ``kind`` (admission denies
        a Job and a JobSet sharing a name: they would share the StrataJob and the Checkpoints)."""
        job = self.jobs.get((namespace, name))
        return job.kind if job is not None and job.workload is not None and job.kind != kind else None

    def workload_uid(self, namespace: str, job_name: str) -> str | None:
        """The uid of the watched Job of that name (report checks compare pods' ownerReferences)."""
        job = self.jobs.get((namespace, job_name))
        return job.uid or None if job is not None and job.workload is not None and job.kind == "Job" else None

    def current_generation(self, namespace: str, job_name: str) -> str | None:
        job = self.jobs.get((namespace, job_name))
        return None if job is None or job.status is None else job.status.get("generation")

    def attempt_of(self, namespace: str, job_name: str) -> tuple[int, int | None] | None:
        """The newest attempt known for a job and the step it restored (report checks use it)."""
        job = self.jobs.get((namespace, job_name))
        if job is None or job.status is None or job.status.get("attempt") is None:
            return None
        return int(job.status["attempt"]), job.status.get("restoreStep")

    async def on_commit(
        self, namespace: str, job_name: str, step: int | None, checkpoint: str | None
    ) -> None:
        """The job's newest Checkpoint changed (a newer commit, or a rollback swept newer ones away)."""
        job = self.jobs.get((namespace, job_name))
        if job is None or job.status is None:
            return
        if (step, checkpoint) != (job.status.get("latestStep"), job.status.get("latestCheckpoint")):
            try:
                await self._patch_status(job, {"latestStep": step, "latestCheckpoint": checkpoint})
            except StrataJobGone:
                self._wake(job, self.clock())  # recreated by the reconcile

    # -- the loop -----------------------------------------------------------------------------------

    async def reconcile(self, job: WatchedJob) -> None:
        """Bring the job's restart forward from what is known now. Never raises: whatever fails is
        tried again later (``_retry_later``), so no job waits for an event that never comes."""
        if self._closed:
            return
        async with job.lock:
            if self._closed:
                return
            if self.clock() < job.hold_until:
                self._wake(job, job.hold_until)  # backing off: events meanwhile only fed the index
                return
            for tries in (1, 2):
                try:
                    await self._reconcile(job)
                except StrataJobGone as exc:
                    if tries == 1:
                        continue  # deleted under the live workload: recreated at once
                    self._retry_later(job, exc)
                except Exception as exc:  # every failure is retried: never a job left dead
                    self._retry_later(job, exc)
                else:
                    job.retries = 0
                break

    def _retry_later(self, job: WatchedJob, exc: Exception) -> None:
        """Reconcile ``job`` again after a capped exponential backoff with jitter, no earlier than
        the Retry-After the apiserver asked for (429 from API Priority and Fairness, 503)."""
        if self._closed:
            return
        if self.metrics is not None:
            self.metrics.reconcile_errors.inc()
        job.retries += 1
        delay = min(RETRY_MAX_S, RETRY_BASE_S * 2 ** min(job.retries - 1, 16)) * self.rng.uniform(0.5, 1.0)
        hint = exc.retry_after if isinstance(exc, ApiError) else None
        if hint is not None:
            delay = max(delay, min(hint, RETRY_AFTER_MAX_S) * self.rng.uniform(1.0, 1.2))
        job.hold_until = self.clock() + delay
        where = f"{job.namespace}/{job.name}"
        if isinstance(exc, ApiError) or transient(exc):
            # repr: a reset (ServerDisconnectedError) or a timeout has no message of its own
            what = str(exc) if isinstance(exc, ApiError) else repr(exc)
            log.warning("%s: reconcile failed (%s); retrying in %.1f s", where, what, delay)
        else:
            log.error("%s: reconcile failed unexpectedly; retrying in %.1f s", where, delay, exc_info=exc)
        self._wake(job, job.hold_until)

    async def refresh_report_ca(self, bundle: str) -> int:
        """Write the current CA bundle into every live pod that carries an older one in
        ``strata.dev/report-ca`` (the injection wrote it at admission): the kubelet updates the
        downward-API file and the sidecar re-reads it, so a CA rotation or a cert-manager renewal
        never cuts a running sidecar off the report endpoint. Returns the pods patched."""
        patched = 0
        if not bundle:
            return 0
        for job in list(self.jobs.values()):
            for pod in list(job.pods.values()):
                meta = meta_of(pod)
                held = (meta.get("annotations") or {}).get(names.REPORT_CA_ANNOTATION)
                if held is None or held == bundle or is_terminal(pod) or meta.get("deletionTimestamp"):
                    continue
                url = path("", "v1", "pods", job.namespace, str(meta.get("name")))
                try:
                    await self.api.merge_patch(
                        url, {"metadata": {"annotations": {names.REPORT_CA_ANNOTATION: bundle}}}
                    )
                except ApiError as exc:
                    if exc.status != 404:
                        log.warning(
                            "could not refresh the report CA of pod %s/%s: %s",
                            job.namespace,
                            meta.get("name"),
                            exc,
                        )
                    continue
                pod.setdefault("metadata", {}).setdefault("annotations", {})[names.REPORT_CA_ANNOTATION] = (
                    bundle
                )
                patched += 1
        if patched:
            log.info("refreshed the report CA bundle of %d running pod(s)", patched)
        return patched

    def close(self) -> None:
        """Stop scheduling work (the operator is stopping)."""
        self._closed = True
        for job in self.jobs.values():
            if job.timer is not None:
                job.timer.cancel()
                job.timer = None

    def _wake(self, job: WatchedJob, at: float) -> None:
        """Reconcile ``job`` again at wall time ``at`` (the earliest wins)."""
        if self._closed:
            return
        if job.timer is not None and job.timer_at <= at and not job.timer.cancelled():
            return
        if job.timer is not None:
            job.timer.cancel()
        loop = asyncio.get_running_loop()
        job.timer_at = at
        job.timer = loop.call_later(max(0.0, at - self.clock()), self._fire, job)

    def _fire(self, job: WatchedJob) -> None:
        job.timer = None
        if self.jobs.get(job.key) is job:
            task = asyncio.ensure_future(self.reconcile(job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _reconcile(self, job: WatchedJob) -> None:
        if job.workload is None:
            return  # pods seen before their Job: wait for it
        if job.status is None:
            await self._load(job)
        assert job.status is not None
        await self._check_settings(job)
        await self._check_lifecycle(job)
        await self._check_stuck(job)
        if job.kind == "JobSet":
            await self._reflect_jobset(job)
            return
        phase = job.status.get("phase")
        if phase == "Succeeded":
            return
        pods = self._own_pods(job)
        if phase == "Failed":  # for good: what the Job controller still creates is released to stop
            await self._stop_pods(job, [p for p in pods if not is_gated(p) and not is_stopping(p)])
            await self._release_to_stop(job, pods)
            return
        ended = self._workload_ended(job)
        if ended is not None:
            # The Job itself completed or failed (its own policy, a deadline): nothing to restart.
            phase_now = "Succeeded" if ended == "Complete" else "Failed"
            given_up = failed_indexes(job.workload)
            why = f" (failed indexes: {', '.join(map(str, given_up))})" if given_up else ""
            await self._patch_status(
                job,
                {"phase": phase_now, "pendingRestart": None},
                condition=(phase_now, "True", f"Job{ended}", f"the {job.kind} reports {ended}{why}"),
            )
            return
        if await self._suspension(job):
            return  # suspended (Kueue): its pods go away on purpose; or resumed: restarted here
        if await self._index_given_up(job, pods):
            return
        pending = job.status.get("pendingRestart")
        if pending:
            await self._restart(job, pods, pending)
            return
        current = job.status.get("generation")
        released = [p for p in pods if not is_gated(p)]
        running = [
            p
            for p in released
            if (meta_of(p).get("annotations") or {}).get(names.GENERATION_ANNOTATION) == current
        ]
        if current is None:
            if await self._earlier_run_gone(job):
                await self._release(job, pods, job.generation(0), first=True)
            return
        found = self._failure(job, running) or self._vanished(job, pods, running)
        if found is not None and await self._suspended_meanwhile(job, found[1]):
            return
        if found is not None:
            await self._decide(job, found[0], running, found[1])
            return
        done = {index_of(p) for p in running if (p.get("status") or {}).get("phase") == "Succeeded"}
        if running and len(done) >= job.world:
            await self._patch_status(
                job,
                {"phase": "Succeeded"},
                condition=("Succeeded", "True", "Completed", f"all {job.world} ranks succeeded"),
            )
            return
        if job.settings.hang_timeout > 0 and phase == "Running":
            # From the newest progress, the release, or this operator's first sight of the job
            # (progress seen by an earlier operator process is not known here).
            started = max(
                job.progress_at, job.seen_at, parse_time(job.status.get("generationStartedAt")) or 0.0
            )
            deadline = started + job.settings.hang_timeout
            if self.clock() >= deadline:
                await self._decide(
                    job,
                    Failure(
                        FailureKind.HANG,
                        detail="no sidecar heartbeat showed save progress for "
                        f"{job.settings.hang_timeout:g} s",
                    ),
                    running,
                )
            else:
                self._wake(job, deadline)

    # -- state --------------------------------------------------------------------------------------

    # -- decisions ----------------------------------------------------------------------------------

    def _failure(self, job: WatchedJob, running: list[dict[str, Any]]) -> tuple[Failure, str] | None:
        """The failure to act on, and its pod: the first cause wins (a pod the node lost or evicted
        beats the peers that died after it)."""
        found: list[tuple[Failure, str]] = []
        status = job.status or {}
        since = (
            parse_time(status.get("generationStartedAt")) if status.get("restartMode") == "in-place" else None
        )
        for pod in running:
            if (pod.get("status") or {}).get("phase") == "Succeeded":
                continue
            failure = classify_pod(without_stale_exits(pod, since), container=self.trainer_container)
            if failure is not None:
                found.append((failure, str(meta_of(pod).get("name", ""))))
        order = [FailureKind.LOST, FailureKind.EVICTED, FailureKind.OOM, FailureKind.DELETED]
        found.sort(key=lambda f: order.index(f[0].kind) if f[0].kind in order else len(order))
        return found[0] if found else None

    async def _world_size_failure(self, job: WatchedJob, tracker: RestartTracker) -> Failure | None:
        """A CONFIG failure when the job's newest Checkpoint was saved by another number of ranks
        than the gang has and cannot be resharded (one LIST of the job's Checkpoints); None when
        it fits, is reshardable (saved through DCP), or cannot be read."""
        try:
            listing = await self.api.request(
                "GET",
                path(names.GROUP, names.VERSION, "checkpoints", job.namespace),
                params={"labelSelector": f"{names.JOB_LABEL}={job.name},{names.LATEST_LABEL}=true"},
            )
        except ApiError as exc:
            log.info(
                "%s/%s: newest Checkpoint unreadable (%s); world size not checked",
                job.namespace,
                job.name,
                exc,
            )
            return None
        return world_size_failure(job.world, (listing or {}).get("items") or [], tracker)

    async def _decide(
        self, job: WatchedJob, failure: Failure, running: list[dict[str, Any]], pod: str = ""
    ) -> None:
        assert job.status is not None
        settings = job.settings
        policy = RestartPolicy(
            max_restarts=settings.max_restarts,
            backoff_s=settings.backoff_seconds,
            backoff_max_s=max(settings.backoff_max_seconds, settings.backoff_seconds),
        )
        tracker = RestartTracker(
            policy, job.world, restarts=int(job.status.get("restarts") or 0), rng=self.rng
        )
        done = sorted(
            {str(index_of(p)) for p in running if (p.get("status") or {}).get("phase") == "Succeeded"}
        )
        if done:
            # The Job controller never re-creates a succeeded index, so no whole gang can start again.
            failure = Failure(
                FailureKind.CONFIG,
                failure.rank,
                failure.exit_code,
                failure.signal,
                f"{failure.describe()}, after index(es) {', '.join(done)} had succeeded: "
                "a gang restart cannot bring completed indexes back",
            )
        elif failure.kind not in PERMANENT:
            # Trainers that cannot restore the newest checkpoint (saved by another number of ranks,
            # and not reshardable) fail again after any restart: a permanent failure.
            changed = await self._world_size_failure(job, tracker)
            if changed is not None:
                failure = Failure(
                    FailureKind.CONFIG,
                    failure.rank,
                    failure.exit_code,
                    failure.signal,
                    f"{failure.describe()}, and {changed.detail}",
                )
        if failure.kind in DISRUPTIONS:
            await self._disrupted(job, failure, running, pod)
            return
        decision = tracker.decide(failure)
        last = last_failure(failure, pod)
        self.decisions.append((job.name, time.monotonic()))
        if not decision.restart:
            reason = "NotRestartable" if failure.kind in PERMANENT else "RestartLimitReached"
            if self.metrics is not None:
                self.metrics.jobs_failed.labels(reason=reason).inc()
            await self._patch_status(
                job,
                {"phase": "Failed", "lastFailure": last},
                condition=("Failed", "True", reason, decision.message),
            )
            await self._event(
                job,
                reason,
                f"{decision.message}; once the gang has stopped, its replacements are released only so "
                f"that their trainers exit {names.EXIT_LIMIT_SPENT} (podFailurePolicy FailJob ends the Job)",
                warning=True,
                on_workload=True,
            )
            await self._stop_pods(job, running)
            return
        if self.metrics is not None:
            self.metrics.restarts.labels(reason=decision.reason).inc()
        now = self.clock()
        pending = {
            "generation": job.generation(job.restart_count + 1),
            "decidedAt": now_text(),
            "notBefore": datetime.datetime.fromtimestamp(now + decision.delay_s, tz=datetime.UTC).strftime(
                "%Y-%m-%dT%H:%M:%S.%fZ"
            ),
            "reason": decision.reason,
            "mode": "in-place" if self._in_place_kind(job, failure) else "pod",
        }
        await self._patch_status(
            job,
            {
                "phase": "Restarting",
                "restarts": tracker.restarts,
                "pendingRestart": pending,
                "lastFailure": last,
            },
            condition=("Restarting", "True", decision.reason, decision.message),
        )
        await self._event(job, "GangRestart", decision.message, warning=True, on_workload=True)
        await self._restart(job, self._own_pods(job), pending)

    async def _restart(self, job: WatchedJob, pods: list[dict[str, Any]], pending: Mapping[str, Any]) -> None:
        """Drive a decided gang restart: stop the old gang, fence what hangs, release the new one."""
        if pending.get("mode") == "in-place":
            await self._restart_in_place(job, pods, pending)
            return
        target = str(pending["generation"])
        old = [
            p
            for p in pods
            if not is_gated(p)
            and (meta_of(p).get("annotations") or {}).get(names.GENERATION_ANNOTATION) != target
        ]
        await self._stop_pods(job, old)
        if not await self._wait_gone(job, old):
            return  # the watch brings their end (or a timer, to fence one stuck Terminating)
        not_before = parse_time(str(pending.get("notBefore"))) or 0.0
        if self.clock() < not_before:
            self._wake(job, not_before)
            return
        await self._release(job, pods, target, first=False)

    # -- in-place restarts ---------------------------------------------------------------------------

    def _own_pods(self, job: WatchedJob) -> list[dict[str, Any]]:
        """Pods this Job controls (not those of an earlier Job of the same name)."""
        return [p for p in job.pods.values() if owner_uid(p) == job.uid]

    def _vanished(
        self, job: WatchedJob, pods: list[dict[str, Any]], running: list[dict[str, Any]]
    ) -> tuple[Failure, str] | None:
        """A pod of the current generation that is gone without a failure showing: its DELETED event
        came first, or (after an operator restart) its index has only a gated replacement, which the
        Job controller creates only once the pod it replaces failed or went away."""
        for name, pod in sorted(job.vanished.items()):
            shown = classify_pod(pod, container=self.trainer_container)
            if shown is not None and shown.kind in DISRUPTIONS:
                return shown, name  # e.g. the pod GC's DisruptionTarget, then its force delete
            return Failure(
                FailureKind.DELETED, index_of(pod), detail=f"pod {name} disappeared while it ran"
            ), name
        live = {index_of(p) for p in running if not is_terminal(p)}
        started = (job.status or {}).get("generationStartedAt") or ""
        for pod in pods:
            index = index_of(pod)
            meta = meta_of(pod)
            replacement = (
                is_gated(pod)
                and str(meta.get("uid")) not in job.released_uids
                and str(meta.get("creationTimestamp") or "") >= started  # RFC 3339 UTC: orders as text
            )
            if replacement and index is not None and index not in live:
                return (
                    Failure(
                        FailureKind.DELETED,
                        index,
                        detail=f"the pod of index {index} is gone "
                        f"(its replacement {meta_of(pod).get('name')} waits)",
                    ),
                    "",
                )
        return None

    def _workload_ended(self, job: WatchedJob) -> str | None:
        """ "Complete" or "Failed" when the Job controller says the Job ended, else None."""
        for condition in ((job.workload or {}).get("status") or {}).get("conditions") or []:
            if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
                return str(condition["type"])
        return None

    # -- JobSet -------------------------------------------------------------------------------------


def _version(value: Any) -> int | None:
    """A resourceVersion as a number (etcd's revision), None where it is not one."""
    text = str(value or "")
    return int(text) if text.isdigit() else None


def world_size_failure(
    world: int, checkpoints: list[Mapping[str, Any]], tracker: RestartTracker | None = None
) -> Failure | None:
    """The shared world-size decision (``RestartTracker.check_world_size``) for the newest of
    ``checkpoints`` (Checkpoint objects): None when there is none, when it was saved by ``world``
    ranks, or when it is reshardable (``spec.reshardable``: saved through DCP)."""
    newest: Mapping[str, Any] | None = None
    for item in checkpoints:
        spec = item.get("spec") or {}
        if isinstance(spec.get("step"), int) and (newest is None or spec["step"] > newest["step"]):
            newest = spec
    if newest is None or not isinstance(newest.get("worldSize"), int):
        return None
    tracker = tracker or RestartTracker(RestartPolicy(), world)
    return tracker.check_world_size(
        world, newest["worldSize"], newest.get("reshardable") is True, keep="the gang at {n} ranks"
    )
