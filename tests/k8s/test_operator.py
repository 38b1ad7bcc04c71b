"""The operator's restart protocol end to end: kopf watching the emulated API, the controller
deciding, a Job controller and kubelets (tests/k8s/cluster.py) doing what a cluster does.

Cluster-agnostic: everything goes through the API, so the same checks can run against kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from sidecar.operator import names, objects
from sidecar.operator.kube import ApiError
from sidecar.operator.run import OperatorConfig, serve
from tests.fixtures.prometheus import Prometheus, free_port, prometheus_bin
from tests.k8s.cluster import Cluster, create, indexed_job
from tests.k8s.conftest import K8s, call, kubectl
from tests.k8s.test_crds import install_crds, report, rows, validator

JOBS = "/apis/batch/v1/namespaces/default/jobs"
STRATAJOBS = "/apis/strata.dev/v1alpha1/namespaces/default/stratajobs"

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]


async def until(what: Callable[[], Awaitable[Any] | Any], timeout: float = 30.0, message: str = "") -> Any:
    """Wait until ``what()`` returns something truthy (polled: this is the test, not the operator)."""
    deadline = time.monotonic() + timeout
    while True:
        found = what()
        if asyncio.iscoroutine(found):
            found = await found
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {message or what}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def operator(k8s: K8s, **config: Any) -> AsyncIterator[Any]:
    config = {"fence_margin_s": 1.0, "report_port": 0, "report_host": "127.0.0.1", **config}
    async with serve(OperatorConfig(kubeconfig=str(k8s.kubeconfig), **config)) as running_operator:
        yield running_operator


@pytest_asyncio.fixture
async def cluster(k8s: K8s) -> AsyncIterator[Cluster]:
    await install_crds(k8s)
    async with Cluster(k8s, termination_s=2.0).running() as running:
        yield running


async def assert_valid(k8s: K8s, name: str) -> None:
    """The StrataJob the operator wrote validates against its CRD (a real apiserver would prune or
    refuse what does not)."""
    found = await stratajob(k8s, name)
    assert found is not None
    errors = [f"{list(e.path)}: {e.message}" for e in validator("stratajobs.strata.dev").iter_errors(found)]
    assert errors == []


async def stratajob(k8s: K8s, name: str) -> dict[str, Any] | None:
    status, body = await call(k8s, "GET", f"{STRATAJOBS}/{name}")
    return body if status == 200 else None


async def status_of(k8s: K8s, name: str) -> dict[str, Any]:
    found = await stratajob(k8s, name)
    return (found or {}).get("status") or {}


def generation_of(pod: dict[str, Any]) -> str | None:
    return (pod["metadata"].get("annotations") or {}).get(names.GENERATION_ANNOTATION)


def running(cluster: Cluster, job: str, generation: str, world: int) -> list[dict[str, Any]] | None:
    pods = [
        p
        for p in cluster.pods(job)
        if p.get("status", {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
        and generation_of(p) == generation
        and not p.get("spec", {}).get("schedulingGates")
    ]
    return pods if len(pods) == world else None


async def events_about(k8s: K8s, name: str) -> list[dict[str, Any]]:
    status, body = await call(k8s, "GET", "/api/v1/namespaces/default/events")
    assert status == 200
    return [e for e in body["items"] if e["involvedObject"]["name"] == name]


async def start_job(k8s: K8s, cluster: Cluster, job: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """Create ``job`` and wait for its first generation to run; (RUN of the generation, its pods)."""
    created = await create(k8s, JOBS, job)
    name, world = created["metadata"]["name"], created["spec"]["completions"]

    async def released() -> str | None:
        found = await stratajob(k8s, name) or {}
        generation = (found.get("status") or {}).get("generation") or ""
        mine = found.get("spec", {}).get("workload", {}).get("uid") == created["metadata"]["uid"]
        return generation.removesuffix("/0") if mine and generation.endswith("/0") else None

    run = await until(released, message="the StrataJob of this Job at generation 0")
    pods = await until(lambda: running(cluster, name, f"{run}/0", world), message="generation 0 running")
    return run, pods


def release_order(k8s: K8s, old: set[str], new: set[str]) -> tuple[int, int]:
    """(resourceVersion when the last old pod became terminal or gone, resourceVersion when the first
    new pod lost its gate), from the emulator's event log."""
    old_done: dict[str, int] = {}
    new_released: dict[str, int] = {}
    for rv, resource, event in k8s.api._log:
        if resource.plural != "pods":
            continue
        pod = event["object"]
        name = pod["metadata"]["name"]
        ended = event["type"] == "DELETED" or pod.get("status", {}).get("phase") in ("Failed", "Succeeded")
        if name in old and name not in old_done and ended:
            old_done[name] = rv
        gates = [g["name"] for g in pod.get("spec", {}).get("schedulingGates") or []]
        if (
            name in new
            and name not in new_released
            and event["type"] != "ADDED"
            and names.GANG_GATE not in gates
        ):
            new_released[name] = rv
    assert set(old_done) == old, f"old pods never ended: {old - set(old_done)}"
    assert set(new_released) == new, f"new pods never released: {new - set(new_released)}"
    return max(old_done.values()), min(new_released.values())


# ---- first start ----------------------------------------------------------------------------------------


