"""Disruptions are not crashes: Kueue's suspend/resume, evictions and lost nodes restart the gang
without spending ``strata.dev/max-restarts`` (counted apart in ``status.disruptions``); an index the
Job controller gave up on (``backoffLimitPerIndex``) fails the job naming it instead of leaving the
gang gated forever; the gate is lifted without touching anyone else's gate.

The real operator (``serve``) against the emulated API, with the emulated Job controller's suspend,
per-index backoff limit and FailedCreate (tests/k8s/cluster.py). Cluster-agnostic: everything goes
through the API (``Cluster.preempt`` does what Kueue does: ``spec.suspend`` true, then false).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from sidecar.operator import names
from sidecar.operator.admission import validate_workload
from tests.k8s.cluster import Cluster, create, indexed_job
from tests.k8s.conftest import K8s, call
from tests.k8s.test_crds import install_crds
from tests.k8s.test_operator import (
    JOBS,
    _job_failed,
    _stopping,
    assert_valid,
    events_about,
    operator,
    running,
    start_job,
    status_of,
    until,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]

KUEUE_GATE = "kueue.x-k8s.io/admission"
NO_BACKOFF = {"strata.dev/backoff-seconds": "0"}


@pytest_asyncio.fixture
async def cluster(k8s: K8s) -> AsyncIterator[Cluster]:
    await install_crds(k8s)
    async with Cluster(k8s, termination_s=0.3).running() as running_cluster:
        yield running_cluster


def _no_pods_left(cluster: Cluster, job: str) -> bool:
    return all(p["status"].get("phase") in ("Failed", "Succeeded") for p in cluster.pods(job))


async def _status_with(k8s: K8s, name: str, **wanted: Any) -> dict[str, Any] | None:
    status = await status_of(k8s, name)
    return status if all(status.get(k) == v for k, v in wanted.items()) else None


# ---- Kueue: suspend and resume ------------------------------------------------------------------------


async def test_preemptions_spend_no_crash_budget_and_a_crash_still_restarts(
    k8s: K8s, cluster: Cluster
) -> None:
    """Five Kueue preemptions of a job allowed one crash restart: each resume starts the next
    generation as a disruption; the crash after them still restarts the gang."""
    async with operator(k8s) as op:
        job = indexed_job("kueue", 2, annotations={**NO_BACKOFF, "strata.dev/max-restarts": "1"})
        run, _ = await start_job(k8s, cluster, job)
        for generation in range(1, 5):  # before, the second one had spent the budget: Failed
            await cluster.preempt("kueue")
            await until(
                lambda g=generation: running(cluster, "kueue", f"{run}/{g}", 2),
                message=f"generation {generation}",
            )
        # The fifth by hand, to look at the suspended state.
        await cluster.set_suspend("kueue", True)
        suspended = await until(lambda: _status_with(k8s, "kueue", phase="Suspended"), message="Suspended")
        assert suspended.get("pendingRestart") is None
        await until(lambda: _no_pods_left(cluster, "kueue"), message="the suspended Job's pods gone")
        await asyncio.sleep(0.3)  # pods gone while suspended are no failure: nothing is decided
        assert (await status_of(k8s, "kueue"))["phase"] == "Suspended"
        await cluster.set_suspend("kueue", False)
        await until(lambda: running(cluster, "kueue", f"{run}/5", 2), message="generation 5 after resume")
        status = await status_of(k8s, "kueue")
        assert status["restarts"] == 0 and status["disruptions"] == 5 and status["phase"] == "Running"
        conditions = {c["type"]: c for c in status["conditions"]}
        assert (
            conditions["Suspended"]["status"] == "False" and conditions["Suspended"]["reason"] == "JobResumed"
        )
        # The crash budget is whole: a crash restarts the gang.
        pods = running(cluster, "kueue", f"{run}/5", 2)
        assert pods is not None
        await cluster.fail(pods[0], 1)
        await until(lambda: running(cluster, "kueue", f"{run}/6", 2), message="generation 6 after a crash")
        status = await status_of(k8s, "kueue")
        assert status["restarts"] == 1 and status["disruptions"] == 5
        assert status["lastFailure"]["reason"] == "ExitError"
        reasons = [e["reason"] for e in await events_about(k8s, "kueue")]
        assert reasons.count("GangSuspended") == 5 and reasons.count("GangResumed") == 5
        registry = op.metrics.registry
        assert registry.get_sample_value("strata_operator_disruptions_total", {"reason": "suspended"}) == 5
        assert registry.get_sample_value("strata_operator_restarts_total", {"reason": "exit-error"}) == 1
        await assert_valid(k8s, "kueue")


async def test_a_job_suspended_before_its_first_gang_starts_it_on_resume_uncounted(
    k8s: K8s, cluster: Cluster
) -> None:
    """Kueue creates its Jobs suspended: the first gang is no disruption."""
    job = indexed_job("queued", 2, annotations=NO_BACKOFF)
    job["spec"]["suspend"] = True
    async with operator(k8s):
        await create(k8s, JOBS, job)
        await until(lambda: _status_with(k8s, "queued", phase="Suspended"), message="Suspended")
        assert cluster.pods("queued") == []
        await assert_valid(k8s, "queued")  # phase Suspended is in the CRD's schema
        await cluster.set_suspend("queued", False)
        status = await until(lambda: _status_with(k8s, "queued", phase="Running"), message="Running")
        assert status["generation"].endswith("/0") and status["disruptions"] == 0 and status["restarts"] == 0


async def test_pods_deleted_for_a_suspension_seen_before_the_jobs_event_are_no_crash(
    k8s: K8s, cluster: Cluster
) -> None:
    """The Job and pod watches are separate streams: the pods' deletions, even the resumed Job's new
    pods, may come before the Job's suspend. Their failure is checked against the Job (one GET):
    suspended, or resumed since the gang started (its Suspended condition), it is no crash."""
    async with operator(k8s) as op:
        run, _ = await start_job(k8s, cluster, indexed_job("lagging", 2, annotations=NO_BACKOFF))
        await asyncio.sleep(1.0)  # condition times are whole seconds: a later one than the release
        original = op.controller.on_job

        async def lagging(event_type: str | None, body: dict[str, Any]) -> None:
            if (body.get("spec") or {}).get("suspend"):
                await asyncio.sleep(1.0)  # the Job watch lags the pods'
            await original(event_type, body)

        op.controller.on_job = lagging
        await cluster.preempt("lagging")
        await until(lambda: running(cluster, "lagging", f"{run}/1", 2), message="generation 1 after resume")
        await asyncio.sleep(1.5)  # the lagging events (suspended, resumed) come and change nothing
        assert running(cluster, "lagging", f"{run}/1", 2)
        status = await status_of(k8s, "lagging")
        assert status["phase"] == "Running"
        assert status["restarts"] == 0 and status["disruptions"] == 1, status.get("lastFailure")


# ---- evictions and lost nodes ---------------------------------------------------------------------------


async def test_evictions_and_a_lost_node_are_disruptions_not_crashes(k8s: K8s, cluster: Cluster) -> None:
    """A job allowed no crash restart survives the kubelet's eviction, a drain (the Eviction API)
    and its node's loss: three disruptions, no restart budget spent, no backoff."""
    async with operator(k8s):
        job = indexed_job(
            "drained", 2, annotations={"strata.dev/max-restarts": "0", "strata.dev/backoff-seconds": "600"}
        )
        job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 1
        run, pods = await start_job(k8s, cluster, job)
        await cluster.kubelet_evict(pods[1])
        pods = await until(lambda: running(cluster, "drained", f"{run}/1", 2), message="generation 1")
        assert (await status_of(k8s, "drained"))["lastFailure"]["reason"] == "Evicted"
        status, body = await call(
            k8s,
            "POST",
            f"/api/v1/namespaces/default/pods/{pods[0]['metadata']['name']}/eviction",
            {
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": pods[0]["metadata"]["name"]},
            },
        )
        assert status in (200, 201), body
        pods = await until(lambda: running(cluster, "drained", f"{run}/2", 2), message="generation 2")
        await cluster.lose_node(pods[0]["spec"]["nodeName"])
        await until(lambda: running(cluster, "drained", f"{run}/3", 2), timeout=20, message="generation 3")
        status = await status_of(k8s, "drained")
        assert status["restarts"] == 0 and status["disruptions"] == 3
        assert status["lastFailure"]["reason"] == "NodeLost"
        condition = next(c for c in status["conditions"] if c["type"] == "Restarting")
        assert condition["status"] == "False"  # released
        await assert_valid(k8s, "drained")


