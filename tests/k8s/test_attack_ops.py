"""Adversarial checks of the operator's lifecycle (retention), stuck-gang detection and JobSet
mirroring, as a real cluster or a careless user would drive them.

The controller is driven directly over a small in-memory API (no kopf, no emulator): each test
places the cluster in one exact state (a resubmission landing between two calls, a 403 or a reset
on one GET, a pod of an earlier incarnation) that the emulated cluster cannot time as precisely.
Each test asserts what a user of a real cluster expects; those that fail show a defect.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import pytest

from sidecar.operator import names
from sidecar.operator.controller import Controller
from sidecar.operator.gang import WatchedJob, now_text
from sidecar.operator.kube import ApiError
from tests.k8s.emulator import label_matcher

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(20)]

SJ = "/apis/strata.dev/v1alpha1/namespaces/default/stratajobs"
CP = "/apis/strata.dev/v1alpha1/namespaces/default/checkpoints"
JOBS = "/apis/batch/v1/namespaces/default/jobs"
JOBSETS = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets"
LONG_AGO = "2020-01-01T00:00:00Z"

Hook = Callable[[str, str], None]


def _merge(into: dict[str, Any], patch: Mapping[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


class FakeApi:
    """The calls the controller makes, over a dict of objects by path. ``hooks`` run before a
    request (method, url) and may raise (a 403, a reset) or change the store (a resubmission)."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.hooks: list[Hook] = []
        self._rv = 0

    def put(self, url: str, obj: dict[str, Any]) -> dict[str, Any]:
        self._rv += 1
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", f"uid-{url.rsplit('/', 1)[1]}-{self._rv}")
        meta["resourceVersion"] = str(self._rv)
        meta.setdefault("name", url.rsplit("/", 1)[1])
        meta.setdefault("namespace", "default")
        self.objects[url] = obj
        return obj

    def _list(self, url: str, selector: str | None) -> dict[str, Any]:
        if every := re.fullmatch(r"(/apis/[^/]+/[^/]+)/([^/]+)", url):  # all namespaces
            pattern = re.compile(
                re.escape(every[1]) + r"/namespaces/[^/]+/" + re.escape(every[2]) + r"/[^/]+$"
            )
        else:
            pattern = re.compile(re.escape(url) + r"/[^/]+$")
        items = [o for k, o in self.objects.items() if pattern.match(k)]
        matches = label_matcher(selector)
        items = [o for o in items if matches(o["metadata"].get("labels") or {})]
        return {"items": [dict(o) for o in items]}

    async def request(
        self,
        method: str,
        url: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        self.calls.append((method, url))
        for hook in list(self.hooks):
            hook(method, url)
        await asyncio.sleep(0)
        if method == "GET":
            if url in self.objects:
                return self.objects[url]
            if url.rsplit("/", 1)[1] in ("stratajobs", "checkpoints", "jobs", "jobsets", "pods", "events"):
                return self._list(url, (params or {}).get("labelSelector"))
            raise ApiError(404, "NotFound", f"{url} not found")
        if method == "POST":
            name = (body.get("metadata") or {}).get("name") or f"gen-{self._rv + 1}"
            return self.put(f"{url}/{name}", dict(body))
        if method == "PATCH":
            target = url.removesuffix("/status")
            if target not in self.objects:
                raise ApiError(404, "NotFound", f"{target} not found")
            _merge(self.objects[target], body)
            self._rv += 1
            self.objects[target]["metadata"]["resourceVersion"] = str(self._rv)
            return self.objects[target]
        if method == "DELETE":
            found = self.objects.get(url)
            if found is None:
                raise ApiError(404, "NotFound", f"{url} not found")
            pre = (body or {}).get("preconditions") or {}
            for field in ("uid", "resourceVersion"):
                if pre.get(field) and pre[field] != found["metadata"].get(field):
                    raise ApiError(409, "Conflict", f"precondition {field} failed")
            del self.objects[url]
            return {}
        raise AssertionError(f"unexpected {method} {url}")

    async def get(self, url: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = await self.request("GET", url)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return found

    async def create(self, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
        created: dict[str, Any] = await self.request("POST", url, dict(body))
        return created

    async def merge_patch(self, url: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        patched: dict[str, Any] = await self.request("PATCH", url, dict(patch))
        return patched

    async def delete(self, url: str, body: Mapping[str, Any] | None = None) -> bool:
        try:
            await self.request("DELETE", url, body)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def controller(api: FakeApi, **kwargs: Any) -> Controller:
    ctrl = Controller(api, **kwargs)  # type: ignore[arg-type]
    ctrl._wake = lambda job, at: None  # type: ignore[method-assign]  # timers: the test drives
    return ctrl


def add_stratajob(
    api: FakeApi,
    name: str,
    *,
    kind: str = "Job",
    workload_name: str | None = None,
    deleted_at: str | None = None,
    retention: str = "0",
) -> None:
    api_version = "batch/v1" if kind == "Job" else "jobset.x-k8s.io/v1alpha2"
    status: dict[str, Any] = {"phase": "Succeeded", "retention": retention}
    if deleted_at:
        status["workloadDeletedAt"] = deleted_at
    api.put(
        f"{SJ}/{name}",
        {
            "apiVersion": "strata.dev/v1alpha1",
            "kind": "StrataJob",
            "metadata": {"name": name},
            "spec": {"workload": {"apiVersion": api_version, "kind": kind, "name": workload_name or name}},
            "status": status,
        },
    )


def add_checkpoint(api: FakeApi, job: str, step: int, *, created: float | None = None) -> str:
    name = f"{job}-{step}"
    meta: dict[str, Any] = {"name": name, "labels": {names.JOB_LABEL: job}}
    if created is not None:
        meta["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    api.put(f"{CP}/{name}", {"metadata": meta, "spec": {"step": step}})
    return name


def add_job(api: FakeApi, name: str) -> None:
    api.put(f"{JOBS}/{name}", {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}})


def checkpoints(api: FakeApi, job: str) -> list[str]:
    return sorted(
        o["metadata"]["name"]
        for k, o in api.objects.items()
        if k.startswith(CP + "/") and o["metadata"]["labels"].get(names.JOB_LABEL) == job
    )


# -- retention: deleting what a live workload still uses ---------------------------------------------


async def test_retention_keeps_checkpoints_of_a_job_resubmitted_between_the_get_and_the_deletes() -> None:
    """The sweep's GET says the Job is gone; the user's `kubectl apply` lands right after it. The
    Checkpoints are deleted anyway (no second look, no precondition on them): the resubmission
    that should resume finds none."""
    api = FakeApi()
    add_stratajob(api, "train", deleted_at=LONG_AGO)
    add_checkpoint(api, "train", 100)
    add_checkpoint(api, "train", 200)

    def resubmit(method: str, url: str) -> None:
        if (method, url) == ("GET", f"{JOBS}/train") and f"{JOBS}/train" not in api.objects:
            api.hooks.remove(resubmit)
            # the GET below answers 404; the Job exists from the next call on
            api.hooks.append(
                lambda m, u: add_job(api, "train") if f"{JOBS}/train" not in api.objects else None
            )

    api.hooks.append(resubmit)
    ctrl = controller(api)
    await ctrl._expire("default", "train")
    assert f"{JOBS}/train" in api.objects, "the resubmission happened"
    assert checkpoints(api, "train") == ["train-100", "train-200"], (
        "Checkpoints of a Job that exists again were deleted"
    )


async def test_retention_keeps_checkpoints_when_the_workload_came_back_as_another_kind() -> None:
    """A JobSet `train` was deleted long ago; `train` is resubmitted as a plain Job (while no operator
    watched it, or at the operator's start before kopf listed it). The sweep GETs only the
    recorded kind (jobsets/train: 404) and deletes the Checkpoints and StrataJob that the Job named
    `train` resumes from (Checkpoints are keyed by name only)."""
    api = FakeApi()
    add_stratajob(api, "train", kind="JobSet", deleted_at=LONG_AGO)
    add_checkpoint(api, "train", 100)
    add_job(api, "train")
    ctrl = controller(api)
    await ctrl.sweep_retention()
    for key in list(ctrl._retention_due):
        await ctrl._expire(*key)
    assert checkpoints(api, "train") == ["train-100"], "Checkpoints deleted while Job train exists"
    assert f"{SJ}/train" in api.objects


async def test_retention_checks_the_stratajobs_own_name_not_a_forged_spec_workload_name() -> None:
    """spec.workload is user-editable (no status subresource protects it): a StrataJob `victim`
    whose spec.workload.name says `ghost` is swept by GETting `ghost` (404), marked, and its
    Checkpoints deleted although Job `victim` exists. The label selector uses the StrataJob's name,
    the existence check another name."""
    api = FakeApi()
    add_stratajob(api, "victim", workload_name="ghost")
    add_checkpoint(api, "victim", 100)
    add_job(api, "victim")
    ctrl = controller(api)
    await ctrl.sweep_retention()
    for key in list(ctrl._retention_due):
        await ctrl._expire(*key)
    assert checkpoints(api, "victim") == ["victim-100"], "Checkpoints deleted while Job victim exists"


async def test_deleting_a_job_does_not_mark_a_live_jobset_of_the_same_name() -> None:
    """A Job and a JobSet may share a name in one namespace; the controller keys both as
    (namespace, name). The Job's DELETED event marks the shared StrataJob as deleted and unwatches
    the JobSet, so the retention later deletes the live JobSet's Checkpoints."""
    api = FakeApi()
    add_stratajob(api, "train", kind="JobSet", retention="168h")
    ctrl = controller(api)
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "train", "namespace": "default", "uid": "jobset-uid"},
        "spec": {},
    }
    watched = ctrl._job("default", "train")
    watched.kind, watched.workload = "JobSet", jobset
    watched.status = dict(api.objects[f"{SJ}/train"]["status"])
    watched.stratajob = api.objects[f"{SJ}/train"]
    job_body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "train", "namespace": "default", "uid": "job-uid"},
        "spec": {"template": {"metadata": {"labels": {names.OPT_IN_LABEL: names.OPT_IN_VALUE}}}},
    }
    await ctrl.on_job("DELETED", job_body)
    assert ctrl._watched(("default", "train")), "the live JobSet is no longer watched"
    assert "workloadDeletedAt" not in api.objects[f"{SJ}/train"]["status"]


