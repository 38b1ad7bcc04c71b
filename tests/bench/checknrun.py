"""Check-N-Run section: bytes written and stored per policy and bit width, and model quality
after restores from quantized checkpoints.

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
- Quality: a smaller model of the same shape (4 x 50k rows) learns synthetic clicks. Runs
  restore from a quantized checkpoint k times (k = 1, 3, 20: every table replaced by its
  dequantized per-row quantization, at the bit width the policy picks for k restores) and
  their held-out log loss is compared with an uninterrupted run of the same seed; three
  uninterrupted runs with different seeds give the spread beside it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from sidecar.pipeline import encode as enc
from sidecar.pipeline import quantize as qz
from sidecar.pipeline.policy import POLICIES, start_new_full
from tests.bench.common import Options as BaseOptions
from tests.bench.common import Phases, Row

TABLES = 4
DIM = 64
BITS = (0, 8, 4, 3, 2)  # 0: fp32, lossless
ZIPF_A = 1.1
BATCH = 4096
BAG = 4
MAX_DIFFS = 32  # the sidecar's default --max-diffs

KEYS = (
    "write_reduction_4bit_intermittent",
    "storage_reduction_4bit_intermittent",
    "storage_reduction_2bit_intermittent",
    "rows_changed_fraction",
    "logloss_rel_change_policy_bits",
    "logloss_seed_spread_rel",
)


class Options(BaseOptions):
    @property
    def rows(self) -> int:
        return 1 << 14 if self.quick else 1 << 20

    @property
    def intervals(self) -> int:
        return 6 if self.quick else 24

    @property
    def quality_rows(self) -> int:
        return 4096 if self.quick else 50_000

    @property
    def quality_restores(self) -> tuple[int, ...]:
        return (1, 3) if self.quick else (1, 3, 20)


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


def record_changes(opts: Options, figures: dict[str, Any]) -> list[list[np.ndarray]]:
    """Per interval, per table: which rows changed (compared by bytes with the previous snapshot)."""
    rows = opts.rows
    lookups = lookups_for(rows, 0.25)
    steps = max(1, round(lookups / (BATCH * BAG)))
    figures["cnr_lookups_per_interval"] = steps * BATCH * BAG
    figures["cnr_steps_per_interval"] = steps
    model = DLRM(rows, seed=0)
    opt = Both(optimizers(model, lr=5.0))
    data = Clicks(rows, seed=0)
    previous = [t.weight.detach().clone() for t in model.tables]
    masks: list[list[np.ndarray]] = []
    for i in range(opts.intervals):
        t0 = time.perf_counter()
        train_steps(model, opt, data, steps, BATCH)
        now = [t.weight.detach() for t in model.tables]
        changed = []
        for cur, old in zip(now, previous, strict=True):
            shape = list(cur.shape)
            a = enc.as_rows(memoryview(cur.numpy()).cast("B"), shape)
            b = enc.as_rows(memoryview(old.numpy()).cast("B"), shape)
            changed.append(enc.changed_rows(a, b))
            old.copy_(cur)
        masks.append(changed)
        frac = sum(int(m.sum()) for m in changed) / (rows * TABLES)
        print(
            f"     interval {i + 1:2d}: {frac:.1%} of rows changed ({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
    figures["rows_changed_fraction"] = float(
        np.mean([sum(int(m.sum()) for m in ms) / (rows * TABLES) for ms in masks])
    )
    figures["cnr_dense_bytes"] = sum(p.numel() * 4 for p in model.mlp.parameters())
    return masks


def simulate(
    policy: str, masks: list[list[np.ndarray]], bits: int, dense: int
) -> tuple[list[int], list[int]]:
    """(bytes written per interval, bytes a restore of the newest step reads), the initial full first."""
    rows = len(masks[0][0])
    shape = [rows, DIM]

    def size(kind: str, changed: int) -> int:
        return enc.encoded_bytes(kind, shape, 4, changed, bits)

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
            or (policy == "intermittent" and start_new_full([*sizes, diff / full]))
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


# --- quality -------------------------------------------------------------------------------------


def quantize_tables(model: DLRM, bits: int) -> float:
    """What a restore from a quantized checkpoint hands back; returns the worst relative error."""
    worst = 0.0
    with torch.no_grad():
        for t in model.tables:
            values = t.weight.numpy()
            restored = qz.dequantize_rows(qz.quantize_rows(values, bits, workers=2))
            worst = max(worst, qz.relative_l2_error(values, restored))
            t.weight.copy_(torch.from_numpy(restored))
    return worst


def quality_run(opts: Options, seed: int, restores: int = 0, bits: int = 0) -> float:
    rows = opts.quality_rows
    model = DLRM(rows, seed=seed)
    opt = Both(optimizers(model, lr=5.0))
    data = Clicks(rows, seed=seed)
    intervals = max(opts.intervals, max(opts.quality_restores))
    steps = 3 if opts.quick else 6
    at = set(np.linspace(1, intervals - 1, restores, dtype=int).tolist()) if restores else set()
    for i in range(intervals):
        train_steps(model, opt, data, steps, BATCH)
        if i in at:
            quantize_tables(model, bits)
    held_out = Clicks(rows, seed=999)
    ids, labels = held_out.batch(16384 if opts.quick else 65536, np.random.default_rng(999))
    with torch.no_grad():
        return float(nn.functional.binary_cross_entropy_with_logits(model(ids), labels))


def quality(opts: Options, figures: dict[str, Any]) -> None:
    base = [quality_run(opts, seed) for seed in (0, 1, 2)]
    figures["logloss_uninterrupted"] = base[0]
    figures["logloss_seed_spread_rel"] = (max(base) - min(base)) / float(np.mean(base))
    print(f"     uninterrupted log loss, seeds 0-2: {', '.join(f'{b:.6f}' for b in base)}", flush=True)
    for k in opts.quality_restores:
        bits = qz.bits_for_restores(k)
        loss = quality_run(opts, 0, restores=k, bits=bits)
        rel = abs(loss - base[0]) / base[0]
        figures[f"logloss_rel_change_k{k}_{bits}bit"] = rel
        print(
            f"     {k:2d} restores at {bits} bits: log loss {loss:.6f} ({rel:.4%} vs uninterrupted)",
            flush=True,
        )
        figures["logloss_rel_change_policy_bits"] = rel  # the last k: 20 (or 3 when quick)
        figures["logloss_policy_bits"] = bits
    # The same number of restores at 8 bits: what a more careful --restore-bits table costs in quality.
    k = opts.quality_restores[-1]
    loss = quality_run(opts, 0, restores=k, bits=8)
    rel = figures[f"logloss_rel_change_k{k}_8bit"] = abs(loss - base[0]) / base[0]
    print(f"     {k:2d} restores at 8 bits: log loss {loss:.6f} ({rel:.4%} vs uninterrupted)", flush=True)


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with phases("record row changes (1 training run)"):
        masks = record_changes(opts, figures)
    with phases("price policies x bit widths"):
        for line in price(masks, figures):
            print(line, flush=True)
    with phases("quality runs"):
        quality(opts, figures)
    return _rows(figures)


def _rows(f: dict[str, Any]) -> list[Row]:
    def get(key: str) -> float | None:
        v = f.get(key)
        return float(v) if isinstance(v, int | float) and math.isfinite(v) else None

    def at_least(key: str, target: float) -> Row:
        v = get(key)
        return Row(key, v, "x", None, "", f">= {target:g}x", None if v is None else v >= target)

    spread = get("logloss_seed_spread_rel")
    change = get("logloss_rel_change_policy_bits")
    bound = max(1e-4, spread or 0.0)
    return [
        Row("rows_changed_fraction", get("rows_changed_fraction"), "", None, "", "0.2-0.3", None),
        at_least("write_reduction_4bit_intermittent", 17),
        at_least("storage_reduction_4bit_intermittent", 5),
        at_least("storage_reduction_2bit_intermittent", 8),
        Row("write_reduction_fp32_intermittent", get("write_reduction_fp32_intermittent"), "x"),
        Row("write_reduction_4bit_consecutive", get("write_reduction_4bit_consecutive"), "x"),
        Row(
            "logloss_rel_change_policy_bits",
            change,
            "",
            None,
            "",
            "< 0.01% or seed spread",
            None if change is None else change < bound,
        ),
        Row("logloss_seed_spread_rel", spread, ""),
        Row("logloss_rel_change_k20_8bit", get("logloss_rel_change_k20_8bit"), ""),
    ]
