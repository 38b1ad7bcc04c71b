"""Recovery section: discovery + restore with 10 vs 1,000 older checkpoints, and the
restart-to-resumed time of a 4-rank `strata launch` gang after a rank is killed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.bench.common import REPO_ROOT, MiB, Options, Phases, Row, median

DDP = REPO_ROOT / "deploy" / "examples" / "train_ddp.py"
STRATA = str(Path(sys.executable).parent / "strata")


def _fake_history(store: Any, job: str, steps: range) -> None:
    """Committed steps with a tiny state each: what discovery has to look past."""
    from sidecar import manifest as mf

    for step in steps:
        prefix = mf.rank_prefix("bench", job, step, 0, "hist", 0)
        store.put(prefix + "obj-00000", b"x")
        entry = mf.ObjectEntry(prefix + "obj-00000", 1, mf.crc32(b"x"))
        m = mf.Manifest("bench", job, step, 0, 1, 0, "hist", 1, {}, [], [entry])
        mf.write_manifest(store, prefix, m)
        mf.write_commit(store, "bench", job, step, 1, 0)


def _restore_time(
    url: str, endpoint: str, job: str, sock: Path, state_bytes: int, repeats: int
) -> list[float]:
    """A fresh sidecar (empty memory) and a fresh client each time: discovery + read + stream."""
    import torch

    from sidecar.config import SidecarSettings
    from sidecar.server import SidecarServer
    from trainer_client import CheckpointClient

    times = []
    for _ in range(repeats):
        server = SidecarServer(
            SidecarSettings(storage=url, socket=str(sock), metrics_port=0, s3_endpoint=endpoint, keep=0)
        ).start()
        try:
            state = {"w": torch.empty(state_bytes // 4)}
            t0 = time.perf_counter()
            client = CheckpointClient(job=job, namespace="bench", socket=str(sock), resume="never")
            client.restore(state)
            times.append(time.perf_counter() - t0)
            client.close(wait=False)
        finally:
            server.stop(grace=1)
    return times


def discovery(opts: Options, figures: dict[str, Any], phases: Phases) -> None:
    import torch

    from sidecar import manifest as mf
    from sidecar.config import SidecarSettings
    from sidecar.local.seaweed import SeaweedServer
    from sidecar.server import SidecarServer
    from sidecar.store import open_store
    from trainer_client import CheckpointClient

    state_bytes = (8 if opts.quick else 64) * MiB
    repeats = 3 if opts.quick else 5
    sock = Path(f"/tmp/strata-bench-{uuid.uuid4().hex[:8]}.sock")
    with SeaweedServer(opts.tmp / "s3") as s3:
        s3.create_bucket("recovery")
        url = "s3://recovery/ckpt"
        store = open_store(url, endpoint_url=s3.endpoint)
        for older in (10, 1000):
            job = f"disc-{older}"
            with phases(f"write {older} older checkpoints"):
                _fake_history(store, job, range(older))
            server = SidecarServer(
                SidecarSettings(
                    storage=url, socket=str(sock), metrics_port=0, s3_endpoint=s3.endpoint, keep=0
                )
            ).start()
            try:
                client = CheckpointClient(job=job, namespace="bench", socket=str(sock), resume="never")
                client.save(older, {"w": torch.rand(state_bytes // 4)}).durable.result(300)
                client.close()
            finally:
                server.stop(grace=5)
            store.requests.clear()
            assert mf.newest_committed(store, "bench", job) == older
            figures[f"discovery_requests_{older}"] = sum(store.requests.values())
            with phases(f"restore past {older} checkpoints"):
                figures[f"discovery_s_{older}"] = median(
                    _restore_time(url, s3.endpoint, job, sock, state_bytes, repeats)
                )
        figures["discovery_state_bytes"] = state_bytes
        store.close()


_STAMP = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) WARNING strata\.launch: .*stopped all ranks", re.M
)


def restart(opts: Options, figures: dict[str, Any], phases: Phases) -> None:
    """Kill rank 1 of a 4-rank gang mid-save; time from the launcher noticing to every rank restored."""
    args = ["--steps", "40", "--save-every", "10", "--rows", "20000" if not opts.quick else "2000"]
    env = dict(
        os.environ,
        STRATA_FAULTS="client.stream.chunk@29#1=kill",
        STRATA_FAULTS_RANK="1",
        STRATA_TEST_FAULTS="1",
    )
    with phases("4-rank gang restart"):
        run = subprocess.run(
            [
                STRATA,
                "launch",
                "--nproc",
                "4",
                "--job",
                "restart-bench",
                "--backoff-s",
                "0",
                "--workdir",
                str(opts.tmp / "launch"),
                "--",
                sys.executable,
                str(DDP),
                *args,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO_ROOT,
        )
    if run.returncode != 0:
        raise RuntimeError(f"gang restart run failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    figures["restart_to_resumed_s"] = resumed_after_failure(run)


def resumed_after_failure(run: subprocess.CompletedProcess[str]) -> float:
    """Seconds from the launcher stopping the ranks to the restarted gang's ``READY_AT``."""
    failed = _STAMP.search(run.stderr)
    ready = re.findall(r"READY_AT (\d+\.\d+)", run.stdout)
    if failed is None or len(ready) != 2:
        raise RuntimeError(f"could not find the failure and resume marks:\n{run.stderr[-2000:]}")
    return float(ready[1]) - datetime.strptime(failed.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    discovery(opts, figures, phases)
    restart(opts, figures, phases)
    return _rows(figures)


def _rows(f: dict[str, Any]) -> list[Row]:
    d10, d1000 = f.get("discovery_s_10"), f.get("discovery_s_1000")
    grows = None if d10 is None or d1000 is None else d1000 / d10
    return [
        Row("discovery_s_10", d10, "s", target="restore with 10 older steps"),
        Row(
            "discovery_s_1000",
            d1000,
            "s",
            grows,
            "discovery_s_10",
            "<= 1.5x (must not grow)",
            None if grows is None else grows <= 1.5,
        ),
        Row("discovery_requests_10", f.get("discovery_requests_10"), "requests"),
        Row(
            "discovery_requests_1000",
            f.get("discovery_requests_1000"),
            "requests",
            target="== with 10",
            passed=None
            if "discovery_requests_1000" not in f
            else f["discovery_requests_1000"] == f.get("discovery_requests_10"),
        ),
        Row(
            "restart_to_resumed_s", f.get("restart_to_resumed_s"), "s", target="4 ranks, kill -> all restored"
        ),
    ]
