"""A lost member's share rebuilt down a chain of its group's survivors, over real gRPC: each
survivor XORs its part into the stream the one before passed it, so the rebuilt member receives
its share's bytes once (not the parity plus every survivor's share). A survivor that fails
mid-stream or sends more than the share fails the rebuild (storage then, never a pull of
what the chain refused); a survivor's wrong bytes are caught by the rank's digests; a survivor
without chains (an older sidecar) makes the member pull as before; a chain request not signed
with the job's key gets nothing."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from sidecar import manifest as mf
from sidecar import redundancy as rd
from sidecar.api import pb
from sidecar.engine.redundancy import Redundancy, _Upstream
from sidecar.errors import FailedPrecondition
from sidecar.gang import PEER_PROTOCOL, PeerStub
from sidecar.store import open_store
from tests.fixtures.member_pods import Pods, check_equal, data_gets, restore_all, save_all, settled


@pytest.fixture
def pods(short_tmp):
    made: list[Pods] = []

    def make(n: int, **options: Any) -> Pods:
        made.append(Pods(short_tmp, n, "parity", parity_group=n, **options))
        return made[-1]

    yield make
    for p in made:
        p.close()


def protected_then_lost(p: Pods, job: str, lost: int) -> int:
    """Every member saves step 3 and pushes its parity; member ``lost`` is then lost (its pod,
    memory and emptyDir) and replaced. Returns the lost share's size, as the survivors hold it."""
    for c in save_all(p, job, 3):
        c.close()
    assert settled(lambda: p.pushed(job, "parity"), [1.0] * p.n) == [1.0] * p.n
    holder = p.servers[(lost + 1) % p.n]
    assert holder is not None and holder.engine.redundancy.holdings is not None
    (entry,) = holder.engine.redundancy.holdings.complete.values()
    (header,) = [h for h in entry.headers if h.member == lost]
    p.stop(lost, wipe=True)
    p.start(lost)
    return int(header.share_bytes)


def rebuilds(p: Pods, i: int, job: str, outcome: str) -> float:
    server = p.servers[i]
    assert server is not None
    return float(server.metrics.peer_rebuilds.labels(job, "parity", outcome)._value.get())


def received(p: Pods, i: int, job: str) -> float:
    server = p.servers[i]
    assert server is not None
    return float(server.metrics.peer_rebuild_received_bytes.labels(job, "parity")._value.get())


def hop_of(p: Pods, i: int, change: Any) -> None:
    """Member ``i`` serves its hop through ``change(chunks)``."""
    server = p.servers[i]
    assert server is not None

    def hop(*args: Any) -> Iterator[memoryview]:
        return change(Redundancy._hop(*args))

    server.engine.redundancy._hop = hop  # type: ignore[method-assign]


@pytest.mark.parametrize("n", [3, 4])
def test_the_lost_member_receives_one_share_down_the_chain_and_comes_back_bit_for_bit(pods, job_name, n):
    p = pods(n)
    lost = 1
    share = protected_then_lost(p, job_name, lost)
    results = restore_all(p, job_name, "run/1")
    for i, (target, info) in enumerate(results):
        check_equal(target, i, 3)
        assert info["source"] == ("peer" if i == lost else "memory"), (i, info)
    assert data_gets(p, lost, job_name) == []
    assert rebuilds(p, lost, job_name, "ok") == 1
    assert received(p, lost, job_name) == share  # pulling took the parity and n-1 shares


@pytest.mark.parametrize("how", ["fails", "oversized"])
def test_a_survivor_failing_mid_chain_fails_the_rebuild_cleanly_and_storage_serves(
    pods, job_name, how, caplog
):
    """Member 2 begins the chain 2 -> 3 -> 0 -> (1): after two good chunks it fails, or sends a
    chunk longer than the share's next; member 3 refuses, and the failure reaches member 1."""
    p = pods(4)
    lost = 1
    protected_then_lost(p, job_name, lost)

    def broken(chunks: Iterator[memoryview]) -> Iterator[memoryview]:
        for k, chunk in enumerate(chunks):
            if k == 2:
                if how == "fails":
                    raise FailedPrecondition("this survivor's memory is gone")
                yield memoryview(bytes(chunk) + b"\0")
            yield chunk

    hop_of(p, 2, broken)
    with caplog.at_level(logging.WARNING, logger="sidecar.engine.redundancy"):
        results = restore_all(p, job_name, "run/1")
    check_equal(results[lost][0], lost, 3)
    assert results[lost][1]["source"] == "storage"
    assert data_gets(p, lost, job_name)
    assert rebuilds(p, lost, job_name, "failed") == 1 and rebuilds(p, lost, job_name, "ok") == 0
    assert "the chain through members [2, 3, 0] failed" in caplog.text
    why = "memory is gone" if how == "fails" else "a chunk other than the share's next"
    assert why in caplog.text
    assert "pulling" not in caplog.text  # a failed chain is not retried another way


