"""Bench section ``activation``: selective activation checkpointing on the memory/recompute frontier.

Deterministic counts, so one run suffices. For one training step (forward, ``sum()`` loss,
backward) of each model, on fake CPU tensors (``FakeTensorMode``: real shapes and CPU kernels'
choices, no data, no time):

- activation bytes: the unique storages made by the forward that are still alive when it
  returns (loss excepted), parameters never counted. Saved-tensor hooks cannot see selective
  checkpointing's cache, so liveness is the count; on the unwrapped model it equals the bytes an
  outer ``saved_tensors_hooks`` sees (checked by tests/unit/test_activation.py).
- FLOPs, forward + backward including recompute: ``torch.utils.flop_counter.FlopCounterMode``
  with the CPU fused attention's formulas added (``trainer_client.activation.FLOP_FORMULAS``;
  PyTorch counts 0 for it). Extra FLOPs = a policy's step FLOPs - the unwrapped step's.

Models: a GPT-style stack (4 pre-LN blocks, d=1024, 16 heads, GELU MLP 4d, batch 1) at seq 2048
and seq 512, as LLMs train it: no dropout, so CPU attention runs the fused kernel
(``_scaled_dot_product_flash_attention_for_cpu``), which keeps only its output and logsumexp, not
the seq x seq scores (the gradient checks use dropout), and a DLRM-style model (8 tables x 64
dims, bottom MLP 13-512-256-64, pairwise dot interaction, top MLP 100-512-256-1, batch 4096;
blocks: bottom and top). Columns: no checkpointing, full checkpointing, the save-matmuls policy,
torch.compile's partitioner at ``activation_memory_budget`` (AOTAutograd's min-cut + knapsack,
as ``torch.compile`` runs it, its graphs run eagerly on the same fake tensors: Inductor's codegen
is the only part left out, and it does not change which tensors are saved), and Strata's budgeted
policy at four budgets and at two caps on recompute (``max_recompute``).

The frontier itself, for the GPT stacks: every choice eager selective checkpointing has in a
block (keep or recompute each FLOP op the recomputation reruns: 2^4 on this block), each run and
counted, and every way of giving the 4 blocks different choices (bytes and FLOPs add up block by
block; one mixed stack is run to check). ``sac_frontier_min_bytes_ratio_at_recompute_target`` is
the fewest bytes / none within 3% extra FLOPs, ``sac_frontier_min_extra_flops_ratio_at_bytes_target``
the fewest extra FLOPs within 0.5 of the bytes: both over all of them, so a value past its target
says no policy of this kind reaches it on this block.

Keys (GPT seq 2048): ``sac_activation_bytes_ratio`` (Strata at its default budget / no
checkpointing, <= 0.5), ``sac_recompute_flops_ratio`` (its extra FLOPs / the step's, <= 0.03),
``sac_vs_compile_budget_flops_ratio`` (its extra FLOPs / torch.compile's cheapest point at no
more bytes, over a sweep of budgets, <= 1.0), ``sac_grad_max_abs_diff`` (float32, a small real
GPT stack with dropout: the largest gradient difference to the unwrapped model). Wall-clock step
times of a small real stack are information only. The frontier plot goes to
``docs/guides/img/activation-frontier.png``.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import math
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.bench.common import REPO_ROOT, Options, Phases, Row, median
from trainer_client.activation import DEFAULT_BUDGET, FLOP_FORMULAS, Checkpointed, checkpoint_blocks

__all__ = ["Options", "run"]

BUDGETS = (0.4, DEFAULT_BUDGET, 0.6, 0.65)
MAX_RECOMPUTE = (0.02, 0.03)
COMPILE_BUDGETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0)
QUICK_COMPILE_BUDGETS = (0.3, 0.5, 1.0)
PLOT = REPO_ROOT / "docs" / "guides" / "img" / "activation-frontier.png"
TARGETS = {
    "sac_activation_bytes_ratio": 0.5,
    "sac_recompute_flops_ratio": 0.03,
    "sac_vs_compile_budget_flops_ratio": 1.0,
}


# --- models ---------------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-LN GPT block: causal attention (``scaled_dot_product_attention``) and a GELU MLP."""

    def __init__(self, d: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        p = self.dropout if self.training else 0.0
        q, k, v = (
            z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for z in self.qkv(self.ln1(x)).split(d, 2)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, t, d)), p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), p, self.training)