async def test_operator_releases_a_new_gang_as_generation_zero(k8s: K8s, cluster: Cluster) -> None:
    async with operator(k8s):
        run, pods = await start_job(k8s, cluster, indexed_job("recsys", 3))
        status = await status_of(k8s, "recsys")
        assert status["phase"] == "Running" and status["generation"] == f"{run}/0"
        assert status["restarts"] == 0 and status["restartLimit"] == 3 and status["runMode"] == "resumed"
        assert all(generation_of(p) == f"{run}/0" for p in pods)
        await assert_valid(k8s, "recsys")


async def test_operator_leaves_unlabeled_workloads_untouched(k8s: K8s, cluster: Cluster) -> None:
    async with operator(k8s) as op:
        await create(k8s, JOBS, indexed_job("plain", 2, labelled=False))
        pods = await until(
            lambda: (
                [p for p in cluster.pods("plain") if p["status"].get("phase") == "Running"]
                if len(cluster.pods("plain")) == 2
                else None
            )
        )
        await cluster.fail(pods[0])
        await asyncio.sleep(1.0)
        assert await stratajob(k8s, "plain") is None
        assert op.controller.jobs == {}
        assert all(not p.get("spec", {}).get("schedulingGates") for p in cluster.pods("plain"))
        assert all(generation_of(p) is None for p in cluster.pods("plain"))
        assert k8s.api.evictions == []


# ---- gang restarts --------------------------------------------------------------------------------------


async def test_operator_pod_failure_restarts_the_whole_gang_after_the_old_one_ends(
    k8s: K8s, cluster: Cluster
) -> None:
    async with operator(k8s):
        job = indexed_job("recsys", 3, annotations={"strata.dev/backoff-seconds": "0.2"})
        run, pods = await start_job(k8s, cluster, job)
        failed = next(p for p in pods if p["metadata"]["labels"][names.JOB_INDEX_LABEL] == "1")
        await cluster.fail(failed, 1)
        new = await until(lambda: running(cluster, "recsys", f"{run}/1", 3), message="generation 1 running")
        status = await status_of(k8s, "recsys")
        assert status["generation"] == f"{run}/1" and status["restarts"] == 1 and status["phase"] == "Running"
        assert status["lastFailure"]["reason"] == "ExitError"
        assert failed["metadata"]["name"] in status["lastFailure"]["pod"]
        # Survivors were evicted (DisruptionTarget, which podFailurePolicy ignores), never the failed one.
        survivors = {p["metadata"]["name"] for p in pods} - {failed["metadata"]["name"]}
        assert set(k8s.api.evictions) == survivors
        last_old, first_new = release_order(
            k8s, {p["metadata"]["name"] for p in pods}, {p["metadata"]["name"] for p in new}
        )
        assert last_old < first_new, "a new pod was released before every old pod had ended"
        reasons = [e["reason"] for e in await events_about(k8s, "recsys")]
        assert "GangRestart" in reasons and reasons.count("GangReleased") == 2


async def restarted_by(
    k8s: K8s, cluster: Cluster, name: str, act: Callable[[list[dict[str, Any]]], Awaitable[Any]]
) -> dict[str, Any]:
    """Start a 2-rank job, do ``act`` to its pods, wait for its second generation; its status."""
    async with operator(k8s):
        job = indexed_job(name, 2, annotations={"strata.dev/backoff-seconds": "0"})
        run, pods = await start_job(k8s, cluster, job)
        await act(pods)
        await until(lambda: running(cluster, name, f"{run}/1", 2), message="generation 1")
        await assert_valid(k8s, name)
        return await status_of(k8s, name)


async def test_operator_oomkilled_pod_is_classified_and_restarts_the_gang(k8s: K8s, cluster: Cluster) -> None:
    status = await restarted_by(
        k8s, cluster, "oom", lambda pods: cluster.fail(pods[0], 137, reason="OOMKilled")
    )
    assert status["lastFailure"]["reason"] == "OOMKilled" and status["lastFailure"]["kind"] == "oom"
    assert "OOM killer" in status["lastFailure"]["message"]


async def test_operator_evicted_pod_is_classified_and_restarts_the_gang(k8s: K8s, cluster: Cluster) -> None:
    status = await restarted_by(k8s, cluster, "evict", lambda pods: cluster.kubelet_evict(pods[1]))
    assert status["lastFailure"]["reason"] == "Evicted"


async def test_operator_deleted_pod_is_classified_and_restarts_the_gang(k8s: K8s, cluster: Cluster) -> None:
    async def delete(pods: list[dict[str, Any]]) -> None:
        status, body = await call(
            k8s, "DELETE", f"/api/v1/namespaces/default/pods/{pods[0]['metadata']['name']}"
        )
        assert status == 200, body

    status = await restarted_by(k8s, cluster, "deleted", delete)
    assert status["lastFailure"]["reason"] == "PodDeleted"


async def test_operator_eviction_refused_by_a_disruption_budget_falls_back_to_delete(
    k8s: K8s, cluster: Cluster
) -> None:
    async with operator(k8s):
        run, pods = await start_job(
            k8s, cluster, indexed_job("pdb", 2, annotations={"strata.dev/backoff-seconds": "0"})
        )
        k8s.api.pdb_blocked.add(("default", pods[1]["metadata"]["name"]))
        await cluster.fail(pods[0], 1)
        await until(lambda: running(cluster, "pdb", f"{run}/1", 2), message="generation 1")
        assert k8s.api.evictions == []  # refused (429), then deleted
        # ...marked DisruptionTarget first, so the Job's podFailurePolicy ignores it like an eviction.
        deleted = pods[1]["metadata"]["name"]
        marked = [
            event["object"]
            for _, resource, event in k8s.api._log
            if resource.plural == "pods"
            and event["object"]["metadata"]["name"] == deleted
            and event["object"]["metadata"].get("deletionTimestamp")
        ]
        assert marked, "the pod was never deleted"
        conditions = {c["type"]: c for c in marked[0]["status"]["conditions"]}
        assert conditions["DisruptionTarget"]["reason"] == "DeletionByStrataGangRestart"


