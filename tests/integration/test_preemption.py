"""A save on SIGTERM: real trainer processes, a real SIGTERM at random points, real gRPC, real S3
(SeaweedFS). After the exit the newest committed step is the one saved on SIGTERM whenever the
budget allowed it, never a torn one; a budget too small exits at once with an older complete
step; a survivor of a dead peer exits at once without saving; `strata launch` forwards its
SIGTERM to ranks and sidecars, and the sidecar keeps serving the trainer's last save."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import torch
from statecheck import assert_bitwise_equal

from sidecar import cli
from sidecar import manifest as mf
from sidecar.store import open_store

TRAINER = textwrap.dedent(
    """
    import sys, time, torch
    from trainer_client import CheckpointClient, Preempted

    def state_of(step, rows):
        return {
            "w": torch.arange(rows * 1024, dtype=torch.float32).reshape(rows, 1024) + step,
            "b": torch.full((1000,), step, dtype=torch.float64),
        }

    every, delay, rows = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    client = CheckpointClient(capture_rng=False, resume="never")
    state = state_of(0, rows)
    print("READY", flush=True)
    try:
        for step in range(100_000):
            state.update(state_of(step, rows))
            if step % every == 0 or client.preempted:
                client.save(step, state)
                print("SAVED", step, flush=True)
            time.sleep(delay)
    except Preempted as p:
        print(f"PREEMPTED step={p.step} saved={p.saved} reason={p.reason}", flush=True)
        raise
    """
)
PREEMPTED = re.compile(r"PREEMPTED step=(\S+) saved=(True|False) reason=(.*)")


def state_of(step: int, rows: int) -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(rows * 1024, dtype=torch.float32).reshape(rows, 1024) + step,
        "b": torch.full((1000,), step, dtype=torch.float64),
    }


def start_trainer(
    socket: str, job: str, budget: float, every: int = 3, delay: float = 0.02, rows: int = 256, **env: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(every), str(delay), str(rows)],
        env=dict(
            os.environ,
            STRATA_SOCKET=socket,
            STRATA_JOB=job,
            STRATA_SAVE_ON_SIGTERM_S=str(budget),
            PYTHONUNBUFFERED="1",
            **env,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_line(proc: subprocess.Popen[str], pattern: str, timeout: float = 60) -> list[str]:
    """Read ``proc``'s output until a line matches; returns the lines read."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if re.search(pattern, line):
            return lines
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(lines)}")


def preempted(out: str) -> tuple[int | None, bool, str]:
    found = PREEMPTED.search(out)
    assert found, out
    step = None if found.group(1) == "None" else int(found.group(1))
    return step, found.group(2) == "True", found.group(3)


def verify_all(url: str, endpoint: str, job: str) -> None:
    """Every committed step re-reads with every checksum right (`strata verify --all`)."""
    assert cli.main(["verify", "--storage", url, "--s3-endpoint", endpoint, "--job", job, "--all"]) == 0


def test_sigterm_at_random_points_commits_the_step_saved_on_sigterm(
    make_sidecar, make_client, s3_store_url, job_name
):
    url, endpoint = s3_store_url
    server = make_sidecar(url, s3_endpoint=endpoint)
    rng = random.Random()
    trials = [f"{job_name}-{i}" for i in range(4)]
    procs = [start_trainer(server.socket_path, job, budget=20) for job in trials]
    for proc in procs:
        wait_for_line(proc, r"SAVED 3\b")
    # Each trainer is hit at its own random point: mid-save, mid-upload, between saves.
    order = list(zip(trials, procs, strict=True))
    for _job, proc in order:
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGTERM)
    store = open_store(url, endpoint_url=endpoint)
    try:
        for job, proc in order:
            out, _ = proc.communicate(timeout=40)
            assert proc.returncode == 143, out
            step, saved, reason = preempted(out)
            assert saved, reason  # 20 s is plenty for 1 MiB on loopback
            assert "Traceback" not in out
            assert mf.newest_committed(store, "default", job) == step
            assert mf.committed_steps(store, "default", job)[-1] == step
            restored = state_of(-1, 256)
            assert make_client(server, job, capture_rng=False).restore(restored) == step
            assert_bitwise_equal(restored, state_of(step, 256))
            verify_all(url, endpoint, job)
    finally:
        store.close()


def test_a_budget_too_small_exits_at_once_with_an_older_complete_step(make_sidecar, s3_store_url, job_name):
    url, endpoint = s3_store_url
    server = make_sidecar(url, s3_endpoint=endpoint)
    # 32 MiB streamed over gRPC: no save fits in 10 ms.
    proc = start_trainer(
        server.socket_path, job_name, budget=0.01, every=4, delay=0.05, rows=8192, STRATA_SHM="off"
    )
    wait_for_line(proc, r"SAVED 8\b")
    time.sleep(random.uniform(0.0, 0.3))
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode == 143, out
    _, saved, reason = preempted(out)
    assert not saved and reason, out
    assert took < 5, took
    regular = [int(s) for s in re.findall(r"SAVED (\d+)", out)] + [0, 4, 8]
    store = open_store(url, endpoint_url=endpoint)
    try:
        time.sleep(1.0)  # let the sidecar settle what it still uploads of an earlier save
        newest = mf.newest_committed(store, "default", job_name)
        assert newest is not None and newest % 4 == 0 and newest in regular, (newest, out)
        verify_all(url, endpoint, job_name)
    finally:
        store.close()


