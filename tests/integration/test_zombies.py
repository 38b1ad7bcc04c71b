"""Superseded gangs (zombies) against a real S3 server: they may keep writing, but what they
commit above the newer attempt's restore step is never read, never blocks the newer attempt,
and never undoes a rollback. Also: storage that ignores conditional writes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sidecar import manifest as mf
from sidecar.metrics import Metrics
from sidecar.server import SidecarServer
from sidecar.store import open_store
from trainer_client.errors import SidecarUnavailable


def _gen_file(tmp, name: str, generation: str):
    path = tmp / name
    path.write_text(generation + "\n")
    return str(path)


def _commits_written(store, job: str) -> set[tuple[int, int]]:
    """Every COMMIT object in storage, valid or void: (attempt, step)."""
    out = set()
    for o in store.list(mf.job_prefix("default", job) + "steps/").objects:
        if o.key.endswith("/COMMIT"):
            out.add(mf.parse_commit_key(o.key))
    return out


def _state(value: float) -> dict:
    return {"w": torch.full((2048,), value), "step_tag": torch.tensor([int(value)])}


def test_a_zombie_gang_writes_void_commits_that_no_reader_sees(
    make_sidecar, make_client, job_name, s3_store_url, short_tmp
):
    url, endpoint = s3_store_url
    old_gen = _gen_file(short_tmp, "gen-a", "run/0")
    zombie_side = make_sidecar(url, s3_endpoint=endpoint, generation_file=old_gen)
    zombie = make_client(zombie_side, job_name, capture_rng=False)
    for step in (1, 2):
        zombie.save(step, _state(step)).durable.result(30)

    # The gang is restarted elsewhere (generation 1) while the old one keeps running and never
    # learns of it on its commit path.
    zombie_side.engine._stale_fences = True
    new_side = make_sidecar(url, s3_endpoint=endpoint, generation_file=_gen_file(short_tmp, "gen-b", "run/1"))
    fresh = make_client(new_side, job_name, capture_rng=False)
    state = _state(0)
    assert fresh.restore(state) == 2 and torch.equal(state["w"], _state(2)["w"])

    # The zombie commits step 3 and 4 (above the new restore step 2): written, but void.
    for step in (3, 4):
        zombie.save(step, _state(100 + step)).durable.result(30)
    store = open_store(url, endpoint_url=endpoint)
    assert {(0, 3), (0, 4)} <= _commits_written(store, job_name)
    # The new attempt commits the same step 3 regardless, and readers see only its commits.
    fresh.save(3, _state(3)).durable.result(30)
    assert mf.newest_valid(store, "default", job_name) == (1, 3)
    assert mf.committed_steps(store, "default", job_name) == [1, 2, 3]
    assert mf.read_commit(store, "default", job_name, 3).attempt == 1
    reader_side = make_sidecar(
        url, s3_endpoint=endpoint, generation_file=_gen_file(short_tmp, "gen-c", "run/2")
    )
    reader = make_client(reader_side, job_name, capture_rng=False)
    got = _state(0)
    assert reader.restore(got) == 3 and torch.equal(got["w"], _state(3)["w"])
    assert reader.last_restore["source"] == "storage"

    # A rollback: generation 2 finds step 3 unusable and restores step 2 instead; a zombie of
    # attempt 1 committing step 4 afterwards must not undo it.
    mf.mark_unusable(store, "default", job_name, (1, 3), "test: rolled back")
    rollback_side = make_sidecar(
        url, s3_endpoint=endpoint, generation_file=_gen_file(short_tmp, "gen-d", "run/3")
    )
    rolled = make_client(rollback_side, job_name, capture_rng=False)
    back = _state(0)
    assert rolled.restore(back) == 2 and torch.equal(back["w"], _state(2)["w"])
    new_side.engine._stale_fences = True  # attempt 1 is a zombie now
    fresh.save(4, _state(104)).durable.result(30)
    zombie.save(5, _state(105)).durable.result(30)
    written = _commits_written(store, job_name)
    void = {p for p in written if not mf.read_fences(store, "default", job_name).valid(*p)}
    assert {(0, 3), (0, 4), (0, 5), (1, 3), (1, 4)} <= void
    rolled.save(3, _state(33)).durable.result(30)
    assert mf.newest_valid(store, "default", job_name) == (3, 3)
    assert mf.committed_steps(store, "default", job_name) == [1, 2, 3]
    assert mf.read_commit(store, "default", job_name, 3).attempt == 3
    again = make_sidecar(url, s3_endpoint=endpoint, generation_file=_gen_file(short_tmp, "gen-e", "run/4"))
    final = _state(0)
    assert make_client(again, job_name, capture_rng=False).restore(final) == 3
    assert torch.equal(final["w"], _state(33)["w"])
    store.close()


def test_a_superseded_sidecar_stops_at_its_next_commit(
    make_sidecar, make_client, job_name, s3_store_url, short_tmp
):
    url, endpoint = s3_store_url
    old = make_sidecar(url, s3_endpoint=endpoint, generation_file=_gen_file(short_tmp, "g0", "r/0"))
    old_client = make_client(old, job_name, capture_rng=False)
    old_client.save(1, _state(1)).durable.result(30)
    new = make_sidecar(url, s3_endpoint=endpoint, generation_file=_gen_file(short_tmp, "g1", "r/1"))
    make_client(new, job_name, capture_rng=False).restore(_state(0))
    handle = old_client.save(2, _state(2))
    with pytest.raises(Exception, match="superseded"):
        handle.durable.result(30)
    store = open_store(url, endpoint_url=endpoint)
    assert (0, 2) not in _commits_written(store, job_name)
    assert old.metrics.superseded.labels(job_name)._value.get() == 1
    store.close()


def test_storage_ignoring_conditional_writes_is_refused_or_warned(s3_store_url, short_tmp, caplog):
    from s3proxy import S3Proxy

    from sidecar.config import SidecarSettings

    url, endpoint = s3_store_url
    with S3Proxy(endpoint, strip_conditional=True) as proxy:
        settings = SidecarSettings(
            storage=url, s3_endpoint=proxy.endpoint, socket=str(short_tmp / "c.sock"), metrics_port=0
        )
        with pytest.raises(ValueError, match=r"does not honour conditional writes.*If-None-Match"):
            SidecarServer(settings, metrics=Metrics())
        settings.conditional_writes = "warn"
        metrics = Metrics()
        server = SidecarServer(settings, metrics=metrics).start()
        try:
            assert metrics.conditional_writes._value.get() == 0
            assert "does not honour conditional writes" in caplog.text
            # It runs: saves commit, and a superseded gang's commits above the new restore step
            # are still never read (fencing needs no conditional writes).
            from trainer_client import CheckpointClient

            job = "warned"
            old = CheckpointClient(job=job, socket=server.socket_path, capture_rng=False, generation="w/0")
            old.save(1, _state(1)).durable.result(30)
            server.engine._stale_fences = True
            settings2 = replace(settings, socket=str(short_tmp / "c2.sock"))
            other = SidecarServer(settings2, metrics=Metrics()).start()
            new = CheckpointClient(job=job, socket=other.socket_path, capture_rng=False, generation="w/1")
            assert new.restore(_state(0)) == 1
            old.save(2, _state(102)).durable.result(30)  # void: written through a store that ignores If-*
            new.save(2, _state(2)).durable.result(30)
            store = open_store(url, endpoint_url=endpoint)
            assert (0, 2) in _commits_written(store, job)
            assert mf.newest_valid(store, "default", job) == (1, 2)
            store.close()
            got = _state(0)
            assert new.restore(got) == 2 and torch.equal(got["w"], _state(2)["w"])
            old.close(wait=False)
            new.close(wait=False)
            other.stop(grace=1)
        finally:
            server.stop(grace=1)
    honest = SidecarServer(
        SidecarSettings(storage=url, s3_endpoint=endpoint, socket=str(short_tmp / "d.sock"), metrics_port=0),
        metrics=(m := Metrics()),
    )
    assert m.conditional_writes._value.get() == 1
    honest.store.close()


def test_a_deleted_commit_is_gone_even_where_its_directory_lingers(s3_store_url):
    """SeaweedFS keeps a directory after its last object is deleted: a commit directory alone
    must not count as a COMMIT."""
    url, endpoint = s3_store_url
    store = open_store(url, endpoint_url=endpoint)
    prefix = mf.rank_prefix("default", "linger", 4, 0, "s1", 0)
    store.put(prefix + "obj-00000", b"x")
    manifest = mf.Manifest(
        "default",
        "linger",
        4,
        0,
        1,
        0,
        "s1",
        1,
        {},
        [],
        [mf.ObjectEntry(prefix + "obj-00000", 1, mf.crc32(b"x"))],
    )
    mf.write_manifest(store, prefix, manifest)
    mf.write_commit(store, "default", "linger", 4, 1, 0)
    assert mf.step_commits(store, "default", "linger", 4) == [0]
    store.delete([mf.commit_key("default", "linger", 4, 0)])
    assert mf.step_commits(store, "default", "linger", 4) == []
    assert mf.committed_steps(store, "default", "linger") == []
    store.close()


def test_a_fixed_generation_is_the_sidecars_and_a_trainer_of_another_is_refused(
    make_sidecar, make_client, job_name, s3_store_url, monkeypatch
):
    """A JobSet pod's sidecar has its generation from the pod's labels (STRATA_GENERATION, composed by
    the injection): a trainer declaring none gets it, one declaring another gang's is refused."""
    url, endpoint = s3_store_url
    uid = "9d2e0c1a-0000-4000-8000-00000000000a"
    side = make_sidecar(url, s3_endpoint=endpoint, generation=f"{uid}/1")
    client = make_client(side, job_name, capture_rng=False)
    client.save(1, _state(1)).durable.result(30)
    store = open_store(url, endpoint_url=endpoint)
    key = mf.epoch_key("default", job_name, 0)
    assert mf.Epoch.from_json(store.get(key), key).generation == f"{uid}/1"
    monkeypatch.setenv("STRATA_GENERATION", f"{uid}/0")
    with pytest.raises(SidecarUnavailable, match=f"this sidecar's is {uid}/1"):
        make_client(side, job_name + "-b", capture_rng=False)
