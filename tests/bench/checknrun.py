"""Check-N-Run section: bytes written and stored per policy and bit width. Model quality after
restores from quantized checkpoints is the ``quality`` section (``tests/bench/quality.py``).

Workload (DLRM-style): 4 embedding tables x 1M rows x 64 dims (1 GiB) and a small MLP, plain
SGD with sparse gradients, Zipf-distributed lookups; the number of lookups per interval is
calibrated so that 20-30% of each table's rows change per interval.

- Bytes: one training run is recorded (which rows changed in each interval, found the way the
  sidecar finds them: ``encode.changed_rows`` on consecutive snapshots). Every cell (policy x
  fp32/8/4/3/2 bits) is then priced with ``encode.encoded_bytes``, the size function of the
  encoders the sidecar runs (a unit test holds it equal to what ``encode.encode`` writes), and
  the policies' own decision rule (``policy.start_new_full``). No upload. Ratios are against
  one full fp32 checkpoint per interval; storage is what restoring the newest step needs
  with retention 1, averaged over the intervals.
- Regime: the same, over the fraction of rows changed per interval: one training run per
  fraction in ``FRACTIONS`` (1-50%; the lookups calibrated for each), on the 1M-row tables for
  10% and 25% and on 256k-row tables for the others. Every policy is priced at 4 bits, the
  intermittent one also at the bits ``--quantize auto`` picks for the sidecar's default
  ``--expected-restores`` (every restore lossy: ``--restore-class stored``) and at the bits it
  picks for the quality section's failure mix (``--restore-class auto``: only storage restores
  lossy, the sidecar's default ``--expected-storage-restores``); its rule is set beside a
  candidate rule (cycle length predicted from the measured change rate), the best fixed cycle
  in hindsight and the offline optimum (a dynamic program over where the full checkpoints go),
  over the run and over whole cycles only (the long run: a 24-interval run that happens to end
  on a new full checkpoint reads ~7% worse). The plot goes to ``docs/img/checknrun-regime.png``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from sidecar.pipeline import encode as enc
from sidecar.pipeline.policy import POLICIES, start_new_full
from sidecar.pipeline.quantize import DEFAULT_RESTORE_TABLE, bits_for_restores
from tests.bench.common import REPO_ROOT, Phases, Row
from tests.bench.common import Options as BaseOptions
from tests.bench.quality import FAILURE_MIX, FAILURES, auto_mix_plan

TABLES = 4
DIM = 64
BITS = (0, 8, 4, 3, 2)  # 0: fp32, lossless
ZIPF_A = 1.1
BATCH = 4096
BAG = 4
MAX_DIFFS = 32  # the sidecar's default --max-diffs
#: the regime curves: fractions of rows the lookups of one interval are calibrated to change
FRACTIONS = (0.01, 0.05, 0.10, 0.25, 0.50)
#: fractions recorded on the full-size tables (Options.rows); the others on SMALL_ROWS-row tables
FULL_SIZE_FRACTIONS = (0.10, 0.25)
SMALL_ROWS = 1 << 18
REGIME_PLOT = REPO_ROOT / "docs" / "img" / "checknrun-regime.png"

KEYS = (
    "write_reduction_4bit_intermittent",
    "storage_reduction_4bit_intermittent",
    "storage_reduction_2bit_intermittent",
    "rows_changed_fraction",
)


class Options(BaseOptions):
    @property
    def rows(self) -> int:
        return 1 << 14 if self.quick else 1 << 20

    @property
    def intervals(self) -> int:
        return 6 if self.quick else 24


class DLRM(nn.Module):
    def __init__(self, rows: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True) for _ in range(TABLES)
        )
        for t in self.tables:
            nn.init.normal_(t.weight, std=0.05)
        self.mlp = nn.Sequential(nn.Linear(TABLES * DIM, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [batch, tables, bag]
        x = torch.cat([t(ids[:, i]) for i, t in enumerate(self.tables)], dim=1)
        return self.mlp(x).squeeze(1)


class Clicks:
    """Synthetic click data: Zipf ids per table, labels from a hidden per-row logit."""

    def __init__(self, rows: int, seed: int) -> None:
        self.rows = rows
        world = np.random.default_rng(12345)  # the same "world" for every run
        self.perm = [world.permutation(rows) for _ in range(TABLES)]
        self.truth = [world.normal(0, 0.7, rows).astype(np.float32) for _ in range(TABLES)]
        self.rng = np.random.default_rng(seed)

    def ids(self, rng: np.random.Generator, n: int) -> np.ndarray:
        out = np.empty((n, TABLES, BAG), np.int64)
        for t in range(TABLES):
            z = rng.zipf(ZIPF_A, n * BAG) - 1
            out[:, t] = self.perm[t][z % self.rows].reshape(n, BAG)
        return out

    def batch(self, n: int, rng: np.random.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        rng = rng or self.rng
        ids = self.ids(rng, n)
        logit = sum(self.truth[t][ids[:, t]].sum(1) for t in range(TABLES)) / math.sqrt(BAG) - 0.5
        labels = rng.random(n) < 1 / (1 + np.exp(-logit))
        return torch.from_numpy(ids), torch.from_numpy(labels.astype(np.float32))


def lookups_for(rows: int, fraction: float) -> int:
    """Zipf lookups per table after which ``fraction`` of the rows have been touched."""
    data = Clicks(rows, 0)
    rng = np.random.default_rng(7)

    def touched(n: int) -> float:
        ids = data.ids(rng, max(1, n // BAG))[:, 0].ravel()
        return len(np.unique(ids)) / rows

    lo, hi = rows // 64, rows // 64
    while touched(hi) < fraction:
        lo, hi = hi, hi * 2
    for _ in range(12):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if touched(mid) < fraction else (lo, mid)
    return hi


def train_steps(model: DLRM, opt: Both, data: Clicks, steps: int, batch: int) -> None:
    loss_fn = nn.BCEWithLogitsLoss()
    for _ in range(steps):
        ids, labels = data.batch(batch)
        loss = loss_fn(model(ids), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def optimizers(model: DLRM, lr: float) -> list[torch.optim.Optimizer]:
    sparse = [t.weight for t in model.tables]
    return [torch.optim.SGD(sparse, lr=lr), torch.optim.SGD(model.mlp.parameters(), lr=0.5)]


class Both:
    """Sparse tables and dense MLP with plain SGD each, stepped together."""

    def __init__(self, opts: list[torch.optim.Optimizer]) -> None:
        self.opts = opts

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.opts:
            o.step()


# --- bytes ---------------------------------------------------------------------------------------


@dataclass
class Recording:
    """One training run's changed rows: ``masks[interval][table]``, True where a row changed."""

    fraction: float  # what the lookups were calibrated to
    rows: int
    masks: list[list[np.ndarray]]
    lookups: int  # per table and interval
    steps: int
    batch: int
    dense: int  # bytes of the MLP, written whole in every checkpoint
    seconds: float

    @property
    def changed(self) -> float:
        """The realised fraction of rows changed per interval, averaged over the intervals."""
        return float(np.mean([sum(int(m.sum()) for m in ms) / (self.rows * TABLES) for ms in self.masks]))


