"""Shared-memory saves: the trainer stages into a tmpfs file the sidecar maps, and gRPC
carries only the header. The committed snapshot's segment is never staged into again,
a corrupted segment is caught before a memory restore, a restarted sidecar or a full
tmpfs falls back to streaming, and hostile segment names are refused."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import re
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from conftest import hold_stream

from sidecar import manifest as mf
from sidecar.api import (
    PROTOCOL_VERSION,
    SHM_HANDOVER_CAPABILITY,
    SHM_LENT_PATTERN,
    channel_options,
    pb,
    pb_grpc,
)
from trainer_client import CheckpointClient, SidecarUnavailable
from trainer_client import _receive as receive_module
from trainer_client._staging import open_segment


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256, 64), value), "b": torch.full((3,), value, dtype=torch.float64)}


def shm_files(server: Any) -> list[str]:
    """Segment files under the trainers' names (the sidecar's held ones are apart; its handover
    socket is a dot file)."""
    return sorted(f for f in os.listdir(server.settings.shm_dir) if not f.startswith(("strata-held-", ".")))


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
        # Sealed memfds handed over, nothing in the tmpfs: the spare too is one.
        assert all(b.segment is not None and b.segment.fd is not None for b in client._buffers)
        assert shm_files(server) == [] and held_files(server) == []
    received = server.metrics.received_bytes.labels(job_name)._value.get()
    assert received == 4 * client._buffers[0].span_bytes
    out = state(-1.0)
    assert client.restore(out) == 3 and client.last_restore["source"] == "memory"
    assert client.last_restore["shared_memory"] is True
    assert torch.equal(out["w"], state(3.0)["w"]) and torch.equal(out["b"], state(3.0)["b"])


def test_a_restarted_trainer_reads_the_held_snapshot_from_shared_memory(
    make_sidecar, make_client, job_name, monkeypatch
):
    server = make_sidecar()
    copy = server.engine.segments.handoff

    def no_copy(blobs: list[memoryview], size: int) -> str:
        raise AssertionError("the held segment is lent, not copied")

    monkeypatch.setattr(server.engine.segments, "handoff", no_copy)
    first = make_client(server, job_name, capture_rng=False, generation="r/0")
    first.save(7, state(7.0)).durable.result(30)
    first._buffers = []  # killed: the sidecar keeps the committed snapshot in its segment
    second = make_client(server, job_name, capture_rng=False, generation="r/1")
    out = state(-1.0)
    assert second.restore(out) == 7
    assert second.last_restore["source"] == "memory" and second.last_restore["shared_memory"] is True
    assert torch.equal(out["w"], state(7.0)["w"]) and torch.equal(out["b"], state(7.0)["b"])
    assert held_files(server) == [] and shm_files(server) == []
    # Where the sidecar cannot lend it, it hands over a copy, which the client removes once read.
    monkeypatch.setattr(server.engine.segments, "handoff", copy)
    monkeypatch.setattr(server.engine.segments, "held_name", lambda name: None)
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


def test_a_held_segment_is_lent_read_only_and_once(make_sidecar, make_client, job_name):
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    client.save(1, state(1.0)).durable.result(30)
    lent = server.engine.segments.held_name(client._buffers[client._held].segment.name)
    assert lent is not None and re.fullmatch(SHM_LENT_PATTERN, lent)
    fd = open_segment(server.settings.shm_dir, lent)
    try:
        assert os.fstat(fd).st_size >= client._buffers[client._held].span_bytes
        with pytest.raises(OSError):
            os.write(fd, b"x")  # the restoring trainer may read it, not change it
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="did not lend it"):
        open_segment(server.settings.shm_dir, lent)


def test_a_segment_restore_writes_into_the_live_tensors_once_the_checkpoint_fits(
    make_sidecar, make_client, job_name, monkeypatch
):
    written: list[int] = []
    copy = receive_module.from_segment

    def spy(header: Any, shm_dir: str, targets: list[Any]) -> None:
        written.extend(t.dst.ctypes.data for t in targets)
        copy(header, shm_dir, targets)

    monkeypatch.setattr(receive_module, "from_segment", spy)
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


def test_a_crashed_trainers_segments_are_released_when_its_successor_saves(
    make_sidecar, make_client, job_name
):
    server = make_sidecar()
    crashed = make_client(server, job_name, capture_rng=False)
    crashed.save(1, state(1.0)).durable.result(30)
    crashed._buffers = []  # as if killed: it never cleans up, and leaves no file behind
    assert shm_files(server) == [] and held_files(server) == []
    successor = make_client(server, job_name, capture_rng=False, restart=1)
    successor.save(2, state(2.0)).durable.result(30)
    (held,) = server.engine.segments._maps.values()  # the rank's segments: the successor's only
    assert {n.split("-")[1] for n in held} == {successor._segments.instance}


def test_a_segment_file_is_taken_over_and_only_what_was_taken_is_removed(make_sidecar, job_name):
    server = make_sidecar()
    shm = Path(server.settings.shm_dir)
    # A client staging through files (an older one): the sidecar takes the segment it saves from
    # under a name of its own; the spare it never saw stays the trainer's.
    make_segment(server, "strata-crashed-0", 64)
    make_segment(server, "strata-crashed-1", 64)
    assert shm_save(server, job_name, "strata-crashed-0", 64).bytes_received == 64
    assert shm_files(server) == ["strata-crashed-1"] and len(held_files(server)) == 1
    # Its successor saves: what the sidecar took from the predecessor is released.
    make_segment(server, "strata-successor-0", 64)
    assert shm_save(server, job_name, "strata-successor-0", 64, step=2).bytes_received == 64
    assert [p.name for p in shm.glob("strata-held-*")] == [held_path(shm, "strata-successor-0").name]
    server.stop(grace=1)  # a stopping sidecar removes what it took over, and nothing else
    assert shm_files(server) == ["strata-crashed-1"] and held_files(server) == []


def test_the_committed_segment_is_never_staged_into(make_sidecar, make_client, job_name, monkeypatch):
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False, staging_buffers=2)
    assert len(client._buffers) == 2  # two-buffer staging stays available
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
    client = make_client(first, job_name, capture_rng=False, staging_buffers=2)
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
    # handed over to the new sidecar on the same socket: memfds still, no file in the tmpfs
    assert all(b.segment is not None and b.segment.fd is not None for b in client._buffers)
    assert shm_files(second) == []
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


def shm_save(
    server: Any,
    job: str,
    name: str,
    size: int,
    nbytes: int = 64,
    chunk: bool = False,
    step: int = 1,
    timeout: float = 30,
) -> Any:
    """A shared-memory save of one ``nbytes`` tensor at offset 0 of segment ``name`` (``server``: a
    sidecar, or the path of its socket)."""
    path = server if isinstance(server, str) else server.socket_path
    channel = grpc.insecure_channel(f"unix:{path}", options=channel_options(8 << 20))
    stub = pb_grpc.CheckpointerStub(channel)
    h = pb.SaveHeader(
        protocol_version=PROTOCOL_VERSION,
        identity=pb.Identity(
            namespace="default", job=job, rank=0, world_size=1, attempt=0, generation="shm/0"
        ),
        step=step,
        save_id=f"s{step}",
        tensors=[pb.TensorMeta(name="w", dtype="uint8", shape=[nbytes], nbytes=nbytes, offset=0)],
        shm=pb.SharedSegment(name=name, size=size),
    )
    msgs = [pb.SaveRequest(header=h)]
    if chunk:
        msgs.append(pb.SaveRequest(chunk=bytes(nbytes)))
    msgs.append(pb.SaveRequest(footer=pb.SaveFooter(total_bytes=nbytes)))
    try:
        return stub.Save(iter(msgs), timeout=timeout)
    finally:
        channel.close()


def make_segment(server: Any, name: str, size: int) -> Path:
    path = Path(server.settings.shm_dir) / name
    path.write_bytes(bytes(size))
    return path


@pytest.mark.parametrize(
    ("name", "size", "code", "match"),
    [
        ("../../etc/passwd", 64, grpc.StatusCode.INVALID_ARGUMENT, "must be strata-<instance>-<n>"),
        ("strata-x/../../y", 64, grpc.StatusCode.INVALID_ARGUMENT, "must be strata-<instance>-<n>"),
        ("strata-0", 64, grpc.StatusCode.INVALID_ARGUMENT, "must be strata-<instance>-<n>"),
        ("strata-held-x-0", 64, grpc.StatusCode.INVALID_ARGUMENT, "must be strata-<instance>-<n>"),
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


# --- a hostile neighbour: one trainer's segments never reach the sidecar or another job ---------


def held_path(shm: Path, name: str) -> Path:
    """The file the sidecar holds segment ``name`` under, once it took it over."""
    found = sorted(shm.glob(f"strata-held-p*-{name.removeprefix('strata-')}"))
    assert len(found) == 1, sorted(os.listdir(shm))
    return found[0]


def test_a_trainer_shrinking_its_segment_fails_that_save_and_no_other_job(short_tmp, job_name):
    # A sidecar process of its own: a SIGBUS in it must fail this test, not end the test run.
    shm, sock = short_tmp / "shm", short_tmp / "hostile.sock"
    shm.mkdir()
    log = (short_tmp / "sidecar.log").open("wb")
    strata = str(Path(sys.executable).parent / "strata")
    args = ["--storage", f"file://{short_tmp}/store", "--socket", str(sock), "--shm-dir", str(shm)]
    sidecar = subprocess.Popen(
        [strata, "sidecar", *args, "--metrics-port", "0"],
        stdout=log,
        stderr=log,
    )
    clients: list[CheckpointClient] = []

    def client(generation: str) -> CheckpointClient:
        made = CheckpointClient(
            job=job_name, socket=str(sock), connect_timeout_s=30, capture_rng=False, generation=generation
        )
        clients.append(made)
        return made

    try:
        victim = client("v/0")
        victim.save(3, state(3.0)).durable.result(30)
        # The neighbour stages through a file, as older clients do, and shrinks it once the
        # sidecar has taken it over.
        segment = shm / "strata-shrinker-0"
        segment.write_bytes(bytes(range(256)) * 16)
        assert shm_save(str(sock), "neighbour", segment.name, 4096, nbytes=4096).bytes_received == 4096
        os.truncate(held_path(shm, segment.name), 0)
        with pytest.raises(grpc.RpcError) as info:
            shm_save(str(sock), "neighbour", segment.name, 4096, nbytes=4096, step=2)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "strata-shrinker-0" in info.value.details() and "shrank" in info.value.details()
        assert sidecar.poll() is None, (short_tmp / "sidecar.log").read_text()
        # The other job's snapshot held in memory restores bit for bit, from memory.
        out = state(-1.0)
        reader = client("v/1")
        assert reader.restore(out) == 3 and reader.last_restore["source"] == "memory"
        assert torch.equal(out["w"], state(3.0)["w"]) and torch.equal(out["b"], state(3.0)["b"])
        assert sidecar.poll() is None
    finally:
        for made in clients:
            made.close(wait=False)
        sidecar.terminate()
        try:
            # A trainer still attached (its close above does not wait) keeps a terminated sidecar
            # serving its last save for a while, by design: nothing here needs that.
            sidecar.wait(5)
        except subprocess.TimeoutExpired:
            sidecar.kill()
            sidecar.wait()
        log.close()


def hand_over(server: Any, name: str, fd: int) -> str:
    """Hand ``fd`` to the sidecar as segment ``name``, as the client does; the sidecar's answer."""
    with grpc.insecure_channel(f"unix:{server.socket_path}") as channel:
        hello = pb_grpc.CheckpointerStub(channel).Handshake(
            pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION), timeout=10
        )
    (socket_name,) = [
        c.removeprefix(SHM_HANDOVER_CAPABILITY)
        for c in hello.capabilities
        if c.startswith(SHM_HANDOVER_CAPABILITY)
    ]
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(10)
        conn.connect(os.path.join(server.settings.shm_dir, socket_name))
        socket.send_fds(conn, [name.encode()], [fd])
        return conn.recv(4096).decode()


