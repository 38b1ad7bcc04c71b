"""The emulated Kubernetes API fills the gaps of kmock's emulator that a real operator and kubectl hit.

All tests are async: the emulator answers on the test's event loop, so blocking clients run in
threads (`asyncio.to_thread`) or subprocesses (`asyncio.create_subprocess_exec`).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import kubernetes
import pytest

from tests.k8s.conftest import K8s, call, kubectl, post_event

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

PODS = "/api/v1/namespaces/default/pods"
WIDGETS = "/apis/strata.dev/v1/namespaces/default/widgets"

WIDGET_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.strata.dev"},
    "spec": {
        "group": "strata.dev",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                    {
                        "name": "Ready",
                        "type": "string",
                        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
                    },
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
            }
        ],
    },
}


def pod(name: str, labels: dict[str, str] | None = None, phase: str | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"containers": [{"name": "main", "image": "busybox"}]},
    }
    if phase:
        obj["status"] = {"phase": phase}
    return obj


def names(listing: dict[str, Any]) -> set[str]:
    return {item["metadata"]["name"] for item in listing["items"]}


async def test_resource_version_set_and_bumped_on_every_write_and_honoured_by_watch(k8s: K8s) -> None:
    core = kubernetes.client.CoreV1Api()
    created = await asyncio.to_thread(
        core.create_namespaced_config_map,
        "default",
        kubernetes.client.V1ConfigMap(metadata=kubernetes.client.V1ObjectMeta(name="cm"), data={"a": "1"}),
    )
    assert created.metadata is not None and created.metadata.resource_version is not None
    rv1 = int(created.metadata.resource_version)
    assert created.metadata.uid and created.metadata.creation_timestamp
    patched = await asyncio.to_thread(core.patch_namespaced_config_map, "cm", "default", {"data": {"a": "2"}})
    assert patched.metadata is not None and patched.metadata.resource_version is not None
    rv2 = int(patched.metadata.resource_version)
    assert rv2 > rv1

    status, listing = await call(k8s, "GET", "/api/v1/namespaces/default/configmaps")
    assert status == 200 and int(listing["metadata"]["resourceVersion"]) >= rv2
    assert listing["items"][0]["metadata"]["resourceVersion"] == str(rv2)

    # A stale resourceVersion in a patch is a conflict, as on the apiserver.
    status, body = await call(
        k8s,
        "PATCH",
        "/api/v1/namespaces/default/configmaps/cm",
        {"metadata": {"resourceVersion": str(rv1)}, "data": {"a": "3"}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert status == 409 and body["kind"] == "Status" and body["reason"] == "Conflict"

    # A watch from rv1 replays what came after it (the MODIFIED at rv2), not a fresh ADDED of everything.
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            k8s.url + "/api/v1/namespaces/default/configmaps",
            params={"watch": "true", "resourceVersion": str(rv1)},
        ) as response,
    ):
        line = await asyncio.wait_for(response.content.readline(), 5)
        event = json.loads(line)
    assert event["type"] == "MODIFIED"
    assert event["object"]["metadata"]["resourceVersion"] == str(rv2)
    assert event["object"]["data"] == {"a": "2"}


async def test_generate_name_yields_unique_names(k8s: K8s) -> None:
    made = []
    for _ in range(20):
        obj = pod("")
        del obj["metadata"]["name"]
        obj["metadata"]["generateName"] = "worker-"
        status, body = await call(k8s, "POST", PODS, obj)
        assert status == 200, body
        made.append(body["metadata"]["name"])
    assert len(set(made)) == 20
    assert all(name.startswith("worker-") and len(name) == len("worker-") + 5 for name in made)
    status, listing = await call(k8s, "GET", PODS)
    assert names(listing) == set(made)


async def test_failed_json_patch_test_op_is_422_with_status(k8s: K8s) -> None:
    await call(k8s, "POST", PODS, pod("p", labels={"gen": "1"}))
    patch = [
        {"op": "test", "path": "/metadata/labels/gen", "value": "0"},
        {"op": "replace", "path": "/metadata/labels/gen", "value": "2"},
    ]
    headers = {"Content-Type": "application/json-patch+json"}
    status, body = await call(k8s, "PATCH", PODS + "/p", patch, headers=headers)
    assert status == 422
    assert body["kind"] == "Status" and body["status"] == "Failure" and body["code"] == 422
    assert body["reason"] == "Invalid"
    status, obj = await call(k8s, "GET", PODS + "/p")
    assert obj["metadata"]["labels"] == {"gen": "1"}

    # The same patch with a passing test applies.
    patch[0]["value"] = "1"
    status, obj = await call(k8s, "PATCH", PODS + "/p", patch, headers=headers)
    assert status == 200 and obj["metadata"]["labels"] == {"gen": "2"}


async def test_label_and_field_selectors_filter_lists_and_watches(k8s: K8s) -> None:
    await call(k8s, "POST", PODS, pod("a1", {"app": "a", "tier": "web"}, "Running"))
    await call(k8s, "POST", PODS, pod("a2", {"app": "a"}, "Pending"))
    await call(k8s, "POST", PODS, pod("b1", {"app": "b"}, "Running"))
    await call(k8s, "POST", "/api/v1/namespaces/other/pods", pod("c1", {"app": "c"}, "Running"))

    async def listed(path: str = PODS, **params: str) -> set[str]:
        status, body = await call(k8s, "GET", path, params=params)
        assert status == 200, body
        return names(body)

    assert await listed(labelSelector="app=a") == {"a1", "a2"}
    assert await listed(labelSelector="app==a,tier=web") == {"a1"}
    assert await listed(labelSelector="app!=a") == {"b1"}
    assert await listed(labelSelector="app in (a, b),!tier") == {"a2", "b1"}
    assert await listed(labelSelector="app notin (a)") == {"b1"}
    assert await listed(labelSelector="tier") == {"a1"}
    assert await listed(fieldSelector="metadata.name=a2") == {"a2"}
    assert await listed(fieldSelector="status.phase=Running") == {"a1", "b1"}
    assert await listed(fieldSelector="status.phase!=Running") == {"a2"}
    assert await listed("/api/v1/pods", fieldSelector="metadata.namespace=other") == {"c1"}
    assert await listed("/api/v1/pods", labelSelector="app", fieldSelector="status.phase=Running") == {
        "a1",
        "b1",
        "c1",
    }

    # A watch with a selector streams only matching objects, existing and new.
    async with (
        aiohttp.ClientSession() as session,
        session.get(k8s.url + PODS, params={"watch": "true", "labelSelector": "app=b"}) as response,
    ):
        first = json.loads(await asyncio.wait_for(response.content.readline(), 5))
        await call(k8s, "POST", PODS, pod("a3", {"app": "a"}))
        await call(k8s, "POST", PODS, pod("b2", {"app": "b"}))
        second = json.loads(await asyncio.wait_for(response.content.readline(), 5))
    assert (first["type"], first["object"]["metadata"]["name"]) == ("ADDED", "b1")
    assert (second["type"], second["object"]["metadata"]["name"]) == ("ADDED", "b2")


async def test_put_replaces_the_object(k8s: K8s) -> None:
    status, created = await call(k8s, "POST", PODS, pod("p", {"keep": "no", "x": "1"}))
    replacement = pod("p", {"x": "2"})
    replacement["metadata"]["resourceVersion"] = created["metadata"]["resourceVersion"]
    status, body = await call(k8s, "PUT", PODS + "/p", replacement)
    assert status == 200, body
    assert body["metadata"]["labels"] == {"x": "2"}  # replaced, not merged
    assert body["metadata"]["uid"] == created["metadata"]["uid"]
    assert int(body["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    status, fetched = await call(k8s, "GET", PODS + "/p")
    assert fetched["metadata"]["labels"] == {"x": "2"}

    # The stale resourceVersion now conflicts; a missing object is 404.
    status, body = await call(k8s, "PUT", PODS + "/p", replacement)
    assert status == 409 and body["reason"] == "Conflict"
    status, body = await call(k8s, "PUT", PODS + "/nope", pod("nope"))
    assert status == 404


async def test_collection_delete_honours_selectors_and_finalizers(k8s: K8s) -> None:
    await call(k8s, "POST", PODS, pod("a1", {"app": "a"}))
    held = pod("a2", {"app": "a"})
    held["metadata"]["finalizers"] = ["strata.dev/hold"]
    await call(k8s, "POST", PODS, held)
    await call(k8s, "POST", PODS, pod("b1", {"app": "b"}))

    status, body = await call(k8s, "DELETE", PODS, params={"labelSelector": "app=a"})
    assert status == 200 and body["status"] == "Success"
    status, listing = await call(k8s, "GET", PODS)
    assert names(listing) == {"a2", "b1"}  # a2 waits for its finalizer
    a2 = next(item for item in listing["items"] if item["metadata"]["name"] == "a2")
    assert a2["metadata"]["deletionTimestamp"]

    # Releasing the finalizer completes the deletion.
    await call(
        k8s,
        "PATCH",
        PODS + "/a2",
        {"metadata": {"finalizers": None}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    status, listing = await call(k8s, "GET", PODS)
    assert names(listing) == {"b1"}
    status, _ = await call(k8s, "DELETE", PODS)
    status, listing = await call(k8s, "GET", PODS)
    assert names(listing) == set()


TABLE_ACCEPT = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"


async def test_table_from_crd_printer_columns_else_name_and_age(k8s: K8s) -> None:
    status, body = await call(
        k8s, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", WIDGET_CRD
    )
    assert status == 200, body
    widget = {
        "apiVersion": "strata.dev/v1",
        "kind": "Widget",
        "metadata": {"name": "w1"},
        "spec": {"size": 3},
        "status": {"conditions": [{"type": "Other", "status": "False"}, {"type": "Ready", "status": "True"}]},
    }
    status, body = await call(k8s, "POST", WIDGETS, widget)
    assert status == 200, body

    status, table = await call(k8s, "GET", WIDGETS, headers={"Accept": TABLE_ACCEPT})
    assert status == 200, table
    assert (table["apiVersion"], table["kind"]) == ("meta.k8s.io/v1", "Table")
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Size", "Ready", "Age"]
    [row] = table["rows"]
    assert row["cells"][:3] == ["w1", 3, "True"]
    assert row["cells"][3].endswith("s")
    assert row["object"]["metadata"]["name"] == "w1"

    # Without printer columns (a built-in kind here): Name and Age.
    await call(k8s, "POST", PODS, pod("p"))
    status, table = await call(k8s, "GET", PODS, headers={"Accept": TABLE_ACCEPT})
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Age"]
    assert table["rows"][0]["cells"][0] == "p"

    # The CRD made its resource discoverable.
    status, discovery = await call(k8s, "GET", "/apis/strata.dev/v1")
    assert status == 200
    [resource] = [r for r in discovery["resources"] if r["name"] == "widgets"]
    assert resource["kind"] == "Widget" and resource["namespaced"] is True


async def test_real_kubectl_get_and_describe(k8s: K8s) -> None:
    await call(k8s, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", WIDGET_CRD)
    widget = {
        "apiVersion": "strata.dev/v1",
        "kind": "Widget",
        "metadata": {"name": "w1"},
        "spec": {"size": 7},
    }
    await call(k8s, "POST", WIDGETS, widget)
    status, created = await call(k8s, "POST", PODS, pod("trainer-0", {"app": "train"}, "Running"))
    assert status == 200
    await post_event(k8s, created, "CheckpointCommitted", "step 42 committed")

    listing = await kubectl(k8s, "get", "widgets")
    header, row = listing.strip().splitlines()
    assert header.split() == ["NAME", "SIZE", "READY", "AGE"]
    assert row.split()[:2] == ["w1", "7"]

    as_json = json.loads(await kubectl(k8s, "get", "pod", "trainer-0", "-o", "json"))
    assert as_json["metadata"]["name"] == "trainer-0"
    assert as_json["metadata"]["labels"] == {"app": "train"}

    description = await kubectl(k8s, "describe", "pod", "trainer-0")
    assert "trainer-0" in description
    assert "Events:" in description
    assert "CheckpointCommitted" in description and "step 42 committed" in description


OPERATOR = """
import kopf


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: object) -> None:
    settings.watching.connect_timeout = 5
    settings.networking.request_timeout = 10


