"""The operator's report endpoint against the emulated API: sidecars' reports (over HTTP and HTTPS)
become Checkpoint objects that fit the CRD, that the real kubectl shows, and that only the reporting
job's own pods, of the newest attempt, can change."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import trustme

from sidecar.operator import reports
from sidecar.operator.kube import Api
from sidecar.operator.metrics import OperatorMetrics
from sidecar.operator.names import (
    JOB_LABEL,
    JOB_NAME_LABEL,
    JOBSET_NAME_LABEL,
    LATEST_LABEL,
    OPT_IN_LABEL,
    OPT_IN_VALUE,
    REPORT_AUDIENCE,
)
from tests.k8s.conftest import K8s, call, kubectl
from tests.k8s.emulator import TOKENREVIEWS, Token
from tests.k8s.test_crds import CHECKPOINTS, install_crds, report, rows, validator

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

PODS = "/api/v1/namespaces/default/pods"


# ---- helpers -----------------------------------------------------------------------------------------


async def seed_pod(
    k8s: K8s,
    name: str,
    job: str = "recsys",
    *,
    jobset: bool = False,
    owner: str | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A running pod of ``job`` (a Job's, or with ``jobset`` a JobSet's), as the controllers make it:
    opted in, labelled, and controlled by its Job (``owner`` overrides that Job's name; "" for none)."""
    child = f"{job}-workers-0" if jobset else job
    found = {JOBSET_NAME_LABEL: job, JOB_NAME_LABEL: child} if jobset else {JOB_NAME_LABEL: job}
    found[OPT_IN_LABEL] = OPT_IN_VALUE
    owner = child if owner is None else owner
    references = (
        [
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "name": owner,
                "uid": str(uuid.uuid4()),
                "controller": True,
            }
        ]
        if owner
        else []
    )
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": found if labels is None else labels,
            "ownerReferences": references,
        },
        "spec": {"serviceAccountName": "trainer", "containers": [{"name": "trainer", "image": "t"}]},
    }
    status, created = await call(k8s, "POST", PODS, body)
    assert status in (200, 201), created
    return dict(created)


def jwt(expires: float) -> str:
    """A token shaped like a projected service-account JWT (unsigned: the emulator checks it by value)."""

    def part(data: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")

    return f"{part({'alg': 'RS256'})}.{part({'exp': int(expires), 'jti': str(uuid.uuid4())})}.c2ln"


def issue(
    k8s: K8s,
    pod: dict[str, Any],
    *,
    audiences: list[str] | None = None,
    expires: float | None = None,
    token: str | None = None,
) -> str:
    """Register a projected token for ``pod`` with the emulated TokenReview."""
    value = token or f"token-{uuid.uuid4()}"
    k8s.api.tokens[value] = Token(
        namespace=pod["metadata"]["namespace"],
        service_account="trainer",
        pod_name=pod["metadata"]["name"],
        pod_uid=pod["metadata"]["uid"],
        audiences=[REPORT_AUDIENCE] if audiences is None else audiences,
        expires=expires,
    )
    return value


def delete_item(step: int, attempt: int = 3, job: str = "recsys") -> dict[str, Any]:
    return {"kind": "delete", "namespace": "default", "job": job, "step": step, "attempt": attempt}


def heartbeat(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "heartbeat",
        "namespace": "default",
        "job": "recsys",
        "rank": 0,
        "generation": "r7k2/1",
        "attempt": 3,
        "restore_step": 1000,
        "step": 1234,
        "saves": 7,
        "time": time.time(),
    }
    body.update(changes)
    return body


def sample(metrics: OperatorMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@dataclass
class Operator:
    """The report endpoint on a loopback port, writing through an Api to the emulator."""

    k8s: K8s
    api: Api
    metrics: OperatorMetrics
    authenticator: reports.Authenticator
    writer: reports.CheckpointWriter
    server: reports.ReportServer
    url: str
    known: dict[tuple[str, str], tuple[int, int | None]] = field(default_factory=dict)
    heartbeats: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    ssl: ssl.SSLContext | None = None

    async def post(
        self, token: str | None, items: Any, *, raw: bytes | None = None
    ) -> tuple[int, dict[str, Any]]:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = raw if raw is not None else json.dumps({"reports": items}).encode()
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.url}/v1/reports", data=data, headers=headers, ssl=self.ssl or True) as resp,
        ):
            return resp.status, await resp.json(content_type=None)

    async def checkpoint(self, step: int, job: str = "recsys") -> dict[str, Any] | None:
        status, body = await call(self.k8s, "GET", f"{CHECKPOINTS}/{job}-{step:012d}")
        if status == 404:
            return None
        assert status == 200, body
        return dict(body)

    async def latest(self) -> list[str]:
        status, listing = await call(
            self.k8s, "GET", CHECKPOINTS, params={"labelSelector": f"{JOB_LABEL}=recsys,{LATEST_LABEL}=true"}
        )
        assert status == 200, listing
        return [item["metadata"]["name"] for item in listing["items"]]


