"""Shared memory of trainers that are gone does not accumulate: a trainer killed after resume()
and before its first save (its two staging segments are made at resume, before any save) leaves
nothing the sidecar holds or the shm dir keeps across a crash loop, and a live trainer's
segments are never removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import settled

from sidecar import shm as shm_module
from sidecar.api.shm_owners import OwnerLock, remove_orphans

ROOT = Path(__file__).resolve().parents[2]

#: Starts a trainer per line read (``<job> <socket>``): a forked child (torch is imported once,
#: here) that resumes (nothing to restore), has its segments made, says its pid and their names,
#: and waits to be killed.
LAUNCHER = """
import ctypes, os, signal, sys, time, torch
from trainer_client import CheckpointClient
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # killed children are reaped by the kernel
for line in sys.stdin:
    job, sock = line.split()
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: none outlives a failed test
        client = CheckpointClient(job=job, socket=sock, capture_rng=False, connect_timeout_s=30)
        client.resume({"w": torch.zeros(64, 256)})
        client._wait_warm()
        print(os.getpid(), *(b.segment.name for b in client._buffers), flush=True)
        time.sleep(300)
        os._exit(0)
"""


class Launcher:
    """Starts trainer processes, one at a time."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def start(self, server: Any, job: str) -> tuple[int, list[str]]:
        """A new trainer of ``job`` on ``server``, once its segments are made: its pid and their
        names."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(f"{job} {server.socket_path}\n")
        self._proc.stdin.flush()
        pid, *names = self._proc.stdout.readline().split()
        assert len(names) == 1, f"the trainer did not start (launcher: {self._proc.poll()})"
        return int(pid), names

    def close(self) -> None:
        self._proc.kill()
        self._proc.communicate()


@pytest.fixture(scope="module")
def launcher() -> Iterator[Launcher]:
    started = Launcher()
    yield started
    started.close()


def segment_files(server: Any) -> set[str]:
    """Files under trainers' segment names (neither the sidecar's held ones nor dot files)."""
    return {f for f in os.listdir(server.settings.shm_dir) if f.startswith("strata-") and "-held-" not in f}


def memfds_held() -> set[str]:
    """The names of the memfds this process (the sidecar's) holds open."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:strata-"):
            names.add(target.removeprefix("/memfd:").split(" ")[0])
    return names


def no_socket(*args: Any, **kwargs: Any) -> Any:
    raise OSError("no handover socket here")


@pytest.mark.parametrize("handover", [True, False], ids=["memfd", "files"])
def test_trainers_killed_before_their_first_save_leave_nothing_behind(
    make_sidecar, make_client, job_name, monkeypatch, handover, launcher
):
    if not handover:  # a sidecar that offers no handover socket: trainers stage into files
        monkeypatch.setattr(shm_module, "Handover", no_socket)
    server = make_sidecar()
    # A live trainer of another job on the same sidecar, its segments made and never saved from.
    live = make_client(server, f"{job_name}-live", capture_rng=False)
    live.resume({"w": torch.zeros(64, 256)})
    live._wait_warm()
    mine = {b.segment.name for b in live._buffers if b.segment is not None}
    assert len(mine) == 1 and segment_files(server) == (set() if handover else mine)  # one by default

    killed: list[str] = []
    for _ in range(3):  # a crash loop
        pid, names = launcher.start(server, job_name)
        # Its predecessor's segments go: this trainer removes them when their lock is free already,
        # else the sidecar, a second after that trainer's connection ended (a SIGKILLed process
        # may still hold its lock for a moment on a loaded machine).
        assert settled(lambda gone=set(killed): gone & segment_files(server), set()) == set()
        if handover:
            assert set(names) <= memfds_held()  # handed over, held until a save or the trainer goes
        else:
            assert set(names) <= segment_files(server)
        os.kill(pid, signal.SIGKILL)
        killed += names

    dead = set(killed)
    assert settled(lambda: segment_files(server) & dead, set()) == set()
    assert settled(lambda: memfds_held() & dead, set()) == set()
    handover_socket = server.engine.segments._handover
    assert handover_socket is None or settled(lambda: len(handover_socket._pending), len(mine)) == len(mine)
    assert server.engine.segments._maps == {}

    # The live trainer's segments were never touched; it saves through them.
    assert segment_files(server) == (set() if handover else mine)
    assert live.save(1, {"w": torch.ones(64, 256)}).durable.result(30).step == 1
    assert {n for m in server.engine.segments._maps.values() for n in m} <= mine


def test_only_files_whose_owner_lock_is_free_are_removed(short_tmp):
    shm = short_tmp / "shm"
    shm.mkdir()
    live = OwnerLock(str(shm), "live")
    for name in ("strata-live-0", "strata-gone-0", "strata-gone-1", "strata-older-0", "strata-gone-x"):
        (shm / name).write_bytes(b"x")
    (shm / ".strata-owner-gone").touch()  # its creator died: nobody holds the lock
    os.symlink(shm / "strata-live-0", shm / "strata-gone-2")  # never followed
    assert sorted(remove_orphans(str(shm))) == ["strata-gone-0", "strata-gone-1"]
    # The live owner's files stay; so do an older client's (it holds no owner lock: nothing
    # proves it gone), a name that is no segment's, and the link (not a file).
    assert sorted(os.listdir(shm)) == [
        ".strata-owner-live",
        "strata-gone-2",
        "strata-gone-x",
        "strata-live-0",
        "strata-older-0",
    ]
    # A descriptor of the lock a forked child inherited keeps it after the trainer died.
    child = os.dup(live.fd)
    live._closer()  # the trainer's own descriptor closes (it is killed)
    assert remove_orphans(str(shm)) == [] and (shm / "strata-live-0").exists()
    os.close(child)
    assert remove_orphans(str(shm)) == ["strata-live-0"]
    assert not (shm / ".strata-owner-live").exists()
    # A client that closes removes its lock file itself.
    closing = OwnerLock(str(shm), "closing")
    closing.release()
    assert not os.path.exists(closing.path)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_an_owner_file_another_user_made_removes_nothing(short_tmp):
    shm = short_tmp / "shm"
    shm.mkdir()
    (shm / "strata-victim-0").write_bytes(b"x")  # an older client's: it takes no owner lock
    forged = shm / ".strata-owner-victim"
    forged.touch()
    os.chown(forged, 54321, 54321)
    assert remove_orphans(str(shm)) == [] and (shm / "strata-victim-0").exists()


def test_an_owner_lock_lost_to_a_sweeper_is_made_again(short_tmp, monkeypatch):
    """A sweeper that takes a new owner file's lock between its creator's create and flock sees
    no owner and removes the file: the creator waits for the unlink and creates it again, rather
    than giving up shared memory."""
    import fcntl
    import threading
    import time

    import sidecar.api.shm_owners as owners

    real_flock, real_unlink = fcntl.flock, os.unlink
    sweeper: list[threading.Thread] = []

    def flock(fd: int, op: int) -> None:
        if not sweeper and threading.current_thread() is threading.main_thread():
            sweeper.append(threading.Thread(target=remove_orphans, args=(str(short_tmp),)))
            sweeper[0].start()
            time.sleep(0.05)  # the sweeper holds the lock now, and unlinks late
        real_flock(fd, op)

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.2)
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(owners.fcntl, "flock", flock)
    monkeypatch.setattr(owners.os, "unlink", unlink)
    lock = OwnerLock(str(short_tmp), "abc123")
    sweeper[0].join()
    assert os.path.exists(lock.path) and os.fstat(lock.fd).st_ino == os.lstat(lock.path).st_ino
    lock.release()
