"""Every reader of a bucket object answers malformed input with CorruptObject naming the key and the
field: nesting and size are bounded before parsing, every field of a MANIFEST is checked, a COMMIT's
world size is bounded before anything is sized by it, and a MANIFEST names only objects of its own
job, step and rank."""

from __future__ import annotations

import json
import uuid

import pytest

from sidecar import manifest as mf
from sidecar.api import MAX_WORLD_SIZE
from sidecar.engine.types import Identity
from sidecar.errors import CorruptObject, InvalidArgument
from sidecar.store import open_store

DEEP = 100_000


@pytest.fixture
def store():
    return open_store(f"memory://readers-{uuid.uuid4().hex}")


def _manifest(job="job", step=2, rank=0, world=1, attempt=0, save_id="abc"):
    prefix = mf.rank_prefix("ns", job, step, attempt, save_id, rank)
    tensors = [mf.TensorEntry("w", "float32", [2, 2], 16, 0, xxh3="0" * 16)]
    objects = [mf.ObjectEntry(prefix + "obj-00000", 16, xxh3="0" * 16)]
    tree = {"root": {"w": {"$tensor": 0}}}
    return mf.Manifest("ns", job, step, rank, world, attempt, save_id, 16, tree, tensors, objects)


def _key(m: mf.Manifest) -> str:
    return mf.rank_prefix(m.namespace, m.job, m.step, m.attempt, m.save_id, m.rank) + "MANIFEST"


def _deep(kind: str) -> bytes:
    return b"[" * DEEP + b"]" * DEEP if kind == "list" else b'{"a":' * DEEP + b"1" + b"}" * DEEP


@pytest.mark.parametrize("kind", ["list", "object"])
@pytest.mark.parametrize("reader", [mf.Manifest, mf.Commit, mf.Epoch])
def test_deeply_nested_records_are_corrupt_not_a_recursion_error(reader, kind):
    with pytest.raises(CorruptObject, match=r"the-key: .*nested deeper than"):
        reader.from_json(_deep(kind), "the-key")


def test_a_deep_value_inside_a_valid_record_is_corrupt():
    body = json.loads(_manifest().to_json())
    body["tree"] = {"root": {"x": json.loads(b"[" * 600 + b"]" * 600)}}
    with pytest.raises(CorruptObject, match="nested deeper than"):
        mf.Manifest.from_json(json.dumps(body).encode(), "k")
    # A string holding brackets is no nesting.
    body["tree"] = {"root": {"x": "[" * DEEP + '\\"{'}}
    assert mf.Manifest.from_json(json.dumps(body).encode(), "k").tree["root"]["x"].startswith("[[")


def test_oversized_records_are_corrupt_before_parsing():
    body = b'{"pad": "' + b" " * (mf.MAX_RECORD_BYTES + 1) + b'"}'
    for reader in (mf.Commit, mf.Epoch):
        with pytest.raises(CorruptObject, match="exceeds"):
            reader.from_json(body, "k")


def test_deep_latest_and_marker_bodies_are_read_as_damage(store):
    mf.create_epoch(store, "ns", "job", mf.Generation.parse("run/0"), 1, None, mf.Fences())
    store.put(mf.latest_key("ns", "job"), _deep("list"))
    assert mf.newest_valid(store, "ns", "job") is None  # LATEST unreadable: a scan, nothing found
    store.put(mf.unusable_prefix("ns", "job") + "000000000003-a0000", _deep("object"))
    [marker] = mf.unusable_markers(store, "ns", "job")
    assert marker.position == (0, 3) and marker.cause == "unknown"


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (("tensors", 0), [], r"tensors\[0\]"),
        (("tensors", 0, "nbytes"), "16", r"tensors\[0\].*nbytes"),
        (("tensors", 0, "shape"), [2, -1], r"tensors\[0\].*shape"),
        (("tensors", 0, "name"), 7, r"tensors\[0\].*name"),
        (("tensors", 0, "bits"), True, r"tensors\[0\].*bits"),
        (("tensors", 0, "rel_l2_error"), "x", r"tensors\[0\].*rel_l2_error"),
        (("objects", 0), "obj", r"objects\[0\]"),
        (("objects", 0, "size"), -1, r"objects\[0\].*size"),
        (("objects", 0, "xxh3"), 5, r"objects\[0\].*xxh3"),
        (("replicas",), [{"name": "x"}], r"replicas\[0\]"),
        (("tensors",), {"w": 1}, "tensors"),
        (("world_size",), 10**12, "world_size"),
        (("rank",), 1, "rank"),
        (("step",), -1, "step"),
        (("created_at",), {"kind": "x"}, "created_at"),
        (("checkpoint",), "partial", "checkpoint"),
        (("base_commit",), [], "base_commit"),
        (("required_commits",), [1], r"required_commits\[0\]"),
        (("requires",), ["x"], "requires"),
        (("save_id",), "a/b", "save_id"),
    ],
)
def test_a_manifest_damaged_in_any_field_is_corrupt_naming_it(path, value, named):
    m = _manifest()
    body = json.loads(m.to_json())
    assert mf.Manifest.from_json(json.dumps(body).encode(), _key(m)).tensors[0].nbytes == 16
    node = body
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    with pytest.raises(CorruptObject, match=f"{_key(m)}: .*{named}"):
        mf.Manifest.from_json(json.dumps(body).encode(), _key(m))


