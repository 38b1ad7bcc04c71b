"""What the operator's controller knows of a watched workload and its pods (the gang), the pod
helpers every part of it shares, and the base its parts (mixins) build on."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from sidecar.api import EXIT_RESTART_IN_PLACE
from sidecar.coordinator import Failure, FailureKind
from sidecar.operator import annotations as table
from sidecar.operator import names
from sidecar.operator.kube import Api

__all__ = ["ControllerBase", "WatchedJob"]

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


def last_failure(failure: Failure, pod: str) -> dict[str, Any]:
    """The StrataJob's ``status.lastFailure`` for ``failure`` of ``pod``."""
    return {
        "reason": REASONS.get(failure.kind, "Failed"),
        "kind": failure.kind.value,
        "message": failure.describe(),
        "pod": pod,
        "time": now_text(),
    }


def with_disruption_target(pod: Mapping[str, Any], reason: str, message: str) -> list[dict[str, Any]]:
    """``pod``'s conditions with a DisruptionTarget of ``reason`` (replacing any): what the taint
    manager and the pod GC write, so the Job's podFailurePolicy ignores the pod, as an eviction."""
    conditions = [
        c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") != "DisruptionTarget"
    ]
    conditions.append(
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": reason,
            "message": message,
            "lastTransitionTime": now_text(),
        }
    )
    return conditions


def now_text() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def meta_of(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def is_gated(pod: Mapping[str, Any]) -> bool:
    return any(g.get("name") == names.GANG_GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])


def is_stopping(pod: Mapping[str, Any]) -> bool:
    """Released with the restore request "stop" (the restart limit is spent)."""
    return (meta_of(pod).get("annotations") or {}).get(names.RESTORE_REQUEST_ANNOTATION) == names.STOP_REQUEST


def without_stale_exits(pod: Mapping[str, Any], since: float | None) -> dict[str, Any]:
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
        finished = parse_time(state.get("finishedAt"))
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


def next_generation(generation: str) -> str:
    run, _, restart = generation.rpartition("/")
    return f"{run}/{int(restart) + 1}" if restart.isdigit() else generation


def index_of(pod: Mapping[str, Any]) -> int | None:
    raw = (meta_of(pod).get("labels") or {}).get(names.JOB_INDEX_LABEL)
    return int(raw) if raw is not None and str(raw).isdigit() else None


def failed_indexes(workload: Mapping[str, Any] | None) -> list[int]:
    """The Job's ``status.failedIndexes`` ("1,3-5": the Job controller's interval format), sorted."""
    text = str(((workload or {}).get("status") or {}).get("failedIndexes") or "")
    found: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            found.update(range(int(first), int(last or first) + 1))
    return sorted(found)


def owner_uid(pod: Mapping[str, Any]) -> str | None:
    for ref in meta_of(pod).get("ownerReferences") or []:
        if ref.get("kind") == "Job" and ref.get("controller"):
            return str(ref.get("uid"))
    return None


def run_id(uid: str, kind: str = "Job") -> str:
    """A run's identity from its workload's uid (a resubmitted Job gets a new uid, so a new run).
    A JobSet's is its whole uid: its pods' sidecars compose the generation from their labels
    (``jobset-uid``/``restart-attempt``, see inject.py), which cannot shorten it."""
    if kind == "JobSet":
        return uid or "run"
    return uid.replace("-", "")[:12] or "run"


