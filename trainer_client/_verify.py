"""Restored bytes checked while they are copied.

A restore header gives every tensor's digest as it was saved (XXH3-64; TensorMeta.xxh3). A
shared segment the client reads by name may hold other bytes than the sidecar checked (anyone
who can write the tmpfs can rename a file over it), so the client checks what it copies: the
bytes move in chunks small enough to stay in the core's cache, and each chunk is hashed right
after it is copied, from the cache, not read from memory a second time. Chunks are copied by
several threads (the cores the process may use: ``restore_threads``); a tensor's digest runs over
its chunks in order, on whichever thread finds the next one copied, while the others copy on.
Tensors without a digest take the same copy, unhashed.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

#: bytes copied then hashed at once: in the core's L2 (1-2 MiB on current x86 servers), at worst L3
CHUNK = 1 << 20


class DigestMismatch(Exception):
    """A tensor's copied bytes differ from the digest its restore header gave."""

    def __init__(self, name: str, got: str, want: str) -> None:
        self.name, self.got, self.want = name, got, want
        super().__init__(f"tensor {name!r} differs from what was saved (digest xxh3 {got} != {want})")


@dataclass
class Target:
    """A tensor's bytes (``dst``, uint8) and where they start in the source; ``digest`` "" is unchecked."""

    offset: int
    dst: np.ndarray
    digest: str
    name: str


class Files:
    """Files read as one source, one after another (a step's objects: each file's ``size`` bytes)."""

    def __init__(self, fds: Sequence[int], sizes: Sequence[int]) -> None:
        self.fds = list(fds)
        self.starts = list(itertools.accumulate(sizes, initial=0))

    def read(self, into: memoryview, at: int) -> None:
        """Fill ``into`` from offset ``at``; EOFError where the files end first."""
        pos = 0
        while pos < len(into):
            i = bisect.bisect_right(self.starts, at + pos) - 1
            if i >= len(self.fds):
                raise EOFError(f"the source ends before byte {at + len(into)}")
            want = min(len(into) - pos, self.starts[i + 1] - (at + pos))
            n = os.preadv(self.fds[i], [into[pos : pos + want]], at + pos - self.starts[i])
            if n <= 0:
                raise EOFError(f"the source ends before byte {at + len(into)}")
            pos += n


class _Digest:
    """One tensor's digest over its chunks in order, whichever threads copied them."""

    def __init__(self, target: Target, source: np.ndarray | int | Files) -> None:
        self.target = target
        self.reader, self.src = None, None
        if isinstance(source, Files):
            self.reader = source
        elif isinstance(source, int):
            self.reader = Files([source], [1 << 62])
        else:
            self.src = source[target.offset : target.offset + target.dst.size]
        self.chunks = -(-target.dst.size // CHUNK)
        self.hasher = xxhash.xxh3_64()
        self.copied: set[int] = set()
        self.next = 0
        self.busy = False
        self.lock = threading.Lock()

    def copy(self, k: int) -> None:
        lo, hi = k * CHUNK, min((k + 1) * CHUNK, self.target.dst.size)
        if self.src is not None:
            np.copyto(self.target.dst[lo:hi], self.src[lo:hi])
        else:  # read from the file: no mapping to build page tables for, or to tear down
            assert self.reader is not None
            self.reader.read(self.target.dst[lo:hi].data, self.target.offset + lo)
        if not self.target.digest:
            return
        with self.lock:
            self.copied.add(k)
            if self.busy or k != self.next:
                return  # the thread hashing this tensor takes it when it gets there
            self.busy = True
        while True:
            n = self.next
            self.hasher.update(self.target.dst[n * CHUNK : min((n + 1) * CHUNK, self.target.dst.size)].data)
            with self.lock:
                self.copied.discard(n)
                self.next = n + 1
                if self.next not in self.copied:
                    self.busy = False
                    return

    def check(self) -> DigestMismatch | None:
        if not self.target.digest:
            return None
        got = self.hasher.hexdigest()
        return (
            None if got == self.target.digest else DigestMismatch(self.target.name, got, self.target.digest)
        )


#: most threads a restore copies with: past a few, the copies wait on memory bandwidth
MAX_RESTORE_THREADS = 8


def restore_threads() -> int:
    """Threads to copy a restore with: the cores this process may run on (no training step runs
    while it restores, so a trainer holding torch to one thread still has them), at least torch's
    thread count, at most ``MAX_RESTORE_THREADS``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(torch.get_num_threads(), min(cores, MAX_RESTORE_THREADS))


def copy_checked(
    source: np.ndarray | int | Files, targets: Sequence[Target], threads: int | None = None
) -> DigestMismatch | None:
    """Copy every target's bytes out of ``source`` (uint8, or a file descriptor or files read
    with ``preadv``), checking those with a digest as they go: the first tensor (in ``targets``
    order) whose bytes differ, or None. Returned, not raised: a traceback would keep views of
    ``source`` (a mapping the caller closes) alive. EOFError: the file ends too early."""
    digests = [_Digest(t, source) for t in targets]  # unchecked ones too: the same copy, unhashed
    work = [(d, k) for d in digests for k in range(d.chunks)]
    if not work:
        return None
    workers = max(1, min(threads or restore_threads(), len(work)))
    taken = itertools.count()  # next() on a count is atomic: each chunk goes to one thread

    def run() -> None:
        while (i := next(taken)) < len(work):
            d, k = work[i]
            d.copy(k)

    if workers == 1:
        run()
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="strata-restore-copy") as pool:
            for f in [pool.submit(run) for _ in range(workers)]:
                f.result()
    return next((bad for d in digests if (bad := d.check()) is not None), None)


class StreamCheck:
    """The digests of targets filled in order from a stream (the bytes pass once): ``update``
    with each piece just written, then ``check``."""

    def __init__(self, targets: Sequence[Target]) -> None:
        self._targets = list(targets)
        self._hashers = [xxhash.xxh3_64() if t.digest else None for t in self._targets]

    def update(self, index: int, lo: int, hi: int) -> None:
        hasher = self._hashers[index]
        if hasher is not None:
            hasher.update(self._targets[index].dst[lo:hi].data)

    def check(self) -> None:
        for t, hasher in zip(self._targets, self._hashers, strict=True):
            if hasher is not None and (got := hasher.hexdigest()) != t.digest:
                raise DigestMismatch(t.name, got, t.digest)
