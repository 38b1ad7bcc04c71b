"""The commit protocol on an in-memory store: manifests, COMMIT, LATEST, discovery."""

from __future__ import annotations

import json
import uuid

import pytest

from sidecar import manifest as mf
from sidecar.errors import CorruptObject, FailedPrecondition, ObjectNotFound, PreconditionFailed
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
    # LIST EPOCH/, GET LATEST, one LIST of newer step dirs, one LIST of the in-flight step's
    # commit dirs, HEAD of LATEST's COMMIT
    assert few == 5 and sum(store.requests.values()) == few


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
    assert body["format_version"] == mf.FORMAT_VERSION == 2 and body["tensors"][0]["encoding"] == "raw"
    for other in (0, 3, "2", None):  # formats before the first and after this build's, and junk
        body["format_version"] = other
        with pytest.raises(CorruptObject, match=rf"format_version {other!r} is not supported.*reads 1 and 2"):
            mf.Manifest.from_json(json.dumps(body).encode(), "k")
    # Format 1 (the previous release's) is read, never written: as format 2 names its fields.
    old = {k: v for k, v in body.items() if k not in ("base_commit", "required_commits", "generation")}
    old["format_version"] = 1
    old["tensors"] = [{k: v for k, v in t.items() if k != "crc32"} for t in body["tensors"]]
    m = mf.Manifest.from_json(json.dumps(old).encode(), "k")
    assert (m.format_version, m.attempt, m.base_commit) == (1, mf.LEGACY_ATTEMPT, None)
    assert m.required_commits == []
    old.update(checkpoint="diff", base_step=0, requires=[0])
    m = mf.Manifest.from_json(json.dumps(old).encode(), "k")
    assert m.base_commit == mf.CommitRef("ns/job/steps/000000000000/COMMIT", "")
    assert m.base_commit.step == 0 and m.base_commit.attempt == mf.LEGACY_ATTEMPT
    with pytest.raises(CorruptObject, match="format_version 1 is not supported"):  # epochs are format 2
        mf.Epoch.from_json(json.dumps({"kind": "strata.epoch", "format_version": 1}).encode(), "e")
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
    store.put(mf.commit_key("ns", "job", 4, 0), commit.to_json())
    assert mf.collect_garbage(store, "ns", "job", keep=0) == []  # 0 keeps everything
    # 1 is needed; 2 and 3 (diffs on 1 that 4 supersedes) are not.
    assert mf.collect_garbage(store, "ns", "job", keep=1) == [2, 3]
    assert mf.committed_steps(store, "ns", "job") == [1, 4]


def test_retention_keeps_a_whole_chain_of_diffs(store):
    for step in range(1, 6):
        put_rank(store, step, 0, world=1)
        commit = mf.write_commit(store, "ns", "job", step, 1, 0)
    commit.requires = [2, 3, 4]  # step 5 replays 2 (a full), 3 and 4
    store.put(mf.commit_key("ns", "job", 5, 0), commit.to_json())
    assert mf.collect_garbage(store, "ns", "job", keep=1) == [1]
    assert mf.committed_steps(store, "ns", "job") == [2, 3, 4, 5]


# --- attempts, fences, create-only COMMIT, LATEST order, retention across attempts ----------


def new_epoch(store, generation: str, restore: tuple[int, int] | None, world: int = 1) -> mf.Epoch:
    """What a generation's rank-0 sidecar does at start: read the fences, create the next EPOCH."""
    fences = mf.read_fences(store, "ns", "job")
    return mf.create_epoch(store, "ns", "job", mf.Generation.parse(generation), world, restore, fences)


def commit_step(store, step: int, attempt: int, save_id: str = "abc") -> mf.Commit:
    put_rank(store, step, 0, world=1, attempt=attempt, save_id=save_id)
    return mf.write_commit(store, "ns", "job", step, 1, attempt)


def latest(store) -> tuple[int, int]:
    body = json.loads(store.get(mf.latest_key("ns", "job")))
    assert body["commit"] == mf.commit_key("ns", "job", body["step"], body["attempt"])
    return body["attempt"], body["step"]


