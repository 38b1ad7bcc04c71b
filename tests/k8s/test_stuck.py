"""Stuck gangs are visible: a pod that does not get going (image pull, a missing Secret, no node,
the sidecar crash-looping) or a gang that cannot be completed shows as the StrataJob condition
Stuck, one Event per pod and cause, and the strata_operator_stuck_* gauges; all clear once it
resolves. The real operator (kopf, controller) against the emulated API and cluster.

Cluster-agnostic apart from the emulated kubelet's helpers that put a pod into each state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from sidecar.operator import names
from tests.k8s.cluster import Cluster, create, indexed_job
from tests.k8s.conftest import K8s
from tests.k8s.test_operator import (
    JOBS,
    assert_valid,
    cluster,  # noqa: F401  (fixture)
    events_about,
    operator,
    running,
    status_of,
    until,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

GRACE_S = 0.6


def stuck_condition(status: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == "Stuck"), None)


def gauge(op: Any, name: str, cause: str) -> float | None:
    value: float | None = op.metrics.registry.get_sample_value(name, {"cause": cause})
    return value


def index_pod(sim: Cluster, job: str, index: int) -> dict[str, Any] | None:
    return next(
        (
            p
            for p in sim.pods(job)
            if p["metadata"]["labels"].get(names.JOB_INDEX_LABEL) == str(index)
            and not p["metadata"].get("deletionTimestamp")
        ),
        None,
    )


async def released_held(sim: Cluster, job: str, index: int) -> dict[str, Any]:
    """The pod of ``index``, released by the operator but held back by its kubelet."""

    def found() -> dict[str, Any] | None:
        pod = index_pod(sim, job, index)
        if pod is None or pod.get("spec", {}).get("schedulingGates"):
            return None
        return pod if (pod["metadata"].get("annotations") or {}).get(names.GENERATION_ANNOTATION) else None

    pod: dict[str, Any] = await until(found, message=f"the pod of index {index} released")
    return pod


async def stuck_events(k8s: K8s, job: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in await events_about(k8s, job) if e["reason"] == reason]


Put = Callable[[Cluster, dict[str, Any]], Awaitable[None]]

CASES: list[tuple[str, Put, str]] = [
    ("ImagePullBackOff", lambda c, p: c.image_pull_backoff(p), 'Back-off pulling image "trainer:1"'),
    (
        "CreateContainerConfigError",
        lambda c, p: c.create_container_config_error(p, secret="s3-credentials"),
        'secret "s3-credentials" not found',
    ),
    ("Unschedulable", lambda c, p: c.unschedulable(p), "Insufficient nvidia.com/gpu"),
    ("SidecarCrashLoop", lambda c, p: c.sidecar_crash_loop(p, restarts=4), "restarted 4 times; last exit 1"),
]


@pytest.mark.parametrize(("cause", "put", "said"), CASES, ids=[c[0] for c in CASES])
async def test_stuck_pod_shows_as_condition_event_and_metric_then_clears(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
    cause: str,
    put: Put,
    said: str,
) -> None:
    async with operator(k8s, stuck_grace_s=GRACE_S) as op:
        cluster.held.add(("stuck", 1))
        await create(k8s, JOBS, indexed_job("stuck", 2))
        pod = await released_held(cluster, "stuck", 1)
        name = pod["metadata"]["name"]
        assert gauge(op, "strata_operator_stuck_gangs", cause) == 0
        put_at = time.monotonic()
        await put(cluster, pod)

        # Within the grace nothing counts yet (the kubelet may still get it going).
        await asyncio.sleep(GRACE_S / 3)
        assert (stuck_condition(await status_of(k8s, "stuck")) or {}).get("status") != "True"
        assert await stuck_events(k8s, "stuck", cause) == []

        async def stuck() -> dict[str, Any] | None:
            condition = stuck_condition(await status_of(k8s, "stuck"))
            return condition if condition is not None and condition["status"] == "True" else None

        condition = await until(stuck, timeout=10, message=f"condition Stuck for {cause}")
        assert time.monotonic() - put_at >= GRACE_S * 0.9
        assert condition["reason"] == cause
        assert name in condition["message"] and said in condition["message"]
        status = await status_of(k8s, "stuck")
        assert [(e["pod"], e["cause"]) for e in status["stuckPods"]] == [(name, cause)]
        await assert_valid(k8s, "stuck")
        assert gauge(op, "strata_operator_stuck_gangs", cause) == 1
        assert gauge(op, "strata_operator_stuck_pods", cause) == 1
        assert gauge(op, "strata_operator_stuck_gangs", "GangIncomplete") == 0

        # Once per pod and cause, however often the pod's status changes meanwhile.
        for _ in range(3):
            await put(cluster, pod)
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)
        events = await stuck_events(k8s, "stuck", cause)
        assert sorted(e["involvedObject"]["kind"] for e in events) == ["Job", "StrataJob"]
        assert all(name in e["message"] and e["type"] == "Warning" for e in events)

        await cluster.start(pod)  # fixed: the kubelet runs it
        run = (status["generation"] or "").removesuffix("/0")
        await until(lambda: running(cluster, "stuck", f"{run}/0", 2), message="the gang running")

        async def cleared() -> dict[str, Any] | None:
            condition = stuck_condition(await status_of(k8s, "stuck"))
            return condition if condition is not None and condition["status"] == "False" else None

        condition = await until(cleared, timeout=10, message="condition Stuck cleared")
        assert condition["reason"] == "Resolved" and cause in condition["message"]
        assert "stuckPods" not in await status_of(k8s, "stuck")
        assert gauge(op, "strata_operator_stuck_gangs", cause) == 0
        assert gauge(op, "strata_operator_stuck_pods", cause) == 0
        assert len(await stuck_events(k8s, "stuck", "Unstuck")) == 1
        assert len(await stuck_events(k8s, "stuck", cause)) == 2  # no new one


async def test_stuck_state_shorter_than_the_grace_is_not_reported(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
) -> None:
    async with operator(k8s, stuck_grace_s=1.0):
        cluster.held.add(("blip", 0))
        await create(k8s, JOBS, indexed_job("blip", 1))
        pod = await released_held(cluster, "blip", 0)
        await cluster.image_pull_backoff(pod)
        await asyncio.sleep(0.3)
        await cluster.start(pod)  # the next pull worked
        await asyncio.sleep(1.5)
        assert stuck_condition(await status_of(k8s, "blip")) is None
        assert await stuck_events(k8s, "blip", "ImagePullBackOff") == []


async def test_gang_that_cannot_be_completed_is_stuck_until_its_last_pod_exists(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
) -> None:
    async with operator(k8s, stuck_grace_s=GRACE_S) as op:
        cluster.refused.add(("partial", 2))  # e.g. a ResourceQuota refuses the third pod
        created_at = time.monotonic()
        await create(k8s, JOBS, indexed_job("partial", 3))

        async def stuck() -> dict[str, Any] | None:
            condition = stuck_condition(await status_of(k8s, "partial"))
            return condition if condition is not None and condition["status"] == "True" else None

        condition = await until(stuck, timeout=10, message="condition Stuck for GangIncomplete")
        assert time.monotonic() - created_at >= GRACE_S * 0.9
        assert condition["reason"] == "GangIncomplete"
        assert "index(es) 2 of 3" in condition["message"]
        gated = {p["metadata"]["name"] for p in cluster.pods("partial")}
        assert len(gated) == 2
        assert (await status_of(k8s, "partial"))["stuckPods"][0]["pod"] in gated
        assert gauge(op, "strata_operator_stuck_gangs", "GangIncomplete") == 1
        events = await stuck_events(k8s, "partial", "GangIncomplete")
        assert sorted(e["involvedObject"]["kind"] for e in events) == ["Job", "StrataJob"]

        cluster.refused.discard(("partial", 2))  # the quota was raised

        async def cleared() -> dict[str, Any] | None:
            condition = stuck_condition(await status_of(k8s, "partial"))
            return condition if condition is not None and condition["status"] == "False" else None

        await until(cleared, timeout=10, message="condition Stuck cleared")

        async def released() -> str | None:
            generation: str | None = (await status_of(k8s, "partial")).get("generation")
            return generation

        generation = await until(released, message="the gang released")
        assert generation.endswith("/0")
        await until(lambda: running(cluster, "partial", generation, 3), message="the whole gang running")
        assert gauge(op, "strata_operator_stuck_gangs", "GangIncomplete") == 0


async def test_a_large_stuck_gang_gets_a_bounded_number_of_events(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
) -> None:
    world = 13
    async with operator(k8s, stuck_grace_s=GRACE_S) as op:
        cluster.held |= {("wide", i) for i in range(world)}
        await create(k8s, JOBS, indexed_job("wide", world))
        pods = [await released_held(cluster, "wide", i) for i in range(world)]
        for pod in pods:
            await cluster.image_pull_backoff(pod)

        async def all_listed() -> bool:
            return len((await status_of(k8s, "wide")).get("stuckPods") or []) == world

        await until(all_listed, timeout=10, message="every pod listed as stuck")
        assert gauge(op, "strata_operator_stuck_pods", "ImagePullBackOff") == world
        assert gauge(op, "strata_operator_stuck_gangs", "ImagePullBackOff") == 1
        await asyncio.sleep(0.3)
        events = [
            e
            for e in await stuck_events(k8s, "wide", "ImagePullBackOff")
            if e["involvedObject"]["kind"] == "Job"
        ]
        own = [e for e in events if e["message"].startswith("pod ")]
        grouped = [e for e in events if "more pods are stuck" in e["message"]]
        # ten with an Event of their own; the rest named together, per check that found them
        assert len(own) == 10 and 1 <= len(grouped) <= world - 10 and len(events) == len(own) + len(grouped)
        # never named twice; pods found after the first summary wait for the next window (10 min)
        named = {
            p["metadata"]["name"]: sum(p["metadata"]["name"] in e["message"] for e in events) for p in pods
        }
        assert all(n <= 1 for n in named.values()), named
        assert sum(named.values()) >= 11, named


async def test_a_restarted_operator_keeps_the_stuck_condition_without_new_events(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
) -> None:
    cluster.held.add(("kept", 0))
    async with operator(k8s, stuck_grace_s=GRACE_S):
        await create(k8s, JOBS, indexed_job("kept", 1))
        pod = await released_held(cluster, "kept", 0)
        await cluster.unschedulable(pod)

        async def stuck() -> dict[str, Any] | None:
            condition = stuck_condition(await status_of(k8s, "kept"))
            return condition if condition is not None and condition["status"] == "True" else None

        before = await until(stuck, timeout=10, message="condition Stuck")
    async with operator(k8s, stuck_grace_s=GRACE_S) as op:
        await until(lambda: ("default", "kept") in op.controller.jobs, message="the job watched again")
        await asyncio.sleep(GRACE_S * 2)
        assert stuck_condition(await status_of(k8s, "kept")) == before  # no flap, same transition time
        assert gauge(op, "strata_operator_stuck_gangs", "Unschedulable") == 1
        assert len(await stuck_events(k8s, "kept", "Unschedulable")) == 2  # the first operator's only