async def test_a_pod_deleted_without_a_disruption_condition_spends_the_crash_budget(
    k8s: K8s, cluster: Cluster
) -> None:
    """``kubectl delete pod`` (no DisruptionTarget): the Job controller counts it against the index's
    backoff limit, so Strata counts it as a crash too (the two budgets agree)."""
    async with operator(k8s):
        run, pods = await start_job(k8s, cluster, indexed_job("deleted", 2, annotations=NO_BACKOFF))
        name = pods[0]["metadata"]["name"]
        status, body = await call(k8s, "DELETE", f"/api/v1/namespaces/default/pods/{name}")
        assert status == 200, body
        await until(lambda: running(cluster, "deleted", f"{run}/1", 2), message="generation 1")
        status_now = await status_of(k8s, "deleted")
        assert status_now["restarts"] == 1 and status_now.get("disruptions", 0) == 0
        assert status_now["lastFailure"]["reason"] == "PodDeleted"


# ---- backoffLimitPerIndex -------------------------------------------------------------------------------


async def test_an_index_past_its_backoff_limit_fails_the_job_naming_it(k8s: K8s, cluster: Cluster) -> None:
    """backoffLimitPerIndex 0: index 0's first crash makes the Job controller give it up (never
    re-created). The StrataJob fails naming the index and the limit; the other index's replacement
    is released to stop, and its exit 76 ends the Job: nothing waits forever."""
    job = indexed_job("perindex", 2, annotations=NO_BACKOFF)
    job["spec"]["backoffLimitPerIndex"] = 0
    async with operator(k8s):
        _, pods = await start_job(k8s, cluster, job)
        await cluster.fail(pods[0], 1)
        status = await until(
            lambda: _status_with(k8s, "perindex", phase="Failed"), timeout=10, message="StrataJob Failed"
        )
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "IndexFailed"
        assert "index(es) 0" in failed["message"] and "spec.backoffLimitPerIndex (0)" in failed["message"]
        assert "strata.dev/max-restarts (3)" in failed["message"]
        stopping = await until(lambda: _stopping(cluster, "perindex"), timeout=10, message="released to stop")
        assert [p["metadata"]["labels"][names.JOB_INDEX_LABEL] for p in stopping] == ["1"]
        await cluster.fail(stopping[0], names.EXIT_LIMIT_SPENT, container="trainer")
        await until(lambda: _job_failed(k8s, "perindex"), message="the Job failed")
        assert "IndexFailed" in [e["reason"] for e in await events_about(k8s, "perindex")]
        await assert_valid(k8s, "perindex")


