"""Quality section: held-out log loss after restores from quantized checkpoints (Check-N-Run).

The question (issue 17, section 1): how much does restoring k times from checkpoints whose
embedding tables are quantized to b bits move a model's held-out log loss, and does the
default ``--quantize auto`` table (``--restore-bits``) stay below 0.01% relative at the planned
number of restores (the sidecar's default ``--expected-restores``)?

Workload: a small DLRM-like student (``TABLES`` embedding tables of ``Options.rows`` rows x
``DIM``, held as one table with per-table offsets; pairwise dot-product interactions and a
small MLP; row-wise Adagrad on the tables, updating only the rows of the batch, Adam on the
MLP) learns clicks from a hidden teacher of the same shape with its own embeddings
(``TEACHER_DIM``): Zipf-distributed ids per table (a truncated Zipf over the rows in a fixed
random popularity order), labels drawn from the teacher's logit, one fixed "world" for every
seed. Both learning rates decay linearly to 0 over the run (``ANNEAL``): with constant rates
the same run perturbed by restores at 8 bits ended 0.03-0.07% away from its reference, a
noise floor far above the 0.01% to resolve; annealed, under 0.01%. The held-out loss is
printed per quarter of training beside the teacher's own loss (the floor) and a constant
predictor's.

Each seed fixes the student's initialization and its training stream (pregenerated: every run
of a seed sees the same batches in the same order). Per seed an uninterrupted run is the
reference, and every other run is the same training with k restores spread over it like
failures arriving uniformly: restore i of k after ``steps * i / (k + 1)`` steps (the expected
order statistics of k uniform failures), training continuing after each, the loss taken at
the end. A restore replaces the tables by the dequantized per-row quantization of their
current values (``quantize_rows``, what the sidecar's full and row-diff checkpoints store: a
chain restores each row from the checkpoint that last wrote it, which holds the row's current
value), and keeps the dense MLP and the optimizer state exactly (the sidecar quantizes only
embedding-role tensors; optimizer state is stored raw). Runs share the reference's prefix up
to their first restore (a copy of model and optimizers).

The failure mix (issue 31): per seed, FAILURES restores on the same schedule, each served by
the source its failure leaves (``FAILURE_MIX``: a trainer crash restores from its sidecar's
memory, a lost pod from a peer's copy, both exact; a lost gang from storage, lossy). An exact
restore hands back the state and data position of the step exactly, so training goes on as if
nothing happened; a storage restore is the quantization above at the bits ``auto`` picks under
the exact restore class for the sidecar's default ``--expected-storage-restores``. Which
failure reads storage is drawn per seed (the same for every run of it). Beside it, the
all-storage worst case: all FAILURES restores from storage at those bits (the curve's cell).

Figures: per (k restores, bits) the median over seeds of the paired relative change
``(loss_restored - loss_reference) / loss_reference`` and the 95% upper bound of its absolute
value (``median_ci``, the distribution-free interval of the median: with <= 8 seeds it is the
seeds' extremes); the same for the bits ``auto`` picks at the planned restores; the seed
spread of the reference loss. Diagnostics at the planned restores and the paper's bits for
them (``PAPER_TABLE``: 4 bits for 20, where there is an effect to take apart; first
``diagnostic_seeds`` seeds only, for time): touched-only quantization
(rows not looked up since the previous restore left as restored, bit-identical to all rows
when the quantizer is idempotent), quantizing each row's change since the previous restore
instead of its value, the old benchmark's schedule (the last restore at the very end), and
which rows carry the change (the reference model with one popularity bucket's rows, or the
MLP, taken from the restored run). The plot goes to ``docs/img/checknrun-logloss.png``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from sidecar.pipeline import quantize as qz
from tests.bench.common import REPO_ROOT, Phases, Row, median, median_ci
from tests.bench.common import Options as BaseOptions

TABLES = 4
DIM = 16
TEACHER_DIM = 8
ZIPF_A = 1.1
BATCH = 4096
BITS = (2, 3, 4, 8)
WORLD_SEED = 12345
HELD_OUT_SEED = 999
EMB_LR = 0.3
DENSE_LR = 1e-2
#: learning rates decay linearly to 0 over this last fraction of training (0: constant)
ANNEAL = 1.0
#: the relative log-loss change the auto table must stay under (95% upper bound)
TARGET = 1e-4
#: the paper's bit table (Check-N-Run, NSDI 2022): the diagnostics run at its bits for the plan
PAPER_TABLE = ((1, 2), (3, 3), (20, 4))
#: The failure model of the mix (README, "the failure mix"), a model and not a measurement:
#: FAILURES failures per run, counted per kind by the source that serves its restore. Llama 3
#: (Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.3.4) had 419 unexpected
#: interruptions in a 54-day snapshot of 16k GPUs, about 78% of them confirmed or suspected
#: hardware issues (a node lost: its peers' exact copy serves the restore), the rest software or
#: host issues that leave the node up (the trainer crashes: its sidecar's memory serves). A lost
#: gang needs a correlated loss (a power or network domain, the job preempted whole, a second
#: loss in one redundancy group before re-protection): taken as 1 in 20, read from storage in
#: its lossy stored form. Of 20: 1 storage, and the other 19 split 78/22 (14.8 / 4.2). A cluster
#: whose jobs are often preempted whole sets the sidecar's --expected-storage-restores higher.
FAILURES = 20
FAILURE_MIX = (("memory", 4), ("peer", 15), ("storage", 1))
#: the sources that restore the exact snapshot (the gang's restore class "exact")
EXACT_SOURCES = ("memory", "peer")
PLOT = REPO_ROOT / "docs" / "img" / "checknrun-logloss.png"
#: popularity buckets of the "which rows carry the change" diagnostic: rank ranges as fractions
BUCKETS = (("head", 0.0, 0.01), ("torso", 0.01, 0.1), ("tail", 0.1, 1.0))
EVAL_CHUNK = 1 << 17


class Options(BaseOptions):
    @property
    def rows(self) -> int:
        return 1_000 if self.quick else 4_000

    @property
    def steps(self) -> int:
        return 60 if self.quick else 250

    @property
    def seeds(self) -> int:
        """6: the fewest for which the median's distribution-free interval reaches 95%."""
        return 2 if self.quick else 6

    @property
    def diagnostic_seeds(self) -> int:
        """Seeds that also run the diagnostics (touched-only, diffs, old schedule, buckets)."""
        return 1 if self.quick else 3

    @property
    def held_out(self) -> int:
        return 40_000 if self.quick else 300_000

    @property
    def restores(self) -> tuple[int, ...]:
        return (1, 3) if self.quick else (1, 3, 10, 20)


