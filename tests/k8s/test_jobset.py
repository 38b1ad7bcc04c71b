"""JobSets (and Kubeflow Trainer v2 TrainJobs) end to end: the real operator (kopf watching the
emulated API), a JobSet controller (tests/k8s/jobset_sim.py) restarting the gang itself under
BlockingRecreate, and the kubelets of tests/k8s/cluster.py.

Cluster-agnostic: everything goes through the API, so the same checks can run against kind with the
real JobSet controller.
"""

from __future__ import annotations

import asyncio
import copy
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from sidecar.operator import names, webhook
from tests.k8s.cluster import Cluster, create
from tests.k8s.conftest import K8s, call
from tests.k8s.jobset_sim import JobSetController
from tests.k8s.test_crds import install_crds
from tests.k8s.test_operator import assert_valid, events_about, operator, status_of, until

pytestmark = [pytest.mark.timeout(60)]

JOBSETS = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "kubernetes" / "operator.md"


@pytest_asyncio.fixture
async def jobsets(k8s: K8s) -> AsyncIterator[JobSetController]:
    await install_crds(k8s)
    async with (
        Cluster(k8s, termination_s=0.5).running() as cluster,
        JobSetController(cluster).running() as controller,
    ):
        yield controller


def jobset(name: str, world: int, *, max_restarts: int = 1, grace_s: int = 1) -> dict[str, Any]:
    """An opted-in JobSet as the docs recommend it (BlockingRecreate, backoffLimit 0, Never)."""
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "failurePolicy": {"maxRestarts": max_restarts, "restartStrategy": "BlockingRecreate"},
            "replicatedJobs": [
                {
                    "name": "workers",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "completionMode": "Indexed",
                            "completions": world,
                            "parallelism": world,
                            "backoffLimit": 0,
                            "template": {
                                "metadata": {"labels": {names.OPT_IN_LABEL: names.OPT_IN_VALUE}},
                                "spec": {
                                    "restartPolicy": "Never",
                                    "terminationGracePeriodSeconds": grace_s,
                                    "containers": [{"name": "trainer", "image": "trainer:1"}],
                                },
                            },
                        }
                    },
                }
            ],
        },
    }


