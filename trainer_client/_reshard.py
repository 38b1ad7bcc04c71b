"""Why a checkpoint saved by N ranks cannot load on M: the per-rank values and data readers a
resharded restore cannot split, named with the fix."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from trainer_client import _tree


def not_reshardable(
    what: str,
    world: int,
    per_rank: list[tuple[Any, ...]],
    differ: list[tuple[Any, ...]],
    readers: list[tuple[tuple[Any, ...], str]],
) -> str:
    """Why a step saved by another number of ranks cannot be restored here, and what to do."""

    def named(paths: list[tuple[Any, ...]]) -> str:
        shown = ", ".join(_tree.where(p) for p in paths[:8])
        return shown + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")

    parts = []
    if per_rank:
        parts.append(
            f"tensors each rank saved for itself (not declared replicated), which cannot be split "
            f"or joined: {named(per_rank)}"
        )
    if differ:
        parts.append(f"values that differ between the {world} ranks: {named(differ)}")
    if readers:
        parts.append(
            "data readers whose state is this rank's own position: "
            + ", ".join(f"{_tree.where(p)} ({kind})" for p, kind in readers)
        )
    fix = (
        "declare replicated tensors with client.replicate(...) (DDP wrappers in the state need no "
        "declaration), save DTensor/FSDP2 state through torch.distributed.checkpoint with "
        "trainer_client.dcp's StrataWriter (StrataReader reshards it), or keep the job at "
        f"{world} ranks"
    )
    if readers:
        fix += (
            "; put each data reader in the state as trainer_client.data.AllRanksState(reader) (every "
            "rank's position as one value, a collective at each save): the rest of the epoch is then "
            "partitioned over the new ranks"
        )
    return f"{what}. A resharded restore needs state that every rank saved alike; this one holds " + (
        "; ".join(parts) + f". To resume on another number of ranks: {fix}"
    )


#: Data readers whose state_dict() is one rank's position (trainer_client.data, torchdata)
READERS = ("ResumableDistributedSampler", "ResumableLoader", "StatefulDataLoader")


def per_rank_readers(node: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], str]]:
    """(path, type name) of the data readers in the live state that save one rank's position
    (not wrapped in ``AllRanksState``, whose value is every rank's). Subclasses too: matched by
    name along the class's MRO (TorchRec or torchdata need not be imported)."""
    if any(c.__name__ in READERS for c in type(node).__mro__):
        yield path, type(node).__name__
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from per_rank_readers(v, (*path, k))
    elif isinstance(node, list | tuple):
        for i, v in enumerate(node):
            yield from per_rank_readers(v, (*path, i))
