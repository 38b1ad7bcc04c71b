"""Selective activation checkpointing (trainer_client.activation): gradients equal the unwrapped
model's (bitwise in float64; float32 within 1e-6 absolute, bitwise in practice on CPU), the
policies keep what they should, and bad arguments or unwrappable blocks are named."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests.bench.activation import DLRM, Block, count_step, dlrm_blocks, dlrm_inputs, eager_step, gpt, mlp
from trainer_client import checkpoint_blocks
from trainer_client.activation import EXPENSIVE_OPS, POLICIES

FLOAT32_ATOL = 1e-6


def _gpt() -> tuple[nn.Module, tuple[Any, ...], Any]:
    # dropout in attention and on both residual branches: the recomputation must replay its RNG
    return gpt(2, 32, 4, dropout=0.2), (torch.randn(2, 16, 32, requires_grad=True),), Block


def _mlp() -> tuple[nn.Module, tuple[Any, ...], Any]:
    model = nn.Sequential(mlp(16, 64, 64), nn.ReLU(), mlp(64, 64, 8))
    return model, (torch.randn(32, 16, requires_grad=True),), lambda name, _m: name in ("0", "2")


def _dlrm() -> tuple[nn.Module, tuple[Any, ...], Any]:
    return DLRM(tables=4, rows=50, dim=8), dlrm_inputs(32, tables=4, rows=50), dlrm_blocks


MODELS = {"gpt": _gpt, "mlp": _mlp, "dlrm": _dlrm}
CASES = [(p, None) for p in POLICIES] + [("budget", 0.3)]


def _grads(model: nn.Module, inputs: tuple[Any, ...]) -> list[torch.Tensor]:
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    model(*inputs).square().sum().backward()
    return [p.grad for p in model.parameters()] + [t.grad for t in inputs if t.requires_grad]  # type: ignore[misc]


def _build(name: str, dtype: torch.dtype) -> tuple[nn.Module, tuple[Any, ...], Any]:
    torch.manual_seed(0)
    model, inputs, blocks = MODELS[name]()
    model = model.to(dtype)
    inputs = tuple(
        t.detach().to(dtype).requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs
    )
    return model, inputs, blocks


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("policy", "budget"), CASES)
def test_gradients_equal_the_unwrapped_model_bitwise_in_float64(name: str, policy: str, budget: Any) -> None:
    model, inputs, blocks = _build(name, torch.float64)
    wrapped = copy.deepcopy(model)
    checkpoint_blocks(wrapped, blocks, policy, budget)  # type: ignore[arg-type]
    expected = _grads(model, inputs)
    for _ in range(2):  # the traced first step and a planned one
        got = _grads(wrapped, inputs)
        assert len(got) == len(expected)
        for a, b in zip(expected, got, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", MODELS)
def test_gradients_bitwise_under_a_recompute_cap(name: str) -> None:
    """``max_recompute`` traces the block's backward too (``autograd.grad``): nothing of it may
    reach the parameters' ``.grad`` of the first step."""
    model, inputs, blocks = _build(name, torch.float64)
    wrapped = copy.deepcopy(model)
    checkpoint_blocks(wrapped, blocks, max_recompute=0.02)
    expected = _grads(model, inputs)
    for _ in range(2):
        for a, b in zip(expected, _grads(wrapped, inputs), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", MODELS)
def test_float32_gradients_within_tolerance(name: str) -> None:
    model, inputs, blocks = _build(name, torch.float32)
    wrapped = copy.deepcopy(model)
    checkpoint_blocks(wrapped, blocks)
    for a, b in zip(_grads(model, inputs), _grads(wrapped, inputs), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=FLOAT32_ATOL)


def _saved(policy: str, budget: Any = None) -> tuple[int, int, Any]:
    model, inputs, blocks = _build("gpt", torch.float32)
    model.eval()  # no dropout: the fused attention kernel, one op per block
    handle = checkpoint_blocks(model, blocks, policy, budget)  # type: ignore[arg-type]
    handle.reset_saved()
    model(*inputs).sum().backward()
    return handle.saved.tensors, handle.saved.bytes, handle


def test_policies_keep_what_they_should() -> None:
    assert _saved("recompute_all")[:2] == (0, 0)
    matmuls, matmul_bytes, _ = _saved("save_matmuls")
    # per block: 4 linears (addmm) and attention (output, logsumexp)
    assert matmuls == 2 * (4 + 2)
    everything, _, _ = _saved("budget", 1.0)
    # a whole block's budget keeps every FLOP op but the last linear: the backward needs only its
    # input, so the recomputation stops before it and keeping its output would avoid nothing
    assert everything == matmuls - 2
    half, half_bytes, handle = _saved("budget", 0.5)
    assert 0 < half < matmuls and half_bytes < matmul_bytes
    (plan,) = handle.plans.values()  # both blocks share one shape: one trace
    assert plan.saved_bytes + plan.input_bytes <= 0.5 * plan.unwrapped_bytes
    assert half_bytes == 2 * plan.saved_bytes
    assert 0 < plan.recompute_flops < plan.forward_flops
    assert _saved("budget", 1)[:2] == (0, 0)  # one byte: less than the inputs, keeps nothing


def _step_flops(model: nn.Module, inputs: tuple[Any, ...]) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    from trainer_client.activation import FLOP_FORMULAS

    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
        model(*inputs).sum().backward()
    return int(counter.get_total_flops())


class _MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 256), nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def test_the_plan_never_pays_for_ops_the_recomputation_does_not_run() -> None:
    """fc2's output is small and costly to compute, but no backward needs it: the recomputation
    stops once it has rebuilt fc2's input, so keeping it avoids nothing. The plan keeps fc1 only,
    and the FLOPs it says it recomputes are the ones a real step adds."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_MLPBlock()), torch.randn(64, 16, requires_grad=True)
    base = _step_flops(model, (x,))
    fc1 = (torch.ops.aten.addmm.default, 0)
    for budget, kept, recomputed in ((1.0, {fc1}, 0), (0.3, set(), 2 * 64 * 16 * 256)):
        wrapped = copy.deepcopy(model)
        handle = checkpoint_blocks(wrapped, _MLPBlock, "budget", budget)
        wrapped(x).sum().backward()  # the traced step
        (plan,) = handle.plans.values()
        assert plan.save == kept
        assert plan.recompute_flops == recomputed
        assert _step_flops(wrapped, (x,)) - base == recomputed


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("budget", [1.0, 0.5, 0.3, 0.1])
def test_planned_recompute_flops_are_the_measured_extra_flops(name: str, budget: float) -> None:
    model, inputs, blocks = _build(name, torch.float32)
    model.eval()  # the GPT's fused attention kernel
    base = _step_flops(model, inputs)
    handle = checkpoint_blocks(model, blocks, "budget", budget)
    model(*inputs).sum().backward()  # the traced step (one forward more)
    # the GPT's two blocks share one plan; the MLP's and DLRM's have one each
    per_plan = len(handle.blocks) // len(handle.plans)
    planned = per_plan * sum(p.recompute_flops for p in handle.plans.values())
    assert _step_flops(model, inputs) - base == planned


class _Looped(nn.Module):
    """One block applied three times: its parameters lie before its own input from the second
    call on."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _MLPBlock16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.block(x)
        return x