def gang(sim: JobSetController, name: str, attempt: int, world: int) -> list[dict[str, Any]] | None:
    """The pods of ``attempt`` once all ``world`` of them run (by completion index)."""
    pods = [
        p
        for p in sim.cluster.pods()
        if p["metadata"]["labels"].get(names.JOBSET_NAME_LABEL) == name
        and p["metadata"]["labels"].get(names.JOBSET_RESTART_LABEL) == str(attempt)
        and p.get("status", {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
    ]
    pods.sort(key=lambda p: p["metadata"]["labels"][names.JOB_INDEX_LABEL])
    return pods if len(pods) == world else None


async def start(k8s: K8s, sim: JobSetController, body: dict[str, Any], world: int) -> tuple[str, list[Any]]:
    """Create the JobSet; (its uid, the pods of attempt 0 once they run and the StrataJob says so)."""
    created = await create(k8s, JOBSETS, body)
    name, uid = created["metadata"]["name"], created["metadata"]["uid"]
    pods = await until(lambda: gang(sim, name, 0, world), 10, "attempt 0 running")
    await until(lambda: _status_is(k8s, name, phase="Running", generation=f"{uid}/0"), 10, "generation 0")
    return uid, pods


async def _status_is(k8s: K8s, name: str, **wanted: Any) -> dict[str, Any] | None:
    status = await status_of(k8s, name)
    return status if all(status.get(k) == v for k, v in wanted.items()) else None


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    [found] = [c for c in status.get("conditions") or [] if c["type"] == kind]
    return found


async def reasons(k8s: K8s, name: str, kind: str = "StrataJob") -> list[str]:
    return [e["reason"] for e in await events_about(k8s, name) if e["involvedObject"]["kind"] == kind]


# ---- the end of a JobSet reaches the StrataJob ----------------------------------------------------------


@pytest.mark.asyncio
async def test_a_completed_jobset_makes_its_stratajob_succeed(k8s: K8s, jobsets: JobSetController) -> None:
    async with operator(k8s):
        _, pods = await start(k8s, jobsets, jobset("done", 2), 2)
        for pod in pods:
            await jobsets.cluster.succeed(pod)
        status = await until(lambda: _status_is(k8s, "done", phase="Succeeded"), 10, "Succeeded")
        succeeded = condition(status, "Succeeded")
        assert succeeded["status"] == "True" and succeeded["reason"] == "JobSetCompleted"
        assert "AllJobsCompleted" in succeeded["message"]
        assert "JobSetCompleted" in await reasons(k8s, "done")
        assert status["restarts"] == 0 and status["restartLimit"] == 1  # the JobSet's maxRestarts
        await assert_valid(k8s, "done")


@pytest.mark.asyncio
async def test_a_jobset_out_of_restarts_makes_its_stratajob_fail(k8s: K8s, jobsets: JobSetController) -> None:
    async with operator(k8s):
        uid, pods = await start(k8s, jobsets, jobset("spent", 2, max_restarts=1), 2)
        await jobsets.cluster.fail(pods[1], 137, reason="OOMKilled")
        # JobSet restarts the gang once (its maxRestarts): the StrataJob reflects the attempt.
        status = await until(lambda: _status_is(k8s, "spent", generation=f"{uid}/1", phase="Running"), 10)
        assert status["restarts"] == 1 and status["lastFailure"]["reason"] == "OOMKilled"
        assert condition(status, "Restarting")["reason"] == "JobSetRecreated"
        pods = await until(lambda: gang(jobsets, "spent", 1, 2), 10, "attempt 1 running")
        await jobsets.cluster.fail(pods[0], 1)
        status = await until(lambda: _status_is(k8s, "spent", phase="Failed"), 10, "Failed")
        failed = condition(status, "Failed")
        assert failed["status"] == "True" and failed["reason"] == "JobSetFailed"
        assert "ReachedMaxRestarts" in failed["message"]
        assert status["lastFailure"]["pod"] == pods[0]["metadata"]["name"]
        assert status["lastFailure"]["reason"] == "ExitError"
        assert "JobSetFailed" in await reasons(k8s, "spent")
        assert k8s.api.evictions == []  # JobSet's own restarts: the operator stops nothing
        await assert_valid(k8s, "spent")


# ---- a lost node under BlockingRecreate ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_lost_nodes_pod_is_fenced_and_the_jobset_restart_proceeds(
    k8s: K8s, jobsets: JobSetController
) -> None:
    """The taint manager deletes the pods of a lost node; they hang in Terminating, so JobSet's
    BlockingRecreate restart would wait for them forever. The operator fences the old attempt's
    pod (DisruptionTarget, force delete) once its grace period plus the margin is over."""
    async with operator(k8s, fence_margin_s=1.0):
        uid, pods = await start(k8s, jobsets, jobset("lost", 2, grace_s=1), 2)
        stuck = pods[0]["metadata"]["name"]
        await jobsets.cluster.lose_node(pods[0]["spec"]["nodeName"])
        # the other pod's kubelet ends it; the lost node's pod stays until the fence removes it
        await until(lambda: gang(jobsets, "lost", 1, 2), 15, "attempt 1 running")
        status = await until(lambda: _status_is(k8s, "lost", generation=f"{uid}/1", phase="Running"), 10)
        assert status["restarts"] == 1 and condition(status, "Restarting")["reason"] == "JobSetRecreated"
        assert status["lastFailure"]["reason"] == "NodeLost" and status["lastFailure"]["pod"] == stuck
        # while JobSet waited for the old gang, the StrataJob said Restarting
        written = [e["object"] for _, r, e in k8s.api._log if r.plural == "stratajobs"]
        assert "JobSetRestarting" in [
            c["reason"] for j in written for c in j.get("status", {}).get("conditions") or []
        ]
        assert "PodFenced" in await reasons(k8s, "lost")
        fenced = [
            event["object"]
            for _, resource, event in k8s.api._log
            if resource.plural == "pods" and event["object"]["metadata"]["name"] == stuck
        ]
        marks = [
            c.get("reason")
            for pod in fenced
            for c in pod.get("status", {}).get("conditions") or []
            if c["type"] == "DisruptionTarget"
        ]
        assert "DeletionByStrataFence" in marks
        # no pod of the new attempt existed before the old one was gone (BlockingRecreate)
        gone = max(
            rv
            for rv, r, e in k8s.api._log
            if r.plural == "pods" and e["type"] == "DELETED" and e["object"]["metadata"]["name"] == stuck
        )
        first_new = min(
            rv
            for rv, r, e in k8s.api._log
            if r.plural == "pods"
            and e["type"] == "ADDED"
            and e["object"]["metadata"]["labels"].get(names.JOBSET_RESTART_LABEL) == "1"
        )
        assert gone < first_new
        assert k8s.api.evictions == []


@pytest.mark.asyncio
async def test_a_pod_of_the_current_attempt_is_never_fenced(k8s: K8s) -> None:
    """A pod of the attempt that runs, stuck in Terminating, is left to JobSet: fencing it would let
    a replacement of the same generation run beside it."""
    await install_crds(k8s)
    async with operator(k8s, fence_margin_s=0.5):
        created = await create(k8s, JOBSETS, jobset("kept", 1))
        pod = copy.deepcopy(created["spec"]["replicatedJobs"][0]["template"]["spec"]["template"])
        pod["metadata"].update(
            name="kept-workers-0-0-x",
            labels={
                **pod["metadata"]["labels"],
                names.JOBSET_NAME_LABEL: "kept",
                names.JOBSET_UID_LABEL: created["metadata"]["uid"],
                names.JOBSET_RESTART_LABEL: "0",
                names.JOB_INDEX_LABEL: "0",
            },
        )
        pod["spec"]["nodeName"] = "node-0"
        await create(k8s, "/api/v1/namespaces/default/pods", {"apiVersion": "v1", "kind": "Pod", **pod})
        await until(lambda: _status_is(k8s, "kept", phase="Running"), 10, "Running")
        status, body = await call(k8s, "DELETE", "/api/v1/namespaces/default/pods/kept-workers-0-0-x")
        assert status == 200, body
        await asyncio.sleep(2.5)  # past its grace period (1 s) and the margin
        status, body = await call(k8s, "GET", "/api/v1/namespaces/default/pods/kept-workers-0-0-x")
        assert status == 200 and body["metadata"].get("deletionTimestamp"), body
        assert "PodFenced" not in await reasons(k8s, "kept")


# ---- Kubeflow Trainer v2 -------------------------------------------------------------------------------

#: kubeflow/trainer manifests/base/runtimes/torch_distributed.yaml (the default torch runtime).
TORCH_DISTRIBUTED = {
    "apiVersion": "trainer.kubeflow.org/v1alpha1",
    "kind": "ClusterTrainingRuntime",
    "metadata": {"name": "torch-distributed", "labels": {"trainer.kubeflow.org/framework": "torch"}},
    "spec": {
        "mlPolicy": {"numNodes": 1, "torch": {}},
        "template": {
            "spec": {
                "replicatedJobs": [
                    {
                        "name": "node",
                        "template": {
                            "metadata": {
                                "labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
                            },
                            "spec": {
                                "template": {
                                    "spec": {
                                        "containers": [
                                            {
                                                "name": "node",
                                                "image": "pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime",
                                            }
                                        ]
                                    }
                                }
                            },
                        },
                    }
                ]
            }
        },
    },
}


#: The TrainJob's uid (it is not an object of the emulated API; its JobSet names it as its owner).
TRAINJOB_UID = "6c1f0e52-1d3c-4a43-9a55-0c0ffee00001"


def trainjob(name: str, runtime: str, nodes: int, *, opt_in_patch: bool = False) -> dict[str, Any]:
    """A TrainJob; ``opt_in_patch``: it opts its pods in itself, through runtimePatches."""
    body: dict[str, Any] = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"runtimeRef": {"name": runtime}, "trainer": {"numNodes": nodes, "command": ["torchrun"]}},
    }
    if opt_in_patch:
        labels = {names.OPT_IN_LABEL: names.OPT_IN_VALUE}
        pod = {"template": {"metadata": {"labels": labels}}}
        body["spec"]["runtimePatches"] = [
            {
                "manager": "example.com/user",
                "trainingRuntimeSpec": {
                    "template": {"spec": {"replicatedJobs": [{"name": "node", "template": {"spec": pod}}]}}
                },
            }
        ]
    return body


