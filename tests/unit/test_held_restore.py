"""A restore served from memory equals a restore from storage, bit for bit, with quantization on.

The sidecar keeps each rank's newest snapshot exactly as the trainer saved it, but the
stored checkpoint may be lossy (quantized or downcast tables). The encoder hands back the
stored form of every lossy tensor (``Outcome.held``) and :func:`decode_held` replays it over
the exact snapshot; the result must be what :func:`read_snapshot` decodes from the store,
for every policy and every step of the chain, so that replicas restored from either source
never diverge.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from sidecar import manifest as mf
from sidecar.pipeline import encode as enc
from sidecar.pipeline.plan import Chain, Outcome, SnapshotEncoder, decode_held, read_snapshot
from sidecar.pipeline.settings import Quantization
from sidecar.pipeline.upload import upload_snapshot
from sidecar.store import open_store
from sidecar.store.base import Store

EMB, DENSE, COUNT = "model.emb.weight", "model.fc.weight", "step_count"
ROWS, DIM = 20_000, 16
TABLE = ((1, 2), (3, 3), (20, 4))
OBJECT_BYTES = 256 << 10
DIFFS = 4
CHANGED = 300  # embedding rows changed per step


def quant(mode: str) -> Quantization:
    return Quantization(mode, (), 20, TABLE)


def entries() -> list[mf.TensorEntry]:
    """The snapshot's layout, with alignment gaps between the tensors as the client leaves."""
    specs = [
        (EMB, "float32", [ROWS, DIM], 4, "embedding"),
        (DENSE, "float32", [300, 64], 4, ""),  # large enough to diff, never quantized
        (COUNT, "int64", [8], 8, ""),
    ]
    out, offset = [], 0
    for name, dtype, shape, itemsize, role in specs:
        nbytes = int(np.prod(shape)) * itemsize
        out.append(mf.TensorEntry(name, dtype, shape, nbytes, offset, role=role))
        offset = (offset + nbytes + 4095) // 4096 * 4096
    return out


@dataclass
class Step:
    step: int
    buffer: bytes  # the exact snapshot
    outcome: Outcome
    manifest: mf.Manifest
    #: the chain a restore of this step reads, oldest first, as (step, tensors, held)
    layers: list[tuple[int, list[mf.TensorEntry], dict[str, bytes]]]


def arrays_over_time(seed: int, poison_step: int | None) -> Iterator[dict[str, np.ndarray]]:
    """Step 0, then steps that change a few hundred random rows each (``poison_step``: one of
    them becomes infinite there, which quantization refuses, so that diff stores the table
    exactly)."""
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    dense = rng.standard_normal((300, 64), dtype=np.float32)
    count = np.zeros(8, np.int64)
    yield {EMB: emb, DENSE: dense, COUNT: count}
    for step in range(1, DIFFS + 1):
        emb, dense, count = emb.copy(), dense.copy(), count + 1
        rows = rng.choice(ROWS, CHANGED, replace=False)
        emb[rows] += rng.standard_normal((CHANGED, DIM), dtype=np.float32) * 0.1
        if step == poison_step:
            emb[rows[0], 3] = np.inf
        dense[rng.choice(300, 20, replace=False)] *= np.float32(0.99)
        yield {EMB: emb, DENSE: dense, COUNT: count}


def pack(layout: list[mf.TensorEntry], arrays: dict[str, np.ndarray]) -> bytearray:
    last = layout[-1]
    buf = bytearray(last.offset + last.nbytes)
    for t in layout:
        buf[t.offset : t.offset + t.nbytes] = arrays[t.name].tobytes()
    return buf


