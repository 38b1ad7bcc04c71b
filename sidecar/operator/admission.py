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


#: The sidecar's metrics port where ``strata.dev/metrics-port`` does not say.
METRICS_PORT = 9464


def sidecar_ports(env: Mapping[str, str]) -> tuple[int, int | None]:
    """(metrics port, peer port or None without redundancy) from a pod template's parsed sidecar
    env; call only where :func:`port_problems` found nothing."""
    metrics = int(env.get("STRATA_METRICS_PORT", str(METRICS_PORT)))
    if env.get("STRATA_REDUNDANCY", "off") == "off":
        return metrics, None
    return metrics, int(env.get("STRATA_PEER_PORT", str(names.PEER_PORT)))


#: Ports below this need root or NET_BIND_SERVICE in the node's network namespace (the kernel's
#: default net.ipv4.ip_unprivileged_port_start); a pod's own namespace lets any user bind them.
UNPRIVILEGED_PORT_START = 1024


def port_problems(env: Mapping[str, str], pod_spec: Mapping[str, Any]) -> list[str]:
    """What is wrong with the sidecar's ports: each must be a decimal 1-65535 (1024 and up on a
    hostNetwork pod: the sidecar runs as a non-root user with every capability dropped and binds in
    the node's network namespace), the two distinct, and none a port another container of the pod
    declares (all share the pod's network namespace; on a hostNetwork pod, the node's)."""
    problems = []
    chosen: list[tuple[str, int]] = []
    metrics_raw = env.get("STRATA_METRICS_PORT")
    peer_raw = env.get("STRATA_PEER_PORT")
    redundancy = env.get("STRATA_REDUNDANCY", "off")
    for key, raw, default, why in (
        (
            "strata.dev/metrics-port",
            metrics_raw,
            METRICS_PORT,
            "the injected startup probe reads the sidecar's /metrics",
        ),
        (
            "strata.dev/peer-port",
            peer_raw,
            names.PEER_PORT,
            "the sidecars of the job connect to each other on it",
        ),
    ):
        if key == "strata.dev/peer-port" and redundancy == "off":
            if raw is not None:
                problems.append(
                    f"{key}={raw!r}: the peer port is used with strata.dev/redundancy (buddy or parity) only"
                )
            continue
        if raw is not None and not (raw.isascii() and raw.isdigit()):
            problems.append(f"{key}={raw!r}: expected a decimal port 1-65535 ({why})")
            continue
        port = default if raw is None else int(raw)
        if not 1 <= port <= 65535:
            problems.append(f"{key}={raw!r}: expected a port 1-65535 ({why})")
            continue
        if pod_spec.get("hostNetwork") and port < UNPRIVILEGED_PORT_START:
            problems.append(
                f"{key}={port}: below {UNPRIVILEGED_PORT_START} on a hostNetwork pod, where the sidecar "
                "(a non-root user, every capability dropped) cannot bind it in the node's network "
                f"namespace; choose a port {UNPRIVILEGED_PORT_START}-65535"
            )
            continue
        if raw is None and pod_spec.get("hostNetwork") and metrics_raw is None and peer_raw is None:
            continue  # the injection picks the job's own pair on a hostNetwork pod, clear of these
        chosen.append((key if raw is not None else f"{key} (default {default})", port))
    if len(chosen) == 2 and chosen[0][1] == chosen[1][1]:
        problems.append(
            f"{chosen[0][0]} and {chosen[1][0]} are both {chosen[0][1]}: the sidecar needs two ports"
        )
    declared = {
        int(p["containerPort"]): str(c.get("name"))
        for c in [*(pod_spec.get("initContainers") or []), *(pod_spec.get("containers") or [])]
        if c.get("name") != names.SIDECAR_CONTAINER
        for p in c.get("ports") or []
        if isinstance(p, Mapping) and isinstance(p.get("containerPort"), int)
    }
    for key, port in chosen:
        if port in declared:
            problems.append(
                f"{key} is {port}, a port container {declared[port]} declares: the sidecar shares the pod's "
                "network namespace; choose another port with the annotation"
            )
    return problems


