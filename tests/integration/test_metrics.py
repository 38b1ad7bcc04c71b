"""The sidecar's /metrics endpoint: names, types and labels, values that match what
the trainer did, and a real Prometheus server scraping it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from sidecar import manifest as mf
from tests.fixtures.prometheus import Prometheus, fetch, free_port, prometheus_bin
from trainer_client import SaveFailed, SaveSkipped

SCRAPE_JOB = "strata-sidecar"


def scrape(port: int) -> dict[str, Any]:
    """Metric families of the sidecar's /metrics by name (counters without `_total`)."""
    text = fetch(f"http://127.0.0.1:{port}/metrics")
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(family: Any, suffix: str = "") -> dict[tuple[tuple[str, str], ...], float]:
    """{sorted labels: value} of the family's samples named <family><suffix>."""
    return {
        tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == family.name + suffix
    }


def state(scale: float) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1000.0) * scale, "b": torch.full((7,), scale, dtype=torch.float64)}


# capture_rng=False: the two tensors above and nothing else, at 64-byte aligned offsets
SNAPSHOT_BYTES = 4032 + 7 * 8


def held_after_header(client: Any, monkeypatch: pytest.MonkeyPatch, step: int) -> threading.Event:
    """Make the client's stream of `step` stop after its header until the returned event is set."""
    gate = threading.Event()
    original = client._requests

    def requests(bufs: Any, shared: bool, s: int, *args: Any) -> Iterator[Any]:
        stream = original(bufs, shared, s, *args)
        yield next(stream)
        if s == step:
            gate.wait(30)
        yield from stream

    monkeypatch.setattr(client, "_requests", requests)
    return gate


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def test_metrics_endpoint_reports_what_the_trainer_did(make_sidecar, make_client, job_name, monkeypatch):
    port = free_port()
    server = make_sidecar(metrics_port=port, metrics_host="127.0.0.1")
    assert server.metrics_port == port
    # One generation for both: a second client of its own would be a new attempt fencing the first off.
    client = make_client(server, job_name, capture_rng=False, generation="metrics/0", staging_buffers=2)
    # same rank, same attempt: shares the sidecar's slot
    other = make_client(server, job_name, capture_rng=False, generation="metrics/0")

    assert client.save(1, state(1)).durable.result(30).step == 1
    gate = held_after_header(client, monkeypatch, step=2)
    streaming = client.save(2, state(2))
    wait_for(lambda: len(server.engine.snapshots()) == 2, 10, "step 2 to be held by the sidecar")
    skipped = client.save(3, state(3))  # the client is still streaming step 2
    assert skipped.skipped
    with pytest.raises(SaveSkipped):
        skipped.durable.result(5)
    with pytest.raises(SaveFailed, match="RESOURCE_EXHAUSTED"):  # the sidecar holds 2 snapshots
        other.save(4, state(4)).durable.result(30)
    gate.set()
    assert streaming.durable.result(30).step == 2
    before_last = time.time()
    assert client.save(5, state(5)).durable.result(30).step == 5  # reports the skipped save
    after_last = time.time()

    families = scrape(port)
    for name, family in families.items():
        assert name.startswith("strata_"), name
        for sample in family.samples:
            assert sample.name.startswith("strata_"), sample.name
            if family.type == "counter":
                assert sample.name.endswith("_total"), f"counter sample {sample.name} lacks _total"
    kinds = {
        "strata_save_stall_seconds": "histogram",
        "strata_upload_duration_seconds": "histogram",
        "strata_received_bytes": "counter",
        "strata_uploaded_bytes": "counter",
        "strata_checkpoints": "counter",
        "strata_saves_skipped": "counter",
        "strata_last_commit_timestamp_seconds": "gauge",
        "strata_last_committed_step": "gauge",
    }
    assert {name: families[name].type for name in kinds if name in families} == kinds

    job = (("training_job", job_name),)
    received = 3 * SNAPSHOT_BYTES  # steps 1, 2, 5; the skipped and the refused save sent no data
    assert samples(families["strata_received_bytes"], "_total") == {job: received}
    commits = [mf.read_commit(server.store, "default", job_name, s) for s in (1, 2, 5)]
    assert mf.committed_steps(server.store, "default", job_name) == [1, 2, 5]
    objects = [o for c in commits for o in mf.load_manifest(server.store, c, 0).objects]
    assert sum(o.size for o in objects) == received
    manifests = sum(ref.size for c in commits for ref in c.manifests)
    assert samples(families["strata_uploaded_bytes"], "_total") == {job: received + manifests}

    assert samples(families["strata_checkpoints"], "_total") == {
        (("result", "committed"), ("training_job", job_name)): 3,
        (("result", "refused"), ("training_job", job_name)): 1,
    }
    assert samples(families["strata_saves_skipped"], "_total") == {job: 1}

    for name in ("strata_save_stall_seconds", "strata_upload_duration_seconds"):
        family = families[name]
        assert samples(family, "_count") == {job: 3}, name
        assert 0 < samples(family, "_sum")[job] < 30, name
        buckets = {s.labels["le"]: s.value for s in family.samples if s.name == name + "_bucket"}
        assert set(s.labels["training_job"] for s in family.samples if s.name == name + "_bucket") == {
            job_name
        }
        assert buckets["+Inf"] == 3, name
        values = [buckets[le] for le in sorted(buckets, key=float)]
        assert values == sorted(values), f"{name} buckets are not cumulative: {buckets}"
    # The client's own stall measurements are what the sidecar observed.
    stall = samples(families["strata_save_stall_seconds"], "_sum")[job]
    assert stall >= client.stats["last_stall_s"]

    (last_commit,) = samples(families["strata_last_commit_timestamp_seconds"]).items()
    assert last_commit[0] == job
    assert before_last - 1 <= last_commit[1] <= after_last + 1
    assert abs(last_commit[1] - time.time()) < 60
    assert samples(families["strata_last_committed_step"]) == {job: 5}