def pct(fraction: float) -> str:
    return f"{round(fraction * 100)}"


def record(rows: int, intervals: int, fraction: float) -> Recording:
    """Train ``intervals`` intervals of lookups calibrated to change ``fraction`` of the rows each;
    per interval and table, which rows changed (compared by bytes with the previous snapshot)."""
    t0 = time.perf_counter()
    lookups = lookups_for(rows, fraction)
    steps = max(1, math.ceil(lookups / (BATCH * BAG)))
    batch = max(1, round(lookups / (steps * BAG)))
    model = DLRM(rows, seed=0)
    opt = Both(optimizers(model, lr=5.0))
    data = Clicks(rows, seed=0)
    previous = [t.weight.detach().clone() for t in model.tables]
    masks: list[list[np.ndarray]] = []
    for _ in range(intervals):
        train_steps(model, opt, data, steps, batch)
        now = [t.weight.detach() for t in model.tables]
        changed = []
        for cur, old in zip(now, previous, strict=True):
            shape = list(cur.shape)
            a = enc.as_rows(memoryview(cur.numpy()).cast("B"), shape)
            b = enc.as_rows(memoryview(old.numpy()).cast("B"), shape)
            changed.append(enc.changed_rows(a, b))
            old.copy_(cur)
        masks.append(changed)
    dense = sum(p.numel() * 4 for p in model.mlp.parameters())
    return Recording(
        fraction, rows, masks, steps * batch * BAG, steps, batch, dense, time.perf_counter() - t0
    )


