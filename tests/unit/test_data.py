"""trainer_client.data: a data reader checkpointed mid-epoch resumes with exactly the samples the
uninterrupted run would have trained next, whatever the workers prefetched."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from trainer_client._tree import decode_skeleton, encode_skeleton, flatten, load_into, rebuild
from trainer_client.data import ResumableDistributedSampler, ResumableLoader

EPOCHS = 2
BATCH = 4


class Ids(Dataset[int]):
    """Sample i is the int i (module level: DataLoader workers must be able to pickle it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def through_checkpoint(state: dict[str, Any]) -> tuple[bytes, list[torch.Tensor]]:
    """What the client sends: the JSON skeleton bytes and the tensors."""
    flat = flatten(state)
    return encode_skeleton(flat.skeleton), [t.clone() for _, t in flat.tensors]


def restore_into(state: dict[str, Any], saved: tuple[bytes, list[torch.Tensor]]) -> None:
    skeleton = decode_skeleton(saved[0])
    load_into(state, skeleton, saved[1])


def plain(
    n: int, workers: int, *, replicas: int = 1, rank: int = 0, drop_last: bool = False
) -> ResumableLoader:
    sampler = ResumableDistributedSampler(n, num_replicas=replicas, rank=rank, seed=7, drop_last=drop_last)
    return ResumableLoader(DataLoader(Ids(n), batch_size=BATCH, sampler=sampler, num_workers=workers))


def train(
    loader: ResumableLoader, stop_after: int | None = None, first_epoch: int | None = None
) -> tuple[list[tuple[int, int]], tuple[bytes, list[torch.Tensor]] | None]:
    """(epoch, sample) pairs in training order, over the epochs left; with ``stop_after``, stop
    after that many batches and return the checkpoint taken there."""
    seen: list[tuple[int, int]] = []
    steps = 0
    start = loader.epoch if first_epoch is None else first_epoch
    for epoch in range(start, EPOCHS):
        loader.set_epoch(epoch)
        for batch in loader:
            seen += [(epoch, i) for i in batch.tolist()]
            steps += 1
            if steps == stop_after:
                return seen, through_checkpoint({"data": loader})
    return seen, None


# 23 samples, batches of 4: 6 batches per epoch, the last one of 3 samples.
@pytest.mark.parametrize("workers", [0, 2])
def test_resumable_loader_resumes_exactly(workers: int) -> None:
    full, _ = train(plain(23, workers))
    assert len(full) == 23 * EPOCHS
    for stop in (1, 5, 6, 7, 12):  # 6: right after epoch 0's last batch; 12: after the last one
        before, saved = train(plain(23, workers), stop_after=stop)
        assert saved is not None
        loader = plain(23, workers)
        restore_into({"data": loader}, saved)
        after, _ = train(loader)
        assert before + after == full, stop


@pytest.mark.parametrize("workers", [0, 2])
def test_save_between_epochs(workers: int) -> None:
    full, _ = train(plain(10, workers))
    loader = plain(10, workers)
    loader.set_epoch(0)
    before = [(0, i) for b in loader for i in b.tolist()]
    at_end = through_checkpoint({"data": loader})  # epoch 0 finished, set_epoch(1) not yet called
    loader.set_epoch(1)
    next_epoch = through_checkpoint({"data": loader})  # epoch 1 announced, nothing consumed
    for saved in (at_end, next_epoch):
        fresh = plain(10, workers)
        restore_into({"data": fresh}, saved)
        after, _ = train(fresh)
        assert before + after == full


def test_drop_last_batch_at_epoch_end() -> None:
    sampler = ResumableDistributedSampler(10, num_replicas=1, rank=0, seed=3)
    loader = ResumableLoader(DataLoader(Ids(10), batch_size=4, sampler=sampler, drop_last=True))
    it = iter(loader)
    next(it), next(it)
    assert loader.state_dict()["consumed_samples"] == 8
    saved = through_checkpoint({"data": loader})
    fresh_sampler = ResumableDistributedSampler(10, num_replicas=1, rank=0, seed=3)
    fresh = ResumableLoader(DataLoader(Ids(10), batch_size=4, sampler=fresh_sampler, drop_last=True))
    restore_into({"data": fresh}, saved)
    assert list(fresh) == []  # the 2 left over form a partial batch, dropped as in the original run
    assert fresh.state_dict()["consumed_samples"] == 10  # a finished pass reads as the whole epoch
    fresh.set_epoch(1)
    assert len(list(fresh)) == 2


def test_sampler_alone_is_exact_only_without_prefetch() -> None:
    for workers, ahead in ((0, 0), (2, 4)):  # 2 workers x prefetch_factor 2 batches in flight
        loader = plain(40, workers)
        it = iter(loader)
        next(it)
        assert loader.state_dict()["consumed_samples"] == BATCH
        assert loader.sampler._yielded == BATCH * (1 + ahead)
        del it


def sampler_sequence(sampler: Any, epochs: range) -> list[list[int]]:
    out = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("n", [30, 31, 32, 2])
def test_matches_torch_distributed_sampler(n: int, shuffle: bool, drop_last: bool) -> None:
    for rank in range(3):
        ours = ResumableDistributedSampler(
            Ids(n), num_replicas=3, rank=rank, shuffle=shuffle, seed=11, drop_last=drop_last
        )
        torchs: DistributedSampler[int] = DistributedSampler(
            Ids(n), num_replicas=3, rank=rank, shuffle=shuffle, seed=11, drop_last=drop_last
        )
        assert sampler_sequence(ours, range(3)) == sampler_sequence(torchs, range(3))
        assert len(ours) == len(torchs)


def test_replicas_partition_each_epoch() -> None:
    samplers = [ResumableDistributedSampler(30, num_replicas=3, rank=r, seed=5) for r in range(3)]
    for epoch in range(3):
        seen = [i for s in samplers for i in sampler_sequence(s, range(epoch, epoch + 1))[0]]
        assert sorted(seen) == list(range(30))
    assert sampler_sequence(samplers[0], range(1)) != sampler_sequence(samplers[0], range(1, 2))


def test_world_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    s = ResumableDistributedSampler(10)
    assert (s.num_replicas, s.rank, len(s)) == (3, 2, 4)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    assert ResumableDistributedSampler(10).num_replicas == 1
    with pytest.raises(ValueError, match="rank 3"):
        ResumableDistributedSampler(10, num_replicas=3, rank=3)


def test_kill_restart_counts_every_sample_once_per_epoch() -> None:
    """3 ranks train in lockstep, checkpoint at a random step, train on a little, die (the steps
    after the checkpoint are lost), restart from the checkpoint: every id is trained exactly once
    per epoch across ranks."""
    n, ranks, epochs = 48, 3, 2  # 16 per rank: 4 batches per epoch
    rng = random.Random(1234)
    for _ in range(4):
        loaders = [plain(n, 1 if r == 0 else 0, replicas=ranks, rank=r) for r in range(ranks)]
        ckpt_step, kill_step = sorted(rng.sample(range(1, 4 * epochs + 1), 2))
        trained: Counter[tuple[int, int]] = Counter()
        lost: Counter[tuple[int, int]] = Counter()
        saved = None
        step = 0
        iters = {}
        for epoch in range(epochs):
            for loader in loaders:
                loader.set_epoch(epoch)
            iters = {r: iter(loader) for r, loader in enumerate(loaders)}
            for batches in zip(*iters.values(), strict=True):
                step += 1
                for batch in batches:
                    (lost if saved is not None else trained).update((epoch, i) for i in batch.tolist())
                if step == ckpt_step:
                    saved = through_checkpoint(
                        {"step": step, "data": {str(r): lo for r, lo in enumerate(loaders)}}
                    )
                if step == kill_step:
                    break
            if step == kill_step:
                break
        del iters
        assert saved is not None
        assert rebuild(decode_skeleton(saved[0]), saved[1])["step"] == ckpt_step
        loaders = [plain(n, 1 if r == 0 else 0, replicas=ranks, rank=r) for r in range(ranks)]
        state: dict[str, Any] = {"step": 0, "data": {str(r): lo for r, lo in enumerate(loaders)}}
        restore_into(state, saved)
        assert state["step"] == ckpt_step
        for epoch in range(loaders[0].epoch, epochs):
            for loader in loaders:
                loader.set_epoch(epoch)
            for batches in zip(*loaders, strict=True):
                for batch in batches:
                    trained.update((epoch, i) for i in batch.tolist())
        assert trained == Counter((e, i) for e in range(epochs) for i in range(n)), (ckpt_step, kill_step)


def test_refuses_other_world_size() -> None:
    saved = ResumableDistributedSampler(30, num_replicas=4, rank=0).state_dict()
    with pytest.raises(ValueError, match=r"num_replicas=4.*num_replicas=3"):
        ResumableDistributedSampler(30, num_replicas=3, rank=0).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"num_replicas=4.*num_replicas=3"):
        plain(30, 0, replicas=3).load_state_dict(saved)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: s.update(seed=1), "seed=1"),
        (lambda s: s.update(dataset_len=31), "dataset_len=31"),
        (lambda s: s.update(consumed_samples=31), "consumed_samples=31"),
        (lambda s: s.update(epoch="1"), "epoch must be an int"),
        (lambda s: s.pop("epoch"), "expected keys"),
    ],
)
def test_refuses_bad_state(change: Callable[[dict[str, Any]], Any], match: str) -> None:
    state = ResumableDistributedSampler(30, num_replicas=1, rank=0).state_dict()
    change(state)
    with pytest.raises(ValueError, match=match):
        ResumableDistributedSampler(30, num_replicas=1, rank=0).load_state_dict(state)


