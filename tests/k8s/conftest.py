"""The emulated Kubernetes API for operator tests, served on the test's own event loop.

Tests using it are async: the server only answers while the test awaits (use `asyncio.sleep`, never
`time.sleep`), and blocking clients (the `kubernetes` package, subprocesses) must run off the loop
(`asyncio.to_thread`, `asyncio.create_subprocess_exec`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

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
