"""The client's checked copy of restored bytes: every tensor with a digest in the restore header is
hashed as it is copied (from a shared segment, in chunks on several threads, or from the stream),
and a tensor whose bytes differ is named; a header without digests (an older sidecar) restores as
before, its tensors counted as unverified."""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from sidecar.api import pb
from trainer_client import RestoreError, _verify
from trainer_client._receive import SegmentChanged, from_segment, receive, unverified

SIZES = [3, 100, _verify.CHUNK, 5 * _verify.CHUNK + 17, 1, 2 * _verify.CHUNK - 1]


def layout(sizes: list[int]) -> tuple[np.ndarray, list[int]]:
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += n + (-n % 8)  # padded, as snapshots are
    source = np.random.default_rng(0).integers(0, 256, at, dtype=np.uint8)
    return source, offsets


def targets(source: np.ndarray, offsets: list[int], sizes: list[int]) -> list[_verify.Target]:
    return [
        _verify.Target(o, np.zeros(n, np.uint8), xxhash.xxh3_64_hexdigest(source[o : o + n]), f"t{i}")
        for i, (o, n) in enumerate(zip(offsets, sizes, strict=True))
    ]


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_a_checked_copy_copies_every_tensor_and_finds_them_intact(threads):
    source, offsets = layout(SIZES)
    out = targets(source, offsets, SIZES)
    out[1].digest = ""  # unchecked: copied all the same
    assert _verify.copy_checked(source, out, threads) is None
    for t in out:
        assert np.array_equal(t.dst, source[t.offset : t.offset + t.dst.size])


@pytest.mark.parametrize("threads", [1, 3])
def test_a_checked_copy_names_the_tensor_whose_bytes_differ(threads):
    source, offsets = layout(SIZES)
    out = targets(source, offsets, SIZES)
    source[offsets[3] + 4 * _verify.CHUNK + 5] ^= 1  # in a late chunk of the large tensor
    bad = _verify.copy_checked(source, out, threads)
    assert bad is not None and bad.name == "t3" and bad.want == out[3].digest
    assert "tensor 't3' differs from what was saved (digest xxh3" in str(bad)
    assert np.array_equal(out[5].dst, source[offsets[5] : offsets[5] + SIZES[5]])  # the rest copied


def header(source: np.ndarray, tensors: list[torch.Tensor], offsets: list[int], digests: bool) -> Any:
    metas = [
        pb.TensorMeta(
            name=f"t{i}",
            dtype="uint8",
            shape=list(t.shape),
            nbytes=t.numel(),
            offset=o,
            xxh3=xxhash.xxh3_64_hexdigest(source[o : o + t.numel()]) if digests else "",
        )
        for i, (t, o) in enumerate(zip(tensors, offsets, strict=True))
    ]
    return pb.RestoreHeader(step=4, tensors=metas, total_bytes=len(source), source="storage")


def stream(h: Any, body: bytes, chunk: int = 1000) -> Iterator[pb.RestoreResponse]:
    yield pb.RestoreResponse(header=h)
    for at in range(0, len(body), chunk):
        yield pb.RestoreResponse(chunk=body[at : at + chunk])


def case() -> tuple[np.ndarray, list[int], list[torch.Tensor]]:
    sizes = [10, 5000, 64]
    source, offsets = layout(sizes)
    return source, offsets, [torch.zeros(n, dtype=torch.uint8) for n in sizes]


def test_a_streamed_restore_checks_every_tensor_against_its_digest():
    source, offsets, tensors = case()
    h = header(source, tensors, offsets, digests=True)
    got, out = receive(stream(h, source.tobytes()))
    assert [bytes(t.numpy()) for t in out] == [
        source[o : o + t.numel()].tobytes() for o, t in zip(offsets, tensors, strict=True)
    ]
    assert unverified(got) == 0
    changed = bytearray(source.tobytes())
    changed[offsets[1] + 4000] ^= 0xFF
    with pytest.raises(
        RestoreError, match=r"step 4 from storage: tensor 't1' differs from what was saved \(digest"
    ):
        receive(stream(h, bytes(changed)))


def test_a_header_without_digests_restores_unverified(caplog):
    source, offsets, tensors = case()
    h = header(source, tensors, offsets, digests=False)  # an older sidecar
    got, out = receive(stream(h, source.tobytes()))
    assert bytes(out[1].numpy()) == source[offsets[1] : offsets[1] + 5000].tobytes()
    assert unverified(got) == 3
    assert "3 of 3 tensors carry no digest" in caplog.text


