"""The admission code's edges: what a real cluster, a careless user or a hostile tenant does to the
sidecar's stand-in (the workload webhook), the per-job ports, the QoS rule and the annotations'
quantities. Each test states what should hold and why."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import pytest_asyncio
from aiohttp import web

from sidecar.operator import inject as injection
from sidecar.operator import reports, webhook
from sidecar.operator.annotations import quantity
from sidecar.operator.names import JOB_INDEX_LABEL, JOBSET_NAME_LABEL, OPT_IN_LABEL
from tests.k8s.test_inject_fit import (
    effective_requests,
    env_of,
    mutate_workload,
    pod_from,
    qos_class,
    sidecar_of,
    valid_everywhere,
)
from tests.k8s.test_webhook import CONFIG, Webhook, job_pod, jobset_pod, tls_files
from tests.k8s.test_webhook import job as plain_job


def job(**spec: Any) -> dict[str, Any]:
    """Job recsys, queued in Kueue: the workload webhook puts its stand-in only there."""
    workload = plain_job(**spec)
    workload["metadata"].setdefault("labels", {})["kueue.x-k8s.io/queue-name"] = "team"
    return workload


pytestmark = [pytest.mark.timeout(60)]


@pytest_asyncio.fixture
async def hook(tmp_path: Path) -> AsyncIterator[Webhook]:
    cert, key, client = tls_files(tmp_path)
    app = web.Application()
    webhook.add_routes(app, CONFIG)
    server = await reports.start_server(app, "127.0.0.1", 0, reports.server_ssl_context(str(cert), str(key)))
    try:
        yield Webhook(f"https://localhost:{server.port}", client)
    finally:
        await server.close()


async def admitted_job(hook: Webhook, workload: dict[str, Any]) -> dict[str, Any]:
    """``workload`` as the API server stores it after the workload webhook."""
    response, patch = await mutate_workload(hook, workload)
    assert response["allowed"] is True
    return dict(jsonpatch.apply_patch(workload, patch))


async def injected(hook: Webhook, pod: dict[str, Any]) -> dict[str, Any]:
    response, patch = await hook.mutate(pod)
    assert response["allowed"] is True, response
    return dict(jsonpatch.apply_patch(pod, patch))


# ---- the stand-in left in a pod ---------------------------------------------------------------------------


def test_a_stand_in_left_in_a_pod_does_not_crash_loop(tmp_path: Path) -> None:
    """The stand-in runs as written wherever the pod webhook does not complete it: the chart
    uninstalled (its webhooks go, the Jobs' templates keep the stand-in, and every pod created later
    - a retry, Kueue's re-admission after a preemption - gets it raw), webhook.injectFailurePolicy
    Ignore with the operator down, or the opt-in label removed from a suspended Job's template. It
    is a native sidecar (restartPolicy Always) running ``strata sidecar`` with no settings at all:
    it must stay up doing nothing (and say why), not exit, or the kubelet restarts it forever
    (CrashLoopBackOff), the pod is never Ready and Kueue's waitForPodsReady evicts the workload."""
    template = jsonpatch.apply_patch(job(), injection.template_patch(job(), namespace="ml", config=CONFIG))[
        "spec"
    ]["template"]
    [stand_in] = template["spec"]["initContainers"]
    assert stand_in["restartPolicy"] == "Always" and stand_in["command"][0] == "strata"
    # a native sidecar without a startup probe counts as started once running: the trainer starts
    assert "startupProbe" not in stand_in and "readinessProbe" not in stand_in
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_"))}
    env.update(env_of(stand_in))
    env["TMPDIR"] = str(tmp_path)
    command = [str(Path(sys.executable).with_name("strata")), *stand_in["command"][1:]]
    log = tmp_path / "stand-in.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        assert process.poll() is None, (
            f"the stand-in exited {process.returncode}: a native sidecar that exits is restarted "
            f"forever\n{log.read_text()}"
        )
        assert "without checkpointing" in log.read_text()
        process.terminate()
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=10)


