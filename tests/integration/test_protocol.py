"""Malformed and hostile save streams, sent with the raw stubs: each gets the
fitting status with a message naming the problem, the sidecar keeps serving,
and nothing partial is ever committed."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from sidecar import manifest as mf
from sidecar.api import PROTOCOL_VERSION, TOKEN_METADATA_KEY, channel_options, pb, pb_grpc

MiB = 1 << 20


#: Every stream of a test comes from one gang generation (one attempt); raw stubs must say so.
GENERATION = "proto/0"


def identity(job: str, rank: int = 0, world: int = 1, generation: str = GENERATION) -> pb.Identity:
    return pb.Identity(
        namespace="default", job=job, rank=rank, world_size=world, attempt=0, generation=generation
    )


def header(job: str, step: int, tensors: list[pb.TensorMeta], **kw) -> pb.SaveRequest:
    return pb.SaveRequest(
        header=pb.SaveHeader(
            protocol_version=kw.pop("version", PROTOCOL_VERSION),
            identity=kw.pop("ident", identity(job)),
            step=step,
            save_id=kw.pop("save_id", f"s{step}"),
            tensors=tensors,
            tree=kw.pop("tree", b'{"w": {"__tensor__": 0}}'),
        )
    )


def f32(name: str, n: int) -> pb.TensorMeta:
    return pb.TensorMeta(name=name, dtype="float32", shape=[n], nbytes=4 * n)


def valid_stream(job: str, step: int, n: int = 16) -> list[pb.SaveRequest]:
    return [
        header(job, step, [f32("w", n)]),
        pb.SaveRequest(chunk=bytes(4 * n)),
        pb.SaveRequest(footer=pb.SaveFooter(total_bytes=4 * n)),
    ]


@pytest.fixture
def stub(make_sidecar):
    server = make_sidecar(max_message_bytes=2 * MiB)
    channel = grpc.insecure_channel(f"unix:{server.socket_path}", options=channel_options(64 * MiB))
    yield pb_grpc.CheckpointerStub(channel), server
    channel.close()


def expect_status(code: grpc.StatusCode, match: str, call) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details(), info.value.details()


def committed(server, job: str) -> list[int]:
    return mf.committed_steps(server.store, "default", job)


@pytest.mark.parametrize(
    ("tensors", "payload", "code", "match"),
    [
        (
            [pb.TensorMeta(name="w", dtype="float13", shape=[4], nbytes=16)],
            16,
            "INVALID_ARGUMENT",
            "unknown dtype",
        ),
        (
            [pb.TensorMeta(name="w", dtype="float32", shape=[4], nbytes=12)],
            12,
            "INVALID_ARGUMENT",
            "12 bytes declared",
        ),
        ([f32("w", 4), f32("w", 4)], 32, "INVALID_ARGUMENT", "duplicate tensor name 'w'"),
        ([f32("w", 4)], 20, "INVALID_ARGUMENT", "more than the 16 bytes"),
        ([f32("w", 4)], 8, "INVALID_ARGUMENT", "stream ended with 8 bytes"),
    ],
)
def test_malformed_headers_and_payloads(stub, job_name, tensors, payload, code, match):
    s, server = stub
    total = sum(t.nbytes for t in tensors)
    msgs = [header(job_name, 1, tensors), pb.SaveRequest(chunk=bytes(payload))]
    msgs.append(pb.SaveRequest(footer=pb.SaveFooter(total_bytes=total)))
    expect_status(getattr(grpc.StatusCode, code), match, lambda: s.Save(iter(msgs), timeout=10))
    # Still serving, and nothing of the bad stream was committed.
    s.Save(iter(valid_stream(job_name, 2)), timeout=10)
    s.WaitCommitted(
        pb.WaitCommittedRequest(identity=identity(job_name), step=2, save_id="s2", timeout_seconds=10)
    )
    assert committed(server, job_name) == [2]


def test_stream_must_start_with_a_header(stub, job_name):
    s, _ = stub
    expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        "must start with a SaveHeader",
        lambda: s.Save(iter([pb.SaveRequest(chunk=b"x")])),
    )


def test_unknown_protocol_version(stub, job_name):
    s, _ = stub
    msgs = valid_stream(job_name, 1)
    msgs[0].header.protocol_version = 99
    expect_status(grpc.StatusCode.FAILED_PRECONDITION, "protocol version 99", lambda: s.Save(iter(msgs)))
    expect_status(
        grpc.StatusCode.FAILED_PRECONDITION,
        "protocol version 99",
        lambda: s.Handshake(pb.HandshakeRequest(protocol_version=99)),
    )


def test_a_committed_step_is_never_overwritten(stub, job_name):
    s, server = stub
    s.Save(iter(valid_stream(job_name, 5)), timeout=10)
    s.WaitCommitted(
        pb.WaitCommittedRequest(identity=identity(job_name), step=5, save_id="s5", timeout_seconds=10)
    )
    again = valid_stream(job_name, 5)
    again[0].header.save_id = "other"
    expect_status(grpc.StatusCode.ALREADY_EXISTS, "step 5", lambda: s.Save(iter(again), timeout=10))
    assert committed(server, job_name) == [5]


def test_a_restarted_generation_saves_only_steps_after_its_restore_step(stub, job_name):
    s, server = stub
    s.Save(iter(valid_stream(job_name, 5)), timeout=10)
    s.WaitCommitted(
        pb.WaitCommittedRequest(identity=identity(job_name), step=5, save_id="s5", timeout_seconds=10)
    )
    restarted = identity(job_name, generation="proto/1")  # the gang restarted: a new attempt
    for step in (5, 4):
        again = valid_stream(job_name, step)
        again[0].header.identity.CopyFrom(restarted)
        expect_status(
            grpc.StatusCode.ALREADY_EXISTS,
            "resumed from step 5",
            lambda again=again: s.Save(iter(again), timeout=10),
        )
    later = valid_stream(job_name, 6)
    later[0].header.identity.CopyFrom(restarted)
    s.Save(iter(later), timeout=10)
    s.WaitCommitted(pb.WaitCommittedRequest(identity=restarted, step=6, save_id="s6", timeout_seconds=10))
    assert mf.valid_commits(server.store, "default", job_name) == [(0, 5), (1, 6)]
    # The old generation is superseded on this sidecar: it cannot save any more.
    expect_status(
        grpc.StatusCode.FAILED_PRECONDITION,
        "older than proto/1",
        lambda: s.Save(iter(valid_stream(job_name, 7)), timeout=10),
    )
    assert committed(server, job_name) == [5, 6]


def test_message_over_the_size_limit(stub, job_name):
    s, server = stub
    msgs = [header(job_name, 1, [f32("w", MiB)]), pb.SaveRequest(chunk=bytes(4 * MiB))]
    expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "", lambda: s.Save(iter(msgs), timeout=10))
    s.Save(iter(valid_stream(job_name, 2)), timeout=10)
    assert server.engine.snapshots()[-1].step == 2


def test_stream_cut_midway_commits_nothing(stub, job_name):
    s, server = stub
    sent = threading.Event()

    def cut_after_one_chunk() -> Iterator[pb.SaveRequest]:
        yield header(job_name, 1, [f32("w", 1024)])
        yield pb.SaveRequest(chunk=bytes(1024))
        sent.set()
        threading.Event().wait(30)  # never sends the rest

    future = s.Save.future(cut_after_one_chunk(), timeout=30)
    assert sent.wait(10)
    for _ in range(200):  # until the sidecar holds the partial snapshot
        held = server.engine.snapshots()
        if held and held[0].received == 1024:
            break
        threading.Event().wait(0.05)
    future.cancel()
    with pytest.raises(grpc.FutureCancelledError):
        future.result()
    # The sidecar notices, drops the snapshot, and keeps serving.
    for _ in range(100):
        if not server.engine.snapshots():
            break
        threading.Event().wait(0.05)
    assert server.engine.snapshots() == []
    assert (
        server.metrics.registry.get_sample_value(
            "strata_checkpoints_total", {"training_job": job_name, "result": "aborted"}
        )
        == 1
    )
    s.Save(iter(valid_stream(job_name, 1)), timeout=10)  # same step again: allowed, it never committed
    s.WaitCommitted(
        pb.WaitCommittedRequest(identity=identity(job_name), step=1, save_id="s1", timeout_seconds=10)
    )
    assert committed(server, job_name) == [1]


def test_a_third_snapshot_is_refused_while_two_are_held(stub, job_name):
    s, server = stub
    s.Save(iter(valid_stream(job_name, 1)), timeout=10)
    s.WaitCommitted(
        pb.WaitCommittedRequest(identity=identity(job_name), step=1, save_id="s1", timeout_seconds=10)
    )
    release = threading.Event()
    started = threading.Event()

    def slow() -> Iterator[pb.SaveRequest]:
        yield header(job_name, 2, [f32("w", 16)])
        started.set()
        release.wait(30)
        yield pb.SaveRequest(chunk=bytes(64))
        yield pb.SaveRequest(footer=pb.SaveFooter(total_bytes=64))

    pending = s.Save.future(slow(), timeout=30)
    assert started.wait(10)
    for _ in range(100):  # the header is being processed on the server
        if len(server.engine.snapshots()) == 2:
            break
        threading.Event().wait(0.05)
    expect_status(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "already holds 2 snapshots",
        lambda: s.Save(iter(valid_stream(job_name, 3)), timeout=10),
    )
    release.set()
    assert pending.result().step == 2


def test_invalid_identity_is_named(stub):
    s, _ = stub
    bad = valid_stream("Bad_Job", 1)
    bad[0].header.identity.CopyFrom(identity("Bad_Job"))
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, "job 'Bad_Job'", lambda: s.Save(iter(bad)))
    worse = valid_stream("ok", 1)
    worse[0].header.identity.CopyFrom(identity("ok", rank=3, world=2))
    expect_status(
        grpc.StatusCode.INVALID_ARGUMENT, "rank 3 is outside world size 2", lambda: s.Save(iter(worse))
    )


def test_a_stream_without_a_valid_generation_is_refused(stub, job_name):
    s, server = stub
    for generation, code, match in (
        ("", grpc.StatusCode.FAILED_PRECONDITION, "no gang generation"),
        ("no-restart-count", grpc.StatusCode.INVALID_ARGUMENT, "RUN/RESTART"),
    ):
        msgs = valid_stream(job_name, 1)
        msgs[0].header.identity.CopyFrom(identity(job_name, generation=generation))
        expect_status(code, match, lambda msgs=msgs: s.Save(iter(msgs), timeout=10))
    assert server.engine.snapshots() == []
    assert committed(server, job_name) == []


def test_tcp_needs_the_token(make_sidecar, make_client, job_name):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = make_sidecar(tcp_port=port, token="s3cret")
    ok = pb_grpc.CheckpointerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    req = pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION)
    expect_status(grpc.StatusCode.UNAUTHENTICATED, TOKEN_METADATA_KEY, lambda: ok.Handshake(req, timeout=10))
    expect_status(
        grpc.StatusCode.UNAUTHENTICATED,
        TOKEN_METADATA_KEY,
        lambda: ok.Handshake(req, timeout=10, metadata=((TOKEN_METADATA_KEY, "wrong"),)),
    )
    reply = ok.Handshake(req, timeout=10, metadata=((TOKEN_METADATA_KEY, "s3cret"),))
    assert reply.protocol_version == PROTOCOL_VERSION
    # The trainer client over TCP.
    from trainer_client import CheckpointClient

    client = CheckpointClient(job=job_name, address=f"127.0.0.1:{port}", token="s3cret", connect_timeout_s=10)
    import torch

    assert client.save(1, {"w": torch.ones(3)}).durable.result(30).step == 1
    client.close()
    assert server.tcp_port == port


def test_health_service_reports_serving(stub):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    _, server = stub
    channel = grpc.insecure_channel(f"unix:{server.socket_path}")
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service="strata.v1.Checkpointer"), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()