def auto_plan() -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """(planned restores, bits, table): what ``--quantize auto`` picks for a fresh chain with the
    sidecar's default --expected-restores and --restore-bits, parsed as the sidecar does."""
    from sidecar.config import SidecarSettings
    from sidecar.pipeline.settings import Quantization, parse_table

    defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SidecarSettings)}
    planned = int(defaults["expected_restores"])
    table = parse_table(str(defaults["restore_bits"]))
    return planned, Quantization("auto", (), planned, table).bits(0), table


def auto_mix_plan() -> tuple[int, int]:
    """(planned storage restores, bits): what ``--quantize auto`` picks for a fresh chain under
    the exact restore class (``--restore-class auto``: restores from memory or peers add no
    error) with the sidecar's default --expected-storage-restores and --restore-bits, parsed
    as the sidecar does."""
    from types import SimpleNamespace

    from sidecar.config import SidecarSettings
    from sidecar.pipeline.settings import quantization

    defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SidecarSettings)}
    q = quantization(SimpleNamespace(**{**defaults, "quantize": "auto", "restore_class": "auto"}))
    return q.expected_storage_restores, q.bits(0, 0)


def failure_sources(seed: int) -> list[str]:
    """The seed's FAILURES failures in order of arrival, each named by the source its restore
    reads: FAILURE_MIX's counts in an order drawn per seed (the same for every run of it)."""
    kinds = [name for name, n in FAILURE_MIX for _ in range(n)]
    order = np.random.default_rng([seed, 2]).permutation(len(kinds))
    return [kinds[i] for i in order]


# --- the world: a hidden teacher, Zipf ids ---------------------------------------------------------


