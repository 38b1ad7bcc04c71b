"""The peer port under a hostile neighbour, over real gRPC between real sidecars: hints are signed
and bounded, per-job state is bounded, a signed request is answered once, and the checkpoint bytes
that travel between sidecars are ciphertext."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from sidecar import manifest as mf
from sidecar.api import pb, pb_grpc
from sidecar.engine import state as engine_state
from sidecar.gang import MAX_HINT_TEXT, PEER_PROTOCOL, sign_fetch, sign_hint
from tests.integration.conftest import free_port


def _state(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return {"w": torch.randn(64, 1024, generator=g), "b": torch.randn(1024, generator=g)}


def _peer(pod) -> pb_grpc.PeerStub:
    return pb_grpc.PeerStub(grpc.insecure_channel(f"127.0.0.1:{pod.peer_port}"))


def _save(clients, step: int, states) -> None:
    for h in [c.save(step, s) for c, s in zip(clients, states, strict=True)]:
        assert h.durable.result(60).step == step


def _clients(make_client, pods, job: str):
    return [
        make_client(pods[r], job, rank=r, world_size=2, generation="g/0", capture_rng=False) for r in range(2)
    ]


def test_a_forged_hint_is_refused_and_cannot_fail_a_commit(two_pods, make_client, job_name):
    pods = two_pods[0]()
    clients = _clients(make_client, pods, job_name)
    states = [_state(r) for r in range(2)]
    _save(clients, 1, states)  # the job is known to both sidecars, and its peer key exists
    key = mf.peer_key(pods[0].store, "default", job_name, create=False)
    for pod in pods:
        stub = _peer(pod)
        for attempt in range(3):
            for rank in range(2):
                forged = pb.HintRequest(
                    namespace="default",
                    job=job_name,
                    attempt=attempt,
                    step=2,
                    skip=pb.SkipHint(rank=rank, reason="forged"),
                )
                with pytest.raises(grpc.RpcError) as unsigned:
                    stub.Hint(forged, timeout=10)
                assert unsigned.value.code() == grpc.StatusCode.UNAUTHENTICATED
                sign_hint(os.urandom(32), forged)  # signed, with another key
                with pytest.raises(grpc.RpcError) as wrong:
                    stub.Hint(forged, timeout=10)
                assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "peer key" in (wrong.value.details() or "")
    # a correctly signed hint is taken once; its replay is refused
    signed = pb.HintRequest(
        namespace="default", job=job_name, attempt=0, step=1, commit=pb.CommitHint(key="k")
    )
    sign_hint(key, signed)
    _peer(pods[0]).Hint(signed, timeout=10)
    with pytest.raises(grpc.RpcError) as replayed:
        _peer(pods[0]).Hint(signed, timeout=10)
    assert replayed.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "already" in (replayed.value.details() or "")
    _save(clients, 2, states)  # no forged skip failed it


def test_an_oversized_hint_is_refused_and_not_kept(two_pods, make_client, job_name):
    pods = two_pods[0]()
    clients = _clients(make_client, pods, job_name)
    _save(clients, 1, [_state(r) for r in range(2)])
    key = mf.peer_key(pods[0].store, "default", job_name, create=False)
    stub = _peer(pods[0])
    big = [
        ("reason", pb.HintRequest(skip=pb.SkipHint(rank=1, reason="x" * (MAX_HINT_TEXT + 1)))),
        ("key", pb.HintRequest(manifest=pb.ManifestHint(rank=1, key="k" * (MAX_HINT_TEXT + 1)))),
        ("uploading", pb.HintRequest(gone=pb.GoneHint(rank=1, uploading=range(100_000)))),
    ]
    for field, req in big:
        req.namespace, req.job, req.attempt, req.step = "default", job_name, 0, 3
        sign_hint(key, req)  # even signed: a sender with the key is bounded too
        with pytest.raises(grpc.RpcError) as refused:
            stub.Hint(req, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert field in (refused.value.details() or ""), (field, refused.value.details())
    # past the peer port's message limit gRPC refuses it before anything is parsed
    huge = pb.HintRequest(
        namespace="default", job=job_name, skip=pb.SkipHint(rank=1, reason="x" * (40 << 20))
    )
    with pytest.raises(grpc.RpcError) as too_big:
        stub.Hint(huge, timeout=30)
    assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    gang = pods[0].engine.gang(("default", job_name))
    with gang.cond:
        assert not any(news.skipped for news in gang.steps.values())


def test_hints_for_many_job_names_do_not_grow_the_sidecars_state(
    two_pods, make_client, job_name, monkeypatch
):
    monkeypatch.setattr(engine_state, "MAX_GANGS", 8, raising=False)
    pods = two_pods[0]()
    stub = _peer(pods[0])
    for i in range(40):
        req = pb.HintRequest(namespace="default", job=f"{job_name}-{i}", attempt=0, step=1)
        req.skip.rank, req.skip.reason = 0, "x"
        sign_hint(os.urandom(32), req)
        try:
            stub.Hint(req, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED)
    assert len(pods[0].engine.shared._gangs) == 0  # no trainer of those jobs here: nothing kept
    # local trainers of many jobs: at most MAX_GANGS gangs, the idle ones evicted first
    for i in range(12):
        make_client(pods[0], f"{job_name}-{i}", rank=0, world_size=1, generation="g/0")  # handshakes
    assert len(pods[0].engine.shared._gangs) <= 8


def _signed_fetch(pods, job: str, rank: int, step: int) -> pb.FetchRequest:
    key = mf.peer_key(pods[0].store, "default", job, create=False)
    commit = mf.read_commit(pods[0].store, "default", job, step)
    req = pb.FetchRequest(
        namespace="default",
        job=job,
        rank=rank,
        world_size=2,
        attempt=commit.attempt,
        step=step,
        issued_at=time.time(),
    )
    sign_fetch(key, req)
    return req


def test_a_replayed_fetch_is_refused(two_pods, make_client, job_name):
    pods = two_pods[0]()
    clients = _clients(make_client, pods, job_name)
    _save(clients, 4, [_state(r) for r in range(2)])
    req = _signed_fetch(pods, job_name, 1, 4)
    assert req.protocol == PEER_PROTOCOL and len(req.nonce) >= 16
    served = list(_peer(pods[1]).Fetch(req, timeout=10))
    assert served[0].header.source == "peer"
    with pytest.raises(grpc.RpcError) as replayed:
        list(_peer(pods[1]).Fetch(req, timeout=10))
    assert replayed.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "already" in (replayed.value.details() or "")
    old = _signed_fetch(pods, job_name, 1, 4)
    old.protocol = 0  # a sidecar of the version before: refused with what to do
    with pytest.raises(grpc.RpcError) as skew:
        list(_peer(pods[1]).Fetch(old, timeout=10))
    assert skew.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol" in (skew.value.details() or "")


class _Tap:
    """A TCP forwarder that keeps every byte it carried from the server to the client."""

    def __init__(self, target: int) -> None:
        self.port = free_port()
        self.received = bytearray()
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self._target))
            threading.Thread(target=self._pipe, args=(conn, up, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, conn, self.received), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, keep: bytearray | None) -> None:
        try:
            while data := src.recv(1 << 16):
                if keep is not None:
                    keep += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def tapped(make_sidecar, s3_store_url) -> Iterator[tuple[list, _Tap]]:
    """Two sidecars; the first reaches the second through a tap."""
    url, endpoint = s3_store_url
    ports = [free_port(), free_port()]
    tap = _Tap(ports[1])
    pods = [
        make_sidecar(url, s3_endpoint=endpoint, peer_port=ports[0], peers=f"127.0.0.1:{tap.port}"),
        make_sidecar(url, s3_endpoint=endpoint, peer_port=ports[1], peers=f"127.0.0.1:{ports[0]}"),
    ]
    yield pods, tap
    tap.close()


def test_peer_stream_bytes_are_not_the_plaintext(tapped, make_client, job_name):
    """A rank's replicated share fetched from the other sidecar: what crossed the wire does not
    contain the tensors' bytes, and the restore is bit for bit."""
    pods, tap = tapped
    clients = [
        make_client(pods[r], job_name, rank=r, world_size=2, generation="g/0", capture_rng=False)
        for r in range(2)
    ]

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(8)])

    states = [{"model": model(7), "own": torch.full((16,), float(r))} for r in range(2)]
    for c, s in zip(clients, states, strict=True):
        c.replicate(s["model"], group=[0, 1])
    _save(clients, 3, states)
    target = {"model": model(8), "own": torch.zeros(16)}
    assert clients[0].restore(target) == 3
    assert clients[0].last_restore["replica_sources"] == {1: "peer"}
    saved = states[0]["model"].state_dict()
    for name, tensor in saved.items():
        assert torch.equal(target["model"].state_dict()[name], tensor), name
    commit = mf.read_commit(pods[0].store, "default", job_name, 3)
    owned = [
        t.name.removeprefix("model.")
        for t in mf.load_manifest(pods[0].store, commit, 1).tensors
        if t.name.startswith("model.")
    ]
    assert owned, "rank 1 owns some of the replicated tensors"
    nbytes = sum(saved[n].numel() * 4 for n in owned)
    assert len(tap.received) >= nbytes  # the share crossed the tap
    wire = bytes(tap.received)
    for name in owned:
        raw = saved[name].numpy().tobytes()
        for at in range(0, len(raw), len(raw) // 4):
            assert raw[at : at + 64] not in wire, f"{name}'s bytes crossed the wire in clear"
