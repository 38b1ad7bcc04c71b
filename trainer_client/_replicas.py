"""Replica-aware saves: a tensor replicated across a data-parallel group is saved by one rank.

With DDP over N ranks every rank holds the same parameters and optimizer state; saving them from
every rank writes N identical copies. Here each replicated tensor gets one owner in its group,
assigned greedily by size so each rank carries about 1/k of the group's bytes; only the owner
stages and sends it. Every rank lists every replicated tensor (owner, dtype, shape) with a digest
of a fixed sample of its own copy, so the commit catches a replica that diverged (a real DDP bug)
and names it. A restore fetches the tensors a rank did not save from their owners' snapshots,
through its own sidecar (memory when it holds them, else storage).

What is replicated:

- the parameters of every ``DistributedDataParallel`` found in the state or declared, across its
  process group (buffers are not: BatchNorm statistics are updated by each rank's own batch after
  DDP broadcasts them);
- the optimizer state of those parameters (every optimizer in the state or registered);
- whatever :meth:`CheckpointClient.replicate` declares, across the group given (the replicate
  dimension of an HSDP mesh, say).

The assignment is a pure function of the replicated tensors' names and sizes and the group, so
every rank computes the same one without talking to the others.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: elements sampled per tensor for the divergence check (fixed positions, spread over the tensor)
SAMPLE_ELEMENTS = 64


@dataclass(frozen=True)
class Replica:
    index: int
    name: str
    owner: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    sample: str = ""


@dataclass(frozen=True)
class Plan:
    """Which tensors of a flattened state this rank saves, and the replicated ones of the state."""

    #: indexes into the flat tensor list that this rank stages and sends, in order
    own: list[int]
    #: every replicated tensor, by flat index (owned by this rank or not)
    replicas: dict[int, Replica]

    @property
    def foreign(self) -> int:
        return sum(1 for i in self.replicas if i not in set(self.own))


def tensor_key(t: torch.Tensor) -> tuple[int, int]:
    return (t.data_ptr(), t.numel() * t.element_size())


def group_ranks(group: Any, world_size: int) -> tuple[int, ...]:
    """Global ranks of ``group``: a ProcessGroup, a sequence of ranks, or None (every rank)."""
    if group is None:
        return tuple(range(world_size))
    if isinstance(group, Sequence) and not isinstance(group, str | bytes):
        ranks = tuple(int(r) for r in group)
    else:
        ranks = tuple(dist.get_process_group_ranks(group))
    if len(set(ranks)) != len(ranks) or any(r < 0 or r >= world_size for r in ranks):
        raise ValueError(
            f"replica group {list(ranks)}: ranks must be distinct and below world size {world_size}"
        )
    return tuple(sorted(ranks))


def ddp_groups(objects: Iterable[Any], world_size: int) -> Iterator[tuple[tuple[int, ...], torch.nn.Module]]:
    """(group, wrapped module) of every DistributedDataParallel among ``objects``."""
    for obj in objects:
        if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
            yield group_ranks(obj.process_group, world_size), obj.module


def assign(sizes: dict[str, int], ranks: tuple[int, ...]) -> dict[str, int]:
    """Owner of each tensor (name -> size): largest first, each to the least loaded rank (lowest on a
    tie). Deterministic: every rank of the group computes the same map."""
    load = dict.fromkeys(ranks, 0)
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        owner = min(ranks, key=lambda r: (load[r], r))
        owners[name] = owner
        load[owner] += sizes[name]
    return owners


def plan(
    tensors: list[tuple[str, torch.Tensor]],
    groups: dict[tuple[int, int], tuple[int, ...]],
    rank: int,
) -> Plan:
    """The plan for ``tensors`` (flattened state) given which tensor keys are replicated across
    which groups. A group this rank is not in is refused (the declaration is wrong)."""
    by_group: dict[tuple[int, ...], dict[str, int]] = {}
    index_of: dict[str, int] = {}
    for i, (name, t) in enumerate(tensors):
        ranks = groups.get(tensor_key(t)) if t.numel() else None
        if ranks is None or len(ranks) < 2:
            continue
        if rank not in ranks:
            raise ValueError(
                f"{name}: declared replicated across ranks {list(ranks)}, which exclude this rank {rank}"
            )
        by_group.setdefault(ranks, {})[name] = t.numel() * t.element_size()
        index_of[name] = i
    replicas: dict[int, Replica] = {}
    for ranks, sizes in by_group.items():
        for name, owner in assign(sizes, ranks).items():
            i = index_of[name]
            t = tensors[i][1]
            replicas[i] = Replica(i, name, owner, t.dtype, tuple(t.shape), sizes[name])
    own = [i for i in range(len(tensors)) if i not in replicas or replicas[i].owner == rank]
    return Plan(own, replicas)


def sample_digests(tensors: list[torch.Tensor], step: int = 0) -> list[str]:
    """crc32 of up to SAMPLE_ELEMENTS elements of each tensor, spread over it, starting at an offset
    that moves with ``step`` (every rank samples the same positions at a step, and successive saves
    look at different ones). Contiguous host tensors are sampled through numpy views (no torch op
    per tensor); others take one small gather per tensor and one host transfer per device. Equal
    tensors give equal digests either way."""
    out = [""] * len(tensors)
    samples: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        t = t.detach()
        n = t.numel()
        stride = max(1, n // SAMPLE_ELEMENTS)
        start = step % stride
        if t.device.type == "cpu" and t.is_contiguous() and n:
            rows = t.reshape(-1).view(torch.uint8).numpy().reshape(n, t.element_size())
            out[i] = f"{zlib.crc32(rows[start::stride][:SAMPLE_ELEMENTS].tobytes()):08x}"
            continue
        picked = t.reshape(-1)[start::stride][:SAMPLE_ELEMENTS].contiguous()
        samples.setdefault(picked.device, []).append((i, picked.view(torch.uint8)))
    for device_samples in samples.values():
        joined = torch.cat([s for _, s in device_samples]).cpu().numpy()
        pos = 0
        for i, s in device_samples:
            out[i] = f"{zlib.crc32(joined[pos : pos + s.numel()].tobytes()):08x}"
            pos += s.numel()
    return out
