"""Diffs without the previous snapshot in memory (one staging segment: the trainer stages the
next save over it): the chain keeps each row's digest, and the next diff finds exactly the rows
that changed from them, by value or from the client's lookups with the spot check."""

from __future__ import annotations

from typing import Any

import numpy as np

from sidecar import manifest as mf
from sidecar.pipeline import encode as enc
from sidecar.pipeline.plan import Chain, SnapshotEncoder
from sidecar.pipeline.settings import Quantization

NAME = "emb"
OFF = Quantization("off", (), 0, ())


def encode(step: int, cur: np.ndarray, chain: Chain | None, previous: np.ndarray | None = None, **kw: Any):
    entry = mf.TensorEntry(NAME, "float32", list(cur.shape), cur.nbytes, 0)
    e = SnapshotEncoder(
        step,
        [entry],
        memoryview(cur).cast("B"),
        policy="consecutive",
        max_diffs=1000,
        quant=OFF,
        restores=0,
        chain=chain,
        previous=None if previous is None else memoryview(previous).cast("B"),
        **kw,
    )
    for _ in e.pieces():
        pass
    return e, e.next_chain()


def table(rows: int = 4096, dim: int = 64) -> np.ndarray:
    return np.random.default_rng(3).standard_normal((rows, dim), dtype=np.float32)


def test_a_full_checkpoint_without_a_previous_copy_keeps_row_digests_and_the_next_diff_uses_them():
    old = table()
    e, chain = encode(1, old, None)
    assert e.outcome.kind == "full" and chain.digests is not None
    assert chain.digests[NAME].shape == (len(old), enc.DIGEST_WIDTH)
    cur = old.copy()
    cur[[0, 17, 4095], 5] += 1.0
    cur[9, 63] = -cur[9, 63]  # a sign bit alone
    cur[100].view(np.uint32)[0] ^= 1  # the lowest mantissa bit alone
    e, after = encode(2, cur, chain)  # no previous: only digests
    assert e.outcome.kind == "diff"
    assert np.array_equal(np.flatnonzero(e._write[NAME]), [0, 9, 17, 100, 4095])
    assert np.array_equal(
        after.digests[NAME], enc.row_digests(enc.as_rows(memoryview(cur).cast("B"), cur.shape))
    )


def test_with_a_previous_copy_bytes_are_compared_and_no_digests_are_kept():
    old = table()
    _, chain = encode(1, old, None)
    cur = old.copy()
    cur[7] += 1
    e, after = encode(2, cur, chain, previous=old)
    assert np.array_equal(np.flatnonzero(e._write[NAME]), [7])
    assert after.digests is None  # stale for step 2: the next diff without a copy is full
    e, _ = encode(3, cur, after)
    assert e.outcome.kind == "full"


def test_lookups_are_spot_checked_against_the_digests_and_only_looked_up_rows_digested_again():
    old = table()
    _, chain = encode(1, old, None)
    cur = old.copy()
    looked_up = np.zeros(len(cur), np.bool_)
    looked_up[[3, 4]] = True
    cur[3] += 1
    bitmap = np.packbits(looked_up, bitorder="little").tobytes()
    e, after = encode(2, cur, chain, touched={NAME: bitmap})
    assert e.outcome.tracking_mismatches == 0
    assert np.array_equal(np.flatnonzero(e._write[NAME]), [3, 4])
    assert after.digests is not None
    assert np.array_equal(
        after.digests[NAME], enc.row_digests(enc.as_rows(memoryview(cur).cast("B"), cur.shape))
    )
    # A row changed behind the tracker's back: every untracked row is checked (check_rows), caught.
    cur2 = cur.copy()
    cur2[1000, 0] += 1
    e, _ = encode(3, cur2, after, touched={NAME: bitmap}, check_rows=len(cur))
    assert e.outcome.tracking_mismatches == 1
    assert np.array_equal(np.flatnonzero(e._write[NAME]), [1000])


