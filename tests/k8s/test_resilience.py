"""The operator under the faults of a real apiserver: watches that expire (410) while pods vanish,
connections reset (a rolling upgrade of the apiserver), and throttling (429 with Retry-After).
Each gang restart here completes, and none retries before the apiserver asked.

The faults come from the emulator's knobs (tests/k8s/emulator.py); everything else goes through
the API as in tests/k8s/test_operator.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from sidecar.operator import names
from tests.k8s.cluster import Cluster, indexed_job
from tests.k8s.conftest import K8s, call
from tests.k8s.emulator import PODS
from tests.k8s.test_crds import install_crds
from tests.k8s.test_operator import (
    operator,
    running,
    start_job,
    status_of,
    until,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

#: The operator's API client names itself so (the cluster simulation's requests stay untouched).
OPERATOR = "strata-operator"
#: A pod's own calls: eviction and the release's merge patch (not its status, not the StrataJob's).
EVICTION = r"/pods/[^/]+/eviction$"
POD = r"/pods/[^/]+$"
FAST = {"strata.dev/backoff-seconds": "0.2"}


@pytest_asyncio.fixture
async def cluster(k8s: K8s) -> AsyncIterator[Cluster]:
    """Pods end half a second after their deletion (their grace period stays 2 s)."""
    await install_crds(k8s)
    async with Cluster(k8s, termination_s=0.5).running() as running_cluster:
        yield running_cluster


def index(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["labels"][names.JOB_INDEX_LABEL])


def pod_url(pod: dict[str, Any]) -> str:
    return f"/api/v1/namespaces/default/pods/{pod['metadata']['name']}"


def faults(k8s: K8s, what: str) -> list[tuple[float, str, str, str]]:
    return [f for f in k8s.api.faults if f[1] == what]


async def test_gang_restart_completes_when_an_evicted_pod_vanishes_while_the_watch_is_expired(
    k8s: K8s,
    cluster: Cluster,
) -> None:
    """The evicted pod ends while the watch is down: no DELETED event, the index holds it
    Terminating. The fence finds it gone (404) and the restart goes on; no periodic list helps."""
    async with operator(k8s, pod_resync_s=0) as op:
        run, pods = await start_job(k8s, cluster, indexed_job("vanish", 2, annotations=FAST))
        failed, survivor = sorted(pods, key=index)
        name = survivor["metadata"]["name"]
        watched = op.controller.jobs[("default", "vanish")]
        await cluster.fail(failed)
        await until(
            lambda: ((watched.pods.get(name) or {}).get("metadata") or {}).get("deletionTimestamp"),
            message="the operator seeing its eviction",
        )
        async with k8s.api.watch_outage(PODS):
            await until(
                lambda: name not in {p["metadata"]["name"] for p in cluster.pods("vanish")},
                message="the evicted pod gone",
            )
        assert name in watched.pods  # no DELETED event came
        await until(lambda: running(cluster, "vanish", f"{run}/1", 2), 15, "generation 1 running")
        assert name not in watched.pods
        assert faults(k8s, "expired")


async def test_a_pod_deleted_while_the_watch_is_expired_is_found_by_the_pod_list(
    k8s: K8s,
    cluster: Cluster,
) -> None:
    """A running pod force-deleted while the watch is down: kopf lists again (410), which shows its
    gated replacement but sends no DELETED for it; the list that follows the relisting finds it
    gone (a period far longer than the test: the relisting, not the period, triggers it)."""
    async with operator(k8s, pod_resync_s=30) as op:
        run, pods = await start_job(k8s, cluster, indexed_job("deleted", 2, annotations=FAST))
        victim = sorted(pods, key=index)[0]
        async with k8s.api.watch_outage(PODS):
            status, _ = await call(k8s, "DELETE", pod_url(victim), {"gracePeriodSeconds": 0})
            assert status == 200
            await until(
                lambda: any(
                    index(p) == "0" and p["spec"].get("schedulingGates") for p in cluster.pods("deleted")
                ),
                message="the Job controller's gated replacement",
            )
        await until(lambda: running(cluster, "deleted", f"{run}/1", 2), 15, "generation 1 running")
        status = await status_of(k8s, "deleted")
        assert status["lastFailure"]["reason"] == "PodDeleted"
        assert victim["metadata"]["name"] not in op.controller.jobs[("default", "deleted")].pods


async def test_gang_restart_completes_through_connection_resets(
    k8s: K8s,
    cluster: Cluster,
) -> None:
    """An apiserver restarting: the watch streams break, an eviction is lost before it applies and
    one after (its answer only), the release's first patch is lost. The restart completes."""
    async with operator(k8s, pod_resync_s=0) as op:
        run, pods = await start_job(k8s, cluster, indexed_job("reset", 3, annotations=FAST))
        k8s.api.reset_next(1, method="POST", path=EVICTION, agent=OPERATOR)
        k8s.api.reset_next(1, method="POST", path=EVICTION, agent=OPERATOR, applied=True)
        k8s.api.reset_next(1, method="PATCH", path=POD, agent=OPERATOR)
        await k8s.api.reset_watches()
        await cluster.fail(sorted(pods, key=index)[0])
        await until(lambda: running(cluster, "reset", f"{run}/1", 3), 20, "generation 1 running")
        assert [f[2] for f in faults(k8s, "reset")] == ["WATCH", "POST", "POST", "PATCH"]
        errors = op.metrics.registry.get_sample_value("strata_operator_reconcile_errors_total")
        assert errors is not None and errors >= 3