def test_loader_refusals() -> None:
    sampler = ResumableDistributedSampler(8, num_replicas=1, rank=0)
    with pytest.raises(TypeError, match="state directly"):
        ResumableLoader(StatefulDataLoader(Ids(8), batch_size=2, sampler=sampler))
    with pytest.raises(TypeError, match="SequentialSampler"):
        ResumableLoader(DataLoader(Ids(8), batch_size=2))
    with pytest.raises(ValueError, match="in_order"):
        ResumableLoader(DataLoader(Ids(8), batch_size=2, sampler=sampler, num_workers=1, in_order=False))
    loader = ResumableLoader(DataLoader(Ids(8), batch_sampler=BatchSampler(sampler, 3, False)))
    assert [b.tolist() for b in loader] == [
        b.tolist()
        for b in DataLoader(
            Ids(8),
            batch_sampler=BatchSampler(ResumableDistributedSampler(8, num_replicas=1, rank=0), 3, False),
        )
    ]
    it = iter(loader)
    next(it)
    loader.load_state_dict(loader.state_dict())
    with pytest.raises(RuntimeError, match="new pass"):
        next(it)


# ------------------------------------------------------------------ torchdata StatefulDataLoader


def stateful(n: int, workers: int) -> StatefulDataLoader:
    sampler = ResumableDistributedSampler(n, num_replicas=1, rank=0, seed=7)
    return StatefulDataLoader(Ids(n), batch_size=BATCH, sampler=sampler, num_workers=workers)


