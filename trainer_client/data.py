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

Another number of ranks: a per-rank state is refused (the others' progress is missing). Checkpoint
``AllRanksState(loader)`` instead (every rank's state as one replicated value, for
``torch.distributed.checkpoint``): loaded on M ranks, the samples of the epoch that no rank had read
are partitioned over the M ranks, so each is still read once (docs/guides/dcp.md).

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
keep your own epoch counter in the state, e.g. ``{"epoch": epoch, "data": stateful_loader}``, or
compute it from the restored step). A StatefulDataLoader that ``CheckpointClient`` saves and
restores follows the same rule with any sampler that has epochs, torchdata's
StatefulDistributedSampler included (trainer_client._loaders).

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
import json
import math
import os
import random
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, Sampler

from trainer_client._rng import kept_global_rng

try:
    import numpy as np
except ModuleNotFoundError:  # torch runs without numpy
    np = None  # type: ignore[assignment]

__all__ = ["AllRanksState", "ResumableDistributedSampler", "ResumableLoader"]

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
        self.epoch = 0
        #: (epoch, stages): the earlier partitions of a loaded epoch that other numbers of ranks
        #: read part of (see _remaining); the epoch's rest is partitioned over this sampler's ranks
        self._reshard: tuple[int, tuple[tuple[int, tuple[int, ...]], ...]] | None = None
        self._epoch_announced = False  # set_epoch() called since the last pass began
        self._resume: tuple[int, int] | None = None  # loaded (epoch, position), not yet used by a pass
        self._pass_epoch: int | None = None  # epoch of the latest pass
        self._yielded = 0  # position of the latest pass: indices handed out, counted from the epoch's start
        self._consumed: int | None = None  # position as a ResumableLoader counts it, when wrapped

    @property
    def num_samples(self) -> int:
        """This rank's samples in the current epoch (fewer in an epoch re-partitioned after
        other ranks read part of it)."""
        return self._samples(self.epoch)

    @property
    def total_size(self) -> int:
        return self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def _stages(self, epoch: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
        return self._reshard[1] if self._reshard is not None and self._reshard[0] == epoch else ()

    def _samples(self, epoch: int) -> int:
        n = self.dataset_len
        for replicas, consumed in self._stages(epoch):
            n = _remaining_len(n, replicas, consumed, self.drop_last)
        return _split(n, self.num_replicas, self.drop_last)[0]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next pass (and its permutation), as DistributedSampler does."""
        self.epoch = int(epoch)
        self._epoch_announced = True

    def indices(self, epoch: int) -> list[int]:
        """This rank's full index list for ``epoch`` (of a re-partitioned epoch: its share of the
        samples the earlier ranks had not read)."""
        n = self.dataset_len
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order: list[int] = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        for replicas, consumed in self._stages(epoch):
            order = _remaining(order, replicas, consumed, self.drop_last)
        total = _split(len(order), self.num_replicas, self.drop_last)[1]
        if self.drop_last:
            order = order[:total]
        elif (pad := total - len(order)) > 0:
            order += (order * math.ceil(pad / len(order)))[:pad]
        return order[self.rank : total : self.num_replicas]

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
        """The epoch and how far into it this rank is (see the module docstring for what counts);
        in an epoch re-partitioned after a change of world size, also ``reshards``: the earlier
        partitions, ``[[num_replicas, [consumed per rank]], ...]``."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "seed": self.seed,
            "consumed_samples": self._position(),
            "num_replicas": self.num_replicas,
            "dataset_len": self.dataset_len,
        }
        if stages := self._stages(self.epoch):
            state["reshards"] = [[replicas, list(consumed)] for replicas, consumed in stages]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next pass.

        ``state`` is this rank's own (what ``state_dict()`` returned on the same rank of the same
        number of ranks), or every rank's, ``{"ranks": [state of rank 0, ...]}`` (what
        :class:`AllRanksState` saves): saved by another number of ranks, the rest of the epoch
        (the samples no rank had read) is partitioned over this sampler's ranks, so each sample of
        the epoch is read once across the change (plus DistributedSampler's padding, or less its
        truncation with ``drop_last``). Refuses a per-rank state of another number of ranks
        (the others' progress is missing), another seed or dataset length."""
        if isinstance(state, dict) and set(state) == {"ranks"}:
            self._load_all(state["ranks"])
            return
        saved_by = state.get("num_replicas") if isinstance(state, dict) else None
        if type(saved_by) is int and saved_by != self.num_replicas:
            raise ValueError(
                f"sampler state was saved with num_replicas={state['num_replicas']} but this sampler has "
                f"num_replicas={self.num_replicas}; resuming would skip or repeat samples: to continue "
                "the epoch on another number of ranks, load every rank's state ({'ranks': [...]}, as "
                "trainer_client.data.AllRanksState saves it)"
            )
        state, stages = self._checked(state, "sampler state")
        self._apply(state["epoch"], stages, state["consumed_samples"])

    def _checked(
        self, state: Any, where: str
    ) -> tuple[dict[str, Any], tuple[tuple[int, tuple[int, ...]], ...]]:
        """``state`` validated against this sampler, and its earlier partitions."""
        if not isinstance(state, dict) or not set(_KEYS) <= set(state) <= {*_KEYS, "reshards"}:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"{where}: expected keys {sorted(_KEYS)} (and reshards), got {got}")
        for key in _KEYS:
            if type(state[key]) is not int:
                raise ValueError(f"{where}: {key} must be an int, got {state[key]!r}")
        for key in ("seed", "dataset_len"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]} but this sampler has "
                    f"{key}={getattr(self, key)}; resuming would skip or repeat samples"
                )
        if state["num_replicas"] < 1:
            raise ValueError(f"{where}: num_replicas must be >= 1, got {state['num_replicas']}")
        stages = []
        n = self.dataset_len
        raw = state.get("reshards", [])
        if not isinstance(raw, list) or (not raw and "reshards" in state):
            raise ValueError(f"{where}: reshards must be a non-empty list, got {raw!r}")
        for stage in raw:
            if (
                not isinstance(stage, list)
                or len(stage) != 2
                or type(stage[0]) is not int
                or stage[0] < 1
                or not isinstance(stage[1], list)
                or len(stage[1]) != stage[0]
                or any(type(c) is not int for c in stage[1])
            ):
                raise ValueError(f"{where}: a reshard is [num_replicas, [consumed per rank]], got {stage!r}")
            per = _split(n, stage[0], self.drop_last)[0]
            if any(not 0 <= c <= per for c in stage[1]):
                raise ValueError(f"{where}: reshard {stage!r}: a rank consumed more than its {per} samples")
            stages.append((stage[0], tuple(stage[1])))
            n = _remaining_len(n, stage[0], stage[1], self.drop_last)
        per = _split(n, state["num_replicas"], self.drop_last)[0]
        if not 0 <= state["consumed_samples"] <= per:
            raise ValueError(f"{where}: consumed_samples={state['consumed_samples']} is not in [0, {per}]")
        return state, tuple(stages)

    def _load_all(self, ranks: Any) -> None:
        if not isinstance(ranks, list) or not ranks:
            raise ValueError(f"sampler state: 'ranks' must be a non-empty list, got {type(ranks).__name__}")
        checked = [self._checked(s, f"sampler state of rank {r}") for r, s in enumerate(ranks)]
        first, stages = checked[0]
        for r, (s, st) in enumerate(checked):
            if s["num_replicas"] != len(ranks):
                raise ValueError(
                    f"sampler state of rank {r}: saved by num_replicas={s['num_replicas']}, "
                    f"but {len(ranks)} ranks' states were given"
                )
            if s["epoch"] != first["epoch"] or st != stages:
                raise ValueError(
                    f"sampler states of ranks 0 and {r} are of different epochs or partitions; "
                    "they were not saved at the same step"
                )
        if len(ranks) == self.num_replicas:  # the same ranks: this rank's own position
            self._apply(first["epoch"], stages, checked[self.rank][0]["consumed_samples"])
            return
        consumed = tuple(s["consumed_samples"] for s, _ in checked)
        if any(consumed) or self.drop_last:  # an untouched partition leaves the order as it was
            stages = (*stages, (len(ranks), consumed))
        self._apply(first["epoch"], stages, 0)

    def _apply(self, epoch: int, stages: tuple[tuple[int, tuple[int, ...]], ...], consumed: int) -> None:
        self._reshard = (epoch, stages) if stages else None
        if not self._epoch_announced:
            self.epoch = epoch
        self._resume = (epoch, consumed)