def test_commit_keys_are_attempt_scoped():
    key = mf.commit_key("ns", "job", 12, 3)
    assert key == "ns/job/steps/000000000012/a0003/COMMIT"
    assert mf.parse_commit_key(key) == (3, 12)
    assert mf.epoch_key("ns", "job", 3) == "ns/job/EPOCH/00000003"
    # The old, step-level key (format 1, read only) reads as the legacy attempt.
    assert mf.parse_commit_key("ns/job/steps/000000000012/COMMIT") == (mf.LEGACY_ATTEMPT, 12)
    assert mf.commit_key("ns", "job", 12, mf.LEGACY_ATTEMPT) == "ns/job/steps/000000000012/COMMIT"
    with pytest.raises(ValueError, match="not a COMMIT key"):
        mf.parse_commit_key("ns/job/steps/000000000012/a0003/MANIFEST")


def test_a_later_epoch_fences_off_commits_above_its_restore_step(store):
    assert new_epoch(store, "run/0", None).attempt == 0
    for step in range(1, 6):
        commit_step(store, step, attempt=0)
    assert mf.committed_steps(store, "ns", "job") == [1, 2, 3, 4, 5]
    epoch = new_epoch(store, "run/1", (0, 3))  # the gang restarts from step 3
    assert (epoch.attempt, epoch.restore) == (1, (0, 3))
    fences = mf.read_fences(store, "ns", "job")
    # s <= R stays valid (R itself included); s > R is void
    assert [fences.valid(0, s) for s in (1, 2, 3, 4, 5)] == [True, True, True, False, False]
    assert fences.valid(1, 10**6)  # nothing later bounds the newest attempt
    assert mf.committed_steps(store, "ns", "job") == [1, 2, 3]
    assert mf.valid_commits(store, "ns", "job") == [(0, 1), (0, 2), (0, 3)]
    assert not mf.is_committed(store, "ns", "job", 4)
    with pytest.raises(ObjectNotFound, match="no valid COMMIT of step 5"):
        mf.read_commit(store, "ns", "job", 5)
    assert mf.read_commit(store, "ns", "job", 5, attempt=0).attempt == 0  # still there, just void
    # A zombie of attempt 0 keeps writing: its commit exists but is void from the start.
    commit_step(store, 6, attempt=0, save_id="zombie")
    assert store.head(mf.commit_key("ns", "job", 6, 0)) is not None
    assert mf.newest_valid(store, "ns", "job") == (0, 3)
    assert mf.newest_committed(store, "ns", "job") == 3


def test_the_smallest_later_restore_step_wins_and_history_carries_the_fences(store):
    new_epoch(store, "run/0", None)
    for step in (1, 2, 3, 4):
        commit_step(store, step, attempt=0)
    new_epoch(store, "run/1", (0, 4))
    commit_step(store, 5, attempt=1)
    # attempt 2 rolls back to step 2: (0, 3), (0, 4) and (1, 5) all become void even though
    # attempt 1 had kept (0, 3) and (0, 4)
    epoch = new_epoch(store, "run/2", (0, 2))
    assert epoch.history == [[0, None, "run/0"], [1, 4, "run/1"]]
    assert mf.read_fences(store, "ns", "job").generations == {0: "run/0", 1: "run/1"}
    fences = mf.read_fences(store, "ns", "job")
    assert fences.restores == {0: None, 1: 4, 2: 2}
    assert fences.floor(0) == 2 and fences.floor(1) == 2 and fences.floor(2) is None
    assert mf.valid_commits(store, "ns", "job") == [(0, 1), (0, 2)]
    # fences read incrementally (only records after the newest known one) agree
    known = mf.Fences({0: None}, mf.Epoch.from_json(store.get(mf.epoch_key("ns", "job", 0))))
    assert mf.read_fences(store, "ns", "job", known).restores == fences.restores
    # an attempt that found nothing to restore fences off every earlier commit
    new_epoch(store, "run/3", None)
    assert mf.valid_commits(store, "ns", "job") == []
    assert mf.newest_valid(store, "ns", "job") is None


def test_a_void_commit_does_not_block_the_new_attempt_from_committing_that_step(store):
    new_epoch(store, "run/0", None)
    for step in (1, 2):
        commit_step(store, step, attempt=0)
    new_epoch(store, "run/1", (0, 1))
    assert mf.step_commits(store, "ns", "job", 2) == [0]
    commit = commit_step(store, 2, attempt=1, save_id="new")
    assert commit.key == mf.commit_key("ns", "job", 2, 1)
    assert mf.step_commits(store, "ns", "job", 2) == [0, 1]
    assert mf.read_commit(store, "ns", "job", 2).attempt == 1  # the newest valid commit of step 2
    assert mf.newest_valid(store, "ns", "job") == (1, 2)