def train_stateful(
    loader: StatefulDataLoader, first_epoch: int, stop_after: int | None = None, after_loop: int = -1
) -> tuple[list[tuple[int, int]], tuple[bytes, list[torch.Tensor]] | None]:
    """The user tracks the epoch (the loader restores lazily, inside iter()). With ``after_loop``
    0 or 1, the checkpoint is taken after the epoch's loop ended, storing epoch + after_loop."""
    seen: list[tuple[int, int]] = []
    steps = 0
    sampler = loader.sampler
    assert isinstance(sampler, ResumableDistributedSampler)
    for epoch in range(first_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for batch in loader:
            seen += [(epoch, i) for i in batch.tolist()]
            steps += 1
            if steps == stop_after and after_loop < 0:
                return seen, through_checkpoint({"epoch": epoch, "data": loader})
        if stop_after is not None and steps >= stop_after and after_loop >= 0:
            return seen, through_checkpoint({"epoch": epoch + after_loop, "data": loader})
    return seen, None


@pytest.mark.parametrize("workers", [0, 2])
def test_inside_stateful_dataloader(workers: int) -> None:
    full, _ = train_stateful(stateful(23, workers), 0)
    assert full == train(plain(23, 0))[0]
    # 6: right after epoch 0's last batch, inside the loop, or after the loop ended (storing 0 or 1)
    for stop, after_loop in ((3, -1), (6, -1), (7, -1), (6, 0), (6, 1), (12, -1)):
        before, saved = train_stateful(stateful(23, workers), 0, stop, after_loop)
        assert saved is not None
        state: dict[str, Any] = {"epoch": 0, "data": stateful(23, workers)}
        restore_into(state, saved)
        after, _ = train_stateful(state["data"], state["epoch"])
        assert before + after == full, (stop, after_loop)


def test_reload_mid_run_adopts_the_checkpoint_epoch() -> None:
    loader = plain(20, 0)
    it = iter(loader)
    next(it)
    saved = loader.state_dict()  # epoch 0, 4 consumed
    loader.set_epoch(1)
    list(loader)
    loader.load_state_dict(saved)  # set_epoch(1) came before a pass that began: the checkpoint's epoch wins
    assert loader.epoch == 0
    assert [i for b in loader for i in b.tolist()] == loader.sampler.indices(0)[4:]


def test_unbatched_loader_counts_single_samples() -> None:
    def make() -> ResumableLoader:
        sampler = ResumableDistributedSampler(9, num_replicas=1, rank=0, seed=2)
        return ResumableLoader(DataLoader(Ids(9), batch_size=None, sampler=sampler))

    full = [int(x) for x in make()]
    loader = make()
    it = iter(loader)
    before = [int(next(it)) for _ in range(3)]
    fresh = make()
    fresh.load_state_dict(loader.state_dict())
    assert before + [int(x) for x in fresh] == full