def gpt(layers: int = 4, d: int = 1024, heads: int = 16, dropout: float = 0.0) -> nn.Sequential:
    return nn.Sequential(*(Block(d, heads, dropout) for _ in range(layers)))


def mlp(*dims: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        layers.append(nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Top(nn.Module):
    """DLRM's pairwise dot interaction and top MLP."""

    def __init__(self, features: int, dim: int, *hidden: int) -> None:
        super().__init__()
        self.pairs = features * (features - 1) // 2
        self.mlp = mlp(dim + self.pairs, *hidden)
        # built here, not in forward: a factory call there would make a real tensor under fake ones
        self.register_buffer("pair_index", torch.tril_indices(features, features, -1), persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        f = torch.cat([dense.unsqueeze(1), sparse], 1)
        z = torch.bmm(f, f.transpose(1, 2))
        i, j = self.pair_index
        return self.mlp(torch.cat([dense, z[:, i, j]], 1))


class DLRM(nn.Module):
    """A DLRM-style model: embedding bags, a bottom MLP on dense features, interaction, top MLP."""

    def __init__(self, tables: int = 8, rows: int = 1000, dim: int = 64, dense: int = 13) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
        self.bottom = mlp(dense, 512, 256, dim)
        self.top = Top(tables + 1, dim, 512, 256, 1)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        sparse = torch.stack([e(ids[i], offsets) for i, e in enumerate(self.embeddings)], 1)
        return self.top(self.bottom(dense), sparse)


def dlrm_inputs(batch: int, tables: int = 8, rows: int = 1000, bag: int = 4) -> tuple[torch.Tensor, ...]:
    """Dense features, ids per table (bags of ``bag`` ids, flattened) and the bags' offsets."""
    return torch.randn(batch, 13), torch.randint(0, rows, (tables, batch * bag)), torch.arange(batch) * bag


def dlrm_blocks(name: str, _m: nn.Module) -> bool:
    return name in ("bottom", "top")


# --- counting -------------------------------------------------------------------------------


class _Live(TorchDispatchMode):
    """Weak references to every storage an op makes: after the forward, the live ones are what
    the step holds for its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[torch.UntypedStorage]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t.untyped_storage()))
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        gc.collect()
        live = {}
        for r in self.refs:
            s = r()
            if s is not None and s._cdata not in exclude:
                live[s._cdata] = s.nbytes()
        return sum(live.values())


def _keys(tensors: Any) -> set[int]:
    return {int(t.untyped_storage()._cdata) for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor)}


def count_step(
    step: Callable[[], torch.Tensor],
    model: nn.Module,
    inputs: tuple[Any, ...],
    after_warmup: Callable[[], None] | None = None,
) -> tuple[int, int]:
    """(activation bytes, FLOPs fwd + bwd incl. recompute) of one step, after one warm-up step
    (traces and compiles happen there; ``after_warmup`` runs next)."""
    from torch.utils.flop_counter import FlopCounterMode

    step().backward()
    if after_warmup is not None:
        after_warmup()
    model.zero_grad(set_to_none=True)
    exclude = _keys(list(model.parameters())) | _keys(list(model.buffers())) | _keys(inputs)
    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as flops:
        with _Live() as live:
            loss = step()
        held = live.alive_bytes(exclude | _keys(loss))
        loss.backward()
    model.zero_grad(set_to_none=True)
    return held, int(flops.get_total_flops())


def eager_step(model: nn.Module, inputs: tuple[Any, ...]) -> Callable[[], torch.Tensor]:
    return lambda: model(*inputs).sum()


def compiled_step(model: nn.Module, inputs: tuple[Any, ...], budget: float) -> Callable[[], torch.Tensor]:
    """The step through AOTAutograd's min-cut partitioner at ``activation_memory_budget``."""
    import torch._functorch.config as functorch_config
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    state = [*model.named_parameters(), *model.named_buffers()]
    names = [n for n, _ in state]
    params = [p for _, p in state]

    def fn(*flat: torch.Tensor) -> torch.Tensor:
        state = dict(zip(names, flat[: len(names)], strict=True))
        return torch.func.functional_call(model, state, tuple(flat[len(names) :])).sum()

    def compiler(gm: torch.fx.GraphModule, _example: Any) -> Any:
        return make_boxed_func(gm.forward)

    compiled = aot_function(
        fn, fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition
    )

    def step() -> torch.Tensor:
        with functorch_config.patch(activation_memory_budget=budget):
            return compiled(*params, *inputs)

    return step


def _register_cpu_attention_flops() -> None:
    """Let the partitioner's FLOP-based runtime estimate see CPU attention too (a fair anchor)."""
    from torch.utils import flop_counter

    for op, formula in FLOP_FORMULAS.items():
        if op not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(op)(formula)


# --- the section ----------------------------------------------------------------------------


def _configs(
    quick: bool,
) -> list[tuple[str, Callable[[], nn.Module], Callable[[], tuple[Any, ...]], Any, Any]]:
    """(name, model factory, inputs factory, blocks selector, block class for the wrapper)."""
    out: list[tuple[str, Callable[[], nn.Module], Callable[[], tuple[Any, ...]], Any, Any]] = []
    for seq in (2048, 512):
        out.append(
            (f"gpt{seq}", gpt, lambda s=seq: (torch.randn(1, s, 1024, requires_grad=True),), Block, None)
        )
    out.append(("dlrm", DLRM, lambda: dlrm_inputs(4096), dlrm_blocks, None))
    return out


def _on_fake(
    make_model: Callable[[], nn.Module], make_inputs: Callable[[], tuple[Any, ...]]
) -> tuple[Callable[[], nn.Module], tuple[Any, ...]]:
    """A factory of fresh models and the inputs, both on one set of fake CPU tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode()
    with fake:
        inputs = make_inputs()

    def fresh() -> nn.Module:
        with fake:
            return make_model()

    return fresh, inputs


def _measure(
    name: str,
    make_model: Callable[[], nn.Module],
    make_inputs: Callable[[], tuple[Any, ...]],
    blocks: Any,
    compile_budgets: tuple[float, ...],
    phases: Phases,
) -> dict[str, tuple[int, int]]:
    """Column -> (bytes, step FLOPs) on fake CPU tensors."""
    fresh, inputs = _on_fake(make_model, make_inputs)
    points: dict[str, tuple[int, int]] = {}
    columns: list[tuple[str, str, Any]] = [
        ("none", "", None),
        ("full", "recompute_all", None),
        ("matmuls", "save_matmuls", None),
        *((f"strata_{b:g}", "budget", b) for b in BUDGETS),
    ]
    with phases(f"{name}: eager policies"):
        for column, policy, budget in columns:
            model = fresh()
            if policy:
                checkpoint_blocks(model, blocks, policy, budget)  # type: ignore[arg-type]
            points[column] = count_step(eager_step(model, inputs), model, inputs)
        for cap in MAX_RECOMPUTE:
            model = fresh()
            checkpoint_blocks(model, blocks, max_recompute=cap)
            points[f"strata_max_recompute_{cap:g}"] = count_step(eager_step(model, inputs), model, inputs)
    with phases(f"{name}: torch.compile budgets"):
        for b in compile_budgets:
            model = fresh()
            points[f"compile_{b:g}"] = count_step(compiled_step(model, inputs, b), model, inputs)
    return points


def _force(handle: Checkpointed, keep: frozenset[tuple[Any, int]]) -> Callable[[], None]:
    """After the warm-up step traced the blocks: make every plan of ``handle`` keep ``keep``."""

    def force() -> None:
        for key, plan in handle.plans.items():
            assert keep <= set(plan.choices), "the forced choice is not one of this plan's"
            handle.plans[key] = dataclasses.replace(plan, save=keep)  # its other fields go stale

    return force


def _keep_sets(
    make_model: Callable[[], nn.Module], inputs: tuple[Any, ...], blocks: Any
) -> tuple[list[tuple[frozenset[tuple[Any, int]], tuple[int, int]]], int]:
    """Every choice of a block's FLOP ops to keep, all blocks alike, counted: [(keep, (bytes,
    FLOPs))], and the number of blocks."""
    model = make_model()
    handle = checkpoint_blocks(model, blocks, "budget", 1.0)
    eager_step(model, inputs)().backward()
    (plan,) = handle.plans.values()  # one block shape
    out = []
    for r in range(len(plan.choices) + 1):
        for keep in itertools.combinations(plan.choices, r):
            model = make_model()
            handle = checkpoint_blocks(model, blocks, "budget", 1.0)
            point = count_step(eager_step(model, inputs), model, inputs, _force(handle, frozenset(keep)))
            out.append((frozenset(keep), point))
    return out, len(handle.blocks)


def _mixes(points: list[tuple[int, int]], blocks: int) -> list[tuple[tuple[int, ...], float, float]]:
    """Every assignment of the uniform points' choices to ``blocks`` blocks, up to order:
    (indices, bytes, FLOPs), each the mean of its blocks' uniform points (what adds up block by
    block: a block's kept outputs and its recomputation)."""
    out = []
    for combo in itertools.combinations_with_replacement(range(len(points)), blocks):
        out.append(
            (
                combo,
                sum(points[i][0] for i in combo) / blocks,
                sum(points[i][1] for i in combo) / blocks,
            )
        )
    return out


