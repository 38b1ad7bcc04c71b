"""sidecar.engine.restore: where a restore is served from (read ahead, memory, storage) and
what a restore changes for later checkpoints."""

from __future__ import annotations

import threading

import pytest

from sidecar import manifest as mf
from sidecar.engine.attempts import Attempts
from sidecar.engine.held import Held
from sidecar.engine.reports import Reports
from sidecar.engine.restore import Restorer
from sidecar.engine.types import Identity, RestoreData, Snapshot
from sidecar.errors import NotFound

SOLO = Identity("ns", "job", 0, 1, 0, "run/0")
DATA = bytes(range(10))


def restorer_of(shared) -> Restorer:
    held = Held(shared)
    return Restorer(shared, held, Attempts(shared, held, Reports(shared)))


def commit_step(store, step: int, attempt: int = 0) -> None:
    prefix = mf.rank_prefix("ns", "job", step, attempt, "abc", 0)
    store.put(prefix + "obj-00000", DATA)
    manifest = mf.Manifest(
        "ns", "job", step, 0, 1, attempt, "abc", 10, {"w": 1},
        [mf.TensorEntry("w", "uint8", [10], 10, 0, crc32=mf.crc32(DATA))],
        [mf.ObjectEntry(prefix + "obj-00000", 10, mf.crc32(DATA))],
    )  # fmt: skip
    mf.write_manifest(store, prefix, manifest)
    mf.write_commit(store, "ns", "job", step, 1, attempt)


def held_copy(restorer: Restorer, step: int, attempt: int = 0, data: bytes = DATA) -> Snapshot:
    entry = mf.TensorEntry("w", "uint8", [10], 10, 0, crc32=mf.crc32(DATA))
    snap = Snapshot(SOLO, step, "abc", [entry], {"w": 1}, 10, bytearray(data), attempt=attempt)
    snap.state, snap.stored = "committed", [entry]
    with restorer.shared.lock:
        restorer.held.slots.setdefault(SOLO.slot, []).append(snap)
    return snap


def body(data: RestoreData) -> bytes:
    return b"".join(bytes(c) for c in data.chunks)


def test_nothing_committed_is_not_found(make_shared):
    restorer = restorer_of(make_shared())
    with pytest.raises(NotFound, match="no committed checkpoint"):
        restorer.open_restore(SOLO, None)
    with pytest.raises(NotFound, match="step 4 of ns/job has no valid COMMIT"):
        restorer.open_restore(SOLO, 4)


def test_the_attempts_restore_step_comes_from_storage_and_ends_the_chain(make_shared):
    shared = make_shared()
    restorer = restorer_of(shared)
    commit_step(shared.store, 3)
    restorer.held.chains[SOLO.slot] = object()
    data = restorer.open_restore(Identity("ns", "job", 0, 1, 0, "run/1"), None)
    assert (data.step, data.source, body(data)) == (3, "storage", DATA)
    assert SOLO.slot not in restorer.held.chains  # the next checkpoint is a full one
    assert restorer.held.restores[SOLO.job_key] == 1
    assert (
        shared.metrics.registry.get_sample_value(
            "strata_restores_total", {"training_job": "job", "source": "storage"}
        )
        == 1
    )
    assert data.memory is not None and shared.memory.held()["restore"] == 10
    data.memory.release()


def test_a_held_copy_is_served_from_memory_only_while_it_holds_what_was_saved(make_shared):
    shared = make_shared()
    restorer = restorer_of(shared)
    commit_step(shared.store, 3)
    snap = held_copy(restorer, 3)
    memory = restorer._from_memory(SOLO, (0, 3))
    assert memory is not None and (memory.source, body(memory)) == ("memory", DATA)
    assert restorer._from_memory(SOLO, (0, 4)) is None
    snap.buffer[0] ^= 0xFF  # the trainer wrote into its segment since
    assert restorer._from_memory(SOLO, (0, 3)) is None
    data = restorer._load(SOLO, (0, 3))
    assert (data.source, body(data)) == ("storage", DATA)


def test_what_was_read_ahead_is_served_once_and_only_for_its_step(make_shared):
    restorer = restorer_of(make_shared())
    ready = threading.Event()
    ready.set()
    ahead = RestoreData(3, [], None, 10, "storage", "", iter([memoryview(DATA)]))
    restorer.prefetched[SOLO.slot] = ((0, 3), ready, ahead)
    assert restorer._take_prefetched(SOLO, (0, 3)) is ahead
    assert restorer._take_prefetched(SOLO, (0, 3)) is None  # taken
    restorer.prefetched[SOLO.slot] = ((0, 3), ready, ahead)
    assert restorer._take_prefetched(SOLO, (0, 5)) is None  # another step: dropped
    assert SOLO.slot not in restorer.prefetched
    restorer.prefetched[SOLO.slot] = ((0, 3), ready, ahead)
    restorer.forget_prefetched(SOLO.slot)  # a save came first
    assert restorer.prefetched == {}


def test_prefetch_reads_the_restore_step_ahead(make_shared):
    shared = make_shared()
    restorer = restorer_of(shared)
    commit_step(shared.store, 3)
    restorer.prefetch(Identity("ns", "job", 0, 1, 0, "run/1"))
    assert restorer.prefetched[SOLO.slot][1].wait(5)
    target, _, data = restorer.prefetched[SOLO.slot]
    assert target == (0, 3) and data is not None and body(data) == DATA
    assert data.memory is not None and data.memory.kind == "prefetch"
    data.memory.release()


def test_queries(make_shared):
    shared = make_shared()
    restorer = restorer_of(shared)
    commit_step(shared.store, 3)
    commit_step(shared.store, 5)
    held_copy(restorer, 5)
    listed = [(c.step, in_memory) for c, in_memory in restorer.list_checkpoints("ns", "job")]
    assert listed == [(3, False), (5, True)]
    commit, manifest = restorer.describe("ns", "job", 3, 0)
    assert commit.step == 3 and mf.Manifest.from_json(manifest, "m").step == 3


def test_a_step_decoded_from_storage_reserves_what_its_objects_hold_besides_the_snapshot(make_shared):
    """Its objects may hold more than the snapshot (a diff of every row, padding): what the
    manifests say is reserved before the read, not twice the snapshot's size."""
    shared = make_shared()
    restorer = restorer_of(shared)
    prefix = mf.rank_prefix("ns", "job", 3, 0, "abc", 0)
    stored = bytes(16) + DATA + bytes(6)  # the tensor's bytes stored 16 bytes in
    shared.store.put(prefix + "obj-00000", stored)
    entry = mf.TensorEntry("w", "uint8", [10], 10, 0, stored_offset=16, stored_bytes=10, crc32=mf.crc32(DATA))
    manifest = mf.Manifest(
        "ns", "job", 3, 0, 1, 0, "abc", 10, {"w": 1}, [entry],
        [mf.ObjectEntry(prefix + "obj-00000", len(stored), mf.crc32(stored))],
    )  # fmt: skip
    mf.write_manifest(shared.store, prefix, manifest)
    mf.write_commit(shared.store, "ns", "job", 3, 1, 0)
    reserved: list[int] = []
    reserve = shared.memory.reserve

    def spy(kind: str, nbytes: int, what: str, **kw: bool):
        reserved.append(nbytes)
        return reserve(kind, nbytes, what, **kw)

    shared.memory.reserve = spy
    data = restorer._from_storage(SOLO, (0, 3))
    assert body(data) == DATA
    assert reserved == [10 + len(stored)]
    assert data.memory is not None and shared.memory.held()["restore"] == 10  # once read
    data.memory.release()
