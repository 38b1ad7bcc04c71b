"""Redundancy between members over real gRPC: a lost member's share (its sidecar gone with its
memory and its redundancy directory) comes back bit for bit from the other members' memory
(buddy copy or parity rebuild) without reading its objects from storage; two lost members of a
group read storage; a holder restarted mid-build keeps its complete parity, and no half-built
one serves."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from sidecar import manifest as mf
from sidecar import redundancy as rd
from sidecar.api import pb, pb_grpc
from sidecar.gang import PEER_PROTOCOL, STREAM_MAC_KEY, stream_opener
from sidecar.store import open_store
from tests.fixtures.member_pods import (
    Pods,
    check_equal,
    data_gets,
    restore_all,
    save_all,
    settled,
    state_of,
)


@pytest.fixture
def pods(short_tmp):
    made: list[Pods] = []

    def make(n: int, mode: str, **options: Any) -> Pods:
        made.append(Pods(short_tmp, n, mode, **options))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.mark.parametrize("mode,n", [("buddy", 3), ("parity", 4)])
def test_a_lost_member_comes_back_bit_for_bit_from_the_others_without_storage(pods, job_name, mode, n):
    p = pods(n, mode, parity_group=4)
    kind = "replica" if mode == "buddy" else "parity"
    first = save_all(p, job_name, 5)
    assert settled(lambda: p.pushed(job_name, kind), [1.0] * n) == [1.0] * n
    for c in first:
        c.close()
    lost = 1
    p.stop(lost, wipe=True)
    p.start(lost)  # the replacement pod: empty memory, empty emptyDir
    results = restore_all(p, job_name, "run/1")
    for i, (target, info) in enumerate(results):
        check_equal(target, i, 5)
        assert info["source"] == ("peer" if i == lost else "memory"), (i, info)
    assert data_gets(p, lost, job_name) == []
    server = p.servers[lost]
    assert server is not None
    assert server.metrics.restores.labels(job_name, "peer")._value.get() == 1
    how = "replica" if mode == "buddy" else "parity"
    assert server.metrics.peer_rebuilds.labels(job_name, how, "ok")._value.get() == 1


def test_a_restarted_buddy_keeps_its_copies_and_serves_them(pods, job_name):
    p = pods(2, "buddy")
    for c in save_all(p, job_name, 3):
        c.close()
    assert settled(lambda: p.pushed(job_name, "replica"), [1.0, 1.0]) == [1.0, 1.0]
    p.stop(1, wipe=False)  # member 1 holds member 0's copy: a container restart keeps the emptyDir
    p.start(1)
    holdings = p.servers[1].engine.redundancy.holdings  # type: ignore[union-attr]
    assert holdings is not None and [k[2:] for k in holdings.complete] == [("replica", 0)]
    p.stop(0, wipe=True)
    p.start(0)
    results = restore_all(p, job_name, "run/1")
    check_equal(results[0][0], 0, 3)
    assert results[0][1]["source"] == "peer"
    assert data_gets(p, 0, job_name) == []
    # member 1 restarted too: its own snapshot is gone from its memory, and member 0 held its copy
    # in a directory that went with member 0's pod, so member 1 reads storage.
    assert results[1][1]["source"] == "storage"


def test_two_lost_members_of_a_group_read_storage_and_say_why(pods, job_name, caplog):
    p = pods(4, "parity", parity_group=4)
    for c in save_all(p, job_name, 2):
        c.close()
    assert settled(lambda: p.pushed(job_name, "parity"), [1.0] * 4) == [1.0] * 4
    for lost in (1, 2):
        p.stop(lost, wipe=True)
        p.start(lost)
    with caplog.at_level(logging.WARNING, logger="sidecar.engine.redundancy"):
        results = restore_all(p, job_name, "run/1")
    for i, (target, info) in enumerate(results):
        check_equal(target, i, 2)
        assert info["source"] == ("storage" if i in (1, 2) else "memory"), (i, info)
    assert "share cannot be rebuilt" in caplog.text
    assert data_gets(p, 1, job_name)  # it did read its objects


def test_a_holder_restarted_mid_build_keeps_its_complete_parity_and_never_serves_a_half_built_one(
    pods, job_name
):
    p = pods(3, "parity", parity_group=3)
    for c in save_all(p, job_name, 1):
        c.close()
    assert settled(lambda: p.pushed(job_name, "parity"), [1.0] * 3) == [1.0] * 3
    holder = 2
    before = (p.root / f"red{holder}").rglob("data")
    complete = {str(f): f.read_bytes() for f in before}
    assert len(complete) == 1
    # Step 2's pushes crawl (1 MB/s): member 2 is restarted while they build its parity.
    for i in range(3):
        if i != holder:
            server = p.servers[i]
            assert server is not None
            server.engine.redundancy.throttle.rate = 1e6
    clients = save_all(p, job_name, 2, generation="run/0")
    deadline = time.monotonic() + 30
    while not list((p.root / f"red{holder}").rglob(".b-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list((p.root / f"red{holder}").rglob(".b-*")), "no build seen"
    for c in clients:
        c.close(wait=False)
    p.stop(holder, wipe=False)
    restarted = p.start(holder)
    holdings = restarted.engine.redundancy.holdings
    assert holdings is not None
    entries = list(holdings.complete.values())
    assert [e.position[1] for e in entries] == [1]
    assert {str(entries[0].data): entries[0].data.read_bytes()} == complete
    assert not list((p.root / f"red{holder}").rglob(".b-*"))  # the half-built one is gone
    # It answers for step 1 with the parity of members 0 and 1 as they were at step 1 ...
    store = open_store(p.storage)
    key = mf.peer_key(store, "default", job_name, create=False)
    stub = pb_grpc.PeerStub(grpc.insecure_channel(f"127.0.0.1:{p.ports[holder]}"))

    def ask(step: int, mac_key: bytes = key) -> tuple[list[pb.ParityResponse], bytes]:
        attempt = entries[0].position[0]
        req = pb.ParityRequest(namespace="default", job=job_name, attempt=attempt, step=step, member=0)
        req.issued_at, req.protocol, req.nonce = time.time(), PEER_PROTOCOL, os.urandom(16)
        req.mac = rd.parity_mac(mac_key, req)
        call = stub.Parity(req, timeout=10)
        answer = list(call)
        opener = stream_opener(key, req.mac, call)  # the parity travels encrypted
        body = b"".join(opener.update(m.chunk) for m in answer[1:])
        assert opener.verify(dict(call.trailing_metadata())[STREAM_MAC_KEY])
        return answer, body

    answer, body = ask(1)
    assert answer[0].header.holder == holder
    assert sorted(c.member for c in answer[0].header.contributors) == [0, 1]
    assert body == next(iter(complete.values()))
    assert b"".join(m.chunk for m in answer[1:]) != body
    # ... and has none for step 2, rather than a torn one; a request not signed with the job's
    # key gets nothing.
    with pytest.raises(grpc.RpcError) as missing:
        ask(2)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as forged:
        ask(1, mac_key=b"x" * 32)
    assert forged.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_push_not_signed_with_the_jobs_key_is_refused(pods, job_name):
    p = pods(2, "buddy")
    for c in save_all(p, job_name, 1):
        c.close()
    header = pb.ProtectHeader(
        namespace="default",
        job=job_name,
        attempt=0,
        step=9,
        world_size=2,
        member=0,
        kind="replica",
        share_bytes=4,
        issued_at=time.time(),
        protocol=PEER_PROTOCOL,
        nonce=os.urandom(16),
    )
    header.mac = rd.header_mac(b"k" * 32, header)
    stub = pb_grpc.PeerStub(grpc.insecure_channel(f"127.0.0.1:{p.ports[1]}"))
    stream = iter([pb.ProtectRequest(header=header), pb.ProtectRequest(chunk=b"evil")])
    with pytest.raises(grpc.RpcError) as refused:
        stub.Protect(stream, timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


ROOT = Path(__file__).resolve().parents[2]
DDP = ROOT / "deploy" / "examples" / "train_ddp.py"
STRATA = str(Path(sys.executable).parent / "strata")
RESUMED = re.compile(r"RESUMED rank=(\d+) restart=(\d+) step=(\S+) source=(\S+)")


def test_launch_a_killed_sidecar_gets_its_ranks_back_from_its_buddy(tmp_path):
    """`strata launch` with two simulated pods and buddy redundancy: pod 1's sidecar is SIGKILLed
    while receiving step 19 (its memory is gone; a sidecar container restart keeps the emptyDir),
    the gang restarts in place, and rank 1 resumes from pod 0's copy, rank 0 from its own memory."""
    kill = {
        "STRATA_TEST_FAULTS": "1",
        "STRATA_SIDECAR_FAULTS": "sidecar.receive.chunk@19#1=kill",
        "STRATA_SIDECAR_FAULTS_INDEX": "1",
    }
    run = subprocess.run(
        [
            *(STRATA, "launch", "--nproc", "2", "--sidecars", "2", "--redundancy", "buddy"),
            *("--workdir", str(tmp_path / "w"), "--job", "bd", "--storage", f"file://{tmp_path}/store"),
            *("--backoff-s", "0.1", "--", sys.executable, str(DDP), "--steps", "25", "--save-every", "5"),
            # Steps slow enough that step 14's push (after its commit, in the background) is
            # done before step 19 arrives and the sidecar dies; without, it races the kill.
            *("--rows", "2000", "--batch", "128", "--tables", "2", "--step-sleep", "0.05"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **kill),
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "sidecar 1 died" in run.stderr
    resumed = {(int(r), int(a)): (s, src) for r, a, s, src in RESUMED.findall(run.stdout)}
    assert resumed[(0, 1)] == ("14", "memory"), resumed
    assert resumed[(1, 1)] == ("14", "peer"), resumed


def test_what_a_member_holds_for_others_is_bounded_by_its_budget(pods, job_name):
    """Member 1 can hold one copy of member 0's share, not two: the next push is refused
    (the pusher counts it failed) and the complete copy it holds stays and still serves."""
    tensors = [t for t in state_of(0, 1).values() if isinstance(t, torch.Tensor)]
    share = sum(t.numel() * t.element_size() for t in tensors)
    p = pods(2, "buddy", memory_budget=int(share * 1.5))
    clients = save_all(p, job_name, 1)
    assert settled(lambda: p.protected(job_name, 1), True)
    save_all(p, job_name, 2, clients=clients)
    pusher = p.servers[0]
    assert pusher is not None
    failed = pusher.metrics.redundancy_pushes.labels(job_name, "replica", "failed")
    assert settled(lambda: failed._value.get(), 1.0) == 1.0
    holder = p.servers[1]
    assert holder is not None and holder.engine.redundancy.holdings is not None
    held = holder.engine.redundancy.holdings.complete
    assert [(k[2], e.position[1]) for k, e in held.items() if k[1] == job_name] == [("replica", 1)]
    assert holder.metrics.memory_refusals.labels("redundancy")._value.get() >= 1


def test_a_repeated_push_is_refused_and_the_held_copy_stays(pods, job_name):
    """A push of a step already held (a retry, or a replay on the wire within its minute) is
    refused before a byte is written: the complete copy stays and still restores."""
    p = pods(2, "buddy")
    for c in save_all(p, job_name, 4):
        c.close()
    assert settled(lambda: p.protected(job_name, 4), True)
    holder = p.servers[1]
    assert holder is not None and holder.engine.redundancy.holdings is not None
    (entry,) = [e for k, e in holder.engine.redundancy.holdings.complete.items() if k[1] == job_name]
    before = entry.data.read_bytes()
    key = mf.peer_key(open_store(p.storage), "default", job_name, create=False)
    header = pb.ProtectHeader()
    header.CopyFrom(entry.headers[0])
    header.issued_at, header.nonce = time.time(), os.urandom(16)
    header.mac = rd.header_mac(key, header)
    stub = pb_grpc.PeerStub(grpc.insecure_channel(f"127.0.0.1:{p.ports[1]}"))
    stream = iter([pb.ProtectRequest(header=header), pb.ProtectRequest(chunk=b"\0" * 16)])
    with pytest.raises(grpc.RpcError) as refused:
        stub.Protect(stream, timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already holds step 4" in (refused.value.details() or "")
    assert entry.data.read_bytes() == before
    p.stop(0, wipe=True)
    p.start(0)
    results = restore_all(p, job_name, "run/1")
    assert results[0][1]["source"] == "peer"
    check_equal(results[0][0], 0, 4)
