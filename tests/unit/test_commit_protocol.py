"""The commit protocol on an in-memory store: manifests, COMMIT, LATEST, discovery."""

from __future__ import annotations

import json
import uuid

import pytest

from sidecar import manifest as mf
from sidecar.errors import CorruptObject, FailedPrecondition
from sidecar.store import open_store


@pytest.fixture
def store():
    return open_store(f"memory://commit-{uuid.uuid4().hex}")


def put_rank(
    store, step: int, rank: int, world: int, attempt: int = 0, save_id: str = "abc"
) -> mf.ManifestRef:
    prefix = mf.rank_prefix("ns", "job", step, attempt, save_id, rank)
    data = bytes([rank]) * 10
    store.put(prefix + "obj-00000", data)
    m = mf.Manifest(
        "ns",
        "job",
        step,
        rank,
        world,
        attempt,
        save_id,
        10,
        {"w": 1},
        [mf.TensorEntry("w", "uint8", [10], 10, 0)],
        [mf.ObjectEntry(prefix + "obj-00000", 10, mf.crc32(data))],
    )
    return mf.write_manifest(store, prefix, m)


def test_commit_requires_every_rank_of_the_attempt(store):
    put_rank(store, 5, 0, world=3)
    put_rank(store, 5, 2, world=3)
    put_rank(store, 5, 1, world=3, attempt=1)  # a different attempt does not count
    with pytest.raises(FailedPrecondition, match=r"ranks \[1\]"):
        mf.write_commit(store, "ns", "job", 5, world_size=3, attempt=0)
    assert not mf.is_committed(store, "ns", "job", 5)
    put_rank(store, 5, 1, world=3)
    commit = mf.write_commit(store, "ns", "job", 5, world_size=3, attempt=0)
    assert [r.rank for r in commit.manifests] == [0, 1, 2]
    assert mf.read_commit(store, "ns", "job", 5).manifests == commit.manifests
    assert mf.load_manifest(store, commit, 1).rank == 1


def test_commit_refuses_a_rank_saved_with_another_world_size(store):
    put_rank(store, 1, 0, world=2)
    put_rank(store, 1, 1, world=4)
    with pytest.raises(FailedPrecondition, match="world size 4"):
        mf.write_commit(store, "ns", "job", 1, world_size=2, attempt=0)


def test_readers_trust_only_what_commit_lists(store):
    put_rank(store, 1, 0, world=1)
    commit = mf.write_commit(store, "ns", "job", 1, 1, 0)
    key = commit.manifests[0].key
    body = json.loads(store.get(key))
    body["total_bytes"] = 11
    store.put(key, json.dumps(body).encode())  # a manifest changed after commit
    with pytest.raises(CorruptObject, match="sha256"):
        mf.load_manifest(store, commit, 0)


def test_read_object_checks_size_and_crc(store):
    ref = put_rank(store, 1, 0, world=1)
    m = mf.Manifest.from_json(store.get(ref.key))
    obj = m.objects[0]
    assert mf.read_object(store, obj) == bytes(10)
    store.put(obj.key, b"\x01" + bytes(9))
    with pytest.raises(CorruptObject, match="crc32"):
        mf.read_object(store, obj)
    store.put(obj.key, bytes(9))
    with pytest.raises(CorruptObject, match="size 9"):
        mf.read_object(store, obj)


def test_latest_only_moves_forward(store):
    for step in (3, 7):
        put_rank(store, step, 0, world=1)
        mf.write_commit(store, "ns", "job", step, 1, 0)
    put_rank(store, 5, 0, world=1)
    mf.write_commit(store, "ns", "job", 5, 1, 0)  # an older step committing late
    assert json.loads(store.get(mf.latest_key("ns", "job")))["step"] == 7
    assert mf.newest_committed(store, "ns", "job") == 7


def test_discovery_takes_a_constant_number_of_requests(store):
    for step in range(40):
        put_rank(store, step, 0, world=1)
        mf.write_commit(store, "ns", "job", step, 1, 0)
    put_rank(store, 40, 0, world=1)  # newer, never committed
    store.requests.clear()
    assert mf.newest_committed(store, "ns", "job") == 39
    few = sum(store.requests.values())
    for step in range(40, 400):
        put_rank(store, step, 0, world=1)
        mf.write_commit(store, "ns", "job", step, 1, 0)
    put_rank(store, 400, 0, world=1)  # again one newer step in flight
    store.requests.clear()
    assert mf.newest_committed(store, "ns", "job") == 399
    # GET LATEST, one LIST of newer steps, HEAD of the in-flight step's COMMIT, HEAD of LATEST's COMMIT
    assert few == 4 and sum(store.requests.values()) == few


