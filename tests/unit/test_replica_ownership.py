"""Replica ownership (client side) and the commit's replica check (sidecar side), without a server."""

from __future__ import annotations

import pytest
import torch

from sidecar import manifest as mf
from sidecar.engine.admission import _check_replicas
from sidecar.engine.types import Identity
from sidecar.errors import Aborted, InvalidArgument
from trainer_client import _replicas


def test_assignment_is_deterministic_and_balanced() -> None:
    sizes = {f"t{i}": (i % 7 + 1) * 1000 for i in range(40)}
    owners = _replicas.assign(sizes, (0, 1, 2, 3))
    assert owners == _replicas.assign(dict(reversed(list(sizes.items()))), (0, 1, 2, 3))  # order-free
    load = {r: sum(sizes[n] for n, o in owners.items() if o == r) for r in range(4)}
    assert max(load.values()) - min(load.values()) <= max(sizes.values())  # greedy: within one tensor
    assert set(owners.values()) == {0, 1, 2, 3}
    # a group of other ranks: only those own anything
    assert set(_replicas.assign(sizes, (4, 6)).values()) == {4, 6}


def test_plan_keeps_private_tensors_and_owned_replicas() -> None:
    big, small, private = torch.zeros(1000), torch.zeros(10), torch.ones(3)
    tensors = [("a", big), ("b", small), ("p", private)]
    groups = {_replicas.tensor_key(big): (0, 1), _replicas.tensor_key(small): (0, 1)}
    p0, p1 = (_replicas.plan(tensors, groups, r) for r in (0, 1))
    assert p0.replicas[0].owner == 0 and p0.replicas[1].owner == 1  # largest first to rank 0
    assert p0.own == [0, 2] and p1.own == [1, 2]
    assert p0.replicas == p1.replicas
    excluded = r"a: declared replicated across ranks \[0, 1\], which exclude this rank 2"
    with pytest.raises(ValueError, match=excluded):
        _replicas.plan(tensors, groups, 2)
    # a group of one is no replication
    assert _replicas.plan(tensors, {_replicas.tensor_key(big): (0,)}, 0).replicas == {}


def test_group_ranks_checks_the_declaration() -> None:
    assert _replicas.group_ranks(None, 3) == (0, 1, 2)
    assert _replicas.group_ranks([2, 0], 4) == (0, 2)
    with pytest.raises(ValueError, match="distinct and below world size 2"):
        _replicas.group_ranks([0, 2], 2)


def test_sample_digests_see_a_changed_element_and_any_dtype() -> None:
    a = torch.arange(10_000, dtype=torch.float32)
    b = a.clone()
    b[5000 - 5000 % (10_000 // _replicas.SAMPLE_ELEMENTS)] += 1  # on a sampled position
    tensors = [a, b, a.to(torch.bfloat16), torch.tensor(3.0), torch.ones(2, 3, dtype=torch.int64)]
    digests = _replicas.sample_digests(tensors)
    assert digests[0] != digests[1] and all(len(d) == 8 for d in digests)
    assert digests == _replicas.sample_digests([t.clone() for t in tensors])
    # the numpy path (contiguous host tensors) and the gather path agree on equal values
    strided = torch.arange(200.0).reshape(10, 20).t()
    assert _replicas.sample_digests([strided]) == _replicas.sample_digests([strided.contiguous()])


def _manifest(rank: int, tensors: list[str], replicas: list[mf.ReplicaEntry]) -> mf.Manifest:
    entries = [mf.TensorEntry(n, "float32", [4], 16, 16 * i) for i, n in enumerate(tensors)]
    size = 16 * len(entries)
    return mf.Manifest("default", "job", 1, rank, 2, 0, "s", size, {}, entries, [], replicas=replicas)


def _ref(name: str, owner: int, sample: str = "0000abcd", shape: tuple[int, ...] = (4,)) -> mf.ReplicaEntry:
    return mf.ReplicaEntry(name, 0, owner, "float32", list(shape), 16, sample)  # 4 float32s either shape


def test_the_commit_check_names_replicas_that_disagree() -> None:
    good = {0: _manifest(0, ["w", "p"], [_ref("w", 0)]), 1: _manifest(1, ["p"], [_ref("w", 0)])}
    mf.check_replicas(1, good)
    drifted = {0: good[0], 1: _manifest(1, ["p"], [_ref("w", 0, sample="ffff0000")])}
    differs = r"w: rank 1's replica differs from its owner rank 0's \(sampled digest ffff0000"
    with pytest.raises(Aborted, match=differs):
        mf.check_replicas(1, drifted)
    unsaved = {0: _manifest(0, ["p"], []), 1: _manifest(1, ["p"], [_ref("w", 0)])}
    with pytest.raises(Aborted, match="rank 1 says rank 0 saves w, but rank 0 did not"):
        mf.check_replicas(1, unsaved)
    reshaped = {0: good[0], 1: _manifest(1, ["p"], [_ref("w", 0, shape=(2, 2))])}
    shapes = r"w: rank 1 holds float32\[2, 2\], its owner rank 0 saved float32\[4\]"
    with pytest.raises(Aborted, match=shapes):
        mf.check_replicas(1, reshaped)
    # an owner whose sidecar saved everything (no replica support): holds it, nothing to compare
    mixed = {0: _manifest(0, ["w", "p"], []), 1: good[1]}
    mf.check_replicas(1, mixed)


def test_a_manifest_with_replicas_round_trips_and_lists_the_foreign_ones() -> None:
    m = _manifest(1, ["p"], [_ref("w", 0), _ref("v", 1)])
    back = mf.Manifest.from_json(m.to_json())
    assert back.replicas == m.replicas and back.format_version == mf.FORMAT_VERSION
    assert [r.name for r in back.foreign()] == ["w"]


def test_admission_refuses_inconsistent_declarations() -> None:
    me = Identity("default", "job", 1, 2, 0)
    own = [mf.TensorEntry("p", "float32", [4], 16, 0)]
    _check_replicas(me, own, [_ref("w", 0)])
    cases = [
        ([_ref("w", 0), _ref("w", 0)], "declared twice"),
        ([_ref("w", 2)], "owner rank 2 is outside world size 2"),
        ([_ref("w", 1)], "this rank owns it but did not send it"),
        ([_ref("p", 0)], "rank 0 owns it, yet this rank sent it too"),
        ([_ref("w", 0, sample="xyz")], "is not a crc32"),
    ]
    for replicas, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            _check_replicas(me, own, replicas)