def test_a_segment_its_writer_may_still_shrink_is_refused(make_sidecar, job_name):
    server = make_sidecar()
    fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 64)
        answer = hand_over(server, "strata-unsealed-0", fd)
    finally:
        os.close(fd)
    assert answer.startswith("error") and "F_SEAL_SHRINK" in answer, answer
    with pytest.raises(grpc.RpcError) as info:
        shm_save(server, job_name, "strata-unsealed-0", 64)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
    # What the client hands over is sealed against shrinking: its writer cannot take pages back.
    client = CheckpointClient(job=job_name, socket=server.socket_path, capture_rng=False)
    try:
        client.save(1, state(1.0)).durable.result(30)
        segment = client._buffers[client._held].segment
        assert segment is not None and segment.fd is not None
        with pytest.raises(PermissionError):
            os.ftruncate(segment.fd, 0)
    finally:
        client.close(wait=False)


def test_a_fifo_named_as_a_segment_is_refused_at_once_and_blocks_no_other_job(
    make_sidecar, make_client, job_name
):
    server = make_sidecar()
    fifo = Path(server.settings.shm_dir) / "strata-fifo-0"
    os.mkfifo(fifo)
    failed: list[grpc.RpcError] = []

    def hostile() -> None:
        try:
            shm_save(server, "neighbour", fifo.name, 64, timeout=15)
        except grpc.RpcError as exc:
            failed.append(exc)

    thread = threading.Thread(target=hostile)
    thread.start()
    try:
        other = make_client(server, job_name, capture_rng=False)  # a handshake
        assert other.save(1, state(1.0)).durable.result(30).step == 1
        thread.join(30)
        assert len(failed) == 1
        assert failed[0].code() == grpc.StatusCode.INVALID_ARGUMENT, failed[0].details()
        assert "strata-fifo-0" in failed[0].details() and "regular file" in failed[0].details()
    finally:
        with contextlib.suppress(OSError):  # a reader stuck on the FIFO gets its writer and returns
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(30)