async def test_operator_eviction_throttled_by_priority_and_fairness_is_retried_not_deleted(
    k8s: K8s, cluster: Cluster
) -> None:
    """API Priority and Fairness answers 429 with Retry-After and no DisruptionBudget cause: the
    apiserver is busy, no budget refused anything. The eviction is retried, never turned into a delete."""
    async with operator(k8s):
        run, pods = await start_job(
            k8s, cluster, indexed_job("apf", 2, annotations={"strata.dev/backoff-seconds": "0"})
        )
        throttled = pods[1]["metadata"]["name"]
        k8s.api.apf_throttled[("default", throttled)] = 1
        await cluster.fail(pods[0], 1)
        await until(lambda: running(cluster, "apf", f"{run}/1", 2), message="generation 1")
        assert k8s.api.apf_throttled[("default", throttled)] == 0  # the 429 was met
        assert k8s.api.evictions == [throttled]  # evicted on the retry
        reasons = {
            c.get("reason")
            for _, resource, event in k8s.api._log
            if resource.plural == "pods" and event["object"]["metadata"]["name"] == throttled
            for c in event["object"].get("status", {}).get("conditions") or []
            if c.get("type") == "DisruptionTarget"
        }
        # Evicted, never the disruption-budget fallback's delete (a fence may still follow, on a
        # loaded machine, if the evicted pod stays Terminating past its grace period).
        assert "EvictionByEvictionAPI" in reasons and "DeletionByStrataGangRestart" not in reasons


async def test_operator_stuck_terminating_pod_is_fenced_and_never_mixed_with_the_new_gang(
    k8s: K8s, cluster: Cluster
) -> None:
    async with operator(k8s):
        run, pods = await start_job(
            k8s, cluster, indexed_job("lost", 2, annotations={"strata.dev/backoff-seconds": "0"})
        )
        lost = pods[0]
        await cluster.lose_node(lost["spec"]["nodeName"])
        # Grace 2 s + margin 1 s: the gang waits, and nothing of generation 1 runs meanwhile.
        await asyncio.sleep(1.5)
        assert not any(
            generation_of(p) == f"{run}/1" and not p["spec"].get("schedulingGates")
            for p in cluster.pods("lost")
        )
        assert any(p["metadata"]["name"] == lost["metadata"]["name"] for p in cluster.pods("lost"))
        new = await until(lambda: running(cluster, "lost", f"{run}/1", 2), message="generation 1")
        status = await status_of(k8s, "lost")
        assert status["lastFailure"]["reason"] == "NodeLost"
        reasons = [e["reason"] for e in await events_about(k8s, "lost")]
        assert "PodFenced" in reasons
        last_old, first_new = release_order(
            k8s, {p["metadata"]["name"] for p in pods}, {p["metadata"]["name"] for p in new}
        )
        assert last_old < first_new


async def test_operator_restart_limit_is_respected_then_the_job_fails(k8s: K8s, cluster: Cluster) -> None:
    async with operator(k8s) as running_operator:
        annotations = {"strata.dev/backoff-seconds": "0", "strata.dev/max-restarts": "1"}
        run, pods = await start_job(k8s, cluster, indexed_job("limit", 2, annotations=annotations))
        await cluster.fail(pods[0], 1)
        pods = await until(lambda: running(cluster, "limit", f"{run}/1", 2), message="generation 1")
        await cluster.fail(pods[1], 1)
        status = await until(lambda: _phase(k8s, "limit", "Failed"), message="phase Failed")
        assert status["restarts"] == 1 and status["restartLimit"] == 1
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["status"] == "True" and failed["reason"] == "RestartLimitReached"
        # what the chart's StrataRestartsExhausted alert reads
        registry = running_operator.metrics.registry
        exhausted = {"reason": "RestartLimitReached"}
        assert registry.get_sample_value("strata_operator_jobs_failed_total", exhausted) == 1
        # Once the gang has stopped, its replacement is released only to stop: never a new generation.
        stopping = await until(
            lambda: _stopping(cluster, "limit"), message="the replacement released to stop"
        )
        assert {generation_of(p) for p in stopping} == {f"{run}/1"}
        assert not any(generation_of(p) == f"{run}/2" for p in cluster.pods("limit"))
        # Its trainer exits 76 (the sidecar refuses it): the Job's FailJob rule ends the Job.
        await cluster.fail(stopping[0], names.EXIT_LIMIT_SPENT, container="trainer")
        job = await until(lambda: _job_failed(k8s, "limit"), message="the Job failed by its podFailurePolicy")
        assert job["reason"] == "PodFailurePolicy"
        reasons = [e["reason"] for e in await events_about(k8s, "limit")]
        assert "RestartLimitReached" in reasons and "ReleasedToStop" in reasons
        await assert_valid(k8s, "limit")


def _stopping(cluster: Cluster, job: str) -> list[dict[str, Any]]:
    return [
        p
        for p in cluster.pods(job)
        if (p["metadata"].get("annotations") or {}).get(names.RESTORE_REQUEST_ANNOTATION)
        == names.STOP_REQUEST
        and not p["spec"].get("schedulingGates")
        and p["status"].get("phase") == "Running"
    ]


