"""A restore checks what the client copies: every tensor's digest travels in the restore header and
the client checks it while it copies, so bytes it reads from a shared segment (which anyone who
can write the tmpfs may have replaced) are never returned unless they are what was committed."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from sidecar import manifest as mf
from trainer_client import RestoreError


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256, 64), value), "b": torch.full((3,), value, dtype=torch.float64)}


def swap_before_open(monkeypatch: Any, swap: Any) -> list[str]:
    """Whatever segment the sidecar names, ``swap(path)`` replaces it just before the client opens
    it: another process that can write the shm dir winning the race. The names swapped."""
    import trainer_client._receive as receive_module

    original = receive_module.open_segment
    swapped: list[str] = []

    def racing(directory: str, name: str) -> int:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            swap(path)
            swapped.append(name)
        return original(directory, name)

    monkeypatch.setattr(receive_module, "open_segment", racing)
    return swapped


def files_only(monkeypatch: Any) -> None:
    """The client stages into files in the shm dir (an older client, or no memfd): the sidecar
    copies each save out of them, and hands a restore back as a sealed copy it lends."""
    import trainer_client.client as client_module

    monkeypatch.setattr(client_module, "_handover_socket", lambda capabilities: "")


def no_handover_socket(server: Any) -> None:
    """A sidecar without a handover socket: it hands restores back through a file in the shm dir,
    which is what another process could replace."""
    segments = server.engine.segments
    assert segments._handover is not None
    segments._handover.close()
    segments._handover = None


def replace_by_rename(path: str, fill: int) -> None:
    """Put another file of the same size under ``path`` (a mapping of the old one keeps it)."""
    other = f"{path}.other"
    with open(other, "wb") as f:
        f.write(bytes([fill]) * os.path.getsize(path))
    os.rename(other, path)


def replace_by_fifo(path: str) -> None:
    os.unlink(path)
    os.mkfifo(path)


def test_a_file_renamed_over_the_segment_a_restore_reads_is_not_restored(
    make_sidecar, make_client, job_name, caplog, monkeypatch
):
    files_only(monkeypatch)
    server = make_sidecar()
    first = make_client(server, job_name, capture_rng=False, generation="r/0")
    first.save(7, state(7.0)).durable.result(30)
    first._buffers = []  # killed: the sidecar keeps the committed snapshot
    swapped = swap_before_open(monkeypatch, lambda path: replace_by_rename(path, 0x5A))
    # The copy of a file segment is lent sealed: no name in the shm dir to rename anything over.
    lent = make_client(server, job_name, capture_rng=False, generation="r/1")
    out = state(-1.0)
    assert lent.restore(out) == 7 and not swapped
    assert lent.last_restore is not None and lent.last_restore["shared_memory"] is True
    assert torch.equal(out["w"], state(7.0)["w"]) and torch.equal(out["b"], state(7.0)["b"])
    no_handover_socket(server)  # only then is a restore handed over as a file
    second = make_client(server, job_name, capture_rng=False, generation="r/2")
    out = state(-1.0)
    try:
        step = second.restore(out)
    except RestoreError as exc:  # a clear error naming the tensor is acceptable too
        assert "digest" in str(exc) and "'w'" in str(exc), exc
    else:
        assert swapped, "the restore read no segment by name"
        assert step == 7
        assert torch.equal(out["w"], state(7.0)["w"]) and torch.equal(out["b"], state(7.0)["b"])
        # the sidecar's own copy (checked against the digests) served it instead, over gRPC
        assert second.last_restore is not None and second.last_restore["shared_memory"] is False
        assert second.last_restore["unverified_tensors"] == 0
        assert "differs from what was saved" in caplog.text


def test_a_memory_restore_carries_every_tensors_digest(make_sidecar, make_client, job_name):
    server = make_sidecar()
    first = make_client(server, job_name, capture_rng=False, generation="r/0")
    first.save(3, state(3.0)).durable.result(30)
    for restart, shm in ((1, "on"), (2, "off")):  # from the held segment, and streamed
        reader = make_client(server, job_name, capture_rng=False, generation=f"r/{restart}", shm=shm)
        out = state(-1.0)
        assert reader.restore(out) == 3
        assert reader.last_restore is not None and reader.last_restore["source"] == "memory"
        assert reader.last_restore["shared_memory"] is (shm == "on")
        assert reader.last_restore["unverified_tensors"] == 0
        assert torch.equal(out["w"], state(3.0)["w"]) and torch.equal(out["b"], state(3.0)["b"])


def test_restores_from_storage_are_checked_and_lossy_tensors_counted_unverified(
    make_sidecar, make_client, job_name
):
    first = make_sidecar(quantize="8", quantize_match="table")
    saver = make_client(first, job_name, capture_rng=False, generation="s/0")
    saved = {**state(2.0), "table": torch.randn(512, 32)}
    saver.save(2, saved).durable.result(30)
    saver.close()
    first.stop(grace=1)
    second = make_sidecar(quantize="8", quantize_match="table")  # memory gone: storage
    for restart, shm in ((1, "on"), (2, "off")):  # a segment handed over, and streamed
        reader = make_client(second, job_name, capture_rng=False, generation=f"s/{restart}", shm=shm)
        out = {**state(-1.0), "table": torch.zeros(512, 32)}
        assert reader.restore(out) == 2
        assert reader.last_restore is not None and reader.last_restore["source"] == "storage"
        assert reader.last_restore["shared_memory"] is (shm == "on")
        # the quantized table comes back decoded, not as saved: no digest to check it against
        assert reader.last_restore["unverified_tensors"] == 1
        assert torch.equal(out["w"], saved["w"]) and torch.equal(out["b"], saved["b"])


def test_a_fifo_put_under_the_segments_name_does_not_hang_the_restore(
    make_sidecar, make_client, job_name, monkeypatch
):
    files_only(monkeypatch)
    server = make_sidecar()
    first = make_client(server, job_name, capture_rng=False, generation="f/0")
    first.save(5, state(5.0)).durable.result(30)
    first._buffers = []
    no_handover_socket(server)
    swapped = swap_before_open(monkeypatch, replace_by_fifo)
    second = make_client(server, job_name, capture_rng=False, generation="f/1")
    out = state(-1.0)
    assert second.restore(out) == 5  # the sidecar's own copy, over gRPC
    assert swapped, "the restore read no segment by name"
    assert second.last_restore is not None and second.last_restore["shared_memory"] is False
    assert torch.equal(out["w"], state(5.0)["w"]) and torch.equal(out["b"], state(5.0)["b"])


def test_a_chain_from_storage_is_lent_as_read_and_restores_bitwise(
    make_sidecar, make_client, job_name, caplog
):
    """A full checkpoint and its diffs read from storage into the memfd that is lent as it is (no
    copy into a second segment), and the same bytes streamed over gRPC to a client without one."""
    first = make_sidecar(policy="consecutive")
    saver = make_client(first, job_name, capture_rng=False, generation="s/0")
    saved = state(2.0)
    saved["w"] = torch.randn(256, 64)
    for step in range(1, 4):
        if step > 1:
            saved["w"][step * 10 : step * 10 + 5] += 1.0
        saver.save(step, saved).durable.result(30)
    saver.close()
    first.stop(grace=1)
    store = first.engine.shared.store
    newest = mf.read_commit(store, saver.settings.namespace, job_name, 3)
    assert mf.load_manifest(store, newest, 0).checkpoint == "diff"
    second = make_sidecar()  # memory gone: storage
    for restart, shm in ((1, "on"), (2, "off")):
        reader = make_client(second, job_name, capture_rng=False, generation=f"s/{restart}", shm=shm)
        out = state(-1.0)
        assert reader.restore(out) == 3
        assert reader.last_restore is not None and reader.last_restore["source"] == "storage"
        assert reader.last_restore["shared_memory"] is (shm == "on")
        assert torch.equal(out["w"], saved["w"]) and torch.equal(out["b"], saved["b"])
    assert "lending a copy" not in caplog.text


def test_a_full_step_on_file_storage_is_read_from_its_objects_files_bitwise(
    make_sidecar, make_client, job_name
):
    """A full checkpoint stored raw on file:// storage: the sidecar lends its object files as they
    are and the trainer reads them once, straight into its tensors, each tensor's digest checked;
    without shared memory the sidecar streams the same bytes."""
    first = make_sidecar(policy="full")
    saver = make_client(first, job_name, capture_rng=False, generation="s/0")
    saved = state(2.0)
    saved["w"] = torch.randn(256, 64)
    saver.save(4, saved).durable.result(30)
    saver.close()
    first.stop(grace=1)
    store = first.engine.shared.store
    objects = len(
        mf.load_manifest(store, mf.read_commit(store, saver.settings.namespace, job_name, 4), 0).objects
    )
    second = make_sidecar()  # memory gone: storage
    for restart, shm, files in ((1, "on", objects), (2, "off", 0)):
        reader = make_client(second, job_name, capture_rng=False, generation=f"s/{restart}", shm=shm)
        out = state(-1.0)
        assert reader.restore(out) == 4
        assert reader.last_restore is not None and reader.last_restore["source"] == "storage"
        assert reader.last_restore["storage_files"] == files
        assert reader.last_restore["unverified_tensors"] == 0
        assert torch.equal(out["w"], saved["w"]) and torch.equal(out["b"], saved["b"])
    assert second.engine.segments._handover._lent == {}  # nothing left lent


def test_an_object_file_changed_in_place_after_its_commit_is_never_restored(
    make_sidecar, make_client, job_name, caplog
):
    """Storage is not trusted: a byte of the newest step's object changed in place, after the
    sidecar checked its size and lent it. The trainer's digest check refuses what it read, the
    sidecar's own read then finds the object damaged and marks the step unusable, and the older
    step is restored, saying so."""
    first = make_sidecar(policy="full")
    saver = make_client(first, job_name, capture_rng=False, generation="s/0")
    saver.save(1, state(1.0)).durable.result(30)
    saver.save(2, state(2.0)).durable.result(30)
    saver.close()
    first.stop(grace=1)
    store = first.engine.shared.store
    manifest = mf.load_manifest(store, mf.read_commit(store, saver.settings.namespace, job_name, 2), 0)
    w = next(t for t in manifest.tensors if t.name.endswith("w"))
    at, damaged = 0, None
    for o in manifest.objects:  # the object holding w's first byte
        if at <= w.offset < at + o.size:
            damaged = (o.key, w.offset - at)
        at += o.size
    assert damaged is not None
    path = os.path.join(store.url.removeprefix("file://"), damaged[0])
    with open(path, "r+b") as f:  # in place: a descriptor opened before sees it too
        f.seek(damaged[1])
        byte = f.read(1)
        f.seek(damaged[1])
        f.write(bytes([byte[0] ^ 0x40]))
    second = make_sidecar()
    reader = make_client(second, job_name, capture_rng=False, generation="s/1")
    out = state(-1.0)
    assert reader.restore(out) == 1
    assert reader.last_restore is not None and "step 2" in reader.last_restore["fallback_reason"]
    assert torch.equal(out["w"], state(1.0)["w"]) and torch.equal(out["b"], state(1.0)["b"])
    assert "differs from what was saved" in caplog.text  # the trainer's own check refused it first


def test_object_files_a_trainer_could_write_are_not_lent_to_it(
    make_sidecar, make_client, job_name, caplog, monkeypatch
):
    """A trainer in another mount namespace (its own container) is not given the files (root, a
    capability or a borrowed descriptor could reopen one read-write there, whatever its mode):
    the sidecar reads them into a sealed copy instead, and the restore is as exact; the client
    asks no more for files after that."""
    import sidecar.shm as shm_module

    first = make_sidecar(policy="full")
    saver = make_client(first, job_name, capture_rng=False, generation="s/0")
    saved = {**state(2.0), "w": torch.randn(256, 64)}
    saver.save(4, saved).durable.result(30)
    saver.close()
    first.stop(grace=1)
    checked: list[int] = []
    real = shm_module._same_mounts

    def elsewhere(pid: int) -> bool:
        checked.append(pid)
        assert real(pid)  # this test's trainer is this very process
        return False

    monkeypatch.setattr(shm_module, "_same_mounts", elsewhere)
    second = make_sidecar()
    reader = make_client(second, job_name, capture_rng=False, generation="s/1")
    out = state(-1.0)
    caplog.set_level("INFO", logger="strata.client")
    assert reader.restore(out) == 4
    assert checked == [os.getpid()]
    assert reader.last_restore is not None and reader.last_restore["storage_files"] == 0
    assert reader.last_restore["shared_memory"] is True
    assert "another mount namespace" in caplog.text
    assert torch.equal(out["w"], saved["w"]) and torch.equal(out["b"], saved["b"])
    out = state(-1.0)
    assert reader.restore(out) == 4  # again: no files asked for, none refused
    assert checked == [os.getpid()] and reader.last_restore["storage_files"] == 0
    assert torch.equal(out["w"], saved["w"])


def test_files_that_cannot_be_lent_are_read_by_the_sidecar_which_marks_a_damaged_step(
    make_sidecar, make_client, job_name, monkeypatch
):
    """Lending fails (no descriptors left, say): the sidecar reads the step itself as any restore,
    so a damaged object still marks its step unusable and the older one is restored."""
    first = make_sidecar(policy="full")
    saver = make_client(first, job_name, capture_rng=False, generation="s/0")
    saver.save(1, state(1.0)).durable.result(30)
    saver.save(2, state(2.0)).durable.result(30)
    saver.close()
    first.stop(grace=1)
    store = first.engine.shared.store
    manifest = mf.load_manifest(store, mf.read_commit(store, saver.settings.namespace, job_name, 2), 0)
    o = manifest.objects[0]
    body = bytearray(store.get(o.key))
    body[0] ^= 0x01
    store.put(o.key, bytes(body))
    second = make_sidecar()
    tried: list[int] = []

    def no_room(fds: list[int]) -> str:
        tried.append(len(fds))
        for fd in fds:
            os.close(fd)
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(second.engine.segments, "lend_files", no_room)
    reader = make_client(second, job_name, capture_rng=False, generation="s/1")
    out = state(-1.0)
    assert reader.restore(out) == 1
    assert tried and reader.last_restore["storage_files"] == 0
    assert "step 2" in reader.last_restore["fallback_reason"]
    assert torch.equal(out["w"], state(1.0)["w"]) and torch.equal(out["b"], state(1.0)["b"])


def test_a_prefetch_of_a_step_in_files_holds_no_descriptors(make_sidecar, make_client, job_name):
    """Prefetch reads a step stored as files into the page cache and keeps nothing open: any
    client may ask for it, for any number of slots."""
    first = make_sidecar(policy="full")
    saver = make_client(first, job_name, capture_rng=False, generation="s/0")
    saved = {**state(2.0), "w": torch.randn(256, 64)}
    saver.save(3, saved).durable.result(30)
    saver.close()
    first.stop(grace=1)
    second = make_sidecar()
    before = len(os.listdir("/proc/self/fd"))
    reader = make_client(second, job_name, capture_rng=False, generation="s/1")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        entry = second.engine.restorer.prefetched.get(next(iter(second.engine.restorer.prefetched), None))
        if entry is not None and entry[1].is_set():
            break
        time.sleep(0.01)
    assert entry is not None and entry[1].is_set() and entry[2] == "files"  # nothing held for it
    time.sleep(0.2)  # the page-cache read ends after the prefetch is published
    assert len(os.listdir("/proc/self/fd")) - before <= 4  # the client's own sockets, no objects
    out = state(-1.0)
    assert reader.restore(out) == 3 and reader.last_restore["storage_files"] > 0
    assert torch.equal(out["w"], saved["w"])