def test_discovery_sees_a_commit_newer_than_latest(store):
    put_rank(store, 1, 0, world=1)
    mf.write_commit(store, "ns", "job", 1, 1, 0)
    put_rank(store, 2, 0, world=1)
    mf.write_commit(store, "ns", "job", 2, 1, 0)
    store.put(mf.latest_key("ns", "job"), json.dumps({"step": 1}).encode())  # a lagging pointer
    assert mf.newest_committed(store, "ns", "job") == 2


def test_discovery_without_latest_scans_and_says_so(store, caplog):
    caplog.set_level("INFO")
    assert mf.newest_committed(store, "ns", "job") is None
    put_rank(store, 4, 0, world=1)
    mf.write_commit(store, "ns", "job", 4, 1, 0)
    store.delete([mf.latest_key("ns", "job")])
    assert mf.newest_committed(store, "ns", "job") == 4
    assert "LATEST missing" in caplog.text


def test_latest_pointing_at_an_uncommitted_step_is_not_trusted(store):
    put_rank(store, 2, 0, world=1)
    mf.write_commit(store, "ns", "job", 2, 1, 0)
    store.put(mf.latest_key("ns", "job"), json.dumps({"step": 9}).encode())
    assert mf.newest_committed(store, "ns", "job") == 2


def test_manifest_format_version_is_checked(store):
    ref = put_rank(store, 1, 0, world=1)
    body = json.loads(store.get(ref.key))
    assert body["format_version"] == 1 and body["tensors"][0]["encoding"] == "raw"
    body["format_version"] = 2
    with pytest.raises(CorruptObject, match="format_version 2"):
        mf.Manifest.from_json(json.dumps(body).encode(), "k")
    with pytest.raises(CorruptObject, match="not a valid manifest"):
        mf.Manifest.from_json(b"{}", "k")


@pytest.mark.parametrize("name", ["", "UPPER", "a/b", "-x", "x" * 300])
def test_names_become_safe_key_segments(name):
    with pytest.raises(ValueError, match="must be lowercase"):
        mf.job_prefix("ns", name)


def test_keys_are_unique_per_save_attempt():
    a = mf.rank_prefix("ns", "job", 10, 0, "aaaa", 0)
    b = mf.rank_prefix("ns", "job", 10, 0, "bbbb", 0)
    c = mf.rank_prefix("ns", "job", 10, 1, "aaaa", 0)
    assert len({a, b, c}) == 3
    assert a == "ns/job/steps/000000000010/a0000-aaaa/rank-0/"


def test_retention_keeps_the_newest_committed_steps_and_what_they_require(store):
    for step in range(1, 7):
        put_rank(store, step, 0, world=1)
        mf.write_commit(store, "ns", "job", step, 1, 0)
    put_rank(store, 2, 0, world=1, attempt=1, save_id="torn")  # a torn attempt of an old step
    put_rank(store, 7, 0, world=1)  # in flight: newer than every commit, never touched
    assert mf.collect_garbage(store, "ns", "job", keep=2) == [1, 2, 3, 4]
    assert mf.committed_steps(store, "ns", "job") == [5, 6]
    assert store.list("ns/job/steps/000000000001/").objects == []
    assert store.list("ns/job/steps/000000000007/").objects  # the in-flight save is intact
    assert mf.newest_committed(store, "ns", "job") == 6


def test_retention_never_deletes_a_required_base(store):
    for step in range(1, 5):
        put_rank(store, step, 0, world=1)
        commit = mf.write_commit(store, "ns", "job", step, 1, 0)
    commit.requires = [1]  # step 4 is a diff on top of step 1
    store.put(mf.commit_key("ns", "job", 4), commit.to_json())
    assert mf.collect_garbage(store, "ns", "job", keep=0) == []  # 0 keeps everything
    # 1 is needed; 2 and 3 (diffs on 1 that 4 supersedes) are not.
    assert mf.collect_garbage(store, "ns", "job", keep=1) == [2, 3]
    assert mf.committed_steps(store, "ns", "job") == [1, 4]


def test_retention_keeps_a_whole_chain_of_diffs(store):
    for step in range(1, 6):
        put_rank(store, step, 0, world=1)
        commit = mf.write_commit(store, "ns", "job", step, 1, 0)
    commit.requires = [2, 3, 4]  # step 5 replays 2 (a full), 3 and 4
    store.put(mf.commit_key("ns", "job", 5), commit.to_json())
    assert mf.collect_garbage(store, "ns", "job", keep=1) == [1]
    assert mf.committed_steps(store, "ns", "job") == [2, 3, 4, 5]
