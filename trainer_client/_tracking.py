"""Changed-row tracking for embedding tables (Check-N-Run): a bitmap per table of the rows
looked up since the last checkpoint, set by a forward pre-hook.

Tables tracked: ``nn.Embedding`` / ``nn.EmbeddingBag`` (so TorchRec's
``EmbeddingBagCollection`` / ``EmbeddingCollection``, whose tables they are), and every table
of fbgemm's table-batched module (TBE): a ``FusedEmbeddingBagCollection``'s, and a sharded
TorchRec module's local shards (see ``_torchrec``).

Lookups tell which rows changed only when untouched rows cannot change: the optimizer
must leave rows without gradient alone. Trusted: plain SGD (no momentum, no weight
decay), SparseAdam, Adagrad without weight decay (its update is 0 where the gradient is
0), found through torchrec's ``CombinedOptimizer`` / ``KeyedOptimizerWrapper`` or a
parameter's in-backward optimizer; for a TBE, fbgemm's SGD and Adagrad (row-wise too),
which update only the rows looked up. Anything else (momentum, weight decay, dense Adam
moments) moves every row, and the table is left to the sidecar's comparison by value. The
optimizer-state rows of a looked-up row (Adagrad's sums, row-wise Adagrad's momentum)
share its bitmap.

Scope: the bitmap sent with a save covers every lookup since the newest committed
checkpoint of this client: a save that is skipped or fails keeps its rows for the next.
The first save of a client (after a start or a restore) sends none, so the sidecar
compares by value: only after a commit does this client know the sidecar holds exactly
its state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from trainer_client import _torchrec

log = logging.getLogger("strata.client")

Key = tuple[int, int]


def tensor_key(t: torch.Tensor) -> Key:
    return (t.data_ptr(), t.numel() * t.element_size())


def owner(optimizer: Any, param: torch.Tensor) -> torch.optim.Optimizer | None:
    """The optimizer that steps ``param``: one under ``optimizer`` (torchrec's wrappers
    opened), else an in-backward optimizer of ``param``; None if none does."""
    found = list(_torchrec.unwrap(optimizer)) if optimizer is not None else []
    found += getattr(param, "_in_backward_optimizers", [])
    for opt in found:
        if any(p is param for g in opt.param_groups for p in g["params"]):
            return opt
    return None


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
    #: its optimizer-state tensors now (a torch optimizer may create them lazily)
    states: Callable[[], Iterable[Any]]


class RowTracker:
    def __init__(self) -> None:
        self._tables: dict[Key, _Table] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        #: a save of this client committed since the last reset: the bitmaps are meaningful
        self.armed = False

    def track(self, modules: Iterable[nn.Module], optimizer: Any = None) -> list[str]:
        """Start tracking every table in ``modules`` (see the module's doc); returns the tracked
        names. Warns, naming the modules, when there is none to track."""
        names: list[str] = []
        roots = list(modules)
        for root in roots:
            for name, sub in root.named_modules():
                if isinstance(sub, nn.Embedding | nn.EmbeddingBag):
                    names += self._track_module(name or type(sub).__name__, sub, optimizer)
            labels = {tensor_key(t): n.removesuffix(".weight") for n, t in _tensors(root)}
            for path, tbe in _torchrec.tbes(root):
                names += self._track_tbe(path or type(tbe).__name__, tbe, labels)
        if not names:
            log.warning(
                "track(%s): no table to track by lookups (nn.Embedding, nn.EmbeddingBag, TorchRec tables) "
                "under an optimizer that leaves untouched rows alone; the sidecar diffs them by value",
                ", ".join(type(m).__name__ for m in roots),
            )
        return names

    def _track_module(self, label: str, sub: nn.Embedding | nn.EmbeddingBag, optimizer: Any) -> list[str]:
        weight = sub.weight
        opt = owner(optimizer, weight)
        if opt is None:
            why = (
                "the optimizer given does not own this table"
                if optimizer is not None
                else "no optimizer steps it: pass the one that does, track(..., optimizer=opt)"
            )
        else:
            why = untouched_rows_stay(opt, weight)
        if why:
            log.warning("not tracking %s by lookups (%s); the sidecar diffs it by value", label, why)
            return []
        assert opt is not None
        rows = weight.shape[0]
        seen = torch.zeros(rows, dtype=torch.bool, device=weight.device)
        states = opt.state
        self._add(label, weight, seen, lambda: states.get(weight, {}).values())
        self._hooks.append(sub.register_forward_pre_hook(_mark(seen), with_kwargs=True))
        return [label]

    def _track_tbe(self, path: str, tbe: nn.Module, labels: dict[Key, str]) -> list[str]:
        why = _torchrec.why_untracked(tbe)
        if why:
            log.warning(
                "not tracking the tables of %s by lookups (%s); the sidecar diffs them by value", path, why
            )
            return []
        found = _torchrec.tables(tbe)
        starts = [0]
        for weight, _ in found:
            starts.append(starts[-1] + weight.shape[0])
        seen = torch.zeros(starts[-1], dtype=torch.bool, device=found[0][0].device if found else None)
        names = []
        for i, (weight, states) in enumerate(found):
            label = labels.get(tensor_key(weight), f"{path}[table {i}]")
            self._add(label, weight, seen[starts[i] : starts[i + 1]], _const(states))
            names.append(label)
        self._hooks.append(
            tbe.register_forward_pre_hook(_torchrec.marker(tbe, seen, starts), with_kwargs=True)
        )
        return names

    def _add(
        self, label: str, weight: torch.Tensor, seen: torch.Tensor, states: Callable[[], Iterable[Any]]
    ) -> None:
        carry = torch.zeros(weight.shape[0], dtype=torch.bool)
        self._tables[tensor_key(weight)] = _Table(label, weight, seen, carry, states)

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
            for state in table.states():
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


def embedding_weights(root: nn.Module) -> Iterator[torch.Tensor]:
    """Every embedding table's weight under ``root``: nn.Embedding / nn.EmbeddingBag, and each
    table of a TBE (fused or sharded TorchRec tables)."""
    for sub in root.modules():
        if isinstance(sub, nn.Embedding | nn.EmbeddingBag):
            yield sub.weight
    for _, tbe in _torchrec.tbes(root):
        for weight, _ in _torchrec.tables(tbe):
            yield weight


def _tensors(root: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``root``'s state_dict tensors by name; a sharded tensor's local shards under its name."""
    for name, value in root.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor) and type(value).__name__ != "ShardedTensor":
            yield name, value
        for shard in getattr(value, "local_shards", lambda: [])():
            yield name, shard.tensor


def _const(states: list[torch.Tensor]) -> Callable[[], Iterable[Any]]:
    return lambda: states


def _mark(seen: torch.Tensor) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # TorchRec's collections call their tables by keyword (input=..., offsets=...)
        ids = kwargs["input"] if "input" in kwargs else args[0]
        seen[ids.reshape(-1)] = True

    return hook
