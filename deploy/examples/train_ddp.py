#!/usr/bin/env python
"""The recommendation example, data-parallel over torch.distributed (gloo on
CPU), for `strata launch`:

    strata launch --nproc 2 --job recsys-ddp -- python deploy/examples/train_ddp.py --steps 60

Every rank reads its own click stream (seed + rank) and saves its own state
(model replica, optimizers, stream position, RNG) at the same steps; a step
exists only when every rank committed it. Rank 0 prints ``FINAL_DIGEST``.

DDP is built with ``find_unused_parameters=True`` (see ``data_parallel``) so that a resumed
run ends bit for bit equal to an uninterrupted one with any number of ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_recsys import ClickStream, RecModel, digest

from trainer_client import CheckpointClient, init_process_group


def data_parallel(module: nn.Module) -> DistributedDataParallel:
    """``module`` wrapped in DDP with gradient buckets that never change.

    By default DDP rebuilds its buckets after its first step (in the order the gradients became
    ready), so a resumed run's first step all-reduces another bucket layout than the uninterrupted
    run does at that step. With 3+ ranks gloo's ring sums each element in an order that depends on
    its place in the bucket, so the last bits would differ. With ``find_unused_parameters=True``
    DDP keeps its first layout for good (for one walk of the autograd graph per step).
    """
    return DistributedDataParallel(module, find_unused_parameters=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--no-checkpoint", action="store_true", help="train without Strata (reference run)")
    parser.add_argument("--out", help="rank 0 writes {'digest', 'resumed_from'} here")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests)")
    args = parser.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)  # same initial replica on every rank

    model = data_parallel(RecModel(args.tables, args.rows, args.dim))
    inner: RecModel = model.module  # type: ignore[assignment]
    sparse_opt = torch.optim.SGD(inner.tables.parameters(), lr=0.05)
    dense_opt = torch.optim.Adam([*inner.bottom.parameters(), *inner.top.parameters()], lr=1e-3)
    data = ClickStream(args.seed + rank, args.tables, args.rows, args.batch)
    state: dict[str, Any] = {"model": inner, "sparse_opt": sparse_opt, "dense_opt": dense_opt, "data": data}
    torch.manual_seed(args.seed + 1000 + rank)  # per-rank dropout streams

    # The state holds the inner module, so declare the DDP wrapper: its parameters (and their
    # optimizer state) are saved once per job, spread over the ranks, not once per rank.
    client = None if args.no_checkpoint else CheckpointClient(replicated=[model])
    resumed = client.resume(state) if client is not None else None
    start = 0 if resumed is None else resumed + 1
    # Every rank says what it resumed from: the ranks of one gang must agree.
    source = (client.last_restore or {}).get("source") if client is not None and resumed is not None else None
    restart = os.environ.get("STRATA_RESTART", "0")
    print(f"RESUMED rank={rank} restart={restart} step={resumed} source={source}", flush=True)
    dist.barrier()  # every rank has its state back
    if rank == 0:
        print(f"resumed from step {resumed}" if resumed is not None else "starting fresh", flush=True)
        print(f"READY_AT {time.time():.3f}", flush=True)

    loss_fn = nn.BCEWithLogitsLoss()
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        ids, dense, clicks = data.next_batch()
        loss = loss_fn(model(ids, dense), clicks)
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if client is not None and (step + 1) % args.save_every == 0:
            handle = client.save(step, state)
            if rank == 0:
                print(f"step {step:4d}  loss {loss.item():.4f}  saved ({handle.stall_s * 1e3:.1f} ms stall)")
    if client is not None:
        client.close()
    final = digest(inner.state_dict(), sparse_opt.state_dict(), dense_opt.state_dict())
    if rank == 0:
        print(f"trained to step {args.steps - 1} in {time.perf_counter() - t0:.1f} s", flush=True)
        print(f"FINAL_DIGEST {final}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"digest": final, "resumed_from": resumed}))
    # Drop DDP (its Reducer) while the process group is still registered: if the Reducer held
    # the last reference at interpreter exit, gloo's destructor would join its worker threads
    # with the GIL held while a worker waits for the GIL (a deadlock seen with torch 2.13).
    del model
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("STRATA_WHEN_BUSY", "wait")
    sys.exit(main())