class ApiserverLikeApi(Api):
    """Drops status from a Checkpoint create, as a real apiserver does when the CRD has the status
    subresource (the emulator keeps it)."""

    async def create(self, url: str, body: Any) -> dict[str, Any]:
        if url.endswith("/checkpoints"):
            body = {key: value for key, value in body.items() if key != "status"}
        return await super().create(url, body)


async def start_operator(
    k8s: K8s,
    *,
    api_class: type[Api] = Api,
    clock: Callable[[], float] = time.time,
    ssl_context: ssl.SSLContext | None = None,
    client_ssl: ssl.SSLContext | None = None,
    max_body_bytes: int = reports.MAX_BODY_BYTES,
) -> Operator:
    api = api_class(k8s.url)
    metrics = OperatorMetrics()
    known: dict[tuple[str, str], tuple[int, int | None]] = {}
    beats: list[tuple[dict[str, Any], str]] = []

    async def on_heartbeat(item: Any, pod: str) -> None:
        beats.append((dict(item), pod))

    authenticator = reports.Authenticator(api, clock=clock)
    writer = reports.CheckpointWriter(
        api, attempt_of=lambda ns, job: known.get((ns, job)), on_heartbeat=on_heartbeat, metrics=metrics
    )
    app = reports.make_app(authenticator, writer, metrics, max_body_bytes=max_body_bytes)
    server = await reports.start_server(app, "127.0.0.1", 0, ssl_context)
    scheme = "https" if ssl_context is not None else "http"
    host = "localhost" if ssl_context is not None else "127.0.0.1"
    return Operator(
        k8s,
        api,
        metrics,
        authenticator,
        writer,
        server,
        f"{scheme}://{host}:{server.port}",
        known,
        beats,
        client_ssl,
    )


async def stop_operator(op: Operator) -> None:
    await op.server.close()
    await op.api.close()


@pytest_asyncio.fixture
async def op(k8s: K8s) -> AsyncIterator[Operator]:
    await install_crds(k8s)
    running = await start_operator(k8s)
    try:
        yield running
    finally:
        await stop_operator(running)


@pytest_asyncio.fixture
async def token(k8s: K8s, op: Operator) -> str:
    """A token of pod recsys-0 of Job recsys."""
    return issue(k8s, await seed_pod(k8s, "recsys-0"))


# ---- commits to Checkpoints --------------------------------------------------------------------------


