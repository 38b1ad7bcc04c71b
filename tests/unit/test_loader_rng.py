"""A run resumed from a checkpoint draws, after the resume, the random numbers the uninterrupted
run drew: dropout in the main process, augmentations in the workers, the next epochs' orders and
seeds. Each test runs the same training twice in this process, once straight through and once
saved at a step, rebuilt from scratch, loaded and continued, and compares bit for bit."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from trainer_client import _loaders, _rng
from trainer_client._tree import decode_skeleton, encode_skeleton, flatten, load_into
from trainer_client.data import ResumableDistributedSampler, ResumableLoader

N = 10  # samples
BATCH = 4  # 3 batches an epoch, the last one partial
EPOCHS = 3
PER_EPOCH = 3


class Features(Dataset[torch.Tensor]):
    """Sample i: a deterministic feature row, plus noise drawn where the sample is loaded when
    ``noisy`` (in a worker with num_workers > 0, else in the main process)."""

    def __init__(self, noisy: bool) -> None:
        self.noisy = noisy

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.linspace(-1.0, 1.0, 6) * (i + 1) / N
        return x + torch.rand(6) if self.noisy else x


class Run:
    """Model, optimizer and loader as a fresh process would build them."""

    def __init__(self, make_loader: Callable[[], Any], start: str = "state") -> None:
        #: where the loop starts after a resume: the epoch in the state ("state"), the one the
        #: restored step is in ("step"), or the state's epoch not advanced by a save after an
        #: epoch's loop ("kept": that epoch is entered again, and must be empty)
        self.start = start
        torch.manual_seed(0)  # the process's seed; a resumed process sets it again
        self.model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.loader = make_loader()
        self.state: dict[str, Any] = {"model": self.model, "opt": self.opt, "data": self.loader, "epoch": 0}
        self.batches: list[torch.Tensor] = []
        self.step = 0
        self.final_rng = torch.empty(0)

    def train_on(self, batch: torch.Tensor) -> None:
        self.batches.append(batch)
        self.step += 1
        self.opt.zero_grad()
        self.model(batch).square().mean().backward()
        self.opt.step()

    def train(self, stop_at: int | None = None, *, after_loop: bool = False) -> Any:
        """Train to the end, or return a checkpoint taken after step ``stop_at`` (after the
        epoch's loop ended, with ``after_loop``, when that step is an epoch's last)."""
        first = self.step // len(self.loader) if self.start == "step" else self.state["epoch"]
        for epoch in range(first, EPOCHS):
            self.state["epoch"] = epoch
            if isinstance(self.loader, ResumableLoader):
                self.loader.set_epoch(epoch)
            elif hasattr(getattr(self.loader, "sampler", None), "set_epoch"):
                self.loader.sampler.set_epoch(epoch)  # DistributedSampler: before iter(), as usual
            for batch in self.loader:
                self.train_on(batch)
                if self.step == stop_at and not after_loop:
                    return self.checkpoint()
            if self.step == stop_at:
                self.state["epoch"] = epoch if self.start == "kept" else epoch + 1
                return self.checkpoint()
        self.final_rng = torch.get_rng_state()
        return None

    def checkpoint(self) -> tuple[bytes, list[torch.Tensor], int]:
        """What the client sends: the skeleton and tensors of the state and the global RNG."""
        _loaders.track(self.state)  # as the client's first save does
        flat = flatten({**self.state, "rng": _rng.capture()})
        return encode_skeleton(flat.skeleton), [t.clone() for _, t in flat.tensors], self.step

    def resume(self, saved: tuple[bytes, list[torch.Tensor], int]) -> None:
        """What ``CheckpointClient.restore`` does with it."""
        skeleton, tensors, self.step = saved
        target = {**self.state, "rng": None}
        load_into(target, decode_skeleton(skeleton), tensors)
        self.state.update((k, v) for k, v in target.items() if k != "rng")
        _rng.restore(target["rng"])
        _loaders.after_restore(self.state)
        _loaders.track(self.state)


def compare(
    make_loader: Callable[[], Any], stop_at: int, *, after_loop: bool = False, start: str = "state"
) -> None:
    straight = Run(make_loader)
    straight.train()
    first = Run(make_loader, start)
    saved = first.train(stop_at, after_loop=after_loop)
    assert saved is not None
    resumed = Run(make_loader, start)  # a fresh process: everything rebuilt, then loaded
    resumed.resume(saved)
    resumed.train()
    got = first.batches + resumed.batches
    assert len(got) == len(straight.batches) == EPOCHS * PER_EPOCH
    for i, (a, b) in enumerate(zip(got, straight.batches, strict=True)):
        assert torch.equal(a, b), f"batch {i} differs"
    for (name, a), b in zip(resumed.model.named_parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} differs after the resume"
    # and the global stream ends where the uninterrupted run left it
    assert torch.equal(resumed.final_rng, straight.final_rng)


# mid-epoch (after the first and second batch of epoch 1) and at epoch 0's end (inside the loop
# and after it); every case then crosses at least one epoch boundary
STOPS = [(4, False), (5, False), (3, False), (3, True)]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("stop_at", "after_loop"), STOPS)
def test_stateful_dataloader_default(workers: int, stop_at: int, after_loop: bool) -> None:
    compare(
        lambda: StatefulDataLoader(Features(False), batch_size=BATCH, shuffle=True, num_workers=workers),
        stop_at,
        after_loop=after_loop,
    )


DISTRIBUTED = [(stateful, stop, after) for stateful in (False, True) for stop, after in STOPS]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("stateful_sampler", "stop_at", "after_loop"), DISTRIBUTED)
def test_stateful_dataloader_with_a_distributed_sampler_and_set_epoch(
    workers: int, stop_at: int, after_loop: bool, stateful_sampler: bool
) -> None:
    """The loaded state applies inside iter(), after the loop's set_epoch: the resumed epoch's
    order is that epoch's, not the sampler's construction-time one."""
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    kind = StatefulDistributedSampler if stateful_sampler else DistributedSampler

    def make() -> StatefulDataLoader:
        sampler = kind(Features(False), num_replicas=1, rank=0, shuffle=True, seed=1)
        return StatefulDataLoader(Features(False), batch_size=BATCH, sampler=sampler, num_workers=workers)

    compare(make, stop_at, after_loop=after_loop)


# "kept" differs from "step" only after a save that followed an epoch's loop
LOOPS = [("step", stop, after) for stop, after in [(5, False), (3, False), (3, True), (6, True)]] + [
    ("kept", 3, True),
    ("kept", 6, True),
]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("start", "stop_at", "after_loop"), LOOPS)
def test_the_loops_set_epoch_selects_what_a_stateful_loader_resumes(
    workers: int, start: str, stop_at: int, after_loop: bool
) -> None:
    """torchdata's StatefulDistributedSampler (its state has no epoch), with persistent workers
    when there are workers: the checkpoint's epoch continues, empty if the checkpoint ended it
    ("kept"); the next one ("step" after an epoch's last batch) starts fresh, drawing what the
    uninterrupted run drew for it (nothing with persistent workers)."""
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    def make() -> StatefulDataLoader:
        sampler = StatefulDistributedSampler(Features(False), num_replicas=1, rank=0, seed=1)
        return StatefulDataLoader(
            Features(False),
            batch_size=BATCH,
            sampler=sampler,
            num_workers=workers,
            persistent_workers=workers > 0,
        )

    compare(make, stop_at, after_loop=after_loop, start=start)


def test_a_loaded_state_is_its_state_until_iter_applies_it() -> None:
    """Building the loaded iterator in state_dict() (the client reads the state's layout at
    restore) would draw its workers' indices before the loop's set_epoch."""
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    def make() -> StatefulDataLoader:
        sampler = StatefulDistributedSampler(Features(False), num_replicas=1, rank=0, seed=1)
        return StatefulDataLoader(Features(False), batch_size=BATCH, sampler=sampler, num_workers=2)

    loader = make()
    _loaders.track({"data": loader})
    loader.sampler.set_epoch(1)
    it = iter(loader)
    next(it)
    saved = loader.state_dict()
    assert saved[_loaders.EPOCH_KEY] == 1
    del it
    fresh = make()
    fresh.load_state_dict(saved)
    _loaders.after_restore({"data": fresh})
    before = torch.get_rng_state()
    assert fresh.state_dict() == saved and fresh._iterator is None
    fresh.sampler.set_epoch(1)
    assert len(list(fresh)) == PER_EPOCH - 1  # the rest of epoch 1, its draws kept
    assert torch.equal(torch.get_rng_state(), before)
    assert type(fresh).__qualname__ == "StatefulDataLoader"  # checkpoints name the same type


def test_a_tracked_loader_pickles_and_copies_as_a_stateful_dataloader() -> None:
    import copy
    import pickle

    loader = StatefulDataLoader(Features(False), batch_size=BATCH)
    _loaders.track({"data": loader})
    assert type(loader) is not StatefulDataLoader and isinstance(loader, StatefulDataLoader)
    for other in [copy.deepcopy(loader)] + [pickle.loads(pickle.dumps(loader, p)) for p in (1, 5)]:
        assert type(other) is StatefulDataLoader
        assert len(list(other)) == PER_EPOCH


def test_a_resumable_sampler_left_at_its_epoch_adopts_the_checkpoints() -> None:
    """With no set_epoch before the resumed pass, a ResumableDistributedSampler continues the
    checkpoint's epoch, as it does outside a StatefulDataLoader."""

    def make() -> StatefulDataLoader:
        sampler = ResumableDistributedSampler(N, num_replicas=1, rank=0, seed=1)
        return StatefulDataLoader(Features(False), batch_size=BATCH, sampler=sampler)

    loader = make()
    _loaders.track({"data": loader})
    loader.sampler.set_epoch(2)
    whole = list(loader)
    loader.sampler.set_epoch(2)
    it = iter(loader)
    next(it)
    fresh = make()
    fresh.load_state_dict(loader.state_dict())
    _loaders.after_restore({"data": fresh})
    rest = list(fresh)
    assert len(rest) == PER_EPOCH - 1
    assert all(torch.equal(a, b) for a, b in zip(rest, whole[1:], strict=True))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("stop_at", "after_loop"), [(4, False), (3, False)])
