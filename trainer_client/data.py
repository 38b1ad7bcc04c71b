"""Data-reader state that resumes mid-epoch, at the same cut as the model.

``ResumableDistributedSampler`` is a drop-in for ``torch.utils.data.DistributedSampler`` (same
shards, padding and per-epoch permutation) that can continue an epoch where a checkpoint left it.
Which object to put in the checkpointed ``state``:

- a plain ``DataLoader``: wrap it in ``ResumableLoader`` and checkpoint the wrapper. It counts the
  batches handed to the training loop, so indices that worker prefetching pulled ahead of the
  loop are not counted as trained;
- a torchdata ``StatefulDataLoader``: checkpoint the loader itself (no wrapper). It snapshots the
  sampler's state_dict when it draws each batch's indices and hands out that snapshot once the
  batch reaches the loop, so it is exact with any ``num_workers``.

Checkpointing a bare sampler is exact only when nothing reads ahead (``num_workers=0``): it counts
the indices it has yielded (once wrapped in a ResumableLoader it reports the wrapper's count, so
either may be checkpointed). The state is plain ints and JSON-encodes::

    {"epoch": 3, "seed": 0, "consumed_samples": 4096, "num_replicas": 8, "dataset_len": 100000}

Usage with a plain DataLoader::

    from torch.utils.data import DataLoader
    from trainer_client import CheckpointClient
    from trainer_client.data import ResumableDistributedSampler, ResumableLoader

    # rank and world size: torch.distributed if initialized, else RANK / WORLD_SIZE
    sampler = ResumableDistributedSampler(dataset, seed=1234)
    loader = ResumableLoader(DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=4))
    state = {"model": model, "opt": opt, "data": loader}
    client = CheckpointClient()
    step = client.resume(state) or 0  # restores the epoch and the position within it
    for epoch in range(loader.epoch, num_epochs):
        loader.set_epoch(epoch)  # the checkpoint's epoch continues after its last trained batch
        for batch in loader:
            train(batch)
            step += 1
            if step % 100 == 0:
                client.save(step, state)

Epochs: ``set_epoch`` to another epoch starts it at its first sample. A checkpoint taken after an
epoch's last batch (inside the loop or after it) makes passes over that epoch empty until
``set_epoch`` selects another, so resuming with either that epoch or the next one is right.
``load_state_dict`` adopts the checkpoint's epoch unless ``set_epoch`` was called after the last
pass began (StatefulDataLoader applies its state lazily, inside ``iter()``, after your
``set_epoch``: your epoch wins there, and the saved position applies only to the same epoch, so
keep your own epoch counter in the state, e.g. ``{"epoch": epoch, "data": stateful_loader}``).

Random numbers: a resumed run draws those of the uninterrupted run. ``iter(DataLoader)`` draws the
workers' base seed from the global torch generator (or the loader's ``generator``), which the
uninterrupted run did when the epoch began, before the saved step. A ResumableLoader makes that
draw itself, as the DataLoader would, as each pass's seed, and records it in its state
(``base_seed``); a pass that continues a loaded epoch reuses it and draws nothing, and the empty
pass over an epoch that the checkpoint ended draws nothing either. With ``num_workers > 0`` it
also seeds each worker's Python, numpy and torch generators before every batch from (pass seed,
batch position), so worker-side randomness (augmentations) matches after a mid-epoch resume
too. For a StatefulDataLoader (default ``generator=None`` or its own one shared with the
sampler) ``CheckpointClient.restore`` creates the loaded iterator without touching the global
streams. Exact: both, ``num_workers`` 0 or more, mid-epoch or at an epoch's end, and every epoch
after. Not exact (logged once, at the first save, with the fix): a ResumableLoader with
``persistent_workers=True`` (worker-side draws), a loader ``generator`` not itself in the state,
a StatefulDataLoader's worker-side draws (its workers restart from their seed) or one sampling
with torch's stateless ``RandomSampler``. A plain DataLoader not in the state is invisible to the
client: wrap it.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, Sampler

from trainer_client._loaders import kept_global_rng

try:
    import numpy as np
except ModuleNotFoundError:  # torch runs without numpy
    np = None  # type: ignore[assignment]

__all__ = ["ResumableDistributedSampler", "ResumableLoader"]

_KEYS = ("epoch", "seed", "consumed_samples", "num_replicas", "dataset_len")


def _world() -> tuple[int, int]:
    """(num_replicas, rank): torch.distributed if initialized, else WORLD_SIZE/RANK, else (1, 0)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