class _Call:
    def __init__(self, items: list[pb.RestoreResponse]) -> None:
        self.items = iter(items)
        self.cancelled = False

    def __iter__(self) -> _Call:
        return self

    def __next__(self) -> pb.RestoreResponse:
        return next(self.items)

    def cancel(self) -> None:
        self.cancelled = True


def test_a_segment_with_other_bytes_than_the_header_names_is_refused(tmp_path):
    source, offsets, tensors = case()
    h = header(source, tensors, offsets, digests=True)
    h.shm.CopyFrom(pb.SharedSegment(name="strata-held-p1.0-abc-0", size=len(source)))
    path = tmp_path / h.shm.name
    path.write_bytes(source.tobytes())
    call = _Call([pb.RestoreResponse(header=h)])
    _, out = receive(call, str(tmp_path))
    assert bytes(out[2].numpy()) == source[offsets[2] : offsets[2] + 64].tobytes()
    changed = bytearray(source.tobytes())
    changed[offsets[2]] ^= 1
    os.rename(_write(tmp_path / "other", bytes(changed)), path)  # renamed over it, same size
    call = _Call([pb.RestoreResponse(header=h)])
    with pytest.raises(SegmentChanged, match=r"strata-held-p1.0-abc-0: tensor 't2' differs .*digest"):
        receive(call, str(tmp_path))
    assert call.cancelled  # the sidecar stops waiting; the client asks again for a streamed copy
    targets_ = [
        _verify.Target(o, np.zeros(t.numel(), np.uint8), m.xxh3, m.name)
        for o, t, m in zip(offsets, tensors, h.tensors, strict=True)
    ]
    with pytest.raises(SegmentChanged):  # the mapping is closed cleanly after a mismatch, every time
        from_segment(h, str(tmp_path), targets_)


def _write(path: Any, data: bytes) -> Any:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("threads", [1, 3])
def test_a_checked_copy_reads_a_file_with_preadv(threads):
    source, offsets = layout(SIZES)
    fd = os.memfd_create("copy")
    try:
        os.write(fd, source.tobytes())
        ts = targets(source, offsets, SIZES)
        assert _verify.copy_checked(fd, ts, threads=threads) is None
        for t in ts:
            assert np.array_equal(t.dst, source[t.offset : t.offset + t.dst.size])
        damaged = source.copy()
        damaged[offsets[3] + _verify.CHUNK + 5] ^= 1
        os.pwrite(fd, damaged.tobytes(), 0)
        bad = _verify.copy_checked(fd, targets(source, offsets, SIZES), threads=threads)
        assert bad is not None and bad.name == "t3"
        os.ftruncate(fd, offsets[-1])  # the last tensor is cut off
        with pytest.raises(EOFError):
            _verify.copy_checked(fd, targets(source, offsets, SIZES), threads=threads)
    finally:
        os.close(fd)


def test_a_lent_copy_is_closed_when_the_thread_that_would_close_it_cannot_start(monkeypatch):
    from trainer_client import _receive

    source, offsets, tensors = case()
    h = header(source, tensors, offsets, digests=True)
    h.shm.CopyFrom(pb.SharedSegment(name=f"strata-fd-{'a' * 16}-{'b' * 32}", size=len(source)))
    h.shm_handoff = True
    fd = os.memfd_create("lent", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, source.tobytes())
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    monkeypatch.setattr(_receive, "open_segment", lambda directory, name: fd)

    class Unstartable(threading.Thread):  # (the copy's own threads still start)
        def start(self) -> None:
            if self.name == "strata-free":
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(_receive.threading, "Thread", Unstartable)
    targets_ = [
        _verify.Target(o, np.zeros(t.numel(), np.uint8), m.xxh3, m.name)
        for o, t, m in zip(offsets, tensors, h.tensors, strict=True)
    ]
    with pytest.raises(RuntimeError, match="can't start"):
        from_segment(h, str(os.getcwd()), targets_)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed, not leaked


def test_a_restore_copies_on_every_core_it_may_use_even_with_torch_held_to_one_thread(monkeypatch):
    # A trainer holding torch to one thread (as training loops leave the other cores to
    # checkpointing) still restores on all its cores: nothing trains while it restores.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert _verify.restore_threads() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert _verify.restore_threads() == _verify.MAX_RESTORE_THREADS
    monkeypatch.setattr(torch, "get_num_threads", lambda: 12)
    assert _verify.restore_threads() == 12
