"""Selective activation checkpointing of a model's blocks, by policy.

Built on PyTorch's selective checkpoint API: each wrapped block runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` with a ``context_fn`` from
``create_selective_checkpoint_contexts`` and a policy function deciding, per aten op of the
block's forward, whether its output is kept (``MUST_SAVE``) or recomputed in the backward
(``PREFER_RECOMPUTE``). No autograd of its own: gradients are those of the unwrapped model, and
random ops (dropout) see the same random numbers in the recomputation, because checkpoint
replays the RNG state of the forward.

Policies:

- ``"recompute_all"``: keep nothing but the block's inputs; recompute the whole block.
- ``"save_matmuls"``: keep the outputs of the expensive ops (matmuls, convolutions, attention),
  recompute the rest (PyTorch's "save matmuls" selective policy).
- ``"budget"``: keep at most ``budget`` activation bytes per block (its inputs included),
  choosing per op, cheapest bytes per recomputed FLOP first, among the ops the recomputation
  reruns (those before the last tensor the forward saves for backward: it stops there). Or,
  given ``max_recompute`` instead, the fewest bytes whose recomputation adds at most that
  fraction of the block's training-step FLOPs. The choice comes from one traced forward per
  block shape (block class, parameter and input shapes, dtypes, training mode), cached: the
  first call of each shape runs the block once more, unwrapped, with the RNG state restored
  after it (and, for ``max_recompute``, its backward, to count the step's FLOPs).

Eager mode is the supported mode. Under ``torch.compile`` the checkpointed block is traced by
Dynamo and the policy's ``MUST_SAVE``/``PREFER_RECOMPUTE`` tags go to AOTAutograd's partitioner:
``"recompute_all"`` and ``"save_matmuls"`` behave as in eager, while ``"budget"`` (whose plan
indexes the eager op sequence, which compilation changes) falls back to ``"save_matmuls"``; for a
memory budget under compile, use ``torch._functorch.config.activation_memory_budget``.

A block cannot be wrapped (``ValueError``, one line naming the module and why) when it is a
TorchScript module, a ``torch.compile``'d module, already checkpointed or inside another selected
block, or holds a BatchNorm that tracks running statistics (the recomputation would update them
twice). Wrapping replaces the block's ``forward`` in place: parameter names and state dicts do
not change.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.utils import checkpoint as _ckpt
from torch.utils import flop_counter as _fc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

log = logging.getLogger(__name__)

Policy = Literal["recompute_all", "save_matmuls", "budget"]
POLICIES: tuple[str, ...] = get_args(Policy)
#: the default budget: this fraction of the block's activation bytes without checkpointing
DEFAULT_BUDGET = 0.5

_aten = torch.ops.aten
#: ops whose outputs "save_matmuls" keeps: matmuls, convolutions, attention
EXPENSIVE_OPS: frozenset[Any] = frozenset(
    {
        _aten.mm,
        _aten.addmm,
        _aten.bmm,
        _aten.baddbmm,
        _aten._scaled_mm,
        _aten.convolution,
        _aten._convolution,
        _aten._scaled_dot_product_flash_attention,
        _aten._scaled_dot_product_efficient_attention,
        _aten._scaled_dot_product_cudnn_attention,
        _aten._scaled_dot_product_flash_attention_for_cpu,
        _aten._flash_attention_forward,
        _aten._efficient_attention_forward,
    }
)

#: FLOP formulas that ``torch.utils.flop_counter`` lacks (the CPU fused attention), in the form
#: ``FlopCounterMode(custom_mapping=...)`` takes: without them attention on CPU counts 0 FLOPs.
FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    # the registered formulas come shape-wrapped; the mapping takes them raw
    _aten._scaled_dot_product_flash_attention_for_cpu: _fc.sdpa_flop.__wrapped__,  # type: ignore[attr-defined]
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _fc.sdpa_backward_flop.__wrapped__,  # type: ignore[attr-defined]
}
_FLOPS = {
    **_fc.flop_registry,
    **{k: _fc.shape_wrapper(v) for k, v in FLOP_FORMULAS.items() if k not in _fc.flop_registry},
}

_SAVE = _ckpt.CheckpointPolicy.MUST_SAVE
_RECOMPUTE = _ckpt.CheckpointPolicy.PREFER_RECOMPUTE


def op_flops(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs of one aten op call, as ``FlopCounterMode`` (with :data:`FLOP_FORMULAS`) counts them."""
    formula = _FLOPS.get(getattr(op, "overloadpacket", op))
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


