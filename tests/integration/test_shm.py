"""Shared-memory saves: the trainer stages into a tmpfs file the sidecar maps, and gRPC
carries only the header. The committed snapshot's segment is never staged into again,
a corrupted segment is caught before a memory restore, a restarted sidecar or a full
tmpfs falls back to streaming, and hostile segment names are refused."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from conftest import hold_stream

from sidecar import manifest as mf
from sidecar.api import PROTOCOL_VERSION, channel_options, pb, pb_grpc
from trainer_client import SidecarUnavailable


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256, 64), value), "b": torch.full((3,), value, dtype=torch.float64)}


def shm_files(server: Any) -> list[str]:
    """Segments under the trainers' names (the sidecar's held ones are apart)."""
    return sorted(f for f in os.listdir(server.settings.shm_dir) if not f.startswith("strata-held-"))


def held_files(server: Any) -> list[str]:
    return sorted(f for f in os.listdir(server.settings.shm_dir) if f.startswith("strata-held-"))


def test_saves_travel_through_shared_memory_and_leave_nothing_in_the_tmpfs(
    make_sidecar, make_client, job_name
):
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    assert client._segments is not None and all(b.shared for b in client._buffers)
    for step in range(4):
        client.save(step, state(float(step))).durable.result(30)
        # The sidecar takes what it maps under its own name; only the spare the client warmed up
        # may still be there under the client's, and the sidecar holds at most two per rank.
        spare = client._buffers[1 - client._held].segment
        assert shm_files(server) == ([spare.name] if step == 0 else [])
        assert 1 <= len(held_files(server)) <= 2
    received = server.metrics.received_bytes.labels(job_name)._value.get()
    assert received == 4 * client._buffers[0].span_bytes
    out = state(-1.0)
    assert client.restore(out) == 3 and client.last_restore["source"] == "memory"
    assert client.last_restore["shared_memory"] is True
    assert torch.equal(out["w"], state(3.0)["w"]) and torch.equal(out["b"], state(3.0)["b"])


def test_a_restarted_trainer_reads_the_held_snapshot_from_shared_memory(make_sidecar, make_client, job_name):
    server = make_sidecar()
    first = make_client(server, job_name, capture_rng=False, generation="r/0")
    first.save(7, state(7.0)).durable.result(30)
    first._buffers = []  # killed: the sidecar keeps the committed snapshot in its segment
    second = make_client(server, job_name, capture_rng=False, generation="r/1")
    out = state(-1.0)
    assert second.restore(out) == 7
    assert second.last_restore["source"] == "memory" and second.last_restore["shared_memory"] is True
    assert torch.equal(out["w"], state(7.0)["w"]) and torch.equal(out["b"], state(7.0)["b"])
    for name in held_files(server):  # gone from the tmpfs (the sidecar's mapping still has it)
        os.unlink(os.path.join(server.settings.shm_dir, name))
    # The sidecar hands over a copy instead, which the client removes once read.
    third = make_client(server, job_name, capture_rng=False, generation="r/2")
    out = state(-1.0)
    assert third.restore(out) == 7
    assert third.last_restore["source"] == "memory" and third.last_restore["shared_memory"] is True
    assert torch.equal(out["w"], state(7.0)["w"])
    assert held_files(server) == []
    # Without shared memory on the client's side, the bytes come over gRPC.
    fourth = make_client(server, job_name, capture_rng=False, generation="r/3", shm="off")
    out = state(-1.0)
    assert fourth.restore(out) == 7
    assert fourth.last_restore["source"] == "memory" and fourth.last_restore["shared_memory"] is False
    assert torch.equal(out["w"], state(7.0)["w"])


def test_a_segment_restore_writes_into_the_live_tensors_once_the_checkpoint_fits(
    make_sidecar, make_client, job_name, monkeypatch
):
    import trainer_client.client as client_module

    written: list[int] = []
    copy = client_module._from_segment

    def spy(header: Any, shm_dir: str, targets: list[Any]) -> None:
        written.extend(t.dst.ctypes.data for t in targets)
        copy(header, shm_dir, targets)

    monkeypatch.setattr(client_module, "_from_segment", spy)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    base = torch.arange(40, dtype=torch.float32)
    saved = {"model": model, "w": torch.randn(300, 7), "view": base[8:24]}
    expect = {"w": saved["w"].clone(), "view": saved["view"].clone(), **model.state_dict()}
    expect = {k: v.clone() for k, v in expect.items()}
    server = make_sidecar()
    first = make_client(server, job_name, capture_rng=False, generation="p/0")
    first.save(3, saved).durable.result(30)
    first._buffers = []

    second = make_client(server, job_name, capture_rng=False, generation="p/1")
    live_model = torch.nn.Linear(64, 32)
    live_base = torch.zeros(40)
    live = {"model": live_model, "w": torch.zeros(300, 7), "view": live_base[8:24]}
    w, weight = live["w"], live_model.weight
    ptrs = (w.data_ptr(), weight.data_ptr(), live_model.bias.data_ptr())
    assert second.restore(live) == 3 and second.last_restore["shared_memory"] is True
    # the same tensors hold the restored bytes: nothing was allocated and swapped in
    assert live["w"] is w and live_model.weight is weight
    assert (w.data_ptr(), weight.data_ptr(), live_model.bias.data_ptr()) == ptrs
    assert set(ptrs) <= set(written)  # copied from the segment straight into them
    assert live_base.data_ptr() + 8 * 4 not in written  # the view got a fresh tensor first
    assert torch.equal(w, expect["w"]) and torch.equal(weight, expect["weight"])
    assert torch.equal(live_model.bias, expect["bias"])
    # a view into a larger buffer is copied into, never written past: the rest stays as it was
    assert torch.equal(live["view"], expect["view"])
    assert live_base[:8].eq(0).all() and live_base[24:].eq(0).all()

    # A state the checkpoint does not fit is refused before any live tensor is touched.
    third = make_client(server, job_name, capture_rng=False, generation="p/2")
    unfit = {"w": torch.full((300, 7), 5.0), "model": torch.nn.Linear(64, 32), "extra": torch.ones(2)}
    before = {k: v.clone() for k, v in unfit["model"].state_dict().items()}
    with pytest.raises(Exception, match=r"extra.*not in the checkpoint"):
        third.restore(unfit)
    assert unfit["w"].eq(5.0).all()
    assert all(torch.equal(v, before[k]) for k, v in unfit["model"].state_dict().items())


def test_a_crashed_trainers_spare_segment_is_removed_when_its_successor_saves(
    make_sidecar, make_client, job_name
):
    server = make_sidecar()
    crashed = make_client(server, job_name, capture_rng=False)
    crashed.save(1, state(1.0)).durable.result(30)
    assert len(shm_files(server)) == 1  # the spare, never mapped by the sidecar
    crashed._buffers = []  # as if killed: it never cleans up
    successor = make_client(server, job_name, capture_rng=False, attempt=1)
    successor.save(2, state(2.0)).durable.result(30)
    spare = successor._buffers[1 - successor._held].segment
    assert shm_files(server) == [spare.name]
    # the crashed trainer's segment the sidecar held is released with it: only the successor's
    assert len(held_files(server)) == 1
    server.stop(grace=1)  # a stopping sidecar sweeps what it knows
    assert shm_files(server) == [] and held_files(server) == []


def test_the_committed_segment_is_never_staged_into(make_sidecar, make_client, job_name, monkeypatch):
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    client.save(1, state(1.0)).durable.result(30)
    client.save(2, state(2.0)).durable.result(30)
    held_index = client._held
    gate = hold_stream(client, monkeypatch)
    third = client.save(3, state(3.0))  # staged, its header not yet sent
    assert third.staged.result(10) is None
    # Step 3 went into the segment step 1 used; step 2's (the committed one) is untouched.
    staged = client._buffers[1 - held_index].views
    assert torch.equal(staged[0], state(3.0)["w"])
    # Another process of the same gang generation (a new generation would supersede the writer).
    reader = make_client(server, job_name, capture_rng=False, generation=client.settings.generation)
    out = state(-1.0)
    assert reader.restore(out) == 2 and reader.last_restore["source"] == "memory"
    assert torch.equal(out["w"], state(2.0)["w"])
    gate.set()
    assert third.durable.result(30).step == 3


def test_a_segment_changed_after_upload_is_refused_for_memory_restore(
    make_sidecar, make_client, job_name, caplog
):
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    client.save(5, state(5.0)).durable.result(30)
    client._buffers[client._held].flat.fill_(7)  # a buggy writer scribbles over the held snapshot
    out = state(-1.0)
    reader = make_client(server, job_name, capture_rng=False)
    assert reader.restore(out) == 5
    assert torch.equal(out["w"], state(5.0)["w"])  # read back from storage, not from the scribble
    assert reader.last_restore["source"] == "storage", reader.last_restore
    # the per-tensor digest names the tensor that changed
    assert "step 5 in memory changed since it was saved (w: xxh3" in caplog.text


def test_a_restarted_sidecar_gets_the_save_streamed_then_new_segments(
    make_sidecar, make_client, job_name, short_tmp
):
    storage = f"file://{short_tmp}/restart-store"
    first = make_sidecar(storage)
    client = make_client(first, job_name, capture_rng=False)
    client.save(1, state(1.0)).durable.result(30)
    client.save(2, state(2.0)).durable.result(30)
    first.stop(grace=1)
    second = make_sidecar(storage, socket=first.socket_path)  # same socket, mappings forgotten
    # Step 3 stages into the segment of step 1, which the new sidecar has never seen: it is
    # refused, streamed instead, and the client starts over with fresh segments.
    assert client.save(3, state(3.0)).durable.result(30).step == 3
    assert client._held is None and client._segments is not None
    assert client.save(4, state(4.0)).durable.result(30).step == 4
    assert all(b.shared for b in client._buffers) and client._held is not None
    out = state(-1.0)
    assert make_client(second, job_name, capture_rng=False).restore(out) == 4
    assert torch.equal(out["w"], state(4.0)["w"])
    assert mf.committed_steps(second.store, "default", job_name) == [1, 2, 3, 4]


def test_a_full_tmpfs_falls_back_to_streaming(make_sidecar, make_client, job_name, monkeypatch, caplog):
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    assert client.save(1, state(1.0)).durable.result(30).step == 1
    assert client._segments is None and not client._buffers[0].shared
    assert "shared-memory saves off" in caplog.text and shm_files(server) == []
    out = state(-1.0)
    assert client.restore(out) == 1 and torch.equal(out["b"], state(1.0)["b"])


def test_policy_on_needs_a_sidecar_that_offers_shared_memory(make_sidecar, make_client, job_name):
    server = make_sidecar(shm_dir="")
    auto = make_client(server, job_name, capture_rng=False)
    assert auto._segments is None  # "auto" streams
    assert auto.save(1, state(1.0)).durable.result(30).step == 1
    with pytest.raises(SidecarUnavailable, match=r"STRATA_SHM=on.*--shm-dir is empty"):
        make_client(server, job_name, shm="on")
    with pytest.raises(ValueError, match="shm='sometimes'"):
        make_client(server, job_name, shm="sometimes")


# --- hostile headers, sent with the raw stub ------------------------------------------------------


def shm_save(server: Any, job: str, name: str, size: int, nbytes: int = 64, chunk: bool = False) -> Any:
    channel = grpc.insecure_channel(f"unix:{server.socket_path}", options=channel_options(8 << 20))
    stub = pb_grpc.CheckpointerStub(channel)
    h = pb.SaveHeader(
        protocol_version=PROTOCOL_VERSION,
        identity=pb.Identity(
            namespace="default", job=job, rank=0, world_size=1, attempt=0, generation="shm/0"
        ),
        step=1,
        save_id="s1",
        tensors=[pb.TensorMeta(name="w", dtype="uint8", shape=[nbytes], nbytes=nbytes, offset=0)],
        shm=pb.SharedSegment(name=name, size=size),
    )
    msgs = [pb.SaveRequest(header=h)]
    if chunk:
        msgs.append(pb.SaveRequest(chunk=bytes(nbytes)))
    msgs.append(pb.SaveRequest(footer=pb.SaveFooter(total_bytes=nbytes)))
    try:
        return stub.Save(iter(msgs), timeout=30)
    finally:
        channel.close()


def make_segment(server: Any, name: str, size: int) -> Path:
    path = Path(server.settings.shm_dir) / name
    path.write_bytes(bytes(size))
    return path


@pytest.mark.parametrize(
    ("name", "size", "code", "match"),
    [
        ("../../etc/passwd", 64, grpc.StatusCode.INVALID_ARGUMENT, "must match"),
        ("strata-x/../../y", 64, grpc.StatusCode.INVALID_ARGUMENT, "must match"),
        ("strata-missing-0", 64, grpc.StatusCode.FAILED_PRECONDITION, "is not in"),
        ("strata-small-0", 16, grpc.StatusCode.INVALID_ARGUMENT, "beyond shared segment size 16"),
    ],
)
def test_hostile_segments_are_refused_naming_the_problem(make_sidecar, job_name, name, size, code, match):
    server = make_sidecar()
    if name == "strata-small-0":
        make_segment(server, name, size)
    with pytest.raises(grpc.RpcError) as info:
        shm_save(server, job_name, name, size)
    assert info.value.code() == code and match in info.value.details(), info.value.details()
    assert mf.committed_steps(server.store, "default", job_name) == []


def test_a_symlinked_segment_is_not_followed(make_sidecar, job_name, short_tmp):
    server = make_sidecar()
    secret = short_tmp / "secret"
    secret.write_bytes(b"s" * 64)
    (Path(server.settings.shm_dir) / "strata-link-0").symlink_to(secret)
    with pytest.raises(grpc.RpcError) as info:
        shm_save(server, job_name, "strata-link-0", 64)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
    assert mf.committed_steps(server.store, "default", job_name) == []


def test_a_shared_memory_save_with_chunks_is_refused(make_sidecar, job_name):
    server = make_sidecar()
    make_segment(server, "strata-raw-0", 64)
    with pytest.raises(grpc.RpcError) as info:
        shm_save(server, job_name, "strata-raw-0", 64, chunk=True)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "carries no chunks" in info.value.details()
    # A well-formed one through the same kind of segment commits.
    make_segment(server, "strata-raw-1", 64)
    assert shm_save(server, job_name, "strata-raw-1", 64).bytes_received == 64


def test_held_segments_of_a_sidecar_that_is_gone_are_removed_at_start(make_sidecar, short_tmp):
    shm = short_tmp / "shm"
    shm.mkdir(exist_ok=True)
    dead = subprocess_pid_that_exited()
    stale = [shm / f"strata-held-p{dead}.0-abc-0", shm / f"strata-held-p{os.getpid()}.999999-abc-1"]
    for path in stale:
        path.write_bytes(b"x" * 10)
    live = make_sidecar()  # same process: its held names survive another sidecar's start
    live_name = shm / f"strata-held-p{live.engine.segments._id}-keep-0"
    live_name.write_bytes(b"y")
    make_sidecar(socket=str(short_tmp / "other.sock"))
    assert [p.exists() for p in stale] == [False, False]
    assert live_name.exists()


def subprocess_pid_that_exited() -> int:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(proc.stdout)
