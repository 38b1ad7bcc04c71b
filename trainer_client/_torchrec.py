"""TorchRec and fbgemm tables, recognised without importing either (the client works without
TorchRec installed): by class name, and by the attributes fbgemm's table-batched embedding
module (TBE) has.

A ``FusedEmbeddingBagCollection`` and every sharded TorchRec table keep their tables in a TBE
(``SplitTableBatchedEmbeddingBagsCodegen``): one flat buffer, each table a view of it (what
``state_dict`` hands out), updated by fbgemm's own optimizer inside backward. Its forward sees
the rows looked up as (indices, offsets): per feature, per sample, the ids local to that
feature's table (after a sharded module's input dist: the rows of this rank's shard).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

#: fbgemm's training TBE; subclasses (SSD, say) are not: their rows live elsewhere
_TBE = "SplitTableBatchedEmbeddingBagsCodegen"

#: where TorchRec keeps kernels in plain lists, out of the module tree
_HIDDEN = ("_emb_modules", "_lookups")

#: EmbOptimType values whose update touches only the looked-up rows, weight decay included
#: (fbgemm applies it in the same per-row kernel). Checked on CPU; fbgemm's Adam, LAMB and
#: LARS are GPU-only here and left to the comparison by value.
_SPARSE_UPDATES = frozenset(
    {"sgd", "exact_sgd", "exact_adagrad", "exact_row_wise_adagrad", "row_wise_adagrad"}
)

#: torchrec's optimizer wrappers: their step is the wrapped optimizer's (clipping, warm-up and
#: keyed state aside), so whether untouched rows stay is the wrapped one's answer
_WRAPPERS = frozenset(
    {"KeyedOptimizerWrapper", "OptimizerWrapper", "GradientClippingOptimizer", "WarmupOptimizer"}
)


def tbes(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(path, module) of every TBE under ``root``. Walked through ``_modules`` and the plain
    lists TorchRec keeps its kernels in, out of ``named_modules`` (a fused collection's
    ``_emb_modules``; a sharded collection's ``_lookups``, whose ``named_modules`` yields itself
    alone)."""
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        path, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if type(module).__name__ == _TBE:
            yield path, module
            continue
        children = [(n, m) for n, m in module._modules.items() if m is not None]
        for attr in _HIDDEN:
            hidden = getattr(module, attr, None)
            if isinstance(hidden, list):
                children += [(f"{attr}.{i}", m) for i, m in enumerate(hidden) if isinstance(m, nn.Module)]
        stack.extend((f"{path}.{n}" if path else n, m) for n, m in reversed(children))


def why_untracked(tbe: nn.Module) -> str:
    """ "" when ``tbe``'s optimizer leaves rows without a lookup alone, else why not."""
    kind = getattr(tbe, "optimizer", None)
    value = str(getattr(kind, "value", kind))
    if value in _SPARSE_UPDATES:
        return ""
    return f"fbgemm's {value} optimizer is not known to leave rows without a lookup alone"


def tables(tbe: nn.Module) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Per table: its weight (a view of the TBE's buffer) and its optimizer-state tensors."""
    weights: list[torch.Tensor] = tbe.split_embedding_weights()  # type: ignore[operator]
    try:
        states: list[list[torch.Tensor]] = tbe.split_optimizer_states()  # type: ignore[operator]
    except (AttributeError, RuntimeError, NotImplementedError):
        states = []
    if len(states) != len(weights):  # SGD keeps no state: fbgemm returns no list at all
        states = [[] for _ in weights]
    return [(w, list(s)) for w, s in zip(weights, states, strict=True)]


def marker(
    tbe: nn.Module, seen: torch.Tensor, starts: list[int], per_feature: bool | None = None
) -> Callable[..., None]:
    """A forward pre-hook (``with_kwargs=True``) for ``tbe`` that sets ``seen[starts[t] + id]``
    for every id its forward looks up in table t. ``per_feature`` (default: on the CPU) slices
    the ids per feature, which reads a few offsets on the host; otherwise it stays on the device
    (no host sync), about 2x slower on the CPU."""
    table_of: list[int] = list(tbe.feature_table_map)  # type: ignore[arg-type]
    rows = [int(spec[0]) for spec in tbe.embedding_specs]  # type: ignore[union-attr]
    device = seen.device
    start_of = torch.tensor([starts[t] for t in table_of], dtype=torch.long, device=device)
    rows_of = torch.tensor([rows[t] for t in table_of], dtype=torch.long, device=device)
    features = len(table_of)
    if per_feature is None:
        per_feature = device.type == "cpu"

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        indices = kwargs["indices"] if "indices" in kwargs else args[0]
        offsets = kwargs["offsets"] if "offsets" in kwargs else args[1]
        per_rank = kwargs.get("batch_size_per_feature_per_rank", args[4] if len(args) > 4 else None)
        # offsets: one bag per feature and sample, feature-major; a variable batch gives each
        # feature's bags per rank
        bags = (
            [sum(b) for b in per_rank]
            if per_rank is not None
            else [(offsets.numel() - 1) // features] * features
        )
        ids = indices.long()
        if per_feature:
            ends = [0]
            for n in bags:
                ends.append(ends[-1] + n)
            bounds = offsets[ends].tolist()
            for f, t in enumerate(table_of):
                part = ids[bounds[f] : bounds[f + 1]]
                if not part.numel():
                    continue
                low, high = torch.aminmax(part)
                if low < 0 or high >= rows[t]:
                    # fbgemm's bounds check turns an id out of range into row 0 (or fails the forward)
                    part = torch.where((part >= 0) & (part < rows[t]), part, 0)
                seen[starts[t] : starts[t] + rows[t]].index_fill_(0, part, True)
            return
        lengths = (offsets[1:] - offsets[:-1]).long()
        # an int repeat for a fixed batch: a tensor of counts would be a host-to-device copy
        count: Any = bags[0] if per_rank is None else torch.tensor(bags, dtype=torch.long, device=device)
        n = ids.numel()
        start = start_of.repeat_interleave(count).repeat_interleave(lengths, output_size=n)
        limit = rows_of.repeat_interleave(count).repeat_interleave(lengths, output_size=n)
        seen.index_fill_(0, start + torch.where((ids >= 0) & (ids < limit), ids, 0), True)

    return hook


def unwrap(optimizer: Any) -> Iterator[Any]:
    """The optimizers that step parameters under ``optimizer``: torchrec's
    ``CombinedOptimizer`` and wrappers opened, anything else as it is."""
    names = {c.__name__ for c in type(optimizer).__mro__}
    if "CombinedOptimizer" in names:
        for _, inner in optimizer.optimizers:
            yield from unwrap(inner)
    elif names & _WRAPPERS and getattr(optimizer, "_optimizer", None) is not None:
        yield from unwrap(optimizer._optimizer)
    else:
        yield optimizer
