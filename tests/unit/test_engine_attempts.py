"""sidecar.engine.attempts: which generation a trainer belongs to, the attempt it runs as, and
the restore step a new attempt records."""

from __future__ import annotations

import pytest

from sidecar import manifest as mf
from sidecar.api import LIMIT_SPENT_MARKER, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
from sidecar.engine.attempts import Attempts, check_protocol
from sidecar.engine.held import Held
from sidecar.engine.reports import Reports
from sidecar.engine.types import Identity
from sidecar.errors import FailedPrecondition, InvalidArgument, StorageError


def attempts_of(shared) -> Attempts:
    return Attempts(shared, Held(shared), Reports(shared))


def solo(generation: str = "run/0", rank: int = 0, world: int = 1) -> Identity:
    return Identity("ns", "job", rank, world, 0, generation)


def commit_step(store, step: int, attempt: int, world: int = 1) -> None:
    """A committed step of ns/job, as the engine leaves it in storage."""
    for rank in range(world):
        prefix = mf.rank_prefix("ns", "job", step, attempt, "abc", rank)
        store.put(prefix + "obj-00000", b"x" * 10)
        manifest = mf.Manifest(
            "ns", "job", step, rank, world, attempt, "abc", 10, None,
            [mf.TensorEntry("w", "uint8", [10], 10, 0)],
            [mf.ObjectEntry(prefix + "obj-00000", 10, mf.crc32(b"x" * 10))],
        )  # fmt: skip
        mf.write_manifest(store, prefix, manifest)
    mf.write_commit(store, "ns", "job", step, world, attempt)


def test_clients_of_this_protocol_and_the_one_before_are_served():
    for version in range(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION + 1):
        check_protocol(version)
    with pytest.raises(FailedPrecondition, match="Upgrade the trainer client"):
        check_protocol(MIN_PROTOCOL_VERSION - 1)
    with pytest.raises(FailedPrecondition, match="Upgrade the sidecar"):
        check_protocol(PROTOCOL_VERSION + 1)


def test_the_generation_file_wins_over_a_lone_trainers_default(make_shared, tmp_path):
    path = tmp_path / "generation"
    path.write_text("pod/3\n")
    attempts = attempts_of(make_shared(generation_file=str(path)))
    assert str(attempts.generation_of(solo(""))) == "pod/3"
    assert str(attempts.generation_of(solo("solo-abc/0"))) == "pod/3"
    assert str(attempts.generation_of(solo("pod/3"))) == "pod/3"
    with pytest.raises(FailedPrecondition, match="another gang generation"):
        attempts.generation_of(solo("pod/2"))
    path.write_text("pod/4")  # read each time: the gang restarted
    assert str(attempts.generation_of(solo(""))) == "pod/4"
    path.write_text("nonsense")
    with pytest.raises(FailedPrecondition, match="generation file"):
        attempts.generation_of(solo(""))
    path.unlink()
    with pytest.raises(FailedPrecondition, match="cannot read the generation file"):
        attempts.generation_of(solo(""))


def test_a_fixed_generation_and_what_the_trainer_declares(make_shared):
    fixed = attempts_of(make_shared(generation="fixed/1"))
    assert str(fixed.generation_of(solo("solo-x/0"))) == "fixed/1"
    with pytest.raises(FailedPrecondition, match="this sidecar's is fixed/1"):
        fixed.generation_of(solo("other/1"))
    declared = attempts_of(make_shared())
    assert str(declared.generation_of(solo("mine/2"))) == "mine/2"
    with pytest.raises(FailedPrecondition, match="no gang generation"):
        declared.generation_of(solo(""))
    with pytest.raises(InvalidArgument):
        declared.generation_of(solo("no-restart-count"))


def test_a_protocol_1_single_rank_gets_a_generation_per_handshake(make_shared):
    attempts = attempts_of(make_shared())
    v1 = solo("")
    attempts.greet(v1, 1)  # a save whose handshake went to an earlier sidecar process
    first = attempts.generation_of(v1)
    assert first.run.startswith("solo-v1-")
    attempts.greet(v1, 1)
    assert attempts.generation_of(v1) == first  # the same trainer process
    attempts.greet(v1, 1, handshake=True)
    assert attempts.generation_of(v1) != first  # a new trainer process
    several = solo("", world=2)
    attempts.greet(several, 1, handshake=True)
    with pytest.raises(FailedPrecondition, match="generation file"):
        attempts.generation_of(several)


def test_the_restore_request_file(make_shared, tmp_path):
    path = tmp_path / "restore"
    attempts = attempts_of(make_shared(restore_request_file=str(path)))
    assert attempts.restore_request() is None  # no file
    for text, expected in [("", None), ("none\n", "none"), ("12", "12"), ("stop", "stop")]:
        path.write_text(text)
        assert attempts.restore_request() == expected
    path.write_text("latest")
    with pytest.raises(FailedPrecondition, match="expected a committed step number"):
        attempts.restore_request()
    attempts.check_not_stopped(solo())  # a bad request stops nothing: the new attempt reports it
    path.write_text("stop")
    with pytest.raises(FailedPrecondition, match=LIMIT_SPENT_MARKER):
        attempts.check_not_stopped(solo())
    with pytest.raises(FailedPrecondition, match=LIMIT_SPENT_MARKER):
        attempts.epoch_for(solo())


