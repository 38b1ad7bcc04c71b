"""A real sidecar (real gRPC, SeaweedFS) reporting to a small HTTP receiver standing in for the
operator: commit reports the operator's Checkpoint builder accepts, the token read at every send,
reports that wait out an operator outage without holding commits back, a flush at shutdown,
retention deletes, heartbeats, re-reports at start; and the operator's one-shot restore request
(a rollback, a fresh start, a refused step), recorded in the EPOCH."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import settled
from statecheck import assert_bitwise_equal, flat_tensors, small_model, train_steps

from sidecar import manifest as mf
from sidecar import reporting
from sidecar.operator.objects import checkpoint_body
from sidecar.store import open_store
from tests.fixtures.report_receiver import Receiver
from trainer_client import RestartLimitSpent, RestoreError


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(reporting, "BACKOFF_INITIAL_S", 0.05)
    monkeypatch.setattr(reporting, "BACKOFF_MAX_S", 0.2)


def _steps(items: list[dict[str, Any]]) -> list[int]:
    return sorted(i["step"] for i in items)


def test_commits_are_reported_as_checkpoints_the_operator_accepts(
    make_sidecar, make_client, job_name, s3_store_url, receiver, short_tmp
):
    url, endpoint = s3_store_url
    token = short_tmp / "token"
    token.write_text("token-1")
    server = make_sidecar(
        url, s3_endpoint=endpoint, report_url=receiver.url, report_token_file=str(token), heartbeat_s=0.1
    )
    client = make_client(server, job_name, capture_rng=False)
    emb = torch.zeros(64, 8)
    client.save(1, {"emb": emb, "w": torch.arange(16.0)}).durable.result(30)
    receiver.wait("commit", lambda got: len(got) >= 1)
    rotated = short_tmp / "token.new"  # as the kubelet rotates a projected token: atomically
    rotated.write_text("token-2")
    rotated.replace(token)  # the next send carries the new one
    emb[3] += 1
    client.save(2, {"emb": emb, "w": torch.arange(16.0)}).durable.result(30)
    commits = receiver.wait("commit", lambda got: len(got) >= 2)
    assert _steps(commits) == [1, 2]
    store = open_store(url, endpoint_url=endpoint)
    try:
        for item in commits:
            body = checkpoint_body(item)  # what the operator turns into a Checkpoint object
            assert body["metadata"]["name"] == f"{job_name}-{item['step']:012d}"
            commit_bytes = store.get(item["commit_key"])
            assert item["commit_sha256"] == mf.sha256(commit_bytes)
            commit = mf.Commit.from_json(commit_bytes)
            assert (item["attempt"], item["world_size"], item["bytes"]) == (
                commit.attempt,
                1,
                commit.total_bytes,
            )
            assert item["generation"] == commit.generation and "/" in item["generation"]
            assert item["location"] == url + f"/default/{job_name}"
            [rank] = item["ranks"]
            assert rank["sha256"] == mf.sha256(store.get(rank["manifest_key"]))
            assert sum(rank["encodings"].values()) == 2
        by_step = {i["step"]: i for i in commits}
        assert by_step[1]["type"] == "full" and by_step[1]["base_step"] is None
        if by_step[2]["type"] == "diff":  # the policy's choice; its base is then step 1
            assert by_step[2]["base_step"] == 1 and by_step[2]["requires"] == [1]
        assert by_step[1]["bits"] is None  # lossless
    finally:
        store.close()
    with receiver.lock:
        auths = {p["auth"] for p in receiver.posts}
    assert {"Bearer token-1", "Bearer token-2"} <= auths
    beats = receiver.wait("heartbeat", lambda got: any(b["step"] == 2 and b["saves"] == 2 for b in got))
    beat = next(b for b in beats if b["step"] == 2)
    assert beat["rank"] == 0 and beat["job"] == job_name and beat["namespace"] == "default"
    assert isinstance(beat["attempt"], int) and beat["restore_step"] is None
    assert beat["generation"] == by_step[2]["generation"] and isinstance(beat["time"], float)


def test_commits_go_on_while_the_operator_is_down_and_reports_arrive_when_it_is_back(
    make_sidecar, make_client, job_name, s3_store_url
):
    url, endpoint = s3_store_url
    gone = Receiver()
    port = gone.port
    gone.stop()  # nothing listens: every send fails
    server = make_sidecar(url, s3_endpoint=endpoint, report_url=f"http://127.0.0.1:{port}", heartbeat_s=0)
    client = make_client(server, job_name, capture_rng=False)
    t0 = time.monotonic()
    for step in (1, 2, 3):
        client.save(step, {"w": torch.full((32,), float(step))}).durable.result(30)
    assert time.monotonic() - t0 < 20
    assert server.metrics.registry.get_sample_value("strata_report_queue_depth") >= 3
    back = Receiver(port)
    try:
        commits = back.wait("commit", lambda got: len(got) >= 3)
        assert _steps(commits) == [1, 2, 3]
    finally:
        back.stop()


def test_shutdown_flushes_queued_reports(make_sidecar, make_client, job_name, s3_store_url, receiver):
    url, endpoint = s3_store_url
    receiver.busy.set()  # the operator is busy: the commit report waits in the queue
    server = make_sidecar(url, s3_endpoint=endpoint, report_url=receiver.url, heartbeat_s=0)
    client = make_client(server, job_name, capture_rng=False)
    client.save(1, {"w": torch.ones(8)}).durable.result(30)
    client.close()
    depth = settled(lambda: server.metrics.registry.get_sample_value("strata_report_queue_depth"), 2)
    assert depth == 2  # commit, heartbeat: waiting (a batch being retried is counted once it is back)
    assert receiver.items("commit") == []
    threading.Timer(0.3, receiver.busy.clear).start()  # back while the sidecar stops
    server.stop(grace=1)  # flushes within its bounded wait
    assert _steps(receiver.items("commit")) == [1]


def test_retention_deletes_are_reported_with_the_attempt(
    make_sidecar, make_client, job_name, s3_store_url, receiver
):
    url, endpoint = s3_store_url
    server = make_sidecar(url, s3_endpoint=endpoint, report_url=receiver.url, heartbeat_s=0, keep=2)
    client = make_client(server, job_name, capture_rng=False)
    for step in range(1, 5):
        client.save(step, {"w": torch.full((8,), float(step)), "p": torch.zeros(4)}).durable.result(30)
    commits = receiver.wait("commit", lambda got: len(got) >= 4)
    deletes = receiver.wait("delete", lambda got: len(got) >= 2)
    attempt = commits[0]["attempt"]
    assert sorted((d["step"], d["attempt"]) for d in deletes) == [(1, attempt), (2, attempt)]
    assert all(d["job"] == job_name and d["namespace"] == "default" for d in deletes)


def test_a_new_attempt_re_reports_every_retained_committed_step(
    make_sidecar, make_client, job_name, s3_store_url, receiver
):
    url, endpoint = s3_store_url
    quiet = make_sidecar(url, s3_endpoint=endpoint)  # the operator heard nothing of these
    first = make_client(quiet, job_name, capture_rng=False, generation="rr/0")
    for step in (1, 2, 3):
        first.save(step, {"w": torch.full((8,), float(step))}).durable.result(30)
    first.close()
    quiet.stop(grace=1)
    server = make_sidecar(url, s3_endpoint=endpoint, report_url=receiver.url, heartbeat_s=0)
    later = make_client(server, job_name, capture_rng=False, generation="rr/1")
    out = {"w": torch.zeros(8)}
    assert later.restore(out) == 3  # the new attempt is created by this restore
    commits = receiver.wait("commit", lambda got: len(got) >= 3)
    assert _steps(commits) == [1, 2, 3]
    for item in commits:
        checkpoint_body(item)
        assert item["generation"] == "rr/0"


# --- the operator's one-shot restore request ---------------------------------------------------


@pytest.fixture
def gang_files(short_tmp):
    """The pod's downward-API files: the generation and the restore request."""
    generation, request = short_tmp / "generation", short_tmp / "restore-request"

    def write(gen: str, req: str | None = None) -> None:
        generation.write_text(gen)
        if req is None:
            request.unlink(missing_ok=True)
        else:
            request.write_text(req)

    write.options = {"generation_file": str(generation), "restore_request_file": str(request)}  # type: ignore[attr-defined]
    return write


