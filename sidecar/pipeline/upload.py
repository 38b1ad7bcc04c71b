"""Cut a received snapshot into objects, checksum and upload them with bounded
concurrency, then write the rank's MANIFEST (last, so its presence means every
object is whole)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait

import xxhash

from sidecar.faults import fault_point
from sidecar.manifest import Manifest, ManifestRef, ObjectEntry, write_manifest
from sidecar.store.base import Buffer, Store

#: Bytes digested at a time: small enough to stay in a core's L2 cache, so the second digest
#: of each chunk (a tensor's, beside the object's) reads cache, not memory.
DIGEST_CHUNK = 1 << 20


class RangeDigests:
    """XXH3-64 of byte ranges ``(offset, nbytes)`` of a stream, computed from chunks that go
    past in order (:meth:`update`), so a stream digested for another purpose is not read again.
    The ranges may not overlap (a chunk feeds each byte to one range only): ValueError."""

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._order = sorted(range(len(ranges)), key=lambda i: ranges[i])
        end = 0
        for i in self._order:
            start, size = ranges[i]
            if start < 0 or size < 0:
                raise ValueError(f"range {i} ({start}, {size}) has a negative offset or size")
            if size and start < end:
                raise ValueError(f"range {i} ({start}, {size}) overlaps another, which ends at {end}")
            end = max(end, start + size)
        self._ranges = list(ranges)
        self._hashers = [xxhash.xxh3_64() for _ in ranges]
        self._next = 0  # ranges in _order before it are complete

    def update(self, at: int, chunk: memoryview) -> None:
        end = at + len(chunk)
        i = self._next
        while i < len(self._order):
            start, size = self._ranges[self._order[i]]
            if start >= end:
                break
            lo, hi = max(at, start), min(end, start + size)
            if hi > lo:
                self._hashers[self._order[i]].update(chunk[lo - at : hi - at])
            if start + size > end:
                break
            i += 1
        self._next = i

    def hexdigests(self) -> list[str]:
        """The digests, in the order the ranges were given."""
        return [h.hexdigest() for h in self._hashers]


def upload_snapshot(
    store: Store,
    executor: Executor,
    prefix: str,
    pieces: Iterable[Buffer],
    object_bytes: int,
    make_manifest: Callable[[list[ObjectEntry]], Manifest],
    on_bytes: Callable[[int], None] = lambda n: None,
    step: int | None = None,
    max_in_flight: int = 8,
    also: RangeDigests | None = None,
) -> ManifestRef:
    """Upload the concatenation of ``pieces`` as objects ``<prefix>obj-NNNNN``, then
    ``<prefix>MANIFEST``.

    ``pieces`` may be produced lazily (an encoder): objects upload while later pieces
    are computed, with at most ``max_in_flight`` objects pending, so memory stays
    bounded. An object inside one piece is a view of it; one spanning pieces is joined.

    Each object's digest is taken in one pass over its bytes, in order, chunk by chunk; ``also``
    is fed the same chunks at their offsets in the concatenation (a lossless full checkpoint's
    tensor digests), so no byte is read from memory twice.

    Object keys are unique per save attempt (the caller's prefix), so nothing
    here ever overwrites a committed object. Raises the store's error on the
    first failed object; objects already written stay orphaned (never referenced
    by a MANIFEST) and are harmless.
    """

    def put(entry: ObjectEntry, piece: Buffer) -> ObjectEntry:
        fault_point("sidecar.upload.object", step)
        store.put(entry.key, piece)
        on_bytes(entry.size)
        return entry

    futures: list[Future[ObjectEntry]] = []
    pending: list[memoryview] = []
    size = 0
    offset = 0  # of the next object in the concatenation

    def digest(obj: Buffer) -> str:
        nonlocal offset
        view = memoryview(obj).cast("B")
        hasher = xxhash.xxh3_64()
        for pos in range(0, len(view), DIGEST_CHUNK):
            chunk = view[pos : pos + DIGEST_CHUNK]
            hasher.update(chunk)
            if also is not None:
                also.update(offset + pos, chunk)
        offset += len(view)
        return hasher.hexdigest()

    def flush() -> None:
        nonlocal pending, size
        obj: Buffer = pending[0] if len(pending) == 1 else b"".join(pending)
        entry = ObjectEntry(f"{prefix}obj-{len(futures):05d}", len(memoryview(obj)), xxh3=digest(obj))
        futures.append(executor.submit(put, entry, obj))
        pending, size = [], 0
        running = [f for f in futures if not f.done()]
        if len(running) >= max_in_flight:
            wait(running, return_when=FIRST_COMPLETED)
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    try:
        for piece in pieces:
            view = memoryview(piece).cast("B")
            pos = 0
            while pos < len(view):
                take = min(len(view) - pos, object_bytes - size)
                pending.append(view[pos : pos + take])
                size += take
                pos += take
                if size == object_bytes:
                    flush()
        if pending:
            flush()
        entries = [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        raise
    fault_point("sidecar.manifest.before", step)
    manifest = make_manifest(entries)
    ref = write_manifest(store, prefix, manifest)
    on_bytes(ref.size)
    return ref
