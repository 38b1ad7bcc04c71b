"""Failure classification and the gang-restart decision."""

from __future__ import annotations

import enum
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

#: Exit code a container gets when the kernel's OOM killer ends it (128 + SIGKILL).
OOM_EXIT_CODE = 137


class FailureKind(enum.StrEnum):
    EXIT_ERROR = "exit-error"  # the process exited non-zero on its own
    SIGNAL = "signal"  # killed by a signal (kill -9, node shutdown, ...)
    OOM = "oom"  # out of memory (OOMKilled, or SIGKILL reported with the OOM flag)
    LOST = "lost"  # the process (or its pod/node) vanished without an exit status
    HANG = "hang"  # no progress within the hang timeout
    EVICTED = "evicted"  # evicted or preempted (Kubernetes' DisruptionTarget condition)
    DELETED = "deleted"  # the pod was deleted while it ran
    CONFIG = "config"  # the job cannot run as configured (e.g. changed world size): permanent


#: Kinds a restart cannot fix; the job stops at once.
PERMANENT = frozenset({FailureKind.CONFIG})


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    rank: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    detail: str = ""

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "the job"
        if self.kind == FailureKind.SIGNAL and self.signal is not None:
            what = f"was killed by {signal.Signals(self.signal).name}"
        elif self.kind == FailureKind.EXIT_ERROR:
            what = f"exited with code {self.exit_code}"
        elif self.kind == FailureKind.OOM:
            what = "was killed by the OOM killer"
        elif self.kind == FailureKind.LOST:
            what = "was lost"
        elif self.kind == FailureKind.HANG:
            what = "made no progress"
        elif self.kind == FailureKind.EVICTED:
            what = "was evicted or preempted"
        elif self.kind == FailureKind.DELETED:
            what = "was deleted while running"
        else:
            what = "cannot run as configured"
        return f"{who} {what}" + (f": {self.detail}" if self.detail else "")


def classify_exit(
    returncode: int, *, rank: int | None = None, oom_killed: bool = False, detail: str = ""
) -> Failure:
    """Classify a non-zero exit status (a negative ``returncode`` is a signal, as subprocess reports it).

    ``oom_killed``: the runtime says the OOM killer did it (Kubernetes' OOMKilled; the launcher's
    cgroup ``oom_kill`` counter grew while the rank died by SIGKILL).
    """
    if oom_killed:
        return Failure(FailureKind.OOM, rank, exit_code=returncode, detail=detail)
    if returncode < 0:
        return Failure(FailureKind.SIGNAL, rank, signal=-returncode, detail=detail)
    if returncode > 128 and returncode - 128 in signal.valid_signals():
        # A shell or container runtime reports death by signal N as 128 + N.
        return Failure(FailureKind.SIGNAL, rank, exit_code=returncode, signal=returncode - 128, detail=detail)
    return Failure(FailureKind.EXIT_ERROR, rank, exit_code=returncode, detail=detail)


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3
    backoff_s: float = 1.0
    backoff_factor: float = 2.0
    backoff_max_s: float = 60.0
    #: Fraction of each delay drawn at random, so many jobs do not restart in lockstep.
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.backoff_s < 0 or self.backoff_max_s < 0 or self.backoff_factor < 1:
            raise ValueError("backoff_s and backoff_max_s must be >= 0 and backoff_factor >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be within [0, 1], got {self.jitter}")

    def delay(self, restart: int, rng: random.Random) -> float:
        base = min(self.backoff_max_s, self.backoff_s * self.backoff_factor ** max(restart - 1, 0))
        return base * (1 - self.jitter * rng.random())


@dataclass(frozen=True)
class Decision:
    restart: bool
    reason: str  # the failure kind, a stable label for metrics
    message: str  # for humans: logs, Events, conditions
    delay_s: float = 0.0
    #: The attempt number the restarted gang runs as (restarts so far).
    attempt: int = 0


@dataclass
class RestartTracker:
    """Counts restarts of one job against its policy and decides each time."""

    policy: RestartPolicy
    world_size: int
    on_decision: Callable[[Decision], None] = lambda d: None
    restarts: int = 0
    history: list[Decision] = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)

    def decide(self, failure: Failure) -> Decision:
        what = failure.describe()
        if failure.kind in PERMANENT:
            decision = Decision(
                False, failure.kind.value, f"{what}; not restarting (a restart cannot fix it)"
            )
        elif self.restarts >= self.policy.max_restarts:
            decision = Decision(
                False,
                failure.kind.value,
                f"{what}; restart limit reached ({self.restarts} of {self.policy.max_restarts}), giving up",
                attempt=self.restarts,
            )
        else:
            self.restarts += 1
            delay = self.policy.delay(self.restarts, self.rng)
            decision = Decision(
                True,
                failure.kind.value,
                f"{what}; restarting all {self.world_size} ranks from the newest committed step "
                f"(restart {self.restarts} of {self.policy.max_restarts}, in {delay:.1f} s)",
                delay_s=delay,
                attempt=self.restarts,
            )
        self.history.append(decision)
        self.on_decision(decision)
        return decision

    def check_world_size(
        self,
        world_size: int,
        checkpoint_world_size: int | None,
        reshardable: bool = False,
        keep: str = "--nproc {n}",
    ) -> Failure | None:
        """A checkpoint saved by another number of ranks cannot be resumed unless it can be
        resharded (``reshardable``: saved through torch.distributed.checkpoint, whose planner
        loads it on any number of ranks, or replicated state every rank saved alike, which
        ``client.resume()`` restores on any number). ``keep``: how to keep the old size, for the message
        (``{n}``: the checkpoint's number of ranks)."""
        if checkpoint_world_size is None or checkpoint_world_size == world_size or reshardable:
            return None
        return Failure(
            FailureKind.CONFIG,
            detail=f"the newest checkpoint was saved by {checkpoint_world_size} ranks but the job now has "
            f"{world_size}; keep {keep.format(n=checkpoint_world_size)} or start a new job name (a "
            "checkpoint saved through torch.distributed.checkpoint with trainer_client.dcp, or one "
            "whose tensors are all declared replicated with client.replicate, loads on any number "
            "of ranks)",
        )