def record_changes(opts: Options, figures: dict[str, Any]) -> dict[float, Recording]:
    """One training run per fraction in FRACTIONS: the full-size tables for FULL_SIZE_FRACTIONS
    (the headline 10% and the 25% of the policy x bits table), SMALL_ROWS-row tables for the others."""
    runs: dict[float, Recording] = {}
    for fraction in FRACTIONS:
        rows = opts.rows if opts.quick or fraction in FULL_SIZE_FRACTIONS else min(opts.rows, SMALL_ROWS)
        run = runs[fraction] = record(rows, opts.intervals, fraction)
        per = [sum(int(m.sum()) for m in ms) / (rows * TABLES) for ms in run.masks]
        p = pct(fraction)
        figures[f"rows_changed_fraction_at_{p}pct"] = run.changed
        figures[f"cnr_rows_at_{p}pct"] = rows
        figures[f"cnr_lookups_per_interval_at_{p}pct"] = run.lookups
        print(
            f"     {fraction:4.0%} target: {TABLES} x {rows} rows, {len(run.masks)} intervals of "
            f"{run.steps} x {run.batch} x {BAG} lookups per table: {run.changed:.1%} of rows changed "
            f"per interval (min {min(per):.1%}, max {max(per):.1%}), {run.seconds:.1f} s",
            flush=True,
        )
    main = runs[0.25]
    figures["cnr_lookups_per_interval"] = main.lookups
    figures["cnr_steps_per_interval"] = main.steps
    figures["rows_changed_fraction"] = main.changed
    figures["cnr_dense_bytes"] = main.dense
    return runs


Rule = Callable[[Sequence[float]], bool]


def simulate(
    policy: str,
    masks: list[list[np.ndarray]],
    bits: int,
    dense: int,
    rule: Rule = start_new_full,
    diff_bits: int | None = None,
) -> tuple[list[int], list[int]]:
    """(bytes written per interval, bytes a restore of the newest step reads), the initial full first.
    ``rule`` decides for the intermittent policy (the sidecar's by default); ``diff_bits`` prices
    diffs at another width than full checkpoints (default: the same)."""
    rows = len(masks[0][0])
    shape = [rows, DIM]

    def size(kind: str, changed: int) -> int:
        width = bits if kind == "quantized" or diff_bits is None else diff_bits
        return enc.encoded_bytes(kind, shape, 4, changed, width)

    full = TABLES * size("quantized" if bits else "raw", 0) + dense
    diff_kind = "rows-diff-quantized" if bits else "rows-diff"
    writes, storage = [full], [full]
    chain = [full]
    since = [np.zeros(rows, np.bool_) for _ in range(TABLES)]
    sizes: list[float] = []
    for delta in masks:
        cum = [s | d for s, d in zip(since, delta, strict=True)]
        write = delta if policy == "consecutive" else cum
        diff = sum(size(diff_kind, int(m.sum())) for m in write) + dense
        if (
            policy == "full"
            or len(sizes) >= MAX_DIFFS
            or (policy == "intermittent" and rule([*sizes, diff / full]))
        ):
            writes.append(full)
            chain, since, sizes = [full], [np.zeros(rows, np.bool_) for _ in range(TABLES)], []
        else:
            writes.append(diff)
            chain = [*chain, diff] if policy == "consecutive" else [chain[0], diff]
            since, sizes = cum, [*sizes, diff / full]
        storage.append(sum(chain))
    return writes, storage


