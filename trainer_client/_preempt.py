"""SIGTERM for the save on SIGTERM: the handler only notes the time; the training loop's next
``save()`` (a safe point) does the rest."""

from __future__ import annotations

import logging
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

    def __init__(self) -> None:
        #: time.monotonic() of the first SIGTERM since install, or None
        self.at: float | None = None
        self._previous: Any = None
        self._installed = False

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

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.at is None:
            self.at = time.monotonic()
        previous = self._previous
        if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
            previous(signum, frame)

    def uninstall(self) -> None:
        """Restore the previous handler, if ours is still the one installed (a handler installed
        after ours chains to ours and is left alone)."""
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._installed = False
        if signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