async def test_commit_report_creates_ready_checkpoint_shown_by_kubectl(
    k8s: K8s, op: Operator, token: str
) -> None:
    status, answer = await op.post(token, [report(1200)])
    assert (status, answer) == (200, {"accepted": 1, "rejected": []})
    stored = await op.checkpoint(1200)
    assert stored is not None
    validator("checkpoints.strata.dev").validate(stored)
    assert stored["metadata"]["labels"] == {JOB_LABEL: "recsys", LATEST_LABEL: "true"}
    assert "ownerReferences" not in stored["metadata"]  # outlives the Job
    assert stored["spec"]["attempt"] == 3 and stored["spec"]["ranks"][1]["rank"] == 1
    assert stored["status"]["ready"] is True and stored["status"]["ranks"] == "2/2"
    [ready] = stored["status"]["conditions"]
    assert ready["type"] == "Ready" and ready["status"] == "True"

    listing = rows(await kubectl(k8s, "get", "checkpoints"))
    assert listing[0] == [
        "NAME",
        "JOB",
        "STEP",
        "TYPE",
        "BASE",
        "RANKS",
        "BYTES",
        "BITS",
        "READY",
        "RESTORED",
        "AGE",
    ]
    assert listing[1][:9] == [
        "recsys-000000001200",
        "recsys",
        "1200",
        "diff",
        "1000",
        "2/2",
        "3145728",
        "4",
        "True",
    ]
    text = await kubectl(k8s, "describe", "checkpoint", "recsys-000000001200")
    for rank in range(2):
        assert f"prefix/default/recsys/steps/000000001200/a3/rank-{rank}.manifest" in text
    assert "Events:" in text and "Committed" in text
    assert "step 1200 attempt 3 committed by 2/2 ranks, 3145728 bytes" in text

    assert sample(op.metrics, "strata_operator_reports_total", kind="commit", result="accepted") == 1
    assert sample(op.metrics, "strata_operator_report_to_cr_seconds_count") == 1
    assert sample(op.metrics, "strata_operator_api_calls_total") == op.api.calls > 0


async def test_the_restore_class_the_ranks_report_is_written_on_the_checkpoint(
    k8s: K8s, op: Operator, token: str
) -> None:
    assert (await op.post(token, [report(1200)]))[1]["accepted"] == 1
    beat = heartbeat(restore_source="memory", restored_step=1200, restore_class="exact")
    assert (await op.post(token, [beat]))[1]["accepted"] == 1
    stored = await op.checkpoint(1200)
    assert stored is not None
    validator("checkpoints.strata.dev").validate(stored)
    last = stored["status"]["lastRestore"]
    assert (last["source"], last["restoreClass"], last["memory"]) == ("memory", "exact", 1)
    wide = rows(await kubectl(k8s, "get", "checkpoints", "-o", "wide"))
    assert wide[1][wide[0].index("CLASS")] == "exact"
    _, answer = await op.post(token, [{**beat, "restore_class": "lossy"}])
    assert answer["accepted"] == 0 and "restore_class" in json.dumps(answer["rejected"])


async def test_partial_commit_is_not_ready_then_recommit_by_newer_attempt_updates_it(
    op: Operator, token: str
) -> None:
    status, answer = await op.post(token, [report(1200, world_size=4)])
    assert answer["accepted"] == 1
    first = await op.checkpoint(1200)
    assert first is not None and first["status"]["ranks"] == "2/4" and first["status"]["ready"] is False
    newer = report(1200, attempt=4, type="full", base_step=None, requires=[], bits=None)
    status, answer = await op.post(token, [newer])
    assert (status, answer["accepted"]) == (200, 1)
    second = await op.checkpoint(1200)
    assert second is not None
    validator("checkpoints.strata.dev").validate(second)
    assert second["spec"]["attempt"] == 4 and second["spec"]["type"] == "full"
    assert second["spec"].get("baseStep") is None and second["spec"].get("bits") is None
    assert second["metadata"]["generation"] == 2
    assert second["status"]["ready"] is True and second["status"]["observedAttempt"] == 4
    assert second["status"]["conditions"][0]["observedGeneration"] == 2
    assert second["metadata"]["labels"][LATEST_LABEL] == "true"