def price(masks: list[list[np.ndarray]], figures: dict[str, Any]) -> list[str]:
    dense = int(figures["cnr_dense_bytes"])
    rows = len(masks[0][0])
    reference = TABLES * rows * DIM * 4 + dense  # one full fp32 checkpoint per interval
    lines = ["     bytes vs a full fp32 checkpoint per interval (writes x / storage x, larger is better):"]
    lines.append("     policy        " + "".join(f"{'fp32' if b == 0 else f'{b} bit':>16}" for b in BITS))
    for policy in POLICIES:
        cells = []
        for bits in BITS:
            writes, storage = simulate(policy, masks, bits, dense)
            label = "fp32" if bits == 0 else f"{bits}bit"
            w = figures[f"write_reduction_{label}_{policy.replace('-', '_')}"] = reference / float(
                np.mean(writes)
            )
            s = figures[f"storage_reduction_{label}_{policy.replace('-', '_')}"] = reference / float(
                np.mean(storage)
            )
            cells.append(f"{w:7.1f} / {s:5.1f}")
        lines.append(f"     {policy:<14}" + "".join(f"{c:>16}" for c in cells))
    return lines


# --- the regime: reductions over the fraction changed, and the intermittent rule against others ---


def auto_bits() -> tuple[int, int]:
    """(planned restores, bits): what ``--quantize auto`` picks for a fresh chain with the sidecar's
    default --expected-restores and --restore-bits (the table it parses, as the sidecar does)."""
    from sidecar.config import SidecarSettings
    from sidecar.pipeline.settings import Quantization, parse_table

    defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SidecarSettings)}
    planned = int(defaults["expected_restores"])
    bits = Quantization("auto", (), planned, parse_table(str(defaults["restore_bits"]))).bits(0)
    if bits != bits_for_restores(planned, DEFAULT_RESTORE_TABLE):
        print(
            f"     note: --restore-bits' default gives {bits} bits for {planned} restores, "
            f"quantize.DEFAULT_RESTORE_TABLE {bits_for_restores(planned)}: using the sidecar's {bits}",
            flush=True,
        )
    return planned, bits


def union_counts(masks: list[list[np.ndarray]]) -> np.ndarray:
    """``counts[a, t, k]`` (a < t): rows of table k changed in intervals a+1 .. t, what a one-shot
    diff at interval t holds after a full checkpoint at interval a (interval 0: the initial full)."""
    n = len(masks)
    counts = np.zeros((n + 1, n + 1, TABLES), np.int64)
    for a in range(n):
        since = [np.zeros_like(m) for m in masks[a]]
        for t in range(a + 1, n + 1):
            for k in range(TABLES):
                np.logical_or(since[k], masks[t - 1][k], out=since[k])
                counts[a, t, k] = np.count_nonzero(since[k])
    return counts


def _diff_bytes(counts: np.ndarray, rows: int, bits: int, dense: int) -> tuple[int, np.ndarray]:
    """(a full checkpoint's bytes, ``diff[a, t]``: the one-shot diff's at t after a full at a)."""
    shape = [rows, DIM]
    full = TABLES * enc.encoded_bytes("quantized" if bits else "raw", shape, 4, 0, bits) + dense
    kind = "rows-diff-quantized" if bits else "rows-diff"
    n = counts.shape[0] - 1
    diff = np.zeros((n + 1, n + 1), np.int64)
    for a in range(n):
        for t in range(a + 1, n + 1):
            diff[a, t] = sum(enc.encoded_bytes(kind, shape, 4, int(c), bits) for c in counts[a, t]) + dense
    return full, diff


def _schedule(fulls: Sequence[int], full: int, diff: np.ndarray) -> list[int]:
    """Writes per interval (0 .. n) with full checkpoints at ``fulls`` (0 first), one-shot diffs between."""
    n = diff.shape[0] - 1
    writes, base = [], 0
    for t in range(n + 1):
        if t in fulls:
            writes.append(full)
            base = t
        else:
            writes.append(int(diff[base, t]))
    return writes


