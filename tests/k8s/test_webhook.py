"""The admission webhooks over real HTTPS (a trustme CA, the operator's own TLS context): AdmissionReview
v1 requests for Job and JobSet pods, the returned JSON patch applied to the pod, the result checked
against the expected pod and the Kubernetes 1.29 and 1.33 Pod schemas; and the injected sidecar's
command line and env run for real against SeaweedFS until its startup probe passes."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import kubernetes_validate
import pytest
import pytest_asyncio
import trustme
from aiohttp import web

from sidecar.operator import inject as injection
from sidecar.operator import reports, webhook
from sidecar.operator.inject import InjectConfig
from sidecar.operator.names import (
    GANG_GATE,
    JOB_INDEX_LABEL,
    JOB_NAME_LABEL,
    JOBSET_NAME_LABEL,
    OPT_IN_LABEL,
    OPT_IN_VALUE,
    REPORT_AUDIENCE,
    REPORT_CA_ANNOTATION,
)
from sidecar.operator.run import OperatorConfig, serve
from tests.images import IMAGE
from tests.k8s.conftest import K8s

pytestmark = [pytest.mark.timeout(60)]

#: What the operator's CA source hands the webhook (the content is opaque to the injection).
REPORT_CA = "-----BEGIN CERTIFICATE-----\nMIIBc2VydmluZw==\n-----END CERTIFICATE-----\n"

CONFIG = InjectConfig(
    image=IMAGE,
    storage_uri="s3://ckpt/jobs",
    storage_endpoint="http://seaweedfs.storage:8333",
    report_url="https://strata-operator.strata-system.svc:8443",
    report_ca=REPORT_CA,
    own_namespace="strata-system",
)


# ---- pods --------------------------------------------------------------------------------------------


def trainer() -> dict[str, Any]:
    return {
        "name": "trainer",
        "image": "trainer:1",
        "command": ["python", "train.py"],
        "env": [{"name": "WORLD_SIZE", "value": "4"}],
        "resources": {"limits": {"memory": "8Gi"}},
    }


def job_pod(
    annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    """Pod 0 of Indexed Job recsys as the Job controller creates it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "recsys-0-",
            "namespace": "ml",
            "labels": {OPT_IN_LABEL: OPT_IN_VALUE, JOB_NAME_LABEL: "recsys", JOB_INDEX_LABEL: "0"}
            if labels is None
            else labels,
            "annotations": {JOB_INDEX_LABEL: "0", **(annotations or {})},
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": "recsys",
                    "uid": "5f0c4a7e-0000-4000-8000-000000000001",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {"restartPolicy": "Never", "containers": [trainer()]},
    }


def jobset_pod() -> dict[str, Any]:
    """Pod 1 of JobSet ranker's replicated job workers (its Job ranker-workers-0)."""
    pod = job_pod()
    pod["metadata"]["generateName"] = "ranker-workers-0-1-"
    pod["metadata"]["labels"] = {
        OPT_IN_LABEL: OPT_IN_VALUE,
        JOB_NAME_LABEL: "ranker-workers-0",
        JOB_INDEX_LABEL: "1",
        JOBSET_NAME_LABEL: "ranker",
        "jobset.sigs.k8s.io/jobset-uid": "9d2e0c1a-0000-4000-8000-00000000000a",
        "jobset.sigs.k8s.io/replicatedjob-name": "workers",
        "jobset.sigs.k8s.io/restart-attempt": "0",
    }
    pod["metadata"]["ownerReferences"][0]["name"] = "ranker-workers-0"
    pod["metadata"]["annotations"] = {JOB_INDEX_LABEL: "1"}
    # JobSet's pods carry an init container of the user's already.
    pod["spec"]["initContainers"] = [{"name": "warmup", "image": "trainer:1", "command": ["true"]}]
    return pod


