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
The pod index comes from the watch: no list calls, no polling; a gang restart costs one eviction
and one release patch per pod, plus a few status writes and Events.

JobSets restart their gangs themselves (``BlockingRecreate``): for them this controller reflects
the restart attempt, classifies failures and records them, and adds no retry layer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from sidecar.api import EXIT_RESTART_IN_PLACE
from sidecar.coordinator import PERMANENT, Failure, FailureKind, RestartPolicy, RestartTracker
from sidecar.operator import annotations as table
from sidecar.operator import names, objects
from sidecar.operator.admission import opted_in
from sidecar.operator.classify import classify_pod, is_terminal
from sidecar.operator.inject import Shape, workload_shape
from sidecar.operator.kube import Api, ApiError, path

__all__ = ["Controller", "lift_gates"]

log = logging.getLogger("strata.operator")

STRATAJOBS = ("strata.dev", "v1alpha1", "stratajobs")
#: lastHeartbeat is written at most this often (each heartbeat would be a write otherwise).
HEARTBEAT_WRITE_S = 60.0
#: lastFailure.reason (CamelCase, as Kubernetes reasons are) for each failure kind.
REASONS = {
    FailureKind.EXIT_ERROR: "ExitError",
    FailureKind.SIGNAL: "Signal",
    FailureKind.OOM: "OOMKilled",
    FailureKind.LOST: "NodeLost",
    FailureKind.HANG: "Hang",
    FailureKind.EVICTED: "Evicted",
    FailureKind.DELETED: "PodDeleted",
    FailureKind.CONFIG: "InvalidConfig",
}
#: How long past its grace period a Terminating pod may hang before it is fenced (force-deleted).
DEFAULT_FENCE_MARGIN_S = 30.0
#: How long an in-place restart waits for every rank's sidecar to acknowledge the instruction (at
#: its next heartbeat, 10 s apart by default) before the pod-level restart takes over.
DEFAULT_IN_PLACE_TIMEOUT_S = 60.0
#: Failure kinds an in-place restart may answer: the trainer crashed, raised or hung, and its pod,
#: sidecar and memory are intact. A pod or node lost, an eviction or a deletion need new pods.
IN_PLACE_KINDS = frozenset({FailureKind.EXIT_ERROR, FailureKind.SIGNAL, FailureKind.OOM, FailureKind.HANG})


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _gated(pod: Mapping[str, Any]) -> bool:
    return any(g.get("name") == names.GANG_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])


def _stopping(pod: Mapping[str, Any]) -> bool:
    """Released with the restore request "stop" (the restart limit is spent)."""
    return (_meta(pod).get("annotations") or {}).get(names.RESTORE_REQUEST_ANNOTATION) == names.STOP_REQUEST


