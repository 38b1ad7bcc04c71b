"""The spot check of a tracked table's untracked rows: sized from the table so that a save
in which at least ``check_fraction`` of them changed is caught with probability at least
``check_confidence``, and the caught tensor is diffed by value."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from sidecar import manifest as mf
from sidecar.pipeline.plan import Chain, SnapshotEncoder, check_sample_size, layout_of
from sidecar.pipeline.settings import Quantization

NAME = "model.emb.weight"
DIM = 4  # narrow rows keep a million of them cheap
OFF = Quantization("off", (), 0, ())


def encoder(
    step: int, old: np.ndarray, cur: np.ndarray, looked_up: np.ndarray, **check: Any
) -> SnapshotEncoder:
    """A diff of ``cur`` against ``old`` (step 0, a full checkpoint), tracked by ``looked_up``."""
    entry = mf.TensorEntry(NAME, "float32", list(cur.shape), cur.nbytes, 0)
    chain = Chain(layout_of([entry]), 0, (0,), {NAME: np.zeros(len(cur), np.bool_)}, ())
    bitmap = np.packbits(looked_up, bitorder="little").tobytes()
    return SnapshotEncoder(
        step,
        [entry],
        memoryview(cur).cast("B"),
        policy="consecutive",
        max_diffs=1000,
        quant=OFF,
        restores=0,
        chain=chain,
        previous=memoryview(old).cast("B"),
        touched={NAME: bitmap},
        **check,
    )


def stored_entry(e: SnapshotEncoder) -> mf.TensorEntry:
    for _ in e.pieces():
        pass
    (entry,) = e.outcome.tensors
    return entry


def table(rows: int, tracked: int, untracked_changes: int, seed: int = 7):
    """Old and new values of a table whose first ``tracked`` rows were looked up (and
    changed) and ``untracked_changes`` other rows changed behind the tracker's back."""
    rng = np.random.default_rng(seed)
    old = rng.standard_normal((rows, DIM), dtype=np.float32)
    cur = old.copy()
    looked_up = np.zeros(rows, np.bool_)
    looked_up[:tracked] = True
    cur[:tracked] += 1
    sneaked = tracked + rng.choice(rows - tracked, untracked_changes, replace=False)
    cur[sneaked, 0] += 1
    return old, cur, looked_up, sneaked


@pytest.fixture(scope="module")
def million() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return table(1_000_000, 1000, 1000)


def test_a_thousand_untracked_changes_in_a_million_rows_are_caught_every_save(million):
    old, cur, looked_up, sneaked = million
    expected = np.sort(np.concatenate([np.arange(1000), sneaked]))
    for step in range(1, 21):
        e = encoder(step, old, cur, looked_up)
        assert e.outcome.kind == "diff"
        assert e.outcome.tracking_mismatches == 1, f"step {step}: the spot check missed"
        entry = stored_entry(e)
        assert entry.tracking == "values: tracking missed a row"
        assert entry.changed_rows == len(expected)
        assert np.array_equal(np.flatnonzero(e._write[NAME]), expected)


def test_no_untracked_change_trusts_the_lookups_and_says_how_many_rows_it_checked(million):
    old, _, looked_up, _ = million
    cur = old.copy()
    cur[:1000] += 1  # only the looked-up rows moved
    e = encoder(3, old, cur, looked_up)
    assert e.outcome.tracking_mismatches == 0
    entry = stored_entry(e)
    assert entry.tracking == "lookups (checked 6905 of 999000 untracked rows)"
    assert entry.changed_rows == 1000
    assert np.array_equal(e._write[NAME], looked_up)


def test_the_sample_size_is_the_bound_and_caps_at_the_untracked_rows():
    f, c = 0.001, 0.999
    k = check_sample_size(999_000, f, c)
    assert k == math.ceil(math.log(1 - c) / math.log(1 - f)) == 6905
    assert (1 - f) ** k <= 1 - c < (1 - f) ** (k - 1)  # the smallest such k
    assert check_sample_size(10**9, f, c) == 6905  # independent of the table once it is large
    assert check_sample_size(6905, f, c) == 6905
    assert check_sample_size(5000, f, c) == 5000  # capped: exhaustive
    assert check_sample_size(0, f, c) == 0
    assert check_sample_size(1000, 1.0, 0.5) == 1000  # fraction 1: compare every row
    assert check_sample_size(100_000, 0.001, 0.9) == math.ceil(math.log(0.1) / math.log(0.999))
    for bad in ((0.0, 0.9), (1.5, 0.9), (0.1, 1.0), (0.1, 0.0)):
        with pytest.raises(ValueError):
            check_sample_size(100, *bad)

    # Capped, the check is exhaustive: one changed untracked row in 5,000 is always caught.
    old, cur, looked_up, _ = table(5100, 100, 1)
    for step in range(1, 6):
        e = encoder(step, old, cur, looked_up)
        assert e.outcome.tracking_mismatches == 1
    unchanged = encoder(1, old, np.where(looked_up[:, None], cur, old), looked_up)
    assert stored_entry(unchanged).tracking == "lookups (checked all 5000 untracked rows)"


def misses(old, cur, looked_up, steps, **check) -> float:
    missed = [encoder(step, old, cur, looked_up, **check).outcome.tracking_mismatches == 0 for step in steps]
    return sum(missed) / len(missed)


def test_the_observed_miss_rate_respects_the_stated_bound_where_a_fixed_256_would_not():
    untracked, f, c = 100_000, 0.001, 0.9
    changed = math.ceil(f * untracked)  # exactly the fraction the bound is stated for: 100
    old, cur, looked_up, _ = table(untracked + 1000, 1000, changed, seed=11)
    steps = range(1, 301)
    sigma = math.sqrt(c * (1 - c) / len(steps))
    bound = (1 - c) + 4 * sigma
    rate = misses(old, cur, looked_up, steps, check_fraction=f, check_confidence=c)
    assert rate <= bound, f"missed {rate:.3f} of saves; the bound is {1 - c} (+4 sigma: {bound:.3f})"
    assert rate > 0  # successive saves check different rows (a fixed sample would give 0 or 1)
    # Deterministic per step: a rerun checks the same rows.
    again = [encoder(s, old, cur, looked_up, check_fraction=f, check_confidence=c) for s in (5, 6, 7)]
    first = [encoder(s, old, cur, looked_up, check_fraction=f, check_confidence=c) for s in (5, 6, 7)]
    assert [e.outcome.tracking_mismatches for e in again] == [e.outcome.tracking_mismatches for e in first]
    # The old fixed sample of 256 rows misses about (1 - 256/100000)^100 = 77% of such saves.
    old_rate = misses(old, cur, looked_up, steps, check_rows=256)
    assert old_rate > bound
