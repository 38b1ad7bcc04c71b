"""Quantization in worker processes: the same bytes as in the sidecar's own process, from a
snapshot the workers map themselves (a trainer's segment or a streamed save's memfd), and a
fallback that never changes the result."""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sidecar import shm
from sidecar.pipeline import encode as enc
from sidecar.pipeline import quantize as qz
from sidecar.pipeline.workers import MIN_POOL_BYTES, EncodePool

DIM = 64
ROWS = MIN_POOL_BYTES // (DIM * 4) + 77  # above the pool's threshold, not a multiple of 8


@pytest.fixture(scope="module")
def pool() -> Iterator[EncodePool]:
    p = EncodePool(2)
    p.warm()
    yield p
    p.close()


def _memfd_table(rows: int, dtype: str, seed: int = 0) -> memoryview:
    values = np.random.default_rng(seed).standard_normal((rows, DIM), dtype=np.float32)
    raw = qz.from_f32(values, dtype)
    m = shm.anonymous(raw.nbytes)
    np.frombuffer(m, np.uint8)[:] = raw.reshape(-1)
    return memoryview(m)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_workers_write_the_bytes_the_sidecar_process_writes(pool, dtype, bits, monkeypatch):
    rows = ROWS * 2 if dtype != "float32" else ROWS  # 2-byte dtypes: stay above the threshold
    data = _memfd_table(rows, dtype)
    assert shm.source_of(data) is not None
    done = []
    quantize = pool.quantize
    monkeypatch.setattr(pool, "quantize", lambda *a, **k: done.append(quantize(*a, **k)) or done[-1])
    pooled = enc.encode(data, dtype, [rows, DIM], bits=bits, pool=pool)
    assert len(done) == 1 and done[0] is not None, "the workers did not quantize"
    alone = enc.encode(data, dtype, [rows, DIM], bits=bits)
    assert pooled.encoding == alone.encoding == "quantized"
    assert bytes(pooled.pieces[0]) == bytes(alone.pieces[0])
    assert pooled.error == pytest.approx(alone.error, rel=1e-9)


def test_a_diff_gathers_its_changed_rows_in_the_workers(pool):
    data = _memfd_table(ROWS * 4, "float32", seed=1)
    mask = np.random.default_rng(2).random(ROWS * 4) < 0.4
    pooled = enc.encode(data, "float32", [ROWS * 4, DIM], bits=4, mask=mask, pool=pool)
    alone = enc.encode(data, "float32", [ROWS * 4, DIM], bits=4, mask=mask)
    assert pooled.encoding == "rows-diff-quantized" and pooled.changed == int(mask.sum())
    assert [bytes(p) for p in pooled.pieces] == [bytes(p) for p in alone.pieces]
    # and it restores on top of the base like any diff
    out = bytearray(np.zeros((ROWS * 4, DIM), np.float32).tobytes())
    enc.decode_into(
        out, b"".join(bytes(p) for p in pooled.pieces), pooled.encoding, "float32", [ROWS * 4, DIM]
    )
    got = np.frombuffer(out, np.float32).reshape(ROWS * 4, DIM)
    want = np.frombuffer(data, np.float32).reshape(ROWS * 4, DIM)
    assert not got[~mask].any()
    assert qz.relative_l2_error(want[mask], got[mask]) == pytest.approx(pooled.error, rel=1e-6)


def test_a_trainer_segment_is_mapped_by_the_fd_it_was_handed_over_as(pool, short_tmp: Path):
    segments = shm.Segments(str(short_tmp))
    values = np.random.default_rng(3).standard_normal((ROWS, DIM), dtype=np.float32)
    fd = os.memfd_create("strata-t1-0", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        os.write(fd, values.tobytes())
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | shm.F_SEAL_FUTURE_WRITE)
        conn.connect(str(short_tmp / segments.handover))
        socket.send_fds(conn, [b"strata-t1-0"], [fd])
        assert conn.recv(256) == b"ok"
        view = segments.acquire("strata-t1-0", owner=0).view(values.nbytes)
        tensor = view[DIM * 4 * 8 :]  # a tensor at an offset inside the segment
        shape = [ROWS - 8, DIM]
        source = shm.source_of(tensor)
        assert source is not None and source[:3] == (os.getpid(), view.obj.fd, DIM * 4 * 8)
        pooled = enc.encode(tensor, "float32", shape, bits=2, pool=pool)
        alone = enc.encode(tensor, "float32", shape, bits=2)
        assert bytes(pooled.pieces[0]) == bytes(alone.pieces[0])
    finally:
        conn.close()
        os.close(fd)
        segments.close()


