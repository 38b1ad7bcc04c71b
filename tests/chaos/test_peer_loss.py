"""Random member loss with peer redundancy: each trial saves two steps on 3-6 simulated pods
(in-process sidecars, one rank each, buddy or parity at random), loses one random member (its
sidecar stopped, its memory and redundancy directory wiped, a fresh sidecar in its place) or, in
one trial of five with parity, two members of one group, and restarts the gang.

Per trial: every rank must restore the newest step bit for bit (else a torn restore); after a
single loss the lost member must read none of its snapshot's objects from storage (its share
comes from the other members' memory); after a double loss it must read them (parity cannot
rebuild two members, and says so).

`make test` runs a few trials (STRATA_CHAOS_TRIALS, default 2); `make chaos` runs 100 and adds
the counts (``peer_loss_*``) to bench-results.json.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from tests.fixtures.chaos_results import record
from tests.fixtures.member_pods import Pods, check_equal, data_gets, restore_all, save_all, settled


def one_trial(rng: random.Random, root: Path) -> dict[str, int]:
    mode = rng.choice(["buddy", "parity"])
    n = rng.randint(3, 6)
    group = rng.randint(3, n) if mode == "parity" else 4
    pods = Pods(root, n, mode, parity_group=group)
    job = "pl-" + uuid.uuid4().hex[:8]
    counts = {"single": 0, "double": 0, "torn": 0, "s3_reads": 0, "double_not_storage": 0, "unprotected": 0}
    try:
        clients = None
        for step in (1, 2):
            # Saved back to back: step 1's push may find step 2 committed and give way to it.
            clients = save_all(pods, job, step, clients=clients)
        if not settled(lambda: pods.protected(job, 2), True):
            counts["unprotected"] += 1
        for c in clients or []:
            c.close()
        double = mode == "parity" and rng.random() < 0.2
        if double:
            members = pods.servers[0].engine.redundancy.members  # type: ignore[union-attr]
            assert members is not None
            lost = rng.sample(members.group(group, rng.randrange(n)), 2)
        else:
            lost = [rng.randrange(n)]
        for i in lost:
            pods.stop(i, wipe=True)
            pods.start(i)
        results = restore_all(pods, job, "run/1")
        for i, (target, info) in enumerate(results):
            try:
                check_equal(target, i, 2)
            except AssertionError:
                counts["torn"] += 1
            if info["step"] != 2:
                counts["torn"] += 1
        if double:
            counts["double"] += 1
            counts["double_not_storage"] += sum(results[i][1]["source"] != "storage" for i in lost)
        else:
            counts["single"] += 1
            counts["s3_reads"] += len(data_gets(pods, lost[0], job))
    finally:
        pods.close()
    return counts


def test_random_member_loss_is_rebuilt_from_peers():
    trials = int(os.environ.get("STRATA_CHAOS_TRIALS", "2"))
    seed = int(os.environ.get("STRATA_CHAOS_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    t0 = time.monotonic()
    totals: dict[str, int] = {}
    for _ in range(trials):
        root = Path(tempfile.mkdtemp(prefix="pl-", dir="/tmp"))
        try:
            for k, v in one_trial(rng, root).items():
                totals[k] = totals.get(k, 0) + v
        finally:
            shutil.rmtree(root, ignore_errors=True)
    summary = {
        "peer_loss_trials": trials,
        "peer_loss_single_losses": totals["single"],
        "peer_loss_double_losses": totals["double"],
        "peer_loss_torn_restores": totals["torn"],
        "peer_loss_s3_reads": totals["s3_reads"],
        "peer_loss_double_not_from_storage": totals["double_not_storage"],
        "peer_loss_unprotected_steps": totals["unprotected"],
    }
    print(f"\npeer loss (seed {seed}, {time.monotonic() - t0:.0f} s): {json.dumps(summary)}")
    record(summary)
    assert totals["torn"] == 0, (seed, summary)
    assert totals["unprotected"] == 0, (seed, summary)
    assert totals["s3_reads"] == 0, (seed, summary)
    assert totals["double_not_storage"] == 0, (seed, summary)