def save_chain(
    store: Store,
    executor: ThreadPoolExecutor,
    mode: str,
    policy: str,
    *,
    poison_step: int | None = None,
    pass_hold: bool = True,
) -> list[Step]:
    """Save step 0 and the diffs as the engine does: the chain and previous snapshot from the
    last commit, and ``hold`` = what is held for the chain so far."""
    layout = entries()
    chain: Chain | None = None
    previous: memoryview | None = None
    layers: list[tuple[int, list[mf.TensorEntry], dict[str, bytes]]] = []
    saved = []
    for step, arrays in enumerate(arrays_over_time(7, poison_step)):
        buf = pack(layout, arrays)
        hold = frozenset(name for _, _, held in layers for name in held) if pass_hold else frozenset()
        e = SnapshotEncoder(
            step,
            layout,
            memoryview(buf),
            policy=policy,
            max_diffs=10,
            quant=quant(mode),
            restores=0,
            chain=chain,
            previous=previous,
            hold=hold,
        )
        o = e.outcome

        def make_manifest(
            objects: list[mf.ObjectEntry], step: int = step, o: Outcome = o, size: int = len(buf)
        ) -> mf.Manifest:
            return mf.Manifest(
                "ns",
                "job",
                step,
                0,
                1,
                0,
                "s",
                size,
                {},
                o.tensors,
                objects,
                checkpoint=o.kind,
                base_step=o.base_step,
                requires=o.requires,
            )

        prefix = mf.rank_prefix("ns", "job", step, 0, "s", 0)
        ref = upload_snapshot(store, executor, prefix, e.pieces(), OBJECT_BYTES, make_manifest)
        manifest = mf.Manifest.from_json(store.get(ref.key), ref.key)
        chain, previous = e.next_chain(), memoryview(buf)
        layer = (step, o.tensors, o.held)
        if o.kind == "full":
            layers = [layer]
        elif policy == "consecutive":
            layers = [*layers, layer]
        else:
            layers = [layers[0], layer]
        assert [s for s, _, _ in layers] == [*manifest.requires, step]
        saved.append(Step(step, bytes(buf), o, manifest, layers))
    return saved


def from_storage(store: Store, executor: ThreadPoolExecutor, saved: list[Step], s: Step) -> bytes:
    manifests = {x.step: x.manifest for x in saved}
    return b"".join(bytes(p) for p in read_snapshot(store, s.manifest, manifests.__getitem__, executor))


def from_memory(s: Step) -> bytes:
    view = bytearray(s.buffer)
    decode_held(memoryview(view), [(t, h) for _, t, h in s.layers], steps=[n for n, _, _ in s.layers])
    return bytes(view)


def tensor(data: bytes, t: mf.TensorEntry) -> bytes:
    return data[t.offset : t.offset + t.nbytes]


@pytest.fixture
def store() -> Store:
    return open_store(f"memory://held-{uuid.uuid4().hex}")


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as ex:
        yield ex


@pytest.mark.parametrize("policy", ["intermittent", "one-shot", "consecutive"])
@pytest.mark.parametrize("mode", ["4", "8", "float16", "off"])
def test_a_memory_restore_is_bitwise_the_storage_restore(store, executor, mode, policy):
    saved = save_chain(store, executor, mode, policy)
    assert [s.outcome.kind for s in saved] == ["full"] + ["diff"] * DIFFS
    for s in saved:
        memory, storage = from_memory(s), from_storage(store, executor, saved, s)
        held = {name for _, _, h in s.layers for name in h}
        for t in s.manifest.tensors:
            assert tensor(memory, t) == tensor(storage, t), f"step {s.step}: {t.name} differs"
            if t.name not in held:  # stored losslessly all along the chain: exact either way
                assert tensor(storage, t) == tensor(s.buffer, t), f"step {s.step}: {t.name}"
        assert memory == storage
        # What is held is exactly what was written into the objects.
        stored = b"".join(mf.read_object(store, o) for o in s.manifest.objects)
        for t in s.outcome.tensors:
            if t.name in s.outcome.held:
                start, size = t.stored()
                assert s.outcome.held[t.name] == stored[start : start + size]
        if mode == "off":
            assert held == set()
        else:
            assert held == {EMB} and all(EMB in h for _, _, h in s.layers)
            emb = next(t for t in s.manifest.tensors if t.name == EMB)
            assert tensor(memory, emb) != tensor(s.buffer, emb)  # lossy indeed
    if mode == "4":
        # The full checkpoint holds 4 bits a value plus a 4-byte scale and bias a row: 3/16 of
        # this 16-wide float32 table.
        full = saved[0].outcome.held[EMB]
        assert len(full) == enc.quantized_bytes(ROWS, DIM, 4) < ROWS * DIM * 4 * 3 // 16 + 64