async def test_second_batch_with_same_token_costs_no_tokenreview_nor_pod_lookup(
    k8s: K8s, op: Operator, token: str
) -> None:
    before = op.api.calls
    assert (await op.post(token, [report(1000)]))[1]["accepted"] == 1
    # TokenReview, GET pod, LIST the job's Checkpoints (first sight), POST Checkpoint, POST Event. (The
    # emulator keeps status on create; a real apiserver costs one status PATCH more.)
    assert op.api.calls - before == 5
    before = op.api.calls
    assert (await op.post(token, [report(1200)]))[1]["accepted"] == 1
    # POST Checkpoint, PATCH the previous latest's label, POST Event: no TokenReview, no pod GET.
    assert op.api.calls - before == 3
    before = op.api.calls
    assert (await op.post(token, [heartbeat(), heartbeat(rank=1)]))[1]["accepted"] == 2
    # The first heartbeat naming an attempt costs one LIST (Checkpoints it fenced off are swept)...
    assert op.api.calls - before == 1
    before = op.api.calls
    assert (await op.post(token, [heartbeat(), heartbeat(rank=1)]))[1]["accepted"] == 2
    assert op.api.calls == before  # ...later ones cost no API call at all
    reviews = [r for r in k8s.api if r.resource == TOKENREVIEWS]
    assert len(reviews) == 1
    assert sample(op.metrics, "strata_operator_api_calls_total") == op.api.calls


async def test_token_cache_expires_after_ttl_and_never_outlives_token(k8s: K8s) -> None:
    await install_crds(k8s)
    now = [time.time()]
    op = await start_operator(k8s, clock=lambda: now[0])
    try:
        pod = await seed_pod(k8s, "recsys-0")
        token = issue(k8s, pod)
        for _ in range(2):
            assert (await op.post(token, [heartbeat()]))[0] == 200
        assert len([r for r in k8s.api if r.resource == TOKENREVIEWS]) == 1
        now[0] += 61  # past the TTL: reviewed again
        assert (await op.post(token, [heartbeat()]))[0] == 200
        assert len([r for r in k8s.api if r.resource == TOKENREVIEWS]) == 2

        short = issue(k8s, pod, token=jwt(now[0] + 5), expires=now[0] + 5)
        assert (await op.post(short, [heartbeat()]))[0] == 200
        now[0] += 10  # the token expired (its own exp) well within the TTL: the cache does not vouch
        status, answer = await op.post(short, [heartbeat()])
        assert status == 401 and "expired" in answer["error"]
    finally:
        await stop_operator(op)


async def test_status_written_through_subresource_when_create_drops_it(k8s: K8s) -> None:
    await install_crds(k8s)
    op = await start_operator(k8s, api_class=ApiserverLikeApi)
    try:
        token = issue(k8s, await seed_pod(k8s, "recsys-0"))
        assert (await op.post(token, [report(1200)]))[1]["accepted"] == 1
        stored = await op.checkpoint(1200)
        assert stored is not None and stored["status"]["ready"] is True
        validator("checkpoints.strata.dev").validate(stored)
        patches = [r for r in k8s.api if r.method == "PATCH" and r.subresource == "status"]
        assert len(patches) == 1 and patches[0].name == "recsys-000000001200"
    finally:
        await stop_operator(op)


async def test_concurrent_batches_leave_one_latest(op: Operator, token: str) -> None:
    answers = await asyncio.gather(*(op.post(token, [report(step)]) for step in range(1000, 1400, 20)))
    assert all(answer == (200, {"accepted": 1, "rejected": []}) for answer in answers)
    assert await op.latest() == ["recsys-000000001380"]
    op.writer.forget("default", "recsys")
    assert op.writer.latest("default", "recsys") is None
    assert (await op.post(token, [delete_item(1380)]))[1]["accepted"] == 1  # relearned by one LIST
    assert await op.latest() == ["recsys-000000001360"]


# ---- authentication and authorization ---------------------------------------------------------------


async def test_tokenreview_forged_token_refused(op: Operator, token: str) -> None:
    status, answer = await op.post("forged-" + token, [report(1200)])
    assert status == 401 and "invalid bearer token" in answer["error"]
    assert "forged-" not in json.dumps(answer)  # the token is never echoed
    status, answer = await op.post(None, [report(1200)])
    assert status == 401 and "bearer" in answer["error"]
    assert await op.checkpoint(1200) is None
    assert sample(op.metrics, "strata_operator_report_rejections_total", reason="token") == 2


