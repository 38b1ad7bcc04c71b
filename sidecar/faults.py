"""Fault injection points, for tests and chaos runs only.

Code marks places where a crash matters with ``fault_point("name", step=...)``.
Nothing happens unless *both* the test-only switch ``STRATA_TEST_FAULTS=1`` is set
and ``STRATA_FAULTS`` (or :func:`arm`) names that point::

    STRATA_TEST_FAULTS=1 STRATA_FAULTS="client.stream.chunk@40#3=kill"

means: on the 3rd time ``client.stream.chunk`` is reached while saving step 40,
SIGKILL this process. The step (``@S``) and count (``#N``, default 1) are
optional. Actions: ``kill`` (SIGKILL self), ``exit`` (``os._exit(70)``),
``raise`` (raise :class:`FaultInjected`). Several specs are comma-separated.
Kill points come from here rather than from sleeps, so a test hits exactly the
window it means to.

Nothing is read at import: the environment is read at the first fault point. A
stray ``STRATA_FAULTS`` without the switch is ignored with one warning (a
production process never kills itself because of a leftover variable); a
malformed value with the switch raises :class:`FaultSpecError` naming the bad
entry, at that first fault point and at every one after it.

This module lives outside ``sidecar.api`` (the wire contract) on purpose: it is
test machinery, which the trainer client may import (see the import contracts in
pyproject.toml), and it imports nothing but the standard library.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENV_VAR = "STRATA_FAULTS"
#: The explicit test-only switch: fault specs are honoured only when it is "1".
SWITCH_VAR = "STRATA_TEST_FAULTS"
_ACTIONS = ("kill", "exit", "raise")


class FaultInjected(RuntimeError):
    """Raised at an armed point whose action is ``raise``."""


class FaultSpecError(ValueError):
    """``STRATA_FAULTS`` (or :func:`arm`'s text) has an entry that does not parse."""


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
        problem = None if sep and action in _ACTIONS else f"action must be one of {'|'.join(_ACTIONS)}"
        nth: int | None = 1
        step: int | None = None
        if problem is None and "#" in where:
            where, count = where.split("#", 1)
            nth = _int(count)
            if nth is None or nth < 1:
                problem = f"count #{count} must be a positive integer"
        if problem is None and "@" in where:
            where, at = where.split("@", 1)
            step = _int(at)
            if step is None:
                problem = f"step @{at} must be an integer"
        if problem is None and not where:
            problem = "the point name is empty"
        if problem is not None:
            raise FaultSpecError(
                f"{ENV_VAR}: bad entry {part!r} ({problem}); "
                "entries look like point[@step][#nth]=kill|exit|raise"
            )
        assert nth is not None
        specs.append(_Spec(where, step, nth, action))
    return specs


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


_lock = threading.Lock()
#: None until the environment is read (at the first fault point) or :func:`arm` is called.
_specs: list[_Spec] | None = None


def _from_environment() -> list[_Spec]:
    text = os.environ.get(ENV_VAR, "")
    if not text.strip():
        return []
    if os.environ.get(SWITCH_VAR) != "1":
        log.warning(
            "%s is set (%r) but ignored: fault injection is test-only and needs %s=1 as well",
            ENV_VAR,
            text,
            SWITCH_VAR,
        )
        return []
    return parse(text)


def arm(text: str | None) -> None:
    """Replace the armed points (tests in one process use this; an explicit call needs no switch).

    ``None`` forgets them, so the next fault point reads the environment again.
    """
    global _specs
    specs = None if text is None else parse(text)
    with _lock:
        _specs = specs


def fault_point(point: str, step: int | None = None) -> None:
    """Fire the armed action if this point (and step) is armed and its count is reached."""
    global _specs
    specs = _specs
    if specs is not None and not specs:
        return  # the common case: nothing armed
    with _lock:
        if _specs is None:
            _specs = _from_environment()  # FaultSpecError leaves it unread: every point raises
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
