"""The injection, pure functions over a Pod: what the mutating webhook adds to an opted-in pod
(label ``strata.dev/checkpoint: enabled`` on the pod template; labels on the Job's own metadata never
reach its pods).

For each opted-in pod outside the operator's own namespace it adds, as one JSON patch (RFC 6902):

- the gang scheduling gate, for Job-owned pods only (:func:`admission.mutate_pod`'s rule; JobSet
  recreates its gang itself);
- the sidecar ``strata-sidecar`` as a native sidecar (an initContainer with ``restartPolicy:
  Always``, Kubernetes 1.29+) running ``strata sidecar``, with a startup probe on its ``/metrics``
  port: the sidecar serves metrics only once its socket is published, and the kubelet starts the
  regular containers only after a native sidecar's startup probe passed;
- volumes: a memory-backed emptyDir for the shared-memory segments (``sizeLimit`` from
  :attr:`InjectConfig.shm_size`; the segments' pages are charged to the trainer, so its memory limit
  must cover two segments per rank), an emptyDir for the socket, a downward-API volume with the pod
  annotations ``strata.dev/generation`` and ``strata.dev/restore-request`` as files, a projected
  service-account token (audience :data:`names.REPORT_AUDIENCE`) and the operator's CA, and a
  scratch ``/tmp`` for the sidecar (its root filesystem is read-only);
- env for every regular container (``STRATA_JOB``, ``STRATA_NAMESPACE``, ``STRATA_RANK`` from the
  completion index, ``STRATA_SOCKET``; a variable the container already sets is left alone) and
  for the sidecar (the same, its settings from the pod's ``strata.dev/*`` annotations through the
  settings table, storage from :class:`InjectConfig`, and ``envFrom`` the Secret named by
  ``strata.dev/storage-secret``, into the sidecar only).

The sidecar's ports are the pod's ``strata.dev/metrics-port`` (default 9464) and, with
``strata.dev/redundancy`` (buddy or parity), ``strata.dev/peer-port`` (default
:data:`names.PEER_PORT`): checked distinct and free of the ports the pod's containers declare, and
declared on the sidecar (as hostPorts on a hostNetwork pod, where the sidecar binds them on the
node). Its resources (:func:`_resources`) are the chart's, with ``strata.dev/sidecar-cpu`` and
``strata.dev/sidecar-memory`` on top; where the pod is Guaranteed, limits equal requests, so the
sidecar keeps it Guaranteed; none where the pod sets pod-level resources.

:func:`template_patch` (the workload webhook, at a Job's or JobSet's creation) puts a stand-in
sidecar with those resources into the pod template, so quota that admits workloads by their
template (Kueue) counts it; :func:`inject` completes the stand-in in each pod, with the resources it
computes from the pod (the stand-in's, unless the template changed since: :func:`warnings` says so).

With ``strata.dev/redundancy`` the sidecar also gets its peer port
(container port ``strata-peer``, on 0.0.0.0) and every member's stable DNS
name: for an Indexed Job the template ``<job>-{index}.<subdomain>:<port>`` (the pod template's
``subdomain``: a Job's pods are named ``<job>-<index>`` as hostnames), for a JobSet the list of its
pods' hostnames ``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>`` in rank order. A pod
without a subdomain is denied (the validating webhook says so at the Job already).

With :attr:`InjectConfig.in_place_restart` (the operator's ``--in-place-restart``) the trainer
containers of Job pods with ``restartPolicy: Never`` get a container restart rule (Kubernetes 1.34+,
feature gate ContainerRestartRules): ``restartPolicy: Never`` plus ``restartPolicyRules: [{action:
Restart, exitCodes: {operator: NotIn, values: [0, 75, 76]}}]``. NotIn rather than In [77]: the trainer
that crashed (any code) must restart in place too, or its pod fails and the gang loses that pod's
memory; a launcher in the container (torchrun) exits with its own code when its workers exit 77.
0 is success, 75 and 76 keep their podFailurePolicy meaning (Ignore, FailJob). Where the API server
drops the fields (feature gate off) the pod runs as before and the operator falls back to new pods.
An API server before 1.34 refuses them instead: the operator's webhook then injects with the switch
off (:class:`~sidecar.operator.kube.ServerVersion`).

World size and rank: a pod carries no field with its workload's size, so the caller passes the
:class:`Shape` that :func:`workload_shape` reads from the Job or JobSet (the operator's watch cache,
else one GET). ``STRATA_WORLD_SIZE`` is the Job's completions, or the sum over a JobSet's replicated
jobs of replicas x completions; ``STRATA_RANK`` is the completion index (downward API) for a Job,
and for a JobSet the literal global rank: the ranks of the replicated jobs before this one, plus
the job index x completions, plus the completion index. A variable the template already sets wins.

Idempotent by construction: every piece is added only when missing (the sidecar container by
name, each volume, mount and env var by name, the gate by name), so a reinvocation, or a patched
pod fed back, yields an empty patch. An existing ``strata-sidecar`` is replaced where it is the
stand-in, or where its env (by the names the injection sets: what another webhook adds is kept) or
its resources differ from this pod's: one copied from another pod, whose job-derived values copied
along into the containers' env are replaced too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.api import EXIT_LIMIT_SPENT, EXIT_PEER_DIED, sizes
from sidecar.operator import admission, names
from sidecar.operator import annotations as table

__all__ = [
    "PODINFO_DIR",
    "SHM_DIR",
    "SIDECAR_CONTAINER",
    "SOCKET_PATH",
    "STORAGE_SECRET_ANNOTATION",
    "TOKEN_DIR",
    "Denied",
    "InjectConfig",
    "inject",
    "quantity",
    "warnings",
]

SIDECAR_CONTAINER = names.SIDECAR_CONTAINER
#: Pod annotation naming a Secret whose keys (AWS_ACCESS_KEY_ID, ...) become the sidecar's env.
STORAGE_SECRET_ANNOTATION = names.STORAGE_SECRET_ANNOTATION
#: Pod annotation overriding :attr:`InjectConfig.shm_size` (the shared-memory emptyDir's sizeLimit).
SHM_SIZE_ANNOTATION = names.SHM_SIZE_ANNOTATION
#: Pod-level annotations the injection reads itself (not sidecar settings).
POD_ANNOTATIONS = table.INJECTION_ANNOTATIONS

SHM_VOLUME, SHM_DIR = "strata-shm", "/var/run/strata/shm"
SOCKET_VOLUME, SOCKET_DIR = "strata-socket", "/var/run/strata/sock"
#: The sidecar creates the socket's own directory (mode 0755) inside the emptyDir.
SOCKET_PATH = f"{SOCKET_DIR}/s/sidecar.sock"
#: 0666 in a directory only this pod's containers mount: the trainer may run as another user.
SOCKET_MODE = "0o666"
PODINFO_VOLUME, PODINFO_DIR = "strata-podinfo", "/etc/strata/podinfo"
TOKEN_VOLUME, TOKEN_DIR = "strata-report-token", "/var/run/secrets/strata.dev/report"
TMP_VOLUME = "strata-tmp"
TOKEN_SECONDS = 3600
PEER_PORT, PEER_PORT_NAME = names.PEER_PORT, names.PEER_PORT_NAME
#: Trainer exits the in-place restart rule leaves alone: success, and the reserved "peer died" (75)
#: and "restart limit spent" (76), which keep their podFailurePolicy meaning.
NO_RESTART_EXIT_CODES = (0, EXIT_PEER_DIED, EXIT_LIMIT_SPENT)


def _default_resources() -> dict[str, Any]:
    return {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}


@dataclass(frozen=True)
class InjectConfig:
    """What every injected sidecar shares (the chart's values)."""

    #: The sidecar image (``strata`` on its PATH).
    image: str
    #: ``STRATA_STORAGE``: s3://bucket/prefix (or file:///path).
    storage_uri: str
    #: ``STRATA_S3_ENDPOINT`` (empty: AWS).
    storage_endpoint: str = ""
    #: ``STRATA_REPORT_URL``: the operator's report Service, https://...:8443 (empty: no reports).
    report_url: str = ""
    #: The CA bundle (PEM) sidecars verify the report endpoint with (empty: the system's CAs). Written
    #: into the pod's annotation :data:`names.REPORT_CA_ANNOTATION` and read from the downward-API
    #: volume: pods in any namespace get it with no per-namespace object to create.
    report_ca: str = ""
    #: ``sizeLimit`` of the shared-memory emptyDir.
    shm_size: str = "2Gi"
    #: The sidecar container's resources.
    resources: Mapping[str, Any] = field(default_factory=_default_resources)
    #: Pods in this namespace (the operator's own) are never injected.
    own_namespace: str = ""
    #: The sidecar's runAsUser (the image's non-root user); None leaves it out, for a platform that
    #: assigns one (OpenShift's restricted-v2 SCC refuses a fixed user outside the namespace's range).
    run_as_user: int | None = 65532
    image_pull_policy: str = "IfNotPresent"
    #: Add the in-place container restart rule to the trainer containers of Job pods.
    in_place_restart: bool = False
    #: The trainer container (None: every regular container is a trainer).
    trainer_container: str | None = None


class Denied(ValueError):
    """The pod must not be admitted; the message names the annotation and what it accepts."""


def _job_name(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(names.JOBSET_NAME_LABEL):
        return str(labels[names.JOBSET_NAME_LABEL])
    if labels.get(names.JOB_NAME_LABEL):
        return str(labels[names.JOB_NAME_LABEL])
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("name"):
            return str(ref["name"])
    return str(meta.get("name") or meta.get("generateName", "").rstrip("-") or "pod")


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


@dataclass(frozen=True)
class Shape:
    """What a pod's workload says of its ranks: the world size, and the pod's global rank when the
    completion index alone is not it (a JobSet's pods); None where unknown."""

    world_size: int | None = None
    rank: int | None = None
    #: A JobSet's pod hostnames in rank order (for peer redundancy); empty for a Job. Derived from
    #: the workload's shape, so not compared.
    hosts: tuple[str, ...] = field(default=(), compare=False)


def _count(spec: Mapping[str, Any]) -> int:
    return int(spec.get("completions") or spec.get("parallelism") or 1)


def _label_int(labels: Mapping[str, Any], key: str) -> int | None:
    value = labels.get(key)
    return int(value) if isinstance(value, str) and value.isdigit() else None


def workload_shape(workload: Mapping[str, Any] | None, pod: Mapping[str, Any]) -> Shape:
    """The :class:`Shape` of ``pod`` in ``workload`` (its Job or JobSet; None: unknown)."""
    if not isinstance(workload, Mapping):
        return Shape()
    spec = workload.get("spec") or {}
    if workload.get("kind") != "JobSet":
        return Shape(world_size=_count(spec))
    labels = (pod.get("metadata") or {}).get("labels") or {}
    total, offset, rank = 0, None, None
    name = str((workload.get("metadata") or {}).get("name", ""))
    hosts: list[str] = []
    for rj in spec.get("replicatedJobs") or []:
        per_job = _count(((rj.get("template") or {}).get("spec")) or {})
        hosts += [
            f"{name}-{rj.get('name')}-{j}-{c}"
            for j in range(int(rj.get("replicas", 1)))
            for c in range(per_job)
        ]
        if rj.get("name") == labels.get(names.JOBSET_REPLICATED_JOB_LABEL):
            offset = total
            job_index = _label_int(labels, names.JOBSET_JOB_INDEX_LABEL)
            completion = _label_int(labels, names.JOB_INDEX_LABEL)
            if job_index is not None and completion is not None:
                rank = offset + job_index * per_job + completion
        total += int(rj.get("replicas", 1)) * per_job
    return Shape(world_size=total or None, rank=rank, hosts=tuple(hosts))


def _common_env(pod: Mapping[str, Any], shape: Shape) -> list[dict[str, Any]]:
    rank = (
        {"name": "STRATA_RANK", "value": str(shape.rank)}
        if shape.rank is not None
        else _field_env("STRATA_RANK", f"metadata.labels['{names.JOB_INDEX_LABEL}']")
    )
    env = [
        {"name": "STRATA_JOB", "value": _job_name(pod)},
        _field_env("STRATA_NAMESPACE", "metadata.namespace"),
        rank,
        {"name": "STRATA_SOCKET", "value": SOCKET_PATH},
    ]
    if shape.world_size is not None:
        env.append({"name": "STRATA_WORLD_SIZE", "value": str(shape.world_size)})
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if labels.get(names.JOBSET_NAME_LABEL):
        # JobSet recreates the gang itself, so the generation is the JobSet's uid (the operator's run
        # id for it) and its restart attempt, from labels JobSet puts on every pod; the kubelet
        # expands $(VAR) from the variables defined before it.
        env += [
            _field_env("STRATA_JOBSET_UID", f"metadata.labels['{names.JOBSET_UID_LABEL}']"),
            _field_env("STRATA_JOBSET_RESTART", f"metadata.labels['{names.JOBSET_RESTART_LABEL}']"),
            {"name": "STRATA_GENERATION", "value": "$(STRATA_JOBSET_UID)/$(STRATA_JOBSET_RESTART)"},
        ]
    return env


#: On a hostNetwork pod (RDMA, EFA) the sidecar binds in the node's network namespace. Unless the
#: job chooses its ports (strata.dev/metrics-port, strata.dev/peer-port), each job gets its own pair
#: from HOST_PORT_BASE on (by a hash of its namespace and name): the sidecars of two jobs sharing a
#: node do not take the same ports by default, nor 9464, where a node's OpenTelemetry exporter
#: listens. Declared as hostPorts (see _ports), two pods of one job stay on separate nodes. The range
#: ends below torchrun's rendezvous and master ports (29400, 29500) and the kernel's ephemeral
#: ports (32768 up), which a hostNetwork trainer binds or connects from without declaring them.
HOST_PORT_BASE, HOST_PORT_PAIRS = 21000, 4000


def _host_ports(
    pod: Mapping[str, Any], namespace: str, env: Mapping[str, str], ports: tuple[int, int | None]
) -> tuple[int, int | None]:
    """``ports``, or on a hostNetwork pod that chose none, the job's own pair (skipping pairs a
    container of the pod declares)."""
    spec = pod.get("spec") or {}
    if not spec.get("hostNetwork") or "STRATA_METRICS_PORT" in env or "STRATA_PEER_PORT" in env:
        return ports
    taken = {
        number
        for c in (spec.get("containers") or []) + (spec.get("initContainers") or [])
        if c.get("name") != SIDECAR_CONTAINER
        for p in c.get("ports") or []
        for number in (p.get("containerPort"), p.get("hostPort"))
        if isinstance(number, int)
    }
    digest = hashlib.sha256(f"{namespace}/{_job_name(pod)}".encode()).digest()
    pair = int.from_bytes(digest[:4], "big") % HOST_PORT_PAIRS
    for step in range(HOST_PORT_PAIRS):
        metrics = HOST_PORT_BASE + 2 * ((pair + step) % HOST_PORT_PAIRS)
        if metrics not in taken and metrics + 1 not in taken:
            return metrics, None if ports[1] is None else metrics + 1
    return ports  # every pair taken: port_problems named the defaults' clash already


def _check(parsed: table.Parsed, raw: Mapping[str, str], pod: Mapping[str, Any]) -> tuple[int, int | None]:
    """Deny bad annotations; returns the metrics (and startup probe) port and the peer port (None
    without redundancy)."""
    problems = list(parsed.problems)
    if not parsed.errors:
        problems += admission.port_problems(parsed.sidecar_env, pod.get("spec") or {})
    shm = parsed.sidecar_env.get("STRATA_SHM_DIR")
    if shm is not None and shm not in ("", SHM_DIR):
        problems.append(
            f"strata.dev/shm-dir={shm!r}: expected {SHM_DIR} (the injected shared-memory volume) or "
            "empty (chunked gRPC saves only)"
        )
    problems += table.injection_problems(raw)
    if problems:
        raise Denied(f"Strata: metadata.annotations: {'; '.join(problems)}")
    return admission.sidecar_ports(parsed.sidecar_env)


def _members(pod: Mapping[str, Any], shape: Shape, port: int) -> tuple[str, int] | None:
    """STRATA_MEMBERS and STRATA_MEMBER_COUNT from the pods' stable DNS names and the peer
    ``port``, or None when the pod has none (no subdomain) or its workload is unknown."""
    subdomain = (pod.get("spec") or {}).get("subdomain")
    if not subdomain:
        return None
    if shape.hosts:
        return ",".join(f"{h}.{subdomain}:{port}" for h in shape.hosts), len(shape.hosts)
    job = ((pod.get("metadata") or {}).get("labels") or {}).get(names.JOB_NAME_LABEL)
    if not job or shape.world_size is None:
        return None
    return f"{job}-{{index}}.{subdomain}:{port}", shape.world_size


def _redundancy(parsed: table.Parsed) -> str:
    return parsed.sidecar_env.get("STRATA_REDUNDANCY", "off")


def _sidecar(
    pod: Mapping[str, Any],
    config: InjectConfig,
    parsed: table.Parsed,
    ports: tuple[int, int | None],
    shape: Shape,
    members: tuple[str, int] | None = None,
) -> dict[str, Any]:
    port, peer_port = ports
    env = _common_env(pod, shape)
    env.append({"name": "STRATA_STORAGE", "value": config.storage_uri})
    if config.storage_endpoint:
        env.append({"name": "STRATA_S3_ENDPOINT", "value": config.storage_endpoint})
    env += [
        {"name": "STRATA_SOCKET_MODE", "value": SOCKET_MODE},
        {"name": "STRATA_SHM_DIR", "value": SHM_DIR},
        {"name": "STRATA_METRICS_PORT", "value": str(port)},
        {"name": "STRATA_RESTORE_REQUEST_FILE", "value": f"{PODINFO_DIR}/restore-request"},
        {"name": "STRATA_REPORT_TOKEN_FILE", "value": f"{TOKEN_DIR}/token"},
    ]
    if _is_job_owned(pod):
        # The operator writes the generation on gated pods before it lifts the gate.
        env.append({"name": "STRATA_GENERATION_FILE", "value": f"{PODINFO_DIR}/generation"})
    if config.report_url:
        env.append({"name": "STRATA_REPORT_URL", "value": config.report_url})
    if config.report_ca:
        env.append({"name": "STRATA_REPORT_CA_FILE", "value": f"{PODINFO_DIR}/report-ca"})
    if members is not None:
        env += [
            {"name": "STRATA_PEER_PORT", "value": str(peer_port)},
            {"name": "STRATA_PEER_HOST", "value": "0.0.0.0"},
            {"name": "STRATA_MEMBERS", "value": members[0]},
            {"name": "STRATA_MEMBER_COUNT", "value": str(members[1])},
        ]
    fixed = {e["name"] for e in env}
    env += [{"name": k, "value": v} for k, v in sorted(parsed.sidecar_env.items()) if k not in fixed]
    if parsed.sidecar_env.get("STRATA_SHM_DIR") == "":
        env = [e if e["name"] != "STRATA_SHM_DIR" else {"name": "STRATA_SHM_DIR", "value": ""} for e in env]
    mounts = [
        {"name": SHM_VOLUME, "mountPath": SHM_DIR},
        {"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR},
        {"name": PODINFO_VOLUME, "mountPath": PODINFO_DIR, "readOnly": True},
        {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
        {"name": TMP_VOLUME, "mountPath": "/tmp"},
    ]
    container: dict[str, Any] = {
        "name": SIDECAR_CONTAINER,
        "image": config.image,
        "imagePullPolicy": config.image_pull_policy,
        "restartPolicy": "Always",
        "command": ["strata", "sidecar"],
        "env": env,
        "ports": _ports(pod, port, peer_port if members else None),
        "startupProbe": {
            "httpGet": {"path": "/metrics", "port": port},
            "periodSeconds": 1,
            "timeoutSeconds": 2,
            "failureThreshold": 120,
        },
        "resources": _resources(config, ((pod.get("metadata") or {}).get("annotations")) or {}, pod),
        "securityContext": _security_context(config),
        "volumeMounts": mounts,
    }
    if config.run_as_user is None:
        # The image's working directory belongs to its user (0700); an assigned one could not enter it.
        container["workingDir"] = "/tmp"
    secret = ((pod.get("metadata") or {}).get("annotations") or {}).get(STORAGE_SECRET_ANNOTATION)
    if secret:
        container["envFrom"] = [{"secretRef": {"name": secret}}]
    return container


def _ports(pod: Mapping[str, Any], port: int, peer_port: int | None) -> list[dict[str, Any]]:
    """The sidecar's declared ports. On a hostNetwork pod (RDMA, EFA) the sidecar binds them on the
    node, so they are declared as hostPorts: the scheduler then keeps two pods with the same ports
    (two ranks of one job) off one node, where the second sidecar could not bind and its startup
    probe would pass against the first's. Jobs that should share a node choose other ports
    (strata.dev/metrics-port, strata.dev/peer-port)."""
    host = bool((pod.get("spec") or {}).get("hostNetwork"))
    out = []
    for name, number in (("strata-metrics", port), (PEER_PORT_NAME, peer_port)):
        if number is not None:
            out.append(
                {
                    "name": name,
                    "containerPort": number,
                    **({"hostPort": number} if host else {}),
                    "protocol": "TCP",
                }
            )
    return out


def workload_problems(workload: Mapping[str, Any], config: InjectConfig) -> list[str]:
    """What the pod webhook would deny in every pod of ``workload`` for the operator's settings
    (the validating webhook says it at the workload's creation, before the Job controller loops on
    FailedCreate)."""
    out = []
    for where, template in admission._templates(workload):
        if not admission.opted_in(template) or admission._jobset_child(workload):
            continue
        try:
            _check_user(template, config)
        except Denied as exc:
            out.append(f"{where}: {str(exc).removeprefix('Strata: ')}")
    return out


def _check_user(pod: Mapping[str, Any], config: InjectConfig) -> None:
    """Deny a pod whose sidecar would run as root beside its runAsNonRoot: true (the kubelet refuses
    to start it, and as a native sidecar it holds back every regular container): with no sidecar
    user of the operator's own, it inherits the pod's."""
    user = ((pod.get("spec") or {}).get("securityContext") or {}).get("runAsUser")
    if config.run_as_user is None and user == 0:
        raise Denied(
            "Strata: spec.securityContext.runAsUser is 0 and the operator sets no user for the sidecar "
            "(--sidecar-user none), so the sidecar would run as root beside its runAsNonRoot: true, which "
            "the kubelet refuses to start; set runAsUser: 0 on the trainer container instead of the pod, "
            "or give the operator a non-root --sidecar-user"
        )


def _stale(existing: Mapping[str, Any], sidecar: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The env entries of an ``existing`` complete sidecar that differ from this pod's ``sidecar``
    (by name: what another webhook adds is kept), as they were; {} for a stand-in."""
    if admission.is_stand_in(existing):
        return {}
    have = {e.get("name"): e for e in existing.get("env") or []}
    return {
        e["name"]: dict(have[e["name"]]) for e in sidecar["env"] if e["name"] in have and have[e["name"]] != e
    } | {e["name"]: {} for e in sidecar["env"] if e["name"] not in have}


def _is_job_owned(pod: Mapping[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return admission._job_owner(pod) is not None and names.JOBSET_NAME_LABEL not in labels


def _guaranteed(pod: Mapping[str, Any]) -> bool:
    """Whether the kubelet would class ``pod`` (without the sidecar) Guaranteed: every container,
    init containers and native sidecars included, has cpu and memory limits, and the requests
    equal them (a missing request defaults to its limit). Pod-level resources (spec.resources)
    decide the class alone where set, and the sidecar's own cannot change it: False there."""
    spec = pod.get("spec") or {}
    if _pod_level(spec):
        return False
    containers = _others(spec)
    if not containers:
        return False
    for c in containers:
        resources = c.get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        for name in ("cpu", "memory"):
            try:
                limit = quantity(limits[name]) if name in limits else 0.0
                request = quantity(requests[name]) if name in requests else limit
            except ValueError:
                return False
            if limit <= 0 or request != limit:
                return False
    return True


def _pod_level(spec: Mapping[str, Any]) -> bool:
    """Whether the pod sets pod-level resources (spec.resources, PodLevelResources)."""
    resources = spec.get("resources") or {}
    return bool(resources.get("requests") or resources.get("limits"))


def _others(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The pod's containers but the sidecar: init containers (native sidecars too) and regular ones."""
    return [
        c
        for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
        if c.get("name") != SIDECAR_CONTAINER
    ]


def _resources(config: InjectConfig, raw: Mapping[str, str], pod: Mapping[str, Any]) -> dict[str, Any]:
    """The sidecar's resources in ``pod`` (or a pod template): the chart's, with the pod's
    annotations on top.

    - Pod-level resources (spec.resources): none of its own. The pod's are the budget of all its
      containers, the sidecar's share included: requests of its own on top would exceed them (the
      API server refuses the pod), and quota counts the pod's.
    - A Guaranteed pod: limits equal requests for cpu and memory, so the sidecar keeps it
      Guaranteed (a Burstable pod loses the CPU manager's exclusive cores and topology alignment);
      there the annotation's value is both.
    - Else a limit the chart sets wins over the request (the memory request rises to the cap the
      sidecar runs under), and where every other container sets a limit of a resource (a
      namespace whose ResourceQuota tracks limits.cpu refuses a container without one), the
      sidecar's limit is its request."""
    spec = pod.get("spec") or {}
    if _pod_level(spec):
        return {}
    guaranteed = _guaranteed(pod)
    out = {k: dict(v) for k, v in config.resources.items()}
    requests, limits = out.setdefault("requests", {}), out.setdefault("limits", {})
    memory = raw.get(names.SIDECAR_MEMORY_ANNOTATION)
    if memory:
        requests["memory"] = limits["memory"] = memory
    cpu = raw.get(names.SIDECAR_CPU_ANNOTATION)
    if cpu:
        requests["cpu"] = cpu
        if "cpu" in limits and _below(limits["cpu"], cpu):
            limits["cpu"] = cpu  # a request above its limit is an invalid pod
        if guaranteed:
            limits["cpu"] = cpu
    fallback = _default_resources()["requests"]
    others = _others(spec)
    for name in ("cpu", "memory"):
        if guaranteed:
            requests[name] = limits[name] = limits.get(name) or requests.get(name) or fallback[name]
        elif (
            name not in limits
            and others
            and all(name in (((c.get("resources") or {}).get("limits")) or {}) for c in others)
        ):
            limits[name] = requests.get(name) or fallback[name]
            requests.setdefault(name, limits[name])
    return {k: v for k, v in out.items() if v}


def _below(a: str, b: str) -> bool:
    try:
        return quantity(a) < quantity(b)
    except ValueError:
        return False


def _shm_size(raw: Mapping[str, str], config: InjectConfig) -> str:
    return str(raw.get(SHM_SIZE_ANNOTATION) or config.shm_size)


def _volumes(config: InjectConfig, shm_size: str) -> list[dict[str, Any]]:
    sources: list[dict[str, Any]] = [
        {
            "serviceAccountToken": {
                "audience": names.REPORT_AUDIENCE,
                "expirationSeconds": TOKEN_SECONDS,
                "path": "token",
            }
        }
    ]
    volumes: list[dict[str, Any]] = [
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
        {"name": SOCKET_VOLUME, "emptyDir": {}},
        {
            "name": PODINFO_VOLUME,
            "downwardAPI": {
                "items": [
                    {
                        "path": "generation",
                        "fieldRef": {"fieldPath": f"metadata.annotations['{names.GENERATION_ANNOTATION}']"},
                    },
                    {
                        "path": "restore-request",
                        "fieldRef": {
                            "fieldPath": f"metadata.annotations['{names.RESTORE_REQUEST_ANNOTATION}']"
                        },
                    },
                    *(
                        [
                            {
                                "path": "report-ca",
                                "fieldRef": {
                                    "fieldPath": f"metadata.annotations['{names.REPORT_CA_ANNOTATION}']"
                                },
                            }
                        ]
                        if config.report_ca
                        else []
                    ),
                ]
            },
        },
        {"name": TOKEN_VOLUME, "projected": {"sources": sources}},
        {"name": TMP_VOLUME, "emptyDir": {}},
    ]
    return volumes


#: Marks the stand-in sidecar :func:`template_patch` puts in a workload's pod template.
PLACEHOLDER_ENV = names.PLACEHOLDER_ENV


def _security_context(config: InjectConfig) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        **({} if config.run_as_user is None else {"runAsUser": config.run_as_user}),
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _stand_in(template: Mapping[str, Any], config: InjectConfig) -> dict[str, Any]:
    raw = ((template.get("metadata") or {}).get("annotations")) or {}
    return {
        "name": SIDECAR_CONTAINER,
        "image": config.image,
        "imagePullPolicy": config.image_pull_policy,
        "restartPolicy": "Always",
        "command": ["strata", "sidecar"],
        "env": [
            {
                "name": PLACEHOLDER_ENV,
                "value": "the operator's webhook completes this container in each pod",
            }
        ],
        "resources": _resources(config, raw, template),
        "securityContext": _security_context(config),
    }


def template_patch(
    workload: Mapping[str, Any], *, namespace: str, config: InjectConfig
) -> list[dict[str, Any]]:
    """The JSON patch that puts a stand-in for the sidecar, with its resources, into each opted-in
    pod template of a Kueue-managed Job or JobSet (``kueue.x-k8s.io/queue-name``) at its creation,
    so that Kueue's quota, which admits workloads by their pod template, counts the sidecar the pods
    get;
    :func:`inject` completes it in each pod. [] for a JobSet's own Jobs (their template is the
    JobSet's) and templates with bad annotations (the validating webhook denies them).

    A template that has a ``strata-sidecar`` already (``kubectl get job -o yaml`` edited and created
    again, a CronJob's jobTemplate) is brought up to date: a stand-in is recomputed from the
    template's annotations and containers as they are now, and a complete sidecar copied from a pod
    gets the resources the pods will get (the pod webhook refreshes the rest of it)."""
    if (config.own_namespace and namespace == config.own_namespace) or admission._jobset_child(workload):
        return []
    if not admission.kueue_queue(workload):
        # Only Kueue admits by the template; elsewhere a template that differs from the manifest
        # is drift to GitOps tools, and a server-side re-apply would try to remove the stand-in
        # from a template that is immutable.
        return []
    spec = workload.get("spec") or {}
    if workload.get("kind") == "Job":
        where = [("/spec/template/spec", spec.get("template") or {})]
    elif workload.get("kind") == "JobSet":
        where = [
            (
                f"/spec/replicatedJobs/{i}/template/spec/template/spec",
                ((rj.get("template") or {}).get("spec") or {}).get("template") or {},
            )
            for i, rj in enumerate(spec.get("replicatedJobs") or [])
        ]
    else:
        return []
    ops: list[dict[str, Any]] = []
    for path, template in where:
        raw = ((template.get("metadata") or {}).get("annotations")) or {}
        pod_spec = template.get("spec") or {}
        if (
            not admission.opted_in(template)
            or table.parse(raw).problems
            or table.injection_problems(raw)
            or admission.container_name_problems(pod_spec)
        ):
            continue
        stand_in = _stand_in(template, config)
        inits = pod_spec.get("initContainers") or []
        at = next((i for i, c in enumerate(inits) if c.get("name") == SIDECAR_CONTAINER), None)
        if at is None and inits:
            ops.append({"op": "add", "path": f"{path}/initContainers/0", "value": stand_in})
        elif at is None:
            ops.append({"op": "add", "path": f"{path}/initContainers", "value": [stand_in]})
        elif admission.is_stand_in(inits[at]):
            if inits[at] != stand_in:
                ops.append({"op": "replace", "path": f"{path}/initContainers/{at}", "value": stand_in})
        elif (inits[at].get("resources") or {}) != stand_in["resources"]:
            ops.append(
                {"op": "add", "path": f"{path}/initContainers/{at}/resources", "value": stand_in["resources"]}
            )
    return ops


def restart_rule() -> dict[str, Any]:
    """The trainer's container restart rule for in-place gang restarts (see the module docstring)."""
    return {
        "action": "Restart",
        "exitCodes": {"operator": "NotIn", "values": list(NO_RESTART_EXIT_CODES)},
    }


quantity = table.quantity


def warnings(pod: Mapping[str, Any], *, namespace: str, config: InjectConfig) -> list[str]:
    """Admission warnings for a pod :func:`inject` accepts: a container whose memory limit leaves
    no room for the shared-memory segments, whose pages are charged to the trainer that writes them."""
    if not admission.opted_in(pod) or (config.own_namespace and namespace == config.own_namespace):
        return []
    size = _shm_size(((pod.get("metadata") or {}).get("annotations")) or {}, config)
    try:
        shm = quantity(size)
    except ValueError:
        return []
    out = _redundancy_warnings(pod, config, shm, size) + _sidecar_warnings(pod, config)
    for container in (pod.get("spec") or {}).get("containers") or []:
        limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
        try:
            tight = limit is not None and quantity(limit) <= shm
        except ValueError:
            continue
        if tight:
            out.append(
                f"container {container.get('name')}: memory limit {limit} is not above the shared-memory "
                f"volume's {size}; the segments (two per rank: the committed snapshot and one "
                "in flight) are charged to the trainer, so its limit must cover them on top of its "
                "working set"
            )
    return out


def _sidecar_warnings(pod: Mapping[str, Any], config: InjectConfig) -> list[str]:
    """What the pod's own ``strata-sidecar`` (a stand-in, or one copied from another pod) said that
    the injection replaced, and the sidecar's share of pod-level resources."""
    spec = pod.get("spec") or {}
    raw = ((pod.get("metadata") or {}).get("annotations")) or {}
    out = []
    existing = admission.sidecar_in(spec)
    resources = _resources(config, raw, pod)
    # requests only: what quota counts (a LimitRange defaults the pods' limits, not the template's)
    counted = ((existing or {}).get("resources") or {}).get("requests") or {}
    if admission.is_stand_in(existing) and counted != (resources.get("requests") or {}):
        out.append(
            f"the sidecar's stand-in in the pod template requests {counted}, this pod's annotations and "
            f"containers give {resources.get('requests') or {}}: the sidecar gets the latter, while "
            "quota that admits workloads by their template (Kueue) counted the former; recreate the "
            "workload to bring its template in step"
        )
    elif existing is not None and not admission.is_stand_in(existing):
        job = {e.get("name"): e.get("value") for e in existing.get("env") or []}.get("STRATA_JOB")
        if job is not None and job != _job_name(pod):
            out.append(
                f"the pod carries a {SIDECAR_CONTAINER} copied from another pod (STRATA_JOB={job}): "
                f"replaced by this pod's (STRATA_JOB={_job_name(pod)}), with the values copied along into "
                "its containers' env"
            )
    if _pod_level(spec):
        set_here = [a for a in admission.RESOURCE_ANNOTATIONS if a in raw]
        out.append(
            "spec.resources (pod-level resources) is set: the sidecar gets no resources of its own and "
            f"shares the pod's; leave room in them for it (the chart's sidecar.resources: "
            f"{dict(config.resources)})" + (f"; {', '.join(set_here)} has no effect here" if set_here else "")
        )
    return out


def _redundancy_warnings(pod: Mapping[str, Any], config: InjectConfig, shm: float, size: str) -> list[str]:
    """The copy (buddy) or parity (parity) a sidecar holds for other pods lives in the
    shared-memory volume, and the sidecar creates its pages: it counts in the volume's sizeLimit
    and in the sidecar's memory. The sizing rule: volume = 2 x snapshot x ranks of the pod + held,
    held = 2 snapshots (buddy) or 2 x snapshot / (parity group - 1) (parity): a new copy is built
    beside the complete one, which it replaces only once complete; the sidecar's budget (0.75 of its
    memory limit unless strata.dev/memory-budget says) must cover held plus its own work."""
    raw = ((pod.get("metadata") or {}).get("annotations")) or {}
    parsed = table.parse(raw)
    mode = _redundancy(parsed)
    if mode == "off":
        return []
    try:
        group = int(parsed.sidecar_env.get("STRATA_PARITY_GROUP", "4"), 0)
    except ValueError:
        return []
    share = 2.0 if mode == "buddy" else 2.0 / max(1, group - 1)
    held = shm * share / (2 + share)  # a volume sized by the rule, one rank per pod
    limit = ((_resources(config, raw, pod).get("limits") or {}).get("memory")) or ""
    try:
        budget = quantity(limit) * 0.75 if limit else 0.0
        if parsed.sidecar_env.get("STRATA_MEMORY_BUDGET"):
            budget = float(sizes.parse_size(parsed.sidecar_env["STRATA_MEMORY_BUDGET"]))
    except ValueError:
        return []
    if limit and budget > held:
        return []
    what = (
        "two copies of a member's snapshot (the complete one, and the next being built)"
        if mode == "buddy"
        else f"2/{group - 1} of a snapshot of parity (the complete one, and the next being built)"
    )
    return [
        f"strata.dev/redundancy={mode}: the sidecar holds {what} for another pod in the shared-memory "
        f"volume, and those pages count in the sidecar's memory; with the volume's {size} sized by "
        f"the rule, it is about {held / 2**30:.2f} GiB, more than the sidecar's budget "
        f"({'no memory limit' if not limit else f'0.75 x its limit {limit}'}): raise "
        f"{names.SIDECAR_MEMORY_ANNOTATION} (docs/guides/memory.md)"
    ]


class _Patch:
    """JSON patch ops that add list items, creating a missing list first; applied to a copy as they
    are made, so later ops see earlier ones."""

    def __init__(self) -> None:
        self.ops: list[dict[str, Any]] = []

    def append(self, parent: dict[str, Any], key: str, path: str, item: Any) -> None:
        if parent.get(key) is None:
            self.ops.append({"op": "add", "path": f"{path}/{key}", "value": [item]})
            parent[key] = [item]
        else:
            self.ops.append({"op": "add", "path": f"{path}/{key}/-", "value": item})
            parent[key].append(item)


def _lists(obj: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    """Copies of the lists ``obj`` holds under ``keys`` (None where it has none), to patch along."""
    return {key: None if obj.get(key) is None else list(obj[key]) for key in keys}


def inject(
    pod: Mapping[str, Any],
    *,
    namespace: str,
    config: InjectConfig,
    shape: Shape | None = None,
) -> list[dict[str, Any]]:
    """The JSON patch that injects Strata into ``pod`` (created in ``namespace``), or [] when it is
    not opted in, is in the operator's own namespace, or has everything already.

    Raises :class:`Denied` for bad ``strata.dev/*`` annotations, naming each and what it accepts.
    """
    looked_up = shape is not None
    shape = shape or Shape()
    if not admission.opted_in(pod) or (config.own_namespace and namespace == config.own_namespace):
        return []
    raw = ((pod.get("metadata") or {}).get("annotations")) or {}
    parsed = table.parse(raw)
    ports = _host_ports(pod, namespace, parsed.sidecar_env, _check(parsed, raw, pod))
    problems = admission.container_name_problems(pod.get("spec") or {})
    if problems:
        raise Denied(f"Strata: {'; '.join(problems)}")
    _check_user(pod, config)
    jobset = ((pod.get("metadata") or {}).get("labels") or {}).get(names.JOBSET_NAME_LABEL)
    if jobset and looked_up and shape.rank is None:
        # The completion index is the rank within the pod's own child Job, which every replica of
        # a replicated job repeats: refused rather than admitted with a rank that collides.
        raise Denied(
            f"Strata: the pod's global rank in JobSet {jobset} cannot be computed (the JobSet is not in "
            "the operator's watch cache and looking it up failed or timed out, or none of its replicated "
            "jobs is this pod's); the Job controller creates the pod again"
        )
    members = None
    if ports[1] is not None:
        members = _members(pod, shape, ports[1])
        if members is None:
            raise Denied(
                f"Strata: strata.dev/redundancy={_redundancy(parsed)} needs the pods' stable DNS names: an "
                "Indexed Job's pod template needs spec.subdomain (and a headless Service of that name), a "
                "JobSet spec.network.enableDNSHostnames (its default)"
            )
    ops = admission.mutate_pod(pod)
    spec = _lists(pod.get("spec") or {}, "initContainers", "volumes")
    patch = _Patch()
    have = {c.get("name"): i for i, c in enumerate(spec["initContainers"] or [])}
    at = have.get(SIDECAR_CONTAINER)
    sidecar = _sidecar(pod, config, parsed, ports, shape, members)
    #: Values a complete sidecar copied from another pod carried, which this pod's differ from.
    copied: dict[str, dict[str, Any]] = {}
    if at is None:
        # First among the init containers: the kubelet starts them in order, so any later init
        # container (and every regular one) can use the sidecar.
        if spec["initContainers"]:
            patch.ops.append({"op": "add", "path": "/spec/initContainers/0", "value": sidecar})
            spec["initContainers"].insert(0, sidecar)
        else:
            patch.append(spec, "initContainers", "/spec", sidecar)
    else:
        existing = spec["initContainers"][at]
        copied = _stale(existing, sidecar)
        if admission.is_stand_in(existing) or copied or existing.get("resources") != sidecar["resources"]:
            # The workload webhook's stand-in (see template_patch), or a sidecar copied from another
            # pod (``kubectl get pod -o yaml`` into a new workload): this pod's, its resources as the
            # pod's annotations and containers say now (:func:`warnings` says where they differ).
            patch.ops.append({"op": "replace", "path": f"/spec/initContainers/{at}", "value": sidecar})
            spec["initContainers"][at] = sidecar
    have_volumes = {v.get("name") for v in spec["volumes"] or []}
    for volume in _volumes(config, _shm_size(raw, config)):
        if volume["name"] not in have_volumes:
            patch.append(spec, "volumes", "/spec", volume)
    trainer_mounts = [
        {"name": SHM_VOLUME, "mountPath": SHM_DIR},
        {"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR},
    ]
    in_place = (
        config.in_place_restart
        and _is_job_owned(pod)
        and (pod.get("spec") or {}).get("restartPolicy") == "Never"
    )
    for i, original in enumerate((pod.get("spec") or {}).get("containers") or []):
        container = _lists(original, "env", "volumeMounts")
        path = f"/spec/containers/{i}"
        trainer = config.trainer_container is None or original.get("name") == config.trainer_container
        if in_place and trainer and "restartPolicy" not in original and "restartPolicyRules" not in original:
            patch.ops += [
                {"op": "add", "path": f"{path}/restartPolicy", "value": "Never"},
                {"op": "add", "path": f"{path}/restartPolicyRules", "value": [restart_rule()]},
            ]
        set_env = {e.get("name"): j for j, e in enumerate(container["env"] or [])}
        for var in _common_env(pod, shape):
            j = set_env.get(var["name"])
            if j is None:
                patch.append(container, "env", path, var)
            elif container["env"][j] == copied.get(var["name"]):
                # copied along with the sidecar from another pod: this pod's value
                patch.ops.append({"op": "replace", "path": f"{path}/env/{j}", "value": var})
        mounted = {m.get("name") for m in container["volumeMounts"] or []}
        paths = {m.get("mountPath") for m in container["volumeMounts"] or []}
        for mount in trainer_mounts:
            if mount["name"] not in mounted and mount["mountPath"] not in paths:
                patch.append(container, "volumeMounts", path, mount)
    if config.report_ca and raw.get(names.REPORT_CA_ANNOTATION) != config.report_ca:
        if not ((pod.get("metadata") or {}).get("annotations")):
            patch.ops.append(
                {
                    "op": "add",
                    "path": "/metadata/annotations",
                    "value": {names.REPORT_CA_ANNOTATION: config.report_ca},
                }
            )
        else:
            key = names.REPORT_CA_ANNOTATION.replace("~", "~0").replace("/", "~1")
            patch.ops.append({"op": "add", "path": f"/metadata/annotations/{key}", "value": config.report_ca})
    return ops + patch.ops