def test_a_lying_survivors_bytes_fail_the_digests_and_storage_serves(pods, job_name, caplog):
    """A survivor that holds the job's key can send wrong bytes under a valid stream tag: the
    rebuilt share is checked against the rank's MANIFEST digests, and storage serves it."""
    p = pods(3)
    lost = 0
    protected_then_lost(p, job_name, lost)

    def lying(chunks: Iterator[memoryview]) -> Iterator[memoryview]:
        for k, chunk in enumerate(chunks):
            if k == 1:
                chunk[100] ^= 0x01
            yield chunk

    hop_of(p, 2, lying)
    with caplog.at_level(logging.ERROR, logger="sidecar.engine.restore"):
        results = restore_all(p, job_name, "run/1")
    check_equal(results[lost][0], lost, 3)
    assert results[lost][1]["source"] == "storage"
    assert "rebuilt from parity differs from what was saved" in caplog.text
    assert rebuilds(p, lost, job_name, "failed") == 1


def test_a_survivor_without_chains_makes_the_member_pull_as_before(pods, job_name, caplog):
    """An older sidecar answers UNIMPLEMENTED (here the first hop, passed on by the next): the
    member pulls the parity and the shares, and comes back as before, at n-1 shares' bytes."""
    p = pods(3)
    lost = 0
    share = protected_then_lost(p, job_name, lost)
    old = p.servers[1]
    assert old is not None

    def unimplemented(*args: Any) -> Any:
        raise _Upstream(grpc.StatusCode.UNIMPLEMENTED, "no chains here")

    old.engine.redundancy.serve_chain = unimplemented  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="sidecar.engine.redundancy"):
        results = restore_all(p, job_name, "run/1")
    check_equal(results[lost][0], lost, 3)
    assert results[lost][1]["source"] == "peer"
    assert "pulling" in caplog.text
    assert received(p, lost, job_name) > 2 * share


def test_a_chain_request_is_signed_bounded_and_answered_once(pods, job_name):
    p = pods(3)
    protected_then_lost(p, job_name, 0)
    key = mf.peer_key(open_store(p.storage), "default", job_name, create=False)
    stub = PeerStub(grpc.insecure_channel(f"127.0.0.1:{p.ports[2]}"))
    attempt = next(iter(p.servers[2].engine.redundancy.holdings.complete.values())).position[0]  # type: ignore[union-attr]

    def ask(chain: list[int], mac_key: bytes = key, req: pb.ChainRequest | None = None) -> Any:
        if req is None:
            req = pb.ChainRequest(namespace="default", job=job_name, attempt=attempt, step=3, member=0)
            req.chain[:] = chain
            req.issued_at, req.protocol, req.nonce = time.time(), PEER_PROTOCOL, os.urandom(16)
            req.mac = rd.chain_mac(mac_key, req)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Chain(req, timeout=10))
        return refused.value.code(), req

    assert ask([1, 2], mac_key=b"x" * 32)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert ask([2, 1])[0] == grpc.StatusCode.INVALID_ARGUMENT  # member 2 is not the last
    assert ask([0, 2])[0] == grpc.StatusCode.INVALID_ARGUMENT  # the lost member is no survivor
    # A good request is answered once: a replay is refused.
    req = pb.ChainRequest(namespace="default", job=job_name, attempt=attempt, step=3, member=0, chain=[1, 2])
    req.issued_at, req.protocol, req.nonce = time.time(), PEER_PROTOCOL, os.urandom(16)
    req.mac = rd.chain_mac(key, req)
    assert len(list(stub.Chain(req, timeout=10))) > 1
    assert ask([], req=req)[0] == grpc.StatusCode.UNAUTHENTICATED
