"""Replica-aware saves over real gRPC and storage: a tensor replicated across the data-parallel
group is saved by one rank, every rank restores the whole state bit for bit (from the owner's
snapshot in its sidecar's memory, else storage), and replicas that disagree fail the commit with
their names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sidecar import manifest as mf
from sidecar.store import open_store
from trainer_client import SaveFailed, _tree


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and its Adam state after one identical step (what DDP leaves on every rank)."""
    m = model(seed)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    torch.manual_seed(99)
    m(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    return m, opt


def state_of(rank: int) -> dict:
    m, opt = trained()
    return {"model": m, "opt": opt, "private": torch.full((16,), float(rank)), "epoch": 3}


def fresh(rank: int) -> dict:
    """A state to restore into: other values everywhere, the same layout (Adam's state exists)."""
    m, opt = trained(seed=7)
    return {"model": m, "opt": opt, "private": torch.zeros(16), "epoch": 0}


def flat(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    for i, per in state["opt"].state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v for k, v in per.items() if isinstance(v, torch.Tensor)})
    out["private"] = state["private"]
    return out


def manifests(url: str, job: str, step: int, endpoint: str | None = None) -> list[mf.Manifest]:
    store = open_store(url, s3_endpoint=endpoint) if endpoint else open_store(url)
    commit = mf.read_commit(store, "default", job, step)
    return [mf.load_manifest(store, commit, r) for r in range(commit.world_size)]


def ranks(make_client, servers, job, **options):
    clients = [
        make_client(servers[r], job, rank=r, world_size=2, generation="dp/0", capture_rng=False, **options)
        for r in range(2)
    ]
    states = [state_of(r) for r in range(2)]
    for client, state in zip(clients, states, strict=True):
        client.replicate(state["model"], group=[0, 1])
    return clients, states


def test_replicated_tensors_are_saved_once_and_every_rank_restores_them(make_sidecar, make_client, job_name):
    server = make_sidecar()
    clients, states = ranks(make_client, [server, server], job_name)
    handles = [c.save(1, s) for c, s in zip(clients, states, strict=True)]
    for h in handles:
        assert h.durable.result(30).step == 1
    saved = manifests(server.settings.storage, job_name, 1)
    assert [m.format_version for m in saved] == [mf.REPLICAS_FORMAT_VERSION] * 2
    replicated = {n for n, _ in _tree.flatten(states[0]).tensors if n != "private"}
    owners: dict[str, list[int]] = {}
    for m in saved:
        for t in m.tensors:
            owners.setdefault(t.name, []).append(m.rank)
        assert {r.name for r in m.replicas} == replicated  # every rank lists them all
    # every replicated tensor is stored by exactly one rank, the private one by both
    assert owners.pop("private") == [0, 1]
    assert all(len(who) == 1 for who in owners.values()), owners
    assert set(owners) == {r.name for r in saved[0].replicas}
    # spread: each rank carries about half of the replicated bytes
    per_rank = [sum(t.nbytes for t in m.tensors if t.name != "private") for m in saved]
    assert min(per_rank) > 0.4 * sum(per_rank), per_rank
    assert clients[1].stats["last_replica_bytes_skipped"] == per_rank[0]
    # both ranks come back whole and bitwise, from this sidecar's memory
    for rank, client in enumerate(clients):
        target = fresh(rank)
        assert client.restore(target) == 1
        for name, tensor in flat(states[rank]).items():
            assert torch.equal(flat(target)[name], tensor), (rank, name)
        assert target["epoch"] == 3
        assert client.last_restore is not None
        assert client.last_restore["replica_sources"] == {1 - rank: "memory"}


def test_two_pods_fetch_the_other_owners_share_from_storage(two_pods, make_client, job_name):
    make = two_pods[0]
    pods = make()
    clients, states = ranks(make_client, pods, job_name)
    for h in [c.save(5, s) for c, s in zip(clients, states, strict=True)]:
        h.durable.result(60)
    for rank, client in enumerate(clients):
        target = fresh(rank)
        assert client.restore(target) == 5
        for name, tensor in flat(states[rank]).items():
            assert torch.equal(flat(target)[name], tensor), (rank, name)
        # the other owner's snapshot lives in the other pod's sidecar: this one reads storage
        assert client.last_restore["replica_sources"] == {1 - rank: "storage"}


def test_a_lost_owner_still_leaves_every_rank_the_full_state(make_sidecar, make_client, job_name, short_tmp):
    """The owner's sidecar is gone (its pod and memory with it): the new sidecar restores its share
    from storage for every rank."""
    store = f"file://{short_tmp}/store"
    first = make_sidecar(store)
    clients, states = ranks(make_client, [first, first], job_name)
    for h in [c.save(2, s) for c, s in zip(clients, states, strict=True)]:
        h.durable.result(30)
    for c in clients:
        c.close()
    first.stop(grace=1)
    second = make_sidecar(store, socket=str(short_tmp / "second.sock"))
    restarted = [
        make_client(second, job_name, rank=r, world_size=2, generation="dp/1", capture_rng=False)
        for r in range(2)
    ]
    for rank, client in enumerate(restarted):
        target = fresh(rank)
        client.replicate(target["model"], group=[0, 1])
        assert client.restore(target) == 2
        assert client.last_restore["source"] == "storage"
        for name, tensor in flat(states[rank]).items():
            assert torch.equal(flat(target)[name], tensor), (rank, name)