def _three_steps(make_sidecar, make_client, job_name, url, endpoint, gang_files):
    gang_files("req/0")
    server = make_sidecar(url, s3_endpoint=endpoint, **gang_files.options)
    client = make_client(server, job_name)
    model = small_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    saved = {}
    for step in (1, 2, 3):
        train_steps(model, opt, 1, seed=step)
        client.save(step, {"model": model, "opt": opt}).durable.result(30)
        saved[step] = {"model": flat_tensors(model), "opt": flat_tensors(opt.state_dict())}
    client.close()
    return server, saved


def _epoch(url, endpoint, job):
    store = open_store(url, endpoint_url=endpoint)
    try:
        return mf.read_fences(store, "default", job).newest, mf.committed_steps(store, "default", job)
    finally:
        store.close()


def test_a_restore_request_rolls_back_to_that_step_bitwise(
    make_sidecar, make_client, job_name, s3_store_url, gang_files
):
    url, endpoint = s3_store_url
    server, saved = _three_steps(make_sidecar, make_client, job_name, url, endpoint, gang_files)
    gang_files("req/1", "2\n")
    client = make_client(server, job_name)
    model = small_model(seed=7)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    assert client.restore({"model": model, "opt": opt}) == 2
    assert_bitwise_equal(flat_tensors(model), saved[2]["model"])
    assert_bitwise_equal(flat_tensors(opt.state_dict()), saved[2]["opt"])
    epoch, steps = _epoch(url, endpoint, job_name)
    assert (epoch.generation, epoch.restore_step, epoch.restore_reason) == ("req/1", 2, "requested")
    assert steps == [1, 2]  # step 3 of the older attempt is fenced off: the rollback stays rolled back
    train_steps(model, opt, 1, seed=9)
    assert client.save(3, {"model": model, "opt": opt}).durable.result(30).step == 3