@pytest.mark.parametrize("namespaces", [(), ("default",)], ids=["clusterwide", "namespaced"])
async def test_the_sweep_deletes_checkpoints_left_without_a_stratajob_or_a_workload(
    namespaces: tuple[str, ...],
) -> None:
    """An expiry deletes the StrataJob, then the Checkpoints; what is left to delete lives only in
    memory. An operator restarted in between (or a StrataJob deleted by hand once its workload is
    gone) left the Checkpoints forever: no StrataJob points the sweep at them. Those of a live
    workload, of a job with a StrataJob, or younger than the grace (a new job's first Checkpoint
    may precede its StrataJob) stay."""
    clock = Clock()
    api = FakeApi()
    old, young = clock.now - 3600, clock.now - 60
    add_checkpoint(api, "gone", 100, created=old)
    add_checkpoint(api, "gone", 200, created=old)
    add_checkpoint(api, "alive", 100, created=old)
    add_job(api, "alive")  # not opted in: no StrataJob, nothing watched
    add_checkpoint(api, "kept", 100, created=old)
    add_stratajob(api, "kept", deleted_at=LONG_AGO, retention="never")
    add_checkpoint(api, "new", 100, created=young)
    ctrl = controller(api, clock=clock)  # a restarted operator: nothing in memory
    await ctrl.sweep_retention(namespaces)
    assert checkpoints(api, "gone") == [], "Checkpoints of no StrataJob and no workload stay forever"
    assert checkpoints(api, "alive") == ["alive-100"]
    assert checkpoints(api, "kept") == ["kept-100"]
    assert checkpoints(api, "new") == ["new-100"]


