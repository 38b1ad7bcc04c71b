"""The peer protocol's pieces: the replay cache, the stream cipher, hint bounds, and the bound on
per-job gang state."""

from __future__ import annotations

import os
import time

import pytest

from sidecar.api import pb
from sidecar.engine import state as engine_state
from sidecar.errors import InvalidArgument, NotFound, ResourceExhausted, Unauthenticated
from sidecar.gang import (
    MAX_HINT_STEPS,
    MAX_HINT_TEXT,
    ReplayCache,
    StreamCipher,
    check_hint,
    sign_hint,
    stream_mac,
)


def test_a_nonce_is_taken_once_and_forgotten_after_its_window():
    cache = ReplayCache(limit=3, window_s=60)
    nonce = os.urandom(16)
    cache.take(nonce, time.time())
    with pytest.raises(Unauthenticated, match="already used"):
        cache.take(nonce, time.time())
    with pytest.raises(Unauthenticated, match="nonce"):
        cache.take(b"short", time.time())
    cache.take(os.urandom(16), time.time())
    cache.take(os.urandom(16), time.time())
    with pytest.raises(ResourceExhausted, match="try again"):  # full of live nonces: none forgotten early
        cache.take(os.urandom(16), time.time())
    assert len(cache) == 3
    past = ReplayCache(limit=2, window_s=60)
    past.take(os.urandom(16), time.time() - 61)  # its request is refused anywhere from now on
    past.take(os.urandom(16), time.time() - 61)
    past.take(os.urandom(16), time.time())
    assert len(past) == 1


def test_a_stream_is_ciphertext_its_tag_catches_a_change_and_no_two_answers_share_a_key():
    key, mac = os.urandom(32), "ab" * 32
    data = [os.urandom(1000), os.urandom(4096), b"", os.urandom(7)]
    sender = stream_mac(key, mac, b"salt-1")
    sealed = [sender.update(d) for d in data]
    tag = sender.hexdigest()
    assert all(s != d for s, d in zip(sealed, data, strict=True) if d)
    opener = StreamCipher(key, mac, b"salt-1", encrypt=False)
    assert [opener.update(s) for s in sealed] == data
    assert opener.verify(tag)
    changed = bytearray(sealed[1])
    changed[10] ^= 1
    opener = StreamCipher(key, mac, b"salt-1", encrypt=False)
    for s in (sealed[0], bytes(changed), *sealed[2:]):
        opener.update(s)
    assert not opener.verify(tag)
    assert not StreamCipher(key, mac, b"salt-1", encrypt=False).verify("not hex")
    # into the stream's own buffer (the hot paths): the same bytes, the same tag
    sender = stream_mac(key, mac, b"salt-1")
    assert [bytes(sender.apply(d)) for d in data] == sealed
    assert sender.hexdigest() == tag
    opener = StreamCipher(key, mac, b"salt-1", encrypt=False)
    assert [bytes(opener.apply(s)) for s in sealed] == data
    assert opener.verify(tag)
    # the same request answered by two peers: two salts, two keystreams
    other = stream_mac(key, mac, b"salt-2")
    assert other.update(data[0]) != sealed[0]


def test_hints_are_bounded_and_name_the_field():
    def hint(**kind: object) -> pb.HintRequest:
        return pb.HintRequest(namespace="ns", job="job", attempt=0, step=1, **kind)  # type: ignore[arg-type]

    check_hint(hint(skip=pb.SkipHint(rank=0, reason="x" * MAX_HINT_TEXT)))
    for req, field in (
        (hint(skip=pb.SkipHint(reason="x" * (MAX_HINT_TEXT + 1))), "skip.reason"),
        (hint(commit=pb.CommitHint(key="k" * (MAX_HINT_TEXT + 1))), "commit.key"),
        (hint(gone=pb.GoneHint(uploading=range(MAX_HINT_STEPS + 1))), "gone.uploading"),
        (hint(), "manifest, commit, skip or gone"),
        (pb.HintRequest(namespace="ns", job="evil/..", skip=pb.SkipHint()), "job"),
    ):
        with pytest.raises(InvalidArgument, match=field.replace(".", r"\.")):
            check_hint(req)


def test_gang_state_is_bounded_and_the_least_recently_used_job_goes_first(make_shared, monkeypatch):
    monkeypatch.setattr(engine_state, "MAX_GANGS", 4)
    shared = make_shared()
    keep = shared.gang(("ns", "busy"))
    for i in range(20):
        shared.gang(("ns", f"job-{i}"))
        assert shared.gang(("ns", "busy")) is keep  # used between every other: never evicted
        assert len(shared._gangs) <= 4
    assert ("ns", "job-0") not in shared._gangs and ("ns", "job-19") in shared._gangs


def test_a_hint_for_a_job_not_served_here_keeps_nothing(make_shared):
    shared = make_shared()
    req = pb.HintRequest(namespace="ns", job="elsewhere", attempt=0, step=1, skip=pb.SkipHint(rank=0))
    sign_hint(os.urandom(32), req)
    with pytest.raises(NotFound, match="hint dropped"):
        shared.take_hint(req)
    assert not shared._gangs


def test_the_replay_cache_forgets_as_it_goes_not_only_when_full():
    cache = ReplayCache(limit=1000, window_s=60)
    for _ in range(10):
        cache.take(os.urandom(16), time.time() - 61)  # past their window at once
    cache.take(os.urandom(16), time.time())
    assert len(cache) < 10