def common_env(job: str) -> list[dict[str, Any]]:
    env = [
        {"name": "STRATA_JOB", "value": job},
        {"name": "STRATA_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {
            "name": "STRATA_RANK",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{JOB_INDEX_LABEL}']"}},
        },
        {"name": "STRATA_SOCKET", "value": "/var/run/strata/sock/s/sidecar.sock"},
    ]
    if job == "ranker":  # the JobSet's pods: the generation from the labels JobSet sets
        env += [
            {
                "name": "STRATA_JOBSET_UID",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['jobset.sigs.k8s.io/jobset-uid']"}},
            },
            {
                "name": "STRATA_JOBSET_RESTART",
                "valueFrom": {
                    "fieldRef": {"fieldPath": "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"}
                },
            },
            {"name": "STRATA_GENERATION", "value": "$(STRATA_JOBSET_UID)/$(STRATA_JOBSET_RESTART)"},
        ]
    return env


def expected_sidecar(job: str, *, generation_file: bool) -> dict[str, Any]:
    env = [
        *common_env(job),
        {"name": "STRATA_STORAGE", "value": "s3://ckpt/jobs"},
        {"name": "STRATA_S3_ENDPOINT", "value": "http://seaweedfs.storage:8333"},
        {"name": "STRATA_SOCKET_MODE", "value": "0o666"},
        {"name": "STRATA_SHM_DIR", "value": "/var/run/strata/shm"},
        {"name": "STRATA_METRICS_PORT", "value": "9464"},
        {"name": "STRATA_RESTORE_REQUEST_FILE", "value": "/etc/strata/podinfo/restore-request"},
        {"name": "STRATA_REPORT_TOKEN_FILE", "value": "/var/run/secrets/strata.dev/report/token"},
    ]
    if generation_file:
        env.append({"name": "STRATA_GENERATION_FILE", "value": "/etc/strata/podinfo/generation"})
    env += [
        {"name": "STRATA_REPORT_URL", "value": "https://strata-operator.strata-system.svc:8443"},
        {"name": "STRATA_REPORT_CA_FILE", "value": "/etc/strata/podinfo/report-ca"},
    ]
    return {
        "name": "strata-sidecar",
        "image": IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "restartPolicy": "Always",
        "command": ["strata", "sidecar"],
        "env": env,
        "ports": [{"name": "strata-metrics", "containerPort": 9464, "protocol": "TCP"}],
        "startupProbe": {
            "httpGet": {"path": "/metrics", "port": 9464},
            "periodSeconds": 1,
            "timeoutSeconds": 2,
            "failureThreshold": 120,
        },
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "strata-shm", "mountPath": "/var/run/strata/shm"},
            {"name": "strata-socket", "mountPath": "/var/run/strata/sock"},
            {"name": "strata-podinfo", "mountPath": "/etc/strata/podinfo", "readOnly": True},
            {
                "name": "strata-report-token",
                "mountPath": "/var/run/secrets/strata.dev/report",
                "readOnly": True,
            },
            {"name": "strata-tmp", "mountPath": "/tmp"},
        ],
    }


