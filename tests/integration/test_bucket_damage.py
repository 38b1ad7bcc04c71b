"""A flaky or damaged bucket never makes a restore silently older, and never locks a job out:
a momentary 404 is read again (not marked unusable), every skipped step is reported with its
marker's cause and writer, markers are listed and cleared by `strata`, a damaged EPOCH record
or COMMIT is damage to route around, and names and steps that keys cannot hold are refused."""

from __future__ import annotations

import json
import logging

import grpc
import pytest
import torch
from conftest import two_rank_job_with_a_damaged_step
from s3proxy import S3Proxy

from sidecar import cli
from sidecar import manifest as mf
from sidecar.api import PROTOCOL_VERSION, pb, pb_grpc
from trainer_client import RestoreError

#: The largest step keys hold (12 digits): sidecar.api.MAX_STEP
MAX_STEP = 10**12 - 1


def _saved(client, steps, size=4096):
    for step in steps:
        client.save(step, {"w": torch.full((size,), float(step))}).durable.result(30)


def _corrupt_object(store_dir, store, job, step):
    commit = mf.read_commit(store, "default", job, step)
    obj = mf.load_manifest(store, commit, 0).objects[0]
    path = store_dir / obj.key
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    return obj.key


def test_a_transient_404_is_read_again_and_marks_nothing(make_sidecar, make_client, job_name, s3_store_url):
    url, endpoint = s3_store_url
    writer = make_sidecar(url, s3_endpoint=endpoint)
    client = make_client(writer, job_name, generation="t/0")
    _saved(client, (1, 2))
    client.close()
    writer.stop(grace=1)

    with S3Proxy(endpoint) as proxy:
        fresh = make_sidecar(url, s3_endpoint=proxy.endpoint)  # nothing in memory: storage it is
        # GETs of step 2's data object answer 404 for a moment, as a lagging replica may.
        proxy.answer_missing("GET", "/rank-0/obj-", times=2)  # the read-ahead may take one
        out = {"w": torch.zeros(4096)}
        restorer = make_client(fresh, job_name, generation="t/1")
        assert restorer.restore(out) == 2
        assert proxy.missing_left() == 0, "the 404 was never served"
        assert torch.equal(out["w"], torch.full((4096,), 2.0))
        assert restorer.last_restore["fallback_reason"] == ""
        assert fresh.store.list(mf.unusable_prefix("default", job_name)).objects == []


def test_a_step_missing_after_retries_is_marked_missing_and_reported(
    make_sidecar, make_client, job_name, tmp_path
):
    storage = f"file://{tmp_path}/store"
    server = make_sidecar(storage)
    client = make_client(server, job_name, generation="m/0")
    _saved(client, (1, 2))
    client.close()
    server.stop(grace=1)
    commit = mf.read_commit(server.store, "default", job_name, 2)
    gone = mf.load_manifest(server.store, commit, 0).objects[0].key
    (tmp_path / "store" / gone).unlink()

    fresh = make_sidecar(storage)
    out = {"w": torch.zeros(4096)}
    restorer = make_client(fresh, job_name, generation="m/1")
    assert restorer.restore(out) == 1
    reason = restorer.last_restore["fallback_reason"]
    assert "step 2" in reason and "missing" in reason and gone in reason
    [marker] = mf.unusable_markers(fresh.store, "default", job_name)
    assert (marker.step, marker.cause) == (2, "missing")
    assert "rank 0/1 of generation m/1" in marker.by


def test_a_later_generation_reports_every_step_it_skipped_and_why(
    make_sidecar, make_client, job_name, tmp_path
):
    storage = f"file://{tmp_path}/store"
    server = make_sidecar(storage)
    client = make_client(server, job_name, generation="s/0")
    _saved(client, (1, 2, 3))
    client.close()
    server.stop(grace=1)
    bad = {step: _corrupt_object(tmp_path / "store", server.store, job_name, step) for step in (2, 3)}

    first = make_sidecar(storage)
    out = {"w": torch.zeros(4096)}
    restorer = make_client(first, job_name, generation="s/1")
    assert restorer.restore(out) == 1
    reason = restorer.last_restore["fallback_reason"]
    for step, key in bad.items():
        assert f"step {step} " in reason and key in reason, reason
    restorer.close()
    first.stop(grace=1)

    assert "skipped 2 unusable step(s)" in reason, reason


