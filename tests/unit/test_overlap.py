"""Which tensors overlapped staging may copy after save() returns (trainer_client._overlap)."""

from __future__ import annotations

import pytest
import torch

from trainer_client import TornSnapshot, _tree
from trainer_client._overlap import Overlap


def _deferred(overlap: Overlap, state: dict) -> list[str]:
    flat = _tree.flatten(state)
    optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    modules = [v for v in state.values() if isinstance(v, torch.nn.Module)]
    plan = overlap.plan(flat.tensors, optimizers, modules)
    return [flat.tensors[i][0] for i in plan.indices]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(10, 4, max_norm=1.0), torch.nn.Linear(4, 2))


def test_a_torch_optimizer_defers_its_parameters_and_state_but_not_what_forward_changes():
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()
    overlap = Overlap(lambda: None)
    overlap.register(opt)
    names = _deferred(overlap, {"model": model, "opt": opt})
    assert "model.1.weight" in names and "opt.state.1.exp_avg" in names
    assert "model.0.weight" not in names  # max_norm renormalises it in forward


def test_nothing_is_deferred_for_an_unregistered_optimizer_sharing_the_tensors():
    model = _model()
    a = torch.optim.SGD(model.parameters(), lr=0.1)
    b = torch.optim.SGD(model[1].parameters(), lr=0.1)  # steps without waiting for the copy
    overlap = Overlap(lambda: None)
    overlap.register(a)
    assert _deferred(overlap, {"model": model, "a": a, "b": b}) == []


def test_a_changed_version_fails_the_save_and_stops_deferring_that_optimizer():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    overlap = Overlap(lambda: None)
    overlap.register(opt)
    flat = _tree.flatten({"model": model})
    plan = overlap.plan(flat.tensors, [opt], [model])
    overlap.verify(plan, flat.tensors, 3)  # unchanged: proven
    with torch.no_grad():
        model[1].bias.mul_(2)
    with pytest.raises(TornSnapshot, match=r"step 3 not saved: 'model.1.bias' changed in place .*SGD.step"):
        overlap.verify(plan, flat.tensors, 3)
    assert overlap.plan(flat.tensors, [opt], [model]).indices == []


torchrec = pytest.mark.torchrec


@torchrec
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # apply_optimizer_in_backward's imports
@pytest.mark.parametrize("kind", ["plain", "fused", "in_backward"])
def test_torchrec_defers_the_dense_optimizer_through_its_wrappers_and_never_the_tables(kind):
    from tests.fixtures import dlrm  # make setup installs TorchRec: missing, this fails

    model, opt = dlrm.build(kind, fused_optimizer=torch.optim.Adagrad)
    overlap = Overlap(lambda: None)
    overlap.register(opt)
    names = _deferred(overlap, dlrm.state_of(model, opt))
    dense = [n for n in names if "dense_arch" in n or "over_arch" in n]
    tables = [n for n in names if "embedding_bag" in n]
    assert dense and any("exp_avg" in n for n in dense)  # Adam behind KeyedOptimizerWrapper
    # Plain Adagrad tables are stepped by a real torch optimizer; fused and in-backward ones
    # change inside backward.
    assert bool(tables) == (kind == "plain")


def test_a_step_replaced_on_the_instance_is_trusted_only_as_an_lr_schedulers_wrapper_of_its_own():
    """An LR scheduler wraps the class's (hooked) step: the hooks still run first. A wrapper the
    script put on the instance (weight decay before the real step) runs before them, whatever
    wraps it later: its optimizer's tensors are copied inside save()."""
    import types

    from trainer_client._overlap import _hooks_run

    plain = torch.optim.SGD(_model().parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(plain, 10)
    assert _hooks_run(plain)

    wrapped = torch.optim.SGD(_model().parameters(), lr=0.1)
    real = wrapped.step

    def decay_then_step(self: torch.optim.Optimizer, closure: object = None) -> object:
        with torch.no_grad():
            torch._foreach_mul_([p for g in self.param_groups for p in g["params"]], 0.99)
        return real(closure)

    wrapped.step = types.MethodType(decay_then_step, wrapped)  # type: ignore[method-assign]
    torch.optim.lr_scheduler.StepLR(wrapped, 10)
    assert not _hooks_run(wrapped)
