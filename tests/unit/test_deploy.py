"""deploy/: the example workloads, the kind cluster and its SeaweedFS, and `make e2e`'s skip path.

Every built-in object is checked against the Kubernetes 1.29 and 1.33 schemas (kubernetes-validate,
strict), the example Job passes the operator's own admission without a warning, and the names the
manifests, the chart and deploy/e2e/run.sh share agree with each other.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from sidecar.operator import inject, names
from sidecar.operator.admission import mutate_pod, opted_in, validate_workload
from sidecar.operator.inject import InjectConfig
from tests.images import IMAGE, TRAINER_IMAGE

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBE_VERSIONS = ("1.29.0", "1.33.0")
MANIFESTS = [*sorted(DEPLOY.glob("examples/*.yaml")), DEPLOY / "kind" / "seaweedfs.yaml"]
#: Kinds kubernetes-validate has no schema for; checked by hand below.
CUSTOM = {("jobset.x-k8s.io/v1alpha2", "JobSet")}


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def one(path: Path, kind: str) -> dict[str, Any]:
    [found] = [doc for doc in load(path) if doc["kind"] == kind]
    return found


def validate(body: dict[str, Any]) -> None:
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(body, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{body['kind']} {body['metadata'].get('name')} invalid for {version}: {err}")


def test_the_manifests_exist() -> None:
    names_ = {p.relative_to(DEPLOY).as_posix() for p in MANIFESTS}
    assert {"examples/recsys-job.yaml", "examples/recsys-jobset.yaml", "kind/seaweedfs.yaml"} <= names_


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_every_built_in_object_is_valid_for_1_29_and_1_33(path: Path) -> None:
    docs = load(path)
    assert docs
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM:
            continue
        validate(doc)


def test_the_example_job_passes_admission_without_warnings() -> None:
    job = one(DEPLOY / "examples" / "recsys-job.yaml", "Job")
    verdict = validate_workload(job)
    assert verdict.allowed, verdict.message
    assert verdict.warnings == []
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"] == 2
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    # docs/kubernetes/operator.md, "A Job that works with it": the rules, exactly.
    assert spec["backoffLimitPerIndex"] >= 1 and spec["podReplacementPolicy"] == "Failed"
    rules = spec["podFailurePolicy"]["rules"]
    disruption = [{"type": "DisruptionTarget", "status": "True"}]
    assert {"action": "Ignore", "onPodConditions": disruption} in rules
    trainer = "trainer"
    for action, code in (("Ignore", names.EXIT_PEER_DIED), ("FailJob", names.EXIT_LIMIT_SPENT)):
        rule = {"containerName": trainer, "operator": "In", "values": [code]}
        assert {"action": action, "onExitCodes": rule} in rules, (action, code)
    assert [c["name"] for c in spec["template"]["spec"]["containers"]] == [trainer]
    assert (names.EXIT_PEER_DIED, names.EXIT_LIMIT_SPENT) == (75, 76)


def test_the_example_job_opts_in_on_its_pod_template() -> None:
    job = one(DEPLOY / "examples" / "recsys-job.yaml", "Job")
    template = job["spec"]["template"]
    assert template["metadata"]["labels"][names.OPT_IN_LABEL] == names.OPT_IN_VALUE
    assert opted_in(template)
    # The label only on the Job's own metadata opts nothing in: pods never see it.
    moved = copy.deepcopy(job)
    del moved["spec"]["template"]["metadata"]["labels"][names.OPT_IN_LABEL]
    moved["metadata"].setdefault("labels", {})[names.OPT_IN_LABEL] = names.OPT_IN_VALUE
    assert not opted_in(moved["spec"]["template"]) and validate_workload(moved).warnings == []
    # A pod the Job controller makes from the template is gated by the webhook.
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **copy.deepcopy(template["metadata"]),
            "name": "recsys-1-abcde",
            "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": "recsys", "uid": "u", "controller": True}
            ],
        },
        "spec": copy.deepcopy(template["spec"]),
    }
    gated = jsonpatch.apply_patch(pod, mutate_pod(pod))
    assert [g["name"] for g in gated["spec"]["schedulingGates"]] == [names.GANG_GATE]
    validate(gated)
    # Injected with the chart's defaults, its trainer's memory limit covers the segments: no warning
    config = InjectConfig(image="strata:1", storage_uri="s3://ckpt/jobs")
    assert inject.warnings(pod, namespace="default", config=config) == []
    injected = jsonpatch.apply_patch(pod, inject.inject(pod, namespace="default", config=config))
    validate(injected)


def test_the_example_job_has_stable_pod_dns() -> None:
    path = DEPLOY / "examples" / "recsys-job.yaml"
    job, service = one(path, "Job"), one(path, "Service")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]


def test_the_example_jobset() -> None:
    jobset = one(DEPLOY / "examples" / "recsys-jobset.yaml", "JobSet")
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] >= 1 and policy["restartStrategy"] == "BlockingRecreate"
    replicated = jobset["spec"]["replicatedJobs"]
    assert replicated
    for rjob in replicated:
        template = rjob["template"]["spec"]["template"]
        assert template["metadata"]["labels"][names.OPT_IN_LABEL] == names.OPT_IN_VALUE, rjob["name"]
        assert template["spec"]["restartPolicy"] == "Never"
        # The Job each replicated job stamps out is a valid batch/v1 Job.
        validate(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": f"{jobset['metadata']['name']}-{rjob['name']}-0"},
                "spec": rjob["template"]["spec"],
            }
        )
    verdict = validate_workload(jobset)
    assert verdict.allowed and verdict.warnings == [], (verdict.message, verdict.warnings)


def test_the_images_the_e2e_builds_are_the_ones_the_chart_and_the_examples_run() -> None:
    script = (DEPLOY / "e2e" / "run.sh").read_text()
    # the script reads the names from the chart: run its lines that set them
    lines = [line for line in script.splitlines() if line.startswith(("TAG=", "REPO=", "IMAGE=", "TRAINER="))]
    named = subprocess.run(
        ["bash", "-c", "\n".join([*lines, 'echo "$IMAGE $TRAINER"'])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert named.stdout.split() == [IMAGE, TRAINER_IMAGE]
    for path in DEPLOY.glob("examples/*.yaml"):
        for doc in load(path):
            text = yaml.safe_dump(doc)
            if "image:" in text:
                assert f"image: {TRAINER_IMAGE}" in text, path.name
    assert "-f deploy/Dockerfile " in script and "-f deploy/Dockerfile.trainer " in script


def test_seaweedfs_serves_what_the_chart_values_name() -> None:
    path = DEPLOY / "kind" / "seaweedfs.yaml"
    service = one(path, "Service")
    assert (service["metadata"]["name"], service["metadata"]["namespace"]) == ("seaweedfs", "storage")
    assert 8333 in [p["port"] for p in service["spec"]["ports"]]
    [server] = one(path, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert server["args"][0] == "server" and "-s3" in server["args"] and "-s3.port=8333" in server["args"]
    bucket_job = one(path, "Job")
    assert "s3.bucket.create -name ckpt" in bucket_job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    script = (DEPLOY / "e2e" / "run.sh").read_text()
    assert "--set storage.uri=s3://ckpt/jobs --set storage.endpoint=http://seaweedfs.storage:8333" in script


def test_the_kind_cluster_runs_kubernetes_1_29_or_later() -> None:
    config = yaml.safe_load((DEPLOY / "kind" / "cluster.yaml").read_text())
    assert (config["apiVersion"], config["kind"]) == ("kind.x-k8s.io/v1alpha4", "Cluster")
    assert config["nodes"]
    for node in config["nodes"]:
        version = node["image"].split(":v", 1)[1]
        major, minor = (int(x) for x in version.split(".")[:2])
        assert (major, minor) >= (1, 29), node["image"]


def test_make_e2e_skips_without_docker_kind_and_helm() -> None:
    path = "/usr/bin:/bin"
    found = [tool for tool in ("docker", "kind", "helm") if shutil.which(tool, path=path)]
    if found:
        pytest.skip(f"{found} on {path}: the script would run for real")
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8"}
    result = subprocess.run(
        ["bash", str(DEPLOY / "e2e" / "run.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "e2e skipped" in result.stdout
    for tool in ("docker", "kind", "helm"):
        assert tool in result.stdout.splitlines()[0], result.stdout  # it says which is missing
    makefile = (ROOT / "Makefile").read_text()
    assert "\ne2e:  ## " in makefile and " e2e " in makefile.split(".PHONY:", 1)[1].splitlines()[0]
    # `make test` does not call it.
    test_target = next(line for line in makefile.splitlines() if line.startswith("test:"))
    assert "e2e" not in test_target


def test_the_e2e_script_reads_the_trainer_args_from_the_example() -> None:
    kubectl = shutil.which("kubectl") or str(ROOT / ".venv" / "bin" / "kubectl")
    if not os.access(kubectl, os.X_OK):
        pytest.skip("no kubectl")
    # The same command line run.sh uses for the uninterrupted reference run, offline (--local).
    script = (DEPLOY / "e2e" / "run.sh").read_text()
    jsonpath = '{range .spec.template.spec.containers[?(@.name=="trainer")].args[*]}{@}{" "}{end}'
    assert f"-o jsonpath='{jsonpath}'" in script
    example = str(DEPLOY / "examples" / "recsys-job.yaml")
    out = subprocess.run(
        [kubectl, "label", "--local", "-f", example, "e2e=reference", "-o", f"jsonpath={jsonpath}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KUBECONFIG": os.devnull},
        check=True,
    ).stdout
    job = one(DEPLOY / "examples" / "recsys-job.yaml", "Job")
    assert out.split() == job["spec"]["template"]["spec"]["containers"][0]["args"]
