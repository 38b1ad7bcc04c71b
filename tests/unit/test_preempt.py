"""The SIGTERM handler of the save on SIGTERM: it notes the signal, chains to the Python handler
it replaced (never to SIG_DFL, which would kill the process before it saves), and puts the
previous handler back on uninstall; the setting reads from the environment."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from trainer_client import ClientSettings, Preempted
from trainer_client._preempt import SigtermWatch


@pytest.fixture(autouse=True)
def restore_sigterm() -> Iterator[None]:
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def _deliver() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(100):  # Python runs the handler between bytecodes of the main thread
        time.sleep(0.001)


def test_the_handler_notes_the_signal_and_chains_to_the_previous_python_handler() -> None:
    seen: list[int] = []

    def previous(signum: int, _frame: object) -> None:
        seen.append(signum)

    signal.signal(signal.SIGTERM, previous)
    watch = SigtermWatch()
    assert watch.install() and not watch.fired
    before = time.monotonic()
    _deliver()
    assert watch.fired and watch.at is not None and watch.at >= before
    assert seen == [signal.SIGTERM]
    first = watch.at
    _deliver()  # a second SIGTERM keeps the first one's time (the budget runs from it)
    assert watch.at == first and seen == [signal.SIGTERM, signal.SIGTERM]
    watch.uninstall()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_sig_dfl_is_not_chained_and_comes_back_on_uninstall() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    watch = SigtermWatch()
    watch.install()
    _deliver()  # would kill the test process if chained to SIG_DFL
    assert watch.fired
    watch.handled = True  # as after a save on SIGTERM (else uninstall delivers it again)
    watch.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_handler_installed_later_is_left_in_place() -> None:
    watch = SigtermWatch()
    watch.install()

    def later(_signum: int, _frame: object) -> None:
        pass

    signal.signal(signal.SIGTERM, later)
    watch.uninstall()
    assert signal.getsignal(signal.SIGTERM) is later


def test_outside_the_main_thread_sigterm_is_left_alone() -> None:
    before = signal.getsignal(signal.SIGTERM)
    result: list[bool] = []
    watch = SigtermWatch()
    thread = threading.Thread(target=lambda: result.append(watch.install()))
    thread.start()
    thread.join()
    assert result == [False] and signal.getsignal(signal.SIGTERM) is before
    watch.uninstall()  # harmless


def test_preempted_exits_143_and_the_setting_reads_from_the_environment(monkeypatch) -> None:
    exc = Preempted(12, True)
    assert isinstance(exc, SystemExit) and exc.code == 143 and exc.step == 12
    monkeypatch.setenv("STRATA_SAVE_ON_SIGTERM_S", "25.5")
    assert ClientSettings.from_env(job="j").save_on_sigterm == 25.5
    monkeypatch.delenv("STRATA_SAVE_ON_SIGTERM_S")
    assert ClientSettings.from_env(job="j").save_on_sigterm is None
    with pytest.raises(ValueError, match="save_on_sigterm"):
        ClientSettings.from_env(job="j", save_on_sigterm=-1)


WATCHED = """
import os, signal, sys, time
from trainer_client._preempt import SigtermWatch
watch = SigtermWatch(budget_s=float(sys.argv[1]))
watch.install()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.05)
if sys.argv[2] == "close":
    watch.uninstall()  # a client closed without any save after the signal
    time.sleep(5)
    print("STILL ALIVE")
else:
    time.sleep(30)  # stuck (a collective with a dead peer): no save() is ever reached
    print("STILL ALIVE")
"""


@pytest.mark.parametrize("how", ["stuck", "close"])
def test_a_deferred_sigterm_is_never_lost(how: str) -> None:
    """Stuck past the budget: the watchdog exits 143. Closed without a save: the SIGTERM is
    delivered again to the default handler."""
    import subprocess
    import sys

    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", WATCHED, "0.5", how], capture_output=True, text=True, timeout=60
    )
    assert "STILL ALIVE" not in proc.stdout
    if how == "stuck":
        assert proc.returncode == 143, proc.stderr
        assert "did not end the process" in proc.stderr
        assert time.monotonic() - t0 < 20
    else:
        assert proc.returncode == -signal.SIGTERM, proc.stderr
