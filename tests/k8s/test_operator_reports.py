"""End to end: a real `strata sidecar` (real gRPC, SeaweedFS) in a pod of an operator-managed Job
reports its commits and heartbeats to the real operator, which writes Checkpoints and the
StrataJob; with the operator down, commits go on and the Checkpoints catch up when it is back."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from sidecar import reporting
from sidecar.config import SidecarSettings
from sidecar.metrics import Metrics
from sidecar.operator import names
from sidecar.server import SidecarServer
from tests.k8s.cluster import Cluster, indexed_job
from tests.k8s.conftest import K8s, call, kubectl
from tests.k8s.emulator import Token
from tests.k8s.test_crds import install_crds, rows
from tests.k8s.test_operator import operator, start_job, status_of, until
from trainer_client import CheckpointClient

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

CHECKPOINTS = "/apis/strata.dev/v1alpha1/namespaces/default/checkpoints"


@pytest_asyncio.fixture
async def cluster(k8s: K8s) -> AsyncIterator[Cluster]:
    await install_crds(k8s)
    async with Cluster(k8s, termination_s=1.0).running() as running:
        yield running


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def checkpoint(k8s: K8s, name: str) -> dict[str, Any] | None:
    status, body = await call(k8s, "GET", f"{CHECKPOINTS}/{name}")
    return body if status == 200 and (body.get("status") or {}).get("ready") else None


async def test_operator_reports_from_a_real_sidecar_become_checkpoints_and_catch_up_after_an_outage(
    k8s: K8s,
    cluster: Cluster,
    s3_store_url: tuple[str, str],
    short_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reporting, "BACKOFF_INITIAL_S", 0.05)
    monkeypatch.setattr(reporting, "BACKOFF_MAX_S", 0.3)
    url, endpoint = s3_store_url
    port = free_port()
    async with operator(k8s, report_port=port):
        _, [pod] = await start_job(k8s, cluster, indexed_job("recsys", 1))
        # What the injection gives the sidecar: the pod's projected token and downward-API files.
        k8s.api.tokens["pod-token"] = Token(
            namespace="default",
            service_account="default",
            pod_name=pod["metadata"]["name"],
            pod_uid=pod["metadata"]["uid"],
            audiences=[names.REPORT_AUDIENCE],
            expires=time.time() + 3600,
        )
        (short_tmp / "token").write_text("pod-token")
        (short_tmp / "generation").write_text(pod["metadata"]["annotations"][names.GENERATION_ANNOTATION])
        settings = SidecarSettings(
            storage=url,
            s3_endpoint=endpoint,
            socket=str(short_tmp / "sc.sock"),
            shm_dir=str(short_tmp),
            metrics_port=0,
            keep=0,
            generation_file=str(short_tmp / "generation"),
            report_url=f"http://127.0.0.1:{port}",
            report_token_file=str(short_tmp / "token"),
            heartbeat_s=0.2,
        )
        server = await asyncio.to_thread(lambda: SidecarServer(settings, metrics=Metrics()).start())
        client = await asyncio.to_thread(
            CheckpointClient, job="recsys", socket=server.socket_path, connect_timeout_s=10.0
        )
        try:
            state = {"w": torch.arange(64.0), "emb": torch.zeros(256, 8)}

            async def save(step: int) -> None:
                state["emb"][step % 256] += 1  # a few rows change: the policy may write a diff
                await asyncio.to_thread(lambda: client.save(step, state).durable.result(60))

            for step in (100, 200):
                await save(step)
            first = await until(lambda: checkpoint(k8s, "recsys-000000000200"), message="Checkpoint 200")
            assert first["spec"]["attempt"] >= 0 and first["spec"]["ranks"][0]["rank"] == 0
            assert first["spec"]["location"].startswith("s3://") and "@" not in first["spec"]["location"]
            assert first["metadata"]["labels"][names.LATEST_LABEL] == "true"
            status = await until(lambda: _with_step(k8s, "recsys", 200), message="StrataJob at step 200")
            assert status["attempt"] == first["spec"]["attempt"]  # learnt from the heartbeats
            table = rows(await kubectl(k8s, "get", "checkpoints"))
            assert [r[0] for r in table[1:]] == ["recsys-000000000100", "recsys-000000000200"]
            await kubectl(k8s, "get", "stratajobs")
            await kubectl(k8s, "describe", "checkpoint", "recsys-000000000200")
        except BaseException:
            await asyncio.to_thread(client.close)
            await asyncio.to_thread(server.stop, 1)
            raise
    try:
        # The operator is down: commits go on (it is never on the commit path).
        for step in (300, 400):
            await save(step)
        assert await checkpoint(k8s, "recsys-000000000400") is None
        async with operator(k8s, report_port=port):
            # Back: the sidecar's queued reports arrive.
            await until(lambda: checkpoint(k8s, "recsys-000000000400"), timeout=30, message="Checkpoint 400")
            await until(lambda: _with_step(k8s, "recsys", 400), message="StrataJob at step 400")
            latest = rows(await kubectl(k8s, "get", "checkpoints", "-l", f"{names.LATEST_LABEL}=true"))
            assert [r[0] for r in latest[1:]] == ["recsys-000000000400"]
    finally:
        await asyncio.to_thread(client.close)
        await asyncio.to_thread(server.stop, 1)


async def _with_step(k8s: K8s, name: str, step: int) -> dict[str, Any] | None:
    status = await status_of(k8s, name)
    return status if status.get("latestStep") == step else None