@pytest.mark.asyncio
async def test_removing_the_opt_in_from_a_suspended_job_with_a_stand_in_is_refused(hook: Webhook) -> None:
    """The Job API lets a suspended Job (every Kueue-queued Job) change its template's labels and
    annotations. Removing the opt-in label leaves the stand-in in the template while the pods are no
    longer sent to the pod webhook (its objectSelector): the stand-in runs raw. The chart's
    validating webhook matches only objects opted in (matchConditions on the new object), so the
    UPDATE is not even sent; and validate() itself allows it."""
    stored = await admitted_job(hook, job(suspend=True))
    assert injection.SIDECAR_CONTAINER in [
        c["name"] for c in stored["spec"]["template"]["spec"]["initContainers"]
    ]
    updated = copy.deepcopy(stored)
    del updated["spec"]["template"]["metadata"]["labels"][OPT_IN_LABEL]
    # the pods of the updated template: not opted in, so the injection leaves the stand-in as it is
    pod = pod_from(updated["spec"]["template"])
    del pod["metadata"]["labels"][OPT_IN_LABEL]
    assert injection.inject(pod, namespace="ml", config=CONFIG) == []
    assert injection.PLACEHOLDER_ENV in env_of(sidecar_of(pod))
    response = await hook.review(webhook.VALIDATE_PATH, updated, operation="UPDATE", old=stored)
    assert response["allowed"] is False, (
        "a template left with the sidecar's stand-in but no opt-in: its pods run the stand-in raw"
    )


# ---- the stand-in's resources drift from what the template says -----------------------------------------


@pytest.mark.asyncio
async def test_a_suspended_jobs_new_sidecar_memory_reaches_its_pods(hook: Webhook) -> None:
    """A Kueue-queued Job is suspended, and a suspended Job's template annotations may be changed:
    the user raises strata.dev/sidecar-memory after an OOM kill. The pods' sidecar keeps the
    stand-in's resources (the webhook trusts them), so the annotation is silently ignored."""
    stored = await admitted_job(hook, job(suspend=True))
    updated = copy.deepcopy(stored)
    updated["spec"]["template"]["metadata"]["annotations"] = {"strata.dev/sidecar-memory": "8Gi"}
    response = await hook.review(webhook.VALIDATE_PATH, updated, operation="UPDATE", old=stored)
    pod = await injected(hook, pod_from(updated["spec"]["template"]))
    limits = sidecar_of(pod)["resources"].get("limits") or {}
    assert response["allowed"] is False or limits.get("memory") == "8Gi", (
        f"strata.dev/sidecar-memory=8Gi accepted, but the sidecar runs with {sidecar_of(pod)['resources']}"
    )


@pytest.mark.parametrize("edit", ["raise-sidecar-memory", "trainer-made-guaranteed", "cronjob-template"])
@pytest.mark.asyncio
async def test_an_exported_job_resubmitted_gets_the_sidecar_it_now_asks_for(hook: Webhook, edit: str) -> None:
    """``kubectl get job -o yaml`` carries the stand-in; the user edits the file (raises the
    sidecar's memory, or makes the trainer Guaranteed for CPU pinning) and creates it again, or
    uses it as a CronJob's jobTemplate (mutable: every later Job is created from it). The workload
    webhook skips a template that has a strata-sidecar, and the pod webhook keeps the stale
    stand-in's resources: the annotation is ignored, or the Guaranteed pod becomes Burstable."""
    exported = await admitted_job(hook, job())
    resubmitted = copy.deepcopy(exported)
    template = resubmitted["spec"]["template"]
    if edit == "trainer-made-guaranteed":
        exact = {"cpu": "8", "memory": "64Gi"}
        template["spec"]["containers"][0]["resources"] = {"requests": dict(exact), "limits": dict(exact)}
    else:
        template["metadata"]["annotations"] = {"strata.dev/sidecar-memory": "8Gi"}
    if edit == "cronjob-template":
        resubmitted["metadata"] = {
            "name": "recsys-nightly-29170000",
            "namespace": "ml",
            "labels": resubmitted["metadata"].get("labels") or {},  # the jobTemplate's: its queue
        }
    again = await admitted_job(hook, resubmitted)
    pod = await injected(hook, pod_from(again["spec"]["template"]))
    valid_everywhere(pod)
    if edit == "trainer-made-guaranteed":
        assert qos_class(pod) == "Guaranteed", sidecar_of(pod)["resources"]
    else:
        assert (sidecar_of(pod)["resources"].get("limits") or {}).get("memory") == "8Gi", sidecar_of(pod)[
            "resources"
        ]
    # and what quota counts is still what the pods ask for
    assert effective_requests(again["spec"]["template"]["spec"]) == effective_requests(pod["spec"])


