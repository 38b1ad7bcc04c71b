"""Helpers shared by the integration tests: small models and bitwise comparison."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(100, 8),
        nn.Flatten(),
        nn.Linear(8 * 4, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(16, 1),
    )


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 100, (8, 4), generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def flat_tensors(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly Stateful) structure, by path."""
    if hasattr(value, "state_dict") and not isinstance(value, torch.Tensor):
        value = value.state_dict()
    out: dict[str, torch.Tensor] = {}
    if isinstance(value, torch.Tensor):
        out[prefix] = value.detach().clone()
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(flat_tensors(v, f"{prefix}.{k}"))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            out.update(flat_tensors(v, f"{prefix}[{i}]"))
    return out


def assert_bitwise_equal(a: Any, b: Any) -> None:
    ta, tb = flat_tensors(a), flat_tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        ba = ta[k].contiguous().reshape(-1).view(torch.uint8)
        bb = tb[k].contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(ba, bb), f"{k} differs"
