#!/usr/bin/env python
"""A training loop the way most scripts are written: a default data loader (shuffled, no
generator of its own), dropout, a few epochs, a checkpoint every few steps. Killed and resumed
by `strata launch`, it ends bit-identical to an uninterrupted run:

    strata launch --job loader -- python deploy/examples/train_loader.py --loader stateful
    strata launch --job loader -- python deploy/examples/train_loader.py --loader resumable --workers 2

``--loader stateful``: torchdata's StatefulDataLoader, put in the state as it is.
``--loader resumable``: a plain DataLoader over a ResumableDistributedSampler in a ResumableLoader;
its dataset draws noise per sample in the workers (augmentations). Rank 0 prints ``FINAL_DIGEST``.
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
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainer_client import CheckpointClient
from trainer_client.data import ResumableDistributedSampler, ResumableLoader


class Samples(Dataset[torch.Tensor]):
    def __init__(self, n: int, noisy: bool) -> None:
        self.n, self.noisy = n, noisy

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.linspace(-1.0, 1.0, 16) * (i + 1) / self.n
        return x + 0.1 * torch.rand(16) if self.noisy else x  # an augmentation


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loader", choices=["stateful", "resumable"], default="stateful")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--no-checkpoint", action="store_true", help="train without Strata (reference run)")
    p.add_argument("--out", help="writes {'digest', 'resumed_from'} here")
    args = p.parse_args()

    torch.manual_seed(0)  # as scripts do: the global generator seeds everything
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader: Any
    if args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(
            Samples(args.samples, noisy=False), batch_size=args.batch, shuffle=True, num_workers=args.workers
        )
    else:
        sampler = ResumableDistributedSampler(args.samples, seed=7)
        loader = ResumableLoader(
            DataLoader(
                Samples(args.samples, noisy=True),
                batch_size=args.batch,
                sampler=sampler,
                num_workers=args.workers,
            )
        )
    state: dict[str, Any] = {"model": model, "opt": opt, "data": loader, "epoch": 0}
    client = None if args.no_checkpoint else CheckpointClient(capture_rng=True)
    resumed = client.resume(state) if client is not None else None
    step = 0 if resumed is None else resumed + 1
    print(f"RESUMED step={resumed}", flush=True)
    for epoch in range(state["epoch"], args.epochs):
        state["epoch"] = epoch
        if isinstance(loader, ResumableLoader):
            loader.set_epoch(epoch)
        for batch in loader:
            opt.zero_grad()
            model(batch).square().mean().backward()
            opt.step()
            if client is not None and step % args.save_every == 0:
                client.save(step, state)
            step += 1
        state["epoch"] = epoch + 1  # a checkpoint after this epoch's last batch starts the next
    if client is not None:
        client.close()
    # the parameters and where the global generator ended: both must match an uninterrupted run
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    h.update(torch.get_rng_state().numpy().tobytes())
    final = h.hexdigest()[:16]
    print(f"FINAL_DIGEST {final}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"digest": final, "resumed_from": resumed}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("STRATA_WHEN_BUSY", "wait")  # every planned save happens (a test kills at one)
    sys.exit(main())
