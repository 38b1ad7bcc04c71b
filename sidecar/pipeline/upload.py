"""Cut a received snapshot into objects, checksum and upload them with bounded
concurrency, then write the rank's MANIFEST (last, so its presence means every
object is whole)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait

from sidecar.faults import fault_point
from sidecar.manifest import Manifest, ManifestRef, ObjectEntry, write_manifest, xxh3
from sidecar.store.base import Buffer, Store


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
) -> ManifestRef:
    """Upload the concatenation of ``pieces`` as objects ``<prefix>obj-NNNNN``, then
    ``<prefix>MANIFEST``.

    ``pieces`` may be produced lazily (an encoder): objects upload while later pieces
    are computed, with at most ``max_in_flight`` objects pending, so memory stays
    bounded. An object inside one piece is a view of it; one spanning pieces is joined.

    Object keys are unique per save attempt (the caller's prefix), so nothing
    here ever overwrites a committed object. Raises the store's error on the
    first failed object; objects already written stay orphaned (never referenced
    by a MANIFEST) and are harmless.
    """

    def put(index: int, piece: Buffer) -> ObjectEntry:
        fault_point("sidecar.upload.object", step)
        entry = ObjectEntry(f"{prefix}obj-{index:05d}", len(memoryview(piece)), xxh3=xxh3(piece))
        store.put(entry.key, piece)
        on_bytes(entry.size)
        return entry

    futures: list[Future[ObjectEntry]] = []
    pending: list[memoryview] = []
    size = 0

    def flush() -> None:
        nonlocal pending, size
        obj: Buffer = pending[0] if len(pending) == 1 else b"".join(pending)
        futures.append(executor.submit(put, len(futures), obj))
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