# ---- who is a JobSet's Job -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_label_alone_does_not_make_a_job_a_jobsets(hook: Webhook) -> None:
    """A Job counts as a JobSet's own by its jobset-name label alone: a tenant who puts that label on
    a Kueue-queued Job of theirs gets no stand-in (Kueue, which manages the Job as a standalone one,
    admits it without the sidecar's requests), no quota warning and no validation; with
    strata.dev/sidecar-cpu the pods ask for whatever they like beyond the queue's quota. (An owner
    reference to a JobSet cannot be forged as cheaply: the garbage collector deletes a Job whose
    owner does not exist.)"""
    workload = job()
    workload["metadata"]["labels"] = {JOBSET_NAME_LABEL: "not-a-jobset", "kueue.x-k8s.io/queue-name": "team"}
    workload["spec"]["template"]["metadata"]["annotations"] = {"strata.dev/sidecar-cpu": "48"}
    stored = await admitted_job(hook, workload)
    pod = await injected(hook, pod_from(stored["spec"]["template"]))
    counted, asked = effective_requests(stored["spec"]["template"]["spec"]), effective_requests(pod["spec"])
    assert counted == asked, f"Kueue counts {counted}, the pods ask for {asked}"


# ---- hostNetwork -----------------------------------------------------------------------------------------


def test_hostnetwork_pods_of_one_job_do_not_share_the_nodes_ports() -> None:
    """On a hostNetwork pod (RDMA/EFA) the sidecar binds its metrics and peer ports on the node. With
    no hostPort declared, nothing keeps two pods of the same Job (same annotations, same ports) off
    one node (eight 1-GPU ranks on an 8-GPU node): the second sidecar cannot bind, crash-loops, and
    its startup probe (httpGet on the node's IP) passes against the first pod's sidecar, so its
    trainer starts against a sidecar that is not there."""
    pods = []
    for index in ("0", "1"):
        pod = job_pod({"strata.dev/redundancy": "buddy"})
        pod["metadata"]["labels"][JOB_INDEX_LABEL] = index
        pod["metadata"]["annotations"][JOB_INDEX_LABEL] = index
        pod["spec"]["hostNetwork"] = True
        pod["spec"]["subdomain"] = "recsys-peers"
        out = jsonpatch.apply_patch(
            pod, injection.inject(pod, namespace="ml", config=CONFIG, shape=injection.Shape(world_size=8))
        )
        valid_everywhere(out)
        pods.append(sidecar_of(out))

    def node_ports(sidecar: dict[str, Any]) -> set[int]:
        env = env_of(sidecar)
        return {int(env["STRATA_METRICS_PORT"]), int(env["STRATA_PEER_PORT"])}

    declared = [any(p.get("hostPort") for p in s.get("ports") or []) for s in pods]
    assert all(declared) or not node_ports(pods[0]) & node_ports(pods[1]), (
        f"both bind {sorted(node_ports(pods[0]) & node_ports(pods[1]))} on the node and neither declares "
        "a hostPort: the scheduler may put them on one node"
    )


# ---- pod-level resources ---------------------------------------------------------------------------------