def trainer_jobset(job: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    """The JobSet the Kubeflow Trainer controller builds for ``job`` (pkg/runtime/framework/plugins
    /jobset: the runtime's JobSet template, numNodes as the trainer Job's parallelism and completions,
    the runtimePatches' pod labels, the TrainJob as its controller), as JobSet's defaulting webhook
    leaves it (completionMode Indexed, restartPolicy OnFailure where unset)."""
    spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    patches = {
        r["name"]: r["template"]["spec"]["template"]["metadata"]["labels"]
        for patch in job["spec"].get("runtimePatches") or []
        for r in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    }
    for rjob in spec["replicatedJobs"]:
        job_spec = rjob["template"]["spec"]
        if (
            rjob["template"]["metadata"]["labels"].get("trainer.kubeflow.org/trainjob-ancestor-step")
            == "trainer"
        ):
            rjob["replicas"] = 1
            job_spec["parallelism"] = job_spec["completions"] = job["spec"]["trainer"]["numNodes"]
        job_spec.setdefault("completionMode", "Indexed")
        pod = job_spec["template"]
        pod.setdefault("metadata", {}).setdefault("labels", {}).update(patches.get(rjob["name"], {}))
        pod["spec"].setdefault("restartPolicy", "OnFailure")
    meta = job["metadata"]
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": meta["name"],
            "namespace": meta.get("namespace", "default"),
            "ownerReferences": [
                {
                    "apiVersion": "trainer.kubeflow.org/v1alpha1",
                    "kind": "TrainJob",
                    "name": meta["name"],
                    "uid": meta.get("uid", TRAINJOB_UID),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": spec,
    }


def review(obj: dict[str, Any]) -> dict[str, Any]:
    """The validating webhook's answer to creating ``obj``."""
    request = {"uid": "u-1", "operation": "CREATE", "object": obj}
    response: dict[str, Any] = webhook.validate(request)["response"]
    return response


def docs_snippet() -> tuple[dict[str, Any], dict[str, Any]]:
    """The runtime and the TrainJob docs/kubernetes/operator.md gives to copy."""
    for block in re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), flags=re.S):
        docs = [d for d in yaml.safe_load_all(block) if d]
        kinds = {d["kind"]: d for d in docs}
        if {"ClusterTrainingRuntime", "TrainJob"} <= set(kinds):
            return kinds["ClusterTrainingRuntime"], kinds["TrainJob"]
    raise AssertionError("docs/kubernetes/operator.md has no runtime and TrainJob to copy")


