"""torch.distributed set-up with the launcher's short process-group timeout.

A gang restart kills every rank at the first failure; the timeout is the
backstop when something else (a lost node) leaves survivors blocked in a
collective, so it should be short compared with torch's 30-minute default.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_process_group(backend: str | None = None) -> None:
    """``dist.init_process_group`` from the environment `strata launch` (or torchrun) sets."""
    if dist.is_initialized():
        return
    timeout = float(os.environ.get("STRATA_PG_TIMEOUT_S", "1800"))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
