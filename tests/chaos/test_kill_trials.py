"""Kill -9 a trainer or its sidecar at injected points during saves, restart the
gang, and check that every restore returns the newest committed step and that
the final state equals an uninterrupted run's.

`make test` runs a few trials (STRATA_CHAOS_TRIALS, default 3); `make chaos`
runs many (default 100) and prints the counts.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sidecar import manifest as mf
from sidecar.store import open_store

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "examples" / "train_recsys.py"
STRATA = str(Path(sys.executable).parent / "strata")
ARGS = ["--steps", "24", "--save-every", "3", "--rows", "2000", "--batch", "256", "--tables", "2"]
SAVED_STEPS = list(range(2, 24, 3))
POINTS = [
    ("trainer", "client.stream.chunk"),
    ("trainer", "client.stream.footer"),
    ("trainer", "client.saved"),
    ("sidecar", "sidecar.receive.chunk"),
    ("sidecar", "sidecar.upload.object"),
    ("sidecar", "sidecar.manifest.before"),
    ("sidecar", "sidecar.commit.before"),
]


def start_sidecar(storage: str, endpoint: str, sock: Path, faults: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ, STRATA_FAULTS=faults, STRATA_S3_ENDPOINT=endpoint)
    with log.open("a") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [
                STRATA,
                "sidecar",
                "--storage",
                storage,
                "--socket",
                str(sock),
                "--metrics-port",
                "0",
                "--commit-timeout-s",
                "30",
                "--keep",
                "0",  # keep every step: the checks read the whole history
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc


def run_trainer(sock: Path, job: str, attempt: int, faults: str, out: Path, sidecar: subprocess.Popen):
    env = dict(
        os.environ,
        STRATA_SOCKET=str(sock),
        STRATA_JOB=job,
        STRATA_ATTEMPT=str(attempt),
        STRATA_FAULTS=faults,
        STRATA_WHEN_BUSY="wait",
        STRATA_CHUNK_BYTES=str(128 * 1024),
        STRATA_COMMIT_TIMEOUT_S="30",
    )
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), *ARGS, "--out", str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # The gang dies together: if the sidecar is killed, stop the trainer too (as the operator does).
    while proc.poll() is None:
        if sidecar.poll() is not None:
            proc.kill()
        time.sleep(0.05)
    assert proc.stdout is not None
    output = proc.stdout.read()
    proc.stdout.close()
    return proc.returncode, output


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def reference_digest(tmp: Path) -> str:
    out = tmp / "reference.json"
    subprocess.run(
        [sys.executable, str(EXAMPLE), *ARGS, "--no-checkpoint", "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return json.loads(out.read_text())["digest"]


def one_trial(rng: random.Random, tmp: Path, url: str, endpoint: str, reference: str) -> dict[str, int]:
    side, point = rng.choice(POINTS)
    step = rng.choice(SAVED_STEPS[1:])
    # Streams carry several chunks; every other point is reached once per save.
    nth = rng.randint(1, 3) if point.endswith("chunk") else 1
    spec = f"{point}@{step}#{nth}=kill"
    job = "chaos-" + uuid.uuid4().hex[:8]
    sock = Path(f"/tmp/strata-chaos-{uuid.uuid4().hex[:8]}.sock")
    log = tmp / f"{job}.log"
    store = open_store(url, endpoint_url=endpoint)
    counts = {"torn": 0, "lost": 0, "mismatch": 0, "fired": 0}
    sidecar = start_sidecar(url, endpoint, sock, spec if side == "sidecar" else "", log)
    try:
        code, out = run_trainer(sock, job, 0, spec if side == "trainer" else "", tmp / "a0.json", sidecar)
        fired = code == -signal.SIGKILL or sidecar.poll() == -signal.SIGKILL
        counts["fired"] = int(fired)
        if not fired:  # the point was never reached (e.g. a one-chunk stream): a clean run
            assert code == 0, out
            counts["mismatch"] = int(json.loads((tmp / "a0.json").read_text())["digest"] != reference)
            return counts
        if sidecar.poll() is not None:  # restart the sidecar too (fresh memory)
            sidecar = start_sidecar(url, endpoint, sock, "", log)
        code, out = run_trainer(sock, job, 1, "", tmp / "a1.json", sidecar)
        assert code == 0, out + log.read_text()
        match = re.search(r"resumed from step (\d+)", out)
        resumed = int(match.group(1)) if match else None
        committed = {
            s: mf.read_commit(store, "default", job, s) for s in mf.committed_steps(store, "default", job)
        }
        before = [s for s, c in committed.items() if c.attempt == 0]
        if resumed is not None and resumed not in committed:
            counts["torn"] = 1
        if before and (resumed is None or max(before) > resumed):
            counts["lost"] = 1
        counts["mismatch"] = int(json.loads((tmp / "a1.json").read_text())["digest"] != reference)
        if any(counts[k] for k in ("torn", "lost", "mismatch")):
            print(f"trial {spec} on {side}: {counts}, resumed {resumed}, committed {sorted(committed)}")
        return counts
    finally:
        stop(sidecar)
        sock.unlink(missing_ok=True)
        store.close()


@pytest.mark.timeout(3600)
def test_kill_trials(tmp_path, s3_store_url, seaweed):
    trials = int(os.environ.get("STRATA_CHAOS_TRIALS", "3"))
    seed = int(os.environ.get("STRATA_CHAOS_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    url, endpoint = s3_store_url
    reference = reference_digest(tmp_path)
    totals = {"torn": 0, "lost": 0, "mismatch": 0, "fired": 0}
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
    assert totals["torn"] == 0 and totals["lost"] == 0 and totals["mismatch"] == 0, (seed, summary)
    assert totals["fired"] == trials, "an injected kill did not fire: the trial tested nothing"
