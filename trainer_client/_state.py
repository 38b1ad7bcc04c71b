"""What the client looks for in a training state: its optimizers and modules, which tensors
are embedding tables (quantization's default target), and whether the state is sharded
(DTensor, ShardedTensor: saved and loaded through DCP)."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import torch

from trainer_client._overlap import tensor_key as _tensor_key
from trainer_client._tracking import embedding_weights

T = TypeVar("T")


def roles(state: Any, tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
    """ "embedding" for the weights of embedding tables (what quantization targets by default):
    nn.Embedding / nn.EmbeddingBag, and fbgemm's tables (fused or sharded TorchRec tables)."""
    tables = {_tensor_key(w) for module in modules(state) for w in embedding_weights(module)}
    return ["embedding" if _tensor_key(t) in tables else "" for _, t in tensors]


def through_dcp(state: Any) -> bool:
    """Whether ``state`` is saved and loaded through DCP: it holds a DTensor or a ShardedTensor,
    as a value, a module's parameter or an optimizer's (or its state), or a TorchRec sharded
    module (whose state dict holds ShardedTensors)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    sharded = (DTensor, ShardedTensor)
    # Only where TorchRec is imported already: the library works without it.
    types = sys.modules.get("torchrec.distributed.types")
    sharded_module = getattr(types, "ShardedModule", None)

    def walk(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            return isinstance(v, sharded)
        if isinstance(v, torch.nn.Module):
            if sharded_module is not None and any(isinstance(m, sharded_module) for m in v.modules()):
                return True
            return any(isinstance(p, sharded) for p in v.parameters())
        if isinstance(v, torch.optim.Optimizer):
            return any(isinstance(p, sharded) for g in v.param_groups for p in g["params"]) or any(
                isinstance(x, sharded) for s in v.state.values() if isinstance(s, Mapping) for x in s.values()
            )
        if isinstance(v, Mapping):
            return any(walk(x) for x in v.values())
        if isinstance(v, list | tuple):
            return any(walk(x) for x in v)
        return False

    return walk(state)


def walk(obj: Any, seen: set[int] | None = None) -> Iterator[Any]:
    """``obj`` and everything nested in its mappings, lists and tuples."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    if isinstance(obj, Mapping):
        for value in obj.values():
            yield from walk(value, seen)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from walk(value, seen)


def found(state: Any, kind: type[T]) -> Iterator[T]:
    """The objects of ``kind`` in ``state`` (its mappings, lists and tuples walked, not the
    objects), each once."""
    return (obj for obj in walk(state) if isinstance(obj, kind))


def optimizers(state: Any) -> Iterator[torch.optim.Optimizer]:
    return found(state, torch.optim.Optimizer)


def modules(state: Any) -> Iterator[torch.nn.Module]:
    return found(state, torch.nn.Module)
