"""OOM kills told from other SIGKILLs by the memory cgroup's oom_kill counter, end to end in the launcher."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from sidecar.coordinator import OOM_EXIT_CODE, FailureKind, RestartPolicy, RestartTracker, classify_exit
from sidecar.local import launch
from sidecar.local.oom import OomCounter, read_oom_kills

EVENTS = "low 0\nhigh 0\nmax 3\noom 1\noom_kill {n}\noom_group_kill 0\n"


def test_reads_the_counter_of_memory_events_and_of_v1_oom_control(tmp_path):
    events = tmp_path / "memory.events"
    events.write_text(EVENTS.format(n=4))
    assert read_oom_kills(events) == 4
    control = tmp_path / "memory.oom_control"
    control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert read_oom_kills(control) == 2


@pytest.mark.parametrize("text", [None, "", "oom 1\n", "oom_kill many\n"])
def test_an_unreadable_counter_is_none(tmp_path, text):
    path = tmp_path / "memory.events"
    if text is not None:
        path.write_text(text)
    assert read_oom_kills(path) is None


def fake_proc(tmp_path: Path, cgroup_lines: str) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cgroup").write_text(cgroup_lines)
    return proc, root


def test_finds_the_v2_cgroup_of_a_pid(tmp_path):
    proc, root = fake_proc(tmp_path, "0::/kubepods/pod1/ctr\n")
    (root / "kubepods/pod1/ctr").mkdir(parents=True)
    (root / "kubepods/pod1/ctr/memory.events").write_text(EVENTS.format(n=0))
    found = OomCounter.find(42, proc=proc, root=root)
    assert found == OomCounter(root / "kubepods/pod1/ctr/memory.events", "/kubepods/pod1/ctr")
    assert found.read() == 0


def test_finds_the_v1_memory_cgroup_or_the_mount_root_in_a_container(tmp_path):
    proc, root = fake_proc(tmp_path, "5:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n")
    (root / "memory").mkdir(parents=True)
    (root / "memory/memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    found = OomCounter.find(
        42, proc=proc, root=root
    )  # /docker/abc is not mounted: the mount is the container's
    assert found is not None and found.path == root / "memory/memory.oom_control" and found.read() == 7


def test_no_cgroup_files_means_no_counter(tmp_path):
    proc, root = fake_proc(tmp_path, "0::/user.slice\n")
    assert OomCounter.find(42, proc=proc, root=root) is None
    assert OomCounter.find(43, proc=proc, root=root) is None  # no such pid


def gang(tmp_path: Path, script: str, monkeypatch, counter: OomCounter | None) -> launch.Gang:
    monkeypatch.setattr(launch.OomCounter, "find", classmethod(lambda cls, pid="self", **kw: counter))
    settings = launch.LaunchSettings(
        nproc=3,
        command=["sh", "-c", script],
        job="j",
        namespace="default",
        storage=f"file://{tmp_path}",
        s3_endpoint=None,
        workdir=tmp_path,
        policy=RestartPolicy(max_restarts=1, jitter=0),
        hang_timeout_s=0,
        pg_timeout_s=60,
        metrics_port=0,
    )
    (tmp_path / "hb").mkdir(exist_ok=True)
    return launch.Gang(settings, 0, ["/nonexistent.sock"], tmp_path / "hb", "run/0")


def outcome(g: launch.Gang):
    deadline = time.monotonic() + 30
    try:
        while (result := g.poll(0)) is None:
            assert time.monotonic() < deadline, "the gang did not fail"
            time.sleep(0.02)
        return result
    finally:
        g.kill()


# Rank 2 "is OOM-killed": the counter grows, then it dies by SIGKILL; rank 0 then fails on its own.
OOM_RANK_2 = (
    'if [ "$RANK" = 2 ]; then {grow}kill -9 $$; fi; if [ "$RANK" = 0 ]; then sleep 0.3; exit 1; fi; sleep 30'
)


def test_a_sigkill_while_the_cgroup_counted_an_oom_kill_is_an_oom(tmp_path, monkeypatch):
    events = tmp_path / "memory.events"
    events.write_text(EVENTS.format(n=0))
    counter = OomCounter(events, "/job.slice")
    grow = f"printf 'oom 1\\noom_kill 1\\n' > {events}; "
    failure = outcome(gang(tmp_path, OOM_RANK_2.format(grow=grow), monkeypatch, counter))
    assert failure.kind == FailureKind.OOM and failure.rank == 2
    message = failure.describe()
    assert message.startswith(
        "rank 2 was killed by the OOM killer: cgroup /job.slice memory.events oom_kill 0\u21921; "
        "raise that cgroup's memory limit"
    ), message
    decision = RestartTracker(RestartPolicy(max_restarts=1, jitter=0), 3).decide(failure)
    assert decision.restart and decision.reason == "oom"


def test_a_sigkill_without_a_new_oom_kill_stays_a_signal(tmp_path, monkeypatch):
    events = tmp_path / "memory.events"
    events.write_text(EVENTS.format(n=5))  # earlier OOM kills in the cgroup do not count
    failure = outcome(gang(tmp_path, OOM_RANK_2.format(grow=""), monkeypatch, OomCounter(events, "/x")))
    assert failure.kind == FailureKind.SIGNAL and failure.rank == 2
    assert failure.describe() == "rank 2 was killed by SIGKILL"


def test_without_a_readable_cgroup_a_sigkill_stays_a_signal(tmp_path, monkeypatch):
    failure = outcome(gang(tmp_path, OOM_RANK_2.format(grow=""), monkeypatch, None))
    assert failure.kind == FailureKind.SIGNAL and failure.signal == signal.SIGKILL


def test_only_a_kill_is_blamed_on_the_oom_killer(tmp_path, monkeypatch):
    events = tmp_path / "memory.events"
    events.write_text(EVENTS.format(n=0))
    g = gang(tmp_path, "exit 0", monkeypatch, OomCounter(events, "/x"))
    outcome(g)
    events.write_text(EVENTS.format(n=1))
    assert g.classify(1, 3).kind == FailureKind.EXIT_ERROR  # a grown counter, but the rank exited itself
    assert g.classify(1, OOM_EXIT_CODE).kind == FailureKind.OOM  # 128 + SIGKILL, as a shell reports it
    assert classify_exit(OOM_EXIT_CODE, rank=1).kind == FailureKind.SIGNAL


def test_the_real_cgroup_of_this_process_reads_if_present():
    found = OomCounter.find()
    if found is None:
        pytest.skip("no readable memory cgroup here")
    assert isinstance(found.read(), int)