def test_commit_is_create_only(store):
    put_rank(store, 3, 0, world=1, save_id="first")
    first = mf.write_commit(store, "ns", "job", 3, 1, 0)
    body = store.get(first.key)
    # The same commit put again (a retried PUT whose first try landed) is accepted.
    ref = mf.put_commit(store, first)
    assert ref == mf.CommitRef(first.key, mf.sha256(body))
    assert mf.put_commit(store, mf.Commit.from_json(body)) == ref
    # A second writer of the same (attempt, step) with other manifests loses.
    put_rank(store, 3, 0, world=1, save_id="second")
    with pytest.raises(PreconditionFailed, match="another writer"):
        mf.write_commit(store, "ns", "job", 3, 1, 0)
    other = mf.Commit.from_json(body)
    other.manifests = [mf.ManifestRef(0, "elsewhere/MANIFEST", "0" * 64, 1)]
    with pytest.raises(PreconditionFailed, match="another writer"):
        mf.put_commit(store, other)
    # ... and an object there that is not a COMMIT is never taken for one
    store.put(mf.commit_key("ns", "job", 4, 0), b"junk")
    put_rank(store, 4, 0, world=1)
    with pytest.raises(PreconditionFailed, match="not readable as a COMMIT"):
        mf.write_commit(store, "ns", "job", 4, 1, 0)
    assert store.get(first.key) == body  # nothing was overwritten
    assert store.get(mf.commit_key("ns", "job", 4, 0)) == b"junk"


def test_latest_moves_forward_in_attempt_step_order(store):
    new_epoch(store, "run/0", None)
    for step in (3, 7):
        commit_step(store, step, attempt=0)
    assert latest(store) == (0, 7)
    new_epoch(store, "run/1", (0, 3))
    # Before attempt 1 commits anything, LATEST names a void commit: discovery skips it
    # and finds the restore point.
    assert mf.newest_valid(store, "ns", "job") == (0, 3)
    commit_step(store, 4, attempt=1)  # a rollback: a lower step than LATEST, a newer attempt
    assert latest(store) == (1, 4)
    commit_step(store, 8, attempt=0, save_id="zombie")  # a higher step of an older attempt
    assert latest(store) == (1, 4)
    mf.advance_latest(store, "ns", "job", 1, 2)  # an older step of the same attempt
    assert latest(store) == (1, 4)
    assert mf.newest_valid(store, "ns", "job") == (1, 4)


def test_advance_latest_with_a_stale_etag_rereads_and_never_moves_back(store):
    etag = mf.advance_latest(store, "ns", "job", 0, 5)
    assert etag and latest(store) == (0, 5)
    etag = mf.advance_latest(store, "ns", "job", 0, 6, etag=etag)  # nobody wrote since: no GET
    assert etag and latest(store) == (0, 6)
    mf.advance_latest(store, "ns", "job", 1, 2)  # another writer moves it on
    assert mf.advance_latest(store, "ns", "job", 0, 9, etag=etag) == ""
    assert latest(store) == (1, 2)


def test_discovery_skips_a_latest_that_names_a_void_commit(store, caplog):
    new_epoch(store, "run/0", None)
    for step in (1, 2, 3):
        commit_step(store, step, attempt=0)
    new_epoch(store, "run/1", (0, 2))
    commit_step(store, 3, attempt=1)
    # a zombie's write (or a lost race) left LATEST naming the void (0, 3)
    store.put(
        mf.latest_key("ns", "job"),
        json.dumps({"attempt": 0, "step": 3, "commit": mf.commit_key("ns", "job", 3, 0)}).encode(),
    )
    caplog.set_level("INFO")
    assert mf.newest_valid(store, "ns", "job") == (1, 3)
    assert "fenced-off" in caplog.text
    # LATEST names an excluded (unusable) commit: the same scan
    assert mf.newest_valid(store, "ns", "job", exclude={(1, 3)}) == (0, 2)


def test_discovery_prefers_a_newer_attempt_over_a_higher_step(store):
    new_epoch(store, "run/0", None)
    for step in (1, 2, 3):
        commit_step(store, step, attempt=0)
    new_epoch(store, "run/1", (0, 3))
    commit_step(store, 2, attempt=1, save_id="redo")  # cannot happen through the engine, but
    # the order is by (attempt, step): attempt 1's step 2 is newer than attempt 0's step 3
    store.put(
        mf.latest_key("ns", "job"),
        json.dumps({"attempt": 0, "step": 1, "commit": mf.commit_key("ns", "job", 1, 0)}).encode(),
    )  # a lagging hint
    assert mf.newest_valid(store, "ns", "job") == (1, 2)


