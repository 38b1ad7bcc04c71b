"""The operator's API client against the emulated API: errors, and a rotating token re-read."""

from __future__ import annotations

import pytest

from sidecar.operator.kube import Api, ApiError, path
from tests.k8s.conftest import K8s

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


async def test_api_client_reads_a_rotated_token_before_each_request(k8s: K8s) -> None:
    tokens = iter(["Bearer first", "Bearer second"])
    api = Api(k8s.url, {"Authorization": "Bearer stale"}, refresh=lambda: next(tokens))
    try:
        assert await api.get(path("", "v1", "pods", "default", "nope")) is None
        await api.request("GET", path("", "v1", "pods", "default"))
    finally:
        await api.close()
    sent = [r.headers.get("Authorization") for r in k8s.api if r.resource is not None]
    assert sent[-2:] == ["Bearer first", "Bearer second"]
    assert api.calls == 2


async def test_api_client_names_the_status_and_refuses_calls_after_close(k8s: K8s) -> None:
    api = Api(k8s.url)
    with pytest.raises(ApiError) as failed:
        await api.create(path("", "v1", "pods", "default"), {"metadata": {}})
    assert failed.value.status == 422 and "name" in failed.value.message
    await api.close()
    with pytest.raises(ApiError, match="closed"):
        await api.get(path("", "v1", "pods", "default", "x"))