async def test_a_job_the_job_controller_failed_for_its_indexes_names_them(k8s: K8s, cluster: Cluster) -> None:
    """maxFailedIndexes 0: the Job controller fails the Job itself; the StrataJob says which index."""
    job = indexed_job("maxfailed", 2, annotations=NO_BACKOFF)
    job["spec"].update(backoffLimitPerIndex=0, maxFailedIndexes=0)
    async with operator(k8s):
        _, pods = await start_job(k8s, cluster, job)
        await cluster.fail(pods[1], 1)
        status = await until(
            lambda: _status_with(k8s, "maxfailed", phase="Failed"), timeout=10, message="StrataJob Failed"
        )
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert "failed indexes: 1" in failed["message"] or "index(es) 1" in failed["message"], failed
        job_failed = await until(lambda: _job_failed(k8s, "maxfailed"), message="the Job failed")
        assert job_failed["reason"] == "MaxFailedIndexesExceeded"


async def test_admission_warns_when_backoff_limit_per_index_is_below_max_restarts() -> None:
    job = indexed_job("warned", 2, annotations={"strata.dev/max-restarts": "5"})
    job["spec"]["backoffLimitPerIndex"] = 2
    warnings = [w for w in validate_workload(job).warnings if "backoffLimitPerIndex" in w]
    assert len(warnings) == 1, validate_workload(job).warnings
    assert "spec.backoffLimitPerIndex (2)" in warnings[0] and "strata.dev/max-restarts (5)" in warnings[0]
    assert "at least 5" in warnings[0]
    job["spec"]["backoffLimitPerIndex"] = 5
    assert not [w for w in validate_workload(job).warnings if "backoffLimitPerIndex" in w]


