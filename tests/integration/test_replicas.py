"""Replica-aware saves over real gRPC and storage: a tensor replicated across the data-parallel
group is saved by one rank, every rank restores the whole state bit for bit (from the owner's
snapshot in its sidecar's memory, else storage), and replicas that disagree fail the commit with
their names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from sidecar import manifest as mf
from sidecar.api import pb, pb_grpc
from sidecar.gang import sign_fetch
from sidecar.store import open_store
from trainer_client import SaveFailed, _tree
from trainer_client._replicas import tensor_key


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
    assert [m.format_version for m in saved] == [mf.FORMAT_VERSION] * 2  # older readers read it too
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


def test_two_pods_fetch_the_other_owners_share_from_its_sidecars_memory(two_pods, make_client, job_name):
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
        # the other owner's snapshot lives in the other pod's sidecar: fetched from its memory
        assert client.last_restore["replica_sources"] == {1 - rank: "peer"}
    for pod in pods:
        assert pod.metrics.replica_reads.labels(job_name, "peer")._value.get() == 1
        assert pod.metrics.replica_read_bytes.labels(job_name, "peer")._value.get() > 0


def test_bytes_without_the_jobs_stream_mac_are_not_used(two_pods, make_client, job_name, monkeypatch):
    """A peer (or anything on the way) whose stream does not carry the job's MAC: the fetch is
    dropped and the share is read from storage, bit for bit."""
    make = two_pods[0]
    pods = make()
    clients, states = ranks(make_client, pods, job_name)
    for h in [c.save(5, s) for c, s in zip(clients, states, strict=True)]:
        h.durable.result(60)
    serve = pods[1].engine.serve_fetch
    monkeypatch.setattr(pods[1].engine, "serve_fetch", lambda req: (*serve(req)[:2], b"\x00" * 32))
    target = fresh(0)
    assert clients[0].restore(target) == 5
    assert clients[0].last_restore["replica_sources"] == {1: "storage"}
    for name, tensor in flat(states[0]).items():
        assert torch.equal(flat(target)[name], tensor), name


def test_a_peer_serves_only_signed_fresh_requests_for_what_it_holds(two_pods, make_client, job_name):
    """The peer port answers holders of the job's peer key (kept in the job's storage prefix), within
    a minute of the request, from memory only."""
    make = two_pods[0]
    pods = make()
    clients, states = ranks(make_client, pods, job_name)
    for h in [c.save(5, s) for c, s in zip(clients, states, strict=True)]:
        h.durable.result(60)
    key = mf.peer_key(pods[0].store, "default", job_name)
    assert key == mf.peer_key(pods[1].store, "default", job_name)  # one key per job, created once
    stub = pb_grpc.PeerStub(grpc.insecure_channel(f"127.0.0.1:{pods[1].peer_port}"))

    def fetch(rank: int, **change: object) -> list[pb.RestoreResponse]:
        req = pb.FetchRequest(
            namespace="default",
            job=job_name,
            rank=rank,
            world_size=2,
            attempt=0,
            step=5,
            issued_at=time.time(),
        )
        commit = mf.read_commit(pods[0].store, "default", job_name, 5)
        req.attempt = commit.attempt
        sign_fetch(key, req)
        for field, value in change.items():
            setattr(req, field, value)
        return list(stub.Fetch(req, timeout=10))

    served = fetch(1)
    assert served[0].header.source == "peer" and served[0].header.total_bytes > 0
    assert sum(len(m.chunk) for m in served[1:]) == served[0].header.total_bytes
    for change, code in (
        ({"mac": "0" * 64}, grpc.StatusCode.UNAUTHENTICATED),
        ({"step": 4}, grpc.StatusCode.UNAUTHENTICATED),  # signed for another step
        ({"issued_at": time.time() - 600}, grpc.StatusCode.UNAUTHENTICATED),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            fetch(1, **change)
        assert refused.value.code() == code, change
    with pytest.raises(grpc.RpcError) as elsewhere:
        fetch(0)  # rank 0 is the other pod's: this one does not hold it
    assert elsewhere.value.code() == grpc.StatusCode.NOT_FOUND


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
        with pytest.raises(SaveFailed, match=r"replicated tensors of step 1 disagree") as raised:
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


def test_the_manifest_shows_who_holds_what(make_sidecar, make_client, job_name, short_tmp):
    server = make_sidecar()
    clients, states = ranks(make_client, [server, server], job_name)
    for h in [c.save(1, s) for c, s in zip(clients, states, strict=True)]:
        h.durable.result(30)
    raw = json.loads(server.store.get(mf.read_commit(server.store, "default", job_name, 1).manifests[1].key))
    entry = raw["replicas"][0]
    assert set(entry) == {"name", "index", "owner", "dtype", "shape", "nbytes", "sample"}
    assert entry["owner"] in (0, 1) and len(entry["sample"]) == 8
    store = ["--storage", f"file://{short_tmp}/store", "--job", job_name]
    shown = _cli("show", *store, "--step", "1", "--rank", "1")
    assert shown.returncode == 0, shown.stderr
    assert "replicated tensors: this rank saved" in shown.stdout and "on rank 0" in shown.stdout
    verified = _cli("verify", *store, "--step", "1")
    assert verified.returncode == 0 and "step 1: OK" in verified.stdout, verified.stdout + verified.stderr


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_"))}
    return subprocess.run([STRATA, *args], capture_output=True, text=True, env=clean, timeout=60)


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
    restarts, and each rank gets the other owner's share (from the other pod's sidecar, which kept
    it in memory): the run ends bitwise equal to an uninterrupted one."""
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


def test_ddp_wrappers_in_the_state_are_found_and_their_ignored_parameters_stay_per_rank(
    make_sidecar, make_client, job_name, tmp_path
):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        inner = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4), "fc": torch.nn.Linear(4, 2)})
        inner._ddp_params_and_buffers_to_ignore = ["emb.weight"]  # a model-parallel shard inside DDP
        ddp = torch.nn.parallel.DistributedDataParallel(inner)
        opt = torch.optim.Adam(ddp.parameters())
        ddp.module["fc"](torch.randn(3, 4)).sum().backward()
        opt.step()
        client = make_client(make_sidecar(), job_name)
        groups = client._replica_groups({"model": ddp, "opt": opt})
        key = tensor_key
        assert key(inner["fc"].weight) in groups and key(inner["fc"].bias) in groups
        assert key(opt.state[inner["fc"].weight]["exp_avg"]) in groups  # their optimizer state too
        assert key(inner["emb"].weight) not in groups
        # declared through the wrapper when the state holds the inner module
        client.replicate(ddp)
        assert key(inner["fc"].weight) in client._replica_groups({"model": inner, "opt": opt})
        del ddp
    finally:
        dist.destroy_process_group()
