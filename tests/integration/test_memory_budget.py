"""The sidecar's memory budget and its cap on blocking calls, through a real sidecar."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from conftest import settled

from sidecar.api import PROTOCOL_VERSION, channel_options, pb, pb_grpc
from trainer_client import SaveFailed

MIB = 1 << 20


def _state(seed: int, mib: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MIB // 4, generator=g)}


def test_streamed_saves_fit_the_budget_or_are_refused_saying_why(make_sidecar, make_client, job_name):
    server = make_sidecar(memory_budget=int(1.6 * MIB))
    client = make_client(server, job_name, shm="off")
    s1 = _state(1)
    assert client.save(1, s1).durable.result(30).step == 1
    held = server.metrics.registry.get_sample_value("strata_memory_held_bytes", {"kind": "snapshot"})
    assert held is not None and held >= MIB  # the committed copy stays in memory, charged
    # The second snapshot does not fit beside the first: the committed copy (a cache) is dropped.
    s2 = _state(2)
    assert client.save(2, s2).durable.result(30).step == 2
    # One that can never fit is refused, with the budget named; nothing committed is lost.
    with pytest.raises(
        SaveFailed, match=r"FAILED_PRECONDITION.*needs 2\.0 MiB.*more than its whole 1\.6 MiB budget"
    ):
        client.save(3, _state(3, mib=2)).durable.result(30)
    assert server.metrics.registry.get_sample_value("strata_memory_refusals_total", {"kind": "snapshot"}) == 1
    assert server.metrics.registry.get_sample_value("strata_memory_budget_bytes") == int(1.6 * MIB)
    got = {"w": torch.zeros(MIB // 4)}
    assert client.restore(got) == 2
    assert torch.equal(got["w"], s2["w"])


def test_restore_buffers_count_and_are_released(make_sidecar, make_client, job_name):
    server = make_sidecar(memory_budget=8 * MIB)
    client = make_client(server, job_name, shm="off")
    s1 = _state(4)
    client.save(1, s1).durable.result(30)
    server.stop(grace=1)
    again = make_sidecar(storage=server.settings.storage, memory_budget=int(0.5 * MIB))
    fresh = make_client(again, job_name, shm="off", resume="never")
    with pytest.raises(Exception, match=r"FAILED_PRECONDITION.*reading step 1 from storage needs 1\.0 MiB"):
        fresh.restore({"w": torch.zeros(MIB // 4)})
    assert again.engine.memory.refused == 1
    # With room, a restore from storage is charged while it is served and given back after.
    roomy = make_sidecar(storage=server.settings.storage, memory_budget=4 * MIB)
    reader = make_client(roomy, job_name, shm="off", resume="never")
    got = {"w": torch.zeros(MIB // 4)}
    assert reader.restore(got) == 1 and reader.last_restore["source"] == "storage"
    assert torch.equal(got["w"], s1["w"])
    assert roomy.engine.memory.peak >= MIB
    settled(lambda: roomy.engine.memory.held()["restore"], 0)  # once the stream has ended


def test_blocking_calls_beyond_the_cap_are_refused_at_once(make_sidecar, job_name):
    server = make_sidecar(max_blocking_rpcs=4)
    channel = grpc.insecure_channel(f"unix:{server.socket_path}", options=channel_options(MIB))
    stub = pb_grpc.CheckpointerStub(channel)
    streams = []
    try:
        for rank in range(4):
            ident = pb.Identity(namespace="default", job=job_name, rank=rank, world_size=8, generation="r1/0")
            stream = stub.Attach(pb.AttachRequest(identity=ident))
            next(stream)  # being served: holds a slot
            streams.append(stream)
        ident = pb.Identity(namespace="default", job=job_name, rank=5, world_size=8, generation="r1/0")
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Attach(pb.AttachRequest(identity=ident)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "4 blocking calls are already running" in (err.value.details() or "")
        # Saves and handshakes are never starved by blocking calls.
        stub.Handshake(pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION), timeout=5)
        assert (
            server.metrics.registry.get_sample_value("strata_rpc_refusals_total", {"method": "Attach"}) == 1
        )
        streams.pop().cancel()
        for _ in range(50):  # the slot comes back once the cancelled call unwinds
            try:
                next(stub.Attach(pb.AttachRequest(identity=ident)))
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                time.sleep(0.1)
        else:
            pytest.fail("the cancelled call never gave its slot back")
    finally:
        for s in streams:
            s.cancel()
        channel.close()


def test_held_lossy_forms_that_do_not_fit_start_a_new_chain(make_sidecar, make_client, job_name):
    """Dropping the held quantized forms (no room for them) must not leave a chain whose memory
    restore differs from storage: the chain ends there and the next checkpoint is full."""
    from sidecar import manifest as mf

    # the stored class: a memory restore gives storage's form, which the held forms decode
    server = make_sidecar(quantize="4", policy="consecutive", restore_class="stored")
    client = make_client(server, job_name, capture_rng=False)
    torch.manual_seed(0)
    emb = torch.nn.Embedding(8192, 64)
    state = {"emb": emb}
    client.save(1, state).durable.result(60)
    engine = server.engine
    (slot,) = list(engine.held.slots)
    assert engine.held.layers[slot] and engine.memory.held()["encode"] > 0
    limit, engine.memory.limit = engine.memory.limit, 1024  # another holder took the room
    with engine.shared.lock:
        engine.held.account(slot)
    engine.memory.limit = limit
    assert engine.held.layers[slot] == [] and slot not in engine.held.chains
    with torch.no_grad():
        emb.weight[:10] += 1.0
    client.save(2, state).durable.result(60)
    commit = mf.read_commit(engine.store, "default", job_name, 2)
    assert mf.load_manifest(engine.store, commit, 0).checkpoint == "full"
    from_memory = {"emb": torch.nn.Embedding(8192, 64)}
    client.restore(from_memory, step=2)
    assert client.last_restore["source"] == "memory"
    other = make_sidecar(
        storage=server.settings.storage, quantize="4", policy="consecutive", restore_class="stored"
    )
    reader = make_client(other, job_name, capture_rng=False, generation="reader/1")
    from_storage = {"emb": torch.nn.Embedding(8192, 64)}
    reader.restore(from_storage, step=2)
    assert reader.last_restore["source"] == "storage"
    assert torch.equal(from_memory["emb"].weight, from_storage["emb"].weight)