def test_a_commit_of_a_huge_world_size_is_corrupt_without_sizing_anything():
    body = json.loads(mf.Commit("ns", "job", 2, 1, 0, 10, []).to_json())
    for world in (10**12, MAX_WORLD_SIZE + 1):
        body["world_size"] = world
        with pytest.raises(CorruptObject, match="world_size"):
            mf.Commit.from_json(json.dumps(body).encode(), mf.commit_key("ns", "job", 2, 0))


def test_saves_refuse_a_world_size_no_reader_accepts():
    Identity("ns", "job", 0, MAX_WORLD_SIZE, 0).validate()
    with pytest.raises(InvalidArgument, match="world size"):
        Identity("ns", "job", 0, MAX_WORLD_SIZE + 1, 0).validate()


@pytest.mark.parametrize(
    "where",
    [
        "ns/other/steps/000000000002/a0000-abc/rank-0/obj-00000",  # another job
        "ns/job/steps/000000000001/a0000-abc/rank-0/obj-00000",  # another step
        "ns/job/steps/000000000002/a0000-abc/rank-1/obj-00000",  # another rank
        "ns/job/steps/000000000002/a0001-abc/rank-0/obj-00000",  # another attempt
        "ns/job/steps/000000000002/a0000-abc/rank-0/../../../../../other/x",
        "ns/job/steps/000000000002/a0000-abc/rank-0/",
    ],
)
def test_a_manifest_naming_an_object_outside_its_own_directory_is_corrupt(where):
    m = _manifest()
    m.objects[0].key = where
    with pytest.raises(CorruptObject, match="objects"):
        mf.Manifest.from_json(m.to_json(), _key(m))


def test_a_manifest_read_from_another_key_than_its_own_is_corrupt():
    m = _manifest(job="other")
    body = m.to_json()
    assert mf.Manifest.from_json(body, _key(m)).job == "other"
    with pytest.raises(CorruptObject, match="MANIFEST of"):
        mf.Manifest.from_json(body, _key(_manifest()))  # job's key, other's manifest
    with pytest.raises(CorruptObject, match="MANIFEST of"):
        mf.Manifest.from_json(body, _key(_manifest(job="other", rank=0, step=3)))


def test_load_manifest_checks_it_against_the_commit_that_lists_it(store):
    mine, theirs = _manifest(), _manifest(job="other")
    for m in (mine, theirs):
        store.put(_key(m), m.to_json())
    body = theirs.to_json()
    # A COMMIT of job at step 2 resealed to list the other job's MANIFEST body (under job's prefix).
    store.put(_key(mine), body)
    ref = mf.ManifestRef(0, _key(mine), mf.sha256(body), len(body))
    commit = mf.Commit("ns", "job", 2, 1, 0, 16, [ref])
    with pytest.raises(CorruptObject, match=_key(mine)):
        mf.load_manifest(store, commit, 0)
    store.put(_key(mine), mine.to_json())
    ref.sha256 = mf.sha256(mine.to_json())
    assert mf.load_manifest(store, commit, 0).job == "job"
    other_world = mf.Commit("ns", "job", 2, 1, 1, 16, [ref])  # attempt 1 listing attempt 0's manifest
    with pytest.raises(CorruptObject, match="attempt"):
        mf.load_manifest(store, other_world, 0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("attempt", "0"),
        ("world_size", 10**12),
        ("generation", 5),
        ("restore_step", -2),
        ("restore_attempt", "x"),
        ("created_at", None),
        ("history", {"0": 1}),
        ("history", [[0]]),
        ("history", [["r", None, "g"]]),
        ("history", [[0, "5", "g"]]),
        ("history", [[0, None, 7]]),
    ],
)
def test_an_epoch_record_damaged_in_any_field_is_corrupt_naming_it(store, field, value):
    mf.create_epoch(store, "ns", "job", mf.Generation.parse("run/0"), 1, None, mf.Fences())
    mf.create_epoch(
        store, "ns", "job", mf.Generation.parse("run/1"), 1, None, mf.read_fences(store, "ns", "job")
    )
    key = mf.epoch_key("ns", "job", 1)
    body = json.loads(store.get(key))
    assert mf.Epoch.from_json(json.dumps(body).encode(), key).history == [[0, None, "run/0"]]
    body[field] = value
    with pytest.raises(CorruptObject, match=f"{key}: .*{field}"):
        mf.Epoch.from_json(json.dumps(body).encode(), key)
    store.put(key, json.dumps(body).encode())
    fences = mf.read_fences(store, "ns", "job")  # the record before it still reads
    assert list(fences.damaged) == [1] and fences.newest is not None and fences.newest.attempt == 0
