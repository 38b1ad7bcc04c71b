"""Changed-row tracking for embedding tables (Check-N-Run): a bitmap per table of the rows
looked up since the last checkpoint, set by a forward pre-hook.

Lookups tell which rows changed only when untouched rows cannot change: the optimizer
must leave rows without gradient alone. Trusted: plain SGD (no momentum, no weight
decay), SparseAdam, Adagrad without weight decay (its update is 0 where the gradient is
0). Anything else (momentum, weight decay, dense Adam moments) moves every row, and the
table is left to the sidecar's comparison by value. The optimizer-state rows of a
looked-up row (Adagrad's sums) share its bitmap.

Scope: the bitmap sent with a save covers every lookup since the newest committed
checkpoint of this client: a save that is skipped or fails keeps its rows for the next.
The first save of a client (after a start or a restore) sends none, so the sidecar
compares by value: only after a commit does this client know the sidecar holds exactly
its state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

log = logging.getLogger("strata.client")

Key = tuple[int, int]


def tensor_key(t: torch.Tensor) -> Key:
    return (t.data_ptr(), t.numel() * t.element_size())


def untouched_rows_stay(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> str:
    """ "" when rows without gradient cannot change under ``optimizer``, else why not."""
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), None)
    if group is None:
        return "the optimizer does not own this table"
    if group.get("weight_decay", 0):
        return "weight decay changes every row"
    if isinstance(optimizer, torch.optim.SGD):
        return "momentum moves rows without gradient" if group.get("momentum", 0) else ""
    if isinstance(optimizer, torch.optim.SparseAdam | torch.optim.Adagrad):
        return ""
    return f"{type(optimizer).__name__} may change rows without gradient"


@dataclass
class _Table:
    name: str
    weight: torch.Tensor
    seen: torch.Tensor  # bool [rows]: looked up since the last cut
    carry: torch.Tensor  # bool [rows]: sent with saves that have not committed yet
    optimizer: torch.optim.Optimizer


class RowTracker:
    def __init__(self) -> None:
        self._tables: dict[Key, _Table] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        #: a save of this client committed since the last reset: the bitmaps are meaningful
        self.armed = False

    def track(self, modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer) -> list[str]:
        """Start tracking every Embedding/EmbeddingBag in ``modules``; returns the tracked names."""
        names = []
        for root in modules:
            for name, sub in root.named_modules():
                if not isinstance(sub, nn.Embedding | nn.EmbeddingBag):
                    continue
                label = name or type(sub).__name__
                why = untouched_rows_stay(optimizer, sub.weight)
                if why:
                    log.warning("not tracking %s by lookups (%s); the sidecar diffs it by value", label, why)
                    continue
                rows = sub.weight.shape[0]
                seen = torch.zeros(rows, dtype=torch.bool, device=sub.weight.device)
                self._tables[tensor_key(sub.weight)] = _Table(
                    label, sub.weight, seen, torch.zeros(rows, dtype=torch.bool), optimizer
                )
                self._hooks.append(sub.register_forward_pre_hook(_mark(seen)))
                names.append(label)
        return names

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def cut(self, tensors: list[tuple[str, torch.Tensor]]) -> dict[int, bytes]:
        """At a save: per index into ``tensors``, the packed bitmap of rows that may differ from
        the newest committed snapshot (tables and their optimizer-state rows). Empty until armed."""
        if not self._tables:
            return {}
        by_key: dict[Key, bytes] = {}
        for key, table in self._tables.items():
            table.carry |= table.seen.cpu()
            table.seen.zero_()
            packed = np.packbits(table.carry.numpy(), bitorder="little").tobytes()
            by_key[key] = packed
            for state in table.optimizer.state.get(table.weight, {}).values():
                if (
                    isinstance(state, torch.Tensor)
                    and state.dim()
                    and state.shape[0] == table.weight.shape[0]
                ):
                    by_key[tensor_key(state)] = packed
        if not self.armed:
            return {}
        return {i: by_key[tensor_key(t)] for i, (_, t) in enumerate(tensors) if tensor_key(t) in by_key}

    def committed(self) -> None:
        """The save cut last is committed: the sidecar now holds exactly that state."""
        for table in self._tables.values():
            table.carry.zero_()
        self.armed = True

    def disarm(self) -> None:
        """State changed outside training (a restore): the next save is compared by value."""
        self.armed = False


def _mark(seen: torch.Tensor) -> Callable[[nn.Module, tuple[Any, ...]], None]:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        ids = args[0]
        seen[ids.reshape(-1)] = True

    return hook