VOLUMES = [
    {"name": "strata-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
    {"name": "strata-socket", "emptyDir": {}},
    {
        "name": "strata-podinfo",
        "downwardAPI": {
            "items": [
                {
                    "path": "generation",
                    "fieldRef": {"fieldPath": "metadata.annotations['strata.dev/generation']"},
                },
                {
                    "path": "restore-request",
                    "fieldRef": {"fieldPath": "metadata.annotations['strata.dev/restore-request']"},
                },
                {
                    "path": "report-ca",
                    "fieldRef": {"fieldPath": "metadata.annotations['strata.dev/report-ca']"},
                },
            ]
        },
    },
    {
        "name": "strata-report-token",
        "projected": {
            "sources": [
                {
                    "serviceAccountToken": {
                        "audience": REPORT_AUDIENCE,
                        "expirationSeconds": 3600,
                        "path": "token",
                    }
                }
            ]
        },
    },
    {"name": "strata-tmp", "emptyDir": {}},
]


def expected_trainer(job: str) -> dict[str, Any]:
    container = trainer()
    container["env"] += common_env(job)
    container["volumeMounts"] = [
        {"name": "strata-shm", "mountPath": "/var/run/strata/shm"},
        {"name": "strata-socket", "mountPath": "/var/run/strata/sock"},
    ]
    return container


# ---- the webhook over HTTPS ---------------------------------------------------------------------------


@dataclass
class Webhook:
    url: str
    ssl: ssl.SSLContext

    async def post(self, path: str, body: Any, *, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
        data = raw if raw is not None else json.dumps(body).encode()
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"}, ssl=self.ssl
            ) as resp,
        ):
            return resp.status, await resp.json(content_type=None)

    async def review(
        self, path: str, obj: Any, *, namespace: str = "ml", operation: str = "CREATE", old: Any = None
    ) -> dict[str, Any]:
        uid = str(uuid.uuid4())
        request = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": namespace,
                "operation": operation,
                "userInfo": {"username": "system:serviceaccount:kube-system:job-controller"},
                "object": obj,
                "dryRun": False,
            },
        }
        if old is not None:
            request["request"]["oldObject"] = old
        status, answer = await self.post(path, request)
        assert status == 200, answer
        assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
        assert answer["response"]["uid"] == uid
        return dict(answer["response"])

    async def mutate(self, pod: dict[str, Any], **kwargs: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(the response, its JSON patch)."""
        response = await self.review(webhook.MUTATE_PATH, pod, **kwargs)
        if "patch" not in response:
            return response, []
        assert response["patchType"] == "JSONPatch"
        return response, json.loads(base64.b64decode(response["patch"]))


def tls_files(tmp_path: Path) -> tuple[Path, Path, ssl.SSLContext]:
    ca = trustme.CA()
    leaf = ca.issue_cert("localhost", "strata-operator.strata-system.svc")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    key.write_bytes(leaf.private_key_pem.bytes())
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return cert, key, client


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


def valid(pod: dict[str, Any]) -> None:
    for version in ("1.29", "1.33"):
        kubernetes_validate.validate(pod, version, strict=True)


@pytest.mark.asyncio
async def test_a_job_pod_gets_the_gate_and_the_sidecar(hook: Webhook) -> None:
    pod = job_pod()
    response, patch = await hook.mutate(pod)
    assert response["allowed"] is True
    patched = jsonpatch.apply_patch(pod, patch)
    expected = copy.deepcopy(pod)
    expected["metadata"]["annotations"][REPORT_CA_ANNOTATION] = REPORT_CA
    expected["spec"]["schedulingGates"] = [{"name": GANG_GATE}]
    expected["spec"]["initContainers"] = [expected_sidecar("recsys", generation_file=True)]
    expected["spec"]["volumes"] = VOLUMES
    expected["spec"]["containers"] = [expected_trainer("recsys")]
    assert patched == expected
    valid(patched)
    # Reinvoked (reinvocationPolicy: IfNeeded), or fed its own output: nothing more to do.
    again, second = await hook.mutate(patched)
    assert again["allowed"] is True and second == [] and "patch" not in again


@pytest.mark.asyncio
async def test_a_jobset_pod_gets_the_sidecar_but_no_gate(hook: Webhook) -> None:
    pod = jobset_pod()
    response, patch = await hook.mutate(pod)
    assert response["allowed"] is True
    patched = jsonpatch.apply_patch(pod, patch)
    expected = copy.deepcopy(pod)
    expected["metadata"]["annotations"][REPORT_CA_ANNOTATION] = REPORT_CA
    # First among the init containers, so the user's own init containers can use it too.
    expected["spec"]["initContainers"].insert(0, expected_sidecar("ranker", generation_file=False))
    expected["spec"]["volumes"] = VOLUMES
    expected["spec"]["containers"] = [expected_trainer("ranker")]
    assert patched == expected
    assert "schedulingGates" not in patched["spec"]
    valid(patched)
    assert (await hook.mutate(patched))[1] == []


@pytest.mark.asyncio
async def test_annotations_become_the_sidecars_settings_and_the_secret_its_env(hook: Webhook) -> None:
    pod = job_pod(
        {"strata.dev/keep": "5", "strata.dev/metrics-port": "9500", "strata.dev/storage-secret": "s3-creds"}
    )
    _, patch = await hook.mutate(pod)
    patched = jsonpatch.apply_patch(pod, patch)
    sidecar = patched["spec"]["initContainers"][0]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["STRATA_KEEP"] == "5" and env["STRATA_METRICS_PORT"] == "9500"
    assert sidecar["startupProbe"]["httpGet"]["port"] == 9500
    assert sidecar["ports"][0]["containerPort"] == 9500
    assert sidecar["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    trainer_container = patched["spec"]["containers"][0]
    assert "envFrom" not in trainer_container  # storage credentials: the sidecar's only
    assert "STRATA_KEEP" not in {e["name"] for e in trainer_container["env"]}
    valid(patched)


@pytest.mark.asyncio
async def test_shm_size_per_pod_and_the_ca_follows_a_rotation(hook: Webhook) -> None:
    pod = job_pod({"strata.dev/shm-size": "16Gi"})
    response, patch = await hook.mutate(pod)
    patched = jsonpatch.apply_patch(pod, patch)
    [shm] = [v for v in patched["spec"]["volumes"] if v["name"] == "strata-shm"]
    # the chart's sidecar resources apply where the pod says nothing
    assert patched["spec"]["initContainers"][0]["resources"] == CONFIG.resources
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    # the trainer's 8Gi limit cannot hold 16Gi of segments: a warning names both
    assert any("memory limit 8Gi" in w and "16Gi" in w for w in response["warnings"]), response
    # no annotations at all: the map is created with the CA in it
    bare = job_pod()
    del bare["metadata"]["annotations"]
    bare_patched = jsonpatch.apply_patch(bare, (await hook.mutate(bare))[1])
    assert bare_patched["metadata"]["annotations"] == {REPORT_CA_ANNOTATION: REPORT_CA}
    valid(bare_patched)
    # a pod admitted before a rotation and fed back after it gets the new bundle, nothing else
    rotated = "-----BEGIN CERTIFICATE-----\nMIIBbmV4dA==\n-----END CERTIFICATE-----\n"
    second = webhook.mutate(
        {"uid": "u", "operation": "CREATE", "namespace": "ml", "object": patched},
        dataclasses.replace(CONFIG, report_ca=rotated),
    )
    ops = json.loads(base64.b64decode(second["response"]["patch"]))
    assert ops == [{"op": "add", "path": "/metadata/annotations/strata.dev~1report-ca", "value": rotated}]


@pytest.mark.asyncio
async def test_sidecar_resources_per_pod(hook: Webhook) -> None:
    pod = job_pod({"strata.dev/sidecar-memory": "6Gi", "strata.dev/sidecar-cpu": "1500m"})
    patched = jsonpatch.apply_patch(pod, (await hook.mutate(pod))[1])
    assert patched["spec"]["initContainers"][0]["resources"] == {
        "requests": {"cpu": "1500m", "memory": "6Gi"},
        "limits": {"memory": "6Gi"},
    }
    assert CONFIG.resources["requests"]["memory"] == "512Mi"  # the shared default is not modified
    valid(patched)


@pytest.mark.asyncio
async def test_variables_the_trainer_sets_are_left_alone(hook: Webhook) -> None:
    pod = job_pod()
    pod["spec"]["containers"][0]["env"].append({"name": "STRATA_RANK", "value": "3"})
    _, patch = await hook.mutate(pod)
    patched = jsonpatch.apply_patch(pod, patch)
    ranks = [e for e in patched["spec"]["containers"][0]["env"] if e["name"] == "STRATA_RANK"]
    assert ranks == [{"name": "STRATA_RANK", "value": "3"}]


@pytest.mark.asyncio
async def test_unlabeled_pods_and_the_operators_namespace_are_untouched(hook: Webhook) -> None:
    plain = job_pod(labels={JOB_NAME_LABEL: "recsys"})
    response, patch = await hook.mutate(plain)
    assert response == {"uid": response["uid"], "allowed": True} and patch == []
    response, patch = await hook.mutate(job_pod(), namespace="strata-system")
    assert response["allowed"] is True and patch == []
    # Not a CREATE: nothing to inject (the webhook is registered for CREATE; be safe anyway).
    response, patch = await hook.mutate(job_pod(), operation="UPDATE")
    assert response["allowed"] is True and patch == []


@pytest.mark.parametrize(
    ("annotations", "named"),
    [
        ({"strata.dev/keep": "many"}, "strata.dev/keep='many': expected an integer"),
        ({"strata.dev/kep": "3"}, "strata.dev/kep: not a Strata setting; did you mean strata.dev/keep?"),
        ({"strata.dev/metrics-port": "0"}, "strata.dev/metrics-port='0': expected a port 1-65535"),
        ({"strata.dev/shm-dir": "/dev/shm"}, "strata.dev/shm-dir='/dev/shm': expected /var/run/strata/shm"),
        ({"strata.dev/storage-secret": "Bad_Name"}, "strata.dev/storage-secret='Bad_Name'"),
        ({"strata.dev/shm-size": "lots"}, "strata.dev/shm-size='lots': expected a Kubernetes quantity"),
        # values only the sidecar's own validation knew: refused here, not by a sidecar that never starts
        ({"strata.dev/policy": "bogus"}, "strata.dev/policy='bogus': strata.dev/policy: checkpoint policy"),
        ({"strata.dev/nice": "50"}, "strata.dev/nice='50': strata.dev/nice must be between 0 and 19"),
        ({"strata.dev/conditional-writes": "maybe"}, "must be require or warn, got 'maybe'"),
        (
            {"strata.dev/sidecar-memory": "4GB!"},
            "strata.dev/sidecar-memory='4GB!': expected a Kubernetes quantity",
        ),
        ({"strata.dev/sidecar-cpu": "-1"}, "strata.dev/sidecar-cpu='-1': expected a positive CPU quantity"),
        (
            {"strata.dev/shm-size": "1Ki"},
            "strata.dev/shm-size='1Ki': expected a Kubernetes quantity of at least 1Mi",
        ),
        ({"strata.dev/run": "again"}, "strata.dev/run='again': expected one of resume, fresh"),
    ],
)
@pytest.mark.asyncio
async def test_bad_annotations_are_denied_naming_them(
    hook: Webhook, annotations: dict[str, str], named: str
) -> None:
    response, patch = await hook.mutate(job_pod(annotations))
    assert response["allowed"] is False and patch == []
    assert response["status"]["code"] == 422
    assert named in response["status"]["message"], response["status"]["message"]


@pytest.mark.asyncio
async def test_malformed_reviews_get_a_readable_400(hook: Webhook) -> None:
    status, answer = await hook.post(webhook.MUTATE_PATH, None, raw=b"{not json")
    assert status == 400 and answer["error"].startswith("body is not JSON")
    status, answer = await hook.post(
        webhook.MUTATE_PATH, {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}
    )
    assert status == 400 and "expected apiVersion admission.k8s.io/v1" in answer["error"]
    status, answer = await hook.post(
        webhook.VALIDATE_PATH,
        {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"object": {}}},
    )
    assert status == 400 and "request.uid" in answer["error"]
    status, answer = await hook.post(webhook.VALIDATE_PATH, [1, 2])
    assert status == 400 and "JSON object" in answer["error"]


def job(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "recsys", "namespace": "ml"},
        "spec": {
            "completionMode": "Indexed",
            "completions": 4,
            "parallelism": 4,
            "template": {
                "metadata": {"labels": {OPT_IN_LABEL: OPT_IN_VALUE}},
                "spec": {"restartPolicy": "Never", "containers": [trainer()]},
            },
            **spec,
        },
    }


@pytest.mark.asyncio
async def test_validate_workloads_warns_and_denies(hook: Webhook) -> None:
    response = await hook.review(webhook.VALIDATE_PATH, job())
    assert response["allowed"] is True
    assert any("podFailurePolicy has no rule onExitCodes In [75]" in w for w in response["warnings"])
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "ranker", "namespace": "ml"},
        "spec": {"replicatedJobs": [{"name": "workers", "template": {"spec": job()["spec"]}}]},
    }
    response = await hook.review(webhook.VALIDATE_PATH, jobset)
    assert response["allowed"] is False
    assert "BlockingRecreate" in response["status"]["message"]
    jobset["spec"]["failurePolicy"] = {"restartStrategy": "BlockingRecreate"}
    assert (await hook.review(webhook.VALIDATE_PATH, jobset))["allowed"] is True
    # A workload that does not opt in is allowed silently; a DELETE carries no object.
    plain = job()
    plain["spec"]["template"]["metadata"] = {}
    response = await hook.review(webhook.VALIDATE_PATH, plain)
    assert response == {"uid": response["uid"], "allowed": True}
    response = await hook.review(webhook.VALIDATE_PATH, None, operation="DELETE")
    assert response["allowed"] is True


@pytest.mark.asyncio
async def test_an_update_is_denied_only_for_what_it_changes(hook: Webhook) -> None:
    """A JobSet created before the webhook (or accepted by an older release) with a problem can
    still be updated (Kueue clearing suspend): the old problem is a warning; a new one is denied."""
    old = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "ranker", "namespace": "ml"},
        "spec": {
            "suspend": True,
            "replicatedJobs": [{"name": "workers", "template": {"spec": job()["spec"]}}],
        },
    }
    resumed = json.loads(json.dumps(old))
    resumed["spec"]["suspend"] = False
    response = await hook.review(webhook.VALIDATE_PATH, resumed, operation="UPDATE", old=old)
    assert response["allowed"] is True
    assert any("BlockingRecreate" in w and "already so before this update" in w for w in response["warnings"])
    # the same object created now is denied, and so is an update that brings a new problem
    assert (await hook.review(webhook.VALIDATE_PATH, resumed))["allowed"] is False
    broken = json.loads(json.dumps(resumed))
    template = broken["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    template["metadata"]["annotations"] = {"strata.dev/keep": "many"}
    response = await hook.review(webhook.VALIDATE_PATH, broken, operation="UPDATE", old=old)
    assert response["allowed"] is False and "strata.dev/keep" in response["status"]["message"]
    assert "BlockingRecreate" not in response["status"]["message"]


@pytest.mark.asyncio
async def test_the_operator_serves_the_webhooks_on_its_report_port(k8s: K8s, tmp_path: Path) -> None:
    cert, key, client = tls_files(tmp_path)
    config = OperatorConfig(
        kubeconfig=str(k8s.kubeconfig),
        report_host="127.0.0.1",
        report_port=0,
        tls_cert_file=str(cert),
        tls_key_file=str(key),
        inject=CONFIG,
    )
    async with serve(config) as operator:
        assert operator.report_url is not None
        hook = Webhook(operator.report_url.replace("127.0.0.1", "localhost"), client)
        pod = job_pod()
        response, patch = await hook.mutate(pod)
        assert response["allowed"] is True
        assert jsonpatch.apply_patch(pod, patch)["spec"]["initContainers"][0]["name"] == "strata-sidecar"


# ---- the injected sidecar starts ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_injected_sidecar_starts_and_passes_its_startup_probe(
    s3_store_url: tuple[str, str], short_tmp: Path
) -> None:
    """The initContainer's command and env, with the pod's paths moved under a temp dir and the
    downward-API values resolved as the kubelet would, run a real ``strata sidecar`` on SeaweedFS."""
    url, endpoint = s3_store_url
    port = free_port()
    config = InjectConfig(image="unused", storage_uri=url, storage_endpoint=endpoint)
    pod = job_pod({"strata.dev/metrics-port": str(port), "strata.dev/storage-secret": "s3-creds"})
    patched = jsonpatch.apply_patch(pod, injection.inject(pod, namespace="ml", config=config))
    sidecar = patched["spec"]["initContainers"][0]
    # The volumes, where the kubelet would mount them.
    moved = {
        injection.SHM_DIR: short_tmp / "shm",
        "/var/run/strata/sock": short_tmp / "sock",
        injection.PODINFO_DIR: short_tmp / "podinfo",
        injection.TOKEN_DIR: short_tmp / "token",
    }
    for mount in sidecar["volumeMounts"]:
        assert mount["mountPath"] in moved or mount["mountPath"] == "/tmp", mount
    for directory in moved.values():
        directory.mkdir()
    (short_tmp / "podinfo" / "generation").write_text("r7k2/0")  # the operator wrote it before the release
    (short_tmp / "podinfo" / "restore-request").write_text("")
    (short_tmp / "token" / "token").write_text("a-projected-token")
    fields = {"metadata.namespace": "ml", f"metadata.labels['{JOB_INDEX_LABEL}']": "0"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_"))}
    env.update({"AWS_ACCESS_KEY_ID": "strata", "AWS_SECRET_ACCESS_KEY": "strata"})  # the Secret's keys
    for var in sidecar["env"]:
        if "valueFrom" in var:
            value = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            value = var["value"]
            for inside, outside in moved.items():
                value = value.replace(inside, str(outside))
        env[var["name"]] = value
    assert sidecar["command"][0] == "strata"
    command = [str(Path(sys.executable).with_name("strata")), *sidecar["command"][1:]]
    probe = sidecar["startupProbe"]["httpGet"]
    log = short_tmp / "sidecar.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{probe['port']}{probe['path']}", timeout=2
                ) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, f"the startup probe never passed:\n{log.read_text()}"
                time.sleep(0.2)
        # The probe passes only once the socket is published: the trainer can connect now.
        socket_path = Path(env["STRATA_SOCKET"])
        assert socket_path.is_socket() and socket_path.parent == short_tmp / "sock" / "s"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.asyncio
async def test_add_routes_without_injection_only_gates(tmp_path: Path) -> None:
    cert, key, client = tls_files(tmp_path)
    app = web.Application()
    webhook.add_routes(app, None)
    server = await reports.start_server(app, "127.0.0.1", 0, reports.server_ssl_context(str(cert), str(key)))
    try:
        hook = Webhook(f"https://localhost:{server.port}", client)
        _, patch = await hook.mutate(job_pod())
        assert patch == [{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": GANG_GATE}]}]
    finally:
        await server.close()


@pytest.mark.asyncio
async def test_world_size_and_the_jobset_rank_come_from_the_workload(tmp_path: Path) -> None:
    """The operator's controller answers shape_of from its watch cache (else one GET): the world size
    for every pod, and a JobSet pod's global rank as a literal (the completion index alone repeats in
    every replica of a replicated job)."""
    asked: list[tuple[str, str]] = []

    async def shape_of(namespace: str, pod: dict[str, Any]) -> injection.Shape:
        asked.append((namespace, pod["metadata"]["labels"][JOB_NAME_LABEL]))
        workload = {
            "kind": "JobSet",
            "spec": {
                "replicatedJobs": [
                    {"name": "workers", "replicas": 2, "template": {"spec": {"completions": 4}}},
                ]
            },
        }
        return injection.workload_shape(workload, pod)

    cert, key, client = tls_files(tmp_path)
    app = web.Application()
    webhook.add_routes(app, CONFIG, shape_of=shape_of)
    server = await reports.start_server(app, "127.0.0.1", 0, reports.server_ssl_context(str(cert), str(key)))
    try:
        hook = Webhook(f"https://localhost:{server.port}", client)
        pod = jobset_pod()
        pod["metadata"]["labels"]["jobset.sigs.k8s.io/job-index"] = "1"  # Job ranker-workers-1, index 1
        _, patch = await hook.mutate(pod)
        patched = jsonpatch.apply_patch(pod, patch)
        for container in (patched["spec"]["initContainers"][0], patched["spec"]["containers"][0]):
            env = {e["name"]: e for e in container["env"]}
            assert env["STRATA_RANK"] == {"name": "STRATA_RANK", "value": "5"}
            assert env["STRATA_WORLD_SIZE"] == {"name": "STRATA_WORLD_SIZE", "value": "8"}
        valid(patched)
        assert asked == [("ml", "ranker-workers-0")]
        assert (await hook.mutate(patched))[1] == []
    finally:
        await server.close()


@pytest.mark.asyncio
async def test_a_trainer_limit_without_room_for_the_segments_is_a_warning(hook: Webhook) -> None:
    pod = job_pod()
    pod["spec"]["containers"][0]["resources"] = {"limits": {"memory": "2048Mi"}}
    response, patch = await hook.mutate(pod)
    assert response["allowed"] is True and patch
    assert response["warnings"] == [
        "container trainer: memory limit 2048Mi is not above the shared-memory volume's 2Gi; the segments "
        "(two per rank: the committed snapshot and one in flight) are charged to the trainer, so its limit "
        "must cover them on top of its working set"
    ]
    assert injection.quantity("1.5Gi") == 1.5 * 2**30 and injection.quantity("2G") == 2e9
    assert injection.quantity("500m") == 0.5 and injection.quantity("1e3") == 1000


def test_the_operator_cli_teaches_and_builds_the_injection_settings() -> None:
    from sidecar import cli
    from sidecar.operator import cli as operator_cli

    parser = cli.build_parser()
    text = subprocess.run(
        [str(Path(sys.executable).with_name("strata")), "operator", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in (
        "--sidecar-image",
        "--storage-uri",
        "--storage-endpoint",
        "--sidecar-report-url",
        "--shm-size",
    ):
        assert flag in text
    args = parser.parse_args(
        [
            "operator",
            "--sidecar-image",
            "img:1",
            "--storage-uri",
            "s3://b/p",
            "--own-namespace",
            "strata-system",
            "--sidecar-resources",
            '{"limits": {"memory": "1Gi"}}',
        ]
    )
    config = operator_cli._inject_config(args)
    assert config == InjectConfig(
        image="img:1",
        storage_uri="s3://b/p",
        own_namespace="strata-system",
        resources={"limits": {"memory": "1Gi"}},
    )
    assert operator_cli._inject_config(parser.parse_args(["operator"])) is None
    with pytest.raises(ValueError, match="--sidecar-image and --storage-uri go together"):
        operator_cli._inject_config(parser.parse_args(["operator", "--storage", "s3://b/p"]))
    with pytest.raises(ValueError, match="--sidecar-resources is not JSON"):
        operator_cli._inject_config(
            parser.parse_args(
                ["operator", "--sidecar-image", "i", "--storage", "s", "--sidecar-resources", "{"]
            )
        )


def test_shm_dir_may_be_turned_off_or_named_as_injected() -> None:
    def sidecar_env(annotations: dict[str, str]) -> dict[str, str]:
        pod = job_pod(annotations)
        patched = jsonpatch.apply_patch(pod, injection.inject(pod, namespace="ml", config=CONFIG))
        return {e["name"]: e.get("value") for e in patched["spec"]["initContainers"][0]["env"]}

    assert sidecar_env({"strata.dev/shm-dir": ""})["STRATA_SHM_DIR"] == ""  # chunked gRPC saves only
    assert sidecar_env({"strata.dev/shm-dir": injection.SHM_DIR})["STRATA_SHM_DIR"] == injection.SHM_DIR
    pod = job_pod({"strata.dev/shm-dir": injection.SHM_DIR})
    patched = jsonpatch.apply_patch(pod, injection.inject(pod, namespace="ml", config=CONFIG))
    env = patched["spec"]["initContainers"][0]["env"]
    assert [e["name"] for e in env].count("STRATA_SHM_DIR") == 1  # set once: no duplicate env names
