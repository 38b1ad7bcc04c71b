"""Kill -9 a random rank or the sidecar at injected points during saves of a
2-rank job under `strata launch`, and check what the gang restart restores.

Per trial: the restored step must be committed (else a torn restore), no step
committed by the first attempt may be newer than it (else a lost commit), and
the final state must equal an uninterrupted run's bit for bit.

`make test` runs a few trials (STRATA_CHAOS_TRIALS, default 3); `make chaos`
runs 100 and adds the counts to bench-results.json.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sidecar import manifest as mf
from sidecar.store import open_store

ROOT = Path(__file__).resolve().parents[2]
DDP = ROOT / "deploy" / "examples" / "train_ddp.py"
STRATA = str(Path(sys.executable).parent / "strata")
ARGS = ["--steps", "24", "--save-every", "3", "--rows", "2000", "--batch", "128", "--tables", "2"]
SAVED_STEPS = list(range(2, 24, 3))
RANK_POINTS = ["client.stream.chunk", "client.stream.footer", "client.saved"]
SIDECAR_POINTS = [
    "sidecar.receive.chunk",
    "sidecar.upload.object",
    "sidecar.manifest.before",
    "sidecar.commit.before",
]


def launch(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [STRATA, "launch", "--nproc", "2", "--backoff-s", "0", "--keep", "0", *args],
        env=dict(os.environ, STRATA_CHUNK_BYTES=str(64 * 1024), **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def one_trial(rng: random.Random, tmp: Path, url: str, endpoint: str, reference: str) -> dict[str, int]:
    target = rng.choice(["rank 0", "rank 1", "sidecar"])
    point = rng.choice(SIDECAR_POINTS if target == "sidecar" else RANK_POINTS)
    shm = rng.choice(["on", "off"])  # shared-memory saves, or bytes streamed in chunks
    # A chunked stream carries several chunks; a shared-memory save passes each point once.
    nth = rng.randint(1, 3) if point.endswith("chunk") and shm == "off" else 1
    spec = f"{point}@{rng.choice(SAVED_STEPS[1:])}#{nth}=kill"
    env = (
        {"STRATA_SIDECAR_FAULTS": spec}
        if target == "sidecar"
        else {"STRATA_FAULTS": spec, "STRATA_FAULTS_RANK": target[-1]}
    )
    env["STRATA_SHM"] = shm
    job = "chaos-" + uuid.uuid4().hex[:8]
    out = tmp / f"{job}.json"
    run = launch(
        [
            "--job",
            job,
            "--storage",
            url,
            "--s3-endpoint",
            endpoint,
            "--workdir",
            str(tmp / job),
            "--",
            sys.executable,
            str(DDP),
            *ARGS,
            "--out",
            str(out),
        ],
        env,
    )
    assert run.returncode == 0, f"{spec} on {target} (shm {shm}):\n{run.stdout}\n{run.stderr}"
    counts = {"fired": int("restarting all 2 ranks" in run.stderr), "torn": 0, "lost": 0, "mismatch": 0}
    result = json.loads(out.read_text())
    counts["mismatch"] = int(result["digest"] != reference)
    if counts["fired"]:
        store = open_store(url, endpoint_url=endpoint)
        try:
            commits = {
                s: mf.read_commit(store, "default", job, s) for s in mf.committed_steps(store, "default", job)
            }
        finally:
            store.close()
        resumed = result["resumed_from"]
        first_attempt = [s for s, c in commits.items() if c.attempt == 0]
        counts["torn"] = int(resumed is not None and resumed not in commits)
        counts["lost"] = int(bool(first_attempt) and (resumed is None or max(first_attempt) > resumed))
    if any(counts[k] for k in ("torn", "lost", "mismatch")):
        print(f"trial {spec} on {target} (shm {shm}): {counts}, resumed {result['resumed_from']}")
    return counts


@pytest.mark.timeout(5400)
def test_kill_trials(tmp_path, s3_store_url):
    trials = int(os.environ.get("STRATA_CHAOS_TRIALS", "3"))
    seed = int(os.environ.get("STRATA_CHAOS_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    url, endpoint = s3_store_url
    ref = launch(
        [
            "--job",
            "reference",
            "--storage",
            f"file://{tmp_path}/ref",
            "--workdir",
            str(tmp_path / "ref"),
            "--",
            sys.executable,
            str(DDP),
            *ARGS,
            "--no-checkpoint",
            "--out",
            str(tmp_path / "ref.json"),
        ],
        {},
    )
    assert ref.returncode == 0, ref.stderr
    reference = json.loads((tmp_path / "ref.json").read_text())["digest"]
    totals = {"fired": 0, "torn": 0, "lost": 0, "mismatch": 0}
    t0 = time.monotonic()
    for _ in range(trials):
        for k, v in one_trial(rng, tmp_path, url, endpoint, reference).items():
            totals[k] += v
    summary = {
        "fault_trials": trials,
        "fault_kills_fired": totals["fired"],
        "fault_torn_restores": totals["torn"],
        "fault_lost_commits": totals["lost"],
        "fault_final_state_mismatches": totals["mismatch"],
    }
    print(f"\nchaos (seed {seed}, {time.monotonic() - t0:.0f} s): {json.dumps(summary)}")
    results = os.environ.get("STRATA_CHAOS_RESULTS")
    if results:
        path = Path(results)
        data = json.loads(path.read_text()) if path.exists() else {}
        data.update(summary)
        path.write_text(json.dumps(data, indent=1, sort_keys=True))
    assert totals["torn"] == totals["lost"] == totals["mismatch"] == 0, (seed, summary)
    assert totals["fired"] == trials, f"an injected kill did not fire (seed {seed}): the trial tested nothing"