def test_a_later_gang_restart_reports_the_step_it_skipped_and_why(
    make_sidecar, make_client, job_name, tmp_path
):
    storage, key, gang = two_rank_job_with_a_damaged_step(make_sidecar, make_client, job_name, tmp_path, "g")

    fresh = make_sidecar(storage)
    ranks = gang(fresh, "g/1")
    assert ranks[0].restore({"w": torch.zeros(4096)}) == 2
    with pytest.raises(RestoreError, match=key):
        ranks[1].restore({"w": torch.zeros(4096)})
    for c in ranks:
        c.close()
    # The next restart restores step 1 on every rank, and each says what it skipped and why.
    ranks = gang(fresh, "g/2")
    for r, c in enumerate(ranks):
        out = {"w": torch.zeros(4096)}
        assert c.restore(out) == 1 and out["w"][0] == 10.0 + r
        reason = c.last_restore["fallback_reason"]
        assert "skipped 1 unusable step(s): step 2 (attempt 0) corrupt" in reason, reason
        assert key in reason and "marked by rank 1/2 of generation g/1" in reason
        assert reason.endswith("restored step 1")


def test_markers_are_listed_and_cleared_by_the_cli(make_sidecar, make_client, job_name, tmp_path, capsys):
    storage = f"file://{tmp_path}/store"
    server = make_sidecar(storage)
    client = make_client(server, job_name, generation="c/0")
    _saved(client, (1, 2))
    client.close()
    server.stop(grace=1)
    mf.mark_unusable(server.store, "default", job_name, (0, 2), "rank 0: test damage", "corrupt", "rank 0/1")
    capsys.readouterr()

    base = ["--storage", storage, "--job", job_name]
    assert cli.main(["markers", *base]) == 0
    listed = capsys.readouterr().out
    assert "corrupt" in listed and "rank 0: test damage" in listed and "rank 0/1" in listed
    assert cli.main(["markers", *base, "--json"]) == 0
    [marker] = json.loads(capsys.readouterr().out)
    assert (marker["step"], marker["attempt"], marker["cause"]) == (2, 0, "corrupt")

    # While marked, a new generation restores step 1; cleared, step 2 again.
    fresh = make_sidecar(storage)
    out = {"w": torch.zeros(4096)}
    assert make_client(fresh, job_name, generation="c/1").restore(out) == 1
    assert cli.main(["markers", *base, "--clear", "--step", "2"]) == 0
    assert "cleared: step 2" in capsys.readouterr().out
    assert mf.unusable_markers(fresh.store, "default", job_name) == []
    assert cli.main(["markers", *base]) == 0
    assert "no unusable markers" in capsys.readouterr().out


def test_a_damaged_newest_epoch_record_leaves_checkpoints_reachable(
    make_sidecar, make_client, job_name, tmp_path, capsys, caplog
):
    storage = f"file://{tmp_path}/store"
    server = make_sidecar(storage)
    for generation, steps in (("e/0", (1, 2)), ("e/1", (3,))):
        client = make_client(server, job_name, generation=generation)
        if generation == "e/1":
            assert client.restore({"w": torch.zeros(4096)}) == 2
        _saved(client, steps)
        client.close()
    server.stop(grace=1)
    newest = tmp_path / "store" / mf.epoch_key("default", job_name, 1)
    assert newest.exists()
    newest.write_bytes(newest.read_bytes()[:-7])  # a torn record

    caplog.set_level(logging.ERROR)
    fences = mf.read_fences(server.store, "default", job_name)
    assert 1 in fences.damaged and fences.newest_attempt == 1
    assert mf.committed_steps(server.store, "default", job_name) == [1, 2, 3]
    assert any(
        "strata repair-epoch" in r.getMessage() and "attempt 1" in r.getMessage() for r in caplog.records
    )
    capsys.readouterr()
    assert cli.main(["ls", "--storage", storage, "--job", job_name]) == 0
    listed = capsys.readouterr().out
    assert all(f" {s} " in listed for s in (1, 2, 3)), listed

    # A new generation restores the newest step and saves on; its record carries the history.
    fresh = make_sidecar(storage)
    client = make_client(fresh, job_name, generation="e/2")
    out = {"w": torch.zeros(4096)}
    assert client.restore(out) == 3 and out["w"][0] == 3.0
    _saved(client, (4,))
    assert mf.committed_steps(fresh.store, "default", job_name) == [1, 2, 3, 4]

    # The repair command the report names rewrites the record.
    assert cli.main(["repair-epoch", "--storage", storage, "--job", job_name, "--attempt", "1",
                     "--restore-step", "2"]) == 0  # fmt: skip
    epoch = mf.Epoch.from_json(newest.read_bytes())
    assert (epoch.attempt, epoch.restore) == (1, (0, 2))
    assert mf.read_fences(fresh.store, "default", job_name).damaged == {}