async def _job_failed(k8s: K8s, name: str) -> dict[str, Any] | None:
    status, body = await call(k8s, "GET", f"{JOBS}/{name}")
    assert status == 200, body
    return next((c for c in body.get("status", {}).get("conditions") or [] if c["type"] == "Failed"), None)


async def _phase(k8s: K8s, name: str, phase: str) -> dict[str, Any] | None:
    status = await status_of(k8s, name)
    return status if status.get("phase") == phase else None


async def test_operator_malformed_annotations_get_a_condition_and_an_event_naming_them(
    k8s: K8s, cluster: Cluster
) -> None:
    async with operator(k8s):
        job = indexed_job(
            "typo", 1, annotations={"strata.dev/max-restart": "2", "strata.dev/backoff-seconds": "soon"}
        )
        await create(k8s, JOBS, job)
        status = await until(lambda: _condition(k8s, "typo", "SettingsValid"), message="SettingsValid")
        assert status["status"] == "False" and status["reason"] == "InvalidAnnotations"
        assert (
            "strata.dev/max-restart" in status["message"]
            and "did you mean strata.dev/max-restarts" in status["message"]
        )
        assert "strata.dev/backoff-seconds" in status["message"]
        events = [e for e in await events_about(k8s, "typo") if e["reason"] == "InvalidAnnotations"]
        assert {e["involvedObject"]["kind"] for e in events} == {"StrataJob", "Job"}
        assert all(e["type"] == "Warning" for e in events)


async def _condition(k8s: K8s, name: str, kind: str) -> dict[str, Any] | None:
    for condition in (await status_of(k8s, name)).get("conditions") or []:
        if condition["type"] == kind:
            found: dict[str, Any] = condition
            return found
    return None


async def test_operator_restarted_mid_restart_resumes_the_decision(k8s: K8s, cluster: Cluster) -> None:
    annotations = {"strata.dev/backoff-seconds": "3", "strata.dev/backoff-max-seconds": "3"}
    async with operator(k8s):
        run, pods = await start_job(k8s, cluster, indexed_job("resume", 2, annotations=annotations))
        await cluster.fail(pods[0], 1)
        pending = await until(lambda: _pending(k8s, "resume"), message="a pending restart")
        assert pending["generation"] == f"{run}/1"
    # The operator is down while the backoff runs; a new one picks the decision up from the status.
    async with operator(k8s):
        await until(lambda: running(cluster, "resume", f"{run}/1", 2), message="generation 1")
        status = await status_of(k8s, "resume")
        assert status["restarts"] == 1, "the restart was counted twice"
        assert status.get("pendingRestart") is None


async def _pending(k8s: K8s, name: str) -> dict[str, Any] | None:
    found: dict[str, Any] | None = (await status_of(k8s, name)).get("pendingRestart")
    return found


async def test_operator_kubectl_get_stratajob_shows_the_job_level_status(k8s: K8s, cluster: Cluster) -> None:
    async with operator(k8s):
        run, pods = await start_job(
            k8s, cluster, indexed_job("recsys", 2, annotations={"strata.dev/backoff-seconds": "0"})
        )
        await cluster.fail(pods[0], 137, reason="OOMKilled")
        await until(lambda: running(cluster, "recsys", f"{run}/1", 2), message="generation 1")
        table = rows(await kubectl(k8s, "get", "stratajobs"))
        assert table[0] == [
            "NAME",
            "WORKLOAD",
            "PHASE",
            "STEP",
            "ATTEMPT",
            "RESTARTS",
            "LIMIT",
            "DISRUPTIONS",
            "LAST-FAILURE",
            "AGE",
        ]
        row = table[1]
        assert row[:3] == ["recsys", "Job", "Running"] and row[5:9] == ["1", "3", "0", "OOMKilled"]
        described = await kubectl(k8s, "describe", "stratajob", "recsys")
        assert "GangRestart" in described and "GangReleased" in described
        assert "OOM killer" in described


async def _with_run(k8s: K8s, name: str) -> dict[str, Any] | None:
    status = await status_of(k8s, name)
    return status if status.get("run") else None


# ---- hang, rollback, resubmission, JobSet ---------------------------------------------------------------


def heartbeat(
    job: str, generation: str, rank: int, step: int | None, saves: int, attempt: int = 1
) -> dict[str, Any]:
    return {
        "kind": "heartbeat",
        "namespace": "default",
        "job": job,
        "rank": rank,
        "generation": generation,
        "attempt": attempt,
        "restore_step": None,
        "step": step,
        "saves": saves,
        "time": time.time(),
    }


async def test_operator_hang_timeout_restarts_a_gang_whose_heartbeats_show_no_progress(
    k8s: K8s, cluster: Cluster
) -> None:
    annotations = {"strata.dev/backoff-seconds": "0", "strata.dev/hang-timeout": "3"}
    async with operator(k8s) as op:
        run, pods = await start_job(k8s, cluster, indexed_job("hung", 2, annotations=annotations))
        # Progress keeps it alive past the timeout...
        for saves in range(1, 6):
            for rank in (0, 1):
                await op.controller.on_heartbeat(
                    heartbeat("hung", f"{run}/0", rank, saves * 100, saves), pods[rank]["metadata"]["name"]
                )
            await asyncio.sleep(0.5)
        status = await status_of(k8s, "hung")
        assert status["generation"] == f"{run}/0" and status["attempt"] == 1
        # ...heartbeats that repeat the same step and save count do not.
        for _ in range(4):
            for rank in (0, 1):
                await op.controller.on_heartbeat(
                    heartbeat("hung", f"{run}/0", rank, 500, 5), pods[rank]["metadata"]["name"]
                )
            await asyncio.sleep(0.6)
        await until(lambda: running(cluster, "hung", f"{run}/1", 2), message="generation 1")
        status = await status_of(k8s, "hung")
        assert status["lastFailure"]["reason"] == "Hang" and "3 s" in status["lastFailure"]["message"]
        await assert_valid(k8s, "hung")


