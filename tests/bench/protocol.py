"""Protocol section: S3 requests per save as the S3 server sees them (a counting proxy in front
of SeaweedFS), 8 ranks with one sidecar each (hints between sidecars over loopback), with every
rank on time and with one rank 5 s late. Counted: everything but object and MANIFEST PUTs
(epochs, COMMIT, LATEST, hint verification, fallback polling, retention)."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from tests.bench.common import Options, Phases, Row

RANKS = 8
LATE_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _is_data_put(method: str, key: str) -> bool:
    return method in ("PUT", "POST") and ("/obj-" in key or key.endswith("/MANIFEST"))


def _kind(method: str, key: str, query: str) -> str:
    """What a control request is for, from its method and key (for the breakdown printed)."""
    if "list-type" in query or (method == "GET" and not key.strip("/").count("/")):
        what = "LIST " + ("EPOCH" if "EPOCH" in query else "steps")
        return what
    if "delete" in query:
        return "DELETE"
    for name in ("EPOCH", "COMMIT", "LATEST", "SKIPPED", "UNUSABLE", "MANIFEST"):
        if name in key:
            return f"{method} {name}"
    return f"{method} other"


def _control_per_save(opts: Options, proxy: Any, url: str, late_rank: int | None, saves: int) -> float:
    import torch

    from sidecar.config import SidecarSettings
    from sidecar.metrics import Metrics
    from sidecar.server import SidecarServer
    from trainer_client import CheckpointClient

    job = f"proto-{uuid.uuid4().hex[:8]}"
    ports = [_free_port() for _ in range(RANKS)]
    sock_dir = Path(f"/tmp/strata-bench-{uuid.uuid4().hex[:6]}")
    sock_dir.mkdir()
    servers, clients = [], []
    try:
        for r in range(RANKS):
            peers = ",".join(f"127.0.0.1:{p}" for i, p in enumerate(ports) if i != r)
            settings = SidecarSettings(
                storage=url,
                s3_endpoint=proxy.endpoint,
                socket=str(sock_dir / f"s{r}.sock"),
                metrics_port=0,
                shm_dir=str(opts.tmp),
                peer_port=ports[r],
                peers=peers,
                nice=0,
            )
            servers.append(SidecarServer(settings, metrics=Metrics()).start())
        for r in range(RANKS):
            clients.append(
                CheckpointClient(
                    job=job,
                    socket=servers[r].socket_path,
                    rank=r,
                    world_size=RANKS,
                    generation=f"{job}/0",
                    resume="never",
                    capture_rng=False,
                )
            )
        state = [{"w": torch.full((256 * 1024,), float(r))} for r in range(RANKS)]

        def save(step: int) -> None:
            def one(r: int) -> None:
                if r == late_rank:
                    time.sleep(LATE_S)
                clients[r].save(step, state[r]).durable.result(120)

            threads = [threading.Thread(target=one, args=(r,)) for r in range(RANKS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        for step in range(2):  # warm-up: connections, the epoch, the first full checkpoints
            save(step)
        time.sleep(0.5)  # retention of the warm-up runs after "committed"
        proxy.reset()
        for step in range(2, 2 + saves):
            save(step)
        time.sleep(0.5)
        control = [r for r in list(proxy.log) if not _is_data_put(r.method, r.key)]
        kinds = Counter(_kind(r.method, r.key, r.query) for r in control)
        print(
            "     per save: " + ", ".join(f"{k} {v / saves:.1f}" for k, v in kinds.most_common()), flush=True
        )
        return len(control) / saves
    finally:
        for c in clients:
            c.close(wait=False)
        for s in servers:
            s.stop(grace=1)
        for p in sock_dir.iterdir():
            p.unlink(missing_ok=True)
        sock_dir.rmdir()


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    from sidecar.local.seaweed import SeaweedServer
    from tests.integration.s3proxy import S3Proxy

    saves = 3 if opts.quick else 10
    with SeaweedServer(opts.tmp / "s3") as s3, S3Proxy(s3.endpoint) as proxy:
        s3.create_bucket("proto")
        with phases("8 ranks on time"):
            figures["s3_control_requests_per_save_8"] = _control_per_save(
                opts, proxy, "s3://proto/ckpt", None, saves
            )
        with phases("8 ranks, one late"):
            figures["s3_control_requests_per_save_8_slow"] = _control_per_save(
                opts, proxy, "s3://proto/ckpt", RANKS - 1, 2 if opts.quick else 4
            )
    return _rows(figures)


def _rows(f: dict[str, Any]) -> list[Row]:
    normal, slow = f.get("s3_control_requests_per_save_8"), f.get("s3_control_requests_per_save_8_slow")
    per_rank = None if normal is None else normal / RANKS
    ratio = None if normal is None or slow is None else slow / normal
    return [
        Row(
            "s3_control_requests_per_save_8",
            normal,
            "requests",
            per_rank,
            "per rank",
            "<= 3 per rank",
            None if per_rank is None else per_rank <= 3,
        ),
        Row(
            "s3_control_requests_per_save_8_slow",
            slow,
            "requests",
            ratio,
            "on time",
            f"<= 1.2x on time (one rank {LATE_S:.0f} s late)",
            None if ratio is None else ratio <= 1.2,
        ),
    ]