@dataclass
class Saved:
    """What the policies kept: tensors cached by selective checkpointing, and their bytes."""

    tensors: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class Plan:
    """The budgeted policy's choice for one block shape."""

    #: (op, occurrence) pairs whose outputs are kept, occurrence counting calls of that op
    save: frozenset[tuple[Any, int]]
    #: output byte sizes by (op, occurrence), to check the recomputed forward is the traced one
    sizes: dict[tuple[Any, int], int]
    #: the choices: the FLOP ops the recomputation reruns unless kept, in forward order
    choices: tuple[tuple[Any, int], ...]
    #: activation bytes of the block without checkpointing (unique storages autograd saved)
    unwrapped_bytes: int
    #: bytes of the block's tensor inputs, which checkpointing holds anyway
    input_bytes: int
    #: bytes of the kept outputs
    saved_bytes: int
    #: FLOPs the recomputation runs: the ops not kept before the last tensor saved for backward
    recompute_flops: int
    #: FLOPs of the whole forward
    forward_flops: int
    #: FLOPs of the block's backward (traced for ``max_recompute`` only, else 0)
    backward_flops: int = 0


@dataclass
class _Op:
    key: tuple[Any, int]
    bytes: int
    flops: int


class _Recorder(TorchDispatchMode):
    """Records each op of a forward as selective checkpointing counts them: its new output bytes
    and FLOPs."""

    def __init__(self, seen: set[int]) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.seen = seen
        self.counts: dict[Any, int] = defaultdict(int)
        # outputs held until the trace ends: a freed storage's address could name a new one
        self.held: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _ckpt.SAC_IGNORED_OPS:
            return out
        idx = self.counts[func]
        self.counts[func] += 1
        new = 0
        for t in _tensors(out):
            self.held.append(t)
            k = _storage_key(t)
            if k not in self.seen:  # a view costs nothing of its own
                self.seen.add(k)
                new += t.untyped_storage().nbytes()
        self.ops.append(_Op((func, idx), new, op_flops(func, args, kwargs, out)))
        return out


def _trace(
    module: nn.Module,
    forward: Callable[..., Any],
    args: Any,
    kwargs: Any,
    budget: float | int | None,
    max_recompute: float | None = None,
) -> Plan:
    """Run ``forward`` once unwrapped, then choose the outputs to keep: within ``budget`` bytes, or
    the fewest bytes that rerun at most ``max_recompute`` of the block's step FLOPs."""
    # the trace works on copies of the inputs, cut from the model's graph: its backward must not
    # run into the graph before the block (a parameter shared with an earlier call, a tied
    # weight), and an op changing an input in place must not change the real one
    args, kwargs = tree_map(_cut, (args, kwargs))
    params = {_storage_key(p) for p in module.parameters()} | {_storage_key(b) for b in module.buffers()}
    inputs = {_storage_key(t): t.untyped_storage().nbytes() for t in _tensors((args, kwargs))}
    saved: dict[int, int] = {}
    recorder = _Recorder(set(params) | set(inputs))
    # ops dispatched when the forward saved its last tensor for backward: the recomputation stops
    # there (non-reentrant checkpoint's early stop), so the ops after it never run again
    stop = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal stop
        stop = len(recorder.ops)  # autograd saves an op's inputs before dispatching it
        k = _storage_key(t)
        if k not in params:
            saved[k] = t.untyped_storage().nbytes()
        return t

    cuda = sorted({t.device.index or 0 for t in _tensors((args, kwargs)) if t.is_cuda})
    with torch.random.fork_rng(devices=cuda):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
            out = forward(*args, **kwargs)
        recorder.held.clear()
        forward_flops = sum(o.flops for o in recorder.ops)
        backward = 0 if max_recompute is None else _backward_flops(module, (args, kwargs), out, forward_flops)
        del out
    unwrapped = sum(saved.values())
    input_bytes = sum(inputs.values())
    # Recomputation reruns the forward in order up to the stop, every op not kept: each kept op
    # avoids its own FLOPs, no more (its predecessors run anyway), and keeping an op past the stop
    # avoids nothing. Ops that cost no FLOPs (norms, activations, adds) are always recomputed.
    rerun = recorder.ops[:stop]
    candidates = [o for o in rerun if o.flops > 0]
    if max_recompute is not None:
        chosen = _least_bytes(candidates, int(max_recompute * (forward_flops + backward)))
    else:
        assert budget is not None
        limit = (int(budget * unwrapped) if isinstance(budget, float) else budget) - input_bytes
        chosen = _knapsack(candidates, limit)
    used = sum(o.bytes for o in candidates if o.key in chosen)
    return Plan(
        save=frozenset(chosen),
        sizes={o.key: o.bytes for o in recorder.ops if o.flops > 0},
        choices=tuple(o.key for o in candidates),
        unwrapped_bytes=unwrapped,
        input_bytes=input_bytes,
        saved_bytes=used,
        recompute_flops=sum(o.flops for o in rerun if o.key not in chosen),
        forward_flops=forward_flops,
        backward_flops=backward,
    )


