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

The usual epoch loop (``sampler.set_epoch(epoch)``, then ``for batch in loader``) with a sampler
that has epochs (torch's or torchdata's DistributedSampler, ResumableDistributedSampler): a
StatefulDataLoader's state names no epoch, and torchdata applies a loaded position to whatever
epoch the sampler is at. :func:`track` makes each such loader's ``state_dict()`` record the epoch
of its pass (``strata_epoch``); the iterator that applies a loaded state then continues the pass
only when the loop's ``set_epoch`` selected that epoch (an empty pass if it had ended), and
otherwise starts the selected epoch fresh, drawing what the uninterrupted run drew for it. A
loaded state's ``state_dict()`` is that state until an ``iter()`` applies it: building the
iterator earlier (for the client's first look at the state's layout) would draw its indices
before the loop's ``set_epoch``.

:func:`check` (called at a client's first save) logs, once, each loader setup whose resume
cannot be made exact, with the fix.
"""

from __future__ import annotations

import copyreg
import logging
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from trainer_client._rng import kept_global_rng
from trainer_client._state import found, walk
from trainer_client.data import ResumableDistributedSampler, ResumableLoader

log = logging.getLogger(__name__)

__all__ = ["after_restore", "check", "track"]

#: the key a tracked StatefulDataLoader's state records its pass's epoch under
EPOCH_KEY = "strata_epoch"
_FINISHED = "_iterator_finished"  # torchdata's: the saved pass had ended (its loop exited)


def _stateful_loader_type() -> Any:
    # Without torchdata imported, no StatefulDataLoader can exist: do not import it here.
    module = sys.modules.get("torchdata.stateful_dataloader")
    return getattr(module, "StatefulDataLoader", None) if module is not None else None


def _stateful_loaders(state: Mapping[str, Any]) -> Iterator[Any]:
    kind = _stateful_loader_type()
    if kind is not None:
        yield from found(state, kind)


#: what tracking replaces: a subclass that overrides any of them is left as it is
_TRACKED_METHODS = ("__iter__", "_get_iterator", "state_dict", "load_state_dict")
_UNTRACKED: set[type] = set()


def track(state: Mapping[str, Any]) -> None:
    """Make the StatefulDataLoaders in ``state`` record their pass's epoch in their state and
    apply a loaded one by the epoch the loop selects (see the module docstring). Idempotent."""
    for loader in _stateful_loaders(state):
        _track(loader)


def after_restore(state: Mapping[str, Any]) -> None:
    """Make the next ``iter()`` of every StatefulDataLoader in ``state`` that holds a loaded
    state draw what the uninterrupted run drew at that point: nothing when it continues the
    saved pass, the epoch's draws when it starts one. Call after the RNG restore."""
    for loader in _stateful_loaders(state):
        if getattr(loader, "next_iter_state", None) is not None:
            _track(loader)
            loader._strata_armed = True  # the iterator that applies it keeps the restored streams


def _track(loader: Any) -> None:
    kind = type(loader)
    if kind in _TRACKED.values():
        return
    base = _stateful_loader_type()
    if any(getattr(kind, m) is not getattr(base, m) for m in _TRACKED_METHODS):
        # A subclass with its own state (or iteration) keeps it as it wrote it: what it saves
        # is its own shape, which the epoch bookkeeping here must not replace.
        if kind not in _UNTRACKED:
            _UNTRACKED.add(kind)
            log.warning(
                "%s overrides StatefulDataLoader's %s: its state is saved as it writes it, and a "
                "resume in another epoch than the checkpoint's follows its own set_epoch handling",
                kind.__qualname__,
                "/".join(m for m in _TRACKED_METHODS if getattr(kind, m) is not getattr(base, m)),
            )
        return
    tracked = _TRACKED.get(kind)
    if tracked is None:
        # A subclass (not methods patched onto the loader, which would make cycles that keep
        # a dropped loader's workers alive until a collection), named as the loader's class:
        # checkpoints record the same type, and type checks agree.
        tracked = _TRACKED[kind] = type(
            kind.__name__,
            (kind,),
            {
                "__module__": kind.__module__,
                "__qualname__": kind.__qualname__,
                "__iter__": _iter,
                "_get_iterator": _get_iterator,
                "state_dict": _state_dict,
                "__reduce_ex__": _reduce_ex,
            },
        )
    loader._strata_armed = False  # the next _get_iterator keeps the global streams
    loader._strata_pass_epoch = None  # the epoch the latest iter() began its pass at
    loader.__class__ = tracked


_TRACKED: dict[type, type] = {}  # a StatefulDataLoader class -> its tracked subclass


def _epoch(loader: Any, saved: int | None = None) -> int | None:
    """The epoch the loader's sampler is at, if it has epochs (``set_epoch``); ``saved`` for a
    ResumableDistributedSampler that no ``set_epoch`` told otherwise (it adopts a loaded one)."""
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        epoch = getattr(sampler, "epoch", None)
        if callable(getattr(sampler, "set_epoch", None)) and isinstance(epoch, int):
            adopts = isinstance(sampler, ResumableDistributedSampler) and not sampler._epoch_announced
            return saved if adopts and saved is not None else epoch
    return None


def _reduce_ex(loader: Any, protocol: Any) -> Any:
    """Pickled (and copied) as the loader's own class: pickle finds a class by its name, which
    names that one."""
    func, args, *rest = super(type(loader), loader).__reduce_ex__(protocol)
    if args and args[0] is type(loader):
        # pickle refuses copyreg.__newobj__ of a class that is not the object's
        if func is copyreg.__newobj__:  # type: ignore[attr-defined]
            func = _new
        args = (type(loader).__mro__[1], *args[1:])
    return (func, args, *rest)


def _new(cls: type, *args: Any) -> Any:
    return cls.__new__(cls, *args)


def _iter(loader: Any) -> Any:
    iterator = super(type(loader), loader).__iter__()
    loader._strata_pass_epoch = _epoch(loader)
    return iterator


def _get_iterator(loader: Any) -> Any:
    """Apply a loaded state by the selected epoch; keep the streams when it continues."""
    armed, loader._strata_armed = loader._strata_armed, False
    state = loader.next_iter_state
    if state is not None and EPOCH_KEY in state:
        saved = state[EPOCH_KEY]
        state = {k: v for k, v in state.items() if k != EPOCH_KEY}
        epoch = _epoch(loader, saved)
        if epoch is not None and saved != epoch:
            state = None  # another epoch: the uninterrupted run began it fresh
        elif state.get(_FINISHED):
            # The same epoch, its pass ended: an empty pass (the state's sampler position is
            # its end), not torchdata's fresh one, which would read the epoch again.
            state[_FINISHED] = False
        loader.next_iter_state = state
    base: Any = super(type(loader), loader)
    # Persistent workers: the uninterrupted run made its one iterator (and drew for it) before
    # the saved step, and began later epochs on it drawing nothing.
    persistent = loader.persistent_workers and loader.num_workers > 0
    if not armed or (state is None and not persistent):
        return base._get_iterator()
    generator = loader.generator
    shared = generator is not None and getattr(loader.sampler, "generator", None) is generator
    with kept_global_rng():
        iterator = base._get_iterator()
    if shared and loader.num_workers == 0:
        # The single-process state holds the shared generator as the epoch's permutation
        # found it; loading it leaves the generator after the permutation, but the
        # uninterrupted run then drew the base seed from it too. (The multi-process state is
        # taken after that.)
        torch.empty((), dtype=torch.int64).random_(generator=generator)
    return iterator


def _state_dict(loader: Any) -> dict[str, Any]:
    """The loader's state with its pass's epoch; a loaded state no ``iter()`` applied yet is
    returned as it is (building its iterator here would draw its indices and seeds before the
    loop's ``set_epoch``)."""
    if loader._iterator is None and loader.next_iter_state is not None:
        return dict(loader.next_iter_state)
    state: dict[str, Any] = super(type(loader), loader).state_dict()
    epoch = loader._strata_pass_epoch if loader._iterator is not None else None
    epoch = _epoch(loader) if epoch is None else epoch
    if epoch is not None:
        state[EPOCH_KEY] = epoch
    return state


def _problems(state: Mapping[str, Any]) -> list[str]:
    objects = list(walk(state))
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
