"""One rank of an FSDP2 job (CPU, gloo) saving and loading through torch.distributed.checkpoint with
Strata's StrataWriter / StrataReader; run by tests/integration/test_dcp.py, one process per rank.

    python dcp_ranks.py save OUT      # train, dcp.save step 1, dcp.async_save steps 2 and 3
    python dcp_ranks.py load OUT STEP NEXT  # dcp.load STEP ("newest": the attempt's restore step),
                                            # then dcp.save step NEXT
    python dcp_ranks.py resume OUT - NEXT   # the same through client.resume(state)
    python dcp_ranks.py plain OUT DIR       # train, then plain dcp.save with FileSystemWriter(DIR)
    python dcp_ranks.py data OUT STEP NEXT BATCHES  # a data reader's position in AllRanksState:
                                            # dcp.load STEP ("-": none), read BATCHES batches
                                            # ("all": the epoch's rest), dcp.save step NEXT ("-": none)

The rank, world size, job, socket and generation come from STRATA_* variables (or RANK and
WORLD_SIZE, as `strata launch` sets them), the rendezvous from MASTER_ADDR / MASTER_PORT. Rank 0
writes the gathered (full) parameters and optimizer state to OUT.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from trainer_client import CheckpointClient
from trainer_client._staging import Stager
from trainer_client.data import AllRanksState, ResumableDistributedSampler, ResumableLoader
from trainer_client.dcp import StrataReader, StrataWriter, committed_step

DATA_LEN = 48


def build(seed: int, world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    # Row counts that shard unevenly over 2, 3 and 4 ranks (FSDP2 shards dim 0).
    model = torch.nn.Sequential(torch.nn.Linear(16, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    model(torch.randn(4, 16, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> object:
    """The gathered state (a collective; rank 0 gets it)."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _cloned({"model": msd, "optim": osd})


def _cloned(value: object) -> object:
    """Copies of the tensors: a full state dict shares plain tensors (Adam's step) with the live
    optimizer, which the next step changes in place."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cloned(v) for v in value)
    return value


def count_background_copies() -> list[int]:
    """Bytes of tensors (not DCP's pickled values, uint8) the client's staging copies off the main
    thread, i.e. in DCP's background thread after stage(): [total], reset by the caller."""
    copied = [0]
    original = Stager.copy

    def counting(self, views, tensors, indices):  # type: ignore[no-untyped-def]
        if threading.current_thread() is not threading.main_thread():
            copied[0] += sum(tensors[i][1].nbytes for i in indices if tensors[i][1].dtype != torch.uint8)
        return original(self, views, tensors, indices)

    Stager.copy = counting  # type: ignore[method-assign]
    return copied


def data(client: CheckpointClient, report: dict) -> None:
    """Read part of an epoch with every rank's position checkpointed as one value through DCP."""
    load, save, batches = sys.argv[3], sys.argv[4], sys.argv[5]
    sampler = ResumableDistributedSampler(DATA_LEN, seed=3)  # rank and world size of the process group
    loader = ResumableLoader(DataLoader(list(range(DATA_LEN)), batch_size=2, sampler=sampler))
    state = {"data": AllRanksState(loader), "w": torch.arange(4.0)}
    if load != "-":
        dcp.load(state, storage_reader=StrataReader(client, step=int(load)))
    seen: list[int] = []
    it = iter(loader)
    for batch in it if batches == "all" else (next(it) for _ in range(int(batches))):
        seen += batch.tolist()
    report["seen"] = seen
    if save != "-":
        dcp.save(state, storage_writer=StrataWriter(client, step=int(save)))


def _close() -> None:
    """Leave together: a rank tearing gloo down while another still talks to it can abort
    ("terminate called without an active exception"). Even after the barrier, gloo's threads can
    abort in the interpreter's exit; everything is written by now, so leave without it."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ.get("STRATA_RANK") or os.environ["RANK"])  # `strata launch` sets RANK
    world = int(os.environ.get("STRATA_WORLD_SIZE") or os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if mode == "plain":  # no Strata at all: DCP's own writer
        model, opt = build(0, world)
        train(model, opt, 1, rank)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(sys.argv[3]))
        saved = full(model, opt)
        if rank == 0:
            torch.save(saved, out)
        _close()
        return
    if mode == "data":
        client = CheckpointClient(capture_rng=False, resume="never", commit_timeout_s=60)
        report = {"rank": rank, "world_size": world}
        data(client, report)
        print("REPORT " + json.dumps(report), flush=True)
        client.close()
        _close()
        return
    # a loading job resumes as usual ("auto"): its prefetch finds the step saved by other ranks
    client = CheckpointClient(
        capture_rng=False, resume="never" if mode == "save" else "auto", commit_timeout_s=60
    )
    report: dict = {"rank": rank, "world_size": world}
    if mode == "save":
        model, opt = build(0, world)
        writer = StrataWriter(client)  # one for the job: the step comes as DCP's checkpoint_id
        saved = {}
        train(model, opt, 1, rank)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer, checkpoint_id=1)
        saved[1] = full(model, opt)
        # A process group of its own: the save's collectives run in DCP's thread while training goes on.
        group = dist.new_group(backend="gloo")
        reused, copied, background = [], [], count_background_copies()
        for step in (2, 3):
            train(model, opt, step, rank)
            saved[step] = full(model, opt)
            msd, osd = get_state_dict(model, opt)
            future = dcp.async_save(
                {"model": msd, "optim": osd}, storage_writer=writer, checkpoint_id=step, process_group=group
            )
            reused.append(writer.last_stage_reused)
            train(model, opt, 10 + step, rank)  # mutates what was staged: the checkpoint must not see it
            future.result()
            copied.append(background[0])
            background[0] = 0
        report["stage_reused"] = reused
        report["copied_after_stage"] = copied
        if rank == 0:
            torch.save(saved, out)
    else:
        step = None if sys.argv[3] in ("newest", "-") else int(sys.argv[3])
        model, opt = build(123, world)  # other values everywhere
        msd, osd = get_state_dict(model, opt)  # creates Adam's state, which the load fills
        state = {"model": msd, "optim": osd}
        report["committed"] = committed_step(client)
        if mode == "resume":  # the client's own resume, on DTensor state: DCP under the hood
            assert client.resume(state) == report["committed"]
            done = client.last_restore
            assert done is not None
            report.update(step=done["step"], saved_by=done["saved_by"], sources=done["sources"])
        else:
            reader = StrataReader(client, step=step)
            dcp.load(state, storage_reader=reader)
            report.update(step=reader.position[1], saved_by=reader.world_size, sources=reader.sources)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = full(model, opt)
        # The next checkpoint of this (resharded) job: every rank's is a full one.
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=StrataWriter(client, step=int(sys.argv[4])))
        if rank == 0:
            torch.save(loaded, out)
    print("REPORT " + json.dumps(report), flush=True)
    client.close()
    _close()


if __name__ == "__main__":
    main()
