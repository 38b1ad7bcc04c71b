"""Admission logic, pure functions over API objects (the webhook that serves them is installed by
the chart): gate opted-in Job-owned pods, and check opted-in Jobs and JobSets before they run.

Why a gate: the Job controller replaces a failed pod at once. Gated, the replacement stays
Pending until the operator has seen every pod of the old gang terminal (or fenced), written the
new generation on it and lifted the gate, so two generations never run side by side.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.operator import annotations as table
from sidecar.operator import names

#: Gangs above this size hit the Job controller's re-creation backoff (it also counts pods
#: podFailurePolicy ignored: kubernetes issues 119434 and 130881).
LARGE_GANG = 8


def opted_in(template_or_pod: Mapping[str, Any]) -> bool:
    labels = (template_or_pod.get("metadata") or {}).get("labels") or {}
    return labels.get(names.OPT_IN_LABEL) == names.OPT_IN_VALUE


def _job_owner(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if (
            ref.get("kind") == "Job"
            and str(ref.get("apiVersion", "")).startswith("batch/")
            and ref.get("controller")
        ):
            return ref
    return None


def mutate_pod(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The JSON patch (RFC 6902) that gates ``pod``, or [] when it is not ours to gate or already is.

    Gated: opted-in pods a Job controls. Not gated: bare pods and other owners, and JobSet pods
    (JobSet recreates its whole gang itself, with BlockingRecreate).
    """
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if not opted_in(pod) or _job_owner(pod) is None or names.JOBSET_NAME_LABEL in labels:
        return []
    gates = (pod.get("spec") or {}).get("schedulingGates")
    if gates is None:
        return [{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": names.GANG_GATE}]}]
    if any(g.get("name") == names.GANG_GATE for g in gates):
        return []
    return [{"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": names.GANG_GATE}}]


@dataclass
class Verdict:
    allowed: bool = True
    message: str = ""
    warnings: list[str] = field(default_factory=list)

    def to_admission_response(self, uid: str) -> dict[str, Any]:
        response: dict[str, Any] = {"uid": uid, "allowed": self.allowed}
        if not self.allowed:
            response["status"] = {"code": 422, "reason": "Invalid", "message": self.message}
        if self.warnings:
            response["warnings"] = self.warnings
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def mutation_response(uid: str, patch: list[dict[str, Any]]) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def _templates(obj: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(where, pod template) of a Job, or of each replicated Job of a JobSet."""
    kind = obj.get("kind")
    spec = obj.get("spec") or {}
    if kind == "Job":
        return [("spec.template", spec.get("template") or {})]
    if kind == "JobSet":
        out = []
        for i, rjob in enumerate(spec.get("replicatedJobs") or []):
            template = ((rjob.get("template") or {}).get("spec") or {}).get("template") or {}
            out.append((f"spec.replicatedJobs[{i}] ({rjob.get('name', '?')})", template))
        return out
    return []


def _job_warnings(spec: Mapping[str, Any], template: Mapping[str, Any], job: table.JobSettings) -> list[str]:
    warnings = []
    pod_spec = template.get("spec") or {}
    if spec.get("completionMode") != "Indexed":
        warnings.append(
            "spec.completionMode is not Indexed: ranks need stable indexes for a gang restart; "
            "set completionMode: Indexed"
        )
    world = int(spec.get("completions") or spec.get("parallelism") or 1)
    for c in pod_spec.get("containers") or []:
        for e in c.get("env") or []:
            value = e.get("value")
            # the injection sets STRATA_WORLD_SIZE from completions; a template's own value wins
            if e.get("name") == "STRATA_WORLD_SIZE" and isinstance(value, str) and value != str(world):
                warnings.append(
                    f"container {c.get('name')}: STRATA_WORLD_SIZE={value} but the Job runs {world} "
                    "completions (one rank per pod): no step commits unless every rank is counted; "
                    "remove it (the injection sets it from completions) or fix it"
                )
    if pod_spec.get("restartPolicy") != "Never":
        warnings.append(
            "spec.template.spec.restartPolicy should be Never: the operator restarts the whole gang, "
            "a kubelet restart of one container would rejoin a gang that has moved on"
        )
    rules = (spec.get("podFailurePolicy") or {}).get("rules") or []

    def has_rule(code: int, action: str) -> bool:
        for rule in rules:
            values = (rule.get("onExitCodes") or {}).get("values") or []
            if (
                rule.get("action") == action
                and code in values
                and (rule.get("onExitCodes") or {}).get("operator", "In") == "In"
            ):
                return True
        return False

    trainers = [str(c.get("name")) for c in pod_spec.get("containers") or []]
    trainer = trainers[0] if len(trainers) == 1 else "<the trainer>"
    for i, rule in enumerate(rules):
        on = rule.get("onExitCodes")
        if not on:
            continue
        operator, values = on.get("operator", "In"), on.get("values")
        where = f"spec.podFailurePolicy.rules[{i}] (onExitCodes {operator} {values})"
        if not on.get("containerName"):
            # The Job controller matches every container's exit, the native sidecar's included (it
            # is stopped by a signal after the trainer): a NotIn rule can fail the Job for it.
            warnings.append(
                f"{where} has no containerName: it also matches the injected sidecar "
                f"({names.SIDECAR_CONTAINER}), whose exit says nothing about training; "
                f"set containerName: {trainer}"
            )
        elif on["containerName"] not in trainers:
            warnings.append(
                f"{where}: containerName {on['containerName']!r} is no container of the pod template "
                f"(containers: {', '.join(trainers)}): the rule never matches the trainer"
            )
    if not has_rule(names.EXIT_PEER_DIED, "Ignore"):
        warnings.append(
            f"spec.podFailurePolicy has no rule onExitCodes In [{names.EXIT_PEER_DIED}] action Ignore "
            "(with containerName of the trainer): ranks that exit because a peer died count against "
            "backoffLimit, so one failure is counted once per rank"
        )
    if not has_rule(names.EXIT_LIMIT_SPENT, "FailJob"):
        warnings.append(
            f"spec.podFailurePolicy has no rule onExitCodes In [{names.EXIT_LIMIT_SPENT}] action FailJob: "
            'the code is reserved for "Strata\'s restart limit is spent", and a trainer that exits '
            "with it would be retried"
        )
    if not any((r.get("onPodConditions") or []) and r.get("action") == "Ignore" for r in rules):
        warnings.append(
            "spec.podFailurePolicy has no rule onPodConditions [{type: DisruptionTarget}] action Ignore: "
            "pods the operator evicts for a gang restart count as failures"
        )
    if rules and spec.get("podReplacementPolicy", "Failed") != "Failed":
        warnings.append("spec.podReplacementPolicy must be Failed with a podFailurePolicy")
    parallelism = int(spec.get("parallelism") or 1)
    per_index = spec.get("backoffLimitPerIndex")
    if isinstance(per_index, int) and per_index < job.max_restarts:
        # Each gang restart counts against at most the index that crashed (evicted peers and exit 75
        # are ignored), so the Job controller gives an index up only past max-restarts crashes.
        warnings.append(
            f"spec.backoffLimitPerIndex ({per_index}) is below strata.dev/max-restarts ({job.max_restarts}): "
            f"an index whose pods fail more than {per_index} time(s) is failed by the Job controller and "
            "never re-created, so no gang restart can bring it back and the job fails early; set "
            f"backoffLimitPerIndex to at least {job.max_restarts}"
        )
    backoff_limit = spec.get("backoffLimit", 6)
    if spec.get("backoffLimitPerIndex") is None and backoff_limit is not None:
        if int(backoff_limit) < job.max_restarts:
            warnings.append(
                f"spec.backoffLimit ({backoff_limit}) is below strata.dev/max-restarts ({job.max_restarts}): "
                "the Job fails before Strata's restarts are spent"
            )
        if parallelism >= LARGE_GANG:
            warnings.append(
                f"a gang of {parallelism} without spec.backoffLimitPerIndex: the Job controller's "
                "re-creation backoff also counts pods the policy ignored (kubernetes issues 119434, "
                "130881), so a gang restart can wait minutes; set backoffLimitPerIndex"
            )
    return warnings


def _redundancy_warnings(
    obj: Mapping[str, Any], where: str, template: Mapping[str, Any], env: Mapping[str, str]
) -> list[str]:
    """Peer redundancy needs stable pod DNS names: an Indexed Job's pods get them from the pod
    template's subdomain (a headless Service of that name); a JobSet's from its network settings."""
    mode = env.get("STRATA_REDUNDANCY", "off")
    if mode == "off":
        return []
    if obj.get("kind") == "JobSet":
        network = (obj.get("spec") or {}).get("network") or {}
        if network.get("enableDNSHostnames") is False:
            return [
                f"{where}: strata.dev/redundancy={mode} needs the pods' DNS names, but "
                "spec.network.enableDNSHostnames is false; the injected sidecars are refused"
            ]
        return []
    spec = obj.get("spec") or {}
    problems = []
    if not (template.get("spec") or {}).get("subdomain"):
        problems.append(
            f"{where}: strata.dev/redundancy={mode} needs stable pod DNS names: set "
            "spec.template.spec.subdomain and create a headless Service of that name selecting the "
            "Job's pods; without it the injected sidecars are refused"
        )
    if spec.get("completionMode") != "Indexed":
        problems.append(
            f"{where}: strata.dev/redundancy={mode} needs completionMode: Indexed (one stable "
            "hostname per index)"
        )
    return problems


def validate_workload(obj: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> Verdict:
    """Deny malformed Strata annotations (naming each); warn about settings that would let retries
    multiply or be miscounted. Workloads that do not opt in are always allowed, silently.

    ``old``: the object an UPDATE changes. Only what the update brings is denied: a problem the
    object had already (created before the webhook was installed, or accepted by an older
    release) is a warning, so the workload can still be updated (Kueue clearing ``suspend``, a
    controller writing its status, the user fixing another field)."""
    problems, warnings = _findings(obj)
    if old is not None and problems:
        before = set(_findings(old)[0])
        warnings += [
            f"{p} (already so before this update; fix it when you can)" for p in problems if p in before
        ]
        problems = [p for p in problems if p not in before]
    if problems:
        return Verdict(False, f"Strata: {'; '.join(problems)}", warnings)
    return Verdict(True, "", warnings)


def _findings(obj: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a workload (see :func:`validate_workload`)."""
    templates = [(where, t) for where, t in _templates(obj) if opted_in(t)]
    if not templates:
        return [], []
    kind = obj.get("kind")
    problems: list[str] = []
    warnings: list[str] = []
    own = table.parse((obj.get("metadata") or {}).get("annotations"))
    problems += [f"metadata.annotations: {p}" for p in own.problems]
    for where, template in templates:
        annotations = (template.get("metadata") or {}).get("annotations")
        parsed = table.parse(annotations)
        problems += [f"{where}.metadata.annotations: {p}" for p in parsed.problems]
        problems += [f"{where}.metadata.annotations: {p}" for p in table.injection_problems(annotations)]
        warnings += _redundancy_warnings(obj, where, template, parsed.sidecar_env)
        if kind == "Job":
            warnings += _job_warnings(obj.get("spec") or {}, template, parsed.job)
        elif "strata.dev/max-restarts" in ((template.get("metadata") or {}).get("annotations") or {}):
            warnings.append(
                f"{where}: strata.dev/max-restarts has no effect on a JobSet; JobSet restarts the gang "
                "itself (spec.failurePolicy.maxRestarts) and Strata adds no second retry layer"
            )
    if kind == "JobSet":
        strategy = ((obj.get("spec") or {}).get("failurePolicy") or {}).get("restartStrategy")
        if strategy != "BlockingRecreate":
            problems.append(
                f"spec.failurePolicy.restartStrategy is {strategy or 'unset (Recreate)'}; Strata needs "
                "BlockingRecreate, so the old gang is gone before the new one starts"
            )
    return problems, warnings
