"""Readers of bucket records that survive damage: EPOCH history recovered from the records
before a damaged one, COMMITs checked field by field, markers that say why and who, and names
matched whole."""

from __future__ import annotations

import json
import uuid

import pytest

from sidecar import manifest as mf
from sidecar.errors import CorruptObject
from sidecar.store import open_store


@pytest.fixture
def store():
    return open_store(f"memory://records-{uuid.uuid4().hex}")


def _epochs(store, restores):
    fences = mf.Fences()
    for i, restore in enumerate(restores):
        mf.create_epoch(store, "ns", "job", mf.Generation.parse(f"run/{i}"), 1, restore, fences)
        fences = mf.read_fences(store, "ns", "job")
    return fences


@pytest.mark.parametrize("damage", [b"{not json", b'{"kind": "strata.epoch"}', None])
def test_a_damaged_newest_epoch_record_falls_back_to_the_ones_before_it(store, damage):
    _epochs(store, [None, (0, 5), (1, 3)])  # attempt 2 rolled back to step 3
    key = mf.epoch_key("ns", "job", 2)
    if damage is None:  # a record that names another attempt
        body = json.loads(store.get(key))
        body["attempt"] = 7
        damage = json.dumps(body).encode()
    store.put(key, damage)
    fences = mf.read_fences(store, "ns", "job")
    assert fences.newest is not None and fences.newest.attempt == 1
    assert list(fences.damaged) == [2] and fences.newest_attempt == 2
    assert fences.restores == {0: None, 1: 5}  # attempt 2's restore step is unknown: no fence
    assert fences.valid(0, 5) and not fences.valid(0, 6) and fences.valid(1, 9)
    assert "strata repair-epoch" in mf.damaged_epoch_text("ns", "job", 2, fences.damaged[2])
    # Incremental reads (from the fences a sidecar knows) see the same.
    known = mf.read_fences(store, "ns", "job", fences)
    assert (known.newest_attempt, set(known.damaged), known.restores) == (2, {2}, fences.restores)
    # The next attempt takes number 3, its record carries the readable history on.
    created = mf.create_epoch(store, "ns", "job", mf.Generation.parse("run/9"), 1, (1, 4), fences)
    assert created.attempt == 3
    after = mf.read_fences(store, "ns", "job")
    assert after.restores == {0: None, 1: 5, 3: 4}
    # ... and attempt 2 as unknown: a rollback's fence is never dropped from the history.
    assert created.unknown_restores == [2] and after.unknown == {2} and list(after.damaged) == [2]
    # The repair rewrites the record with the history before it.
    repaired = mf.repair_epoch(store, "ns", "job", 2, (1, 3), after, "run/2")
    assert (repaired.attempt, repaired.restore, repaired.history) == (
        2,
        (1, 3),
        [[0, None, "run/0"], [1, 5, "run/1"]],
    )
    assert mf.epoch_damage(store, "ns", "job", 2) is None
    # Repaired, the later record's unknown resolves to it.
    healed = mf.read_fences(store, "ns", "job")
    assert (healed.unknown, healed.damaged) == (set(), {})
    assert healed.restores == {0: None, 1: 5, 2: 3, 3: 4}
    with pytest.raises(ValueError, match="not damaged"):
        mf.repair_epoch(store, "ns", "job", 2, (1, 3), after, "run/2")


def test_an_epoch_record_of_a_newer_format_is_not_taken_for_damage(store):
    _epochs(store, [None])
    key = mf.epoch_key("ns", "job", 0)
    body = json.loads(store.get(key))
    body["format_version"] = mf.FORMAT_VERSION + 1
    store.put(key, json.dumps(body).encode())
    with pytest.raises(CorruptObject, match="newer sidecar"):
        mf.read_fences(store, "ns", "job")


def _commit(world=1):
    refs = [
        mf.ManifestRef(r, mf.rank_prefix("ns", "job", 2, 0, "abc", r) + "MANIFEST", "0" * 64, 10)
        for r in range(world)
    ]
    return mf.Commit("ns", "job", 2, world, 0, 10, refs)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("world_size", 2),
        ("world_size", 0),
        ("world_size", "1"),
        ("world_size", True),
        ("step", 3),
        ("attempt", 4),
        ("job", "other"),
        ("total_bytes", -1),
        ("requires", ["x"]),
    ],
)
def test_a_commit_damaged_in_any_field_is_corrupt(field, value):
    body = json.loads(_commit().to_json())
    key = mf.commit_key("ns", "job", 2, 0)
    assert mf.Commit.from_json(json.dumps(body).encode(), key).world_size == 1
    body[field] = value
    with pytest.raises(CorruptObject, match=key):
        mf.Commit.from_json(json.dumps(body).encode(), key)


def test_a_commit_naming_a_manifest_outside_its_step_is_corrupt():
    body = json.loads(_commit(2).to_json())
    body["manifests"][1]["key"] = "ns/job/steps/000000000001/a0000-abc/rank-1/MANIFEST"
    with pytest.raises(CorruptObject, match="outside step 2"):
        mf.Commit.from_json(json.dumps(body).encode(), mf.commit_key("ns", "job", 2, 0))


def test_markers_say_why_and_who_and_clear(store):
    mf.mark_unusable(store, "ns", "job", (0, 2), "rank 0: gone", "missing", "rank 0/1 of generation r/1")
    mf.mark_unusable(store, "ns", "job", (1, 4), "rank 1: bad digest", "corrupt", "rank 1/2")
    store.put(mf.unusable_prefix("ns", "job") + "000000000003-v1", b"an older release's reason")
    markers = mf.unusable_markers(store, "ns", "job")
    assert [(m.position, m.cause) for m in markers] == [
        ((-1, 3), "unknown"),
        ((0, 2), "missing"),
        ((1, 4), "corrupt"),
    ]
    assert markers[1].by == "rank 0/1 of generation r/1" and markers[1].at > 0
    assert "step 2 (attempt 0) missing: rank 0: gone; marked by rank 0/1" in markers[1].describe()
    assert mf.unusable_commits(store, "ns", "job") == {(-1, 3), (0, 2), (1, 4)}
    assert [m.step for m in mf.clear_markers(store, "ns", "job", {2})] == [2]
    assert mf.unusable_commits(store, "ns", "job") == {(-1, 3), (1, 4)}
    mf.clear_markers(store, "ns", "job")
    assert mf.unusable_markers(store, "ns", "job") == []
    with pytest.raises(ValueError, match="cause"):
        mf.mark_unusable(store, "ns", "job", (0, 2), "x", "flaky")


@pytest.mark.parametrize("name", ["evil\n", "job\n", "a\r", "", "-a", "A", "a b"])
def test_names_are_matched_whole(name):
    with pytest.raises(ValueError):
        mf.check_name("job", name)


def test_keys_with_a_trailing_newline_are_not_commit_keys():
    key = mf.commit_key("ns", "job", 2, 0)
    assert mf.parse_commit_key(key) == (0, 2)
    with pytest.raises(ValueError):
        mf.parse_commit_key(key + "\n")