def test_a_survivor_of_a_dead_peer_exits_at_once_without_saving(make_sidecar, s3_store_url, job_name):
    url, endpoint = s3_store_url
    server = make_sidecar(url, s3_endpoint=endpoint, commit_timeout_s=120)
    ranks = [
        start_trainer(
            server.socket_path,
            job_name,
            budget=60,
            every=2,
            delay=0.05,
            STRATA_RANK=str(r),
            STRATA_WORLD_SIZE="2",
            STRATA_GENERATION="peer-gone/0",
        )
        for r in range(2)
    ]
    for proc in ranks:
        wait_for_line(proc, r"SAVED 4\b")
    store = open_store(url, endpoint_url=endpoint)
    deadline = time.monotonic() + 30
    while mf.newest_committed(store, "default", job_name) is None:  # both ranks are well under way
        assert time.monotonic() < deadline, "the gang never committed a step"
        time.sleep(0.1)
    store.close()
    ranks[1].kill()  # a node lost: its trainer dies without a word
    ranks[1].communicate(timeout=10)
    time.sleep(0.5)
    t0 = time.monotonic()
    ranks[0].send_signal(signal.SIGTERM)  # the gang restart evicts the survivor
    out, _ = ranks[0].communicate(timeout=60)
    took = time.monotonic() - t0
    assert ranks[0].returncode == 143, out
    _, saved, reason = preempted(out)
    assert not saved and "left attempt" in reason, out
    assert took < 5, took  # well under its 60 s budget


def test_strata_launch_forwards_sigterm_and_its_sidecar_serves_the_last_save(s3_store_url, short_tmp):
    """SIGTERM to `strata launch` reaches the rank and the sidecar at once (a pod without native
    sidecars): the sidecar keeps serving until the trainer's save on SIGTERM is durable."""
    url, endpoint = s3_store_url
    job = "launch-" + uuid.uuid4().hex[:8]  # a temporary directory's name may end in "_" (not a job name)
    script = short_tmp / "train.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "strata"),
            "launch",
            "--nproc",
            "1",
            "--storage",
            url,
            "--s3-endpoint",
            endpoint,
            "--job",
            job,
            "--workdir",
            str(short_tmp / "w"),
            "--keep",
            "0",
            "--",
            sys.executable,
            str(script),
            "3",
            "0.02",
            "256",
        ],
        env=dict(os.environ, STRATA_SAVE_ON_SIGTERM_S="20", PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_line(proc, r"SAVED 6\b")
    except BaseException:
        proc.kill()  # never leave it running into the next test
        proc.communicate()
        raise
    time.sleep(random.uniform(0.0, 0.3))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    step, saved, reason = preempted(out)
    assert saved, reason
    store = open_store(url, endpoint_url=endpoint)
    try:
        assert mf.newest_committed(store, "default", job) == step
    finally:
        store.close()
    verify_all(url, endpoint, job)
    log = (short_tmp / "w" / "sidecar.log").read_text()
    assert "serving 1 attached trainer" in log or "finishing uploads" in log, log


GANG_TRAINER = textwrap.dedent(
    """
    import os, sys, time, torch, torch.distributed as dist
    from trainer_client import CheckpointClient, Preempted

    dist.init_process_group("gloo", rank=int(os.environ["STRATA_RANK"]), world_size=2)
    client = CheckpointClient(capture_rng=False, resume="never")
    state = {"w": torch.zeros(4096)}
    print("READY", flush=True)
    try:
        for step in range(100_000):
            t = torch.ones(1)
            dist.all_reduce(t)  # a collective every step, as DDP's
            state["w"].fill_(step)
            if step % 50 == 0 or client.preempted:
                client.save(step, state)
                print("SAVED", step, flush=True)
            time.sleep(0.02)
    except Preempted as p:
        print(f"PREEMPTED step={p.step} saved={p.saved} reason={p.reason}", flush=True)
        raise
    """
)


def test_ranks_signalled_apart_agree_on_the_step_they_save(make_sidecar, s3_store_url, job_name):
    """SIGTERM reaches the ranks at different steps (or only one node's): ``preempted`` is a
    collective, so every rank saves the same step, it commits, and every rank exits 143."""
    import socket

    url, endpoint = s3_store_url
    server = make_sidecar(url, s3_endpoint=endpoint, commit_timeout_s=60)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", GANG_TRAINER],
            env=dict(
                os.environ,
                STRATA_SOCKET=server.socket_path,
                STRATA_JOB=job_name,
                STRATA_RANK=str(r),
                STRATA_WORLD_SIZE="2",
                STRATA_GENERATION="apart/0",
                STRATA_SAVE_ON_SIGTERM_S="20",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                PYTHONUNBUFFERED="1",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    for proc in ranks:
        wait_for_line(proc, r"SAVED 50\b")
    ranks[0].send_signal(signal.SIGTERM)  # only rank 0's node is drained
    outs = [p.communicate(timeout=60)[0] for p in ranks]
    results = [preempted(out) for out in outs]
    assert [p.returncode for p in ranks] == [143, 143], outs
    assert all(saved for _, saved, _ in results), outs
    steps = {step for step, _, _ in results}
    assert len(steps) == 1, results  # the same step on both ranks
    store = open_store(url, endpoint_url=endpoint)
    try:
        assert mf.newest_committed(store, "default", job_name) == steps.pop()
    finally:
        store.close()
    verify_all(url, endpoint, job_name)
