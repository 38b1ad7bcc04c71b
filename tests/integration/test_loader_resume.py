"""Killed and resumed through a real sidecar, a run with the default torchdata loader (no
generator, shuffled, dropout in the model) or a ResumableLoader draws the random numbers of the
uninterrupted run: same batches, bit-identical parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from tests.unit.test_loader_rng import BATCH, EPOCHS, PER_EPOCH, Features, Run
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