@kopf.on.create("strata.dev", "v1", "widgets")
def created(spec: kopf.Spec, patch: kopf.Patch, **_: object) -> None:
    patch.status["seenSize"] = spec.get("size")
"""


async def test_real_kopf_operator_patches_an_object(k8s: K8s, tmp_path: Path) -> None:
    from kopf.testing import KopfRunner

    status, body = await call(
        k8s, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", WIDGET_CRD
    )
    assert status == 200, body
    operator = tmp_path / "operator.py"
    operator.write_text(OPERATOR)
    runner = KopfRunner(["run", "--standalone", "-A", "--verbose", str(operator)], timeout=20)
    # The runner's thread talks to the emulator, which answers only while this loop is free.
    await asyncio.to_thread(runner.__enter__)
    try:
        widget = {
            "apiVersion": "strata.dev/v1",
            "kind": "Widget",
            "metadata": {"name": "w1"},
            "spec": {"size": 5},
        }
        status, body = await call(k8s, "POST", WIDGETS, widget)
        assert status == 200, body
        seen = None
        for _ in range(200):
            await asyncio.sleep(0.05)
            status, obj = await call(k8s, "GET", WIDGETS + "/w1")
            seen = obj.get("status", {}).get("seenSize")
            if seen is not None:
                break
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)
    assert seen == 5, runner.output
    assert runner.exception is None and runner.exit_code == 0, runner.output


# ---- faults -----------------------------------------------------------------------------------------


async def _next_event(response: aiohttp.ClientResponse) -> dict[str, Any] | None:
    """The next watch event, or None where the stream ended."""
    line = await asyncio.wait_for(response.content.readline(), 5)
    return json.loads(line) if line.strip() else None


async def test_expired_watch_ends_with_410_and_a_rewatch_from_before_gets_410(k8s: K8s) -> None:
    from tests.k8s.emulator import PODS as POD_RESOURCE

    status, first = await call(k8s, "POST", PODS, pod("a"))
    assert status in (200, 201)
    async with aiohttp.ClientSession() as session:
        async with session.get(k8s.url + PODS, params={"watch": "true"}) as response:
            assert (await _next_event(response) or {}).get("type") == "ADDED"
            await k8s.api.expire_watches(POD_RESOURCE)
            ended = await _next_event(response)
            assert ended is not None and ended["type"] == "ERROR"
            assert ended["object"]["code"] == 410 and ended["object"]["reason"] == "Expired"
            assert await _next_event(response) is None  # and the stream ends
        old = first["metadata"]["resourceVersion"]
        async with session.get(k8s.url + PODS, params={"watch": "true", "resourceVersion": old}) as response:
            again = await _next_event(response)
            assert again is not None and again["object"]["code"] == 410
            assert "too old resource version" in again["object"]["message"]
        # A list and a watch from its resourceVersion work again.
        status, listing = await call(k8s, "GET", PODS)
        since = listing["metadata"]["resourceVersion"]
        params = {"watch": "true", "resourceVersion": since}
        async with session.get(k8s.url + PODS, params=params) as response:
            await call(k8s, "POST", PODS, pod("b"))
            added = await _next_event(response) or {}
            assert added["type"] == "ADDED" and added["object"]["metadata"]["name"] == "b"
    assert [f[1] for f in k8s.api.faults] == ["expired"]


async def test_watch_outage_holds_lists_and_hides_what_happens_meanwhile(k8s: K8s) -> None:
    from tests.k8s.emulator import PODS as POD_RESOURCE

    await call(k8s, "POST", PODS, pod("a"))
    async with k8s.api.watch_outage(POD_RESOURCE):
        listing = asyncio.ensure_future(call(k8s, "GET", PODS))
        await asyncio.sleep(0.2)
        assert not listing.done()  # waits for the outage to end
        status, _ = await call(k8s, "DELETE", PODS + "/a")
        assert status == 200
    status, body = await asyncio.wait_for(listing, 5)
    assert status == 200 and names(body) == set()


async def test_reset_next_breaks_matching_requests_before_or_after_they_apply(k8s: K8s) -> None:
    k8s.api.reset_next(1, method="POST", path=r"/pods$")
    with pytest.raises(aiohttp.ClientError):
        await call(k8s, "POST", PODS, pod("lost"))
    k8s.api.reset_next(1, method="POST", path=r"/pods$", applied=True)
    with pytest.raises(aiohttp.ClientError):
        await call(k8s, "POST", PODS, pod("kept"))
    status, listing = await call(k8s, "GET", PODS)  # another method: not reset
    assert status == 200 and names(listing) == {"kept"}
    status, _ = await call(k8s, "POST", PODS, pod("next"))  # the rules are spent
    assert status in (200, 201)
    assert [(f[1], f[2]) for f in k8s.api.faults] == [("reset", "POST"), ("reset", "POST")]


async def test_reset_watches_breaks_open_streams(k8s: K8s) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(k8s.url + PODS, params={"watch": "true"}) as response,
    ):
        await asyncio.sleep(0.1)
        await k8s.api.reset_watches()
        with pytest.raises(aiohttp.ClientError):
            await asyncio.wait_for(response.content.read(), 5)


async def test_fail_next_answers_429_with_retry_after_then_serves(k8s: K8s) -> None:
    k8s.api.fail_next(2, 429, method="GET", path=r"/pods$", retry_after=3)
    k8s.api.fail_next(1, 503, method="POST")
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            async with session.get(k8s.url + PODS) as response:
                body = await response.json()
                assert response.status == 429 and response.headers["Retry-After"] == "3"
                assert body["kind"] == "Status" and body["details"]["retryAfterSeconds"] == 3
    assert (await call(k8s, "GET", PODS))[0] == 200
    assert (await call(k8s, "POST", PODS, pod("a")))[0] == 503
    assert (await call(k8s, "GET", PODS + "/a"))[0] == 404  # refused: it took no effect
    assert [f[1] for f in k8s.api.faults] == ["429", "429", "503"]