def test_a_restore_request_of_none_starts_fresh(
    make_sidecar, make_client, job_name, s3_store_url, gang_files
):
    url, endpoint = s3_store_url
    server, _ = _three_steps(make_sidecar, make_client, job_name, url, endpoint, gang_files)
    gang_files("req/1", "none")
    client = make_client(server, job_name)
    with pytest.raises(RestoreError, match="no committed checkpoint"):
        client.restore({"w": torch.zeros(4)})
    epoch, steps = _epoch(url, endpoint, job_name)
    assert (epoch.restore_step, epoch.restore_attempt, epoch.restore_reason) == (None, None, "fresh")
    assert steps == []  # every older commit is invalid now
    assert client.save(1, {"w": torch.ones(4)}).durable.result(30).step == 1  # from step 0 again
    assert _epoch(url, endpoint, job_name)[1] == [1]


def test_a_stop_request_makes_the_trainer_exit_76_and_touches_nothing(
    make_sidecar, make_client, job_name, s3_store_url, gang_files
):
    """The restart limit is spent: the operator releases the replacements with "stop", so their
    trainers exit 76 and the Job's podFailurePolicy (FailJob) ends the Job."""
    url, endpoint = s3_store_url
    server, _ = _three_steps(make_sidecar, make_client, job_name, url, endpoint, gang_files)
    before = _epoch(url, endpoint, job_name)
    gang_files("req/0", "stop")
    with pytest.raises(RestartLimitSpent) as stopped:  # refused at the handshake: it never trains
        make_client(server, job_name)
    assert stopped.value.code == 76 and "restart limit is spent" in str(stopped.value)
    assert _epoch(url, endpoint, job_name) == before  # no attempt created, no step lost


@pytest.mark.parametrize("request_text", ["7", "soon"])
def test_a_restore_request_of_an_unusable_step_is_refused_naming_it(
    make_sidecar, make_client, job_name, s3_store_url, gang_files, request_text
):
    url, endpoint = s3_store_url
    server, _ = _three_steps(make_sidecar, make_client, job_name, url, endpoint, gang_files)
    before, _ = _epoch(url, endpoint, job_name)
    gang_files("req/1", request_text)
    client = make_client(server, job_name)
    with pytest.raises(RestoreError, match="FAILED_PRECONDITION") as refused:
        client.restore({"w": torch.zeros(4)})
    if request_text == "7":
        assert "restore request names step 7" in str(refused.value)
        assert "valid committed steps: [1, 2, 3]" in str(refused.value)
    else:
        assert "expected a committed step number, none or stop" in str(refused.value)
    after, steps = _epoch(url, endpoint, job_name)
    assert after.attempt == before.attempt and steps == [1, 2, 3]  # no attempt made, nothing deleted


def test_no_restore_request_restores_the_newest_and_says_so(
    make_sidecar, make_client, job_name, s3_store_url, gang_files
):
    url, endpoint = s3_store_url
    server, saved = _three_steps(make_sidecar, make_client, job_name, url, endpoint, gang_files)
    gang_files("req/1", "")  # the downward-API file of an annotation that is not set: empty
    client = make_client(server, job_name)
    model = small_model(seed=7)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    assert client.restore({"model": model, "opt": opt}) == 3
    assert_bitwise_equal(flat_tensors(model), saved[3]["model"])
    epoch, _ = _epoch(url, endpoint, job_name)
    assert (epoch.restore_step, epoch.restore_reason) == (3, "")  # the default: not written