def test_a_trainjob_on_the_default_runtime_is_refused_naming_the_trainjob_and_the_runtime_field() -> None:
    """The default runtimes set no failurePolicy: their JobSets never restart a gang. The denial
    reaches the user only as the trainer's Event on the TrainJob (cut at 950 characters): it names
    the TrainJob and the runtime's field first."""
    job = trainjob("llm", "torch-distributed", 2, opt_in_patch=True)
    response = review(trainer_jobset(job, TORCH_DISTRIBUTED))
    assert response["allowed"] is False
    message = response["status"]["message"]
    head = message[:950]
    assert head.startswith("Strata: TrainJob llm: set spec.template.spec.failurePolicy: "), message
    assert "restartStrategy: BlockingRecreate" in head and "spec.runtimeRef" in head
    assert "runtimePatches cannot set it" in head and "never restarts" in head
    # the child Jobs would retry pods alone (JobSet's OnFailure default, backoffLimit 6): warned
    warnings = response.get("warnings") or []
    assert any("restartPolicy is OnFailure" in w for w in warnings), warnings
    assert any("backoffLimit is 6 (the default)" in w for w in warnings), warnings


def test_an_opted_in_runtime_without_blocking_recreate_is_refused_and_the_docs_runtime_passes() -> None:
    runtime = copy.deepcopy(TORCH_DISTRIBUTED)
    template = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    template["metadata"] = {"labels": {names.OPT_IN_LABEL: names.OPT_IN_VALUE}}
    response = review(runtime)
    assert response["allowed"] is False
    assert "spec.template.spec.failurePolicy is unset" in response["status"]["message"]
    runtime["spec"]["template"]["spec"]["failurePolicy"] = {"restartStrategy": "Recreate", "maxRestarts": 3}
    response = review(runtime)
    assert response["allowed"] is False
    assert "spec.template.spec.failurePolicy.restartStrategy is Recreate" in response["status"]["message"]
    for kind in ("ClusterTrainingRuntime", "TrainingRuntime"):
        documented, job = docs_snippet()
        documented["kind"] = kind
        response = review(documented)
        assert response["allowed"] is True and not response.get("warnings"), response
    # and the JobSet the trainer builds from it, for the documented TrainJob
    response = review(trainer_jobset(job, documented))
    assert response["allowed"] is True and not response.get("warnings"), response


@pytest.mark.asyncio
async def test_a_trainjob_on_the_documented_runtime_restarts_and_succeeds(
    k8s: K8s, jobsets: JobSetController
) -> None:
    runtime, job = docs_snippet()
    body = trainer_jobset(job, runtime)
    world = job["spec"]["trainer"]["numNodes"]
    async with operator(k8s):
        uid, pods = await start(k8s, jobsets, body, world)
        await jobsets.cluster.fail(pods[1], 1)
        pods = await until(lambda: gang(jobsets, "llm", 1, world), 10, "attempt 1 running")
        status = await until(lambda: _status_is(k8s, "llm", generation=f"{uid}/1", phase="Running"), 10)
        assert status["restarts"] == 1 and status["restartLimit"] == 3
        for pod in pods:
            await jobsets.cluster.succeed(pod)
        status = await until(lambda: _status_is(k8s, "llm", phase="Succeeded"), 10, "Succeeded")
        assert condition(status, "Succeeded")["reason"] == "JobSetCompleted"
        assert {"JobSetRestarted", "JobSetCompleted"} <= set(await reasons(k8s, "llm"))
        await assert_valid(k8s, "llm")