def container_requests_within_pod_requests(spec: dict[str, Any]) -> list[str]:
    """The API server's check with pod-level resources (PodLevelResources, beta from 1.34): the
    containers' requests (regular ones plus native sidecars) may not exceed the pod's."""
    pod_requests = (spec.get("resources") or {}).get("requests") or {}
    containers = [
        *(c for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"),
        *spec["containers"],
    ]
    out = []
    for name, value in pod_requests.items():
        total = sum(
            quantity(((c.get("resources") or {}).get("requests") or {}).get(name, "0")) for c in containers
        )
        if total > quantity(value):
            out.append(f"{name}: containers request {total:g}, the pod {value}")
    return out


@pytest.mark.asyncio
async def test_pod_level_requests_still_cover_every_container(hook: Webhook) -> None:
    """A pod with pod-level resources whose requests are its trainer's: the sidecar's requests on
    top exceed them, and the API server refuses the pod (the Job controller loops on FailedCreate).
    Where pod-level resources are set the sidecar should share them (no requests of its own) or the
    pod's be raised by the sidecar's (in the template's stand-in too, for quota)."""
    pod = job_pod()
    exact = {"cpu": "8", "memory": "64Gi"}
    pod["spec"]["resources"] = {"requests": dict(exact), "limits": dict(exact)}
    pod["spec"]["containers"][0]["resources"] = {"requests": dict(exact)}
    assert container_requests_within_pod_requests(pod["spec"]) == []
    out = await injected(hook, pod)
    assert container_requests_within_pod_requests(out["spec"]) == []


# ---- quantities Kubernetes refuses -----------------------------------------------------------------------

#: apimachinery's resource.ParseQuantity grammar (number, then one known suffix or an exponent).
K8S_QUANTITY = re.compile(
    r"[+-]?(\d+\.?\d*|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?", re.ASCII
)


@pytest.mark.parametrize(
    ("annotation", "value"),
    [
        ("strata.dev/sidecar-memory", "4Gi\n"),  # a YAML block scalar (|) keeps the newline
        ("strata.dev/sidecar-memory", " 4Gi"),
        ("strata.dev/sidecar-memory", "inf"),
        ("strata.dev/sidecar-cpu", "1_000m"),
        ("strata.dev/sidecar-cpu", "inf"),
        ("strata.dev/sidecar-cpu", "\uff12"),  # a full-width 2
        ("strata.dev/shm-size", "8Gi "),
    ],
)
@pytest.mark.asyncio
async def test_quantities_kubernetes_refuses_are_denied_naming_the_annotation(
    hook: Webhook, annotation: str, value: str
) -> None:
    """quantity() uses float() after strip(), which takes what Kubernetes' quantity grammar does not
    (spaces, newlines, underscores, inf, non-ASCII digits); the value is copied verbatim into the
    sidecar's resources (or the shm volume's sizeLimit): the webhooks accept it, the API server then
    refuses the Job (the stand-in's resources, a container the user never wrote) or, where the
    stand-in is absent, every pod (FailedCreate, forever)."""
    assert not K8S_QUANTITY.fullmatch(value)
    workload = job()
    workload["spec"]["template"]["metadata"]["annotations"] = {annotation: value}
    response = await hook.review(webhook.VALIDATE_PATH, workload)
    assert response["allowed"] is False and annotation in response["status"]["message"], response
    response, patch = await hook.mutate(job_pod({annotation: value}))
    assert response["allowed"] is False, [op for op in patch if "initContainers" in op["path"]]


# ---- a complete sidecar copied from another pod ----------------------------------------------------------


@pytest.mark.asyncio
async def test_a_pod_spec_copied_into_a_new_job_reports_as_that_job(hook: Webhook) -> None:
    """A user copies a running pod's spec (``kubectl get pod -o yaml``) into a new Job, recsys-debug.
    Its complete strata-sidecar (no stand-in marker) is kept as it is, name-idempotent: the sidecar
    saves and reports as the old job recsys (STRATA_JOB), into recsys's checkpoint prefix, with
    the old job's world size and the CA of the day it was copied."""
    old = await injected(hook, job_pod())
    workload = job()
    workload["metadata"]["name"] = "recsys-debug"
    workload["spec"]["template"]["spec"] = copy.deepcopy(old["spec"])
    del workload["spec"]["template"]["spec"]["schedulingGates"]
    stored = await admitted_job(hook, workload)
    pod = pod_from(stored["spec"]["template"])
    pod["metadata"]["labels"]["batch.kubernetes.io/job-name"] = "recsys-debug"
    pod["metadata"]["ownerReferences"][0]["name"] = "recsys-debug"
    response, patch = await hook.mutate(pod)
    assert any("copied from another pod (STRATA_JOB=recsys)" in w for w in response["warnings"])
    pod = dict(jsonpatch.apply_patch(pod, patch))
    assert env_of(sidecar_of(pod))["STRATA_JOB"] == "recsys-debug"
    # the trainer saves under the job its STRATA_JOB names: the copied value goes too
    assert env_of(pod["spec"]["containers"][0])["STRATA_JOB"] == "recsys-debug"
    assert (await hook.mutate(pod))[1] == []  # and fed back, nothing more to do


# ---- names -----------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_regular_container_named_strata_sidecar_is_refused_not_duplicated(hook: Webhook) -> None:
    """Only initContainers are searched for strata-sidecar: a regular container of that name gets a
    second one beside it, and container names must be unique across the pod; the API server refuses
    the Job (or each pod) with a "Duplicate value" on a container the user never wrote."""
    workload = job()
    workload["spec"]["template"]["spec"]["containers"].append(
        {"name": injection.SIDECAR_CONTAINER, "image": "busybox", "command": ["sleep", "inf"]}
    )
    response = await hook.review(webhook.VALIDATE_PATH, workload)
    if response["allowed"] is False:
        return
    for spec in (
        (await admitted_job(hook, workload))["spec"]["template"]["spec"],
        (await injected(hook, pod_from(workload["spec"]["template"])))["spec"],
    ):
        names = [c["name"] for c in [*(spec.get("initContainers") or []), *spec["containers"]]]
        assert len(names) == len(set(names)), names


# ---- a JobSet pod whose workload is unknown at admission ------------------------------------------------


@pytest.mark.asyncio
async def test_a_jobset_pod_is_not_admitted_with_its_completion_index_as_its_rank(tmp_path: Path) -> None:
    """The controller's shape_of answers Shape() when its watch cache lacks the JobSet and the one GET
    fails or takes over 2 s (an apiserver busy with a large JobSet's pods being created at once). The
    pod is then admitted with STRATA_RANK from the completion index, the rank within its own child
    Job, which every replica of a replicated job repeats: ranks collide across the gang, silently
    (no world size either). A pod should rather be refused (the Job controller retries it) than
    admitted with a rank that is not the global one."""

    async def unknown(namespace: str, pod: dict[str, Any]) -> injection.Shape:
        return injection.Shape()  # what controller.shape_of returns on TimeoutError/ApiError/OSError

    cert, key, client = tls_files(tmp_path)
    app = web.Application()
    webhook.add_routes(app, CONFIG, shape_of=unknown)
    server = await reports.start_server(app, "127.0.0.1", 0, reports.server_ssl_context(str(cert), str(key)))
    try:
        hook = Webhook(f"https://localhost:{server.port}", client)
        pod = jobset_pod()
        pod["metadata"]["labels"]["jobset.sigs.k8s.io/job-index"] = "1"  # Job ranker-workers-1, index 1
        response, patch = await hook.mutate(pod)
        if response["allowed"] is False:
            return
        sidecar = sidecar_of(jsonpatch.apply_patch(pod, patch))
        [rank] = [e for e in sidecar["env"] if e["name"] == "STRATA_RANK"]
        assert "value" in rank, f"a JobSet pod admitted with {rank}: the rank within its child Job"
    finally:
        await server.close()


# ---- privileged ports on the node ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_port_the_sidecar_cannot_bind_on_a_hostnetwork_pod_is_refused(hook: Webhook) -> None:
    """The sidecar runs as a non-root user with every capability dropped (no NET_BIND_SERVICE). On a
    hostNetwork pod it binds in the node's network namespace, where ports below
    net.ipv4.ip_unprivileged_port_start (1024 by default) are refused: strata.dev/metrics-port 443
    makes it crash-loop, its startup probe never passes, and the trainer never starts. Accepted today
    with no word."""
    workload = job()
    template = workload["spec"]["template"]
    template["metadata"]["annotations"] = {"strata.dev/metrics-port": "443"}
    template["spec"]["hostNetwork"] = True
    response = await hook.review(webhook.VALIDATE_PATH, workload)
    said = response["allowed"] is False or any("metrics-port" in w for w in response.get("warnings") or [])
    assert said, response
    pod = job_pod({"strata.dev/metrics-port": "443"})
    pod["spec"]["hostNetwork"] = True
    response, _ = await hook.mutate(pod)
    assert response["allowed"] is False or any("metrics-port" in w for w in response.get("warnings") or [])


# ---- a user the platform assigns -------------------------------------------------------------------------


def test_an_unset_sidecar_user_does_not_inherit_the_pods_root_user() -> None:
    """With --sidecar-user none the sidecar's user comes from the pod's securityContext where it sets
    one. A trainer running as root (runAsUser: 0 at pod level, common for ML images, allowed by
    OpenShift's anyuid SCC or any cluster without Pod Security) then gives the sidecar user 0 beside
    its runAsNonRoot: true: the kubelet refuses to start it (CreateContainerConfigError), and as a
    native sidecar it blocks every regular container: the pod never runs. Either the pod is denied
    naming the conflict, or the sidecar runs as a non-root user."""
    config = injection.InjectConfig(**{**CONFIG.__dict__, "run_as_user": None})
    pod = job_pod()
    pod["spec"]["securityContext"] = {"runAsUser": 0}
    try:
        out = jsonpatch.apply_patch(pod, injection.inject(pod, namespace="ml", config=config))
    except injection.Denied:
        return
    context = sidecar_of(out)["securityContext"]
    user = context.get("runAsUser", out["spec"]["securityContext"].get("runAsUser"))
    assert not (context.get("runAsNonRoot") and user == 0), context


# ---- namespaces with a ResourceQuota on limits ----------------------------------------------------------


def quota_refusal(pod: dict[str, Any], hard: dict[str, str]) -> str:
    """The ResourceQuota admission's refusal of ``pod`` in a namespace whose quota tracks ``hard``
    (it runs after every webhook): each container must set what a tracked limits.*/requests.* names."""
    spec = pod["spec"]
    missing: dict[str, list[str]] = {}
    for tracked in hard:
        kind, _, resource = tracked.partition(".")
        for c in [*(spec.get("initContainers") or []), *spec["containers"]]:
            resources = c.get("resources") or {}
            have = {**(resources.get("limits") or {}), **(resources.get(kind) or {})}
            if resource not in have:
                missing.setdefault(tracked, []).append(c["name"])
    return "; ".join(f"must specify {k} for: {','.join(v)}" for k, v in sorted(missing.items()))


@pytest.mark.asyncio
async def test_a_namespace_quota_on_cpu_limits_admits_the_injected_pod(hook: Webhook) -> None:
    """Multi-tenant namespaces commonly carry a ResourceQuota on limits.cpu and limits.memory (and a
    LimitRange defaulting them, which runs before the webhooks and so never sees the sidecar). Every
    container of the user's pod sets both limits; the injected sidecar sets no CPU limit (Burstable
    pod), so the quota admission refuses every pod: "must specify limits.cpu for: strata-sidecar",
    and the Job controller loops on FailedCreate. Where every container of the pod has a CPU limit
    the sidecar should have one too (the namespace evidently demands it), or the pod be denied
    naming strata.dev/sidecar-cpu."""
    hard = {"limits.cpu": "64", "limits.memory": "512Gi", "requests.cpu": "64", "requests.memory": "512Gi"}
    pod = job_pod()
    pod["spec"]["containers"][0]["resources"] = {
        "requests": {"cpu": "4", "memory": "16Gi"},
        "limits": {"cpu": "8", "memory": "32Gi"},
    }
    assert quota_refusal(pod, hard) == ""
    response, patch = await hook.mutate(pod)
    if response["allowed"] is False:
        return
    assert quota_refusal(jsonpatch.apply_patch(pod, patch), hard) == ""


# ---- what the review's fixes promise beyond the cases above ---------------------------------------------


@pytest.mark.parametrize("value", ["0x2500", "0o22400", "9_472", "+9472", "\uff19\uff14\uff17\uff12"])
@pytest.mark.asyncio
async def test_a_port_that_is_not_decimal_is_refused(hook: Webhook, value: str) -> None:
    """int(value, 0) read "0x2500" as port 9472: the probe and the sidecar could read it apart."""
    workload = job()
    workload["spec"]["template"]["metadata"]["annotations"] = {"strata.dev/metrics-port": value}
    response = await hook.review(webhook.VALIDATE_PATH, workload)
    assert response["allowed"] is False and "strata.dev/metrics-port" in response["status"]["message"]
    response, _ = await hook.mutate(job_pod({"strata.dev/metrics-port": value}))
    assert response["allowed"] is False and "decimal" in response["status"]["message"], response


@pytest.mark.asyncio
async def test_changing_the_sidecars_resources_of_a_template_with_the_stand_in_is_refused(
    hook: Webhook,
) -> None:
    """A suspended Job's template annotations may change, its containers not: the stand-in would keep
    what quota counted while the pods got the new value. Other annotation changes pass."""
    stored = await admitted_job(hook, job(suspend=True))
    for key, value in (("strata.dev/sidecar-memory", "8Gi"), ("strata.dev/sidecar-cpu", "2")):
        updated = copy.deepcopy(stored)
        updated["spec"]["template"]["metadata"]["annotations"] = {key: value}
        response = await hook.review(webhook.VALIDATE_PATH, updated, operation="UPDATE", old=stored)
        message = response.get("status", {}).get("message", "")
        assert response["allowed"] is False and key in message and "recreate the Job" in message
    updated = copy.deepcopy(stored)
    updated["spec"]["template"]["metadata"]["annotations"] = {"strata.dev/keep": "5"}
    response = await hook.review(webhook.VALIDATE_PATH, updated, operation="UPDATE", old=stored)
    assert response["allowed"] is True


@pytest.mark.asyncio
async def test_a_stand_in_that_differs_from_the_pods_annotations_is_replaced_with_a_warning(
    hook: Webhook,
) -> None:
    """Where the UPDATE went through anyway (the validating webhook fails open), the pods get what
    their annotations say and the pod webhook says that quota counted otherwise."""
    stored = await admitted_job(hook, job(suspend=True))
    stored["spec"]["template"]["metadata"]["annotations"] = {"strata.dev/sidecar-memory": "8Gi"}
    response, patch = await hook.mutate(pod_from(stored["spec"]["template"]))
    assert any("stand-in in the pod template requests" in w for w in response["warnings"])
    sidecar = sidecar_of(jsonpatch.apply_patch(pod_from(stored["spec"]["template"]), patch))
    assert sidecar["resources"]["requests"]["memory"] == "8Gi"
    # the stand-in as written: no warning
    response, _ = await hook.mutate(pod_from((await admitted_job(hook, job()))["spec"]["template"]))
    assert not any("stand-in" in w for w in response.get("warnings") or [])


@pytest.mark.asyncio
async def test_a_root_pod_user_without_a_sidecar_user_is_refused_at_the_job(tmp_path: Path) -> None:
    """The pods of such a Job would all be denied (the Job controller looping on FailedCreate): the
    validating webhook says it at the Job's creation."""
    cert, key, client = tls_files(tmp_path)
    app = web.Application()
    webhook.add_routes(app, injection.InjectConfig(**{**CONFIG.__dict__, "run_as_user": None}))
    server = await reports.start_server(app, "127.0.0.1", 0, reports.server_ssl_context(str(cert), str(key)))
    try:
        hook = Webhook(f"https://localhost:{server.port}", client)
        workload = job()
        workload["spec"]["template"]["spec"]["securityContext"] = {"runAsUser": 0}
        response = await hook.review(webhook.VALIDATE_PATH, workload)
        assert response["allowed"] is False and "runAsUser is 0" in response["status"]["message"]
        workload["spec"]["template"]["spec"]["securityContext"] = {"runAsUser": 1000}
        assert (await hook.review(webhook.VALIDATE_PATH, workload))["allowed"] is True
    finally:
        await server.close()