def test_stateful_dataloader_own_generator(workers: int, stop_at: int, after_loop: bool) -> None:
    def make() -> StatefulDataLoader:
        g = torch.Generator()
        g.manual_seed(5)
        return StatefulDataLoader(
            Features(False), batch_size=BATCH, shuffle=True, num_workers=workers, generator=g
        )

    compare(make, stop_at, after_loop=after_loop)


def resumable(workers: int, **kwargs: Any) -> Callable[[], ResumableLoader]:
    def make() -> ResumableLoader:
        sampler = ResumableDistributedSampler(N, num_replicas=1, rank=0, seed=3)
        dl = DataLoader(Features(True), batch_size=BATCH, sampler=sampler, num_workers=workers, **kwargs)
        return ResumableLoader(dl)

    return make


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("stop_at", "after_loop"), STOPS)
def test_resumable_loader_with_worker_randomness(workers: int, stop_at: int, after_loop: bool) -> None:
    compare(resumable(workers), stop_at, after_loop=after_loop)


def test_resumable_loader_keeps_a_user_worker_init_fn_and_collate_fn() -> None:
    loader = resumable(2, worker_init_fn=_init, collate_fn=_stack)()
    assert [b.shape for b in loader] == [torch.Size([4, 6]), torch.Size([4, 6]), torch.Size([2, 6])]
    assert loader.loader.worker_init_fn is _init and loader.loader.collate_fn is _stack
    assert loader.loader.generator is None