async def test_the_documented_job_passes_admission_without_warnings() -> None:
    """docs/kubernetes/operator.md's recommended Job (and the tests' fixture, which follows it) draw
    no warning."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "kubernetes" / "operator.md").read_text()
    section = text[text.index("## A Job that works with it") :]
    documented = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))  # type: ignore[union-attr]
    assert documented["spec"]["backoffLimitPerIndex"] >= int(
        documented["spec"]["template"]["metadata"]["annotations"]["strata.dev/max-restarts"]
    )
    assert validate_workload(documented).warnings == []
    assert validate_workload(indexed_job("fixture", 2)).warnings == []


# ---- the gate: a JSON patch that tests its position -----------------------------------------------------


async def test_lifting_the_gate_keeps_a_gate_someone_else_removed_meanwhile(
    k8s: K8s, cluster: Cluster
) -> None:
    """Pods carry Kueue's gate and Strata's. Kueue removes its own just before the operator lifts
    Strata's: a whole-list patch would put Kueue's back (the pod would never schedule)."""

    async def admit(pod: dict[str, Any]) -> list[dict[str, Any]]:
        gates = [{"name": KUEUE_GATE}, {"name": names.GANG_GATE}]
        return [{"op": "add", "path": "/spec/schedulingGates", "value": gates}]

    cluster.admit = admit
    async with operator(k8s) as op:
        api = op.controller.api
        raced: set[str] = set()

        async def kueue_first(url: str) -> None:
            name = url.rstrip("/").rsplit("/", 1)[-1]
            if "/pods/" in url and name not in raced:
                raced.add(name)
                status, body = await call(
                    k8s, "PATCH", url, {"spec": {"schedulingGates": [{"name": names.GANG_GATE}]}}
                )
                assert status == 200, body

        for method in ("json_patch", "merge_patch"):
            original = getattr(api, method)

            async def patched(url: str, body: Any, _original: Any = original) -> Any:
                await kueue_first(url)
                return await _original(url, body)

            setattr(api, method, patched)
        await start_job(k8s, cluster, indexed_job("gates", 2, annotations=NO_BACKOFF))
        assert len(raced) == 2
        for pod in cluster.pods("gates"):
            assert not pod["spec"].get("schedulingGates"), pod["spec"]["schedulingGates"]


# ---- the emulated Job controller ------------------------------------------------------------------------


async def test_emulated_job_controller_fails_an_index_past_its_limit_and_never_recreates_it(
    k8s: K8s, cluster: Cluster
) -> None:
    """Without the operator (not opted in, so nothing is gated): a counted failure past
    backoffLimitPerIndex fails the index for good; ignored ones (exit 75) do not count; the Job
    fails once every index ended."""
    job = indexed_job("plain", 2, labelled=False)
    job["spec"]["backoffLimitPerIndex"] = 1
    await create(k8s, JOBS, job)

    def live(index: str) -> dict[str, Any] | None:
        return next(
            (
                p
                for p in cluster.pods("plain")
                if p["metadata"]["labels"][names.JOB_INDEX_LABEL] == index
                and p["status"].get("phase") == "Running"
            ),
            None,
        )

    await cluster.fail(await until(lambda: live("0")), names.EXIT_PEER_DIED, container="trainer")  # ignored
    await cluster.fail(await until(lambda: live("0")), 1)  # counted: 1 of 1
    await cluster.fail(await until(lambda: live("0")), 1)  # counted: 2 > 1, the index fails
    await asyncio.sleep(0.5)
    assert (
        live("0") is None
        and len([p for p in cluster.pods("plain") if p["metadata"]["labels"][names.JOB_INDEX_LABEL] == "0"])
        == 3
    )
    _, body = await call(k8s, "GET", f"{JOBS}/plain")
    assert body["status"]["failedIndexes"] == "0"
    await cluster.succeed(await until(lambda: live("1")))
    failed = await until(lambda: _job_failed(k8s, "plain"), message="the Job failed")
    assert failed["reason"] == "FailedIndexes"


async def test_emulated_job_controller_records_failed_create_and_retries(k8s: K8s, cluster: Cluster) -> None:
    """A pod the apiserver refuses: a Warning Event FailedCreate on the Job, retried with a backoff."""
    k8s.api.validate_pods = True
    job = indexed_job("refused", 1, labelled=False)
    job["spec"]["template"]["spec"]["containers"][0]["notAField"] = True
    await create(k8s, JOBS, job)
    await until(lambda: cluster.failed_creates, message="a refused creation")
    events = await until(
        lambda: [e for e in _events(k8s) if e.get("reason") == "FailedCreate"], message="the Event"
    )
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["kind"] == "Job"
    assert "notAField" in events[0]["message"] and events[0]["message"].startswith("Error creating:")
    await asyncio.sleep(0.5)
    tries = len(cluster.failed_creates)
    assert 1 <= tries <= 4, "retried without a backoff"
    k8s.api.validate_pods = False  # the refusal ends: the retry creates the pod
    await until(lambda: cluster.pods("refused"), message="the pod created on retry")


def _events(k8s: K8s) -> list[dict[str, Any]]:
    return [
        obj.raw
        for (resource, _, _), obj in list(k8s.api._objects.items())
        if resource.plural == "events" and not obj.deleted
    ]
