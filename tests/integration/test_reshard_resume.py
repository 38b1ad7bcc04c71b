"""``client.resume()`` of a step another number of ranks saved, without DCP: replicated state (DDP
parameters and their optimizer state, declared with ``client.replicate``) and plain values every
rank saved alike come back bit for bit on 1 and on 3 ranks from the snapshots of the ranks that
saved them; per-rank tensors that are not replicas, values that differ between ranks and per-rank
data-reader positions are refused by name (nothing of the live state changes); the first
checkpoint after a resharded restore is full."""

from __future__ import annotations

import pytest
import torch

from sidecar import manifest as mf
from sidecar.reporting import stored_commit_items
from sidecar.store import open_store
from trainer_client import RestoreError
from trainer_client.data import ResumableDistributedSampler


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and its Adam state after one identical step (what DDP leaves on every rank)."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    torch.manual_seed(99)
    m(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    return m, opt


def flat(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    for i, per in state["opt"].state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v for k, v in per.items() if isinstance(v, torch.Tensor)})
    if "private" in state:
        out["private"] = state["private"]
    return out


def manifests(url: str, job: str, step: int) -> list[mf.Manifest]:
    store = open_store(url)
    commit = mf.read_commit(store, "default", job, step)
    return [mf.load_manifest(store, commit, r) for r in range(commit.world_size)]


def ddp_state(rank: int) -> dict:
    m, opt = trained()
    return {"model": m, "opt": opt, "epoch": 3, "lr": [1e-3, 0.5]}


def fresh_ddp(rank: int) -> dict:
    """Other values everywhere, the same layout (Adam's state exists)."""
    m, opt = trained(seed=7)
    return {"model": m, "opt": opt, "epoch": 0, "lr": [0.0, 0.0]}


def save_on_two(make_client, server, job, states, steps=(1,), **options):
    clients = [make_client(server, job, rank=r, world_size=2, generation="dp/0", **options) for r in range(2)]
    for client, state in zip(clients, states, strict=True):
        client.replicate(state["model"], group=[0, 1])
    for step in steps:
        for h in [c.save(step, s) for c, s in zip(clients, states, strict=True)]:
            h.result(60)
    for c in clients:
        c.close()


def assert_restored(target: dict, saved: dict) -> None:
    want, got = flat(saved), flat(target)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
        assert got[name].dtype == tensor.dtype
    assert (target["epoch"], target["lr"]) == (saved["epoch"], saved["lr"])


def test_replicated_state_saved_by_two_ranks_restores_on_three_and_on_one(
    make_sidecar, make_client, job_name
):
    server = make_sidecar()
    states = [ddp_state(r) for r in range(2)]
    save_on_two(make_client, server, job_name, states, steps=(1, 2))  # RNG states captured too
    saved = manifests(server.settings.storage, job_name, 2)
    assert all(m.replicas for m in saved)
    # reshardable for the launcher and the operator: every tensor a replica (the RNG states aside)
    assert mf.replicated(saved) and not any(m.dcp for m in saved)
    commit = mf.read_commit(server.store, "default", job_name, 2)
    [item] = stored_commit_items(server.store, "default", job_name, "file://x", [(commit.attempt, 2)])
    assert item["reshardable"] is True and item["world_size"] == 2

    # 2 -> 3: every rank gets the whole state; rank 2 (new) takes rank 0's tree
    three = [make_client(server, job_name, rank=r, world_size=3, generation="dp/1") for r in range(3)]
    targets = [fresh_ddp(r) for r in range(3)]
    for client, target in zip(three, targets, strict=True):
        client.replicate(target["model"])
        assert client.resume(target) == 2
        assert_restored(target, states[0])
        assert client.last_restore is not None and client.last_restore["saved_by"] == 2
        assert set(client.last_restore["replica_sources"]) == {0, 1}  # both owners read
    assert server.metrics.reshard_reads.labels(job_name, "memory")._value.get() > 0
    # the first save after it commits on the 3 ranks, each a full checkpoint
    for h in [c.save(3, t) for c, t in zip(three, targets, strict=True)]:
        h.result(60)
    saved3 = manifests(server.settings.storage, job_name, 3)
    assert [m.world_size for m in saved3] == [3, 3, 3]
    assert [m.checkpoint for m in saved3] == ["full"] * 3
    for c in three:
        c.close()

    # 2 -> 1 (an older step, named) and 3 -> 1 (the newest)
    one = make_client(server, job_name, generation="dp/2")
    target = fresh_ddp(0)
    assert one.restore(target, step=2) == 2
    assert_restored(target, states[0])
    target = fresh_ddp(0)
    assert one.resume(target) == 3
    assert_restored(target, states[0])
    assert one.last_restore is not None and one.last_restore["saved_by"] == 3