def _split(n: int, replicas: int, drop_last: bool) -> tuple[int, int]:
    """(samples per rank, total) of ``n`` samples over ``replicas`` ranks, as DistributedSampler
    splits them (padded up to a multiple of ``replicas``, or truncated with ``drop_last``)."""
    if drop_last and n % replicas != 0:
        per = max(0, math.ceil((n - replicas) / replicas))
    else:
        per = math.ceil(n / replicas)
    return per, per * replicas


def _remaining_len(n: int, replicas: int, consumed: Sequence[int], drop_last: bool) -> int:
    """``len(_remaining(...))`` of a sequence of ``n``, without it."""
    kept = min(n, _split(n, replicas, drop_last)[1])
    return kept - sum(min(c, len(range(r, kept, replicas))) for r, c in enumerate(consumed))


def _remaining(order: list[int], replicas: int, consumed: Sequence[int], drop_last: bool) -> list[int]:
    """The samples of ``order`` that no rank read, in order, when ``replicas`` ranks read it as
    DistributedSampler partitions it (rank r reads positions r, r + replicas, ...) and rank r
    read its first ``consumed[r]``. Padding positions are not samples of their own: their
    samples appear earlier in ``order``; samples a ``drop_last`` truncation dropped are gone."""
    kept = min(len(order), _split(len(order), replicas, drop_last)[1])
    return [order[p] for p in range(kept) if p // replicas >= consumed[p % replicas]]


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
        """The sampler's ``load_state_dict`` (this rank's state, or every rank's: see there); a
        state without ``base_seed`` (older ones, a bare sampler's) loads too. A pass over an
        epoch re-partitioned for another number of ranks draws a new pass seed."""
        seed = None
        if isinstance(state, dict) and set(state) == {"ranks"} and isinstance(state["ranks"], list):
            ranks = [_without_seed(s) for s in state["ranks"]]
            if len(ranks) == self.sampler.num_replicas:
                seed = ranks[self.sampler.rank][1]
            state = {"ranks": [s for s, _ in ranks]}
        else:
            state, seed = _without_seed(state)
        self.sampler.load_state_dict(state)
        self._seed, self._seed_loaded = seed, seed is not None
        self._generation += 1


class AllRanksState:
    """The data reader's state of every rank as one value, the same on every rank: what lets the
    rest of an epoch be re-partitioned when a checkpoint is loaded on another number of ranks.

    Put it in the state that ``torch.distributed.checkpoint`` saves and loads (with Strata's
    ``StrataWriter`` / ``StrataReader`` or DCP's own), in place of the reader::

        state = {"model": model_sd, "optim": optim_sd, "data": AllRanksState(loader)}
        dcp.save(state, storage_writer=StrataWriter(client), checkpoint_id=step)
        ...  # later, on any number of ranks:
        dcp.load(state, storage_reader=StrataReader(client))

    ``state_dict()`` gathers every rank's ``reader.state_dict()`` over ``group`` (default: the
    default process group; a collective, as ``dcp.save`` and ``dcp.load`` are): ``{"ranks":
    JSON of [rank 0's, rank 1's, ...]}``, a small replicated value DCP writes once (as one string:
    DCP would flatten a list into one entry per rank, and a load on fewer ranks would ask for
    fewer). ``load_state_dict``
    hands it to the reader: a ``ResumableDistributedSampler`` or ``ResumableLoader`` continues at
    this rank's own position when the number of ranks is the same, and otherwise partitions the
    samples no rank had read over the new ranks. A torchdata ``StatefulDataLoader`` loads its own
    rank's state on the same number of ranks; on another number it is refused (its position lives
    in its sampler's and workers' snapshots, which cannot be re-partitioned).
    """

    def __init__(self, reader: Any, group: Any = None) -> None:
        if not callable(getattr(reader, "state_dict", None)) or not callable(
            getattr(reader, "load_state_dict", None)
        ):
            raise TypeError(f"{type(reader).__name__} has no state_dict/load_state_dict to checkpoint")
        self.reader = reader
        self.group = group

    def _world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.group), dist.get_rank(self.group)
        return 1, 0

    def state_dict(self) -> dict[str, Any]:
        mine = self.reader.state_dict()
        try:
            json.dumps(mine, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"the {type(self.reader).__name__}'s state is not plain JSON values: {exc}"
            ) from None
        world, _ = self._world()
        ranks: list[Any] = [mine]
        if world > 1:
            ranks = [None] * world
            dist.all_gather_object(ranks, mine, group=self.group)
        return {"ranks": json.dumps(ranks, separators=(",", ":"), allow_nan=False)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ranks = state.get("ranks") if isinstance(state, dict) else None
        if isinstance(ranks, str):
            try:
                ranks = json.loads(ranks)
            except ValueError as exc:
                raise ValueError(f"data reader state: 'ranks' is not JSON ({exc})") from None
        if not isinstance(ranks, list) or not ranks:
            raise ValueError("data reader state: expected {'ranks': JSON of [state of each rank]}")
        if isinstance(self.reader, ResumableDistributedSampler | ResumableLoader):
            self.reader.load_state_dict({"ranks": ranks})
            return
        world, rank = self._world()
        if len(ranks) != world:
            raise ValueError(
                f"the {type(self.reader).__name__}'s state was saved by {len(ranks)} ranks and cannot "
                f"be re-partitioned over {world}: its position lives in its sampler's and workers' "
                "snapshots. Resume on the same number of ranks, or read with a plain DataLoader over "
                "trainer_client.data.ResumableDistributedSampler wrapped in a ResumableLoader"
            )
        self.reader.load_state_dict(ranks[rank])


def _without_seed(state: Any) -> tuple[Any, int | None]:
    """A loader state as the sampler's, and its ``base_seed``."""
    if not isinstance(state, dict) or "base_seed" not in state:
        return state, None
    state = dict(state)
    seed = state.pop("base_seed")
    if type(seed) is not int or not 0 <= seed < 2**63:
        raise ValueError(f"loader state: base_seed must be an int in [0, 2**63), got {seed!r}")
    return state, seed


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
