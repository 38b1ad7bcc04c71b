"""When to write a full checkpoint and when a differential one (Check-N-Run §4).

``full``
    every checkpoint is complete.
``one-shot``
    every checkpoint after a full one holds the rows changed since that full one:
    restore reads two steps, but diffs grow as more rows get touched.
``consecutive``
    every checkpoint holds the rows changed since the previous one: the smallest
    writes; restore replays the whole chain, and storage grows with it.
``intermittent`` (the default)
    one-shot diffs, and a new full checkpoint whenever that is predicted to be
    cheaper than continuing (:func:`start_new_full`).

Every diff policy also starts over with a full checkpoint after ``max_diffs``
diffs, when the tensors change shape, and after a sidecar restart (the snapshot
to compare with is gone).
"""

from __future__ import annotations

from collections.abc import Sequence

POLICIES = ("full", "one-shot", "consecutive", "intermittent")


def check_policy(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"checkpoint policy {name!r} is not one of {', '.join(POLICIES)}")
    return name


def start_new_full(sizes: Sequence[float]) -> bool:
    """Intermittent policy: write a full checkpoint now instead of the next one-shot diff?

    ``sizes`` are the one-shot diffs since the last full checkpoint, as fractions of
    the full one's size, the last being the diff that would be written now
    (S_1 .. S_i). Derivation: a cycle "full, then i diffs" costs, per interval,

        A(i) = (1 + S_1 + ... + S_i) / (i + 1).

    Writing diff i instead of closing the cycle at i - 1 lowers the average iff
    A(i) < A(i - 1), which rearranges to S_i < A(i - 1). One-shot diffs only grow
    (the set of rows changed since the full one only gains rows), so once S_i
    reaches the average it stays above it and every further diff raises the
    average: that is the moment for a new baseline. Hence: start a new full
    checkpoint when

        i * S_i >= 1 + S_1 + ... + S_{i-1}     (equivalently (i+1) S_i >= 1 + S_1 + ... + S_i),

    the rule Check-N-Run reports. With the diff's size measured rather than
    predicted, the history is the prediction for the next interval (S_{i+1} ~ S_i).

    While every cycle sees the same growth, no prediction of later diffs picks a
    cheaper cycle: the rule sees the diff it decides on, and with S non-decreasing A
    is unimodal (once S_i >= A(i-1), A(i) lies between them, so A(i) <= S_i <= S_{i+1}
    and A keeps rising), so the first trigger is the cheapest cycle length.
    ``tests/unit/test_policy.py`` holds it to closed forms; ``tests/bench/checknrun.py``
    sets it beside a rule predicting the cycle from the measured change rate, the best
    fixed cycle and the offline optimum (over whole cycles it matches the best fixed
    cycle at 1-50% of rows changed per interval).
    """
    if not sizes:
        return False
    i = len(sizes)
    return i * sizes[-1] >= 1.0 + sum(sizes[:-1])
