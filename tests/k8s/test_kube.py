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


async def test_api_client_tells_a_disruption_budget_429_from_priority_and_fairness(k8s: K8s) -> None:
    pod = {"metadata": {"name": "p", "namespace": "default"}, "spec": {"containers": [{"name": "c"}]}}
    api = Api(k8s.url)
    try:
        await api.create(path("", "v1", "pods", "default"), pod)
        eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "p"}}
        url = path("", "v1", "pods", "default", "p", "eviction")
        k8s.api.pdb_blocked.add(("default", "p"))
        with pytest.raises(ApiError) as budget:
            await api.create(url, eviction)
        k8s.api.pdb_blocked.clear()
        k8s.api.apf_throttled[("default", "p")] = 1
        with pytest.raises(ApiError) as busy:
            await api.create(url, eviction)
    finally:
        await api.close()
    assert budget.value.status == busy.value.status == 429
    assert budget.value.disruption_budget and budget.value.causes == ("DisruptionBudget",)
    assert not busy.value.disruption_budget and busy.value.retry_after == 1.0
