"""The controllers a real cluster runs, reduced to what the operator's tests need, writing through
the emulated API's HTTP interface like the real ones:

- a Job controller for Indexed Jobs: one pod per index, a replacement only once the old pod is
  Failed or gone (``podReplacementPolicy: Failed``, which podFailurePolicy forces), each passed
  through the admission logic (``mutate_pod``: the gang gate), as the webhook would, or through
  ``admit`` (the operator's webhook itself); a pod the apiserver refuses is a ``FailedCreate``
  Event on the Job and a retry with a doubling backoff. ``spec.suspend: true`` deletes the active
  pods (not counted as failures) and creates none until it is false again (Kueue's preemption:
  ``preempt``). ``backoffLimitPerIndex``: failed pods that no podFailurePolicy Ignore rule matches
  count against their index (a pod gone without a terminal state counts as its last state shows);
  past the limit the index is in ``status.failedIndexes`` and never re-created; the Job fails when
  more indexes failed than ``maxFailedIndexes``, or every index ended and one of them failed;
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
from tests.k8s.conftest import K8s, call, post_event
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
        #: The first delay before a refused pod creation is tried again (doubling, up to 10 s).
        self.create_backoff_s = 0.2
        #: Every refused pod creation: (job, the apiserver's message).
        self.failed_creates: list[tuple[str, str]] = []
        self._create_after: dict[tuple[str, int], tuple[float, float]] = {}  # -> (when, next delay)
        #: Per-index failures the Job controller counted: (job uid, index) -> count.
        self.index_failures: dict[tuple[str, int], int] = {}
        self._counted: set[str] = set()  # pod uids counted (or found not to count)
        self._suspend_deleted: set[str] = set()  # pod uids deleted because their Job was suspended
        self._seen: dict[str, dict[str, Any]] = {}  # pod uid -> its last state the Job controller saw

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
        # A pod gone before it was seen terminal (deleted, or terminated and removed by its kubelet in
        # one go): the real Job controller's finalizer keeps it until counted; here its last state is.
        live = {str(p["metadata"].get("uid")) for p in pods}
        gone = [self._seen.pop(uid) for uid in list(self._seen) if uid not in live]
        for job in self._objects("jobs"):
            uid = job["metadata"]["uid"]
            for pod in gone:
                if _owner(pod) == uid:
                    self._count(job, pod, gone=True)
            await self._job_controller(job, by_owner.get(uid, []))
        for pod in pods:
            if _owner(pod) is not None and str(pod["metadata"].get("uid")) not in self._counted:
                self._seen[str(pod["metadata"].get("uid"))] = pod
        for pod in pods:
            await self._kubelet(pod)

    # -- Job controller -----------------------------------------------------------------------------

    async def _job_controller(self, job: dict[str, Any], mine: list[dict[str, Any]]) -> None:
        spec = job.get("spec", {})
        if spec.get("completionMode") != "Indexed":
            return
        if any(
            c.get("type") in ("Failed", "Complete") for c in job.get("status", {}).get("conditions") or []
        ):
            return
        if spec.get("suspend"):
            await self._suspend(job, mine)
            return
        if _condition(job, "Suspended") == "True":
            await self._set_condition(job, "Suspended", "False", "JobResumed")
        for pod in mine:
            self._count(job, pod)
        if any(self._fails_job(spec, p) for p in mine):
            await self._fail_job(job, mine)
            return
        completions = int(spec.get("completions") or 1)
        failed = self._failed_indexes(job, completions)
        text = _intervals(failed)
        if text != job.get("status", {}).get("failedIndexes", ""):
            await self._patch_job_status(job, {"failedIndexes": text})
        succeeded = {
            int(p["metadata"]["labels"][names.JOB_INDEX_LABEL])
            for p in mine
            if p.get("status", {}).get("phase") == "Succeeded"
        }
        limit = spec.get("maxFailedIndexes")
        if failed and limit is not None and len(failed) > int(limit):
            await self._fail_job(job, mine, "MaxFailedIndexesExceeded")
            return
        if failed and len(failed | succeeded) >= completions:
            await self._fail_job(job, mine, "FailedIndexes")
            return
        for index in range(completions):
            if index in succeeded or index in failed:
                continue
            pods = [p for p in mine if p["metadata"]["labels"].get(names.JOB_INDEX_LABEL) == str(index)]
            if all(p.get("status", {}).get("phase") == "Failed" for p in pods):
                await self._create_pod(job, index)

    def _count(self, job: dict[str, Any], pod: dict[str, Any], *, gone: bool = False) -> None:
        """Count a failed pod against its index once, unless a podFailurePolicy Ignore rule matches it
        (pods deleted for a suspension never count). ``gone``: it vanished; its last state decides."""
        uid = str(pod["metadata"].get("uid"))
        phase = pod.get("status", {}).get("phase")
        if uid in self._counted or phase == "Succeeded" or (phase != "Failed" and not gone):
            return
        self._counted.add(uid)
        index = pod["metadata"].get("labels", {}).get(names.JOB_INDEX_LABEL)
        if uid in self._suspend_deleted or index is None or _ignored(job.get("spec", {}), pod):
            return
        key = (job["metadata"]["uid"], int(index))
        self.index_failures[key] = self.index_failures.get(key, 0) + 1

    def _failed_indexes(self, job: dict[str, Any], completions: int) -> set[int]:
        limit = job.get("spec", {}).get("backoffLimitPerIndex")
        if limit is None:
            return set()
        uid = job["metadata"]["uid"]
        return {i for i in range(completions) if self.index_failures.get((uid, i), 0) > int(limit)}

    async def _suspend(self, job: dict[str, Any], mine: list[dict[str, Any]]) -> None:
        """A suspended Job: its active pods are deleted (not counted as failures), none is created."""
        if _condition(job, "Suspended") != "True":
            await self._set_condition(job, "Suspended", "True", "JobSuspended")
        for pod in mine:
            meta = pod["metadata"]
            if pod.get("status", {}).get("phase") in ("Failed", "Succeeded") or meta.get("deletionTimestamp"):
                continue
            self._suspend_deleted.add(str(meta.get("uid")))
            await call(self.k8s, "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}")

    async def _patch_job_status(self, job: dict[str, Any], status: dict[str, Any]) -> None:
        meta = job["metadata"]
        url = f"/apis/batch/v1/namespaces/{meta['namespace']}/jobs/{meta['name']}/status"
        await call(self.k8s, "PATCH", url, {"status": status})

    async def _set_condition(self, job: dict[str, Any], kind: str, status: str, reason: str) -> None:
        conditions = [c for c in job.get("status", {}).get("conditions") or [] if c.get("type") != kind]
        conditions.append({"type": kind, "status": status, "reason": reason, "lastTransitionTime": _now()})
        await self._patch_job_status(job, {"conditions": conditions})

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

    async def _fail_job(
        self, job: dict[str, Any], pods: list[dict[str, Any]], reason: str = "PodFailurePolicy"
    ) -> None:
        """As the Job controller does when the Job fails (FailJob, failed indexes): the Job fails and
        its other pods are deleted."""
        meta = job["metadata"]
        await self._set_condition(job, "Failed", "True", reason)
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
        key = (meta["uid"], index)
        when, delay = self._create_after.get(key, (0.0, self.create_backoff_s))
        if asyncio.get_running_loop().time() < when:
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
        if status not in (200, 201):
            # As the real Job controller: a Warning Event FailedCreate on the Job, a retry later.
            message = f"Error creating: {(body or {}).get('message') or status}"
            self.failed_creates.append((meta["name"], message))
            self._create_after[key] = (asyncio.get_running_loop().time() + delay, min(2 * delay, 10.0))
            await post_event(self.k8s, job, "FailedCreate", message, warning=True, component="job-controller")
            return
        self._create_after.pop(key, None)
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

    async def kubelet_evict(self, pod: dict[str, Any], *, condition: bool = True) -> None:
        """Node-pressure eviction: the kubelet fails the pod with reason Evicted, and (1.26+, unless
        ``condition`` is False) the DisruptionTarget condition TerminationByKubelet."""
        meta = pod["metadata"]
        conditions = [
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "TerminationByKubelet",
                "message": "The node was low on resource: memory.",
                "lastTransitionTime": _now(),
            }
        ]
        status: dict[str, Any] = {
            "phase": "Failed",
            "reason": "Evicted",
            "message": "The node was low on resource: memory.",
        }
        if condition:
            kept = pod.get("status", {}).get("conditions") or []
            status["conditions"] = [c for c in kept if c.get("type") != "DisruptionTarget"] + conditions
        await call(
            self.k8s,
            "PATCH",
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
            {"status": status},
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

    async def set_suspend(self, job: str, suspend: bool, namespace: str = "default") -> None:
        """What Kueue writes: ``spec.suspend`` of the Job."""
        url = f"/apis/batch/v1/namespaces/{namespace}/jobs/{job}"
        status, body = await call(self.k8s, "PATCH", url, {"spec": {"suspend": suspend}})
        assert status == 200, body

    async def preempt(self, job: str, namespace: str = "default", *, timeout: float = 30.0) -> None:
        """Kueue's preemption (or its waitForPodsReady eviction) and later re-admission: suspend the
        Job, wait until the Job controller's deletions took every pod of it away (terminal or gone),
        resume it."""
        await self.set_suspend(job, True, namespace)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(
            p.get("status", {}).get("phase") not in ("Failed", "Succeeded")
            for p in self.by_job().get(job, [])
            if p["metadata"].get("namespace") == namespace
        ):
            if loop.time() > deadline:
                raise AssertionError(f"the pods of the suspended Job {job} were not gone in {timeout:g} s")
            await asyncio.sleep(self.tick_s)
        await self.set_suspend(job, False, namespace)

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
            # as docs/kubernetes/operator.md recommends: at least strata.dev/max-restarts (an index past it is
            # never re-created, so no gang could restart)
            "backoffLimitPerIndex": 100,
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


def _owner(pod: dict[str, Any]) -> str | None:
    for ref in pod["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == "Job" and ref.get("controller"):
            return str(ref.get("uid"))
    return None


def _condition(job: dict[str, Any], kind: str) -> str | None:
    for c in job.get("status", {}).get("conditions") or []:
        if c.get("type") == kind:
            return str(c.get("status"))
    return None


def _ignored(spec: dict[str, Any], pod: dict[str, Any]) -> bool:
    """The first podFailurePolicy rule that matches the pod says Ignore (the Job controller's order)."""
    conditions = {
        c.get("type") for c in pod.get("status", {}).get("conditions") or [] if c.get("status") == "True"
    }
    codes = [
        (c.get("name"), ((c.get("state") or {}).get("terminated") or {}).get("exitCode"))
        for c in pod.get("status", {}).get("containerStatuses") or []
    ]
    for rule in (spec.get("podFailurePolicy") or {}).get("rules") or []:
        on = rule.get("onExitCodes")
        if on is not None:
            values = on.get("values") or []
            matched = any(
                on.get("containerName") in (None, name)
                and code not in (None, 0)
                and ((code in values) == (on.get("operator", "In") == "In"))
                for name, code in codes
            )
        else:
            matched = any(p.get("type") in conditions for p in rule.get("onPodConditions") or [])
        if matched:
            return bool(rule.get("action") == "Ignore")
    return False


def _intervals(indexes: set[int]) -> str:
    """Indexes in the Job controller's text format: "1,3-5" (runs of three or more compressed)."""
    runs: list[list[int]] = []
    for i in sorted(indexes):
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    parts = [f"{r[0]}-{r[-1]}" if len(r) >= 3 else ",".join(map(str, r)) for r in runs]
    return ",".join(parts)


__all__ = ["PODS", "Cluster", "create", "indexed_job"]