async def test_orphaned_checkpoints_stay_when_the_workload_comes_back_during_the_sweep() -> None:
    """The sweep's LISTs are a moment old when it deletes: a Job resubmitted since resumes from
    these Checkpoints, and one recreated under the same name (a new uid) is not the one listed."""
    clock = Clock()
    api = FakeApi()
    add_checkpoint(api, "back", 100, created=clock.now - 3600)
    add_checkpoint(api, "again", 100, created=clock.now - 3600)
    add_checkpoint(api, "again", 200, created=clock.now - 3600)

    def resubmit(method: str, url: str) -> None:
        if method == "GET" and url == f"{JOBS}/back":
            add_job(api, "back")
        if method == "DELETE" and url == f"{CP}/again-200" and api.objects[url]["spec"]["step"] == 200:
            api.objects.pop(url)
            add_checkpoint(api, "again", 200)  # recreated: a new uid
            api.objects[url]["spec"]["step"] = -1

    api.hooks.append(resubmit)
    await controller(api, clock=clock).sweep_retention()
    assert checkpoints(api, "back") == ["back-100"], "deleted although Job back exists again"
    assert checkpoints(api, "again") == ["again-200"], "a recreated Checkpoint deleted despite its uid"


# -- retention: never deleting ------------------------------------------------------------------------


