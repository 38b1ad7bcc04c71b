"""Admission: opted-in Job-owned pods are gated; opted-in workloads are checked before they run."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import jsonpatch

from sidecar.operator import names
from sidecar.operator.admission import mutate_pod, mutation_response, validate_workload

OWNER = {"apiVersion": "batch/v1", "kind": "Job", "name": "recsys", "uid": "u1", "controller": True}
GOOD_RULES = [
    {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [75]}},
    {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [76]}},
    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
]


def pod(
    *, labels: dict[str, str] | None = None, owners: list[dict[str, Any]] | None = None, gates: Any = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "trainer", "image": "t"}]}
    if gates is not None:
        spec["schedulingGates"] = gates
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "recsys-0-abcde",
            "labels": {names.OPT_IN_LABEL: "enabled"} if labels is None else labels,
            "ownerReferences": [OWNER] if owners is None else owners,
        },
        "spec": spec,
    }


def job(**spec: Any) -> dict[str, Any]:
    template_annotations = spec.pop("template_annotations", {})
    base: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": 4,
        "parallelism": 4,
        "backoffLimit": 3,
        "podReplacementPolicy": "Failed",
        "podFailurePolicy": {"rules": GOOD_RULES},
        "template": {
            "metadata": {"labels": {names.OPT_IN_LABEL: "enabled"}, "annotations": template_annotations},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {"name": "trainer", "image": "t", "env": [{"name": "WORLD_SIZE", "value": "4"}]}
                ],
            },
        },
    }
    base.update(spec)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "recsys"}, "spec": base}


def gates_after(p: dict[str, Any]) -> list[str]:
    patched = jsonpatch.apply_patch(copy.deepcopy(p), mutate_pod(p))
    return [g["name"] for g in patched["spec"].get("schedulingGates") or []]


def test_admission_gates_job_owned_opted_in_pod() -> None:
    assert gates_after(pod()) == [names.GANG_GATE]
    assert gates_after(pod(gates=[{"name": "kueue"}])) == ["kueue", names.GANG_GATE]


def test_admission_gate_is_idempotent() -> None:
    gated = pod(gates=[{"name": names.GANG_GATE}])
    assert mutate_pod(gated) == []
    response = mutation_response("uid-1", mutate_pod(pod()))["response"]
    assert response["allowed"] and response["patchType"] == "JSONPatch"
    assert json.loads(base64.b64decode(response["patch"]))[0]["path"] == "/spec/schedulingGates"


def test_admission_leaves_bare_pods_and_other_owners_ungated() -> None:
    assert mutate_pod(pod(owners=[])) == []
    other = {**OWNER, "kind": "ReplicaSet", "apiVersion": "apps/v1"}
    assert mutate_pod(pod(owners=[other])) == []
    assert mutate_pod(pod(labels={})) == []  # not opted in


def test_admission_jobset_pods_not_gated() -> None:
    labels = {names.OPT_IN_LABEL: "enabled", names.JOBSET_NAME_LABEL: "trainjob"}
    assert mutate_pod(pod(labels=labels)) == []


def test_admission_allows_a_well_configured_job_without_warnings() -> None:
    verdict = validate_workload(job())
    assert verdict.allowed and verdict.warnings == [], verdict.warnings


def test_admission_takes_the_injections_own_annotations_and_checks_their_values() -> None:
    """strata.dev/storage-secret and strata.dev/shm-size are read by the injection, not the settings
    table: allowed at the Job (never "not a Strata setting"), and a bad value is named there already."""
    good = job(template_annotations={"strata.dev/storage-secret": "s3-creds", "strata.dev/shm-size": "8Gi"})
    verdict = validate_workload(good)
    assert verdict.allowed and verdict.warnings == [], verdict.message
    bad = job(template_annotations={"strata.dev/storage-secret": "S3_Creds", "strata.dev/shm-size": "big"})
    verdict = validate_workload(bad)
    assert not verdict.allowed
    assert "strata.dev/storage-secret='S3_Creds': expected the name of a Secret" in verdict.message
    assert "strata.dev/shm-size='big': expected a Kubernetes quantity" in verdict.message


def test_admission_warns_when_the_template_miscounts_the_world_size() -> None:
    """The injection sets STRATA_WORLD_SIZE from completions; a template value that disagrees wins
    over it, so it is named."""
    unsized = job()
    unsized["spec"]["template"]["spec"]["containers"][0].pop("env")
    assert not any("WORLD_SIZE" in w for w in validate_workload(unsized).warnings)
    wrong = job()
    wrong["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "STRATA_WORLD_SIZE", "value": "2"}]
    verdict = validate_workload(wrong)
    assert verdict.allowed
    assert any("STRATA_WORLD_SIZE=2 but the Job runs 4 completions" in w for w in verdict.warnings), (
        verdict.warnings
    )


def test_admission_unlabelled_workload_untouched() -> None:
    plain = job(template_annotations={"strata.dev/memory-budget": "lots"})
    plain["spec"]["template"]["metadata"]["labels"] = {}
    verdict = validate_workload(plain)
    assert verdict.allowed and verdict.warnings == []


def test_admission_denies_malformed_annotation_naming_it() -> None:
    verdict = validate_workload(
        job(template_annotations={"strata.dev/memory-budget": "lots", "strata.dev/keeep": "3"})
    )
    assert not verdict.allowed
    assert "strata.dev/memory-budget='lots'" in verdict.message
    assert "did you mean strata.dev/keep?" in verdict.message
    review = verdict.to_admission_response("u")["response"]
    assert review["allowed"] is False and "memory-budget" in review["status"]["message"]
    bad_rollback = job()
    bad_rollback["metadata"]["annotations"] = {"strata.dev/resume-from": "latest"}
    assert "strata.dev/resume-from='latest'" in validate_workload(bad_rollback).message


def test_admission_warns_backoff_limit_miscounts() -> None:
    verdict = validate_workload(job(backoffLimit=1, template_annotations={"strata.dev/max-restarts": "5"}))
    assert verdict.allowed
    assert any("backoffLimit (1) is below strata.dev/max-restarts (5)" in w for w in verdict.warnings)
    no_rules = validate_workload(job(podFailurePolicy=None))
    assert any("[75] action Ignore" in w for w in no_rules.warnings)
    assert any("[76] action FailJob" in w for w in no_rules.warnings)
    assert any("DisruptionTarget" in w for w in no_rules.warnings)


def test_admission_warns_exit_code_rules_not_scoped_to_the_trainer() -> None:
    # Without containerName a rule also matches the injected native sidecar's exit.
    unscoped = [
        {"action": "Ignore", "onExitCodes": {"operator": "In", "values": [75]}},
        {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0, 75]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
    ]
    warnings = validate_workload(job(podFailurePolicy={"rules": unscoped})).warnings
    scoped = [w for w in warnings if "containerName" in w]
    assert len(scoped) == 2, warnings
    assert "spec.podFailurePolicy.rules[0]" in scoped[0] and "spec.podFailurePolicy.rules[1]" in scoped[1]
    assert all("strata-sidecar" in w and "containerName: trainer" in w for w in scoped)
    typo = copy.deepcopy(GOOD_RULES)
    typo[1]["onExitCodes"]["containerName"] = "trainr"
    warnings = validate_workload(job(podFailurePolicy={"rules": typo})).warnings
    assert any("rules[1]" in w and "'trainr'" in w for w in warnings), warnings
    assert validate_workload(job()).warnings == []


def test_admission_warns_large_gang_without_backoff_limit_per_index() -> None:
    verdict = validate_workload(job(parallelism=64, completions=64))
    assert any("backoffLimitPerIndex" in w for w in verdict.warnings)
    fixed = validate_workload(job(parallelism=64, completions=64, backoffLimitPerIndex=3))
    assert not any("backoffLimitPerIndex" in w for w in fixed.warnings)


def test_admission_warns_not_indexed_or_restarting_in_place() -> None:
    bad = job(completionMode="NonIndexed")
    bad["spec"]["template"]["spec"]["restartPolicy"] = "OnFailure"
    warnings = validate_workload(bad).warnings
    assert any("Indexed" in w for w in warnings) and any(
        "restartPolicy should be Never" in w for w in warnings
    )


def test_admission_jobset_requires_blocking_recreate() -> None:
    template = job()["spec"]["template"]
    jobset: dict[str, Any] = {
        "apiVersion": "jobset.sigs.k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "trainjob"},
        "spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": template}}}]},
    }
    verdict = validate_workload(jobset)
    assert not verdict.allowed and "BlockingRecreate" in verdict.message
    jobset["spec"]["failurePolicy"] = {"restartStrategy": "BlockingRecreate", "maxRestarts": 3}
    assert validate_workload(jobset).allowed
    template["metadata"]["annotations"] = {"strata.dev/max-restarts": "2"}
    assert any("no second retry layer" in w for w in validate_workload(jobset).warnings)