async def test_tokenreview_expired_token_refused(k8s: K8s, op: Operator) -> None:
    pod = await seed_pod(k8s, "recsys-0")
    stale = issue(k8s, pod, expires=time.time() - 1)
    status, answer = await op.post(stale, [report(1200)])
    assert status == 401 and "expired" in answer["error"]
    stale_jwt = issue(k8s, pod, token=jwt(time.time() - 1))
    calls = op.api.calls
    status, answer = await op.post(stale_jwt, [report(1200)])
    assert status == 401 and "expired" in answer["error"]
    assert op.api.calls == calls  # an expired JWT is refused without asking the apiserver
    assert await op.checkpoint(1200) is None


async def test_tokenreview_wrong_audience_refused(k8s: K8s, op: Operator) -> None:
    pod = await seed_pod(k8s, "recsys-0")
    kube_token = issue(k8s, pod, audiences=["https://kubernetes.default.svc.cluster.local"])
    status, answer = await op.post(kube_token, [report(1200)])
    assert status == 401 and "audience" in answer["error"]
    assert await op.checkpoint(1200) is None


async def test_report_for_another_job_forbidden(k8s: K8s, op: Operator, token: str) -> None:
    ranker = issue(k8s, await seed_pod(k8s, "ranker-0", job="ranker"))
    # One item about another job refuses the whole batch, naming the pod and the job.
    status, answer = await op.post(ranker, [report(1200, job="ranker"), report(1200)])
    assert status == 403
    assert "default/ranker-0" in answer["error"] and "default/recsys" in answer["error"]
    assert await op.checkpoint(1200) is None and await op.checkpoint(1200, job="ranker") is None
    # Another namespace is another job too.
    status, answer = await op.post(token, [report(1200, namespace="prod")])
    assert status == 403 and "prod/recsys" in answer["error"]
    assert sample(op.metrics, "strata_operator_report_rejections_total", reason="forbidden") == 2
    assert sample(op.metrics, "strata_operator_reports_total", kind="commit", result="rejected") == 3
    # Its own job is fine.
    assert (await op.post(token, [report(1200)]))[1]["accepted"] == 1


async def test_a_label_alone_does_not_make_a_pod_part_of_a_job(k8s: K8s, op: Operator) -> None:
    # Anyone who can create a pod can label it: the Job controller's ownerReference decides.
    bare = issue(k8s, await seed_pod(k8s, "fake-0", owner=""))
    other = issue(k8s, await seed_pod(k8s, "fake-1", owner="ranker"))  # recsys label, ranker's pod
    unopted = issue(k8s, await seed_pod(k8s, "fake-2", labels={JOB_NAME_LABEL: "recsys"}))
    for token in (bare, other, unopted):
        status, answer = await op.post(token, [report(1200)])
        assert status == 403 and "may not report about job default/recsys" in answer["error"]
    assert await op.checkpoint(1200) is None


async def test_a_refused_token_is_answered_from_memory_for_a_while(k8s: K8s, op: Operator) -> None:
    for _ in range(3):
        status, _answer = await op.post("forged", [report(1200)])
        assert status == 401
    assert len([r for r in k8s.api if r.resource == TOKENREVIEWS]) == 1


async def test_token_of_deleted_or_replaced_pod_forbidden(k8s: K8s, op: Operator) -> None:
    pod = await seed_pod(k8s, "recsys-0")
    token = issue(k8s, pod)
    status, _ = await call(k8s, "DELETE", f"{PODS}/recsys-0")
    assert status == 200
    status, answer = await op.post(token, [report(1200)])
    assert status == 403 and "does not exist" in answer["error"]
    await seed_pod(k8s, "recsys-0")  # same name, another pod (uid)
    status, answer = await op.post(token, [report(1200)])
    assert status == 403 and "uid" in answer["error"]
    assert await op.checkpoint(1200) is None


async def test_jobset_pod_reports_about_its_jobset(k8s: K8s, op: Operator) -> None:
    token = issue(k8s, await seed_pod(k8s, "trainset-workers-0-0-x", job="trainset", jobset=True))
    status, answer = await op.post(token, [report(1200, job="trainset")])
    assert (status, answer["accepted"]) == (200, 1)
    assert await op.checkpoint(1200, job="trainset") is not None


