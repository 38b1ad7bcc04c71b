"""The operator classifies a stopped training pod from its API object alone."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.coordinator import FailureKind, RestartPolicy, RestartTracker
from sidecar.operator.classify import classify_pod, is_terminal


def pod(
    phase: str = "Running",
    *,
    index: int = 3,
    conditions: list[dict[str, Any]] | None = None,
    containers: list[dict[str, Any]] | None = None,
    deleting: bool = False,
    reason: str | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": f"recsys-{index}-abcde",
        "labels": {"batch.kubernetes.io/job-completion-index": str(index)},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions or [],
        "containerStatuses": containers or [],
    }
    if reason:
        status["reason"] = reason
    return {"metadata": meta, "status": status}


def terminated(name: str, code: int, reason: str = "Error") -> dict[str, Any]:
    return {"name": name, "state": {"terminated": {"exitCode": code, "reason": reason}}}


def test_operator_running_pod_is_healthy() -> None:
    assert classify_pod(pod()) is None
    assert classify_pod(pod("Pending")) is None
    assert classify_pod(pod("Succeeded")) is None


def test_operator_oomkilled_trainer_is_oom() -> None:
    failure = classify_pod(pod("Failed", containers=[terminated("trainer", 137, "OOMKilled")]))
    assert failure is not None and failure.kind == FailureKind.OOM and failure.rank == 3
    assert "recsys-3-abcde" in failure.describe()


def test_operator_trainer_exit_code_is_exit_error() -> None:
    failure = classify_pod(pod("Failed", containers=[terminated("trainer", 2)]))
    assert failure is not None and failure.kind == FailureKind.EXIT_ERROR and failure.exit_code == 2


def test_operator_killed_by_signal_reports_the_signal() -> None:
    failure = classify_pod(pod("Failed", containers=[terminated("trainer", 143)]))
    assert failure is not None and failure.kind == FailureKind.SIGNAL and failure.signal == 15


def test_operator_only_the_named_container_counts() -> None:
    # The sidecar's exit alone does not say the trainer failed.
    running = pod(containers=[terminated("strata-sidecar", 1)])
    assert classify_pod(running, container="trainer") is None
    assert classify_pod(running) is not None


def test_operator_evicted_pod_is_evicted_not_an_exit() -> None:
    evicted = pod(
        "Failed",
        conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}],
        containers=[terminated("trainer", 143)],
    )
    failure = classify_pod(evicted)
    assert failure is not None and failure.kind == FailureKind.EVICTED
    assert "EvictionByEvictionAPI" in failure.detail
    preempted = pod(
        conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]
    )
    assert classify_pod(preempted).kind == FailureKind.EVICTED  # type: ignore[union-attr]
    pressure = pod("Failed", reason="Evicted")
    assert classify_pod(pressure).kind == FailureKind.EVICTED  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "lost",
    [
        pod(conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}]),
        # The pod GC's reason for pods of a node that no longer exists (kube-controller-manager podgc).
        pod(
            "Failed",
            conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC"}],
            containers=[terminated("trainer", 137)],
        ),
        pod("Failed", reason="NodeLost"),
        pod(conditions=[{"type": "Ready", "status": "False", "reason": "NodeLost"}]),
    ],
)
def test_operator_lost_node_is_lost(lost: dict[str, Any]) -> None:
    failure = classify_pod(lost)
    assert failure is not None and failure.kind == FailureKind.LOST


def test_operator_deleted_while_running_is_deleted() -> None:
    failure = classify_pod(pod(deleting=True))
    assert failure is not None and failure.kind == FailureKind.DELETED
    assert classify_pod(pod("Succeeded", deleting=True)) is None


def test_operator_terminal_phases() -> None:
    assert is_terminal(pod("Failed")) and is_terminal(pod("Succeeded"))
    assert not is_terminal(pod()) and not is_terminal(pod(deleting=True))


def test_operator_pod_failures_use_the_shared_restart_limit() -> None:
    tracker = RestartTracker(RestartPolicy(max_restarts=1, jitter=0), world_size=4)
    first = tracker.decide(classify_pod(pod("Failed", reason="NodeLost")))  # type: ignore[arg-type]
    assert first.restart and first.reason == "lost" and first.attempt == 1
    second = tracker.decide(classify_pod(pod(deleting=True)))  # type: ignore[arg-type]
    assert not second.restart and second.reason == "deleted" and "limit" in second.message
