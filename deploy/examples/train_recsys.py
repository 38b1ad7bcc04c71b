#!/usr/bin/env python
"""A small recommendation model (embedding tables + MLPs) on synthetic click
data, checkpointed through Strata.

    STRATA_JOB=recsys python deploy/examples/train_recsys.py --steps 60 --save-every 5

On start it resumes from the newest committed checkpoint (STRATA_RESUME=auto).
At the end it prints ``FINAL_DIGEST <sha256>`` over every parameter and
optimizer tensor, so two runs can be compared bit for bit. ``--no-checkpoint``
trains without Strata (the uninterrupted reference).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

import torch
from torch import nn


class ClickStream:
    """Synthetic click logs: batch ``i`` depends only on (seed, i), and the
    position is part of the checkpoint, so no batch is seen twice or skipped."""

    def __init__(self, seed: int, tables: int, rows: int, batch: int, dense: int = 8) -> None:
        self.seed, self.tables, self.rows, self.batch, self.dense = seed, tables, rows, batch, dense
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        # Skewed ids (a few hot rows), like real recommendation traffic.
        u = torch.rand(self.batch, self.tables, 3, generator=g)
        ids = (u.pow(3) * self.rows).long().clamp_(max=self.rows - 1)
        dense = torch.randn(self.batch, self.dense, generator=g)
        score = dense[:, 0] + 0.5 * torch.sin(ids[:, 0, 0].float())
        clicks = (score + 0.3 * torch.randn(self.batch, generator=g) > 0).float()
        return ids, dense, clicks

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.position = int(state["seed"]), int(state["position"])


class RecModel(nn.Module):
    def __init__(self, tables: int, rows: int, dim: int, dense: int = 8) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
        self.bottom = nn.Sequential(nn.Linear(dense, dim), nn.ReLU())
        self.top = nn.Sequential(
            nn.Linear(dim * (tables + 1), 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1)
        )

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        pooled = [table(ids[:, i, :]) for i, table in enumerate(self.tables)]
        return self.top(torch.cat([self.bottom(dense), *pooled], dim=1)).squeeze(1)


def digest(*parts: dict[str, Any]) -> str:
    """sha256 over the raw bytes of every tensor, in a fixed order."""
    h = hashlib.sha256()

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            h.update(prefix.encode())
            h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(f"{prefix}.{k}", value[k])
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(f"{prefix}[{i}]", v)

    for i, part in enumerate(parts):
        walk(str(i), part)
    return h.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="train until this many steps are done")
    parser.add_argument("--save-every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--no-checkpoint", action="store_true", help="train without Strata (reference run)")
    parser.add_argument("--wait-durable", action="store_true", help="wait for each save to commit")
    parser.add_argument("--out", help="write {'digest', 'resumed_from', 'steps'} as JSON here")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(int(os.environ.get("STRATA_EXAMPLE_THREADS", "1")))

    model = RecModel(args.tables, args.rows, args.dim)
    sparse_opt = torch.optim.SGD(model.tables.parameters(), lr=0.05)
    dense_params = [*model.bottom.parameters(), *model.top.parameters()]
    dense_opt = torch.optim.Adam(dense_params, lr=1e-3)  # state created lazily on the first step
    data = ClickStream(args.seed, args.tables, args.rows, args.batch)
    state: dict[str, Any] = {"model": model, "sparse_opt": sparse_opt, "dense_opt": dense_opt, "data": data}

    client = None
    resumed_from = None
    start = 0
    if not args.no_checkpoint:
        from trainer_client import CheckpointClient

        client = CheckpointClient()
        resumed_from = client.resume(state)
        if resumed_from is not None:
            start = resumed_from + 1
            print(f"resumed from step {resumed_from} (data position {data.position})", flush=True)
        else:
            print("no checkpoint found; starting from step 0", flush=True)

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
        if client is not None and (step + 1) % args.save_every == 0:
            handle = client.save(step, state)
            note = f"save {'skipped' if handle.skipped else 'staged'} ({handle.stall_s * 1e3:.1f} ms stall)"
            if args.wait_durable and not handle.skipped:
                handle.durable.result()
                note += ", committed"
            print(f"step {step:4d}  loss {loss.item():.4f}  {note}", flush=True)
    if client is not None:
        client.close()
    final = digest(model.state_dict(), sparse_opt.state_dict(), dense_opt.state_dict())
    print(f"trained to step {args.steps - 1} in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"FINAL_DIGEST {final}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"digest": final, "resumed_from": resumed_from, "steps": args.steps}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