def test_replicas_that_disagree_are_named_and_nothing_commits(make_sidecar, make_client, job_name):
    server = make_sidecar()
    clients, states = ranks(make_client, [server, server], job_name)
    with torch.no_grad():
        states[1]["model"][2].bias.add_(1e-3)  # rank 1's replica drifted (a DDP bug)
    handles = [c.save(1, s) for c, s in zip(clients, states, strict=True)]
    for h in handles:
        with pytest.raises(SaveFailed, match=r"replicated tensors disagree") as raised:
            h.durable.result(30)
    message = str(raised.value)
    assert "model.2.bias: rank 1's replica differs from its owner rank 0's" in message or (
        "model.2.bias: rank 0's replica differs from its owner rank 1's" in message
    ), message
    assert mf.committed_steps(server.store, "default", job_name) == []


def test_replicas_off_saves_everything_on_every_rank(make_sidecar, make_client, job_name):
    server = make_sidecar()
    clients, states = ranks(make_client, [server, server], job_name, replicas="off")
    for h in [c.save(1, s) for c, s in zip(clients, states, strict=True)]:
        h.durable.result(30)
    saved = manifests(server.settings.storage, job_name, 1)
    assert [m.replicas for m in saved] == [[], []]
    assert [m.format_version for m in saved] == [mf.FORMAT_VERSION] * 2
    assert {t.name for t in saved[0].tensors} == {t.name for t in saved[1].tensors}


def test_the_manifest_shows_who_holds_what(make_sidecar, make_client, job_name):
    server = make_sidecar()
    clients, states = ranks(make_client, [server, server], job_name)
    for h in [c.save(1, s) for c, s in zip(clients, states, strict=True)]:
        h.durable.result(30)
    raw = json.loads(server.store.get(mf.read_commit(server.store, "default", job_name, 1).manifests[1].key))
    entry = raw["replicas"][0]
    assert set(entry) == {"name", "index", "owner", "dtype", "shape", "nbytes", "sample"}
    assert entry["owner"] in (0, 1) and len(entry["sample"]) == 8


ROOT = Path(__file__).resolve().parents[2]
STRATA = str(Path(sys.executable).parent / "strata")
DDP = ROOT / "deploy" / "examples" / "train_ddp.py"
DDP_ARGS = ["--steps", "30", "--save-every", "5", "--rows", "2000", "--batch", "128", "--tables", "2"]


def _launch(tmp: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [STRATA, "launch", "--nproc", "2", "--workdir", str(tmp), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **(env or {})),
        cwd=ROOT,
    )


def test_ddp_over_two_pods_saves_each_replica_once_and_survives_a_killed_owner(tmp_path):
    """DDP (the example declares its wrapper) over two simulated pods: each parameter and its
    optimizer state is stored by one rank; rank 1 is SIGKILLed while saving step 19, the gang
    restarts, and each rank gets the other owner's share from storage: the run ends bitwise equal
    to an uninterrupted one."""
    store = f"file://{tmp_path}/store"
    out, ref = tmp_path / "out.json", tmp_path / "ref.json"
    kill = {
        "STRATA_FAULTS": "client.stream.chunk@19#1=kill",
        "STRATA_FAULTS_RANK": "1",
        "STRATA_TEST_FAULTS": "1",
    }
    run = _launch(
        tmp_path / "w1",
        *("--sidecars", "2", "--job", "dp", "--storage", store, "--backoff-s", "0.1", "--"),
        *(sys.executable, str(DDP), *DDP_ARGS, "--out", str(out)),
        env=kill,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "rank 1 was killed by SIGKILL" in run.stderr
    assert json.loads(out.read_text())["resumed_from"] == 14
    saved = manifests(store, "dp", 29)
    stored = [{t.name for t in m.tensors} for m in saved]
    replicated = {r.name for r in saved[0].replicas}
    assert replicated and replicated == {r.name for r in saved[1].replicas}
    assert not (stored[0] & stored[1] & replicated)  # no replicated tensor stored twice
    assert replicated <= stored[0] | stored[1]
    assert stored[0] - replicated and stored[1] - replicated  # the data readers stay per rank
    reference = _launch(
        tmp_path / "w2",
        *("--job", "dp-ref", "--storage", f"file://{tmp_path}/ref-store", "--"),
        *(sys.executable, str(DDP), *DDP_ARGS, "--no-checkpoint", "--out", str(ref)),
    )
    assert reference.returncode == 0, reference.stdout + reference.stderr
    assert json.loads(out.read_text())["digest"] == json.loads(ref.read_text())["digest"]
