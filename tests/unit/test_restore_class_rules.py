"""The pieces of the gang's restore class: the holdings reports ranks' sidecars write (bounded and
checked: the bucket is distrusted), the rule that decides "exact" from them, the EPOCH field, the
manifests' count of lossy restores, and ``auto``'s bit width under each class."""

from __future__ import annotations

import json
import threading
import tracemalloc
import uuid
from types import SimpleNamespace

import pytest

from sidecar import manifest as mf
from sidecar.engine.attempts import Attempts
from sidecar.engine.types import Identity
from sidecar.errors import CorruptObject
from sidecar.pipeline.settings import Quantization, parse_table, quantization
from sidecar.store.memory import MemoryStore

R = (3, 40)  # (attempt, step)
GEN = mf.Generation.parse("run/1")


def report(rank: int, own=(), copies=(), parity=()) -> mf.Holdings:
    return mf.Holdings("run/1", rank, [list(o) for o in own], [list(c) for c in copies], list(parity))


def test_every_rank_holding_its_own_is_exact_and_one_missing_is_not():
    reports = {r: report(r, own=[R]) for r in range(3)}
    assert mf.exact_everywhere(3, R, reports)
    reports[2] = report(2)  # its pod was lost: a fresh sidecar holds nothing
    assert not mf.exact_everywhere(3, R, reports)
    del reports[2]  # or it was never heard from
    assert not mf.exact_everywhere(3, R, reports)


def test_a_buddys_copy_or_parity_with_one_member_missing_covers_a_lost_rank():
    base = {0: report(0, own=[R]), 1: report(1), 2: report(2, own=[R])}
    assert not mf.exact_everywhere(3, R, base)
    assert mf.exact_everywhere(3, R, {**base, 2: report(2, own=[R], copies=[[1, *R]])})
    assert not mf.exact_everywhere(3, R, {**base, 2: report(2, own=[R], copies=[[1, 3, 39]])})  # another step
    # each member holds parity over the group's other members
    held = {
        0: report(0, own=[R], parity=[[[1, 2], *R]]),
        1: report(1),
        2: report(2, own=[R], parity=[[[0, 1], *R]]),
    }
    assert mf.exact_everywhere(3, R, held)
    two_lost = {
        0: report(0, own=[R], parity=[[[1, 2], *R]]),
        1: report(1),
        2: report(2, parity=[[[0, 1], *R]]),
    }
    assert not mf.exact_everywhere(3, R, two_lost)  # XOR rebuilds one member, not two


def test_parity_covers_a_lost_member_only_when_every_other_member_holds_its_part():
    # The rebuild XORs the parity of every other member of the group: one member's parity alone
    # (the other's still being written when the pod was lost) cannot rebuild anything.
    reports = {0: report(0, own=[R]), 1: report(1), 2: report(2, own=[R], parity=[[[0, 1], *R]])}
    assert not mf.exact_everywhere(3, R, reports)


def test_a_holdings_report_round_trips_and_a_damaged_or_oversized_one_is_refused():
    good = report(1, own=[R], copies=[[0, *R]], parity=[[[0, 1], *R]])
    assert mf.Holdings.from_json(good.to_json()) == good
    raw = json.loads(good.to_json())
    for field, value in [
        ("own", [[1]]),
        ("own", [[-5, 3]]),
        ("copies", [["x", 1, 2]]),
        ("parity", [[[0, 1] * 200, 3, 40]]),
        ("own", [[1, 2]] * (mf.MAX_HOLDINGS + 1)),
        ("rank", -1),
        ("extra", 1),
    ]:
        bad = {**raw, field: value}
        with pytest.raises(CorruptObject, match="holdings report"):
            mf.Holdings.from_json(json.dumps(bad).encode(), "HOLDS/x/000001")


def test_the_epoch_records_exact_and_leaves_the_stored_class_out():
    exact = mf.Epoch(4, "run/1", 2, 40, 3, [], restore_class="exact")
    assert mf.Epoch.from_json(exact.to_json()).restore_class == "exact"
    stored = mf.Epoch(4, "run/1", 2, 40, 3, [])
    assert "restore_class" not in json.loads(stored.to_json())  # older sidecars still read it
    body = json.loads(exact.to_json())
    body["restore_class"] = "lossy"
    with pytest.raises(CorruptObject, match="restore_class"):
        mf.Epoch.from_json(json.dumps(body).encode())


def test_a_manifest_counts_lossy_restores_within_its_restores():
    m = mf.Manifest("ns", "job", 5, 0, 1, 1, "s1", 0, {}, [], [], restores=3, storage_restores=1)
    assert mf.Manifest.from_json(m.to_json()).storage_restores == 1
    m.storage_restores = 0
    assert "storage_restores" not in json.loads(m.to_json())
    body = json.loads(m.to_json())
    body["storage_restores"] = 4  # more lossy restores than restores
    with pytest.raises(CorruptObject, match="storage_restores"):
        mf.Manifest.from_json(json.dumps(body).encode())


def settings(**over: object) -> SimpleNamespace:
    base = dict(
        quantize="auto",
        quantize_match="",
        expected_restores=20,
        restore_bits="1:4",
        restore_class="auto",
        expected_storage_restores=1,
    )
    return SimpleNamespace(**{**base, **over})


