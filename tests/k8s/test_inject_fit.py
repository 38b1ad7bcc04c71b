"""What the injection owes a real cluster beyond a valid pod: the sidecar's ports chosen per job and
checked against the pod's own, the pod's QoS class kept (a Guaranteed pod stays Guaranteed, computed
as the kubelet computes it), the sidecar counted by quota that admits workloads by their pod template
(Kueue), a JobSet's own Jobs left to the JobSet's validation, and a sidecar user that OpenShift's
restricted-v2 SCC may assign. Every injected pod is checked against the 1.29-1.35 schemas and Pod
Security "restricted"."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import pytest_asyncio
from aiohttp import web

from sidecar.operator import inject as injection
from sidecar.operator import reports, webhook
from sidecar.operator.annotations import quantity
from sidecar.operator.names import JOBSET_NAME_LABEL
from tests.k8s.test_webhook import CONFIG, Webhook, job, job_pod, tls_files, trainer

pytestmark = [pytest.mark.timeout(60)]


@pytest_asyncio.fixture
async def hook(tmp_path: Path) -> AsyncIterator[Webhook]:
    """Both webhooks over HTTPS, as the operator serves them (the injection configured)."""
    cert, key, client = tls_files(tmp_path)
    app = web.Application()
    webhook.add_routes(app, CONFIG)
    server = await reports.start_server(app, "127.0.0.1", 0, reports.server_ssl_context(str(cert), str(key)))
    try:
        yield Webhook(f"https://localhost:{server.port}", client)
    finally:
        await server.close()


#: The controller reference JobSet puts on the Jobs it creates.
JOBSET_OWNER = {
    "apiVersion": "jobset.x-k8s.io/v1alpha2",
    "kind": "JobSet",
    "name": "ranker",
    "uid": "u",
    "controller": True,
}

VERSIONS = ("1.29", "1.30", "1.31", "1.32", "1.33", "1.34", "1.35")


def valid_everywhere(obj: dict[str, Any]) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What Pod Security "restricted" refuses in the injected sidecar (the checks that concern a
    container; the pod's own containers are the user's)."""
    spec = pod["spec"]
    [sidecar] = [c for c in spec["initContainers"] if c["name"] == injection.SIDECAR_CONTAINER]
    context = sidecar.get("securityContext") or {}
    pod_context = spec.get("securityContext") or {}
    out = []
    if not (context.get("runAsNonRoot") or pod_context.get("runAsNonRoot")):
        out.append("runAsNonRoot")
    if context.get("runAsUser", pod_context.get("runAsUser")) == 0:
        out.append("runAsUser 0")
    if context.get("allowPrivilegeEscalation") is not False:
        out.append("allowPrivilegeEscalation")
    if (context.get("capabilities") or {}).get("drop") != ["ALL"]:
        out.append("capabilities.drop")
    if (context.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get("type") not in (
        "RuntimeDefault",
        "Localhost",
    ):
        out.append("seccompProfile")
    # a hostNetwork pod is outside Pod Security baseline already, and on it each port is the node's
    if not spec.get("hostNetwork") and any(p.get("hostPort") for p in sidecar.get("ports") or []):
        out.append("hostPort")
    allowed = {"emptyDir", "downwardAPI", "projected", "configMap", "secret", "persistentVolumeClaim"}
    out += [f"volume {v['name']}" for v in spec.get("volumes") or [] if not set(v) - {"name"} <= allowed]
    return out


async def injected(hook: Webhook, pod: dict[str, Any]) -> dict[str, Any]:
    response, patch = await hook.mutate(pod)
    assert response["allowed"] is True, response
    out = jsonpatch.apply_patch(pod, patch)
    valid_everywhere(out)
    assert restricted_violations(out) == []
    return dict(out)


async def mutate_workload(
    hook: Webhook, obj: dict[str, Any], **kwargs: Any
) -> tuple[dict[str, Any], list[Any]]:
    """(the response of the workload webhook, its JSON patch)."""
    response = await hook.review(webhook.MUTATE_WORKLOADS_PATH, obj, **kwargs)
    if "patch" not in response:
        return response, []
    assert response["patchType"] == "JSONPatch"
    return response, json.loads(base64.b64decode(response["patch"]))


def sidecar_of(pod: dict[str, Any]) -> dict[str, Any]:
    [sidecar] = [c for c in pod["spec"]["initContainers"] if c["name"] == injection.SIDECAR_CONTAINER]
    return dict(sidecar)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


# ---- ports per job -------------------------------------------------------------------------------------


def test_a_job_chooses_its_sidecars_ports() -> None:
    for host_network in (False, True):
        pod = job_pod(
            {
                "strata.dev/metrics-port": "9500",
                "strata.dev/peer-port": "9600",
                "strata.dev/redundancy": "buddy",
            }
        )
        pod["spec"]["subdomain"] = "recsys-peers"
        pod["spec"]["hostNetwork"] = host_network
        pod["spec"]["containers"][0]["ports"] = [{"containerPort": 9464}, {"containerPort": 9411}]
        out = jsonpatch.apply_patch(
            pod, injection.inject(pod, namespace="ml", config=CONFIG, shape=injection.Shape(world_size=4))
        )
        valid_everywhere(out)
        assert restricted_violations(out) == []
        sidecar = sidecar_of(out)
        env = env_of(sidecar)
        assert env["STRATA_METRICS_PORT"] == "9500" and env["STRATA_PEER_PORT"] == "9600"
        assert env["STRATA_MEMBERS"] == "recsys-{index}.recsys-peers:9600"
        assert sidecar["startupProbe"]["httpGet"]["port"] == 9500
        # declared, as hostPorts on a hostNetwork pod: two pods of one job never share a node's ports
        # (this test said undeclared before; see test_admission_edges.py, the hostNetwork case)
        assert [p["containerPort"] for p in sidecar["ports"]] == [9500, 9600]
        assert [p.get("hostPort") for p in sidecar["ports"]] == ([9500, 9600] if host_network else [None] * 2)


def job_with(annotations: dict[str, str], ports: list[int]) -> dict[str, Any]:
    workload = job()
    template = workload["spec"]["template"]
    template["metadata"]["annotations"] = annotations
    template["spec"]["subdomain"] = "recsys-peers"
    template["spec"]["containers"][0]["ports"] = [{"containerPort": p} for p in ports]
    return workload


@pytest.mark.parametrize(
    ("annotations", "ports", "named"),
    [
        ({"strata.dev/metrics-port": "0"}, [], "strata.dev/metrics-port='0': expected a port 1-65535"),
        ({"strata.dev/redundancy": "buddy", "strata.dev/peer-port": "70000"}, [], "strata.dev/peer-port="),
        (
            {"strata.dev/redundancy": "buddy", "strata.dev/peer-port": "http"},
            [],
            "strata.dev/peer-port='http'",
        ),
        (
            {
                "strata.dev/redundancy": "buddy",
                "strata.dev/peer-port": "9500",
                "strata.dev/metrics-port": "9500",
            },
            [],
            "strata.dev/metrics-port and strata.dev/peer-port are both 9500",
        ),
        (
            {"strata.dev/metrics-port": "8080"},
            [8080],
            "strata.dev/metrics-port is 8080, a port container trainer declares",
        ),
        ({}, [9464], "strata.dev/metrics-port (default 9464) is 9464, a port container trainer declares"),
        (
            {"strata.dev/redundancy": "parity"},
            [9411],
            "strata.dev/peer-port (default 9411) is 9411, a port container trainer declares",
        ),
        ({"strata.dev/peer-port": "9600"}, [], "strata.dev/peer-port='9600': the peer port is used with"),
    ],
)
@pytest.mark.asyncio
async def test_bad_ports_are_denied_naming_the_annotation(
    hook: Webhook, annotations: dict[str, str], ports: list[int], named: str
) -> None:
    response = await hook.review(webhook.VALIDATE_PATH, job_with(annotations, ports))
    assert response["allowed"] is False and named in response["status"]["message"], response
    # and the pods, should the Job have come in before the webhook
    pod = job_pod(annotations)
    pod["spec"]["subdomain"] = "recsys-peers"
    pod["spec"]["containers"][0]["ports"] = [{"containerPort": p} for p in ports]
    response, patch = await hook.mutate(pod)
    assert response["allowed"] is False and patch == [] and named in response["status"]["message"]


# ---- QoS -------------------------------------------------------------------------------------------------


def qos_class(pod: dict[str, Any]) -> str:
    """The pod's QoS class as the kubelet computes it (pkg/apis/core/helper/qos): every container,
    init containers and native sidecars alike; a missing request is its limit (the API server's
    defaulting); only positive cpu and memory quantities count; pod-level resources, where set, alone."""
    spec = pod["spec"]
    containers = [*(spec.get("initContainers") or []), *spec["containers"]]
    if spec.get("resources"):
        containers = [{"resources": spec["resources"]}]
    requests: dict[str, float] = {}
    limits: dict[str, float] = {}
    guaranteed = True
    for c in containers:
        resources = c.get("resources") or {}
        c_limits = {
            k: quantity(v) for k, v in (resources.get("limits") or {}).items() if k in ("cpu", "memory")
        }
        c_requests = {
            **c_limits,
            **{
                k: quantity(v) for k, v in (resources.get("requests") or {}).items() if k in ("cpu", "memory")
            },
        }
        for name, value in c_requests.items():
            if value > 0:
                requests[name] = requests.get(name, 0) + value
        found = set()
        for name, value in c_limits.items():
            if value > 0:
                found.add(name)
                limits[name] = limits.get(name, 0) + value
        if found != {"cpu", "memory"}:
            guaranteed = False
    if not requests and not limits:
        return "BestEffort"
    if guaranteed and all(limits.get(k) == v for k, v in requests.items()) and len(requests) == len(limits):
        return "Guaranteed"
    return "Burstable"


def guaranteed_pod(annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A GPU trainer with whole CPUs (CPU-manager pinning), a user's native sidecar and an init
    container, all with limits equal to requests."""
    pod = job_pod(annotations)
    exact = {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"}
    pod["spec"]["containers"][0]["resources"] = {"requests": dict(exact), "limits": dict(exact)}
    small = {"cpu": "100m", "memory": "64Mi"}
    pod["spec"]["initContainers"] = [
        {"name": "fetch", "image": "busybox", "resources": {"limits": dict(small)}},  # requests default
        {
            "name": "log-shipper",
            "image": "busybox",
            "restartPolicy": "Always",
            "resources": {"limits": dict(small)},
        },
    ]
    return pod


@pytest.mark.asyncio
async def test_a_guaranteed_pod_stays_guaranteed(hook: Webhook) -> None:
    pod = guaranteed_pod()
    assert qos_class(pod) == "Guaranteed"
    out = await injected(hook, pod)
    assert qos_class(out) == "Guaranteed"
    resources = sidecar_of(out)["resources"]
    # the chart's 2Gi memory cap stays the sidecar's, its request rises to it; its CPU limit is its request
    assert resources == {
        "requests": {"cpu": "250m", "memory": "2Gi"},
        "limits": {"cpu": "250m", "memory": "2Gi"},
    }
    # per job: the annotations are the sidecar's request and limit there
    out = await injected(
        hook, guaranteed_pod({"strata.dev/sidecar-cpu": "1500m", "strata.dev/sidecar-memory": "6Gi"})
    )
    assert qos_class(out) == "Guaranteed"
    assert sidecar_of(out)["resources"]["limits"] == {"cpu": "1500m", "memory": "6Gi"}


@pytest.mark.asyncio
async def test_other_classes_keep_the_sidecars_configured_resources(hook: Webhook) -> None:
    burstable = job_pod()  # the trainer: a memory limit only
    assert qos_class(burstable) == "Burstable"
    out = await injected(hook, burstable)
    assert qos_class(out) == "Burstable" and sidecar_of(out)["resources"] == CONFIG.resources
    # one container short of Guaranteed (the user's sidecar has no CPU limit): nothing to keep
    almost = guaranteed_pod()
    del almost["spec"]["initContainers"][1]["resources"]["limits"]["cpu"]
    assert qos_class(almost) == "Burstable"
    assert sidecar_of(await injected(hook, almost))["resources"] == CONFIG.resources
    # a BestEffort pod becomes Burstable: the sidecar asks for what it needs
    best_effort = job_pod()
    del best_effort["spec"]["containers"][0]["resources"]
    assert qos_class(best_effort) == "BestEffort"
    assert qos_class(await injected(hook, best_effort)) == "Burstable"


def test_a_chart_cpu_limit_wins_and_a_cpu_request_above_it_raises_it() -> None:
    config = injection.InjectConfig(
        **{
            **CONFIG.__dict__,
            "resources": {"requests": {"cpu": "250m"}, "limits": {"cpu": "1", "memory": "1Gi"}},
        }
    )
    pod = guaranteed_pod()
    out = jsonpatch.apply_patch(pod, injection.inject(pod, namespace="ml", config=config))
    assert qos_class(out) == "Guaranteed"
    assert sidecar_of(out)["resources"] == {
        "requests": {"cpu": "1", "memory": "1Gi"},
        "limits": {"cpu": "1", "memory": "1Gi"},
    }
    # not Guaranteed: an annotation's request above the chart's limit raises the limit (else an invalid pod)
    pod = job_pod({"strata.dev/sidecar-cpu": "2"})
    out = jsonpatch.apply_patch(pod, injection.inject(pod, namespace="ml", config=config))
    assert sidecar_of(out)["resources"]["limits"]["cpu"] == "2"
    valid_everywhere(out)


# ---- quota -----------------------------------------------------------------------------------------------


def effective_requests(spec: dict[str, Any]) -> dict[str, float]:
    """What the scheduler (and Kueue) count for a pod spec: the regular containers plus the native
    sidecars, or an init container plus the native sidecars started before it, whichever is more."""

    def requests(c: dict[str, Any]) -> dict[str, float]:
        resources = c.get("resources") or {}
        merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        return {k: quantity(v) for k, v in merged.items() if k in ("cpu", "memory")}

    def add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}

    sidecars: dict[str, float] = {}
    peak: dict[str, float] = {}
    for c in spec.get("initContainers") or []:
        if c.get("restartPolicy") == "Always":
            sidecars = add(sidecars, requests(c))
        else:
            here = add(sidecars, requests(c))
            peak = {k: max(peak.get(k, 0), here.get(k, 0)) for k in {*peak, *here}}
    total = sidecars
    for c in spec["containers"]:
        total = add(total, requests(c))
    return {k: max(total.get(k, 0), peak.get(k, 0)) for k in {*total, *peak}}


def pod_from(template: dict[str, Any]) -> dict[str, Any]:
    """Pod 0 as the Job controller creates it from ``template``."""
    pod = job_pod()
    pod["metadata"]["labels"].update(template["metadata"].get("labels") or {})
    pod["metadata"]["annotations"].update(template["metadata"].get("annotations") or {})
    pod["spec"] = copy.deepcopy(template["spec"])
    return pod


@pytest.mark.asyncio
async def test_quota_sees_the_sidecar_in_the_jobs_template(hook: Webhook) -> None:
    for template_annotations, resources in (
        ({}, {"limits": {"memory": "8Gi"}}),
        ({"strata.dev/sidecar-cpu": "2"}, None),
    ):
        workload = job()
        workload["metadata"].setdefault("labels", {})["kueue.x-k8s.io/queue-name"] = "team"
        workload["spec"]["template"]["metadata"]["annotations"] = template_annotations
        if resources is None:  # a Guaranteed trainer
            exact = {"cpu": "8", "memory": "64Gi"}
            workload["spec"]["template"]["spec"]["containers"][0]["resources"] = {
                "requests": exact,
                "limits": exact,
            }
        response, patch = await mutate_workload(hook, workload)
        assert response["allowed"] is True
        admitted = jsonpatch.apply_patch(workload, patch)
        valid_everywhere(admitted)
        template = admitted["spec"]["template"]
        assert restricted_violations({"spec": template["spec"]}) == []  # Pod Security warns on templates
        pod = await injected(hook, pod_from(template))
        # what Kueue counts from the template is what the pod asks for
        assert effective_requests(template["spec"]) == effective_requests(pod["spec"])
        assert effective_requests(template["spec"]) != effective_requests(
            workload["spec"]["template"]["spec"]
        )
        assert qos_class(pod) == ("Guaranteed" if resources is None else "Burstable")
        sidecar = sidecar_of(pod)
        assert injection.PLACEHOLDER_ENV not in env_of(sidecar) and "STRATA_STORAGE" in env_of(sidecar)
        assert pod["spec"]["initContainers"].index(sidecar) == 0
        # fed back (reinvocation): nothing more to do
        assert (await hook.mutate(pod))[1] == []


@pytest.mark.asyncio
async def test_a_workload_outside_kueue_keeps_its_template_as_written(hook: Webhook) -> None:
    """Only Kueue admits by the template: elsewhere the stand-in would be drift to a GitOps tool,
    and a server-side re-apply would try to remove it from an immutable template."""
    workload = job()
    _, patch = await mutate_workload(hook, workload)
    assert patch == []
    workload["metadata"]["annotations"] = {"kueue.x-k8s.io/queue-name": "team"}  # older Kueue's form
    _, patch = await mutate_workload(hook, workload)
    assert any(op["path"].startswith("/spec/template/spec/initContainers") for op in patch)


@pytest.mark.asyncio
async def test_quota_sees_the_sidecar_in_a_jobsets_templates_not_twice_in_its_jobs(hook: Webhook) -> None:
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "ranker", "namespace": "ml", "labels": {"kueue.x-k8s.io/queue-name": "team"}},
        "spec": {
            "failurePolicy": {"restartStrategy": "BlockingRecreate"},
            "replicatedJobs": [
                {
                    "name": "driver",
                    "template": {"spec": {"template": {"metadata": {}, "spec": {"containers": [trainer()]}}}},
                },
                {"name": "workers", "template": {"spec": job()["spec"]}},
            ],
        },
    }
    _, patch = await mutate_workload(hook, jobset)
    admitted = jsonpatch.apply_patch(jobset, patch)
    [driver, workers] = [
        rj["template"]["spec"]["template"]["spec"] for rj in admitted["spec"]["replicatedJobs"]
    ]
    assert "initContainers" not in driver  # not opted in
    assert [c["name"] for c in workers["initContainers"]] == [injection.SIDECAR_CONTAINER]
    child = job()
    child["metadata"]["labels"] = {JOBSET_NAME_LABEL: "ranker"}
    child["metadata"]["ownerReferences"] = [JOBSET_OWNER]
    child["spec"] = admitted["spec"]["replicatedJobs"][1]["template"]["spec"]
    assert (await mutate_workload(hook, child))[1] == []
    # a Job created again (an UPDATE), or without the injection configured: no change
    assert (await mutate_workload(hook, job(), operation="UPDATE", old=job()))[1] == []
    request = {"uid": "u", "operation": "CREATE", "namespace": "ml", "object": job()}
    assert "patch" not in webhook.mutate_workload(request, None)["response"]


@pytest.mark.asyncio
async def test_a_kueue_workload_created_without_the_stand_in_is_warned_about(hook: Webhook) -> None:
    """The workload webhook fails open (the operator down at creation): the Job is created as
    written, and the validating webhook (which runs after every mutation) says quota undercounts."""
    queued = job()
    queued["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team"}
    response = await hook.review(webhook.VALIDATE_PATH, queued)
    assert response["allowed"] is True
    assert any("Kueue queue team" in w and "strata-sidecar" in w for w in response["warnings"])
    admitted = jsonpatch.apply_patch(queued, (await mutate_workload(hook, queued))[1])
    response = await hook.review(webhook.VALIDATE_PATH, admitted)
    assert not any("Kueue" in w for w in response["warnings"])
    # not queued, or an update of a workload from before the install: nothing to say
    assert not any("Kueue" in w for w in (await hook.review(webhook.VALIDATE_PATH, job()))["warnings"])
    response = await hook.review(webhook.VALIDATE_PATH, queued, operation="UPDATE", old=queued)
    assert not any("Kueue" in w for w in response["warnings"])


# ---- JobSet's own Jobs -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_jobsets_own_jobs_are_left_to_the_jobsets_validation(hook: Webhook) -> None:
    """JobSet creates its Jobs from its replicated jobs' templates (not Indexed by our rules, no
    podFailurePolicy of ours: JobSet has its own failure policy): the Job webhook sees them and must
    neither deny nor warn."""
    # JobSet sets both on its Jobs; the label alone no longer counts (anyone can set it: see
    # test_admission_edges.py, a label alone does not make a Job a JobSet's)
    for meta in ({"labels": {JOBSET_NAME_LABEL: "ranker"}, "ownerReferences": [JOBSET_OWNER]},):
        child = job(completionMode="NonIndexed")
        child["metadata"].update(meta)
        child["spec"]["template"]["metadata"]["annotations"] = {"strata.dev/max-restarts": "2"}
        response = await hook.review(webhook.VALIDATE_PATH, child)
        assert response == {"uid": response["uid"], "allowed": True}
    # the same Job of a user's own is warned about
    response = await hook.review(webhook.VALIDATE_PATH, job(completionMode="NonIndexed"))
    assert response["allowed"] is True and any("Indexed" in w for w in response["warnings"])


# ---- OpenShift: the sidecar's user -----------------------------------------------------------------------


def test_the_sidecars_user_may_be_left_to_the_platform() -> None:
    from sidecar import cli
    from sidecar.operator import cli as operator_cli

    parser = cli.build_parser()
    base = ["operator", "--sidecar-image", "img:1", "--storage-uri", "s3://b/p"]
    config = operator_cli._inject_config(parser.parse_args([*base, "--sidecar-user", "none"]))
    assert config.run_as_user is None
    assert operator_cli._inject_config(parser.parse_args(base)).run_as_user == 65532
    assert (
        operator_cli._inject_config(parser.parse_args([*base, "--sidecar-user", "1000"])).run_as_user == 1000
    )
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--sidecar-user", "0"])
    pod = job_pod()
    out = jsonpatch.apply_patch(
        pod,
        injection.inject(
            pod, namespace="ml", config=injection.InjectConfig(**{**CONFIG.__dict__, "run_as_user": None})
        ),
    )
    context = sidecar_of(out)["securityContext"]
    assert "runAsUser" not in context and context["runAsNonRoot"] is True
    assert sidecar_of(out)["workingDir"] == "/tmp"  # an emptyDir any user may enter
    valid_everywhere(out)
    assert restricted_violations(out) == []