async def test_a_connection_reset_during_the_sweep_does_not_end_retention_for_good() -> None:
    """aiohttp's ServerDisconnectedError is neither ApiError nor OSError: it escapes
    run_retention, whose task ends; nothing is ever deleted again until the operator restarts."""
    api = FakeApi()
    failed = []

    def reset_once(method: str, url: str) -> None:
        if method == "GET" and url.endswith("/stratajobs") and not failed:
            failed.append(url)
            raise aiohttp.ServerDisconnectedError()

    api.hooks.append(reset_once)
    ctrl = controller(api, retention_sweep_s=0.05)
    task = asyncio.create_task(ctrl.run_retention())
    try:
        await asyncio.sleep(0.3)
        assert not task.done(), f"the retention loop ended: {task.exception()!r}"
        lists = [u for m, u in api.calls if m == "GET" and u.endswith("/stratajobs")]
        assert len(lists) >= 2, "no sweep after the reset"
    finally:
        ctrl._closed = True
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def test_one_forbidden_workload_get_does_not_stop_the_sweep_of_every_other_stratajob() -> None:
    """One workload GET that fails (a 403 where a Role lacks a kind, a 500 or a timeout from a
    busy apiserver, a CRD being upgraded) aborts the whole sweep, every hour, so every orphan
    listed after it is never marked nor deleted."""
    api = FakeApi()
    add_stratajob(api, "a-jobset", kind="JobSet")
    add_stratajob(api, "b-orphan")
    add_checkpoint(api, "b-orphan", 100)

    def forbid(method: str, url: str) -> None:
        if url.startswith(JOBSETS):
            raise ApiError(403, "Forbidden", "jobsets.jobset.x-k8s.io is forbidden")

    api.hooks.append(forbid)
    ctrl = controller(api)
    with contextlib.suppress(ApiError):
        await ctrl.sweep_retention()
    assert api.objects[f"{SJ}/b-orphan"]["status"].get("workloadDeletedAt"), (
        "the orphan behind a forbidden GET was never marked"
    )


async def test_the_sweep_costs_no_get_per_stratajob() -> None:
    """Every StrataJob not (yet) in the watch cache costs one GET of its workload per sweep, and at
    start kopf has listed nothing yet: 300 finished Jobs kept for their logs = 300 sequential GETs
    at each start and each hour. One LIST per kind and namespace answers the same question."""
    api = FakeApi()
    for i in range(300):
        add_stratajob(api, f"job-{i}", retention="168h")
        add_job(api, f"job-{i}")
    ctrl = controller(api)
    await ctrl.sweep_retention()
    assert len(api.calls) <= 10, f"{len(api.calls)} API calls for one sweep of 300 StrataJobs"


# -- stuck detection -------------------------------------------------------------------------------------


