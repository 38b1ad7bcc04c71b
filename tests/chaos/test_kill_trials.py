"""Kill -9 a random rank or a random sidecar at injected points during saves of a
2-4 rank job under `strata launch --sidecars 2` (one sidecar per simulated pod),
and check what the gang restart restores. Every tenth trial instead runs a
zombie: a first launch whose sidecars never learn of newer attempts on their
commit path keeps training and committing while a second launch of the same job
supersedes it.

Per kill trial: every rank of an attempt restores the same step (else a
disagreement), the restored step must be committed (else a torn restore), no
step committed by the first attempt may be newer than it (else a lost commit),
and the final state must equal an uninterrupted run's bit for bit. Per zombie
trial: the superseding run resumes from a valid commit and ends bitwise equal,
the zombie's void commits exist in storage, and no reader returns any of them.

`make test` runs a few trials (STRATA_CHAOS_TRIALS, default 2); `make chaos`
runs 100 and adds the counts to bench-results.json.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar import manifest as mf
from sidecar.store import open_store
from tests.fixtures.chaos_results import record

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


SIDECARS = 2
RESUMED = re.compile(r"RESUMED rank=(\d+) restart=(\d+) step=(\S+)")


def launch(
    args: list[str], env: dict[str, str], nproc: int = 2, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [STRATA, "launch", "--nproc", str(nproc), "--backoff-s", "0", "--keep", "0", *args],
        # Small chunks: with replica-aware saves a rank may stream only tens of KiB (its share of the
        # replicated tensors), and a kill at its 3rd chunk must still find one.
        env=dict(os.environ, STRATA_CHUNK_BYTES=str(4 * 1024), **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def disagreements(stdout: str) -> int:
    """Attempts whose ranks resumed from different steps."""
    by_attempt: dict[str, set[str]] = {}
    for _, attempt, step in RESUMED.findall(stdout):
        by_attempt.setdefault(attempt, set()).add(step)
    return sum(len(steps) > 1 for steps in by_attempt.values())


def one_trial(
    rng: random.Random, tmp: Path, url: str, endpoint: str, reference: Callable[[int], str]
) -> dict[str, int]:
    nproc = rng.randint(2, 4)
    target = rng.choice([*(f"rank {r}" for r in range(nproc)), *(f"sidecar {i}" for i in range(SIDECARS))])
    point = rng.choice(SIDECAR_POINTS if target.startswith("sidecar") else RANK_POINTS)
    shm = rng.choice(["on", "off"])  # shared-memory saves, or bytes streamed in chunks
    # A chunked stream carries several chunks; a shared-memory save passes each point once.
    nth = rng.randint(1, 3) if point.endswith("chunk") and shm == "off" else 1
    spec = f"{point}@{rng.choice(SAVED_STEPS[1:])}#{nth}=kill"
    env = (
        {"STRATA_SIDECAR_FAULTS": spec, "STRATA_SIDECAR_FAULTS_INDEX": target.split()[-1]}
        if target.startswith("sidecar")
        else {"STRATA_FAULTS": spec, "STRATA_FAULTS_RANK": target.split()[-1]}
    )
    env["STRATA_TEST_FAULTS"] = "1"  # fault injection is test-only
    env["STRATA_SHM"] = shm
    job = "chaos-" + uuid.uuid4().hex[:8]
    out = tmp / f"{job}.json"
    run = launch(
        [
            "--sidecars",
            str(SIDECARS),
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
        nproc=nproc,
    )
    assert run.returncode == 0, f"{spec} on {target} (shm {shm}):\n{run.stdout}\n{run.stderr}"
    counts = {
        "fired": int(f"restarting all {nproc} ranks" in run.stderr),
        "torn": 0,
        "lost": 0,
        "mismatch": 0,
        "disagree": disagreements(run.stdout),
    }
    result = json.loads(out.read_text())
    # Bitwise final state with any number of ranks (the example keeps DDP's bucket layout fixed).
    counts["mismatch"] = int(result["digest"] != reference(nproc))
    store = open_store(url, endpoint_url=endpoint)
    try:
        commits = {
            s: mf.read_commit(store, "default", job, s) for s in mf.committed_steps(store, "default", job)
        }
        # Replica ownership (the example declares its DDP wrapper): in the newest commit every
        # replicated tensor is stored by exactly one rank; every rank owns a share, so a killed
        # rank is always a killed owner whose share the others restored.
        newest = commits[max(commits)] if commits else None
        manifests = [mf.load_manifest(store, newest, r) for r in range(newest.world_size)] if newest else []
    finally:
        store.close()
    replicated = {r.name for r in manifests[0].replicas} if manifests else set()
    stored = [t.name for m in manifests for t in m.tensors if t.name in replicated]
    counts["replicas"] = int(bool(replicated))
    counts["replica_errors"] = int(
        sorted(stored) != sorted(replicated)
        or any({r.name for r in m.replicas} != replicated for m in manifests)
    )
    counts["owner_kills"] = int(bool(counts["fired"] and replicated and target.startswith("rank")))
    if counts["fired"]:
        resumed = result["resumed_from"]
        first_attempt = [s for s, c in commits.items() if c.attempt == 0]
        counts["torn"] = int(resumed is not None and resumed not in commits)
        counts["lost"] = int(bool(first_attempt) and (resumed is None or max(first_attempt) > resumed))
    if any(counts[k] for k in ("torn", "lost", "mismatch", "disagree", "replica_errors")):
        print(
            f"trial {spec} on {target} ({nproc} ranks, shm {shm}): {counts}, resumed {result['resumed_from']}"
        )
    return counts


def zombie_trial(tmp: Path, url: str, endpoint: str, reference: Callable[[int], str]) -> dict[str, int]:
    """A launch that is superseded mid-run by a second launch of the same job, and keeps going."""
    job = "zombie-" + uuid.uuid4().hex[:8]
    common = ["--sidecars", str(SIDECARS), "--job", job, "--storage", url, "--s3-endpoint", endpoint]
    train = [sys.executable, str(DDP), *ARGS]
    zombie = subprocess.Popen(
        [
            STRATA,
            "launch",
            "--nproc",
            "2",
            "--keep",
            "0",
            *common,
            "--workdir",
            str(tmp / f"{job}-z"),
            "--",
            *train,
            "--step-sleep",
            "0.9",
            "--out",
            str(tmp / f"{job}-z.json"),
        ],
        env=dict(os.environ, STRATA_TEST_STALE_FENCES="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    store = open_store(url, endpoint_url=endpoint)
    try:
        deadline = time.monotonic() + 120
        while not mf.committed_steps(store, "default", job) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mf.committed_steps(store, "default", job), "the first launch committed nothing"
        out = tmp / f"{job}.json"
        run = launch([*common, "--workdir", str(tmp / job), "--", *train, "--out", str(out)], {})
        zombie_out, _ = zombie.communicate(timeout=300)
        assert run.returncode == 0, f"superseding launch:\n{run.stdout}\n{run.stderr}"
        assert zombie.returncode == 0, f"zombie launch:\n{zombie_out}"
        result = json.loads(out.read_text())
        fences = mf.read_fences(store, "default", job)
        written = {
            mf.parse_commit_key(o.key)
            for o in store.list(mf.job_prefix("default", job) + "steps/").objects
            if o.key.endswith("/COMMIT")
        }
        void = {p for p in written if not fences.valid(*p)}
        # What readers return: the newest, every listed step's commit, the superseding run's resume.
        seen = {mf.newest_valid(store, "default", job)}
        seen |= {
            (mf.read_commit(store, "default", job, s).attempt, s)
            for s in mf.committed_steps(store, "default", job)
        }
        # The superseding run's own restore point, as its attempt's EPOCH record names it.
        epochs = [
            mf.Epoch.from_json(store.get(o.key)) for o in store.list(mf.epoch_prefix("default", job)).objects
        ]
        zombie_gen = (tmp / f"{job}-z" / "generation").read_text().strip().rpartition("/")[0]
        seen |= {
            e.restore for e in epochs if e.restore is not None and not e.generation.startswith(zombie_gen)
        }
        resumed = result["resumed_from"]
        counts = {
            "zombie_written": len(void),
            "zombie_read": len(seen & void),
            "mismatch": int(result["digest"] != reference(2)),
            "torn": int(resumed is not None and resumed not in mf.committed_steps(store, "default", job)),
            "disagree": disagreements(run.stdout),
        }
    finally:
        if zombie.poll() is None:
            zombie.kill()
        store.close()
    print(f"zombie trial {job}: {counts}")
    return counts


@pytest.mark.slow  # make chaos runs it (100 trials), make test-slow a few; 30 s is too much for make test
@pytest.mark.timeout(5400)
def test_kill_trials(tmp_path, s3_store_url):
    trials = int(os.environ.get("STRATA_CHAOS_TRIALS", "2"))
    seed = int(os.environ.get("STRATA_CHAOS_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    url, endpoint = s3_store_url
    references: dict[int, str] = {}

    def reference(nproc: int) -> str:
        """The uninterrupted run's final digest with ``nproc`` ranks (DDP averages per world size)."""
        if nproc not in references:
            out = tmp_path / f"ref-{nproc}.json"
            ref = launch(
                [
                    "--job",
                    f"reference-{nproc}",
                    "--storage",
                    f"file://{tmp_path}/ref",
                    "--workdir",
                    str(tmp_path / f"ref-{nproc}"),
                    "--",
                    sys.executable,
                    str(DDP),
                    *ARGS,
                    "--no-checkpoint",
                    "--out",
                    str(out),
                ],
                {},
                nproc=nproc,
            )
            assert ref.returncode == 0, ref.stderr
            references[nproc] = json.loads(out.read_text())["digest"]
        return references[nproc]

    totals = {"fired": 0, "torn": 0, "lost": 0, "mismatch": 0, "disagree": 0}
    totals |= {"replicas": 0, "replica_errors": 0, "owner_kills": 0}
    totals |= {"zombie_written": 0, "zombie_read": 0}
    t0 = time.monotonic()
    zombies = max(1, trials // 10) if trials >= 3 else 0
    kills = trials - zombies
    for _ in range(kills):
        for k, v in one_trial(rng, tmp_path, url, endpoint, reference).items():
            totals[k] += v
    zombie_less = 0
    for _ in range(zombies):
        counts = zombie_trial(tmp_path, url, endpoint, reference)
        zombie_less += counts["zombie_written"] == 0
        for k, v in counts.items():
            totals[k] += v
    summary = {
        "fault_trials": trials,
        "fault_sidecars": SIDECARS,
        "fault_kills_fired": totals["fired"],
        "fault_torn_restores": totals["torn"],
        "fault_lost_commits": totals["lost"],
        "fault_final_state_mismatches": totals["mismatch"],
        "fault_rank_step_disagreements": totals["disagree"],
        "fault_zombie_trials": zombies,
        "fault_zombie_commits_written": totals["zombie_written"],
        "fault_zombie_commits_read": totals["zombie_read"],
        "fault_replica_trials": totals["replicas"],
        "fault_replica_ownership_errors": totals["replica_errors"],
        "fault_replica_owner_kills": totals["owner_kills"],
    }
    print(f"\nchaos (seed {seed}, {time.monotonic() - t0:.0f} s): {json.dumps(summary)}")
    record(summary)
    assert totals["torn"] == totals["lost"] == totals["mismatch"] == totals["disagree"] == 0, (seed, summary)
    assert totals["zombie_read"] == 0, (seed, summary)
    assert totals["replica_errors"] == 0 and totals["replicas"] == kills, (seed, summary)
    assert totals["fired"] == kills, f"an injected kill did not fire (seed {seed}): the trial tested nothing"
    assert zombie_less == 0, f"{zombie_less} zombie trial(s) wrote no void commit: tested nothing ({summary})"
