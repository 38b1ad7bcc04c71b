"""One rank of a TorchRec DistributedModelParallel job (CPU, gloo) saving and resuming through
client.save / client.resume, which go through torch.distributed.checkpoint for its ShardedTensor
state; run by tests/integration/test_dmp.py, one process per rank.

    python dmp_ranks.py train OUT LAST SAVED       # a fresh job: steps 1..LAST, client.save(step)
                                                   # for steps up to SAVED; OUT gets the state
                                                   # after SAVED ("saved") and after LAST ("final")
    python dmp_ranks.py resume OUT LAST PLACEMENT  # client.resume (tables placed as PLACEMENT,
                                                   # e.g. "1,0"): first before the optimizer's
                                                   # lazy state exists (refused), then after
                                                   # init_state(); then steps up to LAST; OUT gets
                                                   # the state loaded ("loaded") and after LAST

Each rank writes OUT.<rank>: its state's tensors by name, a ShardedTensor as its global size and
its local shards with their offsets (the test assembles the global tensors); its report holds
``draws``: what the Python and torch generators draw right after the save of SAVED (train; each
rank seeds its own streams) or right after the resume (resume). The rank, world
size, job, socket and generation come from STRATA_* variables, the rendezvous from MASTER_ADDR /
MASTER_PORT.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.fixtures

from tests.fixtures import dlrm
from trainer_client import CheckpointClient, RestoreError

SHAPE = dlrm.Shape(rows=200, batch=16)


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Copies of every tensor of the model's and optimizer's state dicts, by dotted name."""
    out: dict[str, Any] = {}
    for name, v in [*dlrm.leaves("model", model.state_dict()), *dlrm.leaves("optimizer", opt.state_dict())]:
        if isinstance(v, ShardedTensor):
            shards = [(list(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in v.local_shards()]
            out[name] = ("sharded", list(v.size()), shards)
        elif isinstance(v, torch.Tensor):
            out[name] = ("dense", v.detach().clone())
    return out


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    dlrm.train_step(model, opt, dlrm.batch(SHAPE, rank, step))  # type: ignore[arg-type]


def draws() -> list[float]:
    return [random.random(), *torch.rand(2).tolist()]


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["STRATA_RANK"])
    world = int(os.environ["STRATA_WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    client = CheckpointClient(commit_timeout_s=60)
    report: dict[str, Any] = {"rank": rank, "world_size": world}
    parts: dict[str, Any] = {}
    if mode == "train":
        last, saved_until = int(sys.argv[3]), int(sys.argv[4])
        model, opt = dlrm.build_sharded(world, shape=SHAPE)
        state = dlrm.state_of(model, opt)  # type: ignore[arg-type]
        report["resumed"] = client.resume(state)  # a fresh job: None
        torch.manual_seed(100 + rank)  # each rank its own streams
        random.seed(100 + rank)
        stalls = []
        for step in range(1, last + 1):
            train(model, opt, step, rank)
            if step <= saved_until:
                handle = client.save(step, state)
                stalls.append(handle.staged.done())
            if step == saved_until:  # staged: the next steps train while the save goes on
                parts["saved"] = snapshot(model, opt)
                report["draws"] = draws()
        report["staged"] = stalls
        report["durable"] = handle.durable.result(60).step
        parts["final"] = snapshot(model, opt)
    else:  # resume
        last = int(sys.argv[3])
        placement = tuple(int(r) for r in sys.argv[4].split(","))
        # other values everywhere, and no optimizer state yet
        model, opt = dlrm.build_sharded(world, placement, shape=SHAPE, seed=123, init_state=False)
        state = dlrm.state_of(model, opt)  # type: ignore[arg-type]
        try:
            client.resume(state)
            report["refused"] = ""
        except RestoreError as exc:
            report["refused"] = str(exc)
        opt.init_state()  # type: ignore[operator]
        step = client.resume(state)
        assert step is not None and client.last_restore is not None
        report.update(step=step, saved_by=client.last_restore["saved_by"], draws=draws())
        parts["loaded"] = snapshot(model, opt)
        for s in range(step + 1, last + 1):
            train(model, opt, s, rank)
        parts["final"] = snapshot(model, opt)
    torch.save(parts, f"{out}.{rank}")
    print("REPORT " + json.dumps(report), flush=True)
    client.close()
    dist.barrier()  # leave together: gloo torn down under a peer still talking can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