class World:
    """The teacher (its own embeddings; linear and pairwise terms, as the student's shape) and the
    id distribution: the same for every seed."""

    def __init__(self, rows: int) -> None:
        g = np.random.default_rng(WORLD_SEED)
        self.rows = rows
        p = 1.0 / np.arange(1, rows + 1, dtype=np.float64) ** ZIPF_A
        self.popularity = p / p.sum()  # probability of each popularity rank
        self.cdf = np.cumsum(self.popularity)
        self.perm = np.stack([g.permutation(rows) for _ in range(TABLES)])  # [table, rank] -> id
        self.emb = (g.standard_normal((TABLES, rows, TEACHER_DIM)) * 0.6).astype(np.float32)
        self.w = (g.standard_normal((TABLES, TEACHER_DIM)) * 0.5).astype(np.float32)
        self.pair = np.float32(0.3)
        self.bias = np.float32(-1.0)

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``n`` clicks: ids [n, TABLES] (int64, flat: table t's row r is ``t * rows + r``, as the
        student stacks its tables), labels [n] (float32, 0/1), teacher logits [n]."""
        ids = np.empty((n, TABLES), np.int64)
        labels = np.empty(n, np.float32)
        logits = np.empty(n, np.float32)
        for s in range(0, n, 1 << 16):
            m = min(1 << 16, n - s)
            ranks = np.minimum(np.searchsorted(self.cdf, rng.random((m, TABLES))), self.rows - 1)
            part = np.stack([self.perm[t][ranks[:, t]] for t in range(TABLES)], axis=1)
            e = np.stack([self.emb[t][part[:, t]] for t in range(TABLES)], axis=1)  # [m, T, TD]
            logit = np.einsum("ntd,td->n", e, self.w) + self.bias
            for i in range(TABLES):
                for j in range(i + 1, TABLES):
                    logit += self.pair * np.einsum("nd,nd->n", e[:, i], e[:, j])
            ids[s : s + m] = part + np.arange(TABLES) * self.rows
            logits[s : s + m] = logit
            labels[s : s + m] = rng.random(m) < 1.0 / (1.0 + np.exp(-logit))
        return ids, labels, logits

    def bucket_rows(self, lo: float, hi: float) -> np.ndarray:
        """Rows of the student's stacked table whose popularity rank is in [lo, hi) of each table's."""
        a = int(lo * self.rows)
        b = max(a + 1, int(hi * self.rows))
        return (self.perm[:, a:b] + np.arange(TABLES)[:, None] * self.rows).ravel()

    def traffic(self, lo: float, hi: float) -> float:
        a = int(lo * self.rows)
        return float(self.popularity[a : max(a + 1, int(hi * self.rows))].sum())


def bce(logits: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor) -> float:
    x = torch.as_tensor(logits, dtype=torch.float64)
    y = torch.as_tensor(labels, dtype=torch.float64)
    return float(nn.functional.binary_cross_entropy_with_logits(x, y))


# --- the student ----------------------------------------------------------------------------------


class Student(nn.Module):
    """DLRM-like: one embedding per table (the tables stacked in one ``[TABLES * rows, DIM]``
    tensor, looked up by flat ids), their pairwise dot products and the embeddings into a
    small MLP. The table is a plain tensor: :class:`Trainer` updates it sparsely itself."""

    def __init__(self, rows: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.rows = rows
        self.weight = torch.randn(TABLES * rows, DIM) * 0.01
        self.iu = torch.triu_indices(TABLES, TABLES, 1)
        pairs = TABLES * (TABLES - 1) // 2
        self.mlp = nn.Sequential(nn.Linear(TABLES * DIM + pairs, 64), nn.ReLU(), nn.Linear(64, 1))

    def head(self, e: torch.Tensor) -> torch.Tensor:  # e: [batch, TABLES, DIM]
        inter = torch.bmm(e, e.transpose(1, 2))[:, self.iu[0], self.iu[1]]
        return self.mlp(torch.cat([e.flatten(1), inter], dim=1)).squeeze(1)

    def forward(self, flat: torch.Tensor) -> torch.Tensor:  # flat ids: [batch, TABLES]
        return self.head(self.weight[flat])


class Trainer:
    """Model, optimizer state and the number of steps taken: copied whole for a snapshot.

    The tables learn with row-wise Adagrad (one accumulator per row, as DLRM trains its
    embeddings), applied to the rows of the batch only; the MLP with Adam."""

    def __init__(self, rows: int, seed: int) -> None:
        self.model = Student(rows, seed)
        self.accumulator = torch.zeros(TABLES * rows)
        self.dense = torch.optim.Adam(self.model.mlp.parameters(), lr=DENSE_LR)
        self.step = 0

    def train(self, data: Stream, until: int) -> None:
        loss_fn = nn.BCEWithLogitsLoss()
        w, acc = self.model.weight, self.accumulator
        total = len(data.ids)
        for i in range(self.step, until):
            factor = min(1.0, (total - i) / (ANNEAL * total)) if ANNEAL > 0 else 1.0
            for group in self.dense.param_groups:
                group["lr"] = DENSE_LR * factor
            flat = data.ids[i]
            e = w[flat].requires_grad_()
            loss = loss_fn(self.model.head(e), data.labels[i])
            self.dense.zero_grad(set_to_none=True)
            loss.backward()
            self.dense.step()
            assert e.grad is not None
            rows, inverse = torch.unique(flat.reshape(-1), return_inverse=True)
            g = torch.zeros(len(rows), DIM).index_add_(0, inverse, e.grad.reshape(-1, DIM))
            acc[rows] += g.square().mean(dim=1)
            w[rows] -= (EMB_LR * factor) * g / (acc[rows].sqrt() + 1e-10)[:, None]
        self.step = max(self.step, until)

    def table(self) -> np.ndarray:
        """The stacked embedding table, a writable view."""
        return self.model.weight.numpy()

    def logits(self, flat: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([self.model(flat[s : s + EVAL_CHUNK]) for s in range(0, len(flat), EVAL_CHUNK)])


@dataclass
class Stream:
    """One seed's training batches, in order."""

    ids: torch.Tensor  # [steps, BATCH, TABLES], flat ids of the stacked table
    labels: torch.Tensor  # [steps, BATCH]

    def touched(self, start: int, stop: int) -> np.ndarray:
        """Rows of the stacked table looked up in steps [start, stop)."""
        return np.unique(self.ids[start:stop].numpy())


