"""TorchRec end to end: a DLRM trained by the usual epoch loop (StatefulDataLoader over a
StatefulDistributedSampler, ``set_epoch`` each epoch), killed mid-epoch in a later epoch by
`strata launch` and resumed with the defaults (overlapped staging on), ends bit-identical to an
uninterrupted run: tables, dense layers, optimizer state, data position and RNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torchrec

ROOT = Path(__file__).resolve().parents[2]
STRATA = str(Path(sys.executable).parent / "strata")
EXAMPLE = ROOT / "deploy" / "examples" / "train_torchrec.py"
# 10 batches an epoch on each rank: steps 12 and 16 are mid-epoch 1. Killed once step 16 was
# acknowledged, the job resumes from 16, or from 12 where another rank had not saved 16 yet.
ARGS = ["--batch", "16", "--epochs", "2", "--save-every", "4"]
KILL_AT_16 = {"STRATA_FAULTS": "client.saved@16=kill", "STRATA_TEST_FAULTS": "1"}


def launch(
    tmp_path: Path, nproc: int, job: str, args: list[str], env: dict[str, str]
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [STRATA, "launch", "--nproc", str(nproc), "--job", job, "--workdir", str(tmp_path / "w"),
         "--storage", f"file://{tmp_path}/store", "--backoff-s", "0.1", "--",
         sys.executable, str(EXAMPLE), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, **env),
    )  # fmt: skip


def uninterrupted(nproc: int, args: list[str], out: Path, tmp_path: Path) -> subprocess.Popen[str]:
    """The same run without Strata (under `strata launch` for its process group when nproc > 1)."""
    if nproc > 1:
        return launch(tmp_path / "ref", nproc, "ref", [*args, "--no-checkpoint", "--out", str(out)], {})
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), *args, "--no-checkpoint", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip


def finished(proc: subprocess.Popen[str]) -> str:
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout + stderr
    return stderr


@pytest.mark.parametrize(
    ("kind", "nproc", "extra"),
    [
        ("plain", 1, []),
        ("fused", 1, ["--rows", "20000", "--dim", "32"]),
        ("in_backward", 1, []),
        ("in_backward", 2, ["--dmp"]),
    ],
    ids=["plain", "fused-tbe", "in-backward", "dmp-2-ranks"],
)
def test_a_dlrm_killed_mid_epoch_resumes_bitwise(tmp_path, kind, nproc, extra):
    args = [*ARGS, "--samples", str(160 * nproc), "--kind", kind, *extra]
    out, ref = tmp_path / "out.json", tmp_path / "ref.json"
    reference = uninterrupted(nproc, args, ref, tmp_path)  # beside the killed run: it has a core
    killed = launch(
        tmp_path,
        nproc,
        f"dlrm-{kind}-{nproc}",
        [*args, "--out", str(out)],
        {**KILL_AT_16, "STRATA_FAULTS_RANK": str(nproc - 1)},
    )
    log = finished(killed)
    finished(reference)
    assert "was killed by SIGKILL" in log
    resumed, reference_run = json.loads(out.read_text()), json.loads(ref.read_text())
    assert resumed["resumed_from"] in (12, 16), log  # mid-epoch 1
    assert len(resumed["ranks"]) == nproc  # each rank's own tables and optimizer state, compared
    assert resumed["ranks"] == reference_run["ranks"]