async def test_a_timer_driven_release_that_meets_a_connection_reset_is_tried_again(
    k8s: K8s,
    cluster: Cluster,
) -> None:
    """The release waits for the backoff's notBefore (a timer, no event to come); its first patch
    meets a reset: the timer is armed again and the release completes."""
    async with operator(k8s, pod_resync_s=0):
        job = indexed_job("timer", 2, annotations={"strata.dev/backoff-seconds": "2"})
        run, pods = await start_job(k8s, cluster, job)
        old = {p["metadata"]["name"] for p in pods}
        await cluster.fail(pods[0])

        def waiting() -> bool:
            mine = cluster.pods("timer")
            gated = [p for p in mine if p["spec"].get("schedulingGates")]
            ended = all(p["status"].get("phase") == "Failed" for p in mine if p["metadata"]["name"] in old)
            return len(gated) == 2 and ended

        await until(waiting, message="the old gang gone, the replacements gated")
        pending = (await status_of(k8s, "timer")).get("pendingRestart") or {}
        assert pending.get("notBefore"), "the release waits for its notBefore"
        k8s.api.reset_next(1, method="PATCH", path=POD, agent=OPERATOR)
        await until(lambda: running(cluster, "timer", f"{run}/1", 2), 15, "generation 1 running")
        assert [f[2] for f in faults(k8s, "reset")] == ["PATCH"]


async def test_a_429_with_retry_after_is_honoured(
    k8s: K8s,
    cluster: Cluster,
) -> None:
    """API Priority and Fairness throttles the evictions (429, Retry-After: 1): the job's next try
    waits for it, even when watch events (a replacement pod, a touched pod) come meanwhile."""
    async with operator(k8s, pod_resync_s=0):
        run, pods = await start_job(k8s, cluster, indexed_job("throttled", 3, annotations=FAST))
        k8s.api.fail_next(2, 429, method="POST", path=EVICTION, agent=OPERATOR, retry_after=1)
        first, other = sorted(pods, key=index)[0], sorted(pods, key=index)[1]
        await cluster.fail(first)
        await until(lambda: faults(k8s, "429"), message="the first 429")
        touch = {"metadata": {"annotations": {"example.com/touched": "yes"}}}
        status, _ = await call(k8s, "PATCH", pod_url(other), touch)  # an event while it waits
        assert status == 200
        await until(lambda: len(faults(k8s, "429")) == 2, message="the second 429")
        await until(lambda: running(cluster, "throttled", f"{run}/1", 3), 20, "generation 1 running")
        once, again = (f[0] for f in faults(k8s, "429"))
        assert again - once >= 1.0, f"tried again {again - once:.2f} s after a 429 asking for 1 s"
        assert len(k8s.api.evictions) == 2
