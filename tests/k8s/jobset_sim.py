"""A JobSet controller (jobset.x-k8s.io/v1alpha2) reduced to what the operator's tests need, writing
through the emulated API like the real one (kubernetes-sigs/jobset, pkg/controllers):

- child Jobs are not objects here: each replicated Job's replica is its pods, one per completion
  index, labelled as JobSet and the Job controller label them (``restart-attempt`` is the JobSet's
  ``status.restarts`` when they were made) and passed through the admission logic as the Job
  controller's pods are (``Cluster.admit``, else ``mutate_pod``); the kubelets of
  :class:`tests.k8s.cluster.Cluster` run them;
- a child Job has ``backoffLimit: 0`` (what the docs ask for): it fails with its first Failed pod, or
  its first pod deleted before it succeeded (the Job controller's default podReplacementPolicy,
  TerminatingOrFailed, counts that one as failed);
- a failed Job with no ``failurePolicy`` fails the JobSet (``FailedJobs``); with one, the JobSet
  restarts (``status.restarts`` + 1, condition ``RestartingJobSet``) until
  ``restartsCountTowardsMax`` reaches ``maxRestarts``, then fails (``ReachedMaxRestarts``);
- a restart deletes every pod of earlier attempts (JobSet deletes their Jobs in the foreground);
  under ``BlockingRecreate`` the new gang is created only once every one of them is gone, under
  ``Recreate`` at once;
- Completed (``AllJobsCompleted``) once every pod of the current attempt succeeded; a finished
  JobSet deletes what still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import random
import string
from collections.abc import AsyncIterator
from typing import Any

import jsonpatch

from sidecar.operator import names
from sidecar.operator.admission import mutate_pod
from tests.k8s.cluster import Cluster
from tests.k8s.conftest import call

JOBSETS_PATH = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets"


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _attempt(pod: dict[str, Any]) -> int:
    return int((pod["metadata"].get("labels") or {}).get(names.JOBSET_RESTART_LABEL, "0"))


def _failed(pod: dict[str, Any]) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    return phase == "Failed" or (bool(pod["metadata"].get("deletionTimestamp")) and phase != "Succeeded")


class JobSetController:
    """The JobSet controller over ``cluster`` (whose loop runs the kubelets)."""

    def __init__(self, cluster: Cluster, *, tick_s: float = 0.05) -> None:
        self.cluster = cluster
        self.k8s = cluster.k8s
        self.tick_s = tick_s
        self.created: list[str] = []  # every pod name it created, in order
        self._task: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[JobSetController]:
        self._task = asyncio.create_task(self._loop())
        try:
            yield self
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(self.tick_s)

    async def step(self) -> None:
        pods = self.cluster._objects("pods")
        for jobset in self.cluster._objects("jobsets"):
            uid = jobset["metadata"]["uid"]
            mine = [p for p in pods if (p["metadata"].get("labels") or {}).get(names.JOBSET_UID_LABEL) == uid]
            await self._reconcile(jobset, mine)

    async def _reconcile(self, jobset: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        spec, status = jobset.get("spec") or {}, jobset.get("status") or {}
        if any(
            c.get("type") in ("Completed", "Failed") and c.get("status") == "True"
            for c in status.get("conditions") or []
        ):
            await self._delete(
                [p for p in pods if (p.get("status") or {}).get("phase") not in ("Succeeded",)]
            )
            return
        if spec.get("suspend"):
            return
        restarts = int(status.get("restarts") or 0)
        current = [p for p in pods if _attempt(p) == restarts]
        previous = [p for p in pods if _attempt(p) < restarts]
        await self._delete(previous)
        policy = spec.get("failurePolicy")
        failed = sorted(p["metadata"]["name"] for p in current if _failed(p))
        if failed:
            counted = int(status.get("restartsCountTowardsMax") or 0)
            if policy is None:
                await self._finish(
                    jobset,
                    "Failed",
                    "FailedJobs",
                    f"jobset failed due to one or more job failures (pod {failed[0]})",
                )
            elif counted >= int(policy.get("maxRestarts") or 0):
                await self._finish(
                    jobset,
                    "Failed",
                    "ReachedMaxRestarts",
                    f"jobset failed due to reaching max number of restarts (pod {failed[0]})",
                )
            else:
                condition = {
                    "type": "RestartingJobSet",
                    "status": "True",
                    "reason": "DefaultFailurePolicy",
                    "message": f"applying RestartJobSet failure policy action (pod {failed[0]})",
                    "lastTransitionTime": _now(),
                }
                await self._status(
                    jobset,
                    {"restarts": restarts + 1, "restartsCountTowardsMax": counted + 1},
                    condition,
                )
            return
        slots = [
            (rjob, job_index, pod_index)
            for rjob in spec.get("replicatedJobs") or []
            for job_index in range(int(rjob.get("replicas") or 1))
            for pod_index in range(int((rjob["template"].get("spec") or {}).get("completions") or 1))
        ]
        done = [p for p in current if (p.get("status") or {}).get("phase") == "Succeeded"]
        if slots and len(done) >= len(slots):
            await self._finish(jobset, "Completed", "AllJobsCompleted", "jobset completed successfully")
            return
        if previous and (policy or {}).get("restartStrategy") == "BlockingRecreate":
            return  # the old Jobs (and so their pods) must be gone first
        have = {self._slot(p) for p in current}
        for rjob, job_index, pod_index in slots:
            if (rjob["name"], job_index, pod_index) not in have:
                await self._create_pod(jobset, rjob, job_index, pod_index, restarts)

    @staticmethod
    def _slot(pod: dict[str, Any]) -> tuple[str, int, int]:
        labels = pod["metadata"].get("labels") or {}
        return (
            str(labels.get(names.JOBSET_REPLICATED_JOB_LABEL)),
            int(labels.get(names.JOBSET_JOB_INDEX_LABEL, "0")),
            int(labels.get(names.JOB_INDEX_LABEL, "0")),
        )

    async def _delete(self, pods: list[dict[str, Any]]) -> None:
        for pod in pods:
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            await call(self.k8s, "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}")

    async def _status(
        self, jobset: dict[str, Any], changes: dict[str, Any], condition: dict[str, Any]
    ) -> None:
        meta = jobset["metadata"]
        conditions = [
            c
            for c in (jobset.get("status") or {}).get("conditions") or []
            if c.get("type") != condition["type"]
        ]
        url = JOBSETS_PATH.format(namespace=meta["namespace"]) + f"/{meta['name']}/status"
        status, body = await call(
            self.k8s, "PATCH", url, {"status": {**changes, "conditions": [*conditions, condition]}}
        )
        assert status == 200, body

    async def _finish(self, jobset: dict[str, Any], kind: str, reason: str, message: str) -> None:
        condition = {
            "type": kind,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastTransitionTime": _now(),
        }
        await self._status(jobset, {"terminalState": kind}, condition)

    async def _create_pod(
        self, jobset: dict[str, Any], rjob: dict[str, Any], job_index: int, pod_index: int, attempt: int
    ) -> None:
        meta = jobset["metadata"]
        job_name = f"{meta['name']}-{rjob['name']}-{job_index}"
        template = copy.deepcopy(rjob["template"]["spec"]["template"])
        suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{job_name}-{pod_index}-{suffix}",
                "namespace": meta["namespace"],
                "labels": {
                    **(template.get("metadata", {}).get("labels") or {}),
                    names.JOBSET_NAME_LABEL: meta["name"],
                    names.JOBSET_UID_LABEL: meta["uid"],
                    names.JOBSET_REPLICATED_JOB_LABEL: rjob["name"],
                    names.JOBSET_JOB_INDEX_LABEL: str(job_index),
                    names.JOBSET_RESTART_LABEL: str(attempt),
                    names.JOB_NAME_LABEL: job_name,
                    names.JOB_INDEX_LABEL: str(pod_index),
                },
                "annotations": dict(template.get("metadata", {}).get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": job_name,
                        "uid": f"{meta['uid'][:24]}{attempt:04d}{job_index:08d}",
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": template.get("spec", {}),
            "status": {"phase": "Pending"},
        }
        admit = self.cluster.admit
        patch = mutate_pod(pod) if admit is None else await admit(pod)
        if patch:
            pod = jsonpatch.apply_patch(pod, patch)
        status, body = await call(self.k8s, "POST", f"/api/v1/namespaces/{meta['namespace']}/pods", pod)
        assert status in (200, 201), body
        self.created.append(pod["metadata"]["name"])


__all__ = ["JOBSETS_PATH", "JobSetController"]