@dataclasses.dataclass
class WatchedJob:
    """What the controller knows about one watched workload."""

    namespace: str
    name: str
    kind: str = "Job"
    workload: dict[str, Any] | None = None
    pods: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    status: dict[str, Any] | None = None  # the StrataJob's status, once loaded
    stratajob: dict[str, Any] | None = None  # its metadata (uid, for Events)
    #: The status held when the StrataJob was found deleted under the live workload: recreated
    #: with it.
    lost_status: dict[str, Any] | None = None
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
    #: Warned that a workload of the other kind (Job, JobSet) carries the same name, and its
    #: newest body (watched once this one is deleted).
    warned_other_kind: bool = False
    other_kind: dict[str, Any] | None = None
    #: Warned about pods of an earlier run of the same name still running.
    warned_earlier_run: bool = False
    #: Warned about a pod stuck Terminating (one Event per pod).
    fenced: set[str] = dataclasses.field(default_factory=set)
    #: In-place restart: rank -> the generation its sidecar acknowledged (heartbeats).
    acks: dict[int, str] = dataclasses.field(default_factory=dict)
    #: Reconciles that failed in a row, and the wall time before which none is tried again (the
    #: backoff, or the Retry-After of a 429): events meanwhile only update the pod index.
    retries: int = 0
    hold_until: float = 0.0
    #: metadata.generation of the Job as last read fresh (a suspension decided from it): watch
    #: events of older generations, still on their way, are stale.
    fresh_generation: int = 0

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def uid(self) -> str:
        return str(meta_of(self.workload or {}).get("uid", ""))

    @property
    def world(self) -> int:
        spec = (self.workload or {}).get("spec") or {}
        return int(spec.get("completions") or spec.get("parallelism") or 1)

    def generation(self, restart: int) -> str:
        assert self.status is not None
        return f"{self.status.get('run') or run_id(self.uid, self.kind)}/{restart}"

    @property
    def restart_count(self) -> int:
        """The RESTART of the current generation (0 before the first release)."""
        assert self.status is not None
        current = self.status.get("generation") or ""
        tail = current.rpartition("/")[2]
        return int(tail) if tail.isdigit() else 0


class ControllerBase:
    """The state the controller's parts share: each part (StrataJob status, stopping, release,
    in-place restart, JobSet) is a mixin of :class:`~sidecar.operator.controller.Controller`."""

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
        self.jobs: dict[tuple[str, str], WatchedJob] = {}
        self._closed = False
        self._tasks: set[asyncio.Future[None]] = set()
        #: When each pending decision was made (monotonic), for the decision-latency benchmark.
        self.decisions: list[tuple[str, float]] = []
        #: Set when pods arrive listed (kopf lists again after its watch expired, and DELETED events
        #: of that gap never come): the pod index is checked against a list soon.
        self.relisted = asyncio.Event()
        #: Pods seen deleted (uid -> monotonic time): a list taken before must not bring them back.
        self.tombstones: dict[str, float] = {}

    def _own_pods(self, job: WatchedJob) -> list[dict[str, Any]]:
        """Pods this Job controls (not those of an earlier Job of the same name)."""
        return [p for p in job.pods.values() if owner_uid(p) == job.uid]

    def _jobset_pods(self, job: WatchedJob) -> dict[str, dict[str, Any]]:
        """Pods of this JobSet (its ``jobset-uid`` label), not those of an earlier JobSet of the same
        name still Terminating: their attempt numbers are another incarnation's, and they are no
        earlier attempt of this one to fence. A pod without the label (a JobSet release that did
        not set it) is taken as this one's."""
        return {
            name: pod
            for name, pod in job.pods.items()
            if (meta_of(pod).get("labels") or {}).get(names.JOBSET_UID_LABEL, job.uid) == job.uid
        }

    def _wake(self, job: WatchedJob, at: float) -> None:
        """Reconcile ``job`` again at wall time ``at`` (the controller's loop)."""
        raise NotImplementedError

    async def _restart(self, job: WatchedJob, pods: list[dict[str, Any]], pending: Mapping[str, Any]) -> None:
        """Drive a decided gang restart (the controller's loop)."""
        raise NotImplementedError

    def _gone(self, job: WatchedJob, name: str, body: Mapping[str, Any] | None = None) -> None:
        """Pod ``name`` no longer exists (its DELETED event, a 404, or absent from a list): drop it
        from the index (the controller's inputs)."""
        raise NotImplementedError