def _frontier(
    name: str,
    make_model: Callable[[], nn.Module],
    inputs: tuple[Any, ...],
    blocks: Any,
    base: tuple[int, int],
    figures: dict[str, Any],
) -> list[tuple[float, float]]:
    """The exhaustive frontier of one GPT config: figures for its targets, and every uniform
    choice's (extra FLOPs ratio, bytes ratio) for the plot."""
    sets, n = _keep_sets(make_model, inputs, blocks)
    points = [p for _, p in sets]
    mixes = _mixes(points, n)
    base_bytes, base_flops = base
    eps = 1e-9  # the mixes are means of integers: compare without float noise

    def extra(m: tuple[Any, float, float]) -> float:
        return (m[2] - base_flops) / base_flops

    def held(m: tuple[Any, float, float]) -> float:
        return m[1] / base_bytes

    cheap = [m for m in mixes if extra(m) <= TARGETS["sac_recompute_flops_ratio"] + eps]
    small = [m for m in mixes if held(m) <= TARGETS["sac_activation_bytes_ratio"] + eps]
    best_bytes = min(cheap, key=held)
    figures[f"sac_{name}_frontier_keep_sets"] = len(sets)
    figures[f"sac_{name}_frontier_mixes"] = len(mixes)
    figures[f"sac_{name}_frontier_min_bytes_ratio_at_recompute_target"] = held(best_bytes)
    figures[f"sac_{name}_frontier_min_extra_flops_ratio_at_bytes_target"] = min(map(extra, small))
    # check the adding up: run the best mix for real, each group of blocks with its own choice
    names = [f"{i}" for i in range(n)]
    model = make_model()
    forces = []
    for choice in sorted(set(best_bytes[0])):
        mine = {names[j] for j, c in enumerate(best_bytes[0]) if c == choice}
        handle = checkpoint_blocks(model, lambda q, _m, mine=mine: q in mine, "budget", 1.0)
        forces.append(_force(handle, sets[choice][0]))

    def force_all() -> None:
        for force in forces:
            force()

    measured = count_step(eager_step(model, inputs), model, inputs, force_all)
    figures[f"sac_{name}_frontier_mix_check_error"] = max(
        abs(measured[0] - best_bytes[1]) / base_bytes, abs(measured[1] - best_bytes[2]) / base_flops
    )
    return [((f - base_flops) / base_flops, b / base_bytes) for b, f in points]


