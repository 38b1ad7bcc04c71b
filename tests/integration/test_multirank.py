"""Job-level consistency with several ranks, and `strata launch` gang restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from sidecar import manifest as mf
from trainer_client import SaveFailed, SaveSkipped

ROOT = Path(__file__).resolve().parents[2]
STRATA = str(Path(sys.executable).parent / "strata")
DDP = ROOT / "deploy" / "examples" / "train_ddp.py"
DDP_ARGS = ["--steps", "30", "--save-every", "5", "--rows", "2000", "--batch", "128", "--tables", "2"]


def test_a_step_commits_only_when_every_rank_saved_it(make_sidecar, make_client, job_name):
    server = make_sidecar()
    # one gang generation for both ranks: they run as one attempt
    ranks = [make_client(server, job_name, rank=r, world_size=2, generation="mr/0") for r in range(2)]
    h0 = ranks[0].save(1, {"w": torch.zeros(4)})
    assert not h0.durable.done() or h0.durable.exception() is None
    assert not mf.is_committed(server.store, "default", job_name, 1)
    h1 = ranks[1].save(1, {"w": torch.ones(4)})
    assert h0.durable.result(30).step == h1.durable.result(30).step == 1
    commit = mf.read_commit(server.store, "default", job_name, 1)
    assert [m.rank for m in commit.manifests] == [0, 1]
    out = [{"w": torch.empty(4)} for _ in range(2)]
    for r in range(2):
        assert ranks[r].restore(out[r]) == 1
    assert torch.equal(out[0]["w"], torch.zeros(4)) and torch.equal(out[1]["w"], torch.ones(4))


def test_a_skip_on_one_rank_fails_the_step_on_every_rank_at_once(
    make_sidecar, make_client, job_name, monkeypatch
):
    server = make_sidecar(commit_timeout_s=120)  # the failure must come from the skip, not a timeout
    rank0 = make_client(server, job_name, rank=0, world_size=2, when_busy="wait", generation="mr/0")
    rank1 = make_client(server, job_name, rank=1, world_size=2, generation="mr/0")
    gate = threading.Event()
    original = rank1._requests

    def held(*args, **kwargs):
        gate.wait(30)
        yield from original(*args, **kwargs)

    monkeypatch.setattr(rank1, "_requests", held)
    r1_step1 = rank1.save(1, {"w": torch.ones(4)})  # rank 1's stream of step 1 is held ...
    r0_step1 = rank0.save(1, {"w": torch.zeros(4)})
    r1_step2 = rank1.save(2, {"w": torch.ones(4)})  # ... so rank 1 skips step 2
    assert r1_step2.skipped
    with pytest.raises(SaveSkipped):
        r1_step2.durable.result(5)
    # Release rank 1's held stream first: rank 0 (when_busy="wait") waits in save() for step 1 to
    # become durable, which needs that stream.
    gate.set()
    r0_step2 = rank0.save(2, {"w": torch.zeros(4)})
    assert r0_step1.durable.result(30).step == r1_step1.durable.result(30).step == 1
    # Rank 0's step 2 fails as soon as it is its turn, naming the rank that skipped.
    with pytest.raises(SaveFailed, match=r"rank\(s\) \[1\] did not save it"):
        r0_step2.durable.result(15)
    assert mf.committed_steps(server.store, "default", job_name) == [1]


def launch(
    *args: str, env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [STRATA, "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, **(env or {})),
        cwd=ROOT,
    )


# 3 ranks: gloo's ring sums in an order that depends on DDP's bucket layout, which the example
# keeps fixed (find_unused_parameters=True) so that the resumed run is bitwise too.
@pytest.mark.parametrize("nproc", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_launch_restarts_the_whole_gang_and_resumes_bitwise(tmp_path, nproc):
    out, ref = tmp_path / "out.json", tmp_path / "ref.json"
    faults = {
        "STRATA_FAULTS": "client.stream.chunk@19#1=kill",
        "STRATA_FAULTS_RANK": "1",
        "STRATA_TEST_FAULTS": "1",
    }
    run = launch(
        "--nproc",
        str(nproc),
        "--job",
        "gang",
        "--workdir",
        str(tmp_path / "w1"),
        "--backoff-s",
        "0.1",
        "--",
        sys.executable,
        str(DDP),
        *DDP_ARGS,
        "--out",
        str(out),
        env=faults,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"rank 1 was killed by SIGKILL; restarting all {nproc} ranks" in run.stderr
    assert json.loads(out.read_text())["resumed_from"] == 14  # step 19 was torn; 14 is the newest committed
    reference = launch(
        "--nproc",
        str(nproc),
        "--job",
        "gang-ref",
        "--storage",
        f"file://{tmp_path}/ref-store",
        "--workdir",
        str(tmp_path / "w2"),
        "--",
        sys.executable,
        str(DDP),
        *DDP_ARGS,
        "--no-checkpoint",
        "--out",
        str(ref),
    )
    assert reference.returncode == 0, reference.stdout + reference.stderr
    assert json.loads(out.read_text())["digest"] == json.loads(ref.read_text())["digest"]


def test_launch_gives_up_after_the_restart_limit(tmp_path):
    run = launch(
        "--nproc",
        "2",
        "--storage",
        f"file://{tmp_path}/store",
        "--workdir",
        str(tmp_path / "w"),
        "--max-restarts",
        "1",
        "--backoff-s",
        "0",
        "--",
        sys.executable,
        "-c",
        "import sys; sys.exit(3)",
    )
    assert run.returncode == 3
    assert "restart 1 of 1" in run.stderr and "restart limit reached (1 of 1), giving up" in run.stderr


def test_launch_refuses_a_changed_world_size(tmp_path):
    store = f"file://{tmp_path}/store"
    first = launch(
        "--nproc",
        "2",
        "--job",
        "ws",
        "--storage",
        store,
        "--workdir",
        str(tmp_path / "w"),
        "--",
        sys.executable,
        str(DDP),
        *DDP_ARGS,
    )
    assert first.returncode == 0, first.stdout + first.stderr
    second = launch(
        "--nproc",
        "3",
        "--job",
        "ws",
        "--storage",
        store,
        "--workdir",
        str(tmp_path / "w"),
        "--",
        sys.executable,
        str(DDP),
        *DDP_ARGS,
    )
    assert second.returncode == 2
    assert "saved by 2 ranks but the job now has 3" in second.stderr


def test_launch_explains_its_usage_errors():
    run = launch("--nproc", "2")
    assert run.returncode != 0 and "give the training command after --" in run.stderr


LOADER = ROOT / "deploy" / "examples" / "train_loader.py"


@pytest.mark.parametrize(
    ("loader", "workers"),
    [
        pytest.param("stateful", 0, marks=pytest.mark.slow),  # the worker case covers make test
        ("stateful", 2),
        pytest.param("resumable", 2, marks=pytest.mark.slow),
    ],
)
def test_a_default_loader_killed_and_resumed_by_launch_is_bitwise(tmp_path, loader, workers):
    """A new user's loop (default loader without its own generator, shuffle, dropout, worker
    augmentations) killed mid-epoch and resumed by `strata launch` ends bit-identical, parameters
    and global RNG, to an uninterrupted run."""
    out, ref = tmp_path / "out.json", tmp_path / "ref.json"
    args = ["--loader", loader, "--workers", str(workers)]
    run = launch(
        "--nproc",
        "1",
        "--job",
        f"loader-{loader}",
        "--workdir",
        str(tmp_path / "w1"),
        "--backoff-s",
        "0.1",
        "--",
        sys.executable,
        str(LOADER),
        *args,
        "--out",
        str(out),
        # killed right after step 12's save was acknowledged: mid-epoch 1 (7 batches an epoch)
        env={"STRATA_FAULTS": "client.saved@12=kill", "STRATA_FAULTS_RANK": "0", "STRATA_TEST_FAULTS": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "was killed by SIGKILL" in run.stderr
    assert json.loads(out.read_text())["resumed_from"] in (8, 12)
    reference = subprocess.run(
        [sys.executable, str(LOADER), *args, "--no-checkpoint", "--out", str(ref)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reference.returncode == 0, reference.stdout + reference.stderr
    assert json.loads(out.read_text())["digest"] == json.loads(ref.read_text())["digest"]