@dataclass(frozen=True)
class Plan:
    """k restores at ``bits``. ``mode``: "all" rows quantized at each restore; "touched": only
    rows looked up since the previous restore (the rest are as that restore left them);
    "delta": touched rows store their change since the previous restore, quantized.
    ``schedule``: "spread" (restore i after steps * i / (k + 1)) or "end" (the old benchmark's:
    after steps * i / k, the last at the very end)."""

    k: int
    bits: int
    mode: str = "all"
    schedule: str = "spread"

    def at(self, steps: int) -> list[int]:
        if self.schedule == "end":
            return [round(steps * (i + 1) / self.k) for i in range(self.k)]
        return [round(steps * (i + 1) / (self.k + 1)) for i in range(self.k)]

    @property
    def label(self) -> str:
        extra = "" if self.mode == "all" else f" {self.mode}-only" if self.mode == "touched" else " diffs"
        return f"{self.k:2d} x {self.bits} bit{extra}{' (old schedule)' if self.schedule == 'end' else ''}"


def restore(
    trainer: Trainer, plan: Plan, previous: np.ndarray | None, touched: np.ndarray | None
) -> np.ndarray:
    """Replace the table by what a restore from a quantized checkpoint hands back; returns it."""
    w = trainer.table()
    if previous is None or plan.mode == "all":
        w[:] = qz.dequantize_rows(qz.quantize_rows(w, plan.bits))
    elif plan.mode == "touched":
        assert touched is not None
        w[touched] = qz.dequantize_rows(qz.quantize_rows(w[touched], plan.bits))
    else:  # delta: the previous restore's values plus the quantized change since
        assert touched is not None
        base = previous[touched]
        w[touched] = base + qz.dequantize_rows(qz.quantize_rows(w[touched] - base, plan.bits))
    return w.copy()


def run_plan(
    snapshot: Trainer, plan: Plan, data: Stream, steps: int, lossy: list[int] | None = None
) -> Trainer:
    """Continue a copy of ``snapshot`` (taken at the first lossy restore) through the plan.
    ``lossy``: the steps whose restores read the quantized checkpoint (default: all the plan's);
    the others restore the exact snapshot, which leaves training as if nothing happened."""
    trainer = copy.deepcopy(snapshot)
    previous: np.ndarray | None = None
    last = 0
    for at in plan.at(steps) if lossy is None else lossy:
        trainer.train(data, at)
        touched = data.touched(last, at) if previous is not None and plan.mode != "all" else None
        previous = restore(trainer, plan, previous, touched)
        last = at
    trainer.train(data, steps)
    return trainer


# --- the measurement ----------------------------------------------------------------------------


@dataclass
class Results:
    reference: list[float] = dataclasses.field(default_factory=list)
    changes: dict[Plan, list[float]] = dataclasses.field(default_factory=dict)
    buckets: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    touched_identical: list[bool] = dataclasses.field(default_factory=list)
    #: per seed: the failure mix's change, and the fraction of its restores of exact class
    mix: list[float] = dataclasses.field(default_factory=list)
    mix_exact: list[float] = dataclasses.field(default_factory=list)

    def add(self, plan: Plan, change: float) -> None:
        self.changes.setdefault(plan, []).append(change)


def plans(opts: Options, planned: int, diag_bits: int) -> tuple[list[Plan], list[Plan]]:
    """(the curve's plans, the diagnostics' plans)."""
    curve = [Plan(k, b) for k in opts.restores for b in BITS]
    diagnostics = [
        Plan(planned, diag_bits, mode="touched"),
        Plan(planned, diag_bits, mode="delta"),
        Plan(planned, 2, mode="delta"),
        Plan(planned, diag_bits, schedule="end"),
    ]
    return curve, diagnostics