def test_bytes_the_workers_cannot_map_are_quantized_in_process(pool):
    values = np.random.default_rng(4).standard_normal((ROWS, DIM), dtype=np.float32)
    heap = memoryview(bytearray(values.tobytes()))
    assert shm.source_of(heap) is None
    data = _memfd_table(ROWS, "float32")
    good = shm.source_of(data)
    assert good is not None
    gone = good._replace(fd=10**6)  # not an open fd
    assert pool.quantize(gone, "float32", (ROWS, DIM), 4, greedy=True) is None
    other = good._replace(ino=good.ino + 1)  # the fd now names another file
    assert pool.quantize(other, "float32", (ROWS, DIM), 4, greedy=True) is None
    encoded = enc.encode(heap, "float32", [ROWS, DIM], bits=4, pool=pool)
    assert bytes(encoded.pieces[0]) == qz.quantize_rows(values, 4).to_bytes()
    # the pool still works after a mapping it could not make
    assert pool.quantize(good, "float32", (ROWS, DIM), 4, greedy=True) is not None


@pytest.mark.parametrize("bad_row", [3, ROWS - 3])  # in the first part, in the last
def test_rows_the_quantizer_refuses_are_refused_from_a_worker_too(pool, bad_row):
    data = _memfd_table(ROWS, "float32")
    arr = np.frombuffer(data.obj, np.float32).reshape(ROWS, DIM)
    arr[bad_row, 5] = np.inf
    with pytest.raises(ValueError, match=r"NaN|inf|65504"):
        pool.quantize(shm.source_of(data), "float32", (ROWS, DIM), 4, greedy=True)
    arr[bad_row, 5] = 0.0  # and the pool goes on
    assert pool.quantize(shm.source_of(data), "float32", (ROWS, DIM), 4, greedy=True) is not None


def test_a_killed_worker_sends_the_sidecar_in_process_until_the_pool_is_started_again(monkeypatch):
    import signal

    from sidecar.pipeline import workers

    data = _memfd_table(ROWS, "float32")
    source = shm.source_of(data)
    want = enc.encode(data, "float32", [ROWS, DIM], bits=4).pieces[0]
    pool = EncodePool(2)
    try:
        pids = {pool._executor().submit(os.getpid).result() for _ in range(8)}  # type: ignore[union-attr]
        os.kill(next(iter(pids)), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not pool._pool._broken and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.01)  # until the pool has seen it (else the other worker may do the job)
        assert pool.quantize(source, "float32", (ROWS, DIM), 4, greedy=True) is None
        # meanwhile the encoding happens in process, the same bytes
        assert bytes(enc.encode(data, "float32", [ROWS, DIM], bits=4, pool=pool).pieces[0]) == bytes(want)
        assert pool.fallbacks == 2
        monkeypatch.setattr(workers, "RETRY_S", 0.0)  # the back-off is over: a new pool
        q = pool.quantize(source, "float32", (ROWS, DIM), 4, greedy=True)
        assert q is not None and q.to_bytes() == bytes(want)
    finally:
        pool.close()


def test_parts_join_to_the_whole_bit_for_bit():
    values = np.random.default_rng(5).standard_normal((1003, 24), dtype=np.float32)
    for bits in qz.SUPPORTED_BITS:
        whole = qz.quantize_rows(values, bits)
        parts = [qz.quantize_parts(values[a : a + 328], bits) for a in range(0, 1003, 328)]
        joined = qz.join_parts(parts)
        assert joined.to_bytes() == whole.to_bytes()
        assert joined.rel_error == pytest.approx(whole.rel_error, rel=1e-9)
    with pytest.raises(ValueError, match="cannot join"):
        qz.join_parts([qz.quantize_parts(values[:5], 4), qz.quantize_parts(values[5:], 4)])
