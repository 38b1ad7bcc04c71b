"""Bodies of the objects the operator writes (Checkpoint, StrataJob), as plain dicts.

No Kubernetes client here: the operator hands these to whatever writes them. The shapes follow the
CRDs in ``charts/strata/crds/``; ``tests/k8s/test_crds.py`` validates them against those schemas.

Public surface: :func:`checkpoint_name`, :func:`checkpoint_body`, :func:`checkpoint_status`,
:func:`set_condition`, :func:`stratajob_body`.
"""

from __future__ import annotations

import datetime
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

from sidecar.operator.names import API_VERSION, JOB_LABEL, LATEST_LABEL

__all__ = [
    "checkpoint_body",
    "checkpoint_name",
    "checkpoint_status",
    "event_body",
    "set_condition",
    "stratajob_body",
]

_MAX_NAME = 253  # DNS-1123 subdomain
#: Matched whole (fullmatch): with re.match, "$" also matches before a trailing newline.
_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CONDITION_STATUSES = ("True", "False", "Unknown")


def _timestamp(when: float | None = None) -> str:
    """RFC 3339 in UTC with second precision, as the apiserver writes metav1.Time."""
    moment = (
        datetime.datetime.now(tz=datetime.UTC)
        if when is None
        else datetime.datetime.fromtimestamp(when, tz=datetime.UTC)
    )
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def checkpoint_name(job: str, step: int) -> str:
    """``<job>-<step:012d>``, a valid DNS-1123 subdomain name; ValueError if it cannot be one."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if not isinstance(job, str) or not _DNS1123.fullmatch(job):
        raise ValueError(f"job name {job!r} is not a DNS-1123 name")
    name = f"{job}-{step:012d}"
    if len(name) > _MAX_NAME:
        raise ValueError(
            f"job name {job!r} is too long for a Checkpoint name: "
            f"{len(job)} + 13 characters exceeds {_MAX_NAME}"
        )
    return name


# -- commit report validation -------------------------------------------------------------------------

_Kind = type | tuple[type, ...]


def _get(report: Mapping[str, Any], key: str, kind: _Kind, where: str = "", *, nullable: bool = False) -> Any:
    label = f"{where}{key}"
    if key not in report:
        raise ValueError(f"commit report lacks {label!r}")
    value = report[key]
    if value is None and nullable:
        return None
    # bool is an int subclass: never accept it where a number is meant.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ValueError(f"commit report key {label!r} must be {_kind_name(kind)}, got {value!r}")
    if not isinstance(value, kind):
        raise ValueError(f"commit report key {label!r} must be {_kind_name(kind)}, got {value!r}")
    return value


def _kind_name(kind: _Kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _non_negative(value: int, label: str) -> int:
    if value < 0:
        raise ValueError(f"commit report key {label!r} must be >= 0, got {value}")
    return value


def _sha(value: str, label: str) -> str:
    if not _SHA256.fullmatch(value):
        raise ValueError(f"commit report key {label!r} must be a lowercase hex SHA-256, got {value!r}")
    return value


def _rank(entry: Any, index: int) -> dict[str, Any]:
    where = f"ranks[{index}]."
    if not isinstance(entry, Mapping):
        raise ValueError(f"commit report key 'ranks[{index}]' must be a mapping, got {entry!r}")
    encodings = _get(entry, "encodings", Mapping, where)
    for encoding, count in encodings.items():
        if (
            not isinstance(encoding, str)
            or not isinstance(count, int)
            or isinstance(count, bool)
            or count < 0
        ):
            raise ValueError(
                f"commit report key '{where}encodings' must map names to counts >= 0, "
                f"got {encoding!r}: {count!r}"
            )
    return {
        "rank": _non_negative(_get(entry, "rank", int, where), f"{where}rank"),
        "manifestKey": _get(entry, "manifest_key", str, where),
        "sha256": _sha(_get(entry, "sha256", str, where), f"{where}sha256"),
        "bytes": _non_negative(_get(entry, "bytes", int, where), f"{where}bytes"),
        "encodings": dict(encodings),
    }


def checkpoint_body(report: Mapping[str, Any]) -> dict[str, Any]:
    """The Checkpoint object (metadata, spec, status) for a sidecar's commit report.

    Raises ValueError naming the first missing or ill-typed key. ``strata.dev/latest`` starts "false":
    whoever writes it flips the newest one (and the previous latest) when it knows the order.
    """
    if report.get("kind") != "commit":
        raise ValueError(f"commit report key 'kind' must be 'commit', got {report.get('kind')!r}")
    namespace = _get(report, "namespace", str)
    job = _get(report, "job", str)
    step = _non_negative(_get(report, "step", int), "step")
    world_size = _get(report, "world_size", int)
    if world_size < 1:
        raise ValueError(f"commit report key 'world_size' must be >= 1, got {world_size}")
    reshardable = report.get("reshardable", False)  # absent from older sidecars' reports
    if type(reshardable) is not bool:
        raise ValueError(f"commit report key 'reshardable' must be a boolean, got {reshardable!r}")
    kind = _get(report, "type", str)
    if kind not in ("full", "diff"):
        raise ValueError(f"commit report key 'type' must be 'full' or 'diff', got {kind!r}")
    base_step = _get(report, "base_step", int, nullable=True)
    if kind == "diff" and base_step is None:
        raise ValueError("commit report key 'base_step' must be set for a diff")
    requires = _get(report, "requires", list)
    for index, needed in enumerate(requires):
        if not isinstance(needed, int) or isinstance(needed, bool) or needed < 0:
            raise ValueError(
                f"commit report key 'requires[{index}]' must be a step (int >= 0), got {needed!r}"
            )
    bits = _get(report, "bits", int, nullable=True)
    if bits is not None and not 1 <= bits <= 32:
        raise ValueError(f"commit report key 'bits' must be within 1..32 or None, got {bits}")
    generation = _get(report, "generation", str)
    if "/" not in generation:
        raise ValueError(f"commit report key 'generation' must be RUN/RESTART, got {generation!r}")
    location = _get(report, "location", str)
    parts = urllib.parse.urlsplit(location)
    if not parts.scheme or parts.username or parts.password:
        raise ValueError(
            f"commit report key 'location' must be a storage URL without credentials, got {parts.scheme}://..."
        )
    committed_at = _get(report, "committed_at", (int, float))
    if not 0 <= committed_at < 1e11:  # unix seconds; beyond year 5000 is not a time
        raise ValueError(f"commit report key 'committed_at' must be unix seconds, got {committed_at!r}")
    ranks_raw = _get(report, "ranks", list)
    ranks = sorted((_rank(entry, i) for i, entry in enumerate(ranks_raw)), key=lambda r: r["rank"])
    if len({r["rank"] for r in ranks}) != len(ranks):
        raise ValueError("commit report key 'ranks' lists a rank twice")
    attempt = _non_negative(_get(report, "attempt", int), "attempt")
    spec: dict[str, Any] = {
        "job": job,
        "step": step,
        "attempt": attempt,
        "generation": generation,
        "worldSize": world_size,
        "reshardable": reshardable,
        "type": kind,
        "baseStep": base_step,
        "requires": list(requires),
        "bits": bits,
        "bytes": _non_negative(_get(report, "bytes", int), "bytes"),
        "location": location,
        "commitKey": _get(report, "commit_key", str),
        "commitSha256": _sha(_get(report, "commit_sha256", str), "commit_sha256"),
        "committedAt": _timestamp(float(committed_at)),
        "ranks": ranks,
    }
    return {
        "apiVersion": API_VERSION,
        "kind": "Checkpoint",
        "metadata": {
            "name": checkpoint_name(job, step),
            "namespace": namespace,
            "labels": {JOB_LABEL: job, LATEST_LABEL: "false"},
        },
        "spec": spec,
        "status": checkpoint_status(spec),
    }


def checkpoint_status(
    spec: Mapping[str, Any],
    conditions: list[dict[str, Any]] | None = None,
    observed_generation: int | None = None,
) -> dict[str, Any]:
    """A Checkpoint's status from its spec: ranks committed "n/N" and a Ready condition, True when
    every rank of the world committed. Pass the current conditions to keep their transition times."""
    committed = len({r["rank"] for r in spec["ranks"]})
    world = int(spec["worldSize"])
    ready = committed >= world
    message = (
        f"all {world} ranks committed step {spec['step']}"
        if ready
        else f"{committed} of {world} ranks committed step {spec['step']}"
    )
    return {
        "ranksCommitted": committed,
        "ranks": f"{committed}/{world}",
        "ready": ready,
        "observedAttempt": int(spec["attempt"]),
        "conditions": set_condition(
            list(conditions or []),
            "Ready",
            "True" if ready else "False",
            "AllRanksCommitted" if ready else "RanksMissing",
            message,
            observed_generation,
        ),
    }


def set_condition(
    conditions: list[dict[str, Any]],
    type: str,
    status: str,
    reason: str,
    message: str,
    observed_generation: int | None = None,
) -> list[dict[str, Any]]:
    """A new conditions list with ``type`` set (metav1.Condition shape); the other conditions are kept
    as they are, and lastTransitionTime is kept when the status did not change."""
    if status not in _CONDITION_STATUSES:
        raise ValueError(f"condition status must be one of {_CONDITION_STATUSES}, got {status!r}")
    previous = next((c for c in conditions if c.get("type") == type), None)
    transition = (
        previous["lastTransitionTime"]
        if previous is not None and previous.get("status") == status and previous.get("lastTransitionTime")
        else _timestamp()
    )
    condition: dict[str, Any] = {
        "type": type,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": transition,
    }
    if observed_generation is not None:
        condition["observedGeneration"] = observed_generation
    updated = [dict(c) for c in conditions if c.get("type") != type]
    index = next((i for i, c in enumerate(conditions) if c.get("type") == type), len(updated))
    updated.insert(index, condition)
    return updated


def stratajob_body(
    namespace: str,
    name: str,
    workload: Mapping[str, Any],
    *,
    max_restarts: int | None = None,
    hang_timeout_seconds: float | None = None,
) -> dict[str, Any]:
    """A fresh StrataJob for a watched Job/JobSet (``workload`` is its object, or at least its
    apiVersion, kind and metadata.name/uid). Status starts Pending; the operator fills the rest."""
    kind = workload.get("kind")
    if kind not in ("Job", "JobSet"):
        raise ValueError(f"workload 'kind' must be Job or JobSet, got {kind!r}")
    api_version = workload.get("apiVersion")
    if not isinstance(api_version, str):
        raise ValueError(f"workload 'apiVersion' must be a string, got {api_version!r}")
    metadata = workload.get("metadata", {})
    workload_name = metadata.get("name", name)
    if workload_name != name:
        raise ValueError(f"a StrataJob is named after its workload: {name!r} != {workload_name!r}")
    reference: dict[str, Any] = {"apiVersion": api_version, "kind": kind, "name": name}
    if metadata.get("uid"):
        reference["uid"] = metadata["uid"]
    spec: dict[str, Any] = {"workload": reference}
    if max_restarts is not None:
        spec["maxRestarts"] = max_restarts
    if hang_timeout_seconds is not None:
        spec["hangTimeoutSeconds"] = hang_timeout_seconds
    return {
        "apiVersion": API_VERSION,
        "kind": "StrataJob",
        "metadata": {"name": name, "namespace": namespace, "labels": {JOB_LABEL: name}},
        "spec": spec,
        "status": {"phase": "Pending", "restarts": 0, "disruptions": 0},
    }


def event_body(
    involved: Mapping[str, Any], reason: str, message: str, *, warning: bool = False
) -> dict[str, Any]:
    """A core/v1 Event from the operator about ``involved`` (apiVersion, kind, name, namespace, uid,
    optionally resourceVersion). The name is generated; the message is cut to what the API keeps."""
    now = _timestamp()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{involved['name']}.", "namespace": involved["namespace"]},
        "involvedObject": {k: v for k, v in involved.items() if v is not None},
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": "strata-operator"},
        "reportingComponent": "strata.dev/operator",
        "count": 1,
        "firstTimestamp": now,
        "lastTimestamp": now,
    }
