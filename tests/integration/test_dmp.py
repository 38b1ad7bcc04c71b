"""TorchRec's DistributedModelParallel (ShardedTensor state) through client.save / client.resume:
2 gloo rank processes, a real sidecar, real storage. client.save goes through DCP
(dcp.async_save staged by StrataWriter), client.resume through dcp.load, resharded by DCP's
planner: a resume after the newest save, with the tables placed on each other's rank, loads bitwise
and continues bitwise as the uninterrupted run, each rank's random streams where that rank left
them; an optimizer whose lazy state does not exist yet
is refused, naming what to call (through DCP and without)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from statecheck import assert_bitwise_equal
from test_dcp import run_ranks

from sidecar import manifest as mf
from trainer_client import RestoreError

pytestmark = [
    pytest.mark.torchrec,
    # fbgemm-gpu-cpu warns, on import, of GPU-only lookups it lacks and of its own module moves
    pytest.mark.filterwarnings("ignore::DeprecationWarning:fbgemm_gpu"),
]

RANKS = Path(__file__).with_name("dmp_ranks.py")


def merged(out: Path, world: int, part: str) -> dict[str, torch.Tensor]:
    """The ranks' snapshots as one state: each ShardedTensor assembled from every rank's shards."""
    full: dict[str, torch.Tensor] = {}
    for rank in range(world):
        snap = torch.load(f"{out}.{rank}", weights_only=True)[part]
        for name, entry in snap.items():
            if entry[0] == "dense":  # replicated (DDP): every rank holds the same
                assert torch.equal(full.setdefault(name, entry[1]), entry[1]), name
                continue
            _, size, shards = entry
            for offsets, t in shards:  # none on a rank that holds no shard of it
                whole = full.setdefault(name, torch.full(size, float("nan"), dtype=t.dtype))
                region = whole
                for dim, (o, n) in enumerate(zip(offsets, t.shape, strict=True)):
                    region = region.narrow(dim, o, n)
                region.copy_(t)
    return full


def test_dmp_saves_and_resumes_through_the_client_resharded_by_dcp(make_sidecar, job_name, tmp_path):
    server = make_sidecar()

    def run(generation: str, world: int, *args: str) -> list[dict]:
        return run_ranks(server.socket_path, job_name, generation, world, *args, script=RANKS)

    # An uninterrupted run of 6 steps that saved steps 1..3 (the "kill" after step 3's save).
    a = tmp_path / "a"
    wrote = run("dmp/0", 2, "train", str(a), "6", "3")
    assert [r["resumed"] for r in wrote] == [None, None]
    assert [r["staged"] for r in wrote] == [[True] * 3] * 2  # client.save returned once staged
    assert [r["durable"] for r in wrote] == [3, 3]
    assert mf.committed_steps(server.store, "default", job_name) == [1, 2, 3]
    commit = mf.read_commit(server.store, "default", job_name, 3)
    assert commit.world_size == 2 and mf.load_manifest(server.store, commit, 0).dcp
    saved, final = merged(a, 2, "saved"), merged(a, 2, "final")
    assert not any(t.isnan().any() for t in saved.values())  # every table shard was written

    # Resumed with the tables on each other's rank: each rank reads the table the other saved
    # (DCP reshards). First without the optimizer's lazy state: refused before anything is
    # loaded, naming the optimizer and what to call (DCP would leave that state unloaded).
    b = tmp_path / "b"
    resumed = run("dmp/1", 2, "resume", str(b), "6", "1,0")
    for r in resumed:
        assert r["refused"].startswith("state['optimizer'] (CombinedOptimizer): the checkpoint holds")
        assert "optimizer.init_state()" in r["refused"]
    # then bitwise both at the resume and after the 3 more steps the uninterrupted run took
    assert [(r["step"], r["saved_by"]) for r in resumed] == [(3, 2), (3, 2)]
    assert_bitwise_equal(merged(b, 2, "loaded"), saved)
    assert_bitwise_equal(merged(b, 2, "final"), final)
    # each rank draws on from its own streams as saved (DCP alone keeps the coordinator's values)
    assert wrote[0]["draws"] != wrote[1]["draws"]
    assert [r["draws"] for r in resumed] == [r["draws"] for r in wrote]


@pytest.mark.parametrize("route", ["segment", "stream"])
def test_a_torchrec_optimizer_without_its_lazy_state_is_refused_naming_init_state(
    make_sidecar, make_client, job_name, route
):
    """client.save / client.resume without DCP (one process, TorchRec's KeyedOptimizer): a resume
    into an optimizer whose lazy state does not exist yet says what to call, not only
    "Different parameter count", before any tensor of the state is written (from a shared
    segment, restored straight into the live tensors, or streamed over gRPC)."""
    from tests.fixtures import dlrm

    server = make_sidecar(**({} if route == "segment" else {"shm_dir": ""}))
    model, opt = dlrm.build("plain")
    dlrm.train_step(model, opt, dlrm.batch(dlrm.Shape(), 0, 0))
    client = make_client(server, job_name)
    client.save(1, dlrm.state_of(model, opt)).result(30)

    model, opt = dlrm.build("plain", seed=1, init_state=False)
    before = dlrm.snapshot(model, opt)
    other = make_client(server, job_name)
    with pytest.raises(RestoreError) as exc:
        other.resume(dlrm.state_of(model, opt))
    assert str(exc.value).startswith(
        "step 1 does not fit this state: state['optimizer']: the optimizer (CombinedOptimizer) has "
        "state for 2 parameters, the checkpoint for 10: create its state before resuming (TorchRec: "
        "optimizer.init_state();"
    )
    # refused before anything was written: not even the model's tensors, which come first
    assert_bitwise_equal(dlrm.snapshot(model, opt), before)
    opt.init_state()  # type: ignore[operator]
    assert other.resume(dlrm.state_of(model, opt)) == 1
    assert other.last_restore is not None
    assert other.last_restore["shared_memory"] == (route == "segment")