def test_a_segment_name_never_reaches_another_jobs_segments(make_sidecar, job_name):
    server = make_sidecar()
    shm = Path(server.settings.shm_dir)
    # Another job stages through files: a segment the sidecar holds a snapshot in, and the spare
    # it has not seen yet.
    make_segment(server, "strata-victim0-0", 64)
    make_segment(server, "strata-victim0-1", 64)
    assert shm_save(server, "victim", "strata-victim0-0", 64).bytes_received == 64
    before = set(os.listdir(shm))
    # A trainer naming its segment "strata-0", then restarting (a new instance): its predecessor's
    # segments are swept, and "strata-0" must not stand for every segment in the directory.
    codes = []
    for step, name in enumerate(["strata-0", "strata-next-0"], start=1):
        make_segment(server, name, 64)
        try:
            shm_save(server, job_name, name, 64, step=step)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
    assert before <= set(os.listdir(shm)), sorted(before - set(os.listdir(shm)))
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK]
    # The other job's next save goes through its spare, untouched.
    assert shm_save(server, "victim", "strata-victim0-1", 64, step=2).bytes_received == 64


# --- what a segment's writer can still do to it, and restores handed over as sealed copies ---------

F_SEAL_FUTURE_WRITE = 0x10  # not in every Python's fcntl
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def punch_hole(fd: int, offset: int, size: int) -> int:
    """fallocate(PUNCH_HOLE): the errno it fails with, 0 when it punched."""
    libc = ctypes.CDLL(None, use_errno=True)
    mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    if libc.fallocate(fd, mode, ctypes.c_long(offset), ctypes.c_long(size)) == 0:
        return 0
    return ctypes.get_errno()


