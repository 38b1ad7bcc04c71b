"""kopf peering between operator replicas (``--peering``), as the chart ships it: kopf's peering CRDs
(charts/strata/crds/*.kopf.dev.yaml), the peering object, and one priority per replica.

kopf pauses every replica that sees a live peer of higher priority, and every replica of equal
priority (kopf/_core/engines/peering.py, ``process_peering_event``): the oldest replica acts, the
others wait, and the next takes over when the acting one exits.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest
from kopf._cogs.structs import references

from sidecar.operator.run import Operator, OperatorConfig, _settings
from tests.k8s.cluster import create, indexed_job
from tests.k8s.conftest import K8s, call
from tests.k8s.test_crds import CRD_API, install_crds, load_crd
from tests.k8s.test_operator import JOBS, operator, until

CLUSTER_PEERINGS = "/apis/kopf.dev/v1/clusterkopfpeerings"
PEERING_CRDS = {
    # CRD name: (kind, scope, kopf's selector for it)
    "clusterkopfpeerings.kopf.dev": ("ClusterKopfPeering", "Cluster", references.CLUSTER_PEERINGS_K),
    "kopfpeerings.kopf.dev": ("KopfPeering", "Namespaced", references.NAMESPACED_PEERINGS_K),
}


@pytest.mark.parametrize("name", sorted(PEERING_CRDS))
def test_peering_crds_are_what_kopf_looks_for(name: str) -> None:
    kind, scope, selector = PEERING_CRDS[name]
    crd = load_crd(name)
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1" and crd["kind"] == "CustomResourceDefinition"
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{spec['names']['plural']}.{spec['group']}"
    assert (spec["group"], spec["scope"], spec["names"]["kind"]) == ("kopf.dev", scope, kind)
    [version] = spec["versions"]
    assert version["served"] and version["storage"]
    assert (spec["group"], version["name"]) == (selector.group, selector.version)
    assert spec["names"]["plural"] == selector.any_name
    # kopf merge-patches {status: {<identity>: {...}}} through the object itself (no subresource, so
    # no .../status RBAC): the apiserver must keep whatever keys it writes
    assert "subresources" not in version
    properties = version["schema"]["openAPIV3Schema"]["properties"]
    for field in ("spec", "status"):
        assert properties[field]["type"] == "object"
        assert properties[field]["x-kubernetes-preserve-unknown-fields"] is True


def test_every_replica_gets_its_own_priority_the_older_the_higher() -> None:
    config = OperatorConfig(peering="strata")
    priorities = []
    for _ in range(5):
        settings = _settings(config)
        assert settings.peering.name == "strata" and not settings.peering.standalone
        priorities.append(settings.peering.priority)
        time.sleep(0.002)  # replicas started a millisecond apart: strictly ordered
    assert priorities == sorted(priorities, reverse=True) and len(set(priorities)) == 5
    assert all(p < 0 for p in priorities)  # below kopf's default 0: a developer's `kopf run` wins
    assert _settings(OperatorConfig()).peering.standalone


async def install_peering(k8s: K8s, name: str = "strata") -> None:
    """The peering CRDs from the chart and the ClusterKopfPeering the chart creates."""
    for crd in PEERING_CRDS:
        status, body = await call(k8s, "POST", CRD_API, load_crd(crd))
        assert status in (200, 201), body
    peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}
    await create(k8s, CLUSTER_PEERINGS, peering)


async def peers(k8s: K8s) -> dict[str, dict[str, Any]]:
    """The peering object's status: {identity: {priority, lifetime, lastseen}}."""
    status, body = await call(k8s, "GET", f"{CLUSTER_PEERINGS}/strata")
    assert status == 200, body
    found: dict[str, dict[str, Any]] = body.get("status") or {}
    return found


class Replica:
    """One operator replica on its own event loop and thread, as if in its own pod.

    Not on the test's loop: when kopf stops, it cancels every task started on its loop after its own
    start (kopf/_core/reactor/running.py, ``run_tasks``: the "hung" tasks), which would be the tasks
    of a replica started later on the same loop."""

    def __init__(self, k8s: K8s) -> None:
        self.k8s = k8s
        #: The Job events kopf handed to this replica's controller: (event type, Job name).
        self.jobs_seen: list[tuple[str | None, str]] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            async with operator(self.k8s, peering="strata") as running:
                self._record(running)
                self._ready.set()
                await self._stop.wait()
        except BaseException as e:
            self._error = e
            raise
        finally:
            self._ready.set()

    def _record(self, running: Operator) -> None:
        handle = running.controller.on_job

        async def on_job(event_type: str | None, body: Mapping[str, Any]) -> None:
            self.jobs_seen.append((event_type, body["metadata"]["name"]))
            await handle(event_type, body)

        # build_registry's handler looks the method up on every call
        running.controller.on_job = on_job  # type: ignore[method-assign]

    async def start(self) -> Replica:
        self._thread.start()
        await asyncio.to_thread(self._ready.wait, 30)
        if self._error is not None or not self._thread.is_alive():
            raise AssertionError("the replica did not start") from self._error
        return self

    async def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        await asyncio.to_thread(self._thread.join, 30)
        assert not self._thread.is_alive(), "the replica did not stop"


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_only_the_oldest_replica_acts_and_the_next_takes_over_when_it_exits(k8s: K8s) -> None:
    await install_crds(k8s)
    await install_peering(k8s)
    first, second = Replica(k8s), Replica(k8s)
    try:
        await first.start()
        [first_id] = await until(lambda: peers(k8s), 10, "the first replica's keep-alive")
        await second.start()
        both = await until(lambda: _two(peers(k8s)), 10, "the second replica's keep-alive")
        [second_id] = set(both) - {first_id}
        assert both[first_id]["priority"] > both[second_id]["priority"]

        # The second replica sees a live peer of higher priority: paused from its start (kopf's
        # mandatory peering starts paused), so it never watches Jobs while the first one runs.
        await create(k8s, JOBS, indexed_job("recsys", 2))
        await until(lambda: ("ADDED", "recsys") in first.jobs_seen, 10, "the acting replica to see the Job")
        await asyncio.sleep(1.0)
        assert second.jobs_seen == []

        # The first exits: its keep-alive task removes its entry on the way out, the second sees no
        # peer of higher priority any more, resumes, and kopf's fresh listing hands it the Job.
        await first.stop()
        assert list(await peers(k8s)) == [second_id]
        await until(lambda: (None, "recsys") in second.jobs_seen, 10, "the second replica to take over")
        assert first.jobs_seen == [("ADDED", "recsys")]
    finally:
        await second.stop()
        await first.stop()


async def _two(found: Any) -> dict[str, dict[str, Any]] | None:
    status: dict[str, dict[str, Any]] = await found
    return status if len(status) == 2 else None
