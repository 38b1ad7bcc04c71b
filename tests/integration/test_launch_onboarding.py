"""`strata launch` as a new user runs the examples: each script is its own job with its own workdir,
the launcher says where the run's checkpoints are, and --keep-storage leaves them servable."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

STRATA = str(Path(sys.executable).parent / "strata")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """\
import torch
from trainer_client import CheckpointClient

state = {"w": torch.zeros(2)}
with CheckpointClient() as client:
    resumed = client.resume(state)
    client.save(7 if resumed is None else resumed + 1, state).durable.result(60)
print("RESUMED", resumed)
"""


def launch(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_"))}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [STRATA, "launch", "--nproc", "1", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_two_scripts_are_two_jobs_and_a_rerun_resumes(tmp_path):
    for name in ("first.py", "second.py"):
        (tmp_path / name).write_text(SCRIPT)
    store = f"file://{tmp_path}/store"
    runs = [
        launch(tmp_path, "--storage", store, "--", sys.executable, name) for name in ("first.py", "second.py")
    ]
    for run, job in zip(runs, ("first", "second"), strict=True):
        assert run.returncode == 0, run.stdout + run.stderr
        assert "RESUMED None" in run.stdout  # not the other script's step 7
        assert f"strata launch: job default/{job}, 1 rank(s)" in run.stderr
        assert f"workdir  .strata/launch/{job}" in run.stderr
        assert f"storage  {store}" in run.stderr
        assert (tmp_path / ".strata" / "launch" / job / "sidecar.log").is_file()
    again = launch(tmp_path, "--storage", store, "--", sys.executable, "first.py")
    assert "RESUMED 7" in again.stdout, again.stdout + again.stderr


@pytest.mark.slow
def test_keep_storage_leaves_the_run_listable(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    run = launch(tmp_path, "--keep-storage", "--", sys.executable, "train.py")
    pid = None
    try:
        assert run.returncode == 0, run.stdout + run.stderr
        found = re.search(r"keeps running \(pid (\d+)\)", run.stderr)
        assert found, run.stderr
        pid = int(found.group(1))
        ls = re.search(r"^  (strata ls .*)$", run.stderr, re.M)
        assert ls and "--job train" in ls.group(1), run.stderr
        argv = shlex.split(ls.group(1))
        listed = subprocess.run([STRATA, *argv[1:]], capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert re.search(r"^\s+7\s+1\s", listed.stdout, re.M), listed.stdout
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