def _cut(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    # a clone of a fresh leaf: not a leaf itself, as the block's inputs in a model are not (an
    # outer FlopCounterMode's hooks on a leaf would stop autograd.grad)
    return x.detach().requires_grad_(x.requires_grad).clone()


def _backward_flops(module: nn.Module, inputs: Any, out: Any, forward_flops: int) -> int:
    """FLOPs of the block's backward: gradients of its outputs for its (cut) inputs and its
    parameters, by ``autograd.grad``: nothing accumulates in ``.grad`` (hooks registered on the
    parameters with ``register_hook`` do see it). A backward that cannot run on its own (one
    that refuses all-ones output gradients, an outer ``FlopCounterMode``'s hooks on a leaf) is
    counted as twice the forward, the matmuls' ratio, with a warning."""
    outs = [t for t in _tensors(out) if t.requires_grad]
    wrt = [t for t in _tensors(inputs) if t.requires_grad] + [
        p for p in module.parameters() if p.requires_grad
    ]
    if not outs or not wrt:
        return 0
    try:
        with _fc.FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
            torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)
    except RuntimeError as e:
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        log.warning(
            "selective checkpointing: the backward of %s did not run on its own (%s); "
            "max_recompute counts it as twice the forward",
            type(module).__name__,
            why,
        )
        return 2 * forward_flops
    return int(counter.get_total_flops())


def _table(
    ops: list[_Op], weights: list[int], capacity: int
) -> tuple[list[tuple[int, int]], list[bytearray]]:
    """0/1 knapsack over integer ``weights``: at each capacity, (most FLOPs avoided, -bytes) and
    which op each row took (a byte per capacity: thousands of ops stay small). Among equal FLOPs,
    fewer bytes."""
    best = [(0, 0)] * (capacity + 1)
    took: list[bytearray] = []
    for op, w in zip(ops, weights, strict=True):
        row = bytearray(capacity + 1)
        nxt = list(best)
        for c in range(w, capacity + 1):
            flops, neg_bytes = best[c - w]
            cand = (flops + op.flops, neg_bytes - op.bytes)
            if cand > nxt[c]:
                nxt[c], row[c] = cand, 1
        best = nxt
        took.append(row)
    return best, took


def _pick(ops: list[_Op], weights: list[int], took: list[bytearray], c: int) -> set[tuple[Any, int]]:
    chosen = set()
    for op, w, row in zip(reversed(ops), reversed(weights), reversed(took), strict=True):
        if row[c]:
            chosen.add(op.key)
            c -= w
    return chosen


def _knapsack(ops: list[_Op], limit: int, units: int = 2048) -> set[tuple[Any, int]]:
    """The ops to keep: most recompute FLOPs avoided within ``limit`` bytes, by 0/1 knapsack over
    bytes in ``units`` steps of the limit (rounded up, so the choice never exceeds it). Among
    equal FLOPs, fewer bytes: the cheapest bytes per recomputed FLOP win."""
    if limit <= 0:
        return set()
    step = limit / units
    weights = [math.ceil(o.bytes / step) for o in ops]
    _, took = _table(ops, weights, units)
    return _pick(ops, weights, took, units)