def container_name_problems(pod_spec: Mapping[str, Any]) -> list[str]:
    """A regular container named as the injected sidecar: the injection would add a second container
    of that name, and container names are unique across the pod."""
    return [
        f"spec.containers[{i}]: the name {names.SIDECAR_CONTAINER} is the injected sidecar's (container "
        "names are unique across the pod); rename the container"
        for i, c in enumerate(pod_spec.get("containers") or [])
        if c.get("name") == names.SIDECAR_CONTAINER
    ]


def sidecar_in(pod_spec: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``strata-sidecar`` init container of a pod (or pod template) spec, if it has one."""
    for c in pod_spec.get("initContainers") or []:
        if c.get("name") == names.SIDECAR_CONTAINER:
            return dict(c)
    return None


def is_stand_in(container: Mapping[str, Any] | None) -> bool:
    """Whether ``container`` is the stand-in the workload webhook puts in a pod template."""
    return container is not None and any(
        e.get("name") == names.PLACEHOLDER_ENV for e in container.get("env") or []
    )


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


#: Kubeflow Trainer v2: a TrainJob's JobSet is built from the runtime it names (its
#: ``spec.runtimeRef``), whose JobSet template sits at ``spec.template.spec``.
TRAINER_API_GROUP = "trainer.kubeflow.org"
RUNTIME_KINDS = ("TrainingRuntime", "ClusterTrainingRuntime")


def workload_opted_in(obj: Mapping[str, Any]) -> bool:
    """Whether a Job's pod template, or one of a JobSet's, opts in."""
    return any(opted_in(template) for _, template in _templates(obj))


def _jobset_spec(obj: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """(field path, JobSet spec) of a JobSet, or of the JobSet template of a Kubeflow Trainer
    runtime; None for other kinds."""
    kind = obj.get("kind")
    spec = obj.get("spec") or {}
    if kind == "JobSet":
        return "spec", spec
    if kind in RUNTIME_KINDS:
        return "spec.template.spec", (spec.get("template") or {}).get("spec") or {}
    return None


def _templates(obj: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(where, pod template) of a Job, or of each replicated Job of a JobSet (or of a runtime's
    JobSet template)."""
    if obj.get("kind") == "Job":
        return [("spec.template", (obj.get("spec") or {}).get("template") or {})]
    found = _jobset_spec(obj)
    if found is None:
        return []
    prefix, spec = found
    out = []
    for i, rjob in enumerate(spec.get("replicatedJobs") or []):
        template = ((rjob.get("template") or {}).get("spec") or {}).get("template") or {}
        out.append((f"{prefix}.replicatedJobs[{i}] ({rjob.get('name', '?')})", template))
    return out


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
    jobset = _jobset_spec(obj)
    if jobset is not None:
        prefix, spec = jobset
        if (spec.get("network") or {}).get("enableDNSHostnames") is False:
            return [
                f"{where}: strata.dev/redundancy={mode} needs the pods' DNS names, but "
                f"{prefix}.network.enableDNSHostnames is false; the injected sidecars are refused"
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
    if old is not None and not _jobset_child(obj):
        problems += _stand_in_resource_changes(obj, old)
    if problems:
        return Verdict(False, f"Strata: {'; '.join(problems)}", warnings)
    return Verdict(True, "", warnings)


#: The annotations the sidecar's resources (and so its stand-in's) are computed from.
RESOURCE_ANNOTATIONS = (names.SIDECAR_CPU_ANNOTATION, names.SIDECAR_MEMORY_ANNOTATION)


def _stand_in_resource_changes(obj: Mapping[str, Any], old: Mapping[str, Any]) -> list[str]:
    """An UPDATE (a suspended Job's or JobSet's template annotations may change) of the sidecar's
    resources on a template that carries the stand-in: its containers cannot change, so quota keeps
    counting the stand-in's resources while the pods would get others."""
    before = dict(_templates(old))
    problems = []
    for where, template in _templates(obj):
        if sidecar_in(template.get("spec") or {}) is None:
            continue
        now = (template.get("metadata") or {}).get("annotations") or {}
        then = ((before.get(where) or {}).get("metadata") or {}).get("annotations") or {}
        for key in RESOURCE_ANNOTATIONS:
            if now.get(key) != then.get(key):
                problems.append(
                    f"{where}.metadata.annotations: {key} changed from {then.get(key)!r} to "
                    f"{now.get(key)!r}, but the pod template carries the sidecar's stand-in "
                    f"({names.SIDECAR_CONTAINER}) with the resources the workload was admitted with, and a "
                    f"template's containers cannot change: recreate the {obj.get('kind', 'workload')} "
                    "to change the sidecar's resources"
                )
    return problems


def _jobset_child(obj: Mapping[str, Any]) -> bool:
    """A Job a JobSet created (its replicated job's template): the JobSet was validated instead,
    and denying the Job would only leave the JobSet controller retrying it. Known by its controller
    reference to a JobSet (which the garbage collector keeps honest), never by a label anyone can
    set: a Job taken for a JobSet's gets no stand-in and no validation."""
    meta = obj.get("metadata") or {}
    return obj.get("kind") == "Job" and any(
        ref.get("kind") == "JobSet"
        and str(ref.get("apiVersion", "")).startswith(f"{names.JOBSET_API_GROUP}/")
        and ref.get("controller")
        for ref in meta.get("ownerReferences") or []
    )


#: The label that puts a workload under Kueue's quota.
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def kueue_queue(obj: Mapping[str, Any]) -> str | None:
    """The Kueue queue a workload names (the label, or the annotation older Kueue releases read)."""
    meta = obj.get("metadata") or {}
    queue = (meta.get("labels") or {}).get(KUEUE_QUEUE_LABEL) or (meta.get("annotations") or {}).get(
        KUEUE_QUEUE_LABEL
    )
    return str(queue) if queue else None


def quota_warnings(obj: Mapping[str, Any]) -> list[str]:
    """A Kueue-managed workload whose opted-in templates lack the sidecar (the workload webhook
    puts a stand-in there at creation, unless it was unreachable): Kueue's quota undercounts."""
    queue = kueue_queue(obj)
    if not queue or _jobset_child(obj):
        return []
    return [
        f"{where}: no {names.SIDECAR_CONTAINER} in the pod template of a workload in Kueue queue {queue}: "
        "its quota does not count the sidecar the pods get (the operator's workload webhook adds one at "
        "creation, and did not); recreate the workload, or leave room in the quota for the sidecar's requests"
        for where, template in _templates(obj)
        if opted_in(template)
        and not any(
            c.get("name") == names.SIDECAR_CONTAINER
            for c in (template.get("spec") or {}).get("initContainers") or []
        )
    ]


def _findings(obj: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a workload (see :func:`validate_workload`)."""
    if _jobset_child(obj):
        return [], []
    problems: list[str] = [
        f"{where}: the pod template carries the sidecar's stand-in ({names.SIDECAR_CONTAINER}, "
        f"{names.PLACEHOLDER_ENV}) but not the label {names.OPT_IN_LABEL}: {names.OPT_IN_VALUE}, so "
        "the operator's webhook never completes it and the pods run without checkpointing; keep the "
        f"label, or recreate the workload without the {names.SIDECAR_CONTAINER} init container"
        for where, t in _templates(obj)
        if not opted_in(t) and is_stand_in(sidecar_in(t.get("spec") or {}))
    ]
    templates = [(where, t) for where, t in _templates(obj) if opted_in(t)]
    if not templates:
        return problems, []
    kind = obj.get("kind")
    warnings: list[str] = []
    own = table.parse((obj.get("metadata") or {}).get("annotations"))
    problems += [f"metadata.annotations: {p}" for p in own.problems]
    for where, template in templates:
        annotations = (template.get("metadata") or {}).get("annotations")
        parsed = table.parse(annotations)
        problems += [f"{where}.metadata.annotations: {p}" for p in parsed.problems]
        problems += [f"{where}.metadata.annotations: {p}" for p in table.injection_problems(annotations)]
        if not parsed.errors:
            problems += [
                f"{where}.metadata.annotations: {p}"
                for p in port_problems(parsed.sidecar_env, template.get("spec") or {})
            ]
        problems += [f"{where}.{p}" for p in container_name_problems(template.get("spec") or {})]
        warnings += _redundancy_warnings(obj, where, template, parsed.sidecar_env)
        if kind == "Job":
            warnings += _job_warnings(obj.get("spec") or {}, template, parsed.job)
            continue
        if "strata.dev/max-restarts" in ((template.get("metadata") or {}).get("annotations") or {}):
            warnings.append(
                f"{where}: strata.dev/max-restarts has no effect on a JobSet; JobSet restarts the gang "
                "itself (spec.failurePolicy.maxRestarts) and Strata adds no second retry layer"
            )
    jobset = _jobset_spec(obj)
    if jobset is not None:
        warnings += _child_job_warnings(*jobset)
        problem = _restart_problem(obj, *jobset)
        if problem:
            problems.insert(0, problem)  # first: a TrainJob's Event shows only the start of it
    return problems, warnings


def _child_job_warnings(prefix: str, spec: Mapping[str, Any]) -> list[str]:
    """A JobSet's child Job retries a failed pod on its own (the kubelet, with OnFailure, JobSet's
    default; the Job controller, up to backoffLimit) into a gang that has moved on, before JobSet
    restarts the whole gang; with Never and backoffLimit 0 a failed pod fails its Job at once."""
    warnings = []
    for i, rjob in enumerate(spec.get("replicatedJobs") or []):
        job_spec = (rjob.get("template") or {}).get("spec") or {}
        template = job_spec.get("template") or {}
        if not opted_in(template):
            continue
        where = f"{prefix}.replicatedJobs[{i}] ({rjob.get('name', '?')}).template.spec"
        restart_policy = (template.get("spec") or {}).get("restartPolicy") or "OnFailure (JobSet's default)"
        if restart_policy != "Never":
            warnings.append(
                f"{where}.template.spec.restartPolicy is {restart_policy}: the kubelet restarts one "
                "rank's trainer alone, into a gang that has moved on; set restartPolicy: Never"
            )
        limit = job_spec.get("backoffLimit", 6)
        if limit != 0:
            warnings.append(
                f"{where}.backoffLimit is {limit}{'' if 'backoffLimit' in job_spec else ' (the default)'}: "
                "the Job controller replaces a failed pod alone, into a gang that has moved on, before "
                "JobSet restarts the whole gang; set backoffLimit: 0"
            )
    return warnings


def _trainjob_owner(obj: Mapping[str, Any]) -> str | None:
    """The name of the Kubeflow Trainer TrainJob that controls this JobSet, if one does."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        api_version = str(ref.get("apiVersion", ""))
        if ref.get("kind") == "TrainJob" and api_version.startswith(f"{TRAINER_API_GROUP}/"):
            return str(ref.get("name", "?"))
    return None


def _restart_problem(obj: Mapping[str, Any], prefix: str, spec: Mapping[str, Any]) -> str | None:
    """Why a JobSet (or a runtime's JobSet template) cannot carry Strata's gang, or None.

    Strata needs ``BlockingRecreate``: with ``Recreate`` (the default) JobSet starts the new gang
    while the old one still terminates, two generations side by side; with ``InPlaceRestart`` the
    pods, and so the generation, stay; without a failure policy the first failed Job fails the
    JobSet and the gang never restarts (Strata adds no retry layer to a JobSet)."""
    policy = spec.get("failurePolicy")
    strategy = (policy or {}).get("restartStrategy")
    if strategy == "BlockingRecreate":
        return None
    fix = f"{prefix}.failurePolicy: {{restartStrategy: BlockingRecreate, maxRestarts: <N>}}"
    if policy is None:
        why = (
            f"{prefix}.failurePolicy is unset: the first failed Job fails the JobSet and its gang never "
            "restarts from a checkpoint (Strata adds no retry layer to a JobSet)"
        )
    else:
        why = (
            f"{prefix}.failurePolicy.restartStrategy is {strategy or 'unset (Recreate)'}; Strata needs "
            "BlockingRecreate, so the old gang is gone before the new one starts"
        )
    owner = _trainjob_owner(obj) if obj.get("kind") == "JobSet" else None
    if owner is not None:
        # The trainer shows this denial only as an Event on the TrainJob, cut at 950 characters:
        # what to change comes first, and where (the runtime: runtimePatches cannot set it).
        return (
            f"TrainJob {owner}: set spec.template.{fix} in the ClusterTrainingRuntime or "
            f"TrainingRuntime its spec.runtimeRef names (a TrainJob's runtimePatches cannot set it); "
            f"the JobSet it builds is refused: {why}"
        )
    return f"{why}; set {fix}"
