#!/usr/bin/env python
"""A TorchRec DLRM trained the way recommendation teams write it, for `strata launch`:

    strata launch --job dlrm -- python deploy/examples/train_torchrec.py --kind fused
    strata launch --nproc 2 --job dlrm-dmp -- \
        python deploy/examples/train_torchrec.py --kind in_backward --dmp

``--kind`` picks how the tables are trained:
  plain        EmbeddingBagCollection; KeyedOptimizerWrapper (Adam dense, Adagrad tables) in a
               CombinedOptimizer
  fused        FusedEmbeddingBagCollection: fbgemm's TBE updates the tables inside backward
  in_backward  apply_optimizer_in_backward (SGD) on the tables, Adam on the dense layers
``--dmp``: DistributedModelParallel over the ranks (gloo, table-wise), its state ShardedTensors
saved and resumed through torch.distributed.checkpoint (trainer_client.dcp).

The data: a StatefulDataLoader over a StatefulDistributedSampler, and the loop every DDP tutorial
writes (``for epoch ...: sampler.set_epoch(epoch); for batch in loader``). The state handed to
Strata is the model, the optimizer, the loader and the epoch; a resume continues mid-epoch.
Rank 0 prints ``FINAL_DIGEST`` (every rank's model shards, optimizer state and RNG) and, with
``--out``, writes it there with each rank's own digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

from trainer_client import CheckpointClient, init_process_group

DENSE_IN = 8


class Clicks(Dataset[int]):
    """Sample ``i`` of a synthetic click log; the collate function builds the batch from the ids."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def collate(tables: int, rows: int, pooling: int = 3) -> Any:
    def make(ids: list[int]) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
        dense, values, labels = [], [[] for _ in range(tables)], []
        for i in ids:
            g = torch.Generator().manual_seed(i)
            dense.append(torch.randn(DENSE_IN, generator=g))
            for t in range(tables):  # skewed, as click logs are: a few rows are hot
                values[t].append((torch.rand(pooling, generator=g).pow(3) * rows).long().clamp_(max=rows - 1))
            labels.append(float(i % 3 == 0))
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{t}" for t in range(tables)],
            values=torch.cat([torch.cat(v) for v in values]),
            lengths=torch.full((tables * len(ids),), pooling, dtype=torch.int32),
        )
        return torch.stack(dense), kjt, torch.tensor(labels)

    return make


def build(kind: str, tables: int, rows: int, dim: int, dmp: bool) -> tuple[torch.nn.Module, Any]:
    configs = [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{t}"])
        for t in range(tables)
    ]
    cpu = torch.device("cpu")
    ebc: Any
    if kind == "fused":
        ebc = FusedEmbeddingBagCollection(
            tables=configs, optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.05}, device=cpu
        )
    else:
        ebc = EmbeddingBagCollection(tables=configs, device=cpu)
    model: torch.nn.Module = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE_IN,
        dense_arch_layer_sizes=[16, dim],
        over_arch_layer_sizes=[16, 1],
    )
    if kind == "in_backward":
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.05})
    if dmp:
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

        world = dist.get_world_size()
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device="cpu"),
            constraints={c.name: ParameterConstraints(sharding_types=["table_wise"]) for c in configs},
        )
        plan = planner.collective_plan(model, pg=dist.group.WORLD)
        model = DistributedModelParallel(model, device=cpu, plan=plan)
    sparse = {n: p for n, p in model.named_parameters() if "embedding_bag" in n}
    dense = {n: p for n, p in model.named_parameters() if n not in sparse}
    dense_opt = KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adam(ps, lr=0.01))
    if dmp:
        optimizer = CombinedOptimizer([("sparse", model.fused_optimizer), ("dense", dense_opt)])  # type: ignore[arg-type]
    elif kind == "plain":
        sparse_opt = KeyedOptimizerWrapper(sparse, lambda ps: torch.optim.Adagrad(ps, lr=0.05))
        optimizer = CombinedOptimizer([("dense", dense_opt), ("sparse", sparse_opt)])
    elif kind == "fused":
        optimizer = CombinedOptimizer([("dense", dense_opt), ("sparse", ebc.fused_optimizer())])
    else:
        optimizer = dense_opt
    optimizer.init_state()  # lazy state (Adam's moments) exists before a resume loads into it
    return model, optimizer


def digest(model: torch.nn.Module, optimizer: Any) -> str:
    h = hashlib.sha256()

    def feed(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            local = getattr(v, "local_shards", None)
            for t in [s.tensor for s in local()] if callable(local) else [v]:
                h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(str(k).encode())
                feed(v[k])
        elif isinstance(v, list | tuple):
            for x in v:
                feed(x)
        else:
            h.update(repr(v).encode())

    feed(model.state_dict())
    feed(optimizer.state_dict())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=["plain", "fused", "in_backward"], default="fused")
    p.add_argument("--dmp", action="store_true", help="DistributedModelParallel over the ranks")
    p.add_argument("--tables", type=int, default=2)
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--samples", type=int, default=160, help="samples per epoch (all ranks)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--save-every", type=int, default=4, help="steps between checkpoints")
    p.add_argument("--no-checkpoint", action="store_true", help="train without Strata (reference run)")
    p.add_argument("--out", help="rank 0 writes {'digest', 'resumed_from'} here")
    args = p.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    model, optimizer = build(args.kind, args.tables, args.rows, args.dim, args.dmp)
    clicks = Clicks(args.samples)
    sampler = StatefulDistributedSampler(clicks, num_replicas=world, rank=rank, seed=7)
    batches = collate(args.tables, args.rows)
    loader = StatefulDataLoader(clicks, batch_size=args.batch, sampler=sampler, collate_fn=batches)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "data": loader, "epoch": 0}
    client = None if args.no_checkpoint else CheckpointClient(capture_rng=True)
    resumed = client.resume(state) if client is not None else None
    step = 0 if resumed is None else resumed + 1
    print(f"RESUMED rank={rank} step={resumed}", flush=True)
    for epoch in range(state["epoch"], args.epochs):
        state["epoch"] = epoch
        sampler.set_epoch(epoch)
        for dense, kjt, labels in loader:
            optimizer.zero_grad()
            logits = model(dense, kjt).squeeze(-1)
            torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
            optimizer.step()
            if client is not None and step % args.save_every == 0:
                client.save(step, state)
            step += 1
        state["epoch"] = epoch + 1  # a checkpoint after this epoch's last batch starts the next
    if client is not None:
        client.close()
    mine = digest(model, optimizer)  # this rank's shards: with DMP each rank holds other tables
    digests = [mine]
    if distributed:
        digests = [""] * world
        dist.all_gather_object(digests, mine)
    final = hashlib.sha256(",".join(digests).encode()).hexdigest()[:16]
    if rank == 0:
        print(f"FINAL_DIGEST {final}", flush=True)
        if args.out:
            result = {"digest": final, "ranks": digests, "resumed_from": resumed}
            Path(args.out).write_text(json.dumps(result))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("STRATA_WHEN_BUSY", "wait")  # every planned save happens (a test kills at one)
    sys.exit(main())