def _since(pod: Mapping[str, Any], since: float | None) -> dict[str, Any]:
    """``pod`` without the container terminations that are no failure of the gang that runs now:
    exits with EXIT_RESTART_IN_PLACE (the operator asked for them), and, after an in-place restart
    (``since``: when it was released), terminations that finished before it (the failure it
    answered, and old trainers ending meanwhile: the pod keeps showing that as the last state)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []

    def stale(state: Mapping[str, Any] | None) -> bool:
        if not state:
            return False
        if state.get("exitCode") == EXIT_RESTART_IN_PLACE:
            return True
        finished = _parse_time(state.get("finishedAt"))
        # <=: both are whole seconds, and the trainers restarted after the release take longer
        return since is not None and finished is not None and finished <= since

    kept = []
    changed = False
    for status in statuses:
        status = dict(status)
        for key in ("state", "lastState"):
            state = dict(status.get(key) or {})
            if stale(state.get("terminated")):
                state.pop("terminated")
                status[key] = state
                changed = True
        kept.append(status)
    if not changed:
        return dict(pod)
    return {**pod, "status": {**(pod.get("status") or {}), "containerStatuses": kept}}


def _next_generation(generation: str) -> str:
    run, _, restart = generation.rpartition("/")
    return f"{run}/{int(restart) + 1}" if restart.isdigit() else generation


def _index(pod: Mapping[str, Any]) -> int | None:
    raw = (_meta(pod).get("labels") or {}).get(names.JOB_INDEX_LABEL)
    return int(raw) if raw is not None and str(raw).isdigit() else None


def _owner_uid(pod: Mapping[str, Any]) -> str | None:
    for ref in _meta(pod).get("ownerReferences") or []:
        if ref.get("kind") == "Job" and ref.get("controller"):
            return str(ref.get("uid"))
    return None


def _run_id(uid: str, kind: str = "Job") -> str:
    """A run's identity from its workload's uid (a resubmitted Job gets a new uid, so a new run).
    A JobSet's is its whole uid: its pods' sidecars compose the generation from their labels
    (``jobset-uid``/``restart-attempt``, see inject.py), which cannot shorten it."""
    if kind == "JobSet":
        return uid or "run"
    return uid.replace("-", "")[:12] or "run"


@dataclasses.dataclass
class _Job:
    """What the controller knows about one watched workload."""

    namespace: str
    name: str
    kind: str = "Job"
    workload: dict[str, Any] | None = None
    pods: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    status: dict[str, Any] | None = None  # the StrataJob's status, once loaded
    stratajob: dict[str, Any] | None = None  # its metadata (uid, for Events)
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    timer: asyncio.TimerHandle | None = None
    timer_at: float = 0.0
    settings: table.JobSettings = dataclasses.field(default_factory=table.JobSettings)
    problems: tuple[str, ...] = ()
    #: Hang detection: when save progress was last seen, and the (rank -> (step, saves)) it saw.
    progress_at: float = 0.0
    progress: dict[int, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    heartbeat_written: float = 0.0
    #: When this operator process loaded the job (the hang clock never starts earlier).
    seen_at: float = 0.0
    #: Pods of the current generation whose DELETED event came before any failure showed.
    vanished: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: Pods this operator process evicted or deleted (never twice: its view may lag its writes).
    stopped: set[str] = dataclasses.field(default_factory=set)
    #: Pods this operator process released (a watch event older than the release may still show
    #: them gated: they are not replacements).
    released_uids: set[str] = dataclasses.field(default_factory=set)
    #: Warned that the Job lacks the FailJob rule for exit code 76.
    warned_no_failjob: bool = False
    #: Warned about pods of an earlier run of the same name still running.
    warned_earlier_run: bool = False
    #: Warned about a pod stuck Terminating (one Event per pod).
    fenced: set[str] = dataclasses.field(default_factory=set)
    #: In-place restart: rank -> the generation its sidecar acknowledged (heartbeats).
    acks: dict[int, str] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def uid(self) -> str:
        return str(_meta(self.workload or {}).get("uid", ""))

    @property
    def world(self) -> int:
        spec = (self.workload or {}).get("spec") or {}
        return int(spec.get("completions") or spec.get("parallelism") or 1)

    def generation(self, restart: int) -> str:
        assert self.status is not None
        return f"{self.status.get('run') or _run_id(self.uid, self.kind)}/{restart}"

    @property
    def restart_count(self) -> int:
        """The RESTART of the current generation (0 before the first release)."""
        assert self.status is not None
        current = self.status.get("generation") or ""
        tail = current.rpartition("/")[2]
        return int(tail) if tail.isdigit() else 0


class Controller:
    """The restart protocol over an :class:`Api`. Feed it watch events (``on_job``, ``on_pod``) and
    heartbeats (``on_heartbeat``); it writes StrataJob status, pods, evictions and Events.

    ``metrics`` is an ``OperatorMetrics`` (or None); ``clock`` is wall time (tests may move it).
    """

    def __init__(
        self,
        api: Api,
        *,
        metrics: Any = None,
        trainer_container: str | None = None,
        fence_margin_s: float = DEFAULT_FENCE_MARGIN_S,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        in_place_restart: bool = False,
        in_place_timeout_s: float = DEFAULT_IN_PLACE_TIMEOUT_S,
    ) -> None:
        self.api = api
        self.metrics = metrics
        self.trainer_container = trainer_container
        self.fence_margin_s = fence_margin_s
        #: --in-place-restart: answer a trainer's crash or hang by restarting the trainer containers
        #: in place (container restart rules), keeping pods, sidecars and their memory.
        self.in_place_restart = in_place_restart
        self.in_place_timeout_s = in_place_timeout_s
        self.clock = clock
        self.rng = rng or random.Random()
        self.jobs: dict[tuple[str, str], _Job] = {}
        self._closed = False
        self._tasks: set[asyncio.Future[None]] = set()
        #: When each pending decision was made (monotonic), for the decision-latency benchmark.
        self.decisions: list[tuple[str, float]] = []

    # -- inputs -------------------------------------------------------------------------------------

    def _job(self, namespace: str, name: str) -> _Job:
        key = (namespace, name)
        if key not in self.jobs:
            self.jobs[key] = _Job(namespace, name)
        return self.jobs[key]

    async def on_job(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A Job or JobSet event (kopf's ``on.event``; ``event_type`` None for the initial listing)."""
        if body.get("kind") == "Job" and not opted_in((body.get("spec") or {}).get("template") or {}):
            return
        meta = _meta(body)
        job = self._job(str(meta.get("namespace", "default")), str(meta["name"]))
        if event_type == "DELETED":
            # The StrataJob and the Checkpoints stay: a Job resubmitted under this name finds them.
            # Its pods stay in the index until they are gone: a resubmission waits for them.
            async with job.lock:
                if job.timer is not None:
                    job.timer.cancel()
                job.workload = job.status = job.stratajob = None
                job.vanished.clear()
                job.warned_earlier_run = job.warned_no_failjob = False
                self._tidy(job)
            return
        job.kind = str(body.get("kind", "Job"))
        job.workload = dict(body)
        self._tidy(job)
        await self.reconcile(job)

    async def on_pod(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """An opted-in pod's event."""
        meta = _meta(body)
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
            last = job.pods.pop(name, None) or dict(body)
            if job.workload is None:
                self._tidy(job)
                return
            generation = (_meta(last).get("annotations") or {}).get(names.GENERATION_ANNOTATION)
            if (
                job.status is not None
                and generation is not None
                and generation == job.status.get("generation")
                and not _gated(last)
                and not is_terminal(last)
            ):
                job.vanished[name] = last  # gone before any failure showed: a failure still
        else:
            job.pods[name] = dict(body)
        await self.reconcile(job)

    async def shape_of(self, namespace: str, pod: Mapping[str, Any]) -> Shape:
        """A pod's world size and rank from its Job or JobSet, for the injection: from the watch
        cache, else one GET (the pod's admission may come before the watch event). Unknown
        (a bare pod, an API error) leaves both to the pod template."""
        labels = _meta(pod).get("labels") or {}
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
            except (TimeoutError, ApiError, OSError) as exc:
                log.warning(
                    "%s/%s: world size unknown at admission (%s); template's applies", namespace, owner, exc
                )
                return Shape()
        return workload_shape(workload, pod)

    def _tidy(self, job: _Job) -> None:
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
        changes: dict[str, Any] = {"lastHeartbeat": _now()}
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
            await self._patch_status(job, changes)
        else:
            job.status.update(changes)  # written with the next status change, or within a minute
        return instruction

    def _in_place_answer(self, job: _Job, item: Mapping[str, Any], pod: str | None) -> dict[str, Any] | None:
        """While an in-place restart waits for its acknowledgements: note this rank's (its sidecar
        reports the generation it adopted), else the instruction for its sidecar."""
        assert job.status is not None
        pending = job.status.get("pendingRestart") or {}
        if pending.get("mode") != "in-place" or not pending.get("instructedAt"):
            return None
        target = str(pending.get("generation"))
        rank = item.get("rank")
        if not isinstance(rank, int):
            return None
        if target in (item.get("restart_generation"), item.get("generation")):
            if job.acks.get(rank) != target:
                job.acks[rank] = target
                if set(range(job.world)) <= {r for r, g in job.acks.items() if g == target}:
                    self._wake(job, self.clock())  # every rank acknowledged: finish the restart now
            return None
        if pod is not None and pod not in job.pods:
            return None  # not a pod of this gang the watch knows
        return {
            "namespace": job.namespace,
            "job": job.name,
            "restart": {"generation": target, "reason": str(pending.get("reason") or "")},
        }

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
            await self._patch_status(job, {"latestStep": step, "latestCheckpoint": checkpoint})

    # -- the loop -----------------------------------------------------------------------------------

    async def reconcile(self, job: _Job) -> None:
        if self._closed:
            return
        async with job.lock:
            try:
                await self._reconcile(job)
            except ApiError as exc:
                if self.metrics is not None:
                    self.metrics.reconcile_errors.inc()
                # A 429 or 503 says when to come back (Retry-After); within reason.
                delay = 2.0 if exc.retry_after is None else min(max(exc.retry_after, 0.5), 60.0)
                log.warning(
                    "%s/%s: reconcile failed: %s; retrying in %.1f s", job.namespace, job.name, exc, delay
                )
                self._wake(job, self.clock() + delay)

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
                meta = _meta(pod)
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

    def _wake(self, job: _Job, at: float) -> None:
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

    def _fire(self, job: _Job) -> None:
        job.timer = None
        if self.jobs.get(job.key) is job:
            task = asyncio.ensure_future(self.reconcile(job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _reconcile(self, job: _Job) -> None:
        if job.workload is None:
            return  # pods seen before their Job: wait for it
        if job.status is None:
            await self._load(job)
        assert job.status is not None
        await self._check_settings(job)
        if job.kind == "JobSet":
            await self._reflect_jobset(job)
            return
        phase = job.status.get("phase")
        if phase == "Succeeded":
            return
        pods = self._own_pods(job)
        if phase == "Failed":  # for good: what the Job controller still creates is released to stop
            await self._stop_pods(job, [p for p in pods if not _gated(p) and not _stopping(p)])
            await self._release_to_stop(job, pods)
            return
        ended = self._workload_ended(job)
        if ended is not None:
            # The Job itself completed or failed (its own policy, a deadline): nothing to restart.
            phase_now = "Succeeded" if ended == "Complete" else "Failed"
            await self._patch_status(
                job,
                {"phase": phase_now, "pendingRestart": None},
                condition=(phase_now, "True", f"Job{ended}", f"the {job.kind} reports {ended}"),
            )
            return
        if ((job.workload or {}).get("spec") or {}).get("suspend"):
            return  # suspended (Kueue): its pods go away on purpose; nothing is a failure
        pending = job.status.get("pendingRestart")
        if pending:
            await self._restart(job, pods, pending)
            return
        current = job.status.get("generation")
        released = [p for p in pods if not _gated(p)]
        running = [
            p
            for p in released
            if (_meta(p).get("annotations") or {}).get(names.GENERATION_ANNOTATION) == current
        ]
        if current is None:
            if await self._earlier_run_gone(job):
                await self._release(job, pods, job.generation(0), first=True)
            return
        found = self._failure(job, running) or self._vanished(job, pods, running)
        if found is not None:
            await self._decide(job, found[0], running, found[1])
            return
        done = {_index(p) for p in running if (p.get("status") or {}).get("phase") == "Succeeded"}
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
                job.progress_at, job.seen_at, _parse_time(job.status.get("generationStartedAt")) or 0.0
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

    def _stratajob_path(self, job: _Job, subresource: str | None = None) -> str:
        return path(*STRATAJOBS, job.namespace, job.name, subresource)

    async def _load(self, job: _Job) -> None:
        """Read (or create) the StrataJob; a new workload uid under a used name is a new run."""
        assert job.workload is not None
        found = await self.api.get(self._stratajob_path(job))
        workload = {
            "apiVersion": job.workload.get("apiVersion", "batch/v1"),
            "kind": job.kind,
            "metadata": {"name": job.name, "uid": job.uid},
        }
        parsed = self._parse_settings(job)
        fresh = parsed.run == "fresh"
        if found is None:
            body = objects.stratajob_body(job.namespace, job.name, workload, max_restarts=parsed.max_restarts)
            try:
                found = await self.api.create(path(*STRATAJOBS, job.namespace), body)
            except ApiError as exc:
                if exc.status != 409:
                    raise
                found = await self.api.get(self._stratajob_path(job))
                assert found is not None
            status = self._new_run(job, found.get("status") or {}, resumed=False, fresh=fresh)
            job.stratajob = found
            job.status = dict(found.get("status") or {})
            job.seen_at = self.clock()
            await self._patch_status(job, status)
            return
        job.stratajob = found
        job.status = dict(found.get("status") or {})
        job.seen_at = self.clock()
        known_uid = ((found.get("spec") or {}).get("workload") or {}).get("uid")
        if known_uid != job.uid:
            # Resubmitted under the same name: a new run (its own retry budget), resuming the
            # checkpoints unless strata.dev/run says fresh.
            reference = {
                "apiVersion": workload["apiVersion"],
                "kind": job.kind,
                "name": job.name,
                "uid": job.uid,
            }
            await self.api.merge_patch(self._stratajob_path(job), {"spec": {"workload": reference}})
            status = self._new_run(job, job.status, resumed=not fresh, fresh=fresh)
            await self._patch_status(job, status)
            await self._event(
                job,
                "NewRun",
                f"{job.kind} {job.name} was resubmitted (uid {job.uid}): run {status['run']} "
                + ("starts fresh" if fresh else "resumes the newest committed step"),
            )

    def _new_run(self, job: _Job, old: Mapping[str, Any], *, resumed: bool, fresh: bool) -> dict[str, Any]:
        status: dict[str, Any] = {
            "phase": "Pending",
            "run": _run_id(job.uid, job.kind),
            "runMode": "fresh" if fresh else "resumed",
            "generation": None,
            "generationStartedAt": None,
            "restarts": 0,
            "restartLimit": job.settings.max_restarts,
            "pendingRestart": None,
            "attempt": None,
            "restoreStep": None,
            "lastFailure": old.get("lastFailure") if resumed else None,
        }
        status["resumeFromApplied"] = None  # a new run applies the Job's resume-from once
        return status

    def _parse_settings(self, job: _Job) -> table.JobSettings:
        assert job.workload is not None
        template_annotations = self._template_annotations(job)
        merged = {**template_annotations, **(_meta(job.workload).get("annotations") or {})}
        parsed = table.parse(merged)
        job.problems = tuple(parsed.problems)
        job.settings = parsed.job
        return parsed.job

    def _template_annotations(self, job: _Job) -> dict[str, str]:
        spec = (job.workload or {}).get("spec") or {}
        if job.kind == "JobSet":
            for replicated in spec.get("replicatedJobs") or []:
                template = ((replicated.get("template") or {}).get("spec") or {}).get("template") or {}
                if opted_in(template):
                    return dict(_meta(template).get("annotations") or {})
            return {}
        return dict(_meta(spec.get("template") or {}).get("annotations") or {})

    async def _check_settings(self, job: _Job) -> None:
        before = job.problems
        self._parse_settings(job)
        assert job.status is not None
        if job.status.get("restartLimit") != job.settings.max_restarts:
            await self._patch_status(job, {"restartLimit": job.settings.max_restarts})
        checked = any(c.get("type") == "SettingsValid" for c in job.status.get("conditions") or [])
        if job.problems == before and checked:
            return
        if job.problems:
            message = "; ".join(job.problems)
            await self._patch_status(
                job, {}, condition=("SettingsValid", "False", "InvalidAnnotations", message)
            )
            await self._event(job, "InvalidAnnotations", message, warning=True, on_workload=True)
        else:
            await self._patch_status(
                job, {}, condition=("SettingsValid", "True", "Valid", "every strata.dev annotation is valid")
            )

    async def _patch_status(
        self,
        job: _Job,
        changes: Mapping[str, Any],
        condition: tuple[str, str, str, str] | None = None,
    ) -> None:
        assert job.status is not None
        patch = dict(changes)
        if condition is not None:
            patch["conditions"] = objects.set_condition(list(job.status.get("conditions") or []), *condition)
        if "lastHeartbeat" not in patch and job.status.get("lastHeartbeat"):
            patch["lastHeartbeat"] = job.status["lastHeartbeat"]
        await self.api.merge_patch(self._stratajob_path(job, "status"), {"status": patch})
        job.status.update(patch)

    async def _event(
        self, job: _Job, reason: str, message: str, *, warning: bool = False, on_workload: bool = False
    ) -> None:
        """An Event on the StrataJob (``kubectl describe stratajob``), and on the Job when asked."""
        log.log(
            logging.WARNING if warning else logging.INFO,
            "%s/%s: %s: %s",
            job.namespace,
            job.name,
            reason,
            message,
        )
        targets = []
        if job.stratajob is not None:
            targets.append((names.API_VERSION, "StrataJob", _meta(job.stratajob).get("uid", "")))
        if on_workload and job.workload is not None:
            targets.append((str(job.workload.get("apiVersion", "batch/v1")), job.kind, job.uid))
        for api_version, kind, uid in targets:
            involved = {
                "apiVersion": api_version,
                "kind": kind,
                "name": job.name,
                "namespace": job.namespace,
                "uid": uid,
            }
            body = objects.event_body(involved, reason, message, warning=warning)
            try:
                await self.api.create(path("", "v1", "events", job.namespace), body)
            except ApiError as exc:  # an Event is informational: never fail the decision for it
                log.warning("%s/%s: could not post Event %s: %s", job.namespace, job.name, reason, exc)

    # -- decisions ----------------------------------------------------------------------------------

    def _failure(self, job: _Job, running: list[dict[str, Any]]) -> tuple[Failure, str] | None:
        """The failure to act on, and its pod: the first cause wins (a pod the node lost or evicted
        beats the peers that died after it)."""
        found: list[tuple[Failure, str]] = []
        status = job.status or {}
        since = (
            _parse_time(status.get("generationStartedAt"))
            if status.get("restartMode") == "in-place"
            else None
        )
        for pod in running:
            if (pod.get("status") or {}).get("phase") == "Succeeded":
                continue
            failure = classify_pod(_since(pod, since), container=self.trainer_container)
            if failure is not None:
                found.append((failure, str(_meta(pod).get("name", ""))))
        order = [FailureKind.LOST, FailureKind.EVICTED, FailureKind.OOM, FailureKind.DELETED]
        found.sort(key=lambda f: order.index(f[0].kind) if f[0].kind in order else len(order))
        return found[0] if found else None

    async def _world_size_failure(self, job: _Job, tracker: RestartTracker) -> Failure | None:
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
        self, job: _Job, failure: Failure, running: list[dict[str, Any]], pod: str = ""
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
            {str(_index(p)) for p in running if (p.get("status") or {}).get("phase") == "Succeeded"}
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
        decision = tracker.decide(failure)
        last = {
            "reason": REASONS.get(failure.kind, "Failed"),
            "kind": failure.kind.value,
            "message": failure.describe(),
            "pod": pod,
            "time": _now(),
        }
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
            "decidedAt": _now(),
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

    async def _stop_pods(self, job: _Job, pods: list[dict[str, Any]]) -> None:
        """Evict every pod that still runs (DisruptionTarget, which podFailurePolicy ignores); a
        PodDisruptionBudget's 429 falls back to a delete, any other 429 is retried."""
        for pod in pods:
            meta = _meta(pod)
            uid = str(meta.get("uid"))
            # The index may lag our own evictions (the watch brings the deletion later): once each.
            if is_terminal(pod) or meta.get("deletionTimestamp") or _gated(pod) or uid in job.stopped:
                continue
            job.stopped.add(uid)
            name = str(meta["name"])
            eviction = {
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": name, "namespace": job.namespace},
            }
            try:
                try:
                    await self.api.create(path("", "v1", "pods", job.namespace, name, "eviction"), eviction)
                except ApiError as exc:
                    if exc.status == 404:
                        continue
                    if not exc.disruption_budget:
                        # API Priority and Fairness' 429 too: the apiserver is busy, no budget
                        # refused; the reconcile retries after its Retry-After.
                        raise
                    log.info(
                        "%s/%s: eviction of %s refused by a disruption budget; deleting it",
                        job.namespace,
                        job.name,
                        name,
                    )
                    await self._disrupt_and_delete(job, pod)
            except BaseException:
                job.stopped.discard(uid)  # not stopped after all: the retry tries again
                raise

    async def _disrupt_and_delete(self, job: _Job, pod: Mapping[str, Any]) -> None:
        """What the taint manager and the pod GC do: mark the pod DisruptionTarget (so the Job's
        podFailurePolicy ignores it, as it ignores an eviction), then delete it."""
        meta = _meta(pod)
        url = path("", "v1", "pods", job.namespace, str(meta["name"]))
        conditions = [
            c
            for c in (pod.get("status") or {}).get("conditions") or []
            if c.get("type") != "DisruptionTarget"
        ]
        conditions.append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "DeletionByStrataGangRestart",
                "message": "Strata operator: the gang restarts (a disruption budget refused the eviction)",
                "lastTransitionTime": _now(),
            }
        )
        try:
            await self.api.strategic_patch(url + "/status", {"status": {"conditions": conditions}})
        except ApiError as exc:
            if exc.status == 404:
                return
            raise
        await self.api.delete(url)

    async def _restart(self, job: _Job, pods: list[dict[str, Any]], pending: Mapping[str, Any]) -> None:
        """Drive a decided gang restart: stop the old gang, fence what hangs, release the new one."""
        if pending.get("mode") == "in-place":
            await self._restart_in_place(job, pods, pending)
            return
        target = str(pending["generation"])
        old = [
            p
            for p in pods
            if not _gated(p)
            and (_meta(p).get("annotations") or {}).get(names.GENERATION_ANNOTATION) != target
        ]
        await self._stop_pods(job, old)
        if not await self._wait_gone(job, old):
            return  # the watch brings their end (or a timer, to fence one stuck Terminating)
        not_before = _parse_time(str(pending.get("notBefore"))) or 0.0
        if self.clock() < not_before:
            self._wake(job, not_before)
            return
        await self._release(job, pods, target, first=False)

    # -- in-place restarts ---------------------------------------------------------------------------

    def _in_place_kind(self, job: _Job, failure: Failure) -> bool:
        """Whether a restart for ``failure`` may try in place (the pods are checked when it starts)."""
        return (
            self.in_place_restart
            and job.kind == "Job"
            and failure.kind in IN_PLACE_KINDS
            and self._restore_request(job, first=False) is None  # a rollback needs a fresh release
        )

    def _in_place_problem(self, job: _Job, gang: list[dict[str, Any]]) -> str | None:
        """Why the gang cannot restart in place, or None: every index has its pod of the current
        generation, running, not deleted, and its trainer container(s) carry the restart rule (the
        API server drops it where the ContainerRestartRules feature gate is off)."""
        indexes = {_index(p) for p in gang}
        if len(gang) < job.world or (None not in indexes and not indexes >= set(range(job.world))):
            return f"{len(gang)} of {job.world} pods of the gang are left"
        for pod in gang:
            name = _meta(pod).get("name")
            if is_terminal(pod) or _meta(pod).get("deletionTimestamp"):
                return f"pod {name} ended or is being deleted"
            if (pod.get("status") or {}).get("phase") != "Running":
                return f"pod {name} is {(pod.get('status') or {}).get('phase') or 'not running'}"
            failure = classify_pod(pod, container=self.trainer_container)
            if failure is not None and failure.kind not in IN_PLACE_KINDS:
                return f"pod {name}: {failure.describe()}"
            trainers = [
                c
                for c in (pod.get("spec") or {}).get("containers") or []
                if self.trainer_container is None or c.get("name") == self.trainer_container
            ]
            if not trainers or not all(c.get("restartPolicyRules") for c in trainers):
                return (
                    f"pod {name} has no container restart rule on its trainer (Kubernetes before 1.34, "
                    "the ContainerRestartRules feature gate off, or admitted without --in-place-restart)"
                )
        return None

    async def _restart_in_place(
        self, job: _Job, pods: list[dict[str, Any]], pending: Mapping[str, Any]
    ) -> None:
        """Restart the trainer containers and keep the pods: every sidecar is told the new
        generation in the answer to its next heartbeat, adopts it, and makes its trainers exit
        EXIT_RESTART_IN_PLACE (their restart rule restarts them); once every rank's sidecar
        acknowledged, the pods' generation annotation follows and the generation runs. Falls back
        to the pod-level restart when the gang cannot (a pod gone or not running, no restart rule)
        or the acknowledgements do not come within ``in_place_timeout_s``."""
        assert job.status is not None
        target = str(pending["generation"])
        current = job.status.get("generation")
        gang = [
            p
            for p in pods
            if not _gated(p)
            and (_meta(p).get("annotations") or {}).get(names.GENERATION_ANNOTATION) == current
        ]
        problem = self._in_place_problem(job, gang)
        if problem is not None:
            await self._fall_back(job, pending, problem)
            return
        not_before = _parse_time(str(pending.get("notBefore"))) or 0.0
        if self.clock() < not_before:
            self._wake(job, not_before)
            return
        instructed = _parse_time(str(pending.get("instructedAt") or ""))
        if instructed is None:
            instructed = self.clock()
            at = datetime.datetime.fromtimestamp(instructed, tz=datetime.UTC).strftime(
                "%Y-%m-%dT%H:%M:%S.%fZ"
            )
            job.acks.clear()
            await self._patch_status(job, {"pendingRestart": {**pending, "instructedAt": at}})
            await self._event(
                job,
                "InPlaceRestart",
                f"restarting the trainers of {len(gang)} pods in place as generation {target}: their "
                "sidecars are told at their next heartbeat; pods, sidecars and memory stay",
            )
        acked = {r for r, g in job.acks.items() if g == target}
        if acked >= set(range(job.world)):
            await self._finish_in_place(job, gang, target)
            return
        deadline = instructed + self.in_place_timeout_s
        if self.clock() >= deadline:
            await self._fall_back(
                job,
                pending,
                f"{len(acked)} of {job.world} ranks' sidecars acknowledged within "
                f"{self.in_place_timeout_s:g} s",
            )
            return
        self._wake(job, deadline)

    async def _finish_in_place(self, job: _Job, gang: list[dict[str, Any]], target: str) -> None:
        started = _now()
        for pod in gang:
            meta = _meta(pod)
            # The generation file follows (a sidecar restarted later reads it); the one-shot restore
            # request of the previous release is spent.
            updated = await self.api.merge_patch(
                path("", "v1", "pods", job.namespace, str(meta["name"])),
                {
                    "metadata": {
                        "annotations": {
                            names.GENERATION_ANNOTATION: target,
                            names.RESTORE_REQUEST_ANNOTATION: None,
                        }
                    }
                },
            )
            if isinstance(updated, dict) and str(meta["name"]) in job.pods:
                job.pods[str(meta["name"])] = updated
        job.progress_at = self.clock()
        job.progress.clear()
        job.vanished.clear()
        job.stopped.clear()
        job.acks.clear()
        message = f"restarted the trainers of {len(gang)} pods in place as generation {target}"
        await self._patch_status(
            job,
            {
                "phase": "Running",
                "generation": target,
                "pendingRestart": None,
                "generationStartedAt": started,
                "restartMode": "in-place",
            },
            condition=("Restarting", "False", "RestartedInPlace", message),
        )
        await self._event(job, "GangRestartedInPlace", message)

    async def _fall_back(self, job: _Job, pending: Mapping[str, Any], why: str) -> None:
        """The pod-level restart instead, as the next generation: sidecars that adopted the in-place
        one are fenced off like any earlier gang's. The restart is counted once."""
        fallback = {
            **{k: v for k, v in pending.items() if k != "instructedAt"},
            "mode": "pod",
            "generation": _next_generation(str(pending["generation"])),
            "fallback": why,
        }
        job.acks.clear()
        await self._patch_status(job, {"pendingRestart": fallback})
        await self._event(
            job,
            "InPlaceRestartFallback",
            f"not restarting in place ({why}): restarting the gang's pods as generation "
            f"{fallback['generation']}",
            warning=True,
        )
        await self._restart(job, self._own_pods(job), fallback)

    async def _wait_gone(self, job: _Job, pods: list[dict[str, Any]]) -> bool:
        """True once every pod in ``pods`` is terminal or gone. A pod still Terminating
        ``--fence-margin-seconds`` after its deletion deadline (its node is gone) is force-deleted:
        storage fences its attempt off, so nothing it still writes can commit, and without this its
        index never gets a replacement (podReplacementPolicy: Failed)."""
        now = self.clock()
        waiting = False
        for pod in pods:
            if is_terminal(pod):
                continue
            waiting = True
            meta = _meta(pod)
            # The apiserver sets deletionTimestamp to the end of the grace period.
            deadline = _parse_time(meta.get("deletionTimestamp"))
            if deadline is None:
                continue
            if now < deadline + self.fence_margin_s:
                self._wake(job, deadline + self.fence_margin_s)
                continue
            name = str(meta["name"])
            url = path("", "v1", "pods", job.namespace, name)
            # As the pod GC does for pods of a lost node: terminal phase and DisruptionTarget first
            # (the Job controller counts a pod only once it is terminal, and the rule ignores it),
            # then the force delete.
            conditions = [
                c
                for c in (pod.get("status") or {}).get("conditions") or []
                if c.get("type") != "DisruptionTarget"
            ]
            conditions.append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "DeletionByStrataFence",
                    "message": "Strata operator: still Terminating past its grace period (its node is gone)",
                    "lastTransitionTime": _now(),
                }
            )
            try:
                await self.api.strategic_patch(
                    url + "/status", {"status": {"phase": "Failed", "conditions": conditions}}
                )
            except ApiError as exc:
                if exc.status != 404:
                    raise
            await self.api.delete(url, {"gracePeriodSeconds": 0})
            if name not in job.fenced:
                job.fenced.add(name)
                await self._event(
                    job,
                    "PodFenced",
                    f"pod {name} was still Terminating {now - deadline:.0f} s after its grace period ended "
                    f"(margin {self.fence_margin_s:.0f} s): force-deleted it; its attempt is fenced off in "
                    "storage",
                    warning=True,
                )
        return not waiting

    def _own_pods(self, job: _Job) -> list[dict[str, Any]]:
        """Pods this Job controls (not those of an earlier Job of the same name)."""
        return [p for p in job.pods.values() if _owner_uid(p) == job.uid]

    async def _earlier_run_gone(self, job: _Job) -> bool:
        """A resubmitted Job's first gang waits for the pods of the earlier Job of its name (still
        Terminating, or orphaned): two runs never train side by side."""
        earlier = [p for p in job.pods.values() if _owner_uid(p) != job.uid and not is_terminal(p)]
        if await self._wait_gone(job, earlier):
            return True
        if not job.warned_earlier_run:
            job.warned_earlier_run = True
            names_left = ", ".join(sorted(str(_meta(p).get("name")) for p in earlier)[:5])
            await self._event(
                job,
                "WaitingForEarlierRun",
                f"{len(earlier)} pod(s) of an earlier {job.kind} named {job.name} still run ({names_left}); "
                "this run starts when they are gone (delete them if they were orphaned)",
                warning=True,
                on_workload=True,
            )
        return False

    def _vanished(
        self, job: _Job, pods: list[dict[str, Any]], running: list[dict[str, Any]]
    ) -> tuple[Failure, str] | None:
        """A pod of the current generation that is gone without a failure showing: its DELETED event
        came first, or (after an operator restart) its index has only a gated replacement, which the
        Job controller creates only once the pod it replaces failed or went away."""
        for name, pod in sorted(job.vanished.items()):
            return Failure(
                FailureKind.DELETED, _index(pod), detail=f"pod {name} disappeared while it ran"
            ), name
        live = {_index(p) for p in running if not is_terminal(p)}
        started = (job.status or {}).get("generationStartedAt") or ""
        for pod in pods:
            index = _index(pod)
            meta = _meta(pod)
            replacement = (
                _gated(pod)
                and str(meta.get("uid")) not in job.released_uids
                and str(meta.get("creationTimestamp") or "") >= started  # RFC 3339 UTC: orders as text
            )
            if replacement and index is not None and index not in live:
                return (
                    Failure(
                        FailureKind.DELETED,
                        index,
                        detail=f"the pod of index {index} is gone "
                        f"(its replacement {_meta(pod).get('name')} waits)",
                    ),
                    "",
                )
        return None

    async def _release(self, job: _Job, pods: list[dict[str, Any]], generation: str, *, first: bool) -> None:
        """Write the generation on every gated pod and lift the gates, once every index has its pod.
        Idempotent: pods a failed earlier attempt at this release already carry ``generation`` count
        as released, so a release cut short (an API error, an operator restart) completes."""
        assert job.status is not None and job.workload is not None
        live = [p for p in pods if not is_terminal(p) and not _meta(p).get("deletionTimestamp")]
        gated = [p for p in live if _gated(p)]
        done = [
            p
            for p in live
            if not _gated(p)
            and (_meta(p).get("annotations") or {}).get(names.GENERATION_ANNOTATION) == generation
        ]
        indexes = {_index(p) for p in gated + done}
        ready = len(gated) + len(done) >= job.world if None in indexes else indexes >= set(range(job.world))
        if not ready:
            return  # the Job controller is still creating them: their ADDED events wake us
        # Taken before the patches: a replacement of a pod that vanishes meanwhile is younger.
        started = _now()
        request = self._restore_request(job, first)
        for pod in gated:
            meta = _meta(pod)
            gates = [
                g
                for g in (pod.get("spec") or {}).get("schedulingGates") or []
                if g.get("name") != names.GANG_GATE
            ]
            annotations: dict[str, Any] = {names.GENERATION_ANNOTATION: generation}
            annotations[names.RESTORE_REQUEST_ANNOTATION] = request
            updated = await self.api.merge_patch(
                path("", "v1", "pods", job.namespace, str(meta["name"])),
                {"metadata": {"annotations": annotations}, "spec": {"schedulingGates": gates or None}},
            )
            job.released_uids.add(str(meta.get("uid")))
            if isinstance(updated, dict) and str(meta["name"]) in job.pods:
                job.pods[str(meta["name"])] = updated  # the watch brings the same; do not wait for it
        changes: dict[str, Any] = {
            "phase": "Running",
            "generation": generation,
            "pendingRestart": None,
            "generationStartedAt": started,
            "restartMode": "pod",
        }
        resume_from = job.settings.resume_from if job.settings.resume_from_set else None
        if request is not None and job.settings.resume_from_set:
            changes["resumeFromApplied"] = str(resume_from) if resume_from is not None else "none"
        job.progress_at = self.clock()
        job.progress.clear()
        job.vanished.clear()
        job.stopped.clear()
        released = len(gated) + len(done)
        message = f"released {released} pods as generation {generation}" + (
            f", restoring {'nothing (fresh)' if request == 'none' else f'step {request}'} once"
            if request
            else ""
        )
        await self._patch_status(job, changes, condition=("Restarting", "False", "Released", message))
        await self._event(job, "GangReleased", message)

    async def _release_to_stop(self, job: _Job, pods: list[dict[str, Any]]) -> None:
        """The job failed for good: once the old gang is gone, release its replacements with the
        restore request "stop". Their sidecars refuse the trainers, which exit 76, and the Job's
        podFailurePolicy rule (FailJob) ends the Job, freeing its quota. Never two gangs at once;
        all replacements at once (a lone one would wait for its peers); and only when the Job has
        that rule (without it each exit would be retried: the replacements stay gated)."""
        old = [p for p in pods if not _gated(p) and not _stopping(p) and not is_terminal(p)]
        live = [p for p in pods if not is_terminal(p) and not _meta(p).get("deletionTimestamp")]
        gated = [p for p in live if _gated(p)]
        if not gated or not await self._wait_gone(job, old):
            return
        if not self._fails_on_limit_spent(job):
            if not job.warned_no_failjob:
                job.warned_no_failjob = True
                await self._event(
                    job,
                    "ReplacementsKeptGated",
                    f"the Job has no podFailurePolicy rule onExitCodes In [{names.EXIT_LIMIT_SPENT}] action "
                    "FailJob, so its replacement pods stay gated (a trainer that exits would be retried): "
                    "delete the Job",
                    warning=True,
                    on_workload=True,
                )
            return
        succeeded = {_index(p) for p in pods if (p.get("status") or {}).get("phase") == "Succeeded"}
        have = {_index(p) for p in gated} | {_index(p) for p in live if _stopping(p)}
        if None not in have and not set(range(job.world)) - succeeded <= have:
            return  # the Job controller is still creating replacements
        generation = job.status.get("generation") if job.status else None
        for pod in gated:
            meta = _meta(pod)
            gates = [
                g
                for g in (pod.get("spec") or {}).get("schedulingGates") or []
                if g.get("name") != names.GANG_GATE
            ]
            annotations = {
                names.GENERATION_ANNOTATION: generation,
                names.RESTORE_REQUEST_ANNOTATION: names.STOP_REQUEST,
            }
            updated = await self.api.merge_patch(
                path("", "v1", "pods", job.namespace, str(meta["name"])),
                {"metadata": {"annotations": annotations}, "spec": {"schedulingGates": gates or None}},
            )
            job.released_uids.add(str(meta.get("uid")))
            if isinstance(updated, dict) and str(meta["name"]) in job.pods:
                job.pods[str(meta["name"])] = updated
        await self._event(
            job,
            "ReleasedToStop",
            f"released {len(gated)} replacement pod(s) with the restore request {names.STOP_REQUEST!r}: "
            f"their trainers exit {names.EXIT_LIMIT_SPENT}, which the Job's podFailurePolicy turns into "
            "FailJob",
        )

    def _fails_on_limit_spent(self, job: _Job) -> bool:
        """The Job's podFailurePolicy fails it when a trainer exits EXIT_LIMIT_SPENT."""
        rules = (((job.workload or {}).get("spec") or {}).get("podFailurePolicy") or {}).get("rules") or []
        return any(
            r.get("action") == "FailJob"
            and (r.get("onExitCodes") or {}).get("operator") == "In"
            and names.EXIT_LIMIT_SPENT in ((r.get("onExitCodes") or {}).get("values") or [])
            for r in rules
        )

    def _workload_ended(self, job: _Job) -> str | None:
        """ "Complete" or "Failed" when the Job controller says the Job ended, else None."""
        for condition in ((job.workload or {}).get("status") or {}).get("conditions") or []:
            if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
                return str(condition["type"])
        return None

    def _restore_request(self, job: _Job, first: bool) -> str | None:
        """The one-shot restore request for the next generation: ``strata.dev/resume-from`` once per
        value it takes, and "none" for the first generation of a fresh run."""
        assert job.status is not None
        if job.settings.resume_from_set:
            wanted = "none" if job.settings.resume_from is None else str(job.settings.resume_from)
            if job.status.get("resumeFromApplied") != wanted:
                return wanted
        if first and job.status.get("runMode") == "fresh":
            return "none"
        return None

    # -- JobSet -------------------------------------------------------------------------------------

    async def _reflect_jobset(self, job: _Job) -> None:
        """JobSet restarts its gang itself: record the attempt it runs and why it restarted."""
        assert job.status is not None
        attempts = [
            int(v)
            for p in job.pods.values()
            if (v := (_meta(p).get("labels") or {}).get(names.JOBSET_RESTART_LABEL)) is not None
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
            labels = _meta(pod).get("labels") or {}
            if str(labels.get(names.JOBSET_RESTART_LABEL, "0")) != str(attempt):
                continue
            failure = classify_pod(pod, container=self.trainer_container)
            if failure is not None:
                last = {
                    "reason": REASONS.get(failure.kind, "Failed"),
                    "kind": failure.kind.value,
                    "message": failure.describe(),
                    "pod": str(_meta(pod).get("name")),
                    "time": _now(),
                }
                known = job.status.get("lastFailure") or {}
                if (known.get("pod"), known.get("reason")) != (last["pod"], last["reason"]):
                    changes["lastFailure"] = last
                break
        if changes:
            await self._patch_status(job, changes)


async def lift_gates(api: Api, namespaces: tuple[str, ...] = ()) -> list[str]:
    """Remove the ``strata.dev/gang`` gate from every pod that has it (``helm uninstall``'s pre-delete
    hook runs this, so no pod waits for an operator that is going away). Other gates stay. Returns
    the pods released, as namespace/name."""
    selector = {"labelSelector": f"{names.OPT_IN_LABEL}={names.OPT_IN_VALUE}"}
    items: list[dict[str, Any]] = []
    for namespace in namespaces or (None,):  # None: every namespace (a ClusterRole)
        listing = await api.request("GET", path("", "v1", "pods", namespace), params=selector)
        items.extend((listing or {}).get("items") or [])
    released = []
    for pod in items:
        gates = (pod.get("spec") or {}).get("schedulingGates") or []
        positions = [i for i, g in enumerate(gates) if g.get("name") == names.GANG_GATE]
        if not positions:
            continue
        meta = _meta(pod)
        ops: list[dict[str, Any]] = []
        for i in reversed(positions):  # a test op first: never remove someone else's gate
            ops.append({"op": "test", "path": f"/spec/schedulingGates/{i}/name", "value": names.GANG_GATE})
            ops.append({"op": "remove", "path": f"/spec/schedulingGates/{i}"})
        try:
            await api.json_patch(path("", "v1", "pods", str(meta.get("namespace")), str(meta["name"])), ops)
        except ApiError as exc:
            if exc.status in (404, 409, 422):  # gone, or changed meanwhile: the next run sees it
                log.warning("could not lift the gate of %s/%s: %s", meta.get("namespace"), meta["name"], exc)
                continue
            raise
        released.append(f"{meta.get('namespace')}/{meta['name']}")
    return released


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