def _fake_frontier(
    name: str,
    make_model: Callable[[], nn.Module],
    make_inputs: Callable[[], tuple[Any, ...]],
    blocks: Any,
    base: tuple[int, int],
    figures: dict[str, Any],
) -> list[tuple[float, float]]:
    fresh, inputs = _on_fake(make_model, make_inputs)
    return _frontier(name, fresh, inputs, blocks, base, figures)


def _grad_diff() -> float:
    """Largest |grad| difference, float32, Strata's default budget vs unwrapped, on a small real
    GPT stack with dropout (attention and residual), plus the DLRM-style model."""
    worst = 0.0
    torch.manual_seed(0)
    cases: list[tuple[nn.Module, tuple[Any, ...], Any]] = [
        (gpt(2, 64, 4, dropout=0.1), (torch.randn(2, 32, 64, requires_grad=True),), Block),
        (DLRM(rows=100), dlrm_inputs(64, rows=100), dlrm_blocks),
    ]
    for model, inputs, blocks in cases:
        wrapped = copy.deepcopy(model)
        checkpoint_blocks(wrapped, blocks)
        grads = []
        for m in (model, wrapped):
            torch.manual_seed(1)
            for t in inputs:
                t.grad = None
            m(*inputs).square().sum().backward()
            grads.append([p.grad for p in m.parameters()] + [t.grad for t in inputs if t.requires_grad])
        for a, b in zip(*grads, strict=True):
            worst = max(worst, float((a - b).abs().max()))
    return worst