async def test_operator_resume_from_is_passed_once_with_the_next_generation(
    k8s: K8s, cluster: Cluster
) -> None:
    job = indexed_job(
        "rollback",
        2,
        annotations={"strata.dev/backoff-seconds": "0"},
        job_annotations={names.RESUME_FROM_ANNOTATION: "1200"},
    )
    async with operator(k8s):
        run, pods = await start_job(k8s, cluster, job)
        requests = {
            (p["metadata"].get("annotations") or {}).get(names.RESTORE_REQUEST_ANNOTATION) for p in pods
        }
        assert requests == {"1200"}
        assert (await status_of(k8s, "rollback"))["resumeFromApplied"] == "1200"
        await cluster.fail(pods[0], 1)
        pods = await until(lambda: running(cluster, "rollback", f"{run}/1", 2), message="generation 1")
        # Never re-applied at a later restart: the sidecar restores the newest commit again.
        assert all(
            names.RESTORE_REQUEST_ANNOTATION not in (p["metadata"].get("annotations") or {}) for p in pods
        )
        # A new value on the Job's metadata applies once more, at the next generation.
        status, body = await call(
            k8s,
            "PATCH",
            f"{JOBS}/rollback",
            {"metadata": {"annotations": {names.RESUME_FROM_ANNOTATION: "none"}}},
        )
        assert status == 200, body
        await asyncio.sleep(0.5)
        await cluster.fail(pods[1], 1)
        pods = await until(lambda: running(cluster, "rollback", f"{run}/2", 2), message="generation 2")
        assert {p["metadata"]["annotations"].get(names.RESTORE_REQUEST_ANNOTATION) for p in pods} == {"none"}
        assert (await status_of(k8s, "rollback"))["resumeFromApplied"] == "none"


async def test_operator_resubmitted_job_resumes_by_default_and_starts_fresh_on_request(
    k8s: K8s, cluster: Cluster
) -> None:
    async with operator(k8s):
        first_run, pods = await start_job(
            k8s, cluster, indexed_job("again", 1, annotations={"strata.dev/backoff-seconds": "0"})
        )
        await cluster.fail(pods[0], 1)
        await until(lambda: running(cluster, "again", f"{first_run}/1", 1), message="generation 1")
        assert (await status_of(k8s, "again"))["restarts"] == 1
        status, body = await call(k8s, "DELETE", f"{JOBS}/again")
        assert status == 200, body
        for pod in cluster.pods("again"):  # no garbage collector here: remove its pods as it would
            await call(
                k8s,
                "DELETE",
                f"/api/v1/namespaces/default/pods/{pod['metadata']['name']}",
                {"gracePeriodSeconds": 0},
            )
        await asyncio.sleep(0.3)
        assert await stratajob(k8s, "again") is not None, "the StrataJob must outlive its Job"
        # Resubmitted: a new run with its own restart budget, resuming the checkpoints.
        resumed_run, pods = await start_job(k8s, cluster, indexed_job("again", 1))
        status = await status_of(k8s, "again")
        assert resumed_run != first_run and status["runMode"] == "resumed" and status["restarts"] == 0
        assert all(
            names.RESTORE_REQUEST_ANNOTATION not in (p["metadata"].get("annotations") or {}) for p in pods
        )
        await call(k8s, "DELETE", f"{JOBS}/again")
        for pod in cluster.pods("again"):
            await call(
                k8s,
                "DELETE",
                f"/api/v1/namespaces/default/pods/{pod['metadata']['name']}",
                {"gracePeriodSeconds": 0},
            )
        await asyncio.sleep(0.3)
        fresh_run, pods = await start_job(
            k8s, cluster, indexed_job("again", 1, job_annotations={names.RUN_ANNOTATION: "fresh"})
        )
        status = await status_of(k8s, "again")
        assert fresh_run not in (first_run, resumed_run) and status["runMode"] == "fresh"
        assert {p["metadata"]["annotations"][names.RESTORE_REQUEST_ANNOTATION] for p in pods} == {"none"}
        await assert_valid(k8s, "again")
        reasons = [e["reason"] for e in await events_about(k8s, "again")]
        assert reasons.count("NewRun") == 2


JOBSETS = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets"


def jobset_pod(jobset: dict[str, Any], index: int, attempt: int) -> dict[str, Any]:
    """A pod as the JobSet's child Job creates it (JobSet pods are never gated)."""
    name = jobset["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{name}-workers-0-{index}-a{attempt}",
            "namespace": "default",
            "labels": {
                names.OPT_IN_LABEL: names.OPT_IN_VALUE,
                names.JOBSET_NAME_LABEL: name,
                names.JOBSET_UID_LABEL: jobset["metadata"]["uid"],
                names.JOBSET_RESTART_LABEL: str(attempt),
                names.JOB_NAME_LABEL: f"{name}-workers-0",
                names.JOB_INDEX_LABEL: str(index),
            },
        },
        "spec": {"nodeName": f"node-{index}", "containers": [{"name": "trainer", "image": "trainer:1"}]},
        "status": {"phase": "Running"},
    }


