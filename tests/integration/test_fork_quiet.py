"""A DataLoader with workers forks the trainer while its client is attached to the sidecar: no
gRPC fork-handler lines (``fork_posix.cc``) on its stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINER = """
import torch
from torch.utils.data import DataLoader
from trainer_client import CheckpointClient

state = {"w": torch.zeros(4)}
with CheckpointClient(capture_rng=False) as client:
    client.resume(state)
    for step in (1, 2):
        for _ in DataLoader(list(range(16)), batch_size=4, num_workers=2):
            pass
        client.save(step, state).durable.result(60)
print("done", flush=True)
"""


def test_dataloader_workers_next_to_a_client_print_no_grpc_fork_lines(make_sidecar, job_name):
    server = make_sidecar(None)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "GRPC_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        STRATA_JOB=job_name,
        STRATA_SOCKET=server.socket_path,
        GRPC_VERBOSITY="INFO",  # the level those lines are logged at: shown if they come
    )
    run = subprocess.run(
        [sys.executable, "-c", TRAINER], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stdout + run.stderr
    assert "fork_posix" not in run.stderr and "fork() handlers" not in run.stderr, run.stderr
