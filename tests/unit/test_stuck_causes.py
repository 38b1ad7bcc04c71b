"""What counts as a stuck pod or gang, from pod objects alone (sidecar/operator/stuck.py)."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.operator import names
from sidecar.operator.gang import WatchedJob
from sidecar.operator.stuck import gang_incomplete, pod_cause


def pod(index: int = 0, *, gated: bool = False, phase: str = "Pending", **status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"job-{index}-abcde",
            "labels": {names.JOB_INDEX_LABEL: str(index)},
            "creationTimestamp": f"2026-01-01T00:00:0{index}Z",
        },
        "spec": {"schedulingGates": [{"name": names.GANG_GATE}] if gated else []},
        "status": {"phase": phase, **status},
    }


def waiting(name: str, reason: str, message: str = "", **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "ready": False,
        "state": {"waiting": {"reason": reason, "message": message}},
        **extra,
    }


@pytest.mark.parametrize(
    ("reason", "cause"),
    [
        ("ErrImagePull", "ImagePullBackOff"),
        ("ImagePullBackOff", "ImagePullBackOff"),
        ("InvalidImageName", "ImagePullBackOff"),
        ("CreateContainerConfigError", "CreateContainerConfigError"),
        ("CreateContainerError", "CreateContainerError"),
    ],
)
def test_waiting_reasons_name_their_cause_and_the_kubelets_words(reason: str, cause: str) -> None:
    found = pod_cause(pod(containerStatuses=[waiting("trainer", reason, "the kubelet says so")]))
    assert found == (cause, f"container trainer: {reason}: the kubelet says so")


def test_ordinary_states_are_not_stuck() -> None:
    assert pod_cause(pod(containerStatuses=[waiting("trainer", "ContainerCreating")])) is None
    assert pod_cause(pod(containerStatuses=[waiting("trainer", "PodInitializing")])) is None
    scheduled_gated = {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}
    assert pod_cause(pod(gated=True, conditions=[scheduled_gated])) is None
    pulling = pod(containerStatuses=[waiting("trainer", "ImagePullBackOff")])
    assert pod_cause({**pulling, "metadata": {**pulling["metadata"], "deletionTimestamp": "x"}}) is None
    assert pod_cause(pod(phase="Failed", containerStatuses=[waiting("trainer", "ImagePullBackOff")])) is None


def test_unschedulable_carries_the_schedulers_message() -> None:
    condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/4 nodes"}
    assert pod_cause(pod(conditions=[condition])) == ("Unschedulable", "0/4 nodes")


def test_sidecar_crash_loop_holds_between_crashes_and_ends_once_it_is_ready() -> None:
    last = {"terminated": {"exitCode": 1, "reason": "Error"}}
    backing_off = waiting(
        names.SIDECAR_CONTAINER, "CrashLoopBackOff", "back-off 20s", restartCount=2, lastState=last
    )
    found = pod_cause(pod(initContainerStatuses=[backing_off]))
    assert (
        found is not None and found[0] == "SidecarCrashLoop" and "restarted 2 times; last exit 1" in found[1]
    )
    starting = {"name": names.SIDECAR_CONTAINER, "ready": False, "restartCount": 3, "lastState": last}
    starting["state"] = {"running": {}}
    assert pod_cause(pod(initContainerStatuses=[starting])) is not None  # its startup probe never passes
    assert pod_cause(pod(initContainerStatuses=[{**starting, "ready": True}])) is None  # recovered
    trainer_loop = waiting("trainer", "CrashLoopBackOff", restartCount=3)
    assert pod_cause(pod(phase="Running", containerStatuses=[trainer_loop])) is None  # the protocol's


def test_gang_incomplete_only_when_no_earlier_gang_still_stops() -> None:
    job = WatchedJob("default", "job", workload={"spec": {"completions": 3}})
    gated = [pod(0, gated=True), pod(1, gated=True)]
    found = gang_incomplete(job, gated)
    assert found is not None and found[0] == "job-0-abcde" and "index(es) 2 of 3" in found[1]
    stopping = pod(2, phase="Running")
    assert gang_incomplete(job, [*gated, stopping]) is None  # a gang restart waits for it
    assert gang_incomplete(job, [*gated, pod(2, phase="Failed")]) is not None  # ended: no replacement
    assert gang_incomplete(job, [*gated, pod(2, gated=True)]) is None  # complete
    job.workload = {"spec": {"completions": 5}, "status": {"failedIndexes": "1-3"}}
    found = gang_incomplete(job, gated)
    assert found is not None and "index(es) 2, 3, 4 of 5" in found[1]
    assert "gave up on index(es) 2, 3 (backoffLimitPerIndex)" in found[1]
