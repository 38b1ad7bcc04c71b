"""Fault injection points, for tests and chaos runs.

Code marks places where a crash matters with ``fault_point("name", step=...)``.
Nothing happens unless the environment variable ``STRATA_FAULTS`` (or
:func:`arm`) names that point::

    STRATA_FAULTS="client.stream.chunk@40#3=kill"

means: on the 3rd time ``client.stream.chunk`` is reached while saving step 40,
SIGKILL this process. The step (``@S``) and count (``#N``, default 1) are
optional. Actions: ``kill`` (SIGKILL self), ``exit`` (``os._exit(70)``),
``raise`` (raise :class:`FaultInjected`). Several specs are comma-separated.
Kill points come from here rather than from sleeps, so a test hits exactly the
window it means to.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

ENV_VAR = "STRATA_FAULTS"
_ACTIONS = ("kill", "exit", "raise")


class FaultInjected(RuntimeError):
    """Raised at an armed point whose action is ``raise``."""


@dataclass
class _Spec:
    point: str
    step: int | None
    nth: int
    action: str
    hits: int = 0


def parse(text: str) -> list[_Spec]:
    specs: list[_Spec] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        where, sep, action = part.partition("=")
        if not sep or action not in _ACTIONS:
            raise ValueError(f"{ENV_VAR}: {part!r} must look like point[@step][#nth]=kill|exit|raise")
        nth = 1
        if "#" in where:
            where, count = where.split("#", 1)
            nth = int(count)
        step: int | None = None
        if "@" in where:
            where, at = where.split("@", 1)
            step = int(at)
        specs.append(_Spec(where, step, nth, action))
    return specs


_lock = threading.Lock()
_specs: list[_Spec] = parse(os.environ.get(ENV_VAR, ""))


def arm(text: str) -> None:
    """Replace the armed points (tests in one process use this)."""
    global _specs
    with _lock:
        _specs = parse(text)


def fault_point(point: str, step: int | None = None) -> None:
    """Fire the armed action if this point (and step) is armed and its count is reached."""
    if not _specs:
        return
    with _lock:
        fire = None
        for spec in _specs:
            if spec.point != point or (spec.step is not None and spec.step != step):
                continue
            spec.hits += 1
            if spec.hits == spec.nth:
                fire = spec.action
    if fire == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fire == "exit":
        os._exit(70)
    elif fire == "raise":
        raise FaultInjected(f"fault injected at {point} (step {step})")