def test_create_epoch_is_create_only(store):
    stale = mf.read_fences(store, "ns", "job")
    gen = mf.Generation.parse("run/0")
    first = mf.create_epoch(store, "ns", "job", gen, 2, None, stale)
    assert first.attempt == 0
    # a second sidecar that read the same (now stale) fences loses the race for attempt 0
    with pytest.raises(PreconditionFailed):
        mf.create_epoch(store, "ns", "job", mf.Generation.parse("other/0"), 2, None, stale)
    fences = mf.read_fences(store, "ns", "job")
    assert fences.newest is not None and fences.newest.generation == "run/0"  # the winner stays
    second = mf.create_epoch(store, "ns", "job", mf.Generation.parse("run/1"), 2, None, fences)
    assert second.attempt == 1 and second.history == [[0, None, "run/0"]]


def test_generation_names_run_and_restart():
    gen = mf.Generation.parse("7f3c9a/2")
    assert (gen.run, gen.restart, str(gen)) == ("7f3c9a", 2, "7f3c9a/2")
    assert mf.Generation.parse("a/b/3").run == "a/b"
    assert mf.Generation.parse("t1/0") < mf.Generation.parse("t1/1")
    for bad in ("", "t1", "t1/", "/3", "t1/x", "t 1/0"):
        with pytest.raises(ValueError, match="RUN/RESTART"):
            mf.Generation.parse(bad)


def test_retention_keeps_commits_that_valid_kept_commits_require(store):
    new_epoch(store, "run/0", None)
    base = {}
    for step in range(1, 6):
        base[step] = commit_step(store, step, attempt=0)
    new_epoch(store, "run/1", (0, 3))  # (0, 4) and (0, 5) are void
    ref2 = mf.CommitRef(base[2].key, mf.sha256(store.get(base[2].key)))
    for step in (4, 5, 6):
        commit = commit_step(store, step, attempt=1)
        if step in (5, 6):  # diffs on top of (0, 2), named only by COMMIT reference
            commit.required_commits = [ref2]
            store.put(commit.key, commit.to_json())
    assert mf.collect_garbage(store, "ns", "job", keep=2) == [1, 3, 4]
    assert mf.valid_commits(store, "ns", "job") == [(0, 2), (1, 5), (1, 6)]
    for gone in (1, 3, 4):  # whole step directories, void commits included
        assert store.list(mf.step_prefix("ns", "job", gone)).objects == []
    kept = mf.load_ref(store, ref2)  # the base is whole: COMMIT, manifest and objects
    manifest = mf.load_manifest(store, kept, 0)
    assert mf.read_object(store, manifest.objects[0]) == bytes(10)
    assert mf.newest_valid(store, "ns", "job") == (1, 6)


def test_retention_does_not_count_void_commits_as_kept(store):
    new_epoch(store, "run/0", None)
    for step in range(1, 6):
        commit_step(store, step, attempt=0)
    new_epoch(store, "run/1", (0, 2))  # (0, 3..5) are void
    # keep=2 keeps (0, 1) and (0, 2), the only valid commits: nothing older to delete, and the
    # void ones are newer than the oldest kept step, so they stay too (harmless, never read)
    assert mf.collect_garbage(store, "ns", "job", keep=2) == []
    assert mf.collect_garbage(store, "ns", "job", keep=1) == [1]
    assert mf.valid_commits(store, "ns", "job") == [(0, 2)]


def test_retention_does_not_run_for_a_superseded_attempt(store, caplog):
    new_epoch(store, "run/0", None)
    for step in range(1, 6):
        commit_step(store, step, attempt=0)
    zombie = mf.Retention(store, "ns", "job", keep=1)
    for step in range(1, 6):
        zombie.note_commit(mf.read_commit(store, "ns", "job", step))
    new_epoch(store, "run/1", (0, 2))  # the gang restarted; attempt 0 lives on as a zombie
    before = sorted(o.key for o in store.list("ns/job/steps/").objects)
    caplog.set_level("INFO")
    assert zombie.run(0) == []
    assert zombie.run(0, mf.Fences()) == []  # stale fences it holds are re-read first
    assert "superseded" in caplog.text
    assert sorted(o.key for o in store.list("ns/job/steps/").objects) == before
    # the newest attempt does run it
    assert mf.Retention(store, "ns", "job", keep=1).run(1) == [1]