def _rolled_back_then_damaged(make_sidecar, make_client, job_name, tmp_path, restore):
    """Attempt 0 commits steps 1-3; attempt 1 (the operator's rollback to ``restore``) commits
    its own step 2 (if it restored step 1); then attempt 1's EPOCH record is torn."""
    storage = f"file://{tmp_path}/store"
    server = make_sidecar(storage)
    client = make_client(server, job_name, generation="rb/0")
    _saved(client, (1, 2, 3))
    client.close()
    fences = mf.read_fences(server.store, "default", job_name)
    reason = "requested" if restore else "fresh"
    mf.create_epoch(
        server.store, "default", job_name, mf.Generation.parse("rb/1"), 1, restore, fences, reason
    )
    if restore:
        client = make_client(server, job_name, generation="rb/1")
        assert client.restore({"w": torch.zeros(4096)}) == restore[1]
        client.save(2, {"w": torch.full((4096,), 20.0)}).durable.result(30)
        client.close()
        # LATEST is a hint: left at attempt 0's step 3, as a write that failed would leave it.
        body = {"attempt": 0, "step": 3, "commit": mf.commit_key("default", job_name, 3, 0)}
        server.store.put(mf.latest_key("default", job_name), json.dumps(body).encode())
    server.stop(grace=1)
    record = tmp_path / "store" / mf.epoch_key("default", job_name, 1)
    record.write_bytes(record.read_bytes()[:-7])
    return storage


def test_a_damaged_rollback_record_never_brings_back_what_it_fenced_off(
    make_sidecar, make_client, job_name, tmp_path
):
    storage = _rolled_back_then_damaged(make_sidecar, make_client, job_name, tmp_path, (0, 1))
    fresh = make_sidecar(storage)
    # Attempt 1's own step 2, not attempt 0's step 3 that its rollback fenced off.
    out = {"w": torch.zeros(4096)}
    client = make_client(fresh, job_name, generation="rb/2")
    assert client.restore(out) == 2 and out["w"][0] == 20.0
    client.close()
    # The next record carries attempt 1 on as unknown: the fence is never dropped.
    epoch = mf.Epoch.from_json(fresh.store.get(mf.epoch_key("default", job_name, 2)))
    assert epoch.unknown_restores == [1] and 1 not in [h[0] for h in epoch.history]
    assert epoch.restore == (1, 2)
    fences = mf.read_fences(fresh.store, "default", job_name)
    assert fences.unknown == {1} and 1 in fences.damaged
    out = {"w": torch.zeros(4096)}
    assert make_client(fresh, job_name, generation="rb/3").restore(out) == 2 and out["w"][0] == 20.0


def test_a_damaged_fresh_start_record_refuses_the_automatic_pick(
    make_sidecar, make_client, job_name, tmp_path, capsys
):
    storage = _rolled_back_then_damaged(make_sidecar, make_client, job_name, tmp_path, None)
    fresh = make_sidecar(storage)
    # Attempt 1 fenced off every step and committed none: any automatic pick would be a guess.
    with pytest.raises(RestoreError, match=r"attempt 1 is damaged.*strata repair-epoch .*--attempt 1"):
        make_client(fresh, job_name, generation="rb/2").restore({"w": torch.zeros(4096)})
    assert fresh.store.list(mf.epoch_key("default", job_name, 2)).objects == []
    capsys.readouterr()
    assert cli.main(["ls", "--storage", storage, "--job", job_name]) == 0
    listed = capsys.readouterr().out
    assert all(f" {s} " in listed for s in (1, 2, 3)), listed
    # Repaired (the operator says what attempt 1 restored), the pick is automatic again.
    assert cli.main(["repair-epoch", "--storage", storage, "--job", job_name, "--attempt", "1",
                     "--restore-step", "2"]) == 0  # fmt: skip
    out = {"w": torch.zeros(4096)}
    assert make_client(fresh, job_name, generation="rb/3").restore(out) == 2 and out["w"][0] == 2.0


