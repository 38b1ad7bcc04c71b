"""Data loaders and the random streams of a resumed run.

Creating a DataLoader iterator draws from the global torch generator (the workers' base seed,
unless the loader has its own ``generator``). An uninterrupted run drew it when the epoch began,
before the saved step; a resumed run would draw it again after the RNG restore, and every random
number after that (dropout, augmentations) would differ. :func:`after_restore` (called by
``CheckpointClient.restore`` after the RNG restore) arms each torchdata ``StatefulDataLoader``
that got a state so that the iterator applying that state (created by the loop's next
``iter()``, after its ``set_epoch``) is built with the global streams kept as they are: it draws
nothing. A loader whose state is at an epoch's end then starts its next epoch with a fresh
iterator, drawn as the uninterrupted run drew it there. ``ResumableLoader`` does the same for plain
DataLoaders by itself (trainer_client.data).

:func:`check` (called at a client's first save) logs, once, each loader setup whose resume
cannot be made exact, with the fix.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

try:
    import numpy as np
except ModuleNotFoundError:  # pragma: no cover - torch runs without numpy
    np = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

__all__ = ["after_restore", "check", "kept_global_rng"]


@contextmanager
def kept_global_rng() -> Iterator[None]:
    """Run the body without moving the global Python, numpy and torch CPU generators."""
    py = random.getstate()
    cpu = torch.get_rng_state()
    npy = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        random.setstate(py)
        torch.set_rng_state(cpu)
        if np is not None:
            np.random.set_state(npy)


def _walk(obj: Any, seen: set[int] | None = None) -> Iterator[Any]:
    """``obj`` and everything nested in its mappings, lists and tuples."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    if isinstance(obj, Mapping):
        for value in obj.values():
            yield from _walk(value, seen)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _walk(value, seen)


def _stateful_loader_type() -> Any:
    # Without torchdata imported, no StatefulDataLoader can exist: do not import it here.
    module = sys.modules.get("torchdata.stateful_dataloader")
    return getattr(module, "StatefulDataLoader", None) if module is not None else None


def after_restore(state: Mapping[str, Any]) -> None:
    """Make the next ``iter()`` of every StatefulDataLoader in ``state`` that holds a loaded
    state draw what the uninterrupted run drew at that point: nothing mid-epoch, the next
    epoch's draws after an epoch's end. Call after the RNG restore."""
    kind = _stateful_loader_type()
    if kind is None:
        return
    for obj in _walk(state):
        if isinstance(obj, kind) and getattr(obj, "next_iter_state", None) is not None:
            _prime(obj)


def _prime(loader: Any) -> None:
    """Make the loader's next ``_get_iterator()`` (the one that applies the loaded state, inside
    the user's ``iter()``, after their ``set_epoch``) leave the global streams alone; later
    iterators, a fresh epoch after an end-of-epoch state included, draw as usual."""
    if "_get_iterator" in vars(loader):
        return  # already armed by an earlier restore that no iter() consumed
    shared = loader.generator is not None and getattr(loader.sampler, "generator", None) is loader.generator
    original = loader._get_iterator

    def first() -> Any:
        del loader._get_iterator  # one shot
        with kept_global_rng():
            iterator = original()
        if shared and loader.num_workers == 0:
            # The single-process state holds the shared generator as the epoch's permutation
            # found it; loading it leaves the generator after the permutation, but the
            # uninterrupted run then drew the base seed from it too. (The multi-process state is
            # taken after that.)
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        return iterator

    loader._get_iterator = first


def _problems(state: Mapping[str, Any]) -> list[str]:
    from trainer_client.data import ResumableLoader  # data imports nothing of ours; no cycle

    objects = list(_walk(state))
    kept = {id(o) for o in objects if isinstance(o, torch.Generator)}
    kind = _stateful_loader_type()
    problems = []
    for obj in objects:
        if isinstance(obj, ResumableLoader):
            dl = obj.loader
            if dl.generator is not None and id(dl.generator) not in kept:
                problems.append(
                    "a ResumableLoader's DataLoader has its own generator, which is not in the "
                    "checkpointed state: the worker seeds after a resume differ; put the generator "
                    "in the state or drop generator="
                )
            if dl.persistent_workers and dl.num_workers > 0:
                problems.append(
                    "a ResumableLoader's DataLoader has persistent_workers=True: random numbers drawn "
                    "in its workers differ after a mid-epoch resume; use persistent_workers=False"
                )
        elif kind is not None and isinstance(obj, kind):
            sampler = obj.sampler
            if isinstance(sampler, RandomSampler):  # torchdata's own RandomSampler is no subclass
                problems.append(
                    "a StatefulDataLoader samples with torch's RandomSampler, which has no state: the "
                    "order after a resume differs; use shuffle=True or torchdata's RandomSampler"
                )
            shared = getattr(sampler, "generator", None) is obj.generator
            if obj.generator is not None and not shared and id(obj.generator) not in kept:
                problems.append(
                    "a StatefulDataLoader's generator is not in the checkpointed state: the worker "
                    "seeds after a resume differ; put it in the state or drop generator="
                )
            if obj.num_workers > 0:
                problems.append(
                    "random numbers drawn inside a StatefulDataLoader's workers (augmentations) restart "
                    "from the worker seed after a mid-epoch resume; draw them in the main process, or "
                    "use a plain DataLoader in a ResumableLoader, which seeds each batch"
                )
        elif isinstance(obj, DataLoader):
            problems.append(
                "a plain DataLoader in the state has no position to resume; wrap it in "
                "trainer_client.data.ResumableLoader"
            )
    return list(dict.fromkeys(problems))


def check(state: Mapping[str, Any]) -> None:
    """Log one warning naming the loader setups in ``state`` whose resume is not exact."""
    try:
        problems = _problems(state)
    except Exception as exc:  # a diagnostic must never fail a save
        log.debug("loader check failed: %s", exc)
        return
    if problems:
        log.warning(
            "resuming will not draw the random numbers of an uninterrupted run: %s", "; ".join(problems)
        )