class ResumableDistributedSampler(Sampler[int]):
    """DistributedSampler that resumes mid-epoch.

    Yields this rank's indices of ``epoch``: a permutation of ``range(len)`` seeded with
    ``seed + epoch`` (or the identity without ``shuffle``), padded by repetition to a multiple of
    ``num_replicas`` (or truncated with ``drop_last``), every ``num_replicas``-th from ``rank``,
    exactly as torch's DistributedSampler. A pass starts at the loaded position when its epoch
    is the checkpoint's, else at 0. ``len()`` is the number of samples per replica and epoch.
    """

    def __init__(
        self,
        dataset_or_len: Sized | int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        n = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        if n < 0:
            raise ValueError(f"dataset length must be >= 0, got {n}")
        if num_replicas is None or rank is None:
            world, this = _world()
            num_replicas = world if num_replicas is None else num_replicas
            rank = this if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas - 1}]")
        self.dataset_len = n
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        if drop_last and n % num_replicas != 0:
            self.num_samples = max(0, math.ceil((n - num_replicas) / num_replicas))
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.epoch = 0
        self._epoch_announced = False  # set_epoch() called since the last pass began
        self._resume: tuple[int, int] | None = None  # loaded (epoch, position), not yet used by a pass
        self._pass_epoch: int | None = None  # epoch of the latest pass
        self._yielded = 0  # position of the latest pass: indices handed out, counted from the epoch's start
        self._consumed: int | None = None  # position as a ResumableLoader counts it, when wrapped

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next pass (and its permutation), as DistributedSampler does."""
        self.epoch = int(epoch)
        self._epoch_announced = True

    def indices(self, epoch: int) -> list[int]:
        """This rank's full index list for ``epoch``."""
        n = self.dataset_len
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order: list[int] = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.drop_last:
            order = order[: self.total_size]
        elif (pad := self.total_size - n) > 0:
            order += (order * math.ceil(pad / n))[:pad]
        return order[self.rank : self.total_size : self.num_replicas]

    def _next_start(self) -> int:
        """Where the next pass starts: the loaded position if it belongs to this epoch, else 0."""
        if self._resume is not None and self._resume[0] == self.epoch:
            return self._resume[1]
        return 0

    def __iter__(self) -> Iterator[int]:
        # A generator: the pass (and the loaded position it uses up) begins at the first next(),
        # so iterators that a DataLoader creates and drops unused change nothing.
        start = self._next_start()
        if start < self.num_samples:  # a checkpoint at an epoch's end keeps that epoch empty
            self._resume = None
        self._epoch_announced = False
        self._pass_epoch = self.epoch
        self._yielded = start
        if self._consumed is not None:
            self._consumed = start
        for index in self.indices(self.epoch)[start:]:
            self._yielded += 1
            yield index

    def _position(self) -> int:
        if self._resume is not None or self._pass_epoch != self.epoch:
            return self._next_start()
        return self._yielded if self._consumed is None else self._consumed

    def state_dict(self) -> dict[str, Any]:
        """The epoch and how far into it this rank is (see the module docstring for what counts)."""
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "consumed_samples": self._position(),
            "num_replicas": self.num_replicas,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next pass; refuse one saved with another world size,
        seed or dataset length (it would skip or repeat samples)."""
        if not isinstance(state, dict) or set(state) != set(_KEYS):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"sampler state: expected keys {sorted(_KEYS)}, got {got}")
        for key in _KEYS:
            if type(state[key]) is not int:
                raise ValueError(f"sampler state: {key} must be an int, got {state[key]!r}")
        for key in ("num_replicas", "seed", "dataset_len"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]} but this sampler has "
                    f"{key}={getattr(self, key)}; resuming would skip or repeat samples"
                )
        consumed = state["consumed_samples"]
        if not 0 <= consumed <= self.num_samples:
            raise ValueError(f"sampler state: consumed_samples={consumed} is not in [0, {self.num_samples}]")
        if not self._epoch_announced:
            self.epoch = state["epoch"]
        self._resume = (state["epoch"], consumed)


class ResumableLoader:
    """A plain DataLoader over a ResumableDistributedSampler, checkpointed by what the loop consumed.

    Iterating yields the DataLoader's batches and counts each one as consumed when it is handed
    to the loop, whatever the workers have prefetched. ``state_dict()`` / ``load_state_dict()``
    are the sampler's, with that count as the position; after a load, the next pass starts right
    after the last consumed sample. Batches must be consecutive runs of the sampler's indices
    (``batch_size=N`` or a ``BatchSampler`` over the sampler, or ``batch_size=None``) returned in
    order (``in_order=True``, the default).
    """

    def __init__(self, loader: DataLoader[Any]) -> None:
        if callable(getattr(loader, "state_dict", None)):
            raise TypeError(
                f"{type(loader).__name__} checkpoints its own position; put it in the state directly"
            )
        batch_sampler = loader.batch_sampler
        sampler: object
        if batch_sampler is None:
            sampler, self._batch_size = loader.sampler, 1
        elif isinstance(batch_sampler, BatchSampler):
            sampler, self._batch_size = batch_sampler.sampler, batch_sampler.batch_size
        else:
            raise TypeError(f"cannot count samples per batch of a {type(batch_sampler).__name__}")
        if not isinstance(sampler, ResumableDistributedSampler):
            raise TypeError(
                f"the DataLoader's sampler is a {type(sampler).__name__}, not a ResumableDistributedSampler"
            )
        if not getattr(loader, "in_order", True):
            raise ValueError("in_order=False returns batches out of order; the consumed ones are no prefix")
        self.loader = loader
        self.sampler = sampler
        sampler._consumed = sampler._position()
        self._generation = 0  # bumped by load_state_dict: older iterators stop counting
        self._seed: int | None = None  # seed of the pass that produced the position (see __iter__)
        self._seed_loaded = False  # _seed came from a loaded state

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches in a full epoch (a resumed pass yields fewer)."""
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        start = self.sampler._next_start()
        self.sampler._consumed = start
        dl = self.loader
        persistent = dl.persistent_workers and dl.num_workers > 0
        if persistent and getattr(dl, "_iterator", None) is not None:
            return _Pass(self, iter(dl), start)  # torch reuses the workers: nothing is drawn
        # The pass seed: drawn as the DataLoader draws its base seed (same generator, same draw),
        # so the global stream moves as without the wrapper. A pass that continues a loaded
        # epoch (start > 0) was begun before the save, its draw already made: it reuses the
        # saved seed and draws nothing; so does a new persistent iterator after a load.
        if start > 0 or (persistent and self._seed_loaded):
            seed = self._seed
            if seed is None:  # a state without one (older, or the bare sampler's): keep the streams
                with kept_global_rng():
                    seed = _draw_seed(dl.generator)
        else:
            seed = _draw_seed(dl.generator)
        self._seed, self._seed_loaded = seed, False
        generator = torch.Generator()
        generator.manual_seed(seed)
        saved = dl.generator, dl.worker_init_fn, dl.collate_fn
        dl.generator = generator  # the DataLoader's base seed: a function of the pass seed
        if dl.num_workers > 0 and not persistent:
            seeds = _BatchSeeds(seed, start // self._batch_size, dl.worker_init_fn, dl.collate_fn)
            dl.worker_init_fn, dl.collate_fn = seeds.init, seeds.collate
        try:
            it = iter(dl)
        finally:
            dl.generator, dl.worker_init_fn, dl.collate_fn = saved
        return _Pass(self, it, start)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state, plus the pass seed once a pass began (``base_seed``)."""
        state = self.sampler.state_dict()
        if self._seed is not None:
            state["base_seed"] = self._seed
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The sampler's ``load_state_dict``; a state without ``base_seed`` (older ones, a bare
        sampler's) loads too."""
        seed = None
        if isinstance(state, dict) and "base_seed" in state:
            state = dict(state)
            seed = state.pop("base_seed")
            if type(seed) is not int or not 0 <= seed < 2**63:
                raise ValueError(f"loader state: base_seed must be an int in [0, 2**63), got {seed!r}")
        self.sampler.load_state_dict(state)
        self._seed, self._seed_loaded = seed, seed is not None
        self._generation += 1


def _draw_seed(generator: torch.Generator | None) -> int:
    """The draw ``iter(DataLoader)`` makes for its base seed."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


class _BatchSeeds:
    """Seeds every worker's Python, numpy and torch generators before each batch from (pass
    seed, the batch's position in the epoch), so a pass resumed mid-epoch draws in its workers
    what the interrupted one drew for the same batches. Batches go to the workers in turn
    (``in_order=True``): worker w of W gets the pass's batches w, w + W, ..."""

    def __init__(self, seed: int, first_batch: int, init_fn: Any, collate_fn: Any) -> None:
        self.seed = seed
        self.next_batch = first_batch
        self.stride = 1
        self.init_fn = init_fn
        self.collate_fn = collate_fn

    def init(self, worker_id: int) -> None:  # in the worker, once
        if self.init_fn is not None:
            self.init_fn(worker_id)
        info = torch.utils.data.get_worker_info()
        assert info is not None
        self.next_batch += info.id
        self.stride = info.num_workers
        self._reseed()

    def collate(self, data: Any) -> Any:  # in the worker, after each batch's samples
        out = self.collate_fn(data)
        self.next_batch += self.stride
        self._reseed()
        return out

    def _reseed(self) -> None:
        digest = hashlib.blake2b(f"{self.seed}/{self.next_batch}".encode(), digest_size=16).digest()
        random.seed(digest)
        torch.manual_seed(int.from_bytes(digest[:8], "little"))
        if np is not None:
            np.random.seed([int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)])


class _Pass(Iterator[Any]):
    def __init__(self, owner: ResumableLoader, it: Iterator[Any], start: int) -> None:
        self._owner = owner
        self._it = it
        self._start = start
        self._batches = 0
        self._generation = owner._generation

    def __next__(self) -> Any:
        if self._generation != self._owner._generation:
            raise RuntimeError("state was loaded after this pass began; start a new pass with iter()")
        sampler = self._owner.sampler
        try:
            batch = next(self._it)
        except StopIteration:
            sampler._consumed = sampler.num_samples  # the rest, if any, was a dropped partial batch
            raise
        self._batches += 1
        sampler._consumed = min(self._start + self._batches * self._owner._batch_size, sampler.num_samples)
        return batch
