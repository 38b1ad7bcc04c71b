"""The intermittent policy's rule (``policy.start_new_full``) against cycle lengths derived by hand.

A cycle "full checkpoint, then k one-shot diffs S_1 .. S_k" (sizes as fractions of the full one)
costs A(k) = (1 + S_1 + ... + S_k) / (k + 1) per interval; the rule must close the cycle (write
a full checkpoint instead of diff k + 1) exactly at the k that minimises A.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest

from sidecar.pipeline.policy import start_new_full


def diffs_in_cycle(sizes: Sequence[float]) -> int:
    """How many of the one-shot diffs ``sizes`` the rule writes before its new full checkpoint
    (``len(sizes)`` when it never starts one)."""
    for i in range(1, len(sizes) + 1):
        if start_new_full(sizes[:i]):
            return i - 1
    return len(sizes)


def average(sizes: Sequence[float], k: int) -> float:
    return (1.0 + sum(sizes[:k])) / (k + 1)


@pytest.mark.parametrize("n", [2, 3, 4, 6, 10, 17, 31])
def test_linear_growth_gives_the_closed_form_cycle(n: int) -> None:
    """New rows at a constant rate s per interval, none touched twice: S_i = i s, so
    A(k) = 1/(k+1) + s k/2, minimal where (k+1)^2 = 2/s. With s = 2/n^2 that is k = n - 1
    diffs, strictly (A(n-2) and A(n) are both larger)."""
    s = 2.0 / n**2
    sizes = [i * s for i in range(1, 4 * n)]
    assert diffs_in_cycle(sizes) == n - 1
    assert average(sizes, n - 1) < min(average(sizes, n - 2), average(sizes, n))


@pytest.mark.parametrize(
    ("rate", "diffs"),
    # argmin_k of A(k) for S_j = 1 - (1 - rate)^j, worked out once (the margins are >= 1e-4):
    # 1%: 14 diffs (A = 0.134), 5%: 6 (0.281), 10%: 4 (0.381), 25%: 2 (0.5625).
    [(0.01, 14), (0.05, 6), (0.10, 4), (0.25, 2)],
)
def test_a_constant_change_rate_gives_the_optimal_cycle(rate: float, diffs: int) -> None:
    """Each row changes with probability ``rate`` in each interval, independently: the one-shot
    diff after j intervals holds 1 - (1 - rate)^j of the rows."""
    sizes = [1.0 - (1.0 - rate) ** j for j in range(1, 200)]
    best = min(range(len(sizes)), key=lambda k: average(sizes, k))
    assert best == diffs
    assert diffs_in_cycle(sizes) == diffs


def test_half_the_rows_per_interval_ties_and_the_rule_takes_the_shorter_cycle() -> None:
    # S = .5, .75: A(1) = A(2) = .75; 2 * .75 >= 1 + .5, so a new full after one diff.
    assert diffs_in_cycle([0.5, 0.75, 0.875]) == 1


def test_a_diff_that_stops_growing_never_starts_a_full_checkpoint() -> None:
    """Every row that will change has changed (a fixed working set): S stays at c < 1 and
    A(k) = (1 + k c)/(k + 1) keeps falling towards c. Only --max-diffs ends such a chain."""
    sizes = [0.1, 0.2, *[0.3] * 60]
    assert diffs_in_cycle(sizes) == len(sizes)
    # The same working set reached at once: no different.
    assert diffs_in_cycle([0.3] * 60) == 60


def test_a_burst_of_changes_starts_a_full_checkpoint_when_it_outgrows_the_cycle() -> None:
    # Slow growth, then most of the table changes in one interval (a new data source, say):
    # A(3) = (1 + .05 + .06 + .07) / 4 = .295, and .8 >= .295: a full checkpoint instead.
    assert diffs_in_cycle([0.05, 0.06, 0.07, 0.8, 0.81]) == 3
    # A burst below the cycle's average so far is just another diff: 4 * .25 < 1 + .45.
    assert diffs_in_cycle([0.1, 0.15, 0.2, 0.25, 0.26]) == 5


@pytest.mark.parametrize("shape", ["sqrt", "log", "saturating"])
def test_concave_growth_closes_the_cycle_at_the_cheapest_length(shape: str) -> None:
    """Skewed (Zipf-like) lookups: a hot set changes every interval and the cold tail slowly,
    so the one-shot diff grows ever more slowly. Whatever the curve, the rule's cycle is the
    cheapest one (brute force over every length)."""
    j = np.arange(1, 100, dtype=np.float64)
    curve = {
        "sqrt": 0.05 * np.sqrt(j),
        "log": 0.08 + 0.04 * np.log(j),
        "saturating": 0.1 + 0.5 * (1 - np.exp(-j / 12)),
    }[shape]
    sizes = [float(x) for x in np.minimum(curve, 1.0)]
    averages = [average(sizes, k) for k in range(len(sizes) + 1)]
    k = diffs_in_cycle(sizes)
    assert math.isclose(averages[k], min(averages), rel_tol=1e-12), (k, int(np.argmin(averages)))
    assert 0 < k < len(sizes)  # a real trade-off in each case: neither no diffs nor endless ones


def test_a_diff_as_large_as_a_full_checkpoint_is_never_written() -> None:
    assert start_new_full([1.0])
    assert start_new_full([1.2])  # quantized diffs carry a bitmap: they can exceed the full one
    assert not start_new_full([0.99])
    assert not start_new_full([])