async def test_operator_jobset_restart_is_reflected_without_a_second_retry_layer(
    k8s: K8s, cluster: Cluster
) -> None:
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "llm", "namespace": "default"},
        "spec": {
            "failurePolicy": {"maxRestarts": 3, "restartStrategy": "BlockingRecreate"},
            "replicatedJobs": [
                {
                    "name": "workers",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "completions": 2,
                            "parallelism": 2,
                            "template": {
                                "metadata": {"labels": {names.OPT_IN_LABEL: names.OPT_IN_VALUE}},
                                "spec": {
                                    "restartPolicy": "Never",
                                    "containers": [{"name": "trainer", "image": "t:1"}],
                                },
                            },
                        }
                    },
                }
            ],
        },
    }
    async with operator(k8s):
        created = await create(k8s, JOBSETS, jobset)
        pods = [
            await create(k8s, "/api/v1/namespaces/default/pods", jobset_pod(created, i, 0)) for i in (0, 1)
        ]
        run = (await until(lambda: _with_run(k8s, "llm"), message="the StrataJob"))["run"]
        await until(lambda: _phase(k8s, "llm", "Running"), message="Running")
        # A worker OOMs: recorded, but the JobSet's own controller restarts the gang.
        await cluster.fail(pods[0], 137, reason="OOMKilled")
        await until(lambda: status_of(k8s, "llm"), message="status")
        status = await until(lambda: _failed_with(k8s, "llm", "OOMKilled"), message="the failure recorded")
        assert status["restarts"] == 0
        await asyncio.sleep(0.5)
        assert k8s.api.evictions == [], "the operator must not evict JobSet pods"
        assert all(
            not p["spec"].get("schedulingGates")
            for p in cluster.pods()
            if names.JOBSET_NAME_LABEL in p["metadata"]["labels"]
        )
        # JobSet recreates the gang as restart attempt 1: reflected as the generation.
        for pod in pods:
            await call(
                k8s,
                "DELETE",
                f"/api/v1/namespaces/default/pods/{pod['metadata']['name']}",
                {"gracePeriodSeconds": 0},
            )
        for i in (0, 1):
            await create(k8s, "/api/v1/namespaces/default/pods", jobset_pod(created, i, 1))
        status = await until(lambda: _generation(k8s, "llm", f"{run}/1"), message="generation 1 reflected")
        assert status["restarts"] == 1 and status.get("pendingRestart") is None
        # the generation the injected sidecars compose from their pod's labels (inject.py) is the one the
        # operator expects in their reports and heartbeats
        labels = jobset_pod(created, 0, 1)["metadata"]["labels"]
        composed = f"{labels[names.JOBSET_UID_LABEL]}/{labels[names.JOBSET_RESTART_LABEL]}"
        assert status["generation"] == composed
        assert "JobSetRestarted" in [e["reason"] for e in await events_about(k8s, "llm")]
        await assert_valid(k8s, "llm")
        assert k8s.api.evictions == []


async def _failed_with(k8s: K8s, name: str, reason: str) -> dict[str, Any] | None:
    status = await status_of(k8s, name)
    return status if (status.get("lastFailure") or {}).get("reason") == reason else None


async def _generation(k8s: K8s, name: str, generation: str) -> dict[str, Any] | None:
    status = await status_of(k8s, name)
    return status if status.get("generation") == generation else None


async def test_operator_lift_gates_releases_every_gated_pod_and_keeps_other_gates(k8s: K8s) -> None:
    def pod(name: str, gates: list[str]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": "default",
                "labels": {names.OPT_IN_LABEL: names.OPT_IN_VALUE},
            },
            "spec": {"schedulingGates": [{"name": g} for g in gates], "containers": [{"name": "trainer"}]},
        }

    await create(k8s, "/api/v1/namespaces/default/pods", pod("a", [names.GANG_GATE]))
    await create(
        k8s, "/api/v1/namespaces/default/pods", pod("b", ["kueue.x-k8s.io/admission", names.GANG_GATE])
    )
    await create(k8s, "/api/v1/namespaces/default/pods", pod("c", ["other"]))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar.cli",
        "operator",
        "--lift-gates",
        "--kubeconfig",
        str(k8s.kubeconfig),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    assert "lifted the strata.dev/gang gate from 2 pod(s)" in out.decode()
    gates = {}
    for name in "abc":
        status, body = await call(k8s, "GET", f"/api/v1/namespaces/default/pods/{name}")
        assert status == 200, body
        gates[name] = [g["name"] for g in body["spec"].get("schedulingGates") or []]
    assert gates == {"a": [], "b": ["kueue.x-k8s.io/admission"], "c": ["other"]}


async def test_operator_failure_after_some_ranks_succeeded_fails_the_job_instead_of_restarting(
    k8s: K8s, cluster: Cluster
) -> None:
    async with operator(k8s):
        run, pods = await start_job(
            k8s, cluster, indexed_job("ending", 2, annotations={"strata.dev/backoff-seconds": "0"})
        )
        await cluster.succeed(pods[0])
        await asyncio.sleep(0.3)
        await cluster.fail(pods[1], 1)
        status = await until(lambda: _phase(k8s, "ending", "Failed"), message="phase Failed")
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "NotRestartable" and "index(es) 0 had succeeded" in failed["message"]
        assert status["restarts"] == 0
        assert not any(generation_of(p) == f"{run}/1" for p in cluster.pods("ending"))