class _MLPBlock16(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def test_the_traced_backward_stays_inside_the_block() -> None:
    """A shared block's second call is traced with its own backward: that backward must not run
    the first call's (whose graph the real backward then finds freed), nor count its FLOPs."""
    torch.manual_seed(0)
    model = _Looped().double()
    x = torch.randn(8, 16, dtype=torch.float64)  # data: the first call's input needs no grad
    wrapped = copy.deepcopy(model)
    handle = checkpoint_blocks(wrapped, _MLPBlock16, max_recompute=0.02)
    expected = _grads(model, (x,))
    for a, b in zip(expected, _grads(wrapped, (x,)), strict=True):
        assert torch.equal(a, b)
    first, later = handle.plans.values()  # the input without, then with, a gradient
    matmuls = 2 * 8 * 16 * 64 * 2  # fc1 and fc2, forward
    assert (first.forward_flops, first.backward_flops) == (matmuls, 3 * matmuls // 2)
    assert (later.forward_flops, later.backward_flops) == (matmuls, 2 * matmuls)


def test_an_outer_flop_counter_around_the_first_step() -> None:
    """FlopCounterMode hooks every module's inputs; the trace's backward still runs on its own."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = nn.Sequential(_MLPBlock16(), _MLPBlock16()).double()
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    wrapped = copy.deepcopy(model)
    handle = checkpoint_blocks(wrapped, _MLPBlock16, max_recompute=0.02)
    expected = _grads(model, (x,))
    with FlopCounterMode(display=False):
        got = _grads(wrapped, (x,))
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    (plan,) = handle.plans.values()
    assert plan.backward_flops == 2 * plan.forward_flops == 2 * 2 * 8 * 16 * 64 * 2


class _RefusesOnes(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        if bool((g == 1).all()):
            raise RuntimeError("all-ones output gradients")
        return g * 2


class _Refusing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RefusesOnes.apply(self.lin(x))


def test_a_backward_that_cannot_run_alone_is_estimated(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Refusing()).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    weights = torch.arange(8.0, dtype=torch.float64)
    wrapped = copy.deepcopy(model)
    handle = checkpoint_blocks(wrapped, _Refusing, max_recompute=0.02)
    grads = []
    for m in (model, wrapped):
        x.grad = None
        (m(x) * weights).sum().backward()
        grads.append([p.grad for p in m.parameters()] + [x.grad])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    (plan,) = handle.plans.values()
    assert plan.backward_flops == 2 * plan.forward_flops > 0
    assert "the backward of _Refusing did not run on its own (all-ones output gradients)" in caplog.text


def test_the_traced_backward_is_the_blocks_backward() -> None:
    model, inputs, blocks = _build("gpt", torch.float32)
    model.eval()
    base = _step_flops(model, inputs)
    handle = checkpoint_blocks(model, blocks, max_recompute=0.0)
    model(*inputs).sum().backward()
    (plan,) = handle.plans.values()  # two blocks alike, and nothing else in the model costs FLOPs
    assert 2 * (plan.forward_flops + plan.backward_flops) == base
    assert plan.backward_flops > plan.forward_flops


@pytest.mark.parametrize("name", MODELS)
def test_a_recompute_cap_holds_and_a_lower_cap_keeps_more(name: str) -> None:
    model, inputs, blocks = _build(name, torch.float32)
    model.eval()
    base = _step_flops(model, inputs)
    kept = []
    for cap in (0.3, 0.1, 0.02, 0.0):
        wrapped = copy.deepcopy(model)
        handle = checkpoint_blocks(wrapped, blocks, max_recompute=cap)
        wrapped(*inputs).sum().backward()  # the traced step
        for plan in handle.plans.values():
            assert plan.recompute_flops <= cap * (plan.forward_flops + plan.backward_flops)
        per_plan = len(handle.blocks) // len(handle.plans)
        planned = per_plan * sum(p.recompute_flops for p in handle.plans.values())
        assert _step_flops(wrapped, inputs) - base == planned
        kept.append(sum(p.saved_bytes for p in handle.plans.values()))
    assert kept == sorted(kept)
    assert kept[-1] > kept[0]  # the caps differ on every model here


def test_the_fewest_bytes_within_a_recompute_cap() -> None:
    """Against brute force on random op sets: within the FLOPs allowed, and no subset within them
    holds fewer bytes (beyond the rounding: a step of 1/2048 of all the bytes per op)."""
    import itertools
    import random

    from trainer_client.activation import _least_bytes, _Op

    rng = random.Random(1)
    for trial in range(60):
        ops = [
            _Op((trial, i), rng.choice([8, 16, 24, 32]) << 20, rng.choice([4, 12, 16]) << 30)
            for i in range(6)
        ]
        allowed = rng.randrange(0, sum(o.flops for o in ops) + 1)
        chosen = _least_bytes(ops, allowed)
        assert sum(o.flops for o in ops if o.key not in chosen) <= allowed
        fewest = min(
            sum(o.bytes for o in subset)
            for r in range(len(ops) + 1)
            for subset in itertools.combinations(ops, r)
            if sum(o.flops for o in ops if o not in subset) <= allowed
        )
        step = sum(o.bytes for o in ops) / 2048
        assert sum(o.bytes for o in ops if o.key in chosen) <= fewest + len(ops) * step


def test_save_matmuls_keeps_the_expensive_ops() -> None:
    assert torch.ops.aten.mm in EXPENSIVE_OPS and torch.ops.aten.addmm in EXPENSIVE_OPS
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in EXPENSIVE_OPS


def test_one_trace_per_block_shape() -> None:
    model, (x,), blocks = _build("gpt", torch.float32)
    handle = checkpoint_blocks(model, blocks)
    for _ in range(2):
        model(x).sum().backward()
    assert len(handle.plans) == 1
    model(x[:, :8]).sum().backward()
    assert len(handle.plans) == 2
    with torch.no_grad():  # no autograd, no checkpointing, no trace
        model(x[:, :4])
    assert len(handle.plans) == 2


def test_wrapping_keeps_parameter_names() -> None:
    model, _, blocks = _build("gpt", torch.float32)
    keys = list(model.state_dict())
    handle = checkpoint_blocks(model, blocks, "save_matmuls")
    assert list(model.state_dict()) == keys
    assert handle.blocks == ["0", "1"]


def test_unwrapped_bytes_equal_what_saved_tensor_hooks_see() -> None:
    """The bench counts live storages (hooks cannot see selective checkpointing's cache); on the
    unwrapped model that is what an outer saved_tensors_hooks sees, parameters and inputs aside."""
    model, inputs, _ = _build("gpt", torch.float32)
    model.eval()
    held, _ = count_step(eager_step(model, inputs), model, inputs)
    skip = {p.untyped_storage()._cdata for p in model.parameters()} | {
        t.untyped_storage()._cdata for t in inputs
    }
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage()._cdata not in skip:
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs).sum()
    assert held == sum(seen.values()) > 0
    loss.backward()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"policy": "save_everything"},
            r"^policy: 'save_everything' is not one of recompute_all, save_matmuls, budget$",
        ),
        ({"policy": "save_matmuls", "budget": 0.5}, r"^budget: applies only to policy 'budget'"),
        ({"budget": 1.5}, r"^budget: a fraction must be in \(0, 1\]"),
        ({"budget": 0.0}, r"^budget: a fraction must be in \(0, 1\]"),
        ({"budget": -4}, r"^budget: bytes must be positive"),
        ({"budget": True}, r"^budget: expected a fraction"),
        ({"budget": "half"}, r"^budget: expected a fraction"),
        ({"max_recompute": 0.02, "budget": 0.5}, r"^max_recompute: give budget or max_recompute, not both$"),
        (
            {"max_recompute": 0.02, "policy": "recompute_all"},
            r"^max_recompute: applies only to policy 'budget'",
        ),
        ({"max_recompute": 1.0}, r"^max_recompute: a fraction must be in \[0, 1\)"),
        ({"max_recompute": -0.1}, r"^max_recompute: a fraction must be in \[0, 1\)"),
        ({"max_recompute": float("nan")}, r"^max_recompute: a fraction must be in \[0, 1\)"),
        ({"max_recompute": True}, r"^max_recompute: expected a fraction"),
        ({"blocks": nn.Conv2d}, r"^blocks: .*Conv2d.* matched no module of Sequential$"),
        ({"blocks": 42}, r"^blocks: expected a module class"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], match: str) -> None:
    model, _, blocks = _build("gpt", torch.float32)
    with pytest.raises(ValueError, match=match):
        checkpoint_blocks(model, **{"blocks": blocks, **kwargs})


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")  # deprecated, still in users' models
def test_unwrappable_blocks_are_named() -> None:
    model = nn.Sequential(_Normed(), _Normed())
    with pytest.raises(ValueError, match=r"^cannot checkpoint 0: BatchNorm 0.bn tracks running statistics"):
        checkpoint_blocks(model, _Normed)

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    checkpoint_blocks(model, nn.Linear)
    with pytest.raises(ValueError, match=r"^cannot checkpoint 0: it is already checkpointed$"):
        checkpoint_blocks(model, nn.Linear)

    outer = nn.Sequential(nn.Sequential(nn.Linear(4, 4)))
    checkpoint_blocks(outer, lambda name, _m: name == "0")
    with pytest.raises(ValueError, match=r"^cannot checkpoint 0.0: it is inside checkpointed block 0$"):
        checkpoint_blocks(outer, nn.Linear)

    scripted = nn.Sequential(torch.jit.script(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match=r"^cannot checkpoint 0: a TorchScript module"):
        checkpoint_blocks(scripted, lambda name, _m: name == "0")

    compiled = nn.Sequential(torch.compile(nn.Linear(4, 4)))  # compiles lazily: nothing runs here
    with pytest.raises(ValueError, match=r"^cannot checkpoint 0: it is torch.compile'd"):
        checkpoint_blocks(compiled, lambda name, _m: name == "0")


def test_budget_under_torch_compile_keeps_the_matmuls() -> None:
    """Under torch.compile there is no eager trace: "budget" keeps what "save_matmuls" keeps."""
    model, inputs, blocks = _build("gpt", torch.float32)
    model.eval()
    expected = _grads(model, inputs)
    handle = checkpoint_blocks(model, blocks)
    got = _grads(torch.compile(model, backend="aot_eager"), inputs)  # type: ignore[arg-type]
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=FLOAT32_ATOL)
    assert handle.plans == {}


def test_knapsack_keeps_the_most_flops_within_the_budget() -> None:
    """Against brute force on random op sets: never over the limit, and as many FLOPs avoided as
    the best subset (a greedy by FLOPs per byte misses it on ties of density, as a GPT block has)."""
    import itertools
    import random

    from trainer_client.activation import _knapsack, _Op

    rng = random.Random(0)
    for trial in range(60):
        ops = [
            _Op((trial, i), rng.choice([8, 16, 24, 32]) << 20, rng.choice([4, 12, 16]) << 30)
            for i in range(6)
        ]
        limit = rng.randrange(8 << 20, 96 << 20)
        chosen = _knapsack(ops, limit)
        assert sum(o.bytes for o in ops if o.key in chosen) <= limit
        best = max(
            sum(o.flops for o in subset)
            for r in range(len(ops) + 1)
            for subset in itertools.combinations(ops, r)
            if sum(o.bytes for o in subset) <= limit
        )
        # bytes round up to 1/2048 of the limit; no subset here fits within that margin
        assert sum(o.flops for o in ops if o.key in chosen) == best