def job_pod(job: WatchedJob, index: int, *, gated: bool = False, failed: bool = False) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "metadata": {
            "name": f"{job.name}-{index}-x{index}",
            "namespace": "default",
            "creationTimestamp": now_text(),
            "labels": {names.JOB_NAME_LABEL: job.name, names.JOB_INDEX_LABEL: str(index)},
            "ownerReferences": [{"kind": "Job", "name": job.name, "uid": job.uid, "controller": True}],
        },
        "spec": {"schedulingGates": [{"name": names.GANG_GATE}] if gated else []},
        "status": {"phase": "Failed" if failed else "Pending"},
    }
    return pod


def watched_job(ctrl: Controller, api: FakeApi, name: str, world: int, **status: Any) -> WatchedJob:
    add_stratajob(api, name, retention="168h")
    job = ctrl._job("default", name)
    job.workload = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": "default", "uid": f"{name}-uid"},
        "spec": {"completions": world, "parallelism": world, "completionMode": "Indexed"},
        "status": {},
    }
    job.stratajob = api.objects[f"{SJ}/{name}"]
    job.status = {"phase": "Running", "generation": "run/1", **status}
    return job


def pull_backoff(pod: dict[str, Any]) -> None:
    pod["spec"]["schedulingGates"] = []
    pod["status"] = {
        "phase": "Pending",
        "containerStatuses": [
            {
                "name": "trainer",
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling "t:1"'}},
            }
        ],
    }


async def test_a_large_gang_going_stuck_pod_by_pod_posts_a_bounded_number_of_events() -> None:
    """A 200-pod gang whose pods reach ImagePullBackOff one after another (as a node pool pulls):
    each check past the first ten per cause posts one more "N more pods are stuck" Event on the
    StrataJob and one on the Job: about 2 Events per pod, the storm the bound was meant to stop."""
    api = FakeApi()
    clock = Clock()
    ctrl = controller(api, clock=clock, stuck_grace_s=30.0)
    job = watched_job(ctrl, api, "big", 200)
    for i in range(200):
        pod = job_pod(job, i)
        pull_backoff(pod)
        job.pods[pod["metadata"]["name"]] = pod
        clock.now += 1.0
        await ctrl._check_stuck(job)
    clock.now += 31.0
    await ctrl._check_stuck(job)
    events = [u for m, u in api.calls if m == "POST" and u.endswith("/events")]
    assert len(events) <= 60, f"{len(events)} Events for one stuck gang"


async def test_a_gang_in_the_job_controllers_backoff_after_a_gang_restart_is_not_stuck() -> None:
    """After a gang restart of 4 pods the Job controller has 4 more failed pods: without
    backoffLimitPerIndex its pod-creation backoff is 10 s x 2^(failures-1) = 80 s (capped at
    6-10 min), for the whole Job. The first index, failed first, is recreated (gated) after 10 s;
    the other three come only after that backoff. The grace assumes one failure per restart
    (30 + 10 s) and reports GangIncomplete with a Warning Event on a healthy restart."""
    api = FakeApi()
    clock = Clock()
    ctrl = controller(api, clock=clock, stuck_grace_s=30.0)
    job = watched_job(ctrl, api, "gang", 4, restarts=1)
    job.workload["status"] = {"failed": 4}  # type: ignore[index]
    first = job_pod(job, 0, gated=True)
    job.pods[first["metadata"]["name"]] = first
    for i in (1, 2, 3):
        old = job_pod(job, i, failed=True)
        old["metadata"]["name"] += "-old"
        job.pods[old["metadata"]["name"]] = old
    await ctrl._check_stuck(job)
    clock.now += 45.0  # past the grace, well within the Job controller's 80 s backoff
    await ctrl._check_stuck(job)
    condition = (
        next((c for c in job.status["conditions"] if c["type"] == "Stuck"), None)
        if job.status.get("conditions")
        else None
    )
    assert condition is None or condition["status"] != "True", f"healthy restart reported Stuck: {condition}"


# -- JobSet mirroring ----------------------------------------------------------------------------------