def _least_bytes(ops: list[_Op], allowed_flops: int, units: int = 2048) -> set[tuple[Any, int]]:
    """The ops to keep: the fewest bytes whose recomputation (the ops not kept) costs at most
    ``allowed_flops``. The same knapsack, over bytes in ``units`` steps of all the ops' bytes
    (rounded up: the bytes found exceed the fewest possible by less than a step per op)."""
    need = sum(o.flops for o in ops) - allowed_flops  # FLOPs the kept ops must avoid
    if need <= 0:
        return set()
    step = max(1.0, sum(o.bytes for o in ops) / units)
    weights = [math.ceil(o.bytes / step) for o in ops]
    best, took = _table(ops, weights, sum(weights))
    c = next(c for c, (flops, _) in enumerate(best) if flops >= need)  # keeping all avoids all
    return _pick(ops, weights, took, c)


def _signature(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, ...]:
    def sig(t: torch.Tensor) -> tuple[Any, ...]:
        return (tuple(t.shape), t.dtype, t.device, t.requires_grad)

    return (
        type(module),
        module.training,
        tuple(sig(p) for p in module.parameters()),
        tuple(sig(t) for t in _tensors((args, kwargs))),
        tuple(type(x) for x in tree_flatten((args, kwargs))[0]),
    )


@dataclass
class Checkpointed:
    """The blocks :func:`checkpoint_blocks` wrapped, their policy, and what it kept."""

    blocks: list[str]
    policy: Policy
    budget: float | int | None
    #: the budgeted policy's other bound: at most this fraction of a block's step FLOPs recomputed
    max_recompute: float | None = None
    #: the budgeted policy's plans, one per block shape
    plans: dict[tuple[Any, ...], Plan] = field(default_factory=dict)
    #: what the policy kept since the last :meth:`reset_saved`
    saved: Saved = field(default_factory=Saved)

    def reset_saved(self) -> None:
        self.saved = Saved()

    def _plan(self, module: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any) -> Plan:
        key = _signature(module, args, kwargs)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = _trace(module, forward, args, kwargs, self.budget, self.max_recompute)
        return plan

    def _policy(self, plan: Plan | None) -> Callable[..., Any]:
        counts: dict[Any, int] = defaultdict(int)
        mismatch = False

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal mismatch
            packet = getattr(op, "overloadpacket", op)
            if plan is None:
                # "save_matmuls", or "budget" under torch.compile (no eager trace to plan from)
                keep = packet in EXPENSIVE_OPS
            elif packet not in _FLOPS:
                keep = False  # the plan keeps only ops that cost FLOPs to recompute
            else:
                # occurrences of FLOP ops only: other ops (a profiler's views) may come and go
                key = (op, counts[op])
                counts[op] += 1
                size = plan.sizes.get(key)
                out = _tensors(ctx.op_output)
                if not mismatch and (size is None or size > sum(t.untyped_storage().nbytes() for t in out)):
                    # a forward unlike the traced one (data-dependent control flow): recompute
                    mismatch = True
                    log.warning("selective checkpointing: the forward differs from its trace at %s", op)
                keep = not mismatch and key in plan.save
            if keep:
                out = _tensors(ctx.op_output)
                self.saved.tensors += len(out)
                self.saved.bytes += sum(t.untyped_storage().nbytes() for t in out)
                return _SAVE
            return _RECOMPUTE

        return policy

    def _forward(self, module: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        plan = None
        if self.policy == "budget" and not torch.compiler.is_compiling():
            plan = self._plan(module, forward, args, kwargs)
        if self.policy == "recompute_all":  # plain checkpointing
            return _ckpt.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        context = functools.partial(self._contexts, plan)
        return _ckpt.checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)

    def _contexts(self, plan: Plan | None) -> Any:
        return _ckpt.create_selective_checkpoint_contexts(self._policy(plan))


_MARK = "_strata_checkpointed"