# ---- attempts, latest, retention --------------------------------------------------------------------


async def test_superseded_attempt_never_changes_checkpoint(op: Operator, token: str) -> None:
    # The controller knows attempt 4, restored from step 1000.
    op.known[("default", "recsys")] = (4, 1000)
    status, answer = await op.post(token, [report(1200, attempt=3), report(1000, attempt=3)])
    assert status == 200 and answer["accepted"] == 1
    [refused] = answer["rejected"]
    assert refused["index"] == 0 and "superseded by attempt 4" in refused["error"]
    assert await op.checkpoint(1200) is None
    assert await op.checkpoint(1000) is not None  # at or below the restore step: a real checkpoint

    # A Checkpoint written by attempt 4 is never changed by a late report of attempt 3.
    assert (await op.post(token, [report(1400, attempt=4)]))[1]["accepted"] == 1
    op.known.clear()
    stored = await op.checkpoint(1400)
    assert stored is not None
    status, answer = await op.post(token, [report(1400, attempt=3, bytes=1)])
    assert "holds attempt 4" in answer["rejected"][0]["error"]
    after = await op.checkpoint(1400)
    assert after is not None and after["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]

    # Heartbeats tell the writer of a newer attempt too (restored nothing: every older step is
    # fenced off in storage), and the Checkpoints of those steps go: none can be restored.
    assert (await op.post(token, [heartbeat(attempt=5, restore_step=None)]))[1]["accepted"] == 1
    status, answer = await op.post(token, [report(1600, attempt=4)])
    assert "restored nothing" in answer["rejected"][0]["error"]
    assert await op.checkpoint(1600) is None
    assert sample(op.metrics, "strata_operator_report_rejections_total", reason="superseded") == 3
    assert await op.checkpoint(1400) is None and await op.checkpoint(1000) is None
    assert await op.latest() == []


async def test_a_new_attempt_sweeps_the_checkpoints_it_fenced_off_and_moves_latest(
    op: Operator, token: str
) -> None:
    assert (await op.post(token, [report(s, attempt=2) for s in (1000, 1200, 1400)]))[1]["accepted"] == 3
    assert await op.latest() == ["recsys-000000001400"]
    # Attempt 3 rolled back to step 1200: 1400 of attempt 2 is fenced off, 1000 and 1200 stay valid.
    assert (await op.post(token, [heartbeat(attempt=3, restore_step=1200)]))[1]["accepted"] == 1
    assert await op.checkpoint(1400) is None
    assert await op.checkpoint(1000) is not None and await op.checkpoint(1200) is not None
    assert await op.latest() == ["recsys-000000001200"]


async def test_latest_label_moves(k8s: K8s, op: Operator, token: str) -> None:
    assert (await op.post(token, [report(1000), report(1200)]))[1]["accepted"] == 2
    assert await op.latest() == ["recsys-000000001200"]
    old = await op.checkpoint(1000)
    assert old is not None and old["metadata"]["labels"][LATEST_LABEL] == "false"
    # A late report of an older step does not take the label.
    assert (await op.post(token, [report(1100)]))[1]["accepted"] == 1
    assert await op.latest() == ["recsys-000000001200"]
    assert (await op.post(token, [report(1400)]))[1]["accepted"] == 1
    assert await op.latest() == ["recsys-000000001400"]
    listing = rows(await kubectl(k8s, "get", "ckpt", "-l", f"{JOB_LABEL}=recsys,{LATEST_LABEL}=true"))
    assert [row[0] for row in listing[1:]] == ["recsys-000000001400"]

    # A new operator (restart) learns the job with one LIST and repairs a half-moved label.
    status, _ = await call(
        k8s, "PATCH", f"{CHECKPOINTS}/recsys-000000001200", {"metadata": {"labels": {LATEST_LABEL: "true"}}}
    )
    assert status == 200
    fresh = await start_operator(k8s)
    try:
        assert (await fresh.post(token, [report(1300)]))[1]["accepted"] == 1
        assert await fresh.latest() == ["recsys-000000001400"]
        assert fresh.writer.latest("default", "recsys") == 1400
    finally:
        await stop_operator(fresh)


async def test_two_writers_in_turn_leave_one_latest_once_the_stale_one_reloads(
    k8s: K8s, op: Operator, token: str
) -> None:
    """Two operator processes overlapping (an upgrade, a drained pod finishing its writes): the one
    whose knowledge is stale would leave a second Checkpoint labelled latest; it reloads what it
    knows after ``reload_s``, which repairs the labels before its next commit."""
    assert (await op.post(token, [report(1000)]))[1]["accepted"] == 1
    other = await start_operator(k8s)
    try:
        assert (await other.post(token, [report(1200)]))[1]["accepted"] == 1
    finally:
        await stop_operator(other)
    assert await op.latest() == ["recsys-000000001200"]
    op.writer.reload_s = 0.0  # what RELOAD_S does in time
    assert (await op.post(token, [report(1400)]))[1]["accepted"] == 1
    assert await op.latest() == ["recsys-000000001400"]


async def test_retention_delete_removes_checkpoint(op: Operator, token: str) -> None:
    assert (await op.post(token, [report(1000), report(1200)]))[1]["accepted"] == 2
    # Another attempt's retention never deletes this attempt's Checkpoint.
    assert (await op.post(token, [delete_item(1000, attempt=2)]))[1]["accepted"] == 1
    assert await op.checkpoint(1000) is not None
    status, answer = await op.post(token, [delete_item(1200)])
    assert (status, answer) == (200, {"accepted": 1, "rejected": []})
    assert await op.checkpoint(1200) is None
    assert await op.latest() == ["recsys-000000001000"]  # the next newest takes the label
    # Gone already: nothing to do.
    assert (await op.post(token, [delete_item(1200), delete_item(1000)]))[1]["accepted"] == 2
    assert await op.checkpoint(1000) is None and await op.latest() == []
    assert op.writer.latest("default", "recsys") is None
    assert sample(op.metrics, "strata_operator_reports_total", kind="delete", result="accepted") == 4


async def test_invalid_item_rejected_others_accepted(op: Operator, token: str) -> None:
    items = [
        report(1000),
        {**report(1200), "step": "1200"},
        {**report(1400), "ranks": [{"rank": 0}]},
        {"kind": "gossip", "namespace": "default", "job": "recsys"},
        "not an object",
        delete_item(-1),
        heartbeat(rank="zero"),
        heartbeat(),
    ]
    status, answer = await op.post(token, items)
    assert status == 200 and answer["accepted"] == 2
    errors = {r["index"]: r["error"] for r in answer["rejected"]}
    assert sorted(errors) == [1, 2, 3, 4, 5, 6]
    assert "'step'" in errors[1] and "'ranks[0].encodings'" in errors[2]
    assert "'kind'" in errors[3] and "object" in errors[4]
    assert "'step'" in errors[5] and "'rank'" in errors[6]
    assert await op.checkpoint(1000) is not None and await op.checkpoint(1400) is None
    assert sample(op.metrics, "strata_operator_report_rejections_total", reason="invalid") == 6
    assert sample(op.metrics, "strata_operator_reports_total", kind="unknown", result="rejected") == 2
    assert len(op.heartbeats) == 1


async def test_heartbeat_goes_to_the_controller_with_the_pod(op: Operator, token: str) -> None:
    beat = heartbeat(attempt=None, restore_step=None, step=None)
    assert (await op.post(token, [beat]))[1]["accepted"] == 1
    assert op.heartbeats == [(beat, "recsys-0")]
    assert op.writer.attempt("default", "recsys") is None  # no attempt yet: nothing learned
    assert (await op.post(token, [heartbeat(attempt=6, restore_step=1200)]))[1]["accepted"] == 1
    assert op.writer.attempt("default", "recsys") == (6, 1200)
    op.known[("default", "recsys")] = (7, None)  # the controller knows newer
    assert op.writer.attempt("default", "recsys") == (7, None)


async def test_malformed_body_refused(k8s: K8s, token: str) -> None:
    small = await start_operator(k8s, max_body_bytes=4096)
    try:
        for raw, message in [
            (b"{not json", "not JSON"),
            (b'{"items": []}', '"reports" list'),
            (b'{"reports": {"kind": "commit"}}', '"reports" list'),
            (b"[]", '"reports" list'),
            (json.dumps({"reports": [report(1200)] * 10}).encode(), "larger than 4096"),
        ]:
            status, answer = await small.post(token, None, raw=raw)
            assert status == 400 and message in answer["error"], (raw[:40], answer)
        status, answer = await small.post(token, [heartbeat()] * (reports.MAX_ITEMS + 1), raw=None)
        assert status == 400  # over the body cap or the item cap, either way refused
    finally:
        await stop_operator(small)


async def test_api_failure_answers_503_and_batch_can_be_resent(k8s: K8s) -> None:
    op = await start_operator(k8s)  # no CRDs installed: the Checkpoint API answers 404
    try:
        token = issue(k8s, await seed_pod(k8s, "recsys-0"))
        status, answer = await op.post(token, [report(1200), heartbeat()])
        assert status == 503 and "report 0" in answer["error"]
        assert sample(op.metrics, "strata_operator_reconcile_errors_total") == 1
        await install_crds(k8s)
        assert (await op.post(token, [heartbeat(), report(1200)]))[1]["accepted"] == 2
        assert await op.latest() == ["recsys-000000001200"]
    finally:
        await stop_operator(op)


async def test_healthz(op: Operator) -> None:
    async with aiohttp.ClientSession() as session, session.get(f"{op.url}/healthz") as resp:
        assert resp.status == 200 and await resp.text() == "ok"


async def test_report_over_https(k8s: K8s, tmp_path: Path) -> None:
    await install_crds(k8s)
    ca = trustme.CA()
    leaf = ca.issue_cert("localhost", "strata-operator.strata-system.svc")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    key.write_bytes(leaf.private_key_pem.bytes())
    client = ssl.create_default_context()
    ca.configure_trust(client)
    op = await start_operator(
        k8s, ssl_context=reports.server_ssl_context(str(cert), str(key)), client_ssl=client
    )
    try:
        token = issue(k8s, await seed_pod(k8s, "recsys-0"))
        status, answer = await op.post(token, [report(1200)])
        assert (status, answer) == (200, {"accepted": 1, "rejected": []})
        assert await op.checkpoint(1200) is not None
        # A client that does not trust the operator's CA does not get through.
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await Operator(**{**op.__dict__, "ssl": ssl.create_default_context()}).post(token, [])
    finally:
        await stop_operator(op)


async def test_metrics_use_their_own_registry_and_prometheus_names() -> None:
    first, second = OperatorMetrics(), OperatorMetrics()
    first.report("commit", "accepted")
    first.reject("superseded")
    first.restarts.labels(reason="PodFailed").inc()
    first.watched_jobs.set(3)
    assert sample(second, "strata_operator_reports_total", kind="commit", result="accepted") == 0
    assert sample(first, "strata_operator_reports_total", kind="commit", result="accepted") == 1
    assert sample(first, "strata_operator_restarts_total", reason="PodFailed") == 1
    assert sample(first, "strata_operator_watched_jobs") == 3
    assert sample(first, "strata_operator_report_rejections_total", reason="token") == 0
    names = {m.name for m in first.registry.collect()}
    assert names == {
        "strata_operator_reports",
        "strata_operator_report_rejections",
        "strata_operator_report_to_cr_seconds",
        "strata_operator_restarts",
        "strata_operator_disruptions",
        "strata_operator_reconcile_errors",
        "strata_operator_watched_jobs",
        "strata_operator_api_calls",
        "strata_operator_jobs_failed",
        "strata_operator_tls_changes",
        "strata_operator_tls_certificate_expiry_timestamp_seconds",
        "strata_operator_retention_deletions",
    }
    with pytest.raises(ValueError, match="reason"):
        first.reject("bored")