def test_per_rank_tensors_and_values_are_named_and_refused(make_sidecar, make_client, job_name):
    server = make_sidecar()
    states = [ddp_state(r) for r in range(2)]
    for r, state in enumerate(states):
        state["private"] = torch.full((16,), float(r))  # each rank's own, not a replica
        state["seen"] = 100 + r  # a plain value that differs
    save_on_two(make_client, server, job_name, states, capture_rng=False)
    assert not mf.replicated(manifests(server.settings.storage, job_name, 1))
    one = make_client(server, job_name, generation="one/0", capture_rng=False)
    target = fresh_ddp(0)
    target["private"], target["seen"] = torch.zeros(16), 0
    before = {k: v.clone() for k, v in flat(target).items()}
    with pytest.raises(RestoreError) as err:
        one.resume(target)
    msg = str(err.value)
    assert "step 1 of default/" in msg and "saved by 2 ranks; this job runs 1" in msg
    assert "not declared replicated" in msg and "state['private']" in msg
    assert "values that differ between the 2 ranks: state['seen']" in msg
    assert "client.replicate" in msg and "StrataWriter" in msg
    assert "state['model']" not in msg and "state['opt']" not in msg  # replicas are fine
    assert all(torch.equal(flat(target)[k], v) for k, v in before.items())  # nothing was loaded
    assert target["seen"] == 0


def test_a_per_rank_data_reader_is_refused_naming_all_ranks_state(make_sidecar, make_client, job_name):
    server = make_sidecar()
    states = [ddp_state(r) for r in range(2)]
    for r, state in enumerate(states):
        state["data"] = ResumableDistributedSampler(64, num_replicas=2, rank=r, shuffle=False)
    save_on_two(make_client, server, job_name, states, capture_rng=False)
    one = make_client(server, job_name, generation="one/0", capture_rng=False)
    target = fresh_ddp(0)
    target["data"] = ResumableDistributedSampler(64, num_replicas=1, rank=0, shuffle=False)
    with pytest.raises(RestoreError, match=r"state\['data'\] \(ResumableDistributedSampler\).*AllRanksState"):
        one.resume(target)


def test_first_save_after_a_resharded_restore_is_full(make_sidecar, make_client, job_name):
    """One replicated tensor, owned by rank 0: what rank 0 of the 1-rank job saves next has the
    layout of what rank 0 of the 2-rank job saved, so it would be a diff but for the chain ending."""
    server = make_sidecar()
    w = torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256)
    states = [{"w": w.clone()} for _ in range(2)]
    old = [
        make_client(server, job_name, rank=r, world_size=2, generation="two/0", capture_rng=False)
        for r in range(2)
    ]
    for client, state in zip(old, states, strict=True):
        client.replicate(state["w"], group=[0, 1])
    for h in [c.save(4, s) for c, s in zip(old, states, strict=True)]:
        h.result(60)
    for c in old:
        c.close()
    saved = manifests(server.settings.storage, job_name, 4)
    assert [[t.name for t in m.tensors] for m in saved] == [["w"], []]
    one = make_client(server, job_name, generation="one/0", capture_rng=False)
    target = {"w": torch.zeros(64, 256)}
    assert one.resume(target) == 4
    assert torch.equal(target["w"], w)
    target["w"][0] += 1  # one row changed
    one.save(5, target).result(60)
    commit = mf.read_commit(server.store, "default", job_name, 5)
    assert commit.world_size == 1
    assert mf.load_manifest(server.store, commit, 0).checkpoint == "full"