def oracle(counts: np.ndarray, rows: int, bits: int, dense: int) -> list[int]:
    """Writes per interval of the cheapest schedule in hindsight: the full checkpoints placed by a
    dynamic program over the recorded run, one-shot diffs between (at most MAX_DIFFS per cycle).
    A bound no online rule reaches: it knows every later diff and where the run ends."""
    full, diff = _diff_bytes(counts, rows, bits, dense)
    n = counts.shape[0] - 1
    best = [0.0] + [math.inf] * (n + 1)  # best[b]: intervals 0 .. b-1 covered by whole cycles
    start = [0] * (n + 2)
    for b in range(1, n + 2):
        for a in range(max(0, b - 1 - MAX_DIFFS), b):  # a cycle: full at a, diffs a+1 .. b-1
            cost = best[a] + full + float(diff[a, a + 1 : b].sum())
            if cost < best[b]:
                best[b], start[b] = cost, a
    fulls, b = [], n + 1
    while b > 0:
        b = start[b]
        fulls.append(b)
    return _schedule(sorted(fulls), full, diff)


def fixed_cycles(counts: np.ndarray, rows: int, bits: int, dense: int) -> tuple[int, list[list[int]]]:
    """(a full checkpoint's bytes, writes per interval of "a full checkpoint every k + 1 intervals"
    for k = 0 .. MAX_DIFFS diffs per cycle)."""
    full, diff = _diff_bytes(counts, rows, bits, dense)
    n = counts.shape[0] - 1
    return full, [_schedule(range(0, n + 1, k + 1), full, diff) for k in range(min(MAX_DIFFS, n) + 1)]


def long_run(writes: Sequence[int], full: int) -> float:
    """Mean bytes per interval over a schedule's whole cycles, from the initial full checkpoint up
    to (not including) its last one: the rate of a policy that keeps repeating them, free of where
    the recorded run happens to end (on a new full checkpoint, say). The whole run's mean when no
    cycle closes. (A full checkpoint is told by its size: no diff has exactly a full one's.)"""
    starts = [t for t, w in enumerate(writes) if w == full]
    end = starts[-1] if len(starts) > 1 else len(writes)
    return float(np.mean(writes[:end]))


def cheapest_cycle(sizes: Sequence[float]) -> int:
    """The number of diffs k that minimises A(k) = (1 + S_1 + ... + S_k) / (k + 1)."""
    averages = [(1.0 + sum(sizes[:k])) / (k + 1) for k in range(len(sizes) + 1)]
    return int(np.argmin(averages))


def start_new_full_rate(sizes: Sequence[float]) -> bool:
    """A candidate rule (not the sidecar's): the cycle's length predicted from the measured change
    rate. The cycle's first two diffs fit S_j = c + 1 - (1 - r)^j: a part c every diff holds (rows
    changed in every interval, the bitmap, the dense tensors) and rows changing independently at a
    rate r per interval, r (1 - r) = S_2 - S_1 being the second interval's new rows. The cycle is
    closed after the k diffs that minimise that curve's A(k)."""
    if len(sizes) < 2:
        return bool(sizes) and sizes[0] >= 1.0
    d = min(max(sizes[1] - sizes[0], 0.0), 0.25)
    r = (1.0 - math.sqrt(1.0 - 4.0 * d)) / 2.0
    c = sizes[0] - r
    predicted = [c + 1.0 - (1.0 - r) ** j for j in range(1, MAX_DIFFS + 1)]
    return len(sizes) > max(1, cheapest_cycle(predicted))