def _wall(quick: bool) -> dict[str, float]:
    """Median step time of a small real GPT stack per policy (information only)."""
    torch.manual_seed(0)
    template = gpt(4, 256, 4)
    x = torch.randn(2, 256 if quick else 512, 256, requires_grad=True)
    out = {}
    for column, policy in (
        ("none", ""),
        ("full", "recompute_all"),
        ("matmuls", "save_matmuls"),
        ("strata", "budget"),
    ):
        model = copy.deepcopy(template)
        if policy:
            checkpoint_blocks(model, Block, policy)  # type: ignore[arg-type]
        times = []
        for _ in range(4 if quick else 6):
            t0 = time.perf_counter()
            model(x).sum().backward()
            times.append(time.perf_counter() - t0)
        out[column] = median(times[1:])
    return out


def _compile_at(points: dict[str, tuple[int, int]], held: int) -> tuple[int, int] | None:
    """torch.compile's cheapest point holding no more than ``held`` bytes."""
    fits = [p for k, p in points.items() if k.startswith("compile_") and p[0] <= held]
    return min(fits, key=lambda p: p[1]) if fits else None


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    torch.set_num_threads(max(1, opts.loop_threads))
    _register_cpu_attention_flops()
    budgets = QUICK_COMPILE_BUDGETS if opts.quick else COMPILE_BUDGETS
    all_points = {}
    every: dict[str, list[tuple[float, float]]] = {}
    for name, make_model, make_inputs, blocks, _ in _configs(opts.quick):
        points = _measure(name, make_model, make_inputs, blocks, budgets, phases)
        all_points[name] = points
        if name.startswith("gpt"):
            with phases(f"{name}: every keep choice"):
                every[name] = _fake_frontier(name, make_model, make_inputs, blocks, points["none"], figures)
        base_bytes, base_flops = points["none"]
        for column, (held, flops) in points.items():
            figures[f"sac_{name}_{column}_bytes"] = held
            figures[f"sac_{name}_{column}_flops"] = flops
            figures[f"sac_{name}_{column}_bytes_ratio"] = held / base_bytes
            figures[f"sac_{name}_{column}_extra_flops_ratio"] = (flops - base_flops) / base_flops
        strata = points[f"strata_{DEFAULT_BUDGET:g}"]
        anchor = _compile_at(points, strata[0])
        if anchor is not None:
            figures[f"sac_{name}_compile_at_strata_bytes_extra_flops"] = anchor[1] - base_flops
            extra = strata[1] - base_flops
            compile_extra = anchor[1] - base_flops
            figures[f"sac_{name}_vs_compile_budget_flops_ratio"] = (
                extra / compile_extra if compile_extra > 0 else (1.0 if extra == 0 else math.inf)
            )
    g = "sac_gpt2048"
    figures["sac_activation_bytes_ratio"] = figures[f"{g}_strata_{DEFAULT_BUDGET:g}_bytes_ratio"]
    figures["sac_recompute_flops_ratio"] = figures[f"{g}_strata_{DEFAULT_BUDGET:g}_extra_flops_ratio"]
    for key in (
        "min_bytes_ratio_at_recompute_target",
        "min_extra_flops_ratio_at_bytes_target",
        "mix_check_error",
    ):
        figures[f"sac_frontier_{key}"] = figures[f"{g}_frontier_{key}"]
    if f"{g}_vs_compile_budget_flops_ratio" in figures:
        figures["sac_vs_compile_budget_flops_ratio"] = figures[f"{g}_vs_compile_budget_flops_ratio"]
    with phases("float32 gradients"):
        figures["sac_grad_max_abs_diff"] = _grad_diff()
    with phases("wall-clock steps (small real stack)"):
        for column, seconds in _wall(opts.quick).items():
            figures[f"sac_small_gpt_step_{column}_s"] = seconds
    with phases("frontier plot"):
        _plot(all_points, every, opts.tmp / PLOT.name if opts.quick else PLOT)  # --quick keeps the docs' plot
    _print_frontier(all_points)
    return _rows(figures)


def _print_frontier(all_points: dict[str, dict[str, tuple[int, int]]]) -> None:
    for name, points in all_points.items():
        base_bytes, base_flops = points["none"]
        print(f"\n  {name}: column, activation MiB, bytes / none, extra FLOPs / step")
        for column, (held, flops) in points.items():
            extra = (flops - base_flops) / base_flops
            print(f"    {column:14s} {held / 2**20:10.1f} {held / base_bytes:8.3f} {extra:8.4f}")