def _init(worker_id: int) -> None:
    torch.manual_seed(123 + worker_id)


def _stack(samples: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(samples)


def test_resumable_loader_state_records_the_pass_seed() -> None:
    loader = resumable(0)()
    assert "base_seed" not in loader.state_dict()  # no pass began
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert type(state["base_seed"]) is int
    legacy = {k: v for k, v in state.items() if k != "base_seed"}
    fresh = resumable(0)()
    fresh.load_state_dict(legacy)  # a state from before the seed was recorded still loads
    assert len(list(fresh)) == 2
    for bad in (-1, 2**63, "7", None):
        with pytest.raises(ValueError, match="base_seed must be an int"):
            resumable(0)().load_state_dict({**state, "base_seed": bad})
    with pytest.raises(ValueError, match="expected keys"):
        resumable(0)().load_state_dict({"base_seed": 1})


def test_a_legacy_state_resumes_without_moving_the_global_stream() -> None:
    """A mid-epoch state without base_seed: the resumed pass draws nothing for its seed."""
    loader = resumable(0)()
    loader.loader.dataset.noisy = False
    it = iter(loader)
    next(it)
    legacy = {k: v for k, v in loader.state_dict().items() if k != "base_seed"}
    fresh = resumable(0)()
    fresh.loader.dataset.noisy = False
    fresh.load_state_dict(legacy)
    before = torch.get_rng_state()
    assert len(list(fresh)) == 2
    assert torch.equal(torch.get_rng_state(), before)


def test_warns_once_at_first_check(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trainer_client._loaders")
    g = torch.Generator()
    sampler = ResumableDistributedSampler(N, num_replicas=1, rank=0)
    own_gen = ResumableLoader(DataLoader(Features(False), batch_size=BATCH, sampler=sampler, generator=g))
    _loaders.check({"data": own_gen})
    assert len(caplog.records) == 1 and "put the generator in the state" in caplog.text
    caplog.clear()
    _loaders.check({"data": own_gen, "gen": g})  # checkpointed with it: exact
    torch_sampler = StatefulDataLoader(
        Features(False), batch_size=BATCH, sampler=torch.utils.data.RandomSampler(Features(False))
    )
    _loaders.check({"data": torch_sampler})
    assert len(caplog.records) == 1 and "torchdata's RandomSampler" in caplog.text
    caplog.clear()
    default = StatefulDataLoader(Features(False), batch_size=BATCH, shuffle=True)
    _loaders.check({"nested": [{"data": default}], "data": resumable(2)()})
    assert not caplog.records  # the exact setups


class _Counting(StatefulDataLoader):
    """A user's loader that saves a state of its own shape around torchdata's."""

    def state_dict(self) -> dict[str, Any]:
        return {"inner": super().state_dict(), "batches_seen": 3}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state["inner"])


def test_a_loader_subclass_with_a_state_of_its_own_is_left_as_it_wrote_it(caplog) -> None:
    loader = _Counting(list(range(8)), batch_size=2)
    with caplog.at_level(logging.WARNING, logger="trainer_client._loaders"):
        _loaders.track({"data": loader})
        _loaders.track({"data": loader})
    assert type(loader) is _Counting  # not swapped for the tracking subclass
    assert set(loader.state_dict()) == {"inner", "batches_seen"}
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "overrides StatefulDataLoader's state_dict/load_state_dict" in caplog.records[0].getMessage()
