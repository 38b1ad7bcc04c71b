"""Worker processes that quantize a snapshot's rows on every core.

Threads do not scale here: the bench's ``encoding`` section measures 1.00x from 1 to 2 threads
and ~2x from 1 to 2 processes (numpy's small per-block calls hold the GIL between loops). So
quantization runs in a pool of worker processes, spawned (never forked from a process running
gRPC threads), shared by every rank this sidecar serves.

No table byte is pickled on the way in: a snapshot lies in a shared mapping (the trainer's
segment, or the memfd a streamed save lands in, :mod:`sidecar.shm`), and a worker maps the same
pages through ``/proc/<sidecar pid>/fd/<fd>``. Out come the packed codes and per-row scale and
bias (bits/32 of the input) with the part's squared error. A tensor is cut into parts of a
multiple of 8 rows (whole bytes of codes at every width), one per worker, joined in order: the
result is bit for bit what :func:`sidecar.pipeline.quantize.quantize_rows` gives in one piece.

When a worker cannot map the pages, that tensor is quantized in the sidecar's own process; when
the pool breaks (a worker killed), every later one is. Either is logged once: slower, never
different.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import multiprocessing
import os
import threading
import time
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures import wait as futures_wait
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import numpy.typing as npt

from sidecar.pipeline import quantize as qz
from sidecar.shm import Source

log = logging.getLogger(__name__)

#: tensors smaller than this are quantized in the sidecar's process: a worker round trip costs
#: more than it saves
MIN_POOL_BYTES = 4 << 20

#: a broken pool (a worker killed, by the OOM killer say) is started again this much later
RETRY_S = 60.0


class EncodePool:
    """``workers`` processes quantizing parts of tensors; started on first use."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"encode workers must be >= 1, got {workers}")
        self.workers = workers
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        #: when the pool last broke (monotonic): in-process until RETRY_S later, then a new pool
        self._broken_at: float | None = None
        self._unmappable = False
        #: tensors quantized in the sidecar's process because the pool could not (for tests, logs)
        self.fallbacks = 0

    def _executor(self) -> ProcessPoolExecutor | None:
        with self._lock:
            if self._broken_at is not None:
                if time.monotonic() - self._broken_at < RETRY_S:
                    return None
                self._broken_at = None
                log.info("starting encoding worker processes again")
            if self._pool is None:
                ctx = multiprocessing.get_context("spawn")
                try:
                    self._pool = ProcessPoolExecutor(
                        self.workers, mp_context=ctx, initializer=_watch_parent, initargs=(os.getpid(),)
                    )
                except (OSError, ImportError, NotImplementedError) as exc:  # no semaphores, say
                    self._broken_locked(exc)
                    return None
            return self._pool

    def warm(self) -> None:
        """Start the workers now (they import numpy: ~0.3 s each), not at the first save."""
        pool = self._executor()
        if pool is None:
            return
        try:
            for f in [pool.submit(_ping) for _ in range(self.workers)]:
                f.result(60)
        except Exception as exc:  # a pool that cannot start: the saves quantize in process
            self._give_up(exc)

    def quantize(
        self,
        source: Source,
        dtype: str,
        shape: tuple[int, int],
        bits: int,
        *,
        greedy: bool,
        rows: npt.NDArray[np.intp] | None = None,
    ) -> qz.QuantizedRows | None:
        """The rows of the ``dtype[shape]`` tensor at ``source`` (all, or the indices ``rows``,
        ascending) quantized to ``bits``; None when the pool cannot (the caller encodes in
        process). Raises ``ValueError`` as :func:`quantize_rows` does (a row it refuses).
        Returns only once no part of it runs any more: the caller may drop the snapshot."""
        pool = self._executor()
        if pool is None:
            self.fallbacks += 1
            return None
        n = shape[0] if rows is None else len(rows)
        # Parts of a multiple of 8 rows, one per worker (the last takes the rest).
        per = max(8, (-(-n // self.workers) + 7) // 8 * 8)
        futures: list[Future[qz.Part]] = []
        try:
            try:
                for a in range(0, max(n, 1), per):
                    b = min(a + per, n)
                    pick: npt.NDArray[np.int64] | None = None
                    first, last = a, b
                    if rows is not None and b > a:
                        pick = np.ascontiguousarray(rows[a:b], np.int64)
                        first, last = int(pick[0]), int(pick[-1]) + 1
                    futures.append(
                        pool.submit(_quantize_part, source, dtype, shape, first, last, pick, bits, greedy)
                    )
            except (OSError, RuntimeError) as exc:  # a worker could not be spawned (a pids limit)
                raise BrokenProcessPool(f"cannot start a worker: {exc}") from exc
            return qz.join_parts([f.result() for f in futures])
        except CancelledError:  # closed meanwhile (another sidecar of this process stopped)
            self.fallbacks += 1
            return None
        except BrokenProcessPool as exc:
            self._give_up(exc)
            self.fallbacks += 1
            return None
        except OSError as exc:  # this mapping only (a closed fd, /proc denied): the pool stays
            if not self._unmappable:
                log.warning("encoding workers cannot map a snapshot, quantizing in process: %s", exc)
                self._unmappable = True
            self.fallbacks += 1
            return None
        finally:  # on an error, parts still queued or running must not outlive the call
            for f in futures:
                f.cancel()
            futures_wait(futures)

    def _give_up(self, exc: BaseException) -> None:
        with self._lock:
            self._broken_locked(exc)
            pool, self._pool = self._pool, None
        if pool is not None:
            survivors = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            # A killed worker may have died holding the task queue's lock: the others would wait
            # on it forever, and so would the interpreter's exit joining them (gh-94777).
            for p in survivors:
                with contextlib.suppress(Exception):
                    p.kill()

    def _broken_locked(self, exc: BaseException) -> None:
        log.warning(
            "encoding worker processes unavailable, quantizing in process for %.0f s: %s", RETRY_S, exc
        )
        self._broken_at = time.monotonic()

    def close(self) -> None:
        """Stop the workers (a sidecar's stop); a later call starts new ones."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


_POOLS: dict[int, EncodePool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(workers: int) -> EncodePool | None:
    """This process's pool of ``workers`` processes (several sidecars in one process, as in
    tests, share it), or None for 1 (quantize in the sidecar's process). Its processes stop
    with the interpreter (``concurrent.futures`` joins them at exit)."""
    if workers <= 1:
        return None
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = EncodePool(workers)
        return pool


# --- in the worker -------------------------------------------------------------------------------

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _watch_parent(parent: int) -> None:
    """Exit when the sidecar is gone (killed, it cannot stop its workers): a worker must not
    outlive it holding a snapshot's pages. A poll, not PR_SET_PDEATHSIG, which fires when the
    *thread* that spawned the worker ends."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="strata-parent-watch", daemon=True).start()


def _ping() -> int:
    return os.getpid()


def _quantize_part(
    source: Source,
    dtype: str,
    shape: tuple[int, int],
    first: int,
    last: int,
    pick: npt.NDArray[np.int64] | None,
    bits: int,
    greedy: bool,
) -> qz.Part:
    """Rows ``[first, last)`` of the tensor (or, with ``pick``, those rows among them)."""
    row_bytes = shape[1] * _ITEMSIZE[dtype]
    if last <= first:
        return qz.quantize_parts(np.zeros((0, shape[1]), np.float32), bits, greedy=greedy)
    start = source.offset + first * row_bytes
    size = (last - first) * row_bytes
    page = start - start % mmap.ALLOCATIONGRANULARITY
    handle = os.open(f"/proc/{source.pid}/fd/{source.fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        info = os.fstat(handle)
        if (info.st_dev, info.st_ino) != (source.dev, source.ino):  # the fd now names another file
            raise OSError(f"fd {source.fd} of process {source.pid} no longer holds the snapshot")
        # A diff's rows are scattered: fault in only the pages they lie on.
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if pick is None else 0)
        try:
            mapped = mmap.mmap(handle, start + size - page, flags, mmap.PROT_READ, offset=page)
        except ValueError as exc:  # beyond the file's end: not the snapshot it was
            raise OSError(f"cannot map the snapshot: {exc}") from None
    finally:
        os.close(handle)
    try:
        raw = np.frombuffer(mapped, np.uint8, size, start - page).reshape(last - first, row_bytes)
        values = qz.to_f32(raw if pick is None else raw[pick - first], dtype)
        part = qz.quantize_parts(values, bits, greedy=greedy)
        del raw, values
        return part
    finally:
        with contextlib.suppress(BufferError):  # views die with this frame; the GC unmaps otherwise
            mapped.close()