def measure_seed(
    opts: Options,
    seed: int,
    world: World,
    held: tuple[torch.Tensor, torch.Tensor],
    todo: list[Plan],
    auto_cell: Plan,
    diag_cell: Plan,
    mix_bits: int,
    results: Results,
    figures: dict[str, Any],
    diagnose: bool,
) -> None:
    steps, rows = opts.steps, opts.rows
    t0 = time.perf_counter()
    ids, labels, _ = world.sample(np.random.default_rng([seed, 1]), steps * BATCH)
    data = Stream(
        torch.from_numpy(ids).view(steps, BATCH, TABLES), torch.from_numpy(labels).view(steps, BATCH)
    )
    held_ids, held_labels = held
    t_data = time.perf_counter() - t0

    # The failure mix: FAILURES restores spread like the plans', the storage ones lossy at the
    # bits auto picks for the mix, the exact ones (memory, peers) leaving training untouched.
    mix_plan = Plan(FAILURES, mix_bits)
    sources = failure_sources(seed)
    lossy = [at for at, src in zip(mix_plan.at(steps), sources, strict=True) if src not in EXACT_SOURCES]
    results.mix_exact.append(1 - len(lossy) / len(sources))

    # The reference, with a snapshot at every plan's first restore (and its loss per quarter).
    firsts = sorted({p.at(steps)[0] for p in todo} | set(lossy[:1]))
    quarters = [steps * q // 4 for q in (1, 2, 3)]
    snapshots: dict[int, Trainer] = {}
    curve: list[float] = []
    reference = Trainer(rows, seed)
    for at in sorted({*firsts, *quarters, steps}):
        reference.train(data, at)
        if at in firsts:
            snapshots[at] = copy.deepcopy(reference)
        if at in quarters and seed == 0:
            curve.append(bce(reference.logits(held_ids), held_labels))
    ref_logits = reference.logits(held_ids)
    ref_loss = bce(ref_logits, held_labels)
    results.reference.append(ref_loss)
    if seed == 0:
        curve.append(ref_loss)
        figures["logloss_last_quarter_rel_gain"] = (curve[-2] - curve[-1]) / curve[-1]
        print(
            "     seed 0 held-out log loss per quarter of training: "
            + ", ".join(f"{c:.5f}" for c in curve)
            + f" (last quarter {figures['logloss_last_quarter_rel_gain']:.3%})",
            flush=True,
        )

    t_runs = time.perf_counter()
    finals: dict[Plan, Trainer] = {}
    losses: dict[Plan, float] = {}
    for plan in todo:
        trained = run_plan(snapshots[plan.at(steps)[0]], plan, data, steps)
        loss = bce(trained.logits(held_ids), held_labels)
        losses[plan] = loss
        results.add(plan, (loss - ref_loss) / ref_loss)
        if diagnose and plan in (diag_cell, dataclasses.replace(diag_cell, bits=2)):
            finals[plan] = trained
    if lossy:
        trained = run_plan(snapshots[lossy[0]], mix_plan, data, steps, lossy=lossy)
        loss = bce(trained.logits(held_ids), held_labels)
        results.mix.append((loss - ref_loss) / ref_loss)
    else:  # every restore exact: the run is the reference
        results.mix.append(0.0)
    touched = dataclasses.replace(diag_cell, mode="touched")
    if touched in losses:
        results.touched_identical.append(losses[touched] == losses[diag_cell])

    # Which rows carry the change: the reference with one bucket of rows (or the MLP) taken
    # from the diagnosed cell's restored run.
    for name, plan in (("", diag_cell), ("_2bit", dataclasses.replace(diag_cell, bits=2))):
        if plan not in finals:
            continue
        restored = finals[plan]
        hybrid = copy.deepcopy(reference)
        for bucket, lo, hi in BUCKETS:
            picked = world.bucket_rows(lo, hi)
            w = hybrid.table()
            saved = w[picked].copy()
            w[picked] = restored.table()[picked]
            loss = bce(hybrid.logits(held_ids), held_labels)
            w[picked] = saved
            results.buckets.setdefault(f"{bucket}{name}", []).append((loss - ref_loss) / ref_loss)
        hybrid.model.mlp.load_state_dict(restored.model.mlp.state_dict())
        loss = bce(hybrid.logits(held_ids), held_labels)
        results.buckets.setdefault(f"dense{name}", []).append((loss - ref_loss) / ref_loss)
    cell = results.changes[auto_cell][-1]
    storage = ", ".join(f"#{i + 1}" for i, src in enumerate(sources) if src not in EXACT_SOURCES)
    print(
        f"     seed {seed}: reference {ref_loss:.5f}; {auto_cell.label}: {cell:+.4%}; mix at "
        f"{mix_bits} bit (storage: failure {storage or 'none'} of {FAILURES}): {results.mix[-1]:+.4%} "
        f"(data {t_data:.1f} s, runs {time.perf_counter() - t_runs:.1f} s)",
        flush=True,
    )


def upper_bound(values: list[float]) -> float:
    """95% upper bound of the absolute median change: the larger end of ``median_ci`` in size."""
    lo, hi = median_ci(values)
    return max(abs(lo), abs(hi))


def t_bound(values: list[float]) -> float:
    """95% upper bound of |mean| from a two-sided t-interval (for comparison)."""
    n = len(values)
    if n < 2:
        return math.nan
    t975 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
    t = t975.get(n - 1, 2.0)
    m, sd = statistics.fmean(values), statistics.stdev(values)
    return abs(m) + t * sd / math.sqrt(n)


def key(plan: Plan) -> str:
    return f"logloss_rel_change_k{plan.k}_{plan.bits}bit"


def summarize(
    opts: Options,
    results: Results,
    planned: int,
    auto: int,
    diag_bits: int,
    mix: tuple[int, int],
    figures: dict[str, Any],
) -> list[str]:
    ref = results.reference
    figures["quality_seeds"] = len(ref)
    figures["logloss_reference"] = median(ref)
    figures["logloss_seed_spread_rel"] = (max(ref) - min(ref)) / statistics.fmean(ref)
    figures["logloss_seed_sd_rel"] = statistics.stdev(ref) / statistics.fmean(ref) if len(ref) > 1 else 0.0
    lines = [
        f"     reference log loss over {len(ref)} seeds: median {median(ref):.5f}, "
        f"spread {figures['logloss_seed_spread_rel']:.3%} (sd {figures['logloss_seed_sd_rel']:.3%})",
        "     paired relative change, median over seeds [95% CI of the median]:",
        "     restores " + "".join(f"{f'{b} bit':>28}" for b in BITS),
    ]
    for k in opts.restores:
        cells = []
        for b in BITS:
            values = results.changes[Plan(k, b)]
            lo, hi = median_ci(values)
            figures[key(Plan(k, b))] = median(values)
            figures[key(Plan(k, b)) + "_ci_high"] = upper_bound(values)
            cells.append(f"{median(values):+.4%} [{lo:+.3%}, {hi:+.3%}]")
        lines.append(f"     {k:8d} " + "".join(f"{c:>28}" for c in cells))
    # What the measurement supports: per k, the fewest bits whose bound is under the target.
    needed = {}
    for k in opts.restores:
        ok = [b for b in BITS if figures[key(Plan(k, b)) + "_ci_high"] < TARGET]
        needed[k] = min(ok) if ok else None
        if ok:
            figures[f"bits_needed_k{k}"] = min(ok)
    lines.append(
        "     fewest bits under the target (95% bound < 0.01%) per k: "
        + ", ".join(f"k={k}: {b or 'none'}" for k, b in needed.items())
    )
    cell = Plan(planned, auto)
    values = results.changes[cell]
    figures["auto_bits"] = auto
    figures["auto_planned_restores"] = planned
    figures["logloss_rel_change_auto"] = median(values)
    figures["logloss_rel_change_auto_ci_high"] = upper_bound(values)
    figures["logloss_rel_change_auto_t_high"] = t_bound(values)
    lines.append(
        f"     auto ({planned} planned restores -> {auto} bits): median {median(values):+.4%}, "
        f"95% bound of |change| {upper_bound(values):.4%} (t-interval {t_bound(values):.4%}); "
        f"per seed {', '.join(f'{v:+.4%}' for v in values)}"
    )
    # The failure mix at the bits auto picks for it, beside the all-storage worst case at those
    # bits (no escalation: the sidecar would move to 8 bits past the planned storage restores).
    planned_storage, mix_bits = mix
    worst = results.changes[Plan(FAILURES, mix_bits)]
    figures["auto_mix_bits"] = mix_bits
    figures["auto_mix_planned_storage_restores"] = planned_storage
    for name, n in FAILURE_MIX:
        figures[f"failure_mix_{name}"] = n
    figures["restore_class_exact_fraction"] = statistics.fmean(results.mix_exact)
    figures["logloss_rel_change_auto_mix"] = median(results.mix)
    figures["logloss_rel_change_auto_mix_ci_high"] = upper_bound(results.mix)
    figures["logloss_rel_change_auto_mix_worst"] = median(worst)
    figures["logloss_rel_change_auto_mix_worst_ci_high"] = upper_bound(worst)
    lines.append(
        f"     failure mix ({FAILURES} failures: "
        + ", ".join(f"{n} {name}" for name, n in FAILURE_MIX)
        + f"; {figures['restore_class_exact_fraction']:.0%} of restores exact; auto: "
        f"{planned_storage} planned storage restore(s) -> {mix_bits} bits): "
        f"median {median(results.mix):+.4%}, "
        f"95% bound of |change| {upper_bound(results.mix):.4%}; per seed "
        + ", ".join(f"{v:+.4%}" for v in results.mix)
    )
    lines.append(
        f"     worst case, all {FAILURES} restores from storage at {mix_bits} bits: median "
        f"{median(worst):+.4%}, 95% bound of |change| {upper_bound(worst):.4%}"
    )
    # Diagnostics, at the paper's bits for the plan (where there is an effect to take apart),
    # each beside the same seeds' plain cell.
    diag = {
        "all_rows": Plan(planned, diag_bits),
        "touched_only": Plan(planned, diag_bits, mode="touched"),
        "diffs": Plan(planned, diag_bits, mode="delta"),
        "old_schedule": Plan(planned, diag_bits, schedule="end"),
        "values_2bit": Plan(planned, 2),
        "diffs_2bit": Plan(planned, 2, mode="delta"),
    }
    if all(p in results.changes for p in diag.values()):
        figures["logloss_diag_bits"] = diag_bits
        lines.append(
            f"     diagnostics at the paper's {diag_bits} bits for {planned} restores, first "
            f"{opts.diagnostic_seeds} seeds (median, 95% bound of |change|):"
        )
        for name, plan in diag.items():
            v = results.changes[plan][: opts.diagnostic_seeds]
            figures[f"logloss_diag_{name}"] = median(v)
            figures[f"logloss_diag_{name}_ci_high"] = upper_bound(v)
            lines.append(f"     {plan.label:<34} {median(v):+.4%}, {upper_bound(v):.4%}")
    if results.touched_identical:
        figures["logloss_touched_equals_all"] = float(all(results.touched_identical))
        lines.append(
            f"     touched-only == all rows, bit for bit: {sum(results.touched_identical)}"
            f"/{len(results.touched_identical)} seeds"
        )
    for name, v in sorted(results.buckets.items()):
        figures[f"logloss_diag_bucket_{name}"] = median(v)
    if results.buckets:
        world = World(opts.rows)
        shares = ", ".join(f"{b} {world.traffic(lo, hi):.0%}" for b, lo, hi in BUCKETS)
        for suffix, bits in (("", diag_bits), ("_2bit", 2)):
            parts = [
                f"{b} {median(results.buckets[b + suffix]):+.4%}"
                for b in (*(n for n, _, _ in BUCKETS), "dense")
                if b + suffix in results.buckets
            ]
            lines.append(
                f"     {planned} x {bits} bit, change carried by (lookups: {shares}): " + ", ".join(parts)
            )
    return lines


def plot(opts: Options, results: Results, planned: int, auto: int, path: Path) -> None:
    """Median paired relative change (%) vs restores, one line per bit width, CI as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    ks = list(opts.restores)
    for b in BITS:
        med = [100 * median(results.changes[Plan(k, b)]) for k in ks]
        ci = [median_ci(results.changes[Plan(k, b)]) for k in ks]
        err = [
            [m - 100 * lo for m, (lo, _) in zip(med, ci, strict=True)],
            [100 * hi - m for m, (_, hi) in zip(med, ci, strict=True)],
        ]
        ax.errorbar(ks, med, yerr=err, marker="o", capsize=3, label=f"{b} bit")
    ax.plot(
        [planned],
        [100 * median(results.changes[Plan(planned, auto)])],
        marker="*",
        markersize=14,
        color="black",
        linestyle="none",
        label=f"auto ({auto} bit at {planned})",
    )
    for y in (100 * TARGET, -100 * TARGET):
        ax.axhline(y, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.set_yscale("symlog", linthresh=100 * TARGET / 10)
    ax.set_xlabel("restores from a quantized checkpoint (spread over training)")
    ax.set_ylabel("held-out log loss change vs same seed uninterrupted (%)")
    ax.set_title(
        f"Check-N-Run quality: {TABLES} x {opts.rows:,} rows x {DIM}, {opts.steps} steps x {BATCH}, "
        f"{len(results.reference)} seeds\n(median, 95% CI of the median; dashed: ±0.01%)",
        fontsize=9,
    )
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    torch.set_num_threads(max(1, opts.loop_threads))
    planned, auto, table = auto_plan()
    if planned not in opts.restores:  # --quick: the largest k measured stands for the plan
        planned = max(opts.restores)
        auto = qz.bits_for_restores(planned, table)
    print(
        f"     --quantize auto: --expected-restores {planned} -> {auto} bits "
        f"(table {', '.join(f'{n}: {b}' for n, b in table)}; 8 beyond)",
        flush=True,
    )
    with phases("world and held-out set"):
        world = World(opts.rows)
        ids, labels, logits = world.sample(np.random.default_rng(HELD_OUT_SEED), opts.held_out)
        held = (torch.from_numpy(ids), torch.from_numpy(labels))
        figures["logloss_teacher"] = bce(logits, labels)
        rate = float(labels.mean())
        figures["logloss_constant"] = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
        print(
            f"     held-out {opts.held_out:,} clicks: click rate {rate:.3f}, teacher's log loss "
            f"{figures['logloss_teacher']:.5f}, constant predictor's {figures['logloss_constant']:.5f}",
            flush=True,
        )
    planned_storage, mix_bits = auto_mix_plan()
    storage = dict(FAILURE_MIX).get("storage", 0)
    print(
        f"     failure mix: {FAILURES} failures, "
        + ", ".join(f"{n} {name}" for name, n in FAILURE_MIX)
        + f"; --restore-class auto, --expected-storage-restores {planned_storage} -> {mix_bits} bits"
        + (
            " (the mix's storage restores exceed the plan: the sidecar would escalate)"
            if storage > planned_storage
            else ""
        ),
        flush=True,
    )
    diag_bits = qz.bits_for_restores(planned, PAPER_TABLE)
    curve, diagnostics = plans(opts, planned, diag_bits)
    if Plan(FAILURES, mix_bits) not in curve:  # the mix's worst case (--quick measures k <= 3)
        curve.append(Plan(FAILURES, mix_bits))
    todo = [*curve, *(p for p in diagnostics if p not in curve)]
    results = Results()
    runs = f"{len(curve) + 2} runs, {len(todo) + 2} for the first {opts.diagnostic_seeds}"
    with phases(f"training runs ({opts.seeds} seeds x {runs})"):
        for seed in range(opts.seeds):
            diagnose = seed < opts.diagnostic_seeds
            of_seed = todo if diagnose else curve
            cells = Plan(planned, auto), Plan(planned, diag_bits)
            measure_seed(opts, seed, world, held, of_seed, *cells, mix_bits, results, figures, diagnose)
    for line in summarize(opts, results, planned, auto, diag_bits, (planned_storage, mix_bits), figures):
        print(line, flush=True)
    with phases("plot"):
        # --quick draws the plot too, into its scratch folder: the README's stays the full run's
        path = opts.tmp / PLOT.name if opts.quick else PLOT
        plot(opts, results, planned, auto, path)
        print(f"     plot: {path}", flush=True)
    return _rows(figures)


def _rows(f: dict[str, Any]) -> list[Row]:
    def get(key: str) -> float | None:
        v = f.get(key)
        return float(v) if isinstance(v, int | float) and math.isfinite(v) else None

    def pct(key: str, target: str = "", passed: bool | None = None) -> Row:
        v = get(key)
        return Row(key, None if v is None else 100 * v, "%", None, "", target, passed)

    bound = get("logloss_rel_change_auto_ci_high")
    mix_bound = get("logloss_rel_change_auto_mix_ci_high")
    restores = sorted(
        {
            int(k.split("_k")[1].split("_")[0])
            for k in f
            if k.startswith("logloss_rel_change_k") and "bit" in k
        }
    )
    return [
        Row("auto_bits", get("auto_bits"), "bits"),
        Row("auto_planned_restores", get("auto_planned_restores"), "restores"),
        pct("logloss_rel_change_auto"),
        pct("logloss_rel_change_auto_ci_high", "< 0.01%", None if bound is None else bound < TARGET),
        pct("logloss_rel_change_auto_t_high"),
        Row("auto_mix_bits", get("auto_mix_bits"), "bits"),
        Row("auto_mix_planned_storage_restores", get("auto_mix_planned_storage_restores"), "restores"),
        Row("restore_class_exact_fraction", get("restore_class_exact_fraction"), ""),
        pct("logloss_rel_change_auto_mix"),
        pct(
            "logloss_rel_change_auto_mix_ci_high",
            "<= 0.01%",
            None if mix_bound is None else mix_bound <= TARGET,
        ),
        pct("logloss_rel_change_auto_mix_worst"),
        pct("logloss_rel_change_auto_mix_worst_ci_high"),
        *(pct(f"logloss_rel_change_k{k}_{b}bit") for k in restores for b in BITS),
        pct("logloss_seed_spread_rel"),
        pct("logloss_seed_sd_rel"),
        Row("logloss_reference", get("logloss_reference"), ""),
        Row("logloss_teacher", get("logloss_teacher"), ""),
        Row("logloss_constant", get("logloss_constant"), ""),
        pct("logloss_last_quarter_rel_gain"),
        Row("logloss_diag_bits", get("logloss_diag_bits"), "bits"),
        pct("logloss_diag_all_rows"),
        pct("logloss_diag_touched_only"),
        Row("logloss_touched_equals_all", get("logloss_touched_equals_all"), ""),
        pct("logloss_diag_diffs"),
        pct("logloss_diag_old_schedule"),
        pct("logloss_diag_values_2bit"),
        pct("logloss_diag_diffs_2bit"),
        *(pct(f"logloss_diag_bucket_{b}") for b in ("head", "torso", "tail", "dense")),
    ]
