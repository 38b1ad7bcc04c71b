"""What a training pod's API object says about why it stopped, in the failure kinds the launcher
and the operator share (`sidecar.coordinator`). Pure: no API calls, testable from pod dicts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.coordinator import Failure, FailureKind, classify_exit
from sidecar.operator import names

#: Reasons the node lifecycle / taint manager gives when a pod's node went away; the pod GC's
#: DisruptionTarget reason is DeletionByPodGC (the node no longer exists).
_NODE_LOST = frozenset({"NodeLost", "DeletionByTaintManager", "NodeNotReady", "DeletionByPodGC"})


def _conditions(pod: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c.get("type", ""): c for c in pod.get("status", {}).get("conditions") or []}


def _terminated(pod: Mapping[str, Any], container: str | None) -> list[tuple[str, Mapping[str, Any]]]:
    """(container name, terminated state) of containers that ended non-zero; ``container`` narrows
    it to the trainer (the injected sidecar's own exit says nothing about training)."""
    found = []
    for status in pod.get("status", {}).get("containerStatuses") or []:
        if container is not None and status.get("name") != container:
            continue
        state = (status.get("state") or {}).get("terminated") or (status.get("lastState") or {}).get(
            "terminated"
        )
        if state and state.get("exitCode", 0) != 0:
            found.append((status.get("name", "?"), state))
    return found


def classify_pod(pod: Mapping[str, Any], *, container: str | None = None) -> Failure | None:
    """The failure a pod shows, or None while it looks healthy (running, pending, or succeeded).

    Order matters: a pod the node lost, or one evicted, also ends Failed with a non-zero
    exit; the cause is what the API says first.
    """
    meta = pod.get("metadata", {})
    status = pod.get("status", {})
    name = meta.get("name", "?")
    index = (meta.get("labels") or {}).get(names.JOB_INDEX_LABEL)
    rank = int(index) if index is not None and str(index).isdigit() else None
    conditions = _conditions(pod)
    disruption = conditions.get("DisruptionTarget")
    if disruption is not None and disruption.get("status") == "True":
        reason = disruption.get("reason", "")
        detail = f"pod {name}: {reason}" + (
            f" ({disruption['message']})" if disruption.get("message") else ""
        )
        kind = FailureKind.LOST if reason in _NODE_LOST else FailureKind.EVICTED
        return Failure(kind, rank, detail=detail)
    if status.get("reason") in _NODE_LOST:
        return Failure(FailureKind.LOST, rank, detail=f"pod {name}: {status['reason']}")
    ready = conditions.get("Ready")
    if ready is not None and ready.get("status") != "True" and ready.get("reason") in _NODE_LOST:
        return Failure(FailureKind.LOST, rank, detail=f"pod {name}: node not ready")
    ended = _terminated(pod, container)
    for who, state in ended:
        if state.get("reason") == "OOMKilled":
            return classify_exit(
                int(state.get("exitCode", 137)), rank=rank, oom_killed=True, detail=f"pod {name}, {who}"
            )
    if ended:
        who, state = ended[0]
        return classify_exit(int(state.get("exitCode", 1)), rank=rank, detail=f"pod {name}, {who}")
    if status.get("phase") == "Failed":
        reason = status.get("reason") or "Failed"
        if reason == "Evicted":  # the kubelet's node-pressure eviction
            return Failure(FailureKind.EVICTED, rank, detail=f"pod {name}: {status.get('message', reason)}")
        return Failure(FailureKind.EXIT_ERROR, rank, detail=f"pod {name}: {reason}")
    if meta.get("deletionTimestamp") and status.get("phase") == "Running":
        return Failure(FailureKind.DELETED, rank, detail=f"pod {name} was deleted while running")
    return None


def is_terminal(pod: Mapping[str, Any]) -> bool:
    """The pod's containers will not run again: the gang may be released after it."""
    return pod.get("status", {}).get("phase") in ("Succeeded", "Failed")