def test_rank_0_allocates_an_attempt_per_generation_restoring_the_newest_commit(make_shared):
    shared = make_shared()
    attempts = attempts_of(shared)
    first = attempts.epoch_for(solo("run/0"))
    assert (first.attempt, first.restore) == (0, None)
    assert attempts.epoch_for(solo("run/0")) is first  # the same generation: no new record
    commit_step(shared.store, 3, attempt=0)
    restarted = attempts.epoch_for(solo("run/1"))
    assert (restarted.attempt, restarted.restore) == (1, (0, 3))
    assert shared.gang(("ns", "job")).epoch == restarted
    with pytest.raises(FailedPrecondition, match="older than run/1"):
        attempts.epoch_for(solo("run/0"))


def test_another_rank_waits_for_rank_0s_attempt(make_shared):
    shared = make_shared(commit_timeout_s=0.3)
    attempts = attempts_of(shared)
    with pytest.raises(FailedPrecondition, match="did not record its attempt"):
        attempts.epoch_for(solo("run/0", rank=1, world=2))
    other = attempts_of(make_shared(shared.store))  # rank 0 on another sidecar, same storage
    epoch = other.epoch_for(solo("run/0", rank=0, world=2))
    assert attempts.epoch_for(solo("run/0", rank=1, world=2)).attempt == epoch.attempt


def test_the_operators_restore_request_decides_a_new_attempts_restore(make_shared, tmp_path):
    path = tmp_path / "restore"
    shared = make_shared(restore_request_file=str(path))
    attempts = attempts_of(shared)
    commit_step(shared.store, 3, attempt=0)
    commit_step(shared.store, 5, attempt=0)
    fences = mf.read_fences(shared.store, "ns", "job")
    assert attempts.decide_restore(solo(), fences) == ((0, 5), "")
    path.write_text("none")
    assert attempts.decide_restore(solo(), fences) == (None, "fresh")
    path.write_text("3")
    assert attempts.decide_restore(solo(), fences) == ((0, 3), "requested")
    with pytest.raises(FailedPrecondition, match="saved by 1 ranks and this job runs 2"):
        attempts.decide_restore(solo(world=2), fences)
    path.write_text("4")
    with pytest.raises(FailedPrecondition, match=r"valid committed steps: \[3, 5\]"):
        attempts.decide_restore(solo(), fences)


def test_an_unusable_commit_is_never_chosen_again(make_shared):
    shared = make_shared()
    attempts = attempts_of(shared)
    commit_step(shared.store, 3, attempt=0)
    commit_step(shared.store, 5, attempt=0)
    attempts.mark_unusable(solo(), (0, 5), "rank 0: damaged")
    assert (0, 5) in mf.unusable_commits(shared.store, "ns", "job")
    fences = mf.read_fences(shared.store, "ns", "job")
    assert attempts.decide_restore(solo(), fences) == ((0, 3), "")
    epoch = attempts.reattempt(solo("run/0"))
    assert epoch.restore == (0, 3) and shared.gang(("ns", "job")).epoch == epoch


def test_a_marker_cleared_in_storage_is_restorable_again_on_the_same_sidecar(make_shared):
    shared = make_shared()
    attempts = attempts_of(shared)
    commit_step(shared.store, 3, attempt=0)
    commit_step(shared.store, 5, attempt=0)
    attempts.mark_unusable(solo(), (0, 5), "rank 0: damaged")
    fences = mf.read_fences(shared.store, "ns", "job")
    assert attempts.decide_restore(solo(), fences) == ((0, 3), "")
    # What `strata markers --clear` does: storage is the truth, this process remembers nothing.
    assert [mk.position for mk in mf.clear_markers(shared.store, "ns", "job", {5})] == [(0, 5)]
    assert attempts.decide_restore(solo(), fences) == ((0, 5), "")


def test_a_marker_that_failed_to_write_is_kept_until_written(make_shared, monkeypatch):
    shared = make_shared()
    attempts = attempts_of(shared)
    commit_step(shared.store, 3, attempt=0)
    commit_step(shared.store, 5, attempt=0)
    put = shared.store.put
    down = [True]

    def flaky_put(key, *args, **kwargs):
        if down[0] and "/UNUSABLE/" in key:
            raise StorageError("503 SlowDown")
        return put(key, *args, **kwargs)

    monkeypatch.setattr(shared.store, "put", flaky_put)
    attempts.mark_unusable(solo(), (0, 5), "rank 0: damaged")
    assert mf.unusable_markers(shared.store, "ns", "job") == []
    fences = mf.read_fences(shared.store, "ns", "job")
    assert attempts.decide_restore(solo(), fences) == ((0, 3), "")  # remembered, not written
    down[0] = False
    assert attempts.decide_restore(solo(), fences) == ((0, 3), "")  # written now: storage's
    [marker] = mf.unusable_markers(shared.store, "ns", "job")
    assert marker.position == (0, 5) and marker.detail == "rank 0: damaged"
    mf.clear_markers(shared.store, "ns", "job")
    assert attempts.decide_restore(solo(), fences) == ((0, 5), "")


def test_adopting_an_attempt_fences_older_ones(make_shared):
    shared = make_shared()
    attempts = attempts_of(shared)
    gang = shared.gang(("ns", "job"))
    epoch = mf.Epoch(4, "run/2", 1, 7, 1)
    attempts.adopt(gang, epoch)
    assert gang.epoch is epoch and gang.fences.newest is epoch
    assert not gang.fences.valid(1, 8) and gang.fences.valid(1, 7)
    assert shared.metrics.registry.get_sample_value("strata_attempt", {"training_job": "job"}) == 4