# --- a real Prometheus ------------------------------------------------------------------------


@pytest.fixture
def start_prometheus(tmp_path: Path) -> Iterator[Callable[[list[str]], Prometheus]]:
    started: list[Prometheus] = []

    def start(targets: list[str]) -> Prometheus:
        prom = Prometheus(prometheus_bin(), tmp_path, targets, SCRAPE_JOB)
        started.append(prom)
        return prom

    yield start
    for prom in started:
        with contextlib.suppress(ProcessLookupError):
            prom.stop()


def value_of(result: list[dict[str, Any]]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def test_a_real_prometheus_scrapes_the_sidecar(make_sidecar, make_client, job_name, start_prometheus):
    port = free_port()
    server = make_sidecar(metrics_port=port, metrics_host="127.0.0.1")
    client = make_client(server, job_name, capture_rng=False)
    client.save(1, state(1)).durable.result(30)

    prom = start_prometheus([f"127.0.0.1:{port}"])
    up = prom.wait_query(f'up{{job="{SCRAPE_JOB}"}}', lambda r: value_of(r) == 1, 30)
    assert up[0]["metric"]["instance"] == f"127.0.0.1:{port}"
    result = prom.wait_query("strata_checkpoints_total", lambda r: len(r) > 0, 30)
    (series,) = result
    # The training job is `training_job`, so Prometheus' own target label `job` stays untouched.
    assert series["metric"] == {
        "__name__": "strata_checkpoints_total",
        "training_job": job_name,
        "instance": f"127.0.0.1:{port}",
        "job": SCRAPE_JOB,
        "result": "committed",
    }
    assert float(series["value"][1]) == 1

    # Live: a second commit shows up in a later scrape.
    client.save(2, state(2)).durable.result(30)
    query = f'strata_checkpoints_total{{training_job="{job_name}",result="committed"}}'
    prom.wait_query(query, lambda r: value_of(r) == 2, 15)
    received = f'strata_received_bytes_total{{training_job="{job_name}"}}'
    prom.wait_query(received, lambda r: value_of(r) == 2 * SNAPSHOT_BYTES, 5)
    step = f'strata_last_committed_step{{training_job="{job_name}"}}'
    prom.wait_query(step, lambda r: value_of(r) == 2, 5)
