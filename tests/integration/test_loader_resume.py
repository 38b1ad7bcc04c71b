"""Killed and resumed through a real sidecar, a run with the default torchdata loader (no
generator, shuffled, dropout in the model) or a ResumableLoader draws the random numbers of the
uninterrupted run: same batches, bit-identical parameters."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from tests.unit.test_loader_rng import BATCH, EPOCHS, PER_EPOCH, Features, N, Run
from trainer_client.data import ResumableDistributedSampler, ResumableLoader


def stateful() -> StatefulDataLoader:
    return StatefulDataLoader(Features(False), batch_size=BATCH, shuffle=True, num_workers=2)


def resumable() -> ResumableLoader:
    sampler = ResumableDistributedSampler(len(Features(True)), num_replicas=1, rank=0, seed=3)
    return ResumableLoader(DataLoader(Features(True), batch_size=BATCH, sampler=sampler, num_workers=2))


class ClientRun(Run):
    def __init__(self, make_loader: Any, client: Any) -> None:
        super().__init__(make_loader)
        self.client = client

    def checkpoint(self) -> Any:
        return self.client.save(self.step, self.state).durable.result(30).step


@pytest.mark.parametrize("make_loader", [stateful, resumable], ids=["stateful", "resumable"])
@pytest.mark.parametrize("stop_at", [4, 3], ids=["mid-epoch", "epoch-end"])
def test_resume_through_the_client_is_bit_identical(
    make_sidecar, make_client, job_name, make_loader, stop_at
) -> None:
    server = make_sidecar()
    straight = Run(make_loader)
    straight.train()
    first = ClientRun(make_loader, make_client(server, job_name))
    assert first.train(stop_at) == stop_at
    resumed = ClientRun(make_loader, make_client(server, job_name))  # rebuilt, as a new process would
    assert resumed.client.resume(resumed.state) == stop_at
    resumed.step = stop_at
    resumed.train()
    got = first.batches + resumed.batches
    assert len(got) == len(straight.batches) == EPOCHS * PER_EPOCH
    for i, (a, b) in enumerate(zip(got, straight.batches, strict=True)):
        assert torch.equal(a, b), f"batch {i} differs"
    for (name, a), b in zip(resumed.model.named_parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} differs after the resume"
    assert torch.equal(resumed.final_rng, straight.final_rng)


class EpochLoop(ClientRun):
    """The loop every DDP tutorial writes, on one simulated rank of ``world``: the epoch comes from
    the restored step, and the sampler's ``set_epoch`` precedes each pass."""

    def train(self, stop_at: int | None = None, *, after_loop: bool = False) -> Any:
        per = len(self.loader)
        for epoch in range(self.step // per, EPOCHS):
            self.loader.sampler.set_epoch(epoch)
            for batch in self.loader:
                self.train_on(batch)
                if self.step == stop_at:
                    return self.checkpoint()
        self.final_rng = torch.get_rng_state()
        return None


def _samples(batches: list[torch.Tensor]) -> list[int]:
    """The dataset indices of Features(False) rows (row i ends with (i + 1) / N)."""
    return [round(float(row[-1]) * N) - 1 for batch in batches for row in batch]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("sampler", ["torchdata", "strata"])
@pytest.mark.parametrize("stop_at", [5, 4], ids=["mid-epoch-2", "end-of-epoch-1"])
def test_the_usual_epoch_loop_resumes_in_a_later_epoch(
    make_sidecar, make_client, job_name, workers, sampler, stop_at
) -> None:
    """Resumed in epoch 2 (or at epoch 1's end, the loop going on with epoch 2), each of 2 ranks
    trains the batches of the uninterrupted run with its random draws: every sample once per
    epoch. The client's restore must not build the loaded iterator before the loop's set_epoch
    (its workers would draw epoch 0's order), and a state at an epoch's end must start the next
    epoch fresh."""
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    server = make_sidecar()
    world, per = 2, 2  # 5 samples per rank: batches of 4 and 1
    per_rank: list[list[int]] = []
    for rank in range(world):

        def make(rank: int = rank) -> StatefulDataLoader:
            if sampler == "torchdata":
                s: Any = StatefulDistributedSampler(Features(False), num_replicas=world, rank=rank, seed=1)
            else:
                s = ResumableDistributedSampler(N, num_replicas=world, rank=rank, seed=1)
            return StatefulDataLoader(Features(False), batch_size=BATCH, sampler=s, num_workers=workers)

        straight = EpochLoop(make, None)
        straight.train()
        job = f"{job_name}-{rank}"
        first = EpochLoop(make, make_client(server, job))
        assert first.client.resume(first.state) is None  # a fresh start, as a launched job does
        assert first.train(stop_at) == stop_at
        first.client.close()
        resumed = EpochLoop(make, make_client(server, job))  # rebuilt, as a new process would
        resumed.step = resumed.client.resume(resumed.state)
        assert resumed.step == stop_at
        resumed.train()
        got = first.batches + resumed.batches
        assert len(got) == len(straight.batches) == EPOCHS * per, f"rank {rank}"
        for i, (a, b) in enumerate(zip(got, straight.batches, strict=True)):
            assert torch.equal(a, b), f"rank {rank}: batch {i} differs"
        assert torch.equal(resumed.final_rng, straight.final_rng), f"rank {rank}: the draws differ"
        per_rank.append(_samples(got))
    for epoch in range(EPOCHS):
        seen = [i for samples in per_rank for i in samples[epoch * 5 : (epoch + 1) * 5]]
        assert sorted(seen) == list(range(N)), f"epoch {epoch}: {seen}"


def test_a_fresh_start_keeps_nothing_of_the_caller_alive(make_sidecar, make_client, job_name) -> None:
    """resume() with nothing to restore (the restore stream ends in NOT_FOUND) leaves no cycle
    holding the caller's frame: its objects go with their last reference. (A DataLoader iterator
    that the garbage collector finds instead has its queue threads stopped before its workers
    are told to exit: each worker then stalls the collection 5 s.)"""
    client = make_client(make_sidecar(), job_name)

    def start() -> weakref.ref[Any]:
        kept = torch.nn.Linear(2, 2)  # a local of the caller, not in the state
        assert client.resume({"w": torch.zeros(2)}) is None
        return weakref.ref(kept)

    gc.collect()
    gc.disable()
    try:
        assert start()() is None
    finally:
        gc.enable()
