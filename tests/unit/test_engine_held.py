"""sidecar.engine.held: what stays in memory per rank, and what it is charged to the budget."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from sidecar import manifest as mf
from sidecar.engine.held import Held
from sidecar.engine.types import Identity, Snapshot, drop_buffer, zeroed
from sidecar.pipeline.plan import Chain

RANK0 = Identity("ns", "job", 0, 2, 0)
RANK1 = Identity("ns", "job", 1, 2, 0)


def snap(identity: Identity, step: int, state: str, attempt: int = 0, size: int = 8) -> Snapshot:
    return Snapshot(identity, step, f"s{step}", [], None, size, bytearray(size), attempt=attempt, state=state)


def hold(held: Held, *snaps: Snapshot) -> None:
    with held.shared.lock:
        for s in snaps:
            held.slots.setdefault(s.identity.slot, []).append(s)
    held.update_gauge()


def chain(*steps: int) -> Chain:
    return Chain({}, steps[0], steps, {}, tuple(0.0 for _ in steps[1:]))


def ref(step: int, attempt: int = 0) -> mf.CommitRef:
    return mf.CommitRef(mf.commit_key("ns", "job", step, attempt), "0" * 64)


def gauge(held: Held) -> float:
    return held.shared.metrics.registry.get_sample_value("strata_held_snapshot_bytes") or 0.0


def test_only_the_newest_committed_snapshot_stays_and_its_buffer_is_released(make_shared):
    held = Held(make_shared())
    budget = held.shared.memory
    old, new, uploading = (
        snap(RANK0, 1, "committed"),
        snap(RANK0, 2, "committed"),
        snap(RANK0, 3, "uploading"),
    )
    old.memory = budget.reserve("snapshot", 100, "old")
    hold(held, old, new, uploading)
    assert gauge(held) == 24
    held.keep_newest_committed(new)
    assert held.snapshots() == [new, uploading]
    assert old.buffer == bytearray() and budget.held()["snapshot"] == 0
    assert gauge(held) == 16


def test_release_and_outcomes(make_shared):
    held = Held(make_shared())
    s = snap(RANK0, 1, "uploading")
    s.tree = {"big": list(range(1000))}
    s.metadata = held.shared.memory.reserve("metadata", 500, "s1's tree")
    hold(held, s)
    held.remember(s)
    held.release(s)
    assert held.snapshots() == [] and gauge(held) == 0 and held.shared.memory.used == 0
    # The outcome outlives the buffer, but not the tree nor the tensor lists (1024 are kept).
    outcome = held.wait_committed("s1", 0)
    assert outcome is not None and (outcome.step, outcome.state, outcome.done) == (1, "uploading", s.done)
    assert outcome.tree is None and s.tree is not None  # the snapshot itself is left as it was
    assert held.wait_committed("unknown", 0) is None
    for i in range(1030):
        held.remember(snap(RANK0, 100 + i, "committed"))
    assert len(held.outcomes) == 1024 and "s1" not in held.outcomes


def test_dropping_committed_copies_to_fit_a_save_keeps_the_trainers_segments(make_shared):
    held = Held(make_shared())
    streamed, staged = snap(RANK0, 1, "committed"), snap(RANK0, 2, "committed")
    streamed.memory = held.shared.memory.reserve("snapshot", 8, "streamed")  # staged: no reservation
    hold(held, streamed, staged, snap(RANK1, 1, "committed"))
    with held.shared.lock:
        held.drop_committed_locked(RANK0, "a save")
    assert [s.step for s in held.slots[RANK0.slot]] == [2]
    assert len(held.slots[RANK1.slot]) == 1


def test_queries_over_held_snapshots(make_shared):
    held = Held(make_shared())
    hold(
        held,
        snap(RANK0, 1, "committed"),
        snap(RANK0, 4, "uploading"),
        snap(RANK0, 5, "receiving"),
        snap(RANK1, 3, "committed", attempt=1),
    )
    durable = snap(RANK0, 6, "failed")
    durable.manifest_durable = True
    hold(held, durable)
    assert held.uploading_steps(RANK0.slot, 0) == {4, 6}
    assert held.uploading_steps(RANK0.slot, 1) == set()
    assert held.newest_committed(RANK0) == (0, 1)
    assert held.newest_committed(Identity("ns", "other", 0, 1, 0)) is None
    assert held.in_memory("ns", "job", (1, 3)) and not held.in_memory("ns", "job", (0, 4))
    found = held.committed_copy(RANK0, (0, 1))
    assert found is not None and found[0].step == 1 and len(found[1]) == 8
    assert held.committed_copy(Identity("ns", "job", 0, 4, 0), (0, 1)) is None  # another world size


def test_settling_waits_for_the_jobs_uploads_within_one_bound(make_shared):
    held = Held(make_shared(commit_timeout_s=0.2))
    done, stuck = snap(RANK0, 1, "uploading"), snap(RANK1, 1, "uploading")
    done.done.set()
    hold(held, done, stuck, snap(Identity("ns", "other", 0, 1, 0), 1, "uploading"))
    t0 = time.monotonic()
    held.settle(("ns", "job"))  # the stuck one is given up at the one deadline
    assert 0.15 < time.monotonic() - t0 < 2


def test_held_lossy_forms_are_charged_and_dropped_with_the_chain_when_they_do_not_fit(make_shared):
    held = Held(make_shared(memory_budget=1 << 20))
    budget = held.shared.memory
    held.chain_committed(RANK0.slot, chain(1), 1, ref(1), [], {"emb": b"x" * 1000})
    held.chain_committed(RANK0.slot, chain(1, 2), 2, ref(2), [], {"emb": b"y" * 500})
    assert [s for s, _, _ in held.layers[RANK0.slot]] == [1, 2]
    assert set(held.chain_refs[RANK0.slot]) == {1, 2}
    assert budget.held()["encode"] == 1500
    held.chain_committed(RANK0.slot, chain(3), 3, ref(3), [], {})  # a new full, lossless: nothing held
    assert held.layers[RANK0.slot] == [] and set(held.chain_refs[RANK0.slot]) == {3}
    assert budget.held()["encode"] == 0
    held.chain_committed(RANK0.slot, chain(4), 4, ref(4), [], {"emb": b"z" * 2000})
    budget.limit = 1024  # another holder took the room
    with held.shared.lock:
        held.account(RANK0.slot)
    assert held.layers[RANK0.slot] == [] and RANK0.slot not in held.chains
    assert RANK0.slot not in held.chain_refs and budget.held()["encode"] == 0


def test_the_diff_base_is_the_held_newest_committed_snapshot_of_a_known_chain(make_shared):
    held = Held(make_shared())
    base = snap(RANK0, 1, "committed")
    base.buffer = bytearray(b"12345678")
    hold(held, base)
    new = snap(RANK0, 2, "receiving")
    assert held.diff_base(new) == (None, None, frozenset(), [])
    held.chain_committed(RANK0.slot, chain(1), 1, ref(1), [], {"emb": b"x"})
    held.restores[RANK0.job_key] = 3
    c, previous, forms, decoded = held.diff_base(new)
    assert c is not None and c.steps == (1,) and previous is not None and bytes(previous) == b"12345678"
    assert forms == frozenset({"emb"}) and new.restores == 3
    assert decoded == []  # the trainer holds the exact snapshot: compare with it
    held.restored(RANK0, keep_chain=True, restores=3)  # from memory: the lossy forms came back decoded
    assert held.diff_base(new)[3] == [([], {"emb": b"x"})]
    held.chain_committed(RANK0.slot, chain(2), 2, ref(2), [], {"emb": b"y"})  # exact again
    assert held.diff_base(new)[3] == []
    held.chain_refs[RANK0.slot].clear()  # a base without a known COMMIT: a new chain
    assert held.diff_base(new)[:2] == (None, None)


def test_a_restore_counts_once_per_restart_and_ends_the_chain_unless_from_memory(make_shared):
    held = Held(make_shared())
    held.chain_committed(RANK0.slot, chain(1), 1, ref(1), [], {})
    held.restored(RANK0, keep_chain=True, restores=0)
    held.restored(RANK1, keep_chain=True, restores=0)  # the other rank of the same restart
    assert held.restores[RANK0.job_key] == 1 and RANK0.slot in held.chains
    held.restored(RANK0, keep_chain=False, restores=1)
    assert held.restores[RANK0.job_key] == 2 and RANK0.slot not in held.chains


def test_a_new_attempt_drops_what_it_fenced_off(make_shared):
    held = Held(make_shared())
    kept, fenced = snap(RANK0, 2, "committed"), snap(RANK0, 5, "committed")
    hold(
        held,
        kept,
        fenced,
        snap(RANK0, 6, "uploading"),
        snap(Identity("ns", "other", 0, 1, 0), 9, "committed"),
    )
    held.chain_committed(RANK0.slot, chain(2, 5), 5, ref(5), [], {})
    held.chain_refs[RANK0.slot][2] = ref(2)
    fences = mf.Fences({0: None, 1: 2})  # attempt 1 restores step 2: attempt 0's later steps are void
    held.drop_fenced(("ns", "job"), fences)
    assert [s.step for s in held.slots[RANK0.slot]] == [2, 6]
    assert fenced.buffer == bytearray() and RANK0.slot not in held.chains
    assert len(held.slots[("ns", "other", 0)]) == 1  # another job: untouched


def test_buffers():
    assert isinstance(zeroed(10), bytearray)
    big = zeroed(1 << 20)
    assert isinstance(big, memoryview) and big[-1] == 0
    s = snap(RANK0, 1, "committed")
    drop_buffer(s)
    assert s.buffer == bytearray()


def digest_chain(*steps: int, rows: int = 64) -> Chain:
    layout = (("w", "float32", (rows, 64), 0),)
    since = {"w": np.zeros(rows, np.bool_)}
    digests = {"w": np.zeros((rows, 2), np.uint32)}
    return Chain(layout, steps[0], steps, since, tuple(0.0 for _ in steps[1:]), digests)


def test_a_chains_digests_are_charged_and_dropped_when_they_do_not_fit(make_shared):
    held = Held(make_shared(memory_budget=1 << 20))
    budget = held.shared.memory
    held.chain_committed(RANK0.slot, digest_chain(1), 1, ref(1), [], {})
    assert budget.held()["encode"] == 64 * 8
    budget.limit = 256  # another holder took the room
    with held.shared.lock:
        held.account(RANK0.slot)
    chain_ = held.chains[RANK0.slot]  # the chain stays (a held copy can still be compared with)
    assert chain_.digests is None and budget.held()["encode"] == 0


def committed_in(identity: Identity, step: int, segment: str, rows: int = 64) -> Snapshot:
    s = snap(identity, step, "committed", size=rows * 256)
    s.segment = segment
    s.tensors = [mf.TensorEntry("w", "float32", [rows, 64], rows * 256, 0)]
    return s


def test_a_drop_gives_up_only_the_naming_ranks_snapshot(make_shared):
    held = Held(make_shared())
    mine, theirs = committed_in(RANK0, 1, "strata-a-0"), committed_in(RANK1, 7, "strata-a-0")
    hold(held, mine, theirs)
    theirs.state = "uploading"
    assert held.drop_segment("strata-a-0", RANK0.slot) == ""
    assert held.snapshots() == [theirs]  # the other rank's, under the same name, stays


def test_a_drop_hashes_nothing_when_no_diff_can_follow(make_shared, monkeypatch):
    from sidecar.engine import held as held_module

    calls: list[str] = []
    monkeypatch.setattr(held_module, "base_digests", lambda *a, **k: calls.append("hash") or {})
    for policy, expect in (("full", []), ("intermittent", ["hash"])):
        held = Held(make_shared(policy=policy))
        s = committed_in(RANK0, 1, "strata-a-0")
        hold(held, s)
        full = digest_chain(1)
        with held.shared.lock:
            held.chains[RANK0.slot] = replace(full, digests=None)
        calls.clear()
        assert held.drop_segment("strata-a-0", RANK0.slot) == ""
        assert calls == expect and held.snapshots() == []


def test_a_drop_that_cannot_digest_within_the_budget_ends_the_diffs(make_shared):
    held = Held(make_shared(memory_budget=1 << 20))
    s = committed_in(RANK0, 1, "strata-a-0", rows=8192)  # 2 MiB, decoded: a copy over the budget
    hold(held, s)
    with held.shared.lock:
        held.chains[RANK0.slot] = replace(
            digest_chain(1, rows=8192), layout=(("w", "float32", (8192, 64), 0),)
        )
        held.layers[RANK0.slot] = [
            (1, [replace(s.tensors[0], encoding="raw")], {"w": bytes(s.tensors[0].nbytes)})
        ]
        held.decoded[RANK0.slot] = 1
    assert held.drop_segment("strata-a-0", RANK0.slot) == ""
    assert held.snapshots() == [] and held.decoded.get(RANK0.slot) == 1  # next diff: full