@pytest.mark.parametrize("reshardable", [False, True])
async def test_operator_a_checkpoint_of_another_world_size_is_permanent_unless_reshardable(
    k8s: K8s, cluster: Cluster, reshardable: bool
) -> None:
    """A gang of 2 whose newest Checkpoint 4 ranks saved: its trainers cannot restore it, so a
    failure is permanent (no futile restarts), unless the checkpoint was saved through DCP
    (``reshardable``), which loads on any number of ranks: then the gang restarts as usual."""
    async with operator(k8s):
        run, pods = await start_job(
            k8s, cluster, indexed_job("resized", 2, annotations={"strata.dev/backoff-seconds": "0"})
        )
        saved = report(40, job="resized", world_size=4, reshardable=reshardable)
        saved["ranks"] = [dict(saved["ranks"][0], rank=r) for r in range(4)]
        body = objects.checkpoint_body(saved)
        body["metadata"]["labels"][names.LATEST_LABEL] = "true"
        await create(k8s, f"/apis/{names.API_VERSION}/namespaces/default/checkpoints", body)
        await cluster.fail(pods[1], 1)
        if reshardable:
            await until(lambda: running(cluster, "resized", f"{run}/1", 2), message="generation 1")
            assert (await status_of(k8s, "resized"))["restarts"] == 1
            return
        status = await until(lambda: _phase(k8s, "resized", "Failed"), message="phase Failed")
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "NotRestartable", failed
        assert "saved by 4 ranks but the job now has 2; keep the gang at 4 ranks" in failed["message"]
        assert status["restarts"] == 0 and status["lastFailure"]["reason"] == "InvalidConfig"


# ---- regressions: releases cut short, pods that vanish, runs that overlap, operator restarts ---------------


async def test_operator_release_cut_short_by_an_api_error_completes_on_retry(
    k8s: K8s, cluster: Cluster
) -> None:
    async with operator(k8s) as op:
        run, pods = await start_job(
            k8s, cluster, indexed_job("part", 3, annotations={"strata.dev/backoff-seconds": "0"})
        )
        api = op.controller.api
        patch = api.json_patch
        calls = {"n": 0}

        async def flaky(url: str, ops: list[dict[str, Any]]) -> Any:
            if any(op.get("value") == f"{run}/1" for op in ops):  # a release of generation 1
                calls["n"] += 1
                if calls["n"] == 2:  # the second pod's release fails once
                    raise ApiError(500, "InternalError", "injected")
            return await patch(url, ops)

        api.json_patch = flaky  # type: ignore[method-assign]
        await cluster.fail(pods[0], 1)
        await until(lambda: running(cluster, "part", f"{run}/1", 3), message="generation 1 complete")
        assert (await status_of(k8s, "part"))["restarts"] == 1 and calls["n"] >= 3


async def test_operator_force_deleted_pod_is_classified_as_deleted(k8s: K8s, cluster: Cluster) -> None:
    deleted: list[str] = []

    async def force_delete(pods: list[dict[str, Any]]) -> None:
        deleted.append(pods[0]["metadata"]["name"])
        url = f"/api/v1/namespaces/default/pods/{deleted[0]}"
        status, body = await call(k8s, "DELETE", url, {"gracePeriodSeconds": 0})
        assert status == 200, body

    last = (await restarted_by(k8s, cluster, "force", force_delete))["lastFailure"]
    assert last["reason"] == "PodDeleted" and deleted[0] in last["message"]


async def test_operator_pod_gone_while_the_operator_was_down_is_noticed_after_it_restarts(
    k8s: K8s, cluster: Cluster
) -> None:
    async with operator(k8s):
        run, pods = await start_job(
            k8s, cluster, indexed_job("downtime", 2, annotations={"strata.dev/backoff-seconds": "0"})
        )
    name = pods[1]["metadata"]["name"]
    await call(k8s, "DELETE", f"/api/v1/namespaces/default/pods/{name}", {"gracePeriodSeconds": 0})
    await until(
        lambda: [p for p in cluster.pods("downtime") if p["spec"].get("schedulingGates")],
        message="a gated replacement",
    )
    async with operator(k8s):
        await until(lambda: running(cluster, "downtime", f"{run}/1", 2), message="generation 1")
        assert (await status_of(k8s, "downtime"))["lastFailure"]["reason"] == "PodDeleted"


async def test_operator_resubmitted_job_waits_for_the_earlier_runs_pods(k8s: K8s, cluster: Cluster) -> None:
    async with operator(k8s):
        first_run, pods = await start_job(k8s, cluster, indexed_job("overlap", 2))
        status, body = await call(k8s, "DELETE", f"{JOBS}/overlap")
        assert status == 200, body
        # Orphaned (as `kubectl delete --cascade=orphan` leaves them): they still run.
        created = await create(k8s, JOBS, indexed_job("overlap", 2))
        await until(lambda: _events_with(k8s, "overlap", "WaitingForEarlierRun"), message="the Warning")
        assert not any(
            generation_of(p) and not generation_of(p).startswith(first_run) for p in cluster.pods("overlap")
        ), "the new run started while the earlier run's pods ran"
        for pod in pods:
            await call(k8s, "DELETE", f"/api/v1/namespaces/default/pods/{pod['metadata']['name']}")
        run = await until(
            lambda: _new_generation(k8s, "overlap", created["metadata"]["uid"]), message="new run"
        )
        await until(lambda: running(cluster, "overlap", f"{run}/0", 2), message="the new run's gang")


async def _events_with(k8s: K8s, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in await events_about(k8s, name) if e["reason"] == reason]