def test_auto_sizes_bits_for_storage_restores_under_the_exact_class_and_escalates_on_them():
    exact = quantization(settings())
    assert exact.bits(0, 0) == 4 and exact.bits(19, 1) == 4  # exact restores add no error
    assert exact.bits(5, 2) == 8  # more lossy restores than planned: 8 bits
    stored = quantization(settings(restore_class="stored"))
    assert stored.bits(0, 0) == 8  # every one of 20 restores lossy
    assert Quantization("auto", (), 1, parse_table("1:4")).bits(2) == 8


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"restore_class": "lossy"}, "--restore-class"),
        ({"expected_storage_restores": -1}, "--expected-storage-restores"),
    ],
)
def test_a_bad_restore_setting_is_refused_naming_it(over, named):
    with pytest.raises(ValueError, match=named):
        quantization(settings(**over))


def test_forgetting_older_holdings_deletes_the_previous_generations_reports_only():
    # Rank 0 of generation run/1 decides late (the gang was restarted again meanwhile): the
    # reports run/2's ranks already wrote must survive, or run/2's rank 0 waits for them in vain.
    # Nothing is listed: junk in a distrusted bucket is never read.
    store = MemoryStore(f"holds-{uuid.uuid4().hex}")
    for gen in ("run/0", "run/1", "run/2"):
        for r in range(2):
            store.put(mf.holdings_key("ns", "job", gen, r), report(r).to_json())
    listed: list[str] = []
    real_list = store.list

    def counted(*args, **kwargs):
        listed.append(args[0])
        return real_list(*args, **kwargs)

    store.list = counted  # type: ignore[method-assign]
    previous = mf.Epoch(1, "run/0", 2, 40, 3, [])
    this = SimpleNamespace(store=store)
    Attempts._forget_older_holdings(this, Identity("ns", "job", 0, 2, 0), GEN, previous)  # type: ignore[arg-type]
    assert listed == []
    left = {o.key for o in real_list(mf.job_prefix("ns", "job") + "HOLDS/").objects}
    assert left == {mf.holdings_key("ns", "job", g, r) for g in ("run/1", "run/2") for r in range(2)}


def test_deciding_the_class_keeps_no_more_of_each_report_than_the_restore_step_needs():
    # Every rank's report may be up to 1 MiB of entries: held whole for a large gang, a junk-filled
    # bucket would make rank 0's sidecar hold gigabytes while it waits.
    world = 12
    store = MemoryStore(f"holds-{uuid.uuid4().hex}")
    junk = [[[60_000 + i for i in range(256)], 3, 1000 + j] for j in range(100)]
    for r in range(world):
        store.put(mf.holdings_key("ns", "job", "run/1", r), report(r, own=[R], parity=junk).to_json())
    this = SimpleNamespace(
        store=store,
        exact_classes=True,
        settings=SimpleNamespace(commit_timeout_s=5.0),
        shared=SimpleNamespace(stopping=threading.Event(), gang=lambda key: SimpleNamespace(generation=GEN)),
        _inexact_before=lambda identity, restore: False,
        holdings_of=None,
    )
    tracemalloc.start()
    try:
        got = Attempts._restore_class(
            this, Identity("ns", "job", 0, world, 0), mf.Generation.parse("run/1"), R
        )  # type: ignore[arg-type]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == "exact"
    one = len(report(0, own=[R], parity=junk).to_json())
    assert peak < 16 * one, (peak, one)  # one report parsed at a time (all 12 held: ~64x)


def test_an_unreadable_report_counts_as_a_rank_that_holds_nothing():
    # A damaged report (or one of another format) is an answer: the class is stored at once, not
    # after the whole wait spent reading the same object again and again.
    store = MemoryStore(f"holds-{uuid.uuid4().hex}")
    store.put(mf.holdings_key("ns", "job", "run/1", 0), report(0, own=[R]).to_json())
    damaged = mf.holdings_key("ns", "job", "run/1", 1)
    store.put(damaged, b"{not json")
    gets: list[str] = []
    real_get = store.get

    def counted(key: str) -> bytes:
        gets.append(key)
        return real_get(key)

    store.get = counted  # type: ignore[method-assign]
    this = SimpleNamespace(
        store=store,
        exact_classes=True,
        settings=SimpleNamespace(commit_timeout_s=2.0),
        shared=SimpleNamespace(stopping=threading.Event(), gang=lambda key: SimpleNamespace(generation=GEN)),
        _inexact_before=lambda identity, restore: False,
        holdings_of=None,
    )
    got = Attempts._restore_class(this, Identity("ns", "job", 0, 2, 0), mf.Generation.parse("run/1"), R)  # type: ignore[arg-type]
    assert got == ""
    assert gets.count(damaged) == 1


def test_the_wait_for_reports_ends_when_a_newer_generation_arrives():
    # The gang was restarted again while rank 0's sidecar waited for a rank that will never report
    # for this generation: the newer generation must not wait behind it (it needs the same lock).
    store = MemoryStore(f"holds-{uuid.uuid4().hex}")
    store.put(mf.holdings_key("ns", "job", "run/1", 0), report(0, own=[R]).to_json())
    lists: list[str] = []
    real_list = store.list

    def counted(*args, **kwargs):
        lists.append(args[0])
        return real_list(*args, **kwargs)

    store.list = counted  # type: ignore[method-assign]
    newer = mf.Generation.parse("run/2")
    this = SimpleNamespace(
        store=store,
        exact_classes=True,
        settings=SimpleNamespace(commit_timeout_s=2.0),
        shared=SimpleNamespace(
            stopping=threading.Event(), gang=lambda key: SimpleNamespace(generation=newer)
        ),
        _inexact_before=lambda identity, restore: False,
        holdings_of=None,
    )
    got = Attempts._restore_class(this, Identity("ns", "job", 0, 2, 0), mf.Generation.parse("run/1"), R)  # type: ignore[arg-type]
    assert got == ""
    assert len(lists) == 1
