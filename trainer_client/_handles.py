"""What ``CheckpointClient.save`` returns: a handle with the save's two futures."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass


@dataclass(frozen=True)
class Committed:
    """What ``durable`` resolves to."""

    step: int
    commit_key: str


class SaveHandle:
    """Futures of one save, like DCP's ``AsyncSaveResponse``."""

    def __init__(self, step: int, skipped: bool = False) -> None:
        self.step = step
        self.skipped = skipped
        self.staged: Future[None] = Future()
        self.durable: Future[Committed] = Future()
        self.stall_s = 0.0

    def result(self, timeout: float | None = None) -> Committed:
        """Wait until durable; raises the save's error."""
        return self.durable.result(timeout)