async def _new_generation(k8s: K8s, name: str, uid: str) -> str | None:
    found = await stratajob(k8s, name) or {}
    generation = (found.get("status") or {}).get("generation") or ""
    mine = found.get("spec", {}).get("workload", {}).get("uid") == uid
    return generation.removesuffix("/0") if mine and generation.endswith("/0") else None


async def test_operator_restart_does_not_count_an_old_generation_as_hung(k8s: K8s, cluster: Cluster) -> None:
    annotations = {"strata.dev/backoff-seconds": "0", "strata.dev/hang-timeout": "3"}
    async with operator(k8s) as op:
        run, _ = await start_job(k8s, cluster, indexed_job("steady", 1, annotations=annotations))
        for saves in range(1, 9):  # progress for longer than the hang timeout
            await op.controller.on_heartbeat(heartbeat("steady", f"{run}/0", 0, saves, saves), "")
            await asyncio.sleep(0.5)
    async with operator(k8s) as op:
        for saves in range(9, 13):  # the new operator hears progress too
            await op.controller.on_heartbeat(heartbeat("steady", f"{run}/0", 0, saves, saves), "")
            await asyncio.sleep(0.5)
        status = await status_of(k8s, "steady")
        assert status["restarts"] == 0 and status["generation"] == f"{run}/0", status.get("lastFailure")


async def test_operator_limit_without_a_failjob_rule_keeps_the_replacements_gated(
    k8s: K8s, cluster: Cluster
) -> None:
    job = indexed_job(
        "norule", 1, annotations={"strata.dev/backoff-seconds": "0", "strata.dev/max-restarts": "0"}
    )
    rules = job["spec"]["podFailurePolicy"]["rules"]
    job["spec"]["podFailurePolicy"]["rules"] = [r for r in rules if r["action"] != "FailJob"]
    async with operator(k8s):
        _, pods = await start_job(k8s, cluster, job)
        await cluster.fail(pods[0], 1)
        await until(lambda: _events_with(k8s, "norule", "ReplacementsKeptGated"), message="the Warning")
        gated = [p for p in cluster.pods("norule") if p["spec"].get("schedulingGates")]
        assert gated and not _stopping(cluster, "norule")


async def test_operator_release_cut_short_at_its_status_write_completes_on_retry(
    k8s: K8s, cluster: Cluster
) -> None:
    async with operator(k8s) as op:
        run, pods = await start_job(
            k8s, cluster, indexed_job("statusw", 2, annotations={"strata.dev/backoff-seconds": "0"})
        )
        api = op.controller.api
        patch = api.merge_patch
        failed = {"n": 0}

        async def flaky(url: str, body: Any) -> Any:
            release = url.endswith("/status") and (body.get("status") or {}).get("generation") == f"{run}/1"
            if release and failed["n"] == 0:  # every pod is released, then the status write fails once
                failed["n"] += 1
                raise ApiError(500, "InternalError", "injected")
            return await patch(url, body)

        api.merge_patch = flaky  # type: ignore[method-assign]
        await cluster.fail(pods[0], 1)
        status = await until(lambda: _generation(k8s, "statusw", f"{run}/1"), message="generation 1 recorded")
        assert status.get("pendingRestart") is None and failed["n"] == 1


async def test_operator_job_that_ended_by_its_own_policy_is_not_restarted(k8s: K8s, cluster: Cluster) -> None:
    async with operator(k8s):
        _, pods = await start_job(k8s, cluster, indexed_job("ended", 2))
        condition = {"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}
        status, body = await call(
            k8s, "PATCH", f"{JOBS}/ended/status", {"status": {"conditions": [condition]}}
        )
        assert status == 200, body
        await until(lambda: _phase(k8s, "ended", "Failed"), message="phase Failed")
        for pod in pods:  # the Job controller deletes the pods of a failed Job
            await call(
                k8s,
                "DELETE",
                f"/api/v1/namespaces/default/pods/{pod['metadata']['name']}",
                {"gracePeriodSeconds": 0},
            )
        await asyncio.sleep(0.5)
        status_now = await status_of(k8s, "ended")
        assert status_now["restarts"] == 0 and status_now.get("pendingRestart") is None


async def test_operator_metrics_are_scraped_by_a_real_prometheus(
    k8s: K8s, cluster: Cluster, tmp_path: Path
) -> None:
    port = free_port()
    async with operator(k8s, metrics_port=port, metrics_host="127.0.0.1"):
        run, pods = await start_job(
            k8s, cluster, indexed_job("scraped", 2, annotations={"strata.dev/backoff-seconds": "0"})
        )
        await cluster.fail(pods[0], 137, reason="OOMKilled")
        await until(lambda: running(cluster, "scraped", f"{run}/1", 2), message="generation 1")
        prom = Prometheus(prometheus_bin(), tmp_path, [f"127.0.0.1:{port}"], job="strata-operator")
        try:
            # Blocking HTTP queries: off the loop that serves the emulated API.
            restarts = await asyncio.to_thread(
                prom.wait_query, 'strata_operator_restarts_total{reason="oom"}', lambda r: len(r) == 1, 30
            )
            assert float(restarts[0]["value"][1]) == 1 and restarts[0]["metric"]["job"] == "strata-operator"
            watched = await asyncio.to_thread(
                prom.wait_query, "strata_operator_watched_jobs", lambda r: len(r) == 1, 30
            )
            assert float(watched[0]["value"][1]) == 1
            calls = await asyncio.to_thread(
                prom.wait_query, "strata_operator_api_calls_total", lambda r: len(r) == 1, 30
            )
            assert float(calls[0]["value"][1]) > 0
        finally:
            prom.stop()
