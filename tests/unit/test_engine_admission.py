"""sidecar.engine.admission, through the Engine facade over an in-memory store: a save's header
is checked and refused (counted) before anything is held; a stream is held, then committed."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from sidecar.config import SidecarSettings
from sidecar.engine import Engine, Identity, TensorSpec
from sidecar.errors import AlreadyExists, FailedPrecondition, InvalidArgument, ResourceExhausted
from sidecar.metrics import Metrics
from sidecar.store import open_store

SOLO = Identity("ns", "job", 0, 1, 0, "run/0")
W = TensorSpec("w", "float32", (4,), 16)


@pytest.fixture
def engine() -> Iterator[Engine]:
    settings = SidecarSettings(
        storage="memory://unit", shm_dir="", memory_budget=1 << 30, max_snapshot_bytes=64
    )
    engine = Engine(settings, open_store(f"memory://admission-{uuid.uuid4().hex}"), Metrics())
    yield engine
    engine.close()


def refused(engine: Engine) -> float:
    sample = engine.metrics.registry.get_sample_value(
        "strata_checkpoints_total", {"training_job": "job", "result": "refused"}
    )
    return sample or 0.0


@pytest.mark.parametrize(
    ("step", "save_id", "tensors", "tree", "message"),
    [
        (-1, "a", [W], b"", "step must be >= 0"),
        (1, "no spaces", [W], b"", "save_id"),
        (1, "a", [W, W], b"", "duplicate tensor name"),
        (1, "a", [TensorSpec("w", "float32", (4,), 15)], b"", "15 bytes declared"),
        (1, "a", [TensorSpec("w", "nonsense", (4,), 16)], b"", "tensor 'w'"),
        (1, "a", [TensorSpec("w", "float32", (32,), 128)], b"", "--max-snapshot-bytes"),
        (1, "a", [TensorSpec("w", "float32", (4, 1), 16, touched=b"\0\0")], b"", "touched-rows bitmap"),
        (1, "a", [W], b"{not json", "not valid JSON"),
    ],
)
def test_a_bad_header_is_refused_and_counted_before_anything_is_held(
    engine, step, save_id, tensors, tree, message
):
    with pytest.raises(InvalidArgument, match=message):
        engine.begin_save(2, SOLO, step, save_id, tensors, tree)
    assert refused(engine) == 1
    assert engine.snapshots() == [] and engine.memory.held()["snapshot"] == 0


def test_a_stream_is_held_then_committed_and_restored_from_memory(engine):
    snap = engine.begin_save(2, SOLO, 1, "a", [W], b'{"w": 1}')
    assert snap.state == "receiving" and engine.memory.held()["snapshot"] == 16
    engine.write_chunk(snap, bytes(8))
    with pytest.raises(InvalidArgument, match="more than the 16 bytes"):
        engine.write_chunk(snap, bytes(9))
    engine.write_chunk(snap, bytes(range(8)))
    engine.finish(snap, 16, 0.0, 0)
    done = engine.wait_committed(SOLO, 1, "a", 10)
    assert done is snap and snap.state == "committed", snap.message
    assert engine.in_memory("ns", "job", snap.position)
    with pytest.raises(AlreadyExists, match="is committed"):
        engine.begin_save(2, SOLO, 1, "b", [W], b"")
    data = engine.open_restore(SOLO, None)
    assert data.source == "memory" and b"".join(bytes(c) for c in data.chunks) == bytes(8) + bytes(range(8))


def test_a_short_stream_fails_and_an_aborted_one_is_released(engine):
    snap = engine.begin_save(2, SOLO, 1, "a", [W], b"")
    engine.write_chunk(snap, bytes(4))
    with pytest.raises(InvalidArgument, match="stream ended with 4 bytes"):
        engine.finish(snap, 16, 0.0, 0)
    engine.abort(snap, "the trainer went away")
    assert snap.state == "aborted" and snap.done.is_set()
    assert engine.snapshots() == [] and engine.memory.held()["snapshot"] == 0


def test_a_rank_holds_at_most_max_held_snapshots(engine):
    first = engine.begin_save(2, SOLO, 1, "a", [W], b"")
    second = engine.begin_save(2, SOLO, 2, "b", [W], b"")
    with pytest.raises(ResourceExhausted, match="already holds 2 snapshots"):
        engine.begin_save(2, SOLO, 3, "c", [W], b"")
    assert refused(engine) == 1
    for snap in (first, second):
        engine.abort(snap, "test over")


@pytest.mark.parametrize(
    ("tensors", "tree", "message"),
    [
        ([W] * 3, b"", "3 tensors and replicas, more than --max-tensors 2"),
        ([TensorSpec("w" * 1025, "float32", (4,), 16)], b"", "name of 1025 bytes"),
        ([TensorSpec("w", "float32", (1,) * 65, 4)], b"", "65 dimensions"),
        ([TensorSpec("w", "f" * 100, (4,), 16)], b"", "dtype of 100 characters, more than the limit of 64"),
        ([TensorSpec("w", "float32", (4,), 16, role="r" * 65)], b"", "role of 65 characters"),
        ([W], b"[" * 129 + b"]" * 129, "state tree nested deeper than 128"),
        ([W], b"[" * 5000 + b"]" * 5000, "state tree nested deeper than 128"),
        ([W], b'{"a": NaN}', "state tree holds NaN"),
        ([W], b"[Infinity]", "state tree holds Infinity"),
        ([W], b'{"a": [1e999]}', "state tree holds a number that is not finite"),
        ([W], b'"' + b"x" * 20000 + b'"', "state tree of 20002 bytes exceeds --max-tree-bytes 16384"),
    ],
)
def test_header_limits_and_strict_trees(tensors, tree, message):
    settings = SidecarSettings(
        storage="memory://unit", shm_dir="", memory_budget=1 << 30, max_tensors=2, max_tree_bytes=16384
    )
    engine = Engine(settings, open_store(f"memory://limits-{uuid.uuid4().hex}"), Metrics())
    try:
        with pytest.raises(InvalidArgument, match=message):
            engine.begin_save(2, SOLO, 1, "a", tensors, tree)
        assert refused(engine) == 1 and engine.memory.used == 0
    finally:
        engine.close()


def test_a_tree_is_charged_while_its_snapshot_is_held_and_one_too_big_is_refused():
    settings = SidecarSettings(storage="memory://unit", shm_dir="", memory_budget=1 << 20)
    engine = Engine(settings, open_store(f"memory://charged-{uuid.uuid4().hex}"), Metrics())
    try:
        tree = b'{"opt": [' + b",".join(b'{"lr": 0.1}' for _ in range(1000)) + b"]}"
        snap = engine.begin_save(2, SOLO, 1, "a", [W], tree)
        charged = engine.memory.held()["metadata"]
        assert charged > len(tree)  # the parsed tree and its MANIFEST copy, not just the bytes
        engine.abort(snap, "test over")
        assert engine.memory.held()["metadata"] == 0
        # Parsing may take ~30x its bytes: a tree that could never fit is refused unparsed.
        with pytest.raises(FailedPrecondition, match=r"state tree .*--memory-budget"):
            engine.begin_save(2, SOLO, 2, "b", [W], b"[" + b"{}," * 20_000 + b"{}]")
        assert engine.memory.used == 0
    finally:
        engine.close()