def sealed_memfd(size: int, seals: int, allocate: bool) -> int:
    fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    if allocate:
        os.posix_fallocate(fd, 0, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_a_sparse_segment_or_one_its_writer_may_punch_is_refused(make_sidecar, make_client, job_name):
    server = make_sidecar()
    # 64 GiB of nothing: each page the sidecar read would be allocated, charged to the sidecar.
    every = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE
    fd = sealed_memfd(64 << 30, every, allocate=False)
    try:
        answer = hand_over(server, "strata-sparse-0", fd)
    finally:
        os.close(fd)
    assert answer.startswith("error") and "strata-sparse-0" in answer and "hole" in answer, answer
    # Allocated, but its writer may still punch holes (and write through new descriptors).
    fd = sealed_memfd(1 << 20, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, allocate=True)
    try:
        assert punch_hole(fd, 0, 4096) == 0
        answer = hand_over(server, "strata-punchable-0", fd)
    finally:
        os.close(fd)
    assert answer.startswith("error") and "strata-punchable-0" in answer, answer
    assert "F_SEAL_FUTURE_WRITE" in answer, answer
    with pytest.raises(grpc.RpcError) as info:
        shm_save(server, job_name, "strata-sparse-0", 64)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
    # The client's own segments are sealed so: it still writes them through its mapping, while a
    # hole or a write by any other way is refused.
    client = make_client(server, job_name, capture_rng=False)
    for step in (1, 2, 3):
        client.save(step, state(float(step))).durable.result(30)
    segment = client._buffers[client._held].segment
    assert segment is not None and segment.fd is not None
    assert fcntl.fcntl(segment.fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE
    assert punch_hole(segment.fd, 0, 4096) == errno.EPERM
    with pytest.raises(PermissionError):
        os.pwrite(segment.fd, b"x", 0)
    out = state(-1.0)
    assert make_client(server, job_name, capture_rng=False, generation="g/1").restore(out) == 3
    assert torch.equal(out["w"], state(3.0)["w"]) and torch.equal(out["b"], state(3.0)["b"])


def test_a_restore_assembled_by_the_sidecar_is_lent_sealed_never_named_as_a_file(
    make_sidecar, make_client, job_name, short_tmp, monkeypatch
):
    storage = f"file://{short_tmp}/sealed-store"
    first = make_sidecar(storage, policy="consecutive")
    saver = make_client(first, job_name, capture_rng=False)
    saver.save(3, state(3.0)).durable.result(30)
    saver.save(4, state(4.0)).durable.result(30)  # a diff: assembled (a full is lent as its files)
    first.stop(grace=1)
    second = make_sidecar(storage)  # memory gone: the restore is assembled from storage
    named: list[str] = []

    def inspect(directory: str, name: str) -> int:
        named.append(name)
        fd = open_segment(directory, name)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        want = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert seals & want == want, hex(seals)
        # a memfd's inode is 0777: reopened read-write, it is still sealed
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            for change in (
                lambda: os.pwrite(rw, b"x", 0),
                lambda: os.ftruncate(rw, 0),
                lambda: mmap.mmap(rw, 4096),
                lambda: os.truncate(rw, 1 << 30),
            ):
                with pytest.raises(PermissionError):
                    change()
            assert punch_hole(rw, 0, 4096) == errno.EPERM
        finally:
            os.close(rw)
        return fd

    monkeypatch.setattr(receive_module, "open_segment", inspect)
    out = state(-1.0)
    restorer = make_client(second, job_name, capture_rng=False)
    assert restorer.restore(out) == 4
    assert restorer.last_restore["source"] == "storage" and restorer.last_restore["shared_memory"] is True
    assert torch.equal(out["w"], state(4.0)["w"]) and torch.equal(out["b"], state(4.0)["b"])
    assert len(named) == 1 and re.fullmatch(SHM_LENT_PATTERN, named[0]), named
    assert shm_files(second) == [] and held_files(second) == []
    # taken: the sidecar no longer lends it, and its memory is released once the call ended
    with pytest.raises(OSError, match="did not lend it"):
        open_segment(second.settings.shm_dir, named[0])
    deadline = time.monotonic() + 30
    while second.engine.memory.held().get("restore", 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert second.engine.memory.held().get("restore", 0) == 0


def test_a_handoff_file_truncated_under_the_client_falls_back_to_the_committed_bytes(
    make_sidecar, make_client, job_name, short_tmp, monkeypatch
):
    storage = f"file://{short_tmp}/truncated-store"
    first = make_sidecar(storage)
    make_client(first, job_name, capture_rng=False).save(5, state(5.0)).durable.result(30)
    first.stop(grace=1)
    second = make_sidecar(storage)
    assert second.engine.segments._handover is not None
    second.engine.segments._handover.close()  # no handover socket: restores handed over as files
    second.engine.segments._handover = None
    fstat = os.fstat
    truncated: list[str] = []

    def truncate_after_fstat(fd: Any) -> os.stat_result:
        """The handoff file's size as the client checks it, then truncated by a neighbour."""
        found = fstat(fd)
        target = os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) else ""
        if os.path.basename(target).startswith("strata-held-") and not truncated:
            truncated.append(target)
            os.truncate(target, 0)
        return found

    restorer = make_client(second, job_name, capture_rng=False)
    monkeypatch.setattr(os, "fstat", truncate_after_fstat)
    out = state(-1.0)
    assert restorer.restore(out) == 5
    monkeypatch.setattr(os, "fstat", fstat)
    assert truncated, "the restore was not handed over as a file"
    assert restorer.last_restore["shared_memory"] is False  # fell back to gRPC
    assert torch.equal(out["w"], state(5.0)["w"]) and torch.equal(out["b"], state(5.0)["b"])


def memfd_segments(client: CheckpointClient) -> list[str]:
    """The client's staging memfds mapped in this process (the client's and the sidecar's
    mappings alike), by name, from ``/proc/self/maps``."""
    assert client._segments is not None
    with open("/proc/self/maps") as maps:
        text = maps.read()
    return sorted(set(re.findall(rf"/memfd:(strata-{client._segments.instance}-[0-9]+)", text)))


def test_by_default_one_staging_segment_is_the_held_snapshot(make_sidecar, make_client, job_name):
    """The default stages every save into one segment: at most one state-sized segment is mapped,
    and the sidecar's held snapshot is that segment (no copy)."""
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    assert len(client._buffers) == 1
    for step in range(4):
        client.save(step, state(float(step))).durable.result(30)
        assert len(memfd_segments(client)) == 1
        assert [s.segment for s in server.engine.held.snapshots()] == [client._buffers[0].segment.name]
    out = state(-1.0)
    assert client.restore(out) == 3 and client.last_restore["source"] == "memory"
    assert torch.equal(out["w"], state(3.0)["w"])


def test_overwriting_the_single_segment_gives_up_the_held_copy_first(
    make_sidecar, make_client, job_name, monkeypatch
):
    """While the one segment holds the next save's bytes the sidecar no longer holds the
    committed step there: its holdings report lists no exact copy, and a trainer that dies before
    that save is sent restores the committed step bitwise from storage, never those bytes."""
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    client.save(1, state(1.0)).durable.result(30)
    (snap,) = server.engine.held.snapshots()
    assert server.engine.held.exact_positions(snap.identity) == [[0, 1]]
    gate = hold_stream(client, monkeypatch)
    second = client.save(2, state(2.0))  # staged over step 1's bytes, its header not yet sent
    assert second.staged.result(10) is None
    assert len(memfd_segments(client)) == 1
    assert torch.equal(client._buffers[0].views[0], state(2.0)["w"])
    assert server.engine.held.exact_positions(snap.identity) == []
    # The trainer dies here; its successor (same gang generation) restores step 1.
    reader = make_client(server, job_name, capture_rng=False, generation=client.settings.generation)
    out = state(-1.0)
    assert reader.restore(out) == 1 and reader.last_restore["source"] == "storage"
    assert torch.equal(out["w"], state(1.0)["w"]) and torch.equal(out["b"], state(1.0)["b"])
    gate.set()
    assert second.durable.result(30).step == 2


def test_single_segment_diffs_find_the_changed_rows_from_digests(
    make_sidecar, make_client, job_name, short_tmp
):
    """With the previous snapshot gone from memory, the next save is still a diff of exactly the
    rows that changed (the chain's row digests), and restores bitwise from storage."""
    storage = f"file://{short_tmp}/digest-store"
    server = make_sidecar(storage)
    client = make_client(server, job_name, capture_rng=False)
    w = torch.zeros(4096, 64)
    client.save(1, {"w": w}).durable.result(30)
    w[[5, 700, 4095]] += 1.0
    w[9, 63] = -0.0  # a sign bit alone
    client.save(2, {"w": w}).durable.result(30)
    commit = mf.read_commit(server.engine.store, "default", job_name, 2)
    manifest = mf.load_manifest(server.engine.store, commit, 0)
    (entry,) = [t for t in manifest.tensors if t.name == "w"]
    assert manifest.checkpoint == "diff" and entry.changed_rows == 4
    other = make_sidecar(storage)  # holds nothing: the diff is replayed from storage
    out = {"w": torch.ones(4096, 64)}
    reader = make_client(other, job_name, capture_rng=False)
    assert reader.restore(out) == 2 and reader.last_restore["source"] == "storage"
    assert torch.equal(out["w"].view(torch.int32), w.view(torch.int32))


def test_only_the_connection_that_handed_a_segment_over_may_take_it_back(make_sidecar, make_client, job_name):
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    client.save(1, state(1.0)).durable.result(30)
    (snap,) = server.engine.held.snapshots()
    name = client._buffers[0].segment.name
    path = os.path.join(server.settings.shm_dir, server.engine.segments.handover)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as other:
        other.connect(path)
        other.send(b"drop " + name.encode())
        assert other.recv(4096).startswith(b"error: segment")
    assert server.engine.held.exact_positions(snap.identity) == [[0, 1]]  # still held


def forged_memfd(size: int = 4096) -> int:
    """A memfd as a client hands one over: every page written, then sealed."""
    fd = os.memfd_create("forged", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.pwrite(fd, b"x" * size, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE)
    return fd


def test_a_memfd_handed_over_under_another_ranks_segment_name_drops_nothing(
    make_sidecar, make_client, job_name
):
    """Another connection hands over a memfd of its own named like a held segment, then asks to
    take it back: the held snapshot is not its to give up, and the answer says nothing of it."""
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    client.save(1, state(1.0)).durable.result(30)
    (snap,) = server.engine.held.snapshots()
    name = client._buffers[0].segment.name
    path = os.path.join(server.settings.shm_dir, server.engine.segments.handover)
    fd = forged_memfd()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as other:
            other.settimeout(10)
            other.connect(path)
            socket.send_fds(other, [name.encode()], [fd])
            other.recv(4096)
            other.send(b"drop " + name.encode())
            answer = other.recv(4096).decode()
    finally:
        os.close(fd)
    assert "step" not in answer and job_name not in answer, answer
    assert server.engine.held.exact_positions(snap.identity) == [[0, 1]]  # still held
    assert client.save(2, state(2.0)).durable.result(30).step == 2  # its own drop still works
    assert len(memfd_segments(client)) == 1


def test_a_drop_that_fails_is_refused_and_the_handover_socket_serves_on(
    make_sidecar, make_client, job_name, monkeypatch
):
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    client.save(1, state(1.0)).durable.result(30)

    def broken(*args: Any, **kwargs: Any) -> str:
        raise MemoryError("no room for a decoded copy")

    monkeypatch.setattr(server.engine.held, "drop_segment", broken)
    assert client.save(2, state(2.0)).durable.result(30).step == 2  # staged into a new segment
    monkeypatch.undo()
    assert client.save(3, state(3.0)).durable.result(30).step == 3
    assert all(b.segment is not None and b.segment.fd is not None for b in client._buffers)  # memfds
    assert shm_files(server) == []


def test_a_slow_drop_holds_up_no_other_handover(make_sidecar, make_client, job_name, monkeypatch):
    """A drop may hash a whole snapshot: the socket's thread answers other trainers meanwhile."""
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    client.save(1, state(1.0)).durable.result(30)
    held = server.engine.held
    drop, entered, release = held.drop_segment, threading.Event(), threading.Event()

    def slow(*args: Any, **kwargs: Any) -> str:
        entered.set()
        release.wait(10)
        return drop(*args, **kwargs)

    monkeypatch.setattr(held, "drop_segment", slow)
    saving = threading.Thread(target=lambda: client.save(2, state(2.0)).durable.result(30))
    saving.start()
    try:
        assert entered.wait(10)
        fd = forged_memfd()
        try:
            path = os.path.join(server.settings.shm_dir, server.engine.segments.handover)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as other:
                other.settimeout(2)
                other.connect(path)
                socket.send_fds(other, [b"strata-bystander-0"], [fd])
                assert other.recv(4096) == b"ok"
        finally:
            os.close(fd)
    finally:
        release.set()
        saving.join(30)
    assert client._buffers[0].segment is not None and len(memfd_segments(client)) == 1


def test_a_refused_drop_leaves_the_old_segment_mapped_only_while_its_step_is_held(
    make_sidecar, make_client, job_name, monkeypatch
):
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    client.save(1, state(1.0)).durable.result(30)
    held = server.engine.held
    drop = held.drop_segment
    refusals = iter(["step 1 in segment is being copied to peers"])
    monkeypatch.setattr(held, "drop_segment", lambda *a, **k: next(refusals, None) or drop(*a, **k))
    first = client._buffers[0].segment.name
    for step in range(2, 6):
        client.save(step, state(float(step))).durable.result(30)
        assert first not in memfd_segments(client), step  # step 1 left memory at step 2's commit
        assert len(memfd_segments(client)) == 1
    out = state(-1.0)
    assert client.restore(out) == 5 and client.last_restore["source"] == "memory"


def test_a_restarted_sidecar_with_one_staging_segment_gets_new_segments(
    make_sidecar, make_client, job_name, short_tmp
):
    """The default (one segment): the new sidecar never saw the segment nor the connection its
    drop goes on; the save stages into a new segment, handed over to the new sidecar."""
    storage = f"file://{short_tmp}/restart-one"
    first = make_sidecar(storage)
    client = make_client(first, job_name, capture_rng=False)
    assert len(client._buffers) == 1
    client.save(1, state(1.0)).durable.result(30)
    first.stop(grace=0.2)
    second = make_sidecar(storage, socket=first.socket_path)
    assert client.save(2, state(2.0)).durable.result(30).step == 2
    assert client.save(3, state(3.0)).durable.result(30).step == 3
    assert all(b.segment is not None and b.segment.fd is not None for b in client._buffers)  # memfds
    assert shm_files(second) == []
    assert [x.segment for x in second.engine.held.snapshots()] == [client._buffers[0].segment.name]
    out = state(-1.0)
    assert make_client(second, job_name, capture_rng=False).restore(out) == 3
    assert torch.equal(out["w"], state(3.0)["w"])
    assert mf.committed_steps(second.store, "default", job_name) == [1, 2, 3]


def test_a_save_staged_into_the_held_segment_without_a_drop_is_refused_at_admission(
    make_sidecar, make_client, job_name, monkeypatch, caplog
):
    """A client that stages into its one segment without asking for it back first: the sidecar
    refuses the save that names the segment still holding the committed step (it is streamed), and
    the scribbled-over step is never served from memory."""
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    client.save(1, state(1.0)).durable.result(30)
    assert client._segments is not None
    monkeypatch.setattr(client._segments, "drop", lambda segment: None)
    admit = server.engine.admission.begin_save
    refused: list[str] = []

    def watch(*args: Any, **kwargs: Any) -> Any:
        try:
            return admit(*args, **kwargs)
        except Exception as exc:
            refused.append(str(exc))
            raise

    monkeypatch.setattr(server.engine.admission, "begin_save", watch)
    assert client.save(2, state(2.0)).durable.result(30).step == 2
    assert any("still holds step 1" in why for why in refused), refused
    out = state(-1.0)
    assert make_client(server, job_name, capture_rng=False).restore(out, step=1) == 1
    assert torch.equal(out["w"], state(1.0)["w"])


def _queued(conn: socket.socket) -> int:
    """Bytes this side sent that the peer has not read yet."""
    import termios

    return struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]


def test_many_descriptors_lent_under_one_name_arrive_in_order_across_messages(tmp_path):
    """A restore from file storage lends one descriptor per object: past what one message
    carries, they come in several, in order; lent descriptors count against the bound one by one."""
    from sidecar.shm import Handover
    from trainer_client._staging import fetch_lent

    directory = str(tmp_path)
    handover = Handover(directory, ".strata-segments-0123456789abcdef.sock", 0o600)
    try:
        count = Handover.FDS_PER_MESSAGE + 37
        paths = []
        for i in range(count):
            paths.append(tmp_path / f"object-{i}")
            paths[-1].write_bytes(i.to_bytes(2, "big"))
        name = handover.lend_fds([os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths])
        got = fetch_lent(directory, name, count)
        try:
            assert [int.from_bytes(os.pread(fd, 2, 0), "big") for fd in got] == list(range(count))
        finally:
            for fd in got:
                os.close(fd)
        with pytest.raises(OSError, match="did not lend it"):
            fetch_lent(directory, name, count)  # once
        # more than may be lent at once: refused, closed; older names give way to newer ones
        handover.max_lent = 4
        with pytest.raises(OSError, match="at most 4"):
            handover.lend_fds([os.open(paths[0], os.O_RDONLY) for _ in range(5)])
        first = handover.lend_fds([os.open(paths[0], os.O_RDONLY) for _ in range(3)])
        second = handover.lend_fds([os.open(paths[1], os.O_RDONLY) for _ in range(2)])
        assert not handover.lent(first) and handover.lent(second)
        with pytest.raises(OSError, match="lends 2 descriptors"):
            fetch_lent(directory, second, 3)  # another number than the header said: refused
        # one unread answer per connection: descriptors in flight count against the sidecar's limits
        third = handover.lend_fds([os.open(paths[2], os.O_RDONLY)])
        fourth = handover.lend_fds([os.open(paths[3], os.O_RDONLY)])
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(handover.path)
            conn.send(b"get " + third.encode())
            assert select.select([conn], [], [], 30)[0], "no answer to the first get"  # not read
            conn.send(b"get " + fourth.encode())
            # the second get must be answered before the first answer is read: wait until the
            # sidecar has taken it (nothing left queued on this side), then for its answer
            deadline = time.monotonic() + 30
            while _queued(conn) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
            first_answer, fds, _, _ = socket.recv_fds(conn, 4096, 4)
            second_answer = conn.recv(4096)
            for fd in fds:
                os.close(fd)
        assert first_answer == b"ok" and len(fds) == 1
        assert second_answer.startswith(b"error: read the previous answer")
    finally:
        handover.close()


@pytest.mark.parametrize("how", ["ok", "size", "fifo", "undigested", "count"])
def test_lent_files_the_trainer_cannot_check_are_refused(tmp_path, how):
    """What a sidecar lends as a step's files is checked before a byte is read: regular files of
    the header's sizes, as many as it names, and a digest for every tensor to check them by."""
    import numpy as np

    from sidecar.api import pb
    from sidecar.shm import Handover
    from trainer_client import _receive, _verify

    directory = str(tmp_path)
    handover = Handover(directory, ".strata-segments-0123456789abcdef.sock", 0o600)
    try:
        data = bytes(range(256)) * 16
        (tmp_path / "obj").write_bytes(data)
        fds = [os.open(tmp_path / "obj", os.O_RDONLY)]
        sizes = [len(data)]
        digest = mf.xxh3(data)
        if how == "size":
            sizes = [len(data) - 1]
        elif how == "fifo":
            os.mkfifo(tmp_path / "fifo")
            os.close(fds.pop())
            fds.append(os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK))
        elif how == "undigested":
            digest = ""
        elif how == "count":
            sizes = [len(data) // 2, len(data) - len(data) // 2]
        header = pb.RestoreHeader(step=1, total_bytes=sum(sizes), shm_files=sizes)
        header.shm.CopyFrom(pb.SharedSegment(name=handover.lend_fds(fds), size=sum(sizes)))
        out = np.zeros(sum(sizes), np.uint8)
        if how == "ok":  # the same files, as they should be: read, and checked
            _receive.from_segment(header, directory, [_verify.Target(0, out, digest, "t")])
            assert out.tobytes() == data
            return
        with pytest.raises(_receive.FilesUnusable):
            _receive.from_segment(header, directory, [_verify.Target(0, out, digest, "t")])
        assert not out.any()  # nothing was read into the tensor
    finally:
        handover.close()
