"""The controllers a real cluster runs, reduced to what the operator's tests need, writing through
the emulated API's HTTP interface like the real ones:

- a Job controller for Indexed Jobs: one pod per index, a replacement only once the old pod is
  Failed or gone (``podReplacementPolicy: Failed``, which podFailurePolicy forces), each passed
  through the admission logic (``mutate_pod``: the gang gate), as the webhook would, or through
  ``admit`` (the operator's webhook itself);
- kubelets: an ungated pod is scheduled and runs; a deleted pod stops after ``termination_s``
  (its containers end, it goes Failed, then it is removed) unless its node is "lost", where it
  hangs in Terminating until force-deleted.

Tests drive failures with the helpers (``fail``, ``kubelet_evict``, ``lose_node``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import random
import string
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import jsonpatch

from sidecar.operator import names
from sidecar.operator.admission import mutate_pod
from tests.k8s.conftest import K8s, call
from tests.k8s.emulator import PODS

JOBS = ("batch", "v1", "jobs")


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _age(timestamp: str | None) -> float:
    if not timestamp:
        return 0.0
    then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    return (datetime.datetime.now(tz=datetime.UTC) - then).total_seconds()


class Cluster:
    def __init__(self, k8s: K8s, *, termination_s: float = 2.0, nodes: int = 4, tick_s: float = 0.05) -> None:
        self.k8s = k8s
        self.termination_s = termination_s
        self.nodes = nodes
        self.tick_s = tick_s
        self.lost_nodes: set[str] = set()
        self.created: list[str] = []  # every pod name the Job controller created, in order
        self._task: asyncio.Task[None] | None = None
        self._stopping: dict[str, float] = {}  # pod -> monotonic time its kubelet saw the deletion
        #: The mutating webhook the apiserver calls (pod -> JSON patch), e.g. the operator's over HTTP;
        #: None: the admission logic's gang gate only.
        self.admit: Callable[[dict[str, Any]], Awaitable[list[dict[str, Any]]]] | None = None
        #: (job, index) whose released pods no kubelet starts: a test puts them into a stuck state
        #: (``image_pull_backoff``, ``unschedulable``, ...) and lets them go with ``start``.
        self.held: set[tuple[str, int]] = set()
        #: (job, index) whose pod the Job controller cannot create (FailedCreate, e.g. a quota).
        self.refused: set[tuple[str, int]] = set()

    # -- lifecycle ----------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Cluster]:
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

    def _objects(self, plural: str) -> list[dict[str, Any]]:
        """The stored objects, read-only: the emulator replaces a stored version on each write, never
        changes one in place, so no copies are needed (with hundreds of pods, copies would stall
        the loop the operator shares)."""
        return [
            obj.raw
            for (resource, _, _), obj in list(self.k8s.api._objects.items())
            if resource.plural == plural and not obj.deleted
        ]

    def pods(self, job: str | None = None) -> list[dict[str, Any]]:
        found = [copy.deepcopy(p) for p in self._objects("pods")]  # the tests' own copies
        if job is not None:
            found = [p for p in found if p["metadata"].get("labels", {}).get(names.JOB_NAME_LABEL) == job]
        return sorted(found, key=lambda p: p["metadata"]["name"])

    def by_job(self) -> dict[str, list[dict[str, Any]]]:
        """Stored pods (read-only) by their Job's name, in one pass."""
        found: dict[str, list[dict[str, Any]]] = {}
        for pod in self._objects("pods"):
            job = (pod["metadata"].get("labels") or {}).get(names.JOB_NAME_LABEL)
            if job:
                found.setdefault(job, []).append(pod)
        return found

    async def step(self) -> None:
        pods = self._objects("pods")
        by_owner: dict[str, list[dict[str, Any]]] = {}
        for pod in pods:
            for ref in pod["metadata"].get("ownerReferences") or []:
                by_owner.setdefault(str(ref.get("uid")), []).append(pod)
        for job in self._objects("jobs"):
            await self._job_controller(job, by_owner.get(job["metadata"]["uid"], []))
        for pod in pods:
            await self._kubelet(pod)

    # -- Job controller -----------------------------------------------------------------------------

    async def _job_controller(self, job: dict[str, Any], mine: list[dict[str, Any]]) -> None:
        spec = job.get("spec", {})
        if spec.get("completionMode") != "Indexed" or spec.get("suspend"):
            return
        if any(
            c.get("type") in ("Failed", "Complete") for c in job.get("status", {}).get("conditions") or []
        ):
            return
        if any(self._fails_job(spec, p) for p in mine):
            await self._fail_job(job, mine)
            return
        for index in range(int(spec.get("completions") or 1)):
            pods = [p for p in mine if p["metadata"]["labels"].get(names.JOB_INDEX_LABEL) == str(index)]
            if any(p.get("status", {}).get("phase") == "Succeeded" for p in pods):
                continue
            if all(p.get("status", {}).get("phase") == "Failed" for p in pods):
                await self._create_pod(job, index)

    @staticmethod
    def _fails_job(spec: dict[str, Any], pod: dict[str, Any]) -> bool:
        """A Failed pod matching a podFailurePolicy FailJob rule on exit codes (only those rules)."""
        if pod.get("status", {}).get("phase") != "Failed":
            return False
        codes = {
            (c.get("name"), (c.get("state") or {}).get("terminated", {}).get("exitCode"))
            for c in pod.get("status", {}).get("containerStatuses") or []
        }
        for rule in (spec.get("podFailurePolicy") or {}).get("rules") or []:
            on = rule.get("onExitCodes") or {}
            if rule.get("action") != "FailJob" or on.get("operator") != "In":
                continue
            if any(
                (on.get("containerName") in (None, name)) and code in on.get("values", [])
                for name, code in codes
            ):
                return True
        return False

    async def _fail_job(self, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        """As the Job controller does on FailJob: the Job fails and its other pods are deleted."""
        meta = job["metadata"]
        condition = {
            "type": "Failed",
            "status": "True",
            "reason": "PodFailurePolicy",
            "lastTransitionTime": _now(),
        }
        url = f"/apis/batch/v1/namespaces/{meta['namespace']}/jobs/{meta['name']}/status"
        await call(self.k8s, "PATCH", url, {"status": {"conditions": [condition]}})
        for pod in pods:
            if pod.get("status", {}).get("phase") not in ("Failed", "Succeeded"):
                await call(
                    self.k8s,
                    "DELETE",
                    f"/api/v1/namespaces/{meta['namespace']}/pods/{pod['metadata']['name']}",
                )

    async def _create_pod(self, job: dict[str, Any], index: int) -> None:
        meta = job["metadata"]
        if (meta["name"], index) in self.refused:
            return
        template = copy.deepcopy(job["spec"]["template"])
        suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{meta['name']}-{index}-{suffix}",
                "namespace": meta["namespace"],
                "labels": {
                    **(template.get("metadata", {}).get("labels") or {}),
                    names.JOB_NAME_LABEL: meta["name"],
                    names.JOB_INDEX_LABEL: str(index),
                    "batch.kubernetes.io/controller-uid": meta["uid"],
                },
                "annotations": dict(template.get("metadata", {}).get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": template.get("spec", {}),
            "status": {"phase": "Pending"},
        }
        patch = mutate_pod(pod) if self.admit is None else await self.admit(pod)  # the mutating webhook
        if patch:
            pod = jsonpatch.apply_patch(pod, patch)
        status, body = await call(self.k8s, "POST", f"/api/v1/namespaces/{meta['namespace']}/pods", pod)
        assert status in (200, 201), body
        self.created.append(pod["metadata"]["name"])

    # -- kubelets -----------------------------------------------------------------------------------

    async def _kubelet(self, pod: dict[str, Any]) -> None:
        meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
        name, namespace = meta["name"], meta["namespace"]
        url = f"/api/v1/namespaces/{namespace}/pods/{name}"
        node = spec.get("nodeName")
        if node in self.lost_nodes:
            return  # its kubelet is gone: nothing here changes until someone force-deletes it
        if meta.get("deletionTimestamp"):
            started = self._stopping.setdefault(name, asyncio.get_running_loop().time())
            if asyncio.get_running_loop().time() - started < self.termination_s:
                return
            if status.get("phase") not in ("Failed", "Succeeded"):
                await self._set_terminated(pod, 143, "Error")
            await call(self.k8s, "DELETE", url, {"gracePeriodSeconds": 0})
            self._stopping.pop(name, None)
            return
        if spec.get("schedulingGates") or status.get("phase") != "Pending":
            return
        index = int(meta.get("labels", {}).get(names.JOB_INDEX_LABEL, "0"))
        if (meta.get("labels", {}).get(names.JOB_NAME_LABEL), index) in self.held:
            return
        await call(self.k8s, "PATCH", url, {"spec": {"nodeName": f"node-{index % self.nodes}"}})
        containers = [
            {"name": c["name"], "ready": True, "restartCount": 0, "state": {"running": {"startedAt": _now()}}}
            for c in spec.get("containers") or []
        ]
        await call(
            self.k8s,
            "PATCH",
            url + "/status",
            {
                "status": {
                    "phase": "Running",
                    "startTime": _now(),
                    "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": _now()}],
                    "containerStatuses": containers,
                }
            },
        )

    async def _set_terminated(
        self, pod: dict[str, Any], code: int, reason: str, container: str | None = None
    ) -> None:
        meta, spec = pod["metadata"], pod.get("spec", {})
        statuses = []
        for c in spec.get("containers") or []:
            ends = container is None or c["name"] == container
            state: dict[str, Any] = (
                {"terminated": {"exitCode": code, "reason": reason, "finishedAt": _now()}}
                if ends
                else {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": _now()}}
            )
            statuses.append({"name": c["name"], "ready": False, "restartCount": 0, "state": state})
        await call(
            self.k8s,
            "PATCH",
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
            {"status": {"phase": "Failed" if code else "Succeeded", "containerStatuses": statuses}},
        )

    # -- what tests do ------------------------------------------------------------------------------

    async def fail(
        self, pod: dict[str, Any], code: int = 1, *, reason: str = "Error", container: str | None = None
    ) -> None:
        """The pod's trainer exits with ``code`` (reason "OOMKilled" for the OOM killer)."""
        await self._set_terminated(pod, code, reason, container)

    async def succeed(self, pod: dict[str, Any]) -> None:
        await self._set_terminated(pod, 0, "Completed")

    async def kubelet_evict(self, pod: dict[str, Any]) -> None:
        """Node-pressure eviction: the kubelet fails the pod with reason Evicted."""
        meta = pod["metadata"]
        await call(
            self.k8s,
            "PATCH",
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
            {
                "status": {
                    "phase": "Failed",
                    "reason": "Evicted",
                    "message": "The node was low on resource: memory.",
                }
            },
        )

    # -- stuck pods: what a kubelet or the scheduler shows for a pod that does not get going -------

    async def _pending(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        meta = pod["metadata"]
        await call(
            self.k8s,
            "PATCH",
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
            {"status": {"phase": "Pending", **status}},
        )

    def _waiting(
        self, pod: dict[str, Any], container: str, reason: str, message: str, **extra: Any
    ) -> dict[str, Any]:
        """Pod status with ``container`` waiting for ``reason`` (init container when it is the injected
        sidecar) and the other containers waiting to be created."""

        def entry(name: str) -> dict[str, Any]:
            waiting = (
                {"reason": reason, "message": message} if name == container else {"reason": "PodInitializing"}
            )
            return {
                "name": name,
                "ready": False,
                "restartCount": 0,
                "state": {"waiting": waiting},
                **(extra if name == container else {}),
            }

        regular = [c["name"] for c in pod.get("spec", {}).get("containers") or []]
        init = [names.SIDECAR_CONTAINER] if container == names.SIDECAR_CONTAINER else []
        return {
            "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}],
            "initContainerStatuses": [entry(n) for n in init],
            "containerStatuses": [entry(n) for n in regular if n != container or not init],
        }

    async def image_pull_backoff(self, pod: dict[str, Any], container: str = "trainer") -> None:
        """The kubelet cannot pull ``container``'s image."""
        image = next(
            (c.get("image") for c in pod.get("spec", {}).get("containers") or [] if c["name"] == container),
            "registry.example.com/missing:1",
        )
        await self._pending(
            pod, self._waiting(pod, container, "ImagePullBackOff", f'Back-off pulling image "{image}"')
        )

    async def create_container_config_error(
        self, pod: dict[str, Any], secret: str = "strata-storage", container: str = names.SIDECAR_CONTAINER
    ) -> None:
        """The kubelet cannot create ``container``: the Secret its env comes from is missing."""
        await self._pending(
            pod, self._waiting(pod, container, "CreateContainerConfigError", f'secret "{secret}" not found')
        )

    async def sidecar_crash_loop(self, pod: dict[str, Any], restarts: int = 3) -> None:
        """The injected sidecar keeps exiting: the kubelet backs off restarting it (the trainer never
        starts: a native sidecar must be started first)."""
        name = pod["metadata"]["name"]
        status = self._waiting(
            pod,
            names.SIDECAR_CONTAINER,
            "CrashLoopBackOff",
            f"back-off 40s restarting failed container={names.SIDECAR_CONTAINER} pod={name}",
            restartCount=restarts,
            lastState={"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": _now()}},
        )
        await self._pending(pod, status)

    async def unschedulable(
        self, pod: dict[str, Any], message: str = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    ) -> None:
        """The scheduler finds no node for the pod."""
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastTransitionTime": _now(),
        }
        await self._pending(pod, {"conditions": [condition]})

    async def start(self, pod: dict[str, Any]) -> None:
        """What held the pod back is fixed: its kubelet starts it (the next step runs it)."""
        labels = pod["metadata"].get("labels", {})
        self.held.discard((labels.get(names.JOB_NAME_LABEL), int(labels.get(names.JOB_INDEX_LABEL, "0"))))
        await self._pending(pod, {"conditions": [], "initContainerStatuses": [], "containerStatuses": []})

    async def lose_node(self, node: str) -> None:
        """The node stops answering: its pods get the taint manager's DisruptionTarget and are deleted,
        but no kubelet finishes them, so they hang in Terminating."""
        self.lost_nodes.add(node)
        for pod in self._objects("pods"):
            if pod.get("spec", {}).get("nodeName") != node:
                continue
            meta = pod["metadata"]
            url = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
            conditions = [
                c for c in pod.get("status", {}).get("conditions") or [] if c.get("type") != "Ready"
            ]
            conditions += [
                {
                    "type": "Ready",
                    "status": "Unknown",
                    "reason": "NodeNotReady",
                    "lastTransitionTime": _now(),
                },
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "DeletionByTaintManager",
                    "message": "Taint manager: deleting due to NoExecute taint",
                    "lastTransitionTime": _now(),
                },
            ]
            await call(self.k8s, "PATCH", url + "/status", {"status": {"conditions": conditions}})
            await call(self.k8s, "DELETE", url)