def test_row_digests_differ_for_any_single_bit_and_for_odd_widths():
    rng = np.random.default_rng(5)
    for width in (1, 2, 3, 6, 256):
        g = enc.digest_group(width)
        rows = rng.integers(0, 256, (64 * g, width), dtype=np.uint8)
        base = enc.row_digests(rows)
        assert base.shape == (64, enc.DIGEST_WIDTH)
        for bit in range(width * 8):
            flipped = rows.copy()
            flipped[7 * g, bit // 8] ^= 1 << (bit % 8)
            d = enc.row_digests(flipped)
            assert (d[7] != base[7]).any() and np.array_equal(np.delete(d, 7, 0), np.delete(base, 7, 0))


def vector(n: int = 1 << 16) -> np.ndarray:
    return np.random.default_rng(4).standard_normal(n, dtype=np.float32)


def test_narrow_rows_are_digested_in_groups_of_at_least_256_bytes():
    """A 1-D tensor has a row per element: its digests stay within 1/32 of its size."""
    old = vector()
    _, chain = encode(1, old, None)
    assert chain.digests is not None
    assert chain.digests[NAME].nbytes * 32 <= old.nbytes
    for dtype in (np.float16, np.uint8):  # 2- and 1-byte rows, a shorter last group
        rows = np.zeros((1000, np.dtype(dtype).itemsize), np.uint8)
        groups = -(-1000 // (256 // rows.shape[1]))
        assert enc.row_digests(rows).shape == (groups, enc.DIGEST_WIDTH)


def test_a_changed_element_of_a_1d_tensor_marks_its_group_and_the_diff_restores_exactly():
    old = vector()
    _, chain = encode(1, old, None)
    cur = old.copy()
    cur[[5, 40000, len(cur) - 1]] += 1.0
    e, after = encode(2, cur, chain)
    assert e.outcome.kind == "diff"
    written = np.flatnonzero(e._write[NAME])
    g = enc.digest_group(4)
    assert set(written // g) == {5 // g, 40000 // g, (len(cur) - 1) // g}
    (entry,) = e.outcome.tensors
    payload = memoryview(b"".join(bytes(p) for p in encode(2, cur, chain)[0].pieces()))
    out = bytearray(old.tobytes())  # the diff applied on the base gives the new bytes exactly
    enc.decode_into(out, payload, entry.encoding, "float32", [len(cur)])
    assert bytes(out) == cur.tobytes()
    assert np.array_equal(
        after.digests[NAME], enc.row_digests(enc.as_rows(memoryview(cur).cast("B"), cur.shape))
    )


def test_lookups_in_narrow_rows_write_those_rows_and_the_spot_check_skips_their_groups():
    rng = np.random.default_rng(6)
    old = rng.standard_normal((1 << 14, 8), dtype=np.float32)  # 32-byte rows: groups of 8
    _, chain = encode(1, old, None)
    cur = old.copy()
    looked_up = np.zeros(len(cur), np.bool_)
    looked_up[[3, 1001]] = True
    cur[[3, 1001]] += 1
    bitmap = np.packbits(looked_up, bitorder="little").tobytes()
    e, after = encode(2, cur, chain, touched={NAME: bitmap}, check_rows=len(cur))
    assert e.outcome.tracking_mismatches == 0
    assert np.array_equal(np.flatnonzero(e._write[NAME]), [3, 1001])
    # the 14 other rows of the two looked-up groups cannot be checked against a digest
    assert e._tracking[NAME] == f"lookups (checked {len(cur) - 16} of {len(cur) - 2} untracked rows)"
    assert np.array_equal(
        after.digests[NAME], enc.row_digests(enc.as_rows(memoryview(cur).cast("B"), cur.shape))
    )


def test_group_digests_are_those_of_the_whole_tensor():
    rows = np.random.default_rng(7).integers(0, 256, (1003, 12), dtype=np.uint8)  # a shorter last group
    every = enc.row_digests(rows)
    which = np.array([0, 5, len(every) - 1])
    assert np.array_equal(enc.group_digests(rows, which), every[which])


def test_an_all_zero_row_does_not_hash_to_zero():
    """The additive key: without it zeros hash to (0, 0) under every key."""
    assert enc.row_digests(np.zeros((4, 256), np.uint8)).any()
