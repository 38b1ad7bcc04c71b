"""trainer_client.data after a change of world size: every rank's sampler state, loaded on another
number of ranks, partitions the rest of the epoch over the new ranks, so each sample of the epoch
is read once across 4 -> 2 -> 4 ranks; a per-rank state and a StatefulDataLoader's state of
another number of ranks are refused, naming why."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from trainer_client.data import AllRanksState, ResumableDistributedSampler, ResumableLoader


def samplers(n: int, world: int, **kw: object) -> list[ResumableDistributedSampler]:
    return [ResumableDistributedSampler(n, num_replicas=world, rank=r, seed=5, **kw) for r in range(world)]  # type: ignore[arg-type]


def read(sampler: ResumableDistributedSampler, count: int | None) -> list[int]:
    """The first ``count`` indices of a pass (all with None)."""
    it = iter(sampler)
    return list(it) if count is None else [next(it) for _ in range(count)]


def every_rank(group: list[ResumableDistributedSampler]) -> dict[str, object]:
    """What AllRanksState saves, through JSON (what a checkpoint keeps)."""
    return json.loads(json.dumps({"ranks": [s.state_dict() for s in group]}))


@pytest.mark.parametrize("shuffle", [True, False])
def test_four_two_four_reads_each_sample_once(shuffle: bool) -> None:
    n = 48
    seen: Counter[int] = Counter()
    four = samplers(n, 4, shuffle=shuffle)
    for s in four:
        seen.update(read(s, 3))
    state = every_rank(four)
    two = samplers(n, 2, shuffle=shuffle)
    for s in two:
        s.load_state_dict(state)  # type: ignore[arg-type]
        assert len(s) == 18  # 36 samples left over 2 ranks
        seen.update(read(s, 4))
    state = every_rank(two)
    assert state["ranks"][0]["reshards"] == [[4, [3, 3, 3, 3]]]  # type: ignore[index]
    again = samplers(n, 4, shuffle=shuffle)
    for s in again:
        s.load_state_dict(state)  # type: ignore[arg-type]
        assert len(s) == 7
        seen.update(read(s, None))
    assert seen == Counter(range(n))
    # the next epoch is the whole dataset again, partitioned as DistributedSampler does
    for s in again:
        s.set_epoch(1)
        assert len(s) == 12
    assert Counter(i for s in again for i in read(s, None)) == Counter(range(n))


@pytest.mark.parametrize("drop_last", [False, True])
def test_uneven_progress_and_padding(drop_last: bool) -> None:
    """Ranks that read different amounts, sizes that pad or truncate: no sample of the epoch is
    lost (beyond what drop_last drops), and only padding repeats one."""
    rng = random.Random(3)
    for _ in range(30):
        n = rng.randrange(1, 60)
        sizes = [rng.randrange(1, 6) for _ in range(rng.randrange(2, 5))]
        seen: Counter[int] = Counter()
        group = samplers(n, sizes[0], drop_last=drop_last)
        for size in sizes[1:]:
            for s in group:
                left = len(s) - s.state_dict()["consumed_samples"]
                seen.update(read(s, rng.randrange(0, left + 1)))
            state = every_rank(group)
            group = samplers(n, size, drop_last=drop_last)
            for s in group:
                s.load_state_dict(state)  # type: ignore[arg-type]
        for s in group:
            seen.update(read(s, None))
        if not drop_last:
            assert set(seen) == set(range(n)), (n, sizes)
        # what repeats is padding: at most world - 1 samples per partition
        assert sum(seen.values()) - len(seen) <= sum(sizes), (n, sizes)


def test_a_loader_resumes_on_another_number_of_ranks() -> None:
    n, batch = 40, 2
    loaders = [
        ResumableLoader(DataLoader(list(range(n)), batch_size=batch, sampler=s)) for s in samplers(n, 4)
    ]
    seen: Counter[int] = Counter()
    for loader in loaders:
        it = iter(loader)
        for _ in range(2):
            seen.update(next(it).tolist())
    state = json.loads(json.dumps({"ranks": [loader.state_dict() for loader in loaders]}))
    assert all("base_seed" in s for s in state["ranks"])
    new = [ResumableLoader(DataLoader(list(range(n)), batch_size=batch, sampler=s)) for s in samplers(n, 3)]
    for loader in new:
        loader.load_state_dict(state)
        for b in loader:
            seen.update(b.tolist())
    assert seen == Counter(range(n))
    # the same number of ranks: each continues at its own position
    same = [ResumableLoader(DataLoader(list(range(n)), batch_size=batch, sampler=s)) for s in samplers(n, 4)]
    for loader in same:
        loader.load_state_dict(state)
    assert [len(list(loader)) for loader in same] == [3, 3, 3, 3]


def test_one_ranks_state_on_another_number_of_ranks_is_refused() -> None:
    saved = samplers(30, 4)[0].state_dict()
    with pytest.raises(ValueError, match=r"num_replicas=4 .* num_replicas=2.*AllRanksState"):
        samplers(30, 2)[0].load_state_dict(saved)
    # states of different steps do not make one epoch
    four = samplers(30, 4)
    read(four[0], 2)
    four[1].set_epoch(1)
    with pytest.raises(ValueError, match="different epochs"):
        samplers(30, 2)[0].load_state_dict(every_rank(four))  # type: ignore[arg-type]
    bad = every_rank(samplers(30, 4))
    bad["ranks"][0]["reshards"] = [[2, [99, 0]]]  # type: ignore[index]
    with pytest.raises(ValueError, match="consumed more than"):
        samplers(30, 2)[0].load_state_dict(bad)  # type: ignore[arg-type]


def test_all_ranks_state_outside_a_process_group() -> None:
    sampler = samplers(20, 1)[0]
    read(sampler, 5)
    holder = AllRanksState(sampler)
    state = holder.state_dict()
    assert json.loads(state["ranks"]) == [sampler.state_dict()]  # one string: DCP keeps it whole
    fresh = samplers(20, 1)[0]
    AllRanksState(fresh).load_state_dict(state)
    assert len(read(fresh, None)) == 15


def test_a_stateful_dataloader_of_another_number_of_ranks_is_refused() -> None:
    def loader(world: int, rank: int) -> StatefulDataLoader:
        s = ResumableDistributedSampler(40, num_replicas=world, rank=rank, seed=1)
        return StatefulDataLoader(list(range(40)), batch_size=2, sampler=s)

    saved = []
    for r in range(4):
        dl = loader(4, r)
        it = iter(dl)
        next(it)
        saved.append(dl.state_dict())
    # this process is one rank (no process group): 4 ranks' states cannot be re-partitioned here
    with pytest.raises(ValueError, match=r"StatefulDataLoader's state was saved by 4 ranks .* over 1"):
        AllRanksState(loader(1, 0)).load_state_dict({"ranks": saved})
    # on the same number of ranks it loads its own rank's state
    one = loader(1, 0)
    it = iter(one)
    next(it)
    again = loader(1, 0)
    AllRanksState(again).load_state_dict({"ranks": [one.state_dict()]})
    assert next(iter(again)).tolist() == next(it).tolist()
    with pytest.raises(TypeError, match="no state_dict"):
        AllRanksState(object())