def indexed_job(
    name: str,
    world: int,
    *,
    annotations: dict[str, str] | None = None,
    job_annotations: dict[str, str] | None = None,
    labelled: bool = True,
    grace_s: int = 2,
) -> dict[str, Any]:
    """An opted-in Indexed Job as the docs recommend it (podFailurePolicy with Strata's exit codes)."""
    labels = {names.OPT_IN_LABEL: names.OPT_IN_VALUE} if labelled else {}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": "default", "annotations": dict(job_annotations or {})},
        "spec": {
            "completions": world,
            "parallelism": world,
            "completionMode": "Indexed",
            "backoffLimitPerIndex": 1,
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": {
                "rules": [
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                    {
                        "action": "Ignore",
                        "onExitCodes": {
                            "containerName": "trainer",
                            "operator": "In",
                            "values": [names.EXIT_PEER_DIED],
                        },
                    },
                    {
                        "action": "FailJob",
                        "onExitCodes": {
                            "containerName": "trainer",
                            "operator": "In",
                            "values": [names.EXIT_LIMIT_SPENT],
                        },
                    },
                ]
            },
            "template": {
                "metadata": {"labels": labels, "annotations": dict(annotations or {})},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": grace_s,
                    "containers": [{"name": "trainer", "image": "trainer:1"}],
                },
            },
        },
    }


async def create(k8s: K8s, plural_path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, created = await call(k8s, "POST", plural_path, body)
    assert status in (200, 201), created
    result: dict[str, Any] = created
    return result


__all__ = ["PODS", "Cluster", "create", "indexed_job"]