def _plot(
    all_points: dict[str, dict[str, tuple[int, int]]], every: dict[str, list[tuple[float, float]]], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, axes = plt.subplots(1, len(all_points), figsize=(5 * len(all_points), 4.2))
    for ax, (name, points) in zip(axes, all_points.items(), strict=True):

        def xy(cols: list[str], pts: dict[str, tuple[int, int]] = points) -> tuple[list[float], list[float]]:
            base_bytes, base_flops = pts["none"]
            return (
                [(pts[c][1] - base_flops) / base_flops * 100 for c in cols],
                [pts[c][0] / base_bytes for c in cols],
            )

        comp = sorted((c for c in points if c.startswith("compile_")), key=lambda c: float(c.split("_")[1]))
        strata = [c for c in points if c.startswith("strata_") and not c.startswith("strata_max")]
        capped = [c for c in points if c.startswith("strata_max_recompute_")]
        if name in every:
            ax.plot(
                [x * 100 for x, _ in every[name]],
                [y for _, y in every[name]],
                "x",
                color="tab:orange",
                alpha=0.6,
                label="every keep choice (eager)",
            )
        ax.plot(*xy(comp), "s--", color="tab:gray", label="torch.compile memory budget")
        ax.plot(*xy(strata), "o-", color="tab:blue", label="Strata budgeted")
        for c, x, y in zip(strata, *xy(strata), strict=True):
            ax.annotate(c.split("_")[1], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
        ax.plot(*xy(capped), "P", color="tab:purple", label="Strata max_recompute 2%, 3%")
        if name == "gpt2048":  # the keys' targets: no point of any policy lies in the box
            ax.add_patch(
                Rectangle(
                    (0, 0),
                    TARGETS["sac_recompute_flops_ratio"] * 100,
                    TARGETS["sac_activation_bytes_ratio"],
                    color="tab:green",
                    alpha=0.12,
                    label="target (<= 0.5 bytes, <= 3% FLOPs)",
                )
            )
        for c, marker, label in (
            ("none", "k^", "no checkpointing"),
            ("full", "rv", "full checkpointing"),
            ("matmuls", "gD", "save matmuls"),
        ):
            ax.plot(*xy([c]), marker, label=label)
        ax.set_title(name)
        ax.set_xlabel("extra FLOPs, % of the step")
        ax.set_ylabel("activation bytes / no checkpointing")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rows(f: dict[str, Any]) -> list[Row]:
    rows = []
    for key, target in TARGETS.items():
        value = f.get(key)
        rows.append(Row(key, value, "", None, "", f"<= {target}", None if value is None else value <= target))
    if "sac_vs_compile_budget_flops_ratio" not in f and "sac_activation_bytes_ratio" in f:
        rows[-1].unit = "torch.compile has no point at Strata's bytes"
    for key, target_key in (
        ("sac_frontier_min_bytes_ratio_at_recompute_target", "sac_activation_bytes_ratio"),
        ("sac_frontier_min_extra_flops_ratio_at_bytes_target", "sac_recompute_flops_ratio"),
    ):
        if key in f:
            rows.append(Row(key, f[key], "any keep choice", None, "", f"info (vs {TARGETS[target_key]})"))
    diff = f.get("sac_grad_max_abs_diff")
    rows.append(
        Row(
            "sac_grad_max_abs_diff",
            diff,
            "float32",
            None,
            "",
            "<= 1e-6",
            None if diff is None else diff <= 1e-6,
        )
    )
    for name in ("gpt2048", "gpt512", "dlrm"):
        for column in (
            "full",
            "matmuls",
            f"strata_{DEFAULT_BUDGET:g}",
            *(f"strata_{b:g}" for b in BUDGETS if b != DEFAULT_BUDGET),
            *(f"strata_max_recompute_{c:g}" for c in MAX_RECOMPUTE),
            "compile_0.5",
        ):
            b = f.get(f"sac_{name}_{column}_bytes_ratio")
            x = f.get(f"sac_{name}_{column}_extra_flops_ratio")
            if b is not None:
                rows.append(Row(f"sac_{name}_{column}_bytes_ratio", b, "x none"))
                rows.append(Row(f"sac_{name}_{column}_extra_flops_ratio", x, "x step"))
    for column in ("none", "full", "matmuls", "strata"):
        s = f.get(f"sac_small_gpt_step_{column}_s")
        base = f.get("sac_small_gpt_step_none_s")
        if s is not None:
            rows.append(
                Row(f"sac_small_gpt_step_{column}_s", s, "s", s / base if base else None, "none", "info")
            )
    return rows