def price_regime(runs: dict[float, Recording], figures: dict[str, Any]) -> list[str]:
    """Every policy at 4 bits over the fractions changed; the intermittent policy at auto's bits,
    and its rule against a candidate, the best fixed cycle and the offline optimum."""
    planned, auto = auto_bits()
    figures["auto_bits_bytes"] = auto
    figures["auto_planned_restores"] = planned
    head = "     " + " " * 26 + "".join(f"{f'{r.changed:.1%}':>16}" for r in runs.values())
    lines = [
        "     writes x / storage x vs a full fp32 checkpoint per interval, over the rows changed per "
        "interval (realised; calibrated to " + ", ".join(f"{f:.0%}" for f in runs) + "):",
        head,
    ]
    for policy in POLICIES:
        cells = []
        for fraction, run in runs.items():
            writes, storage = simulate(policy, run.masks, 4, run.dense)
            reference = TABLES * run.rows * DIM * 4 + run.dense
            key = f"4bit_{policy.replace('-', '_')}_at_{pct(fraction)}pct"
            w = figures[f"write_reduction_{key}"] = reference / float(np.mean(writes))
            s = figures[f"storage_reduction_{key}"] = reference / float(np.mean(storage))
            cells.append(f"{w:7.1f} / {s:5.1f}")
        lines.append(f"     {policy + ' @ 4 bit':<26}" + "".join(f"{c:>16}" for c in cells))
    # The intermittent policy at the bits auto picks, and its rule against the others (writes
    # only): over the recorded run, and over whole cycles (the long run, where the run's end
    # does not count).
    rules: dict[str, list[str]] = {
        "rule (start_new_full)": [],
        "candidate: rate-predicted": [],
        "fixed cycle (hindsight)": [],
        "offline optimum": [],
    }
    cells = []
    for fraction, run in runs.items():
        p = pct(fraction)
        reference = TABLES * run.rows * DIM * 4 + run.dense
        writes, storage = simulate("intermittent", run.masks, auto, run.dense)
        w = figures[f"write_reduction_auto_at_{p}pct"] = reference / float(np.mean(writes))
        s = figures[f"storage_reduction_auto_at_{p}pct"] = reference / float(np.mean(storage))
        cells.append(f"{w:7.1f} / {s:5.1f}")
        counts = union_counts(run.masks)
        full, fixed = fixed_cycles(counts, run.rows, auto, run.dense)
        k_run = int(np.argmin([np.mean(f) for f in fixed]))
        k_long = int(np.argmin([long_run(f, full) for f in fixed]))
        rate, _ = simulate("intermittent", run.masks, auto, run.dense, rule=start_new_full_rate)
        best = oracle(counts, run.rows, auto, run.dense)
        for name, tag, over_run, longer in (
            ("rule (start_new_full)", "", writes, writes),
            ("candidate: rate-predicted", "_rate", rate, rate),
            ("fixed cycle (hindsight)", "_fixed_cycle", fixed[k_run], fixed[k_long]),
            ("offline optimum", "_oracle", best, None),
        ):
            x = figures[f"write_reduction_auto{tag}_at_{p}pct"] = reference / float(np.mean(over_run))
            cell = f"{x:6.2f}"
            if longer is not None:
                y = figures[f"write_reduction_auto{tag}_longrun_at_{p}pct"] = reference / long_run(
                    longer, full
                )
                cell += f" / {y:6.2f}"
            if tag == "_fixed_cycle":
                figures[f"cnr_fixed_cycle_diffs_at_{p}pct"] = k_run
                figures[f"cnr_fixed_cycle_diffs_longrun_at_{p}pct"] = k_long
                cell += f" k={k_run},{k_long}"
            rules[name].append(cell)
        figures[f"intermittent_rule_vs_oracle_writes_at_{p}pct"] = float(np.mean(writes) / np.mean(best))
        figures[f"intermittent_rule_vs_best_cycle_longrun_writes_at_{p}pct"] = long_run(
            writes, full
        ) / long_run(fixed[k_long], full)
    lines.append(f"     {f'intermittent @ auto {auto} bit':<26}" + "".join(f"{c:>16}" for c in cells))
    # The same at the bits auto picks under the exact restore class for the failure mix (the
    # quality section's FAILURE_MIX: only storage restores are lossy).
    planned_storage, mix_bits = auto_mix_plan()
    figures["auto_mix_bits_bytes"] = mix_bits
    cells = []
    for fraction, run in runs.items():
        p = pct(fraction)
        reference = TABLES * run.rows * DIM * 4 + run.dense
        writes, storage = simulate("intermittent", run.masks, mix_bits, run.dense)
        w = figures[f"write_reduction_auto_mix_at_{p}pct"] = reference / float(np.mean(writes))
        s = figures[f"storage_reduction_auto_mix_at_{p}pct"] = reference / float(np.mean(storage))
        cells.append(f"{w:7.1f} / {s:5.1f}")
    lines.append(f"     {f'intermittent @ mix {mix_bits} bit':<26}" + "".join(f"{c:>16}" for c in cells))
    # The consecutive policy at auto's bits beside it: writes only the rows of one interval, at
    # the price of storage and of restores that replay the chain (up to MAX_DIFFS diffs).
    cells = []
    for fraction, run in runs.items():
        reference = TABLES * run.rows * DIM * 4 + run.dense
        writes, storage = simulate("consecutive", run.masks, auto, run.dense)
        p = pct(fraction)
        w = figures[f"write_reduction_auto_consecutive_at_{p}pct"] = reference / float(np.mean(writes))
        s = figures[f"storage_reduction_auto_consecutive_at_{p}pct"] = reference / float(np.mean(storage))
        cells.append(f"{w:7.1f} / {s:5.1f}")
    lines.append(f"     {f'consecutive @ auto {auto} bit':<26}" + "".join(f"{c:>16}" for c in cells))
    # Priced only (no such encoding is built): full checkpoints at auto's bits and diffs at fewer,
    # which would need each diff row's change since the full quantized instead of its value for
    # the accuracy to hold (the quality section's logloss_diag_diffs*). The frontier says what
    # that design could reach.
    for b in (4, 3, 2):
        if b >= auto:
            continue
        cells = []
        for fraction, run in runs.items():
            reference = TABLES * run.rows * DIM * 4 + run.dense
            writes, _ = simulate("intermittent", run.masks, auto, run.dense, diff_bits=b)
            w = figures[f"write_reduction_full{auto}_diff{b}_at_{pct(fraction)}pct"] = reference / float(
                np.mean(writes)
            )
            cells.append(f"{w:7.1f}")
        lines.append(f"     {f'  priced: diffs @ {b} bit':<26}" + "".join(f"{c:>16}" for c in cells))
    lines.append(
        f"     auto's bits: {auto} for {planned} planned restores, every restore lossy (--restore-class "
        f"stored); {mix_bits} for the failure mix ({FAILURES} failures: "
        + ", ".join(f"{n} {name}" for name, n in FAILURE_MIX)
        + f"; --restore-class auto, --expected-storage-restores {planned_storage})"
    )
    lines.append(
        f"     the intermittent policy's rule, writes x at auto's {auto} bits ({planned} planned restores): "
        "over the run / over whole cycles (the long run); k: diffs per cycle"
    )
    lines.append("     " + " " * 26 + "".join(f"{f'{r.changed:.1%}':>24}" for r in runs.values()))
    for name, row in rules.items():
        lines.append(f"     {name:<26}" + "".join(f"{c:>24}" for c in row))
    return lines