def _why_not(name: str, module: nn.Module) -> str | None:
    if isinstance(module, torch.jit.ScriptModule):
        return "a TorchScript module runs outside the Python dispatcher that selective checkpointing needs"
    if type(module).__name__ == "OptimizedModule":
        return "it is torch.compile'd; wrap the blocks first, then compile the model"
    if getattr(module, _MARK, False):
        return "it is already checkpointed"
    for sub_name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.track_running_stats:
            where = f"{name}.{sub_name}" if sub_name else name
            return f"BatchNorm {where} tracks running statistics, which recomputation would update twice"
    return None


def checkpoint_blocks(
    model: nn.Module,
    blocks: type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool],
    policy: Policy = "budget",
    budget: float | int | None = None,
    *,
    max_recompute: float | None = None,
) -> Checkpointed:
    """Wrap ``model``'s blocks with selective activation checkpointing.

    ``blocks``: the block class(es), or a predicate on (qualified name, module); the outermost
    matches are wrapped. ``policy``: one of :data:`POLICIES`. ``budget`` (``"budget"`` only):
    activation bytes kept per block, inputs included, as a fraction in (0, 1] of the block's bytes
    without checkpointing (default :data:`DEFAULT_BUDGET`) or as an int of bytes.
    ``max_recompute`` (``"budget"`` only, instead of ``budget``): the extra FLOPs allowed, as a
    fraction in [0, 1) of the block's forward + backward FLOPs; the fewest bytes within it are kept.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
    if policy != "budget" and budget is not None:
        raise ValueError(f"budget: applies only to policy 'budget', not {policy!r}")
    if policy != "budget" and max_recompute is not None:
        raise ValueError(f"max_recompute: applies only to policy 'budget', not {policy!r}")
    if max_recompute is not None:
        if budget is not None:
            raise ValueError("max_recompute: give budget or max_recompute, not both")
        if isinstance(max_recompute, bool) or not isinstance(max_recompute, int | float):
            raise ValueError(f"max_recompute: expected a fraction in [0, 1), got {max_recompute!r}")
        if not 0.0 <= max_recompute < 1.0:
            raise ValueError(f"max_recompute: a fraction must be in [0, 1), got {max_recompute!r}")
    elif policy == "budget":
        if budget is None:
            budget = DEFAULT_BUDGET
        if isinstance(budget, bool) or not isinstance(budget, int | float):
            raise ValueError(f"budget: expected a fraction in (0, 1] or an int of bytes, got {budget!r}")
        if isinstance(budget, float) and not 0.0 < budget <= 1.0:
            raise ValueError(f"budget: a fraction must be in (0, 1], got {budget!r}")
        if isinstance(budget, int) and budget <= 0:
            raise ValueError(f"budget: bytes must be positive, got {budget!r}")
    match: Callable[[str, nn.Module], bool]
    if isinstance(blocks, type | tuple):
        kinds = blocks
        match = lambda _name, m: isinstance(m, kinds)  # noqa: E731
    elif callable(blocks):
        match = blocks
    else:
        raise ValueError(f"blocks: expected a module class, a tuple of them or a predicate, got {blocks!r}")

    selected: list[tuple[str, nn.Module]] = []
    marked: list[str] = []  # blocks checkpointed by an earlier call

    def inside(name: str, outer: list[str]) -> str | None:
        return next((n for n in outer if n == "" or name.startswith(n + ".")), None)

    for name, module in model.named_modules():
        if inside(name, [n for n, _ in selected]) is not None:
            continue  # the outermost match is wrapped
        label = name or type(module).__name__
        if getattr(module, _MARK, False) and not match(name, module):
            marked.append(name)
        if not match(name, module):
            continue
        outer = inside(name, marked)
        if outer is not None:
            raise ValueError(f"cannot checkpoint {label}: it is inside checkpointed block {outer or 'model'}")
        why = _why_not(label, module)
        if why is not None:
            raise ValueError(f"cannot checkpoint {label}: {why}")
        selected.append((name, module))
    if not selected:
        raise ValueError(f"blocks: {blocks!r} matched no module of {type(model).__name__}")

    handle = Checkpointed(
        [n for n, _ in selected], policy, budget, None if max_recompute is None else float(max_recompute)
    )
    for _name, module in selected:
        module.forward = functools.partial(handle._forward, module, module.forward)
        setattr(module, _MARK, True)
    return handle
