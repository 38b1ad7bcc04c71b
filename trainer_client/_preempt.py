"""SIGTERM for the save on SIGTERM: the handler only notes the time; the training loop's next
``save()`` (a safe point) does the rest. A watchdog ends the process when no safe point comes
within the budget (the loop blocked in a collective, or done saving), and a client closed after
an unhandled SIGTERM delivers it again, so a deferred SIGTERM is never lost."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

log = logging.getLogger("strata.client")


class SigtermWatch:
    """Installs a SIGTERM handler that records when the signal came and then calls the handler
    it replaced, when that one is a Python function (SIG_DFL and SIG_IGN are not called: the
    process must live on to save). ``uninstall`` puts the previous handler back."""

    #: seconds after the budget the watchdog waits for the save's own exit
    MARGIN_S = 2.0

    def __init__(self, budget_s: float | None = None) -> None:
        #: time.monotonic() of the first SIGTERM since install (or of a peer's, see ``mark``)
        self.at: float | None = None
        #: the save on SIGTERM ran (the process exits through Preempted, not by redelivery)
        self.handled = False
        self.budget_s = budget_s
        self._previous: Any = None
        self._installed = False
        self._watchdog: threading.Timer | None = None

    @property
    def fired(self) -> bool:
        return self.at is not None

    def install(self) -> bool:
        """False (and SIGTERM left alone) outside the main thread, where Python cannot set one."""
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "save_on_sigterm: the client was created outside the main thread; SIGTERM is left alone"
            )
            return False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True
        return True

    def mark(self) -> None:
        """Preempted without a signal of our own (a peer rank got it): the same path follows."""
        if self.at is None:
            self.at = time.monotonic()
            self._arm_watchdog()

    def _arm_watchdog(self) -> None:
        if self.budget_s is None or self._watchdog is not None:
            return
        self._watchdog = threading.Timer(self.budget_s + self.MARGIN_S, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expire(self) -> None:
        log.error(
            "SIGTERM %.0f s ago and the save on SIGTERM did not end the process (no save() reached, "
            "or it hangs): exiting now with status 143",
            time.monotonic() - (self.at or time.monotonic()),
        )
        logging.shutdown()
        os._exit(143)  # an incomplete save stream is dropped by the sidecar, never committed

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.at is None:
            self.at = time.monotonic()
            self._arm_watchdog()
        previous = self._previous
        if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
            previous(signum, frame)

    def uninstall(self) -> None:
        """Restore the previous handler, if ours is still the one installed (a handler installed
        after ours chains to ours and is left alone). A SIGTERM that came and was not handled
        by a save is then delivered again to the restored default handler."""
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._installed = False
        if signal.getsignal(signal.SIGTERM) == self._handle:
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(signal.SIGTERM, previous)
            if self.at is not None and not self.handled and previous == signal.SIG_DFL:
                log.warning("closing after a SIGTERM no save() handled: terminating as it asked")
                os.kill(os.getpid(), signal.SIGTERM)
