"""The sidecar's reports to the operator (sidecar.reporting): batches over real HTTP(S) to a small
receiver, the token read at every send, retries while the operator is down, drops that are counted,
and a bounded flush at close."""

from __future__ import annotations

import logging
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar import manifest as mf
from sidecar import reporting
from sidecar.operator.objects import checkpoint_body
from sidecar.reporting import Reporter
from sidecar.store.memory import MemoryStore
from tests.fixtures.report_receiver import Receiver


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture
def make_reporter() -> Iterator[Callable[..., Reporter]]:
    made: list[Reporter] = []

    def make(url: str, **options: Any) -> Reporter:
        options.setdefault("backoff_initial_s", 0.02)
        options.setdefault("backoff_max_s", 0.1)
        reporter = Reporter(url, CollectorRegistry(), **options)
        made.append(reporter)
        return reporter

    yield make
    for reporter in made:
        reporter.close(0.2)


def _value(reporter: Reporter, name: str, **labels: str) -> float:
    got = reporter.registry.get_sample_value(name, labels)
    return 0.0 if got is None else float(got)


def _reach(reporter: Reporter, name: str, at_least: float, **labels: str) -> float:
    """The metric once it reaches ``at_least`` (counted just after the answer arrives), or after 5 s."""
    deadline = time.monotonic() + 5
    while (got := _value(reporter, name, **labels)) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


def _event(n: int) -> dict[str, Any]:
    return {"kind": "delete", "namespace": "default", "job": "j", "step": n, "attempt": 0}


def test_disabled_without_a_url_starts_no_thread_and_ignores_reports():
    before = {t.name for t in threading.enumerate()}
    reporter = Reporter("", CollectorRegistry())
    assert not reporter.enabled
    reporter.report(_event(1))
    reporter.close()
    assert "strata-report" not in {t.name for t in threading.enumerate()} - before


def test_batches_are_posted_as_the_wire_format_says_with_the_token_read_at_every_send(
    receiver, make_reporter, tmp_path
):
    token = tmp_path / "token"
    token.write_text("first\n")
    reporter = make_reporter(receiver.url + "/", token_file=str(token))
    reporter.report(_event(1))
    assert receiver.wait_items(1) == [_event(1)]
    token.write_text("second")  # projected tokens rotate
    reporter.report(_event(2))
    receiver.wait_items(2)
    assert [p["path"] for p in receiver.posts] == ["/v1/reports", "/v1/reports"]
    assert [p["auth"] for p in receiver.posts] == ["Bearer first", "Bearer second"]
    assert _reach(reporter, "strata_reports_sent_total", 2, kind="delete") == 2


def test_reports_wait_while_the_operator_is_down_and_arrive_in_order_when_it_is_back(make_reporter):
    down = Receiver()
    port = down.port
    down.stop()  # nothing listens there now
    reporter = make_reporter(f"http://127.0.0.1:{port}")
    for n in range(5):
        reporter.report(_event(n))
    assert _reach(reporter, "strata_report_retries_total", 2) >= 2
    assert _value(reporter, "strata_report_queue_depth") == 5
    back = Receiver(port)
    try:
        assert [i["step"] for i in back.wait_items(5)] == [0, 1, 2, 3, 4]
        assert _value(reporter, "strata_reports_dropped_total", reason="overflow") == 0
    finally:
        back.stop()


@pytest.mark.parametrize("status", [401, 408, 429, 503])
def test_a_retryable_status_keeps_the_batch(receiver, make_reporter, status):
    receiver.statuses = [status, status]
    reporter = make_reporter(receiver.url)
    reporter.report(_event(7))
    assert receiver.wait_items(1) == [_event(7)]
    assert _reach(reporter, "strata_report_retries_total", 2) == 2


