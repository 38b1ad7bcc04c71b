"""Lifecycle of StrataJobs and Checkpoint objects: they outlive a deleted workload (a resubmission
resumes from them) for strata.dev/retention, then the operator deletes them; with
strata.dev/owned-by-workload they carry an ownerReference to the workload instead, for the
garbage collector. The real operator against the emulated API and cluster.

Cluster-agnostic: everything goes through the API. The emulator has no garbage collector: deleting
a Job here leaves its pods, which the tests remove as the collector would.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from sidecar.operator import names, objects
from tests.k8s.cluster import Cluster, create, indexed_job
from tests.k8s.conftest import K8s, call
from tests.k8s.test_crds import report
from tests.k8s.test_operator import (
    JOBS,
    STRATAJOBS,
    assert_valid,
    cluster,  # noqa: F401  (fixture)
    operator,
    start_job,
    status_of,
    stratajob,
    until,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

CHECKPOINTS = "/apis/strata.dev/v1alpha1/namespaces/default/checkpoints"


async def add_checkpoint(k8s: K8s, job: str, step: int) -> str:
    body = objects.checkpoint_body(report(step, job=job))
    await create(k8s, CHECKPOINTS, body)
    name: str = body["metadata"]["name"]
    return name


async def checkpoints_of(k8s: K8s, job: str) -> list[dict[str, Any]]:
    status, body = await call(k8s, "GET", CHECKPOINTS, params={"labelSelector": f"{names.JOB_LABEL}={job}"})
    assert status == 200
    items: list[dict[str, Any]] = body["items"]
    return items


async def delete_job(k8s: K8s, sim: Cluster, name: str) -> None:
    """Delete the Job (kubectl delete, or the TTL controller after ttlSecondsAfterFinished), and its
    pods as the garbage collector would."""
    status, body = await call(k8s, "DELETE", f"{JOBS}/{name}")
    assert status == 200, body
    for pod in sim.pods(name):
        await call(
            k8s,
            "DELETE",
            f"/api/v1/namespaces/default/pods/{pod['metadata']['name']}",
            {"gracePeriodSeconds": 0},
        )


def deletions(op: Any, kind: str) -> float | None:
    value: float | None = op.metrics.registry.get_sample_value(
        "strata_operator_retention_deletions_total", {"kind": kind}
    )
    return value


async def test_retention_deletes_the_stratajob_and_its_checkpoints_after_the_workload_is_gone(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
) -> None:
    async with operator(k8s) as op:
        await start_job(k8s, cluster, indexed_job("short", 1, job_annotations={"strata.dev/retention": "2s"}))
        assert (await status_of(k8s, "short"))["retention"] == "2s"
        mine = {await add_checkpoint(k8s, "short", 100), await add_checkpoint(k8s, "short", 200)}
        other = await add_checkpoint(k8s, "other", 100)
        deleted_at = time.monotonic()
        await delete_job(k8s, cluster, "short")

        async def marked() -> str | None:
            found = await status_of(k8s, "short")
            return found.get("workloadDeletedAt")

        await until(marked, message="workloadDeletedAt recorded")
        await assert_valid(k8s, "short")
        await asyncio.sleep(max(0.0, deleted_at + 1.0 - time.monotonic()))
        assert await stratajob(k8s, "short") is not None, "deleted before its retention passed"
        assert {c["metadata"]["name"] for c in await checkpoints_of(k8s, "short")} == mine

        async def gone() -> bool:
            return await stratajob(k8s, "short") is None

        await until(gone, timeout=10, message="the StrataJob deleted")
        assert time.monotonic() - deleted_at >= 1.8

        async def no_checkpoints() -> bool:
            return await checkpoints_of(k8s, "short") == []

        # The StrataJob goes first (with preconditions), its Checkpoints right after.
        await until(no_checkpoints, timeout=5, message="the Checkpoints deleted")
        assert [c["metadata"]["name"] for c in await checkpoints_of(k8s, "other")] == [other]
        assert deletions(op, "StrataJob") == 1 and deletions(op, "Checkpoint") == 2


async def test_resubmission_within_the_retention_resumes_and_is_kept(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
) -> None:
    async with operator(k8s):
        job = indexed_job("again", 1, job_annotations={"strata.dev/retention": "1s"})
        first = await create(k8s, JOBS, job)
        await until(
            lambda: cluster.pods("again") and cluster.pods("again")[0]["status"]["phase"] == "Running"
        )
        await add_checkpoint(k8s, "again", 100)
        await delete_job(k8s, cluster, "again")

        async def marked() -> str | None:
            return (await status_of(k8s, "again")).get("workloadDeletedAt")

        await until(marked, message="workloadDeletedAt recorded")
        second = await create(k8s, JOBS, job)
        assert second["metadata"]["uid"] != first["metadata"]["uid"]

        async def resumed() -> dict[str, Any] | None:
            found = await stratajob(k8s, "again") or {}
            status = found.get("status") or {}
            mine = found.get("spec", {}).get("workload", {}).get("uid") == second["metadata"]["uid"]
            return status if mine and "workloadDeletedAt" not in status else None

        status = await until(resumed, message="the resubmission's run, mark cleared")
        assert status["runMode"] == "resumed"
        await asyncio.sleep(1.5)  # past the retention of the deletion
        assert await stratajob(k8s, "again") is not None
        assert len(await checkpoints_of(k8s, "again")) == 1


async def test_sweep_at_start_finds_stratajobs_whose_workload_went_while_no_operator_ran(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
) -> None:
    """Workloads deleted while the operator was down: no DELETED event will come."""
    for name, retention in (("orphan", "1s"), ("kept", "never"), ("alive", "1s")):
        workload = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "uid": f"uid-{name}"}}
        body = objects.stratajob_body("default", name, workload)
        body["status"]["retention"] = retention
        await create(k8s, STRATAJOBS, body)
        await add_checkpoint(k8s, name, 100)
    # a workload that still exists (not opted in: no operator watches it, the sweep GETs it)
    await create(k8s, JOBS, indexed_job("alive", 1, labelled=False))
    started = time.monotonic()
    async with operator(k8s) as op:

        async def gone() -> bool:
            return await stratajob(k8s, "orphan") is None

        await until(gone, timeout=10, message="the orphaned StrataJob deleted")
        assert time.monotonic() - started >= 0.9

        async def no_checkpoints() -> bool:
            return await checkpoints_of(k8s, "orphan") == []

        # The StrataJob goes first (with preconditions), its Checkpoints right after.
        await until(no_checkpoints, timeout=5, message="the orphan's Checkpoints deleted")
        kept = await status_of(k8s, "kept")
        assert kept.get("workloadDeletedAt"), "the vanished workload is recorded"
        assert len(await checkpoints_of(k8s, "kept")) == 1
        assert "workloadDeletedAt" not in await status_of(k8s, "alive")
        assert len(await checkpoints_of(k8s, "alive")) == 1
        assert deletions(op, "StrataJob") == 1


async def test_owned_by_workload_gives_the_stratajob_and_checkpoints_an_owner_reference(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
) -> None:
    before = await add_checkpoint(k8s, "owned", 100)  # from an earlier run of that name
    async with operator(k8s) as op:
        owned = indexed_job("owned", 1, job_annotations={"strata.dev/owned-by-workload": "true"})
        await start_job(k8s, cluster, owned)
        await start_job(k8s, cluster, indexed_job("loose", 1))
        job = await call(k8s, "GET", f"{JOBS}/owned")
        reference = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": "owned",
            "uid": job[1]["metadata"]["uid"],
        }

        async def referenced() -> list[Any] | None:
            found = await stratajob(k8s, "owned") or {}
            refs: list[Any] | None = found.get("metadata", {}).get("ownerReferences")
            return refs

        assert await until(referenced, message="the StrataJob's ownerReferences") == [reference]
        status, held = await call(k8s, "GET", f"{CHECKPOINTS}/{before}")
        assert status == 200 and held["metadata"].get("ownerReferences") == [reference]
        # a commit reported now is created owned
        pod = cluster.pods("owned")[0]["metadata"]["name"]
        await op.writer.write(report(300, job="owned", attempt=1), pod)
        status, new = await call(k8s, "GET", f"{CHECKPOINTS}/{objects.checkpoint_name('owned', 300)}")
        assert status == 200 and new["metadata"].get("ownerReferences") == [reference]
        # not asked for: none
        loose = await stratajob(k8s, "loose")
        assert loose is not None and not loose["metadata"].get("ownerReferences")
        await op.writer.write(report(300, job="loose", attempt=1), pod)
        status, free = await call(k8s, "GET", f"{CHECKPOINTS}/{objects.checkpoint_name('loose', 300)}")
        assert status == 200 and not free["metadata"].get("ownerReferences")


async def test_sweep_at_start_deletes_checkpoints_left_without_a_stratajob_or_a_workload(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
) -> None:
    """An operator stopped between an expiry's two deletions (the StrataJob, then its Checkpoints),
    or a StrataJob deleted by hand once its workload is gone: nothing else points at the
    Checkpoints, and they stayed forever. Those of a live workload stay (young ones too: a new job's
    first Checkpoint may precede its StrataJob; timed exactly in test_attack_ops.py)."""
    workload = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "handmade", "uid": "uid-h"}}
    await create(k8s, STRATAJOBS, objects.stratajob_body("default", "handmade", workload))
    orphaned = {await add_checkpoint(k8s, "handmade", 100), await add_checkpoint(k8s, "handmade", 200)}
    status, body = await call(k8s, "DELETE", f"{STRATAJOBS}/handmade")
    assert status == 200, body
    await add_checkpoint(k8s, "alive", 100)
    await create(k8s, JOBS, indexed_job("alive", 1, labelled=False))  # not opted in: no StrataJob
    grace = 1.0
    await asyncio.sleep(grace + 0.1)  # timestamps are whole seconds, rounded down: all past the grace
    async with operator(k8s, orphan_grace_s=grace) as op:

        async def no_checkpoints() -> bool:
            return await checkpoints_of(k8s, "handmade") == []

        await until(no_checkpoints, timeout=5, message="the orphaned Checkpoints deleted")
        assert deletions(op, "Checkpoint") == len(orphaned)
        assert len(await checkpoints_of(k8s, "alive")) == 1