def jobset_pod(name: str, uid: str, attempt: int, *, terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "default",
        "labels": {
            names.JOBSET_NAME_LABEL: "js",
            names.JOBSET_UID_LABEL: uid,
            names.JOBSET_RESTART_LABEL: str(attempt),
            names.JOB_NAME_LABEL: "js-workers-0",
        },
    }
    if terminating:
        meta["deletionTimestamp"] = "2020-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {}, "status": {"phase": "Running"}}


async def test_a_jobset_resubmitted_under_its_name_is_not_mirrored_at_the_old_incarnations_attempt() -> None:
    """JobSet `js` (uid A) at restart attempt 2 is deleted; its pods hang Terminating (a lost node)
    when `js` is resubmitted (uid B, restarts 0: the count goes backwards). The mirror takes the
    highest attempt over all pods named for `js`, uid A's included, and records generation B/2:
    the new gang's sidecars run B/0, so their heartbeats and commits are taken for another
    generation's."""
    api = FakeApi()
    add_stratajob(api, "js", kind="JobSet", retention="168h")
    ctrl = controller(api)
    job = ctrl._job("default", "js")
    job.kind = "JobSet"
    job.workload = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "js", "namespace": "default", "uid": "B"},
        "spec": {"failurePolicy": {"maxRestarts": 3}},
        "status": {"restarts": 0},
    }
    job.stratajob = api.objects[f"{SJ}/js"]
    job.status = {"phase": "Pending", "run": "B"}
    for i in range(2):
        old = jobset_pod(f"js-old-{i}", "A", 2, terminating=True)
        job.pods[old["metadata"]["name"]] = old
        new = jobset_pod(f"js-new-{i}", "B", 0)
        job.pods[new["metadata"]["name"]] = new
    await ctrl._reflect_jobset(job)
    assert job.status.get("generation") == "B/0", f"mirrored generation {job.status.get('generation')}"


# -- a StrataJob deleted under a live workload -------------------------------------------------------


async def test_a_stratajob_deleted_under_a_live_job_is_recreated() -> None:
    """`kubectl delete stratajob train` by a careless user, the garbage collector racing a
    resubmission (owned-by-workload), or the retention racing one: the controller keeps its loaded
    status and every status patch answers 404, retried every 2 s for ever. Nothing reloads or
    recreates the StrataJob: no status, no restart decision is ever recorded again."""
    api = FakeApi()
    ctrl = controller(api)
    job = watched_job(ctrl, api, "train", 2)
    del api.objects[f"{SJ}/train"]  # deleted by hand while the Job runs
    await ctrl.reconcile(job)
    await ctrl.reconcile(job)
    assert f"{SJ}/train" in api.objects, "the StrataJob of a live Job is gone for good"


async def test_a_pod_of_a_deleted_jobset_of_the_same_name_is_not_force_deleted_by_the_new_ones_fence() -> (
    None
):
    """The fence selects pods by the jobset-name label and restart-attempt only, not by the JobSet's
    uid: a pod of an earlier JobSet `js` (uid A) hanging on a lost node is force-deleted as
    "an earlier attempt" of the new `js` (uid B). The safety argument for the fence (the pod's
    generation is an earlier attempt of the same JobSet, older than the new gang's) does not hold
    for A/0, another run's generation; and B's restart never waits for A's pods anyway."""
    api = FakeApi()
    add_stratajob(api, "js", kind="JobSet", retention="168h")
    ctrl = controller(api, fence_margin_s=1.0)
    job = ctrl._job("default", "js")
    job.kind = "JobSet"
    job.workload = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "js", "namespace": "default", "uid": "B"},
        "spec": {"failurePolicy": {"maxRestarts": 3}},
        "status": {"restarts": 1},
    }
    job.stratajob = api.objects[f"{SJ}/js"]
    job.status = {"phase": "Running", "run": "B", "generation": "B/1", "restarts": 1}
    stranger = jobset_pod("js-old-0", "A", 0, terminating=True)
    stranger["status"] = {"phase": "Failed"}
    job.pods["js-old-0"] = stranger
    current = jobset_pod("js-new-0", "B", 1)
    job.pods["js-new-0"] = current
    await ctrl._reflect_jobset(job)
    deletes = [u for m, u in api.calls if m == "DELETE" and "/pods/" in u]
    assert deletes == [], f"force-deleted a pod of another JobSet incarnation: {deletes}"