def plot_regime(runs: dict[float, Recording], figures: dict[str, Any], path: Path) -> None:
    """Write and storage reduction over the fraction of rows changed per interval, one line per
    policy at 4 bits (log axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [100 * r.changed for r in runs.values()]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, what in zip(axes, ("write", "storage"), strict=True):
        for policy in POLICIES:
            key = policy.replace("-", "_")
            y = [figures[f"{what}_reduction_4bit_{key}_at_{pct(f)}pct"] for f in runs]
            ax.plot(x, y, marker="o", label=policy)
        if what == "write":
            ax.axhline(17, color="grey", linestyle="--", linewidth=1, label="target 17x")
            if 0.10 in runs:
                auto = figures["auto_bits_bytes"]
                ax.plot(
                    [100 * runs[0.10].changed],
                    [figures["write_reduction_auto_at_10pct"]],
                    marker="*",
                    markersize=14,
                    color="black",
                    linestyle="none",
                    label=f"intermittent @ auto ({auto} bit)",
                )
                ax.plot(
                    [100 * runs[0.10].changed],
                    [figures["write_reduction_auto_mix_at_10pct"]],
                    marker="*",
                    markersize=12,
                    color="tab:purple",
                    linestyle="none",
                    label=f"intermittent @ auto, failure mix ({figures['auto_mix_bits_bytes']} bit)",
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(x, [f"{v:.2g}" for v in x])
        low, high = ax.get_ylim()
        ticks = [t for t in (1, 2, 3, 5, 7, 10, 15, 20, 30, 50, 70, 100, 150, 200, 300) if low <= t <= high]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("rows changed per interval (%)")
        ax.set_ylabel(f"{what} reduction vs fp32 full per interval (x)")
        ax.set_title(
            "bytes written per interval" if what == "write" else "bytes stored (restore newest, retention 1)"
        )
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8, frameon=False)
    by_rows: dict[int, list[str]] = {}
    for f, r in runs.items():
        by_rows.setdefault(r.rows, []).append(f"{f:.0%}")
    fig.suptitle(
        f"Check-N-Run policies at 4 bits: {TABLES} tables x {DIM} dims, "
        f"{len(next(iter(runs.values())).masks)} intervals; rows per table: "
        + ", ".join(f"{rows:,} at {' '.join(fs)}" for rows, fs in sorted(by_rows.items(), reverse=True)),
        fontsize=10,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with phases(f"record row changes ({len(FRACTIONS)} training runs)"):
        runs = record_changes(opts, figures)
    with phases("price policies x bit widths"):
        for line in price(runs[0.25].masks, figures):
            print(line, flush=True)
    with phases("price the regime"):
        for line in price_regime(runs, figures):
            print(line, flush=True)
        # --quick draws the plot too, into its scratch folder: the README's stays the full run's
        plot = opts.tmp / REGIME_PLOT.name if opts.quick else REGIME_PLOT
        plot_regime(runs, figures, plot)
        print(f"     plot: {plot}", flush=True)
    return _rows(figures)


def _rows(f: dict[str, Any]) -> list[Row]:
    def get(key: str) -> float | None:
        v = f.get(key)
        return float(v) if isinstance(v, int | float) and math.isfinite(v) else None

    def at_least(key: str, target: float) -> Row:
        v = get(key)
        return Row(key, v, "x", None, "", f">= {target:g}x", None if v is None else v >= target)

    return [
        Row("rows_changed_fraction", get("rows_changed_fraction"), "", None, "", "0.2-0.3", None),
        at_least("write_reduction_4bit_intermittent", 17),
        Row("rows_changed_fraction_at_10pct", get("rows_changed_fraction_at_10pct"), "", None, "", "~0.1"),
        at_least("write_reduction_auto_at_10pct", 17),
        Row("storage_reduction_auto_at_10pct", get("storage_reduction_auto_at_10pct"), "x"),
        Row("auto_bits_bytes", get("auto_bits_bytes"), "bits"),
        at_least("write_reduction_auto_mix_at_10pct", 17),
        Row("storage_reduction_auto_mix_at_10pct", get("storage_reduction_auto_mix_at_10pct"), "x"),
        Row("auto_mix_bits_bytes", get("auto_mix_bits_bytes"), "bits"),
        Row("write_reduction_auto_longrun_at_10pct", get("write_reduction_auto_longrun_at_10pct"), "x"),
        Row("write_reduction_auto_oracle_at_10pct", get("write_reduction_auto_oracle_at_10pct"), "x"),
        *(
            Row(
                f"write_reduction_4bit_intermittent_at_{p}pct",
                get(f"write_reduction_4bit_intermittent_at_{p}pct"),
                "x",
            )
            for p in (pct(f) for f in FRACTIONS)
        ),
        at_least("storage_reduction_4bit_intermittent", 5),
        at_least("storage_reduction_2bit_intermittent", 8),
        Row("write_reduction_fp32_intermittent", get("write_reduction_fp32_intermittent"), "x"),
        Row("write_reduction_4bit_consecutive", get("write_reduction_4bit_consecutive"), "x"),
    ]