def test_a_damaged_world_size_in_a_commit_falls_back_with_a_reason(
    make_sidecar, make_client, job_name, tmp_path
):
    storage = f"file://{tmp_path}/store"
    server = make_sidecar(storage)
    client = make_client(server, job_name, generation="w/0")
    _saved(client, (1, 2))
    client.close()
    server.stop(grace=1)
    key = mf.commit_key("default", job_name, 2, 0)
    path = tmp_path / "store" / key
    body = json.loads(path.read_bytes())
    body["world_size"] = 2
    path.write_bytes(json.dumps(body).encode())

    fresh = make_sidecar(storage)
    out = {"w": torch.zeros(4096)}
    restorer = make_client(fresh, job_name, generation="w/1")
    assert restorer.restore(out) == 1 and out["w"][0] == 1.0
    reason = restorer.last_restore["fallback_reason"]
    assert key in reason and "world_size" in reason, reason


def test_a_step_beyond_twelve_digits_is_refused_at_save(make_sidecar, make_client, job_name, monkeypatch):
    server = make_sidecar()
    client = make_client(server, job_name, when_busy="wait")
    with pytest.raises(ValueError, match="12 digits"):
        client.save(MAX_STEP + 1, {"w": torch.ones(4)})
    # The sidecar refuses it too, for a client that does not check.
    import trainer_client.client as client_module

    monkeypatch.setattr(client_module, "_check_step", lambda step: None)
    with pytest.raises(Exception, match="12 digits") as refused:
        client.save(10**12, {"w": torch.ones(4)}).durable.result(30)
    assert "INVALID_ARGUMENT" in str(refused.value) or "invalid" in str(refused.value).lower()
    assert client.save(MAX_STEP, {"w": torch.ones(4)}).durable.result(30).step == MAX_STEP
    assert mf.committed_steps(server.store, "default", job_name) == [MAX_STEP]


@pytest.mark.parametrize(("namespace", "name"), [("default", "evil\n"), ("evil\n", "job")])
def test_a_name_ending_in_a_newline_is_invalid_argument(make_sidecar, namespace, name):
    server = make_sidecar()
    with grpc.insecure_channel(f"unix://{server.socket_path}") as channel:
        stub = pb_grpc.CheckpointerStub(channel)
        request = pb.RestoreRequest(
            protocol_version=PROTOCOL_VERSION,
            identity=pb.Identity(namespace=namespace, job=name, world_size=1, generation="g/0"),
        )
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(stub.Restore(request, timeout=10)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("job" if name != "job" else "namespace") in refused.value.details()
    assert mf.check_name("job", "evil") == "evil"
    for bad in ("evil\n", "default\n"):
        with pytest.raises(ValueError):
            mf.check_name("job", bad)


def test_restore_error_names_a_damaged_commit_when_the_step_is_asked_for(
    make_sidecar, make_client, job_name, tmp_path
):
    storage = f"file://{tmp_path}/store"
    server = make_sidecar(storage)
    client = make_client(server, job_name, generation="x/0")
    _saved(client, (1,))
    client.close()
    server.stop(grace=1)
    path = tmp_path / "store" / mf.commit_key("default", job_name, 1, 0)
    body = json.loads(path.read_bytes())
    body["world_size"] = 3
    path.write_bytes(json.dumps(body).encode())
    fresh = make_sidecar(storage)
    with pytest.raises(RestoreError, match=r"DATA_LOSS.*world_size"):
        make_client(fresh, job_name, generation="x/1").restore({"w": torch.zeros(4096)}, step=1)