@pytest.mark.parametrize("policy", ["one-shot", "consecutive"])
def test_a_table_stored_exactly_in_a_later_diff_stays_held(store, executor, policy):
    """Step 2 puts an infinity in the table: quantization refuses it and the diff stores its
    rows exactly. Storage still restores the other rows from the quantized full checkpoint,
    so memory must replay that step too, which ``hold`` makes the encoder keep."""
    saved = save_chain(store, executor, "4", policy, poison_step=2)
    emb = {s.step: next(t for t in s.outcome.tensors if t.name == EMB) for s in saved}
    assert emb[0].bits == 4 and emb[2].bits == 0 and emb[2].encoding == "rows-diff"
    for s in saved:
        assert EMB in s.outcome.held
        assert from_memory(s) == from_storage(store, executor, saved, s)


def test_without_hold_the_gap_is_refused_naming_tensor_and_step(store, executor):
    saved = save_chain(store, executor, "4", "one-shot", poison_step=2, pass_hold=False)
    assert EMB not in saved[2].outcome.held
    with pytest.raises(ValueError, match=rf"{EMB}: step 2 has no held form"):
        from_memory(saved[2])


def test_a_missing_or_mismatched_held_layer_is_refused_before_touching_the_buffer(store, executor):
    saved = save_chain(store, executor, "4", "consecutive")
    newest = saved[-1]
    layers = [(t, dict(h)) for _, t, h in newest.layers]
    steps = [n for n, _, _ in newest.layers]
    view = bytearray(newest.buffer)

    del layers[2][1][EMB]  # a middle diff lost its held form
    with pytest.raises(ValueError, match=rf"{EMB}: step 2 has no held form"):
        decode_held(memoryview(view), layers, steps=steps)
    assert view == newest.buffer

    with pytest.raises(ValueError, match=rf"{EMB}: layer 2 has no held form"):
        decode_held(memoryview(view), layers)

    layers = [(t, dict(h)) for _, t, h in newest.layers]
    layers[0][1].clear()  # nothing held for the lossy full checkpoint
    with pytest.raises(ValueError, match=rf"{EMB}: step 0 \(the full checkpoint\) stored it lossily"):
        decode_held(memoryview(view), layers, steps=steps)

    layers = [(t, dict(h)) for _, t, h in newest.layers]
    layers[-1][1][EMB] = layers[-1][1][EMB][:-1]
    with pytest.raises(ValueError, match=rf"{EMB}: step {newest.step} holds"):
        decode_held(memoryview(view), layers, steps=steps)

    layers = [(t, dict(h)) for _, t, h in newest.layers]
    layers[1][1]["nope"] = b""
    with pytest.raises(ValueError, match="step 1 holds nope"):
        decode_held(memoryview(view), layers, steps=steps)
    assert view == newest.buffer


def test_a_lossless_full_checkpoint_holds_only_what_it_is_asked_to(store, executor):
    layout = entries()
    arrays = next(arrays_over_time(1, None))
    buf = pack(layout, arrays)

    def outcome(hold: frozenset[str]) -> Outcome:
        e = SnapshotEncoder(
            0,
            layout,
            memoryview(buf),
            policy="one-shot",
            max_diffs=4,
            quant=quant("off"),
            restores=0,
            hold=hold,
        )
        (piece,) = list(e.pieces())  # the fast path: the snapshot itself, no copy
        assert piece is e.buffer
        return e.outcome

    assert outcome(frozenset()).held == {}
    held = outcome(frozenset({EMB})).held
    assert held == {EMB: arrays[EMB].tobytes()}
