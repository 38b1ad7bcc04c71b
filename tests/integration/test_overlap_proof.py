"""Overlapped staging never commits bytes that are not the state at save(): a tensor it copies
after save() returns must be proven untouched until that copy ends (its optimizer's step hooks
run, and its version counter did not move), and whatever cannot be proven is copied in save()."""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from typing import Any

import pytest
import torch
from statecheck import flat_tensors, small_model, train_steps

from trainer_client import RestoreError, TornSnapshot


def slow_sender(client: Any, seconds: float = 0.3) -> None:
    """Hold the client's send thread for ``seconds``: the background copy of the next save
    starts late, after whatever the training thread does right after save() returns."""
    client._sender.submit(time.sleep, seconds)


def assert_restores(client: Any, expected: dict[str, torch.Tensor], step: int, make: Any) -> None:
    model, opt = make()
    assert client.restore({"model": model, "opt": opt}, step=step) == step
    got = flat_tensors({"model": model, "opt": opt})
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_a_parameter_changed_in_place_before_the_next_step_fails_the_save_and_is_copied_in_save_after(
    make_sidecar, make_client, job_name
):
    server = make_sidecar()

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = small_model(seed=7)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    model, opt = make()
    train_steps(model, opt, 2)
    client = make_client(server, job_name)
    state = {"model": model, "opt": opt}
    client.resume(state)
    train_steps(model, opt, 1)
    weight = next(model.parameters())
    slow_sender(client)
    handle = client.save(1, state)
    with torch.no_grad():  # outside opt.step(), before the background copy has run
        weight.mul_(2)
    with pytest.raises(TornSnapshot, match=r"step 1 .*0\.weight.* changed in place .*nothing was committed"):
        handle.durable.result(30)
    fresh, fresh_opt = make()
    with pytest.raises(RestoreError):
        client.restore({"model": fresh, "opt": fresh_opt})

    # From now on that optimizer's tensors are copied in save(): the same edit is harmless.
    train_steps(model, opt, 1)
    expected = flat_tensors(state)
    slow_sender(client)
    handle = client.save(2, state)
    assert handle.staged.done()  # nothing left for the background
    with torch.no_grad():
        weight.mul_(2)
    handle.durable.result(30)
    assert_restores(client, expected, 2, make)


class Bare(torch.optim.Optimizer):
    """An optimizer that skips Optimizer.__init__ and has its own zero_grad (as TorchRec's
    KeyedOptimizerWrapper does): torch never wraps its class step, so step hooks register fine
    but never run."""

    def __init__(self, params: Any, lr: float) -> None:
        self.defaults = {"lr": lr}
        self.param_groups = [{"params": list(params), "lr": lr}]
        self.state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        for name in ("step_pre", "step_post", "state_dict_pre", "state_dict_post"):
            setattr(self, f"_optimizer_{name}_hooks", OrderedDict())
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


def test_an_optimizer_whose_step_hooks_never_run_is_copied_in_save(make_sidecar, make_client, job_name):
    server = make_sidecar()

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = small_model(seed=3)
        return model, Bare(model.parameters(), lr=0.1)

    model, opt = make()
    train_steps(model, opt, 2)
    client = make_client(server, job_name)
    state = {"model": model, "opt": opt}
    client.resume(state)
    expected = flat_tensors(state)
    slow_sender(client)
    handle = client.save(1, state)
    assert handle.staged.done()  # copied before save() returned
    train_steps(model, opt, 1)  # its step waits for nothing: it must not reach the snapshot
    handle.durable.result(30)
    assert_restores(client, expected, 1, make)
