"""The trainer of the restart benchmark (``tests.bench.peer``): each rank holds its own shard of
the state (``--mib`` MiB, as a recommendation model's embedding tables are sharded, so nothing is
broadcast at start), trains a small dense step, saves every ``--save-every`` steps, and prints
when every rank has its state back (``READY_AT``), as deploy/examples/train_ddp.py does."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from trainer_client import CheckpointClient, init_process_group


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--mib", type=int, default=512)
    args = p.parse_args()
    init_process_group()
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    state = {"shard": torch.rand(args.mib * (1 << 20) // 4, generator=g), "dense": torch.randn(256, 256)}
    client = CheckpointClient()
    resumed = client.resume(state)
    source = (client.last_restore or {}).get("source") if resumed is not None else None
    restart = os.environ.get("STRATA_RESTART", "0")
    print(f"RESUMED rank={rank} restart={restart} step={resumed} source={source}", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"READY_AT {time.time():.3f}", flush=True)
    start = 0 if resumed is None else resumed + 1
    for step in range(start, args.steps):
        with torch.no_grad():
            state["dense"] = torch.tanh(state["dense"] @ state["dense"] / 256)
            state["shard"][step * 1000 : (step + 1) * 1000].add_(1.0)
        dist.barrier()
        if (step + 1) % args.save_every == 0:
            client.save(step, state)
    client.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("STRATA_WHEN_BUSY", "wait")
    sys.exit(main())