def test_a_4xx_drops_that_batch_once_logged_and_later_reports_still_go(receiver, make_reporter, caplog):
    caplog.set_level(logging.WARNING, "sidecar.reporting")
    receiver.statuses = [400, 400]
    reporter = make_reporter(receiver.url)
    reporter.report(_event(1))
    _reach(reporter, "strata_reports_dropped_total", 1, reason="refused")
    reporter.report(_event(2))
    _reach(reporter, "strata_reports_dropped_total", 2, reason="refused")
    reporter.report(_event(3))
    assert receiver.wait_items(1) == [_event(3)]
    assert _value(reporter, "strata_reports_dropped_total", reason="refused") == 2
    assert _value(reporter, "strata_report_retries_total") == 0
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1  # once per reason


def test_items_the_operator_rejects_are_counted_and_the_rest_accepted(receiver, make_reporter):
    receiver.reject = lambda item: "bad step" if item["step"] == 2 else ""
    reporter = make_reporter(receiver.url, max_batch=10)
    reporter.close(0)  # nothing queued yet: closes at once
    reporter = make_reporter(receiver.url, max_batch=10)
    with reporter._cond:  # queue three before the thread looks, so they go as one batch
        for n in (1, 2, 3):
            reporter._queue.append(_event(n))
    reporter.report(_event(4))
    receiver.wait_items(4)
    assert _reach(reporter, "strata_reports_sent_total", 3, kind="delete") == 3
    assert _value(reporter, "strata_reports_dropped_total", reason="rejected") == 1


def test_a_full_queue_drops_the_oldest_and_counts_it(make_reporter):
    down = Receiver()
    port = down.port
    down.stop()
    reporter = make_reporter(f"http://127.0.0.1:{port}", max_queue=3)
    for n in range(6):
        reporter.report(_event(n))
    back = Receiver(port)
    try:
        steps = [i["step"] for i in back.wait_items(3)]
        time.sleep(0.1)
        assert steps == [3, 4, 5]
        assert _value(reporter, "strata_reports_dropped_total", reason="overflow") == 3
    finally:
        back.stop()


def test_report_never_raises_and_a_report_that_cannot_be_built_is_dropped(receiver, make_reporter):
    reporter = make_reporter(receiver.url)

    def broken() -> dict[str, Any]:
        raise RuntimeError("bug")

    reporter.report(broken)
    reporter.report(lambda: [_event(1), _event(2)])  # a builder may give several
    reporter.report(_event(3))
    assert [i["step"] for i in receiver.wait_items(3)] == [1, 2, 3]
    assert _reach(reporter, "strata_reports_dropped_total", 1, reason="error") == 1


def test_close_flushes_what_is_queued(receiver, make_reporter):
    reporter = make_reporter(receiver.url, max_batch=2)
    for n in range(7):
        reporter.report(_event(n))
    reporter.close(5.0)
    assert [i["step"] for i in receiver.items()] == list(range(7))


def test_close_waits_a_bounded_time_when_the_operator_is_down(make_reporter):
    down = Receiver()
    port = down.port
    down.stop()
    reporter = make_reporter(f"http://127.0.0.1:{port}")
    reporter.report(_event(1))
    t0 = time.monotonic()
    reporter.close(0.5)
    assert time.monotonic() - t0 < 2.0
    assert _value(reporter, "strata_reports_dropped_total", reason="shutdown") == 1


def test_heartbeats_are_collected_periodically_and_only_the_newest_per_rank_waits(receiver, make_reporter):
    count = {"n": 0}

    def beats() -> list[dict[str, Any]]:
        count["n"] += 1
        return [{"kind": "heartbeat", "namespace": "default", "job": "j", "rank": 0, "saves": count["n"]}]

    reporter = make_reporter(receiver.url, heartbeat_s=0.05, heartbeats=beats)
    got = receiver.wait_items(3, "heartbeat")
    assert [b["saves"] for b in got[:3]] == sorted(b["saves"] for b in got[:3])
    reporter.close(1.0)
    # Queued, not yet sent, several for one rank: only the newest goes.
    down = Receiver()
    port = down.port
    down.stop()
    quiet = make_reporter(f"http://127.0.0.1:{port}")
    for saves in range(5):
        quiet.report({"kind": "heartbeat", "namespace": "default", "job": "j", "rank": 1, "saves": saves})
    assert _value(quiet, "strata_report_queue_depth") == 1


