"""The benchmark's per-save overhead estimator recovers a known cost and reports none for a
save that costs nothing. The figures in the README stand on it, so it is checked against
steps whose slowdown is planted: sleeps, so the expected value is known to the millisecond."""

from __future__ import annotations

import random
import time
from concurrent.futures import Future

from tests.bench.common import median_ci
from tests.bench.foundation import attributed_overhead, null_save

STEP_S = 0.010
EXTRA_S = 0.020  # what each step overlapping the planted save's work loses
BUSY_STEPS = 3  # steps the planted save's background work lasts


class SleepyTrainer:
    """step() sleeps; while a planted save is pending it sleeps longer, and the save resolves
    after BUSY_STEPS such steps, as a background copy + write would."""

    def __init__(self) -> None:
        self.pending = 0
        self.future: Future[None] | None = None

    def step(self) -> None:
        if self.pending:
            time.sleep(STEP_S + EXTRA_S)
            self.pending -= 1
            if not self.pending and self.future is not None:
                self.future.set_result(None)
        else:
            time.sleep(STEP_S)

    def save(self) -> Future[None]:
        self.future = Future()
        self.pending = BUSY_STEPS
        return self.future


def test_a_planted_cost_is_recovered() -> None:
    trainer = SleepyTrainer()
    res = attributed_overhead(trainer, 5, trainer.save, quiet=3)  # type: ignore[arg-type]
    assert res.failed == 0
    # The save's step, its three busy steps and the margin step are charged to it.
    assert res.spans == [1 + BUSY_STEPS + 1] * 5
    expected = BUSY_STEPS * EXTRA_S
    assert abs(res.overhead_s - expected) < 0.25 * expected, res.overheads


def test_a_save_that_does_nothing_costs_nothing() -> None:
    trainer = SleepyTrainer()
    res = attributed_overhead(trainer, 5, null_save(2.5 * STEP_S), quiet=3)  # type: ignore[arg-type]
    assert res.failed == 0
    assert min(res.spans) >= 2  # it really spanned steps
    assert abs(res.overhead_s) < 0.25 * BUSY_STEPS * EXTRA_S, res.overheads


def test_a_failed_save_is_counted() -> None:
    trainer = SleepyTrainer()

    def failing() -> Future[None]:
        fut: Future[None] = Future()
        fut.set_exception(RuntimeError("upload failed"))
        return fut

    res = attributed_overhead(trainer, 2, failing, quiet=1)  # type: ignore[arg-type]
    assert res.failed == 2
    assert res.spans == [2, 2]  # the save's step and the margin


def test_median_interval_uses_the_binomial_order_statistics() -> None:
    assert median_ci([float(i) for i in range(1, 17)]) == (4.0, 13.0)  # P(X <= 3) = 0.011
    assert median_ci([float(i) for i in range(1, 49)]) == (17.0, 32.0)
    assert median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few for 95%: the whole range


def test_median_interval_covers_the_median_as_often_as_it_says() -> None:
    rng = random.Random(7)
    trials, covered = 2000, 0
    for _ in range(trials):
        # Skewed, like step times on a shared machine; the median of expovariate(1) is ln 2.
        low, high = median_ci([rng.expovariate(1.0) for _ in range(16)])
        covered += low <= 0.6931471805599453 <= high
    assert covered / trials >= 0.95