# -- follow-ups of the fixes above -------------------------------------------------------------------


async def test_retention_leaves_checkpoints_created_after_the_workload_was_deleted() -> None:
    """A Checkpoint newer than workloadDeletedAt was written by a resubmission (its sidecars commit
    before the operator's watch catches up): the expiry leaves it."""
    api = FakeApi()
    add_stratajob(api, "train", deleted_at=LONG_AGO)
    add_checkpoint(api, "train", 100)
    newer = add_checkpoint(api, "train", 200)
    api.objects[f"{CP}/{newer}"]["metadata"]["creationTimestamp"] = "2021-01-01T00:00:00Z"
    ctrl = controller(api)
    await ctrl._expire("default", "train")
    assert f"{SJ}/train" not in api.objects
    assert checkpoints(api, "train") == [newer]


async def test_a_late_deleted_event_of_an_earlier_job_of_the_same_name_is_ignored() -> None:
    """Job `train` deleted and resubmitted: the earlier one's DELETED event, arriving late, must
    not mark the new one's StrataJob as deleted nor unwatch it."""
    api = FakeApi()
    add_stratajob(api, "train", retention="168h")
    ctrl = controller(api)
    job = watched_job(ctrl, api, "train", 1)
    opted = {"template": {"metadata": {"labels": {names.OPT_IN_LABEL: names.OPT_IN_VALUE}}}}
    old = {**job.workload, "spec": opted, "metadata": {"name": "train", "uid": "earlier"}}  # type: ignore[dict-item]
    await ctrl.on_job("DELETED", old)
    assert ctrl._watched(("default", "train"))
    assert "workloadDeletedAt" not in api.objects[f"{SJ}/train"]["status"]


async def test_a_jobset_named_like_a_watched_job_is_taken_up_once_the_job_is_deleted() -> None:
    api = FakeApi()
    ctrl = controller(api)
    job = watched_job(ctrl, api, "train", 1)
    assert ctrl.name_taken("default", "train", "JobSet") == "Job"
    assert ctrl.name_taken("default", "train", "Job") is None
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "train", "namespace": "default", "uid": "js-uid"},
        "spec": {"failurePolicy": {"maxRestarts": 1}},
    }
    await ctrl.on_job("ADDED", jobset)
    assert ctrl.jobs[("default", "train")].kind == "Job", "the watched Job keeps its entry"
    opted = {"template": {"metadata": {"labels": {names.OPT_IN_LABEL: names.OPT_IN_VALUE}}}}
    await ctrl.on_job("DELETED", {**job.workload, "kind": "Job", "spec": opted})  # type: ignore[dict-item]
    taken = ctrl.jobs[("default", "train")]
    assert (taken.kind, taken.uid) == ("JobSet", "js-uid")


async def test_admission_denies_an_opted_in_workload_named_like_a_watched_one_of_the_other_kind() -> None:
    from sidecar.operator import webhook

    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "train", "namespace": "default"},
        "spec": {
            "template": {
                "metadata": {"labels": {names.OPT_IN_LABEL: names.OPT_IN_VALUE}},
                "spec": {"containers": [{"name": "trainer", "image": "t:1"}], "restartPolicy": "Never"},
            }
        },
    }
    request = {"uid": "r1", "operation": "CREATE", "namespace": "default", "object": job}
    taken = webhook.validate(request, None, lambda ns, name, kind: "JobSet" if name == "train" else None)
    assert taken["response"]["allowed"] is False
    assert "metadata.name" in taken["response"]["status"]["message"]
    assert "JobSet" in taken["response"]["status"]["message"]
    free = webhook.validate(request, None, lambda ns, name, kind: None)
    assert free["response"]["allowed"] is True