def test_https_is_verified_against_the_ca_file(make_reporter, tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)
    receiver = Receiver(tls=server_ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    try:
        url = f"https://127.0.0.1:{receiver.port}"
        untrusting = make_reporter(url)  # system CAs do not know this one: retried, never sent
        untrusting.report(_event(1))
        assert _reach(untrusting, "strata_report_retries_total", 1) >= 1 and not receiver.items()
        untrusting.close(0)
        trusting = make_reporter(url, ca_file=str(ca_file))
        trusting.report(_event(2))
        assert receiver.wait_items(1) == [_event(2)]
    finally:
        receiver.stop()


def test_location_carries_no_credentials():
    assert reporting.location("s3://bucket/prefix/", "ns", "job") == "s3://bucket/prefix/ns/job"
    assert reporting.location("s3://key:secret@bucket/p", "ns", "job") == "s3://bucket/p/ns/job"
    assert reporting.location("file:///var/lib/strata", "ns", "job") == "file:///var/lib/strata/ns/job"


def _manifest_body(step: int, rank: int, kind: str = "full", base: int | None = None, bits: int = 0) -> bytes:
    tensors = [
        mf.TensorEntry("w", "float32", [4], 16, 0, encoding="raw"),
        mf.TensorEntry("emb", "float32", [8, 2], 64, 16, encoding="quantized" if bits else "raw", bits=bits),
    ]
    m = mf.Manifest(
        "default",
        "j",
        step,
        rank,
        2,
        1,
        "s1",
        80,
        None,
        tensors,
        [mf.ObjectEntry(mf.rank_prefix("default", "j", step, 1, "s1", rank) + "obj-00000", 80, "00000000")],
        checkpoint=kind,
        base_step=base,
        requires=[] if base is None else [base],
        generation="run/0",
    )
    return m.to_json()


def test_a_commit_item_from_a_stored_commit_is_what_the_operator_accepts():
    store = MemoryStore(f"report-{uuid.uuid4().hex}")
    bodies = {}
    for rank in range(2):
        key = mf.rank_prefix("default", "j", 5, 1, "s1", rank) + "MANIFEST"
        body = _manifest_body(5, rank, kind="diff", base=3, bits=4 if rank else 0)
        store.put(key, body)
        bodies[rank] = (key, body)
    commit = mf.build_commit("default", "j", 5, 2, 1, bodies, "run/0")
    ref = mf.put_commit(store, commit)
    item = reporting.stored_commit_items(store, "default", "j", "s3://b/p/default/j", [(1, 5)])[0]
    assert item == reporting.commit_item(commit, ref.sha256, bodies, "s3://b/p/default/j")
    assert item["commit_sha256"] == mf.sha256(store.get(ref.key))
    assert (item["type"], item["base_step"], item["requires"], item["bits"]) == ("diff", 3, [3], 4)
    assert item["ranks"][1]["encodings"] == {"quantized": 1, "raw": 1}
    body = checkpoint_body(item)
    assert body["metadata"]["name"] == "j-000000000005"
    assert body["spec"]["commitKey"] == commit.key and body["status"]["ready"]


def test_a_delete_item_has_the_wire_keys():
    assert reporting.delete_item("ns", "j", 4, 2) == {
        "kind": "delete",
        "namespace": "ns",
        "job": "j",
        "step": 4,
        "attempt": 2,
    }


def test_settings_are_validated_naming_the_setting(tmp_path: Path):
    from sidecar.config import SidecarSettings

    def check(**options: Any) -> None:
        SidecarSettings(storage="file:///tmp/x", **options).validate()

    check(report_url="http://127.0.0.1:1", heartbeat_s=0)
    with pytest.raises(ValueError, match="--report-url must be http"):
        check(report_url="ftp://operator")
    with pytest.raises(ValueError, match="--report-url must carry no credentials"):
        check(report_url="https://u:p@operator")
    with pytest.raises(ValueError, match="--report-ca-file"):
        check(report_ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="--heartbeat-s"):
        check(heartbeat_s=-1)
