"""Cut a received snapshot into objects, checksum and upload them with bounded
concurrency, then write the rank's MANIFEST (last, so its presence means every
object is whole)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor

from sidecar.api.faults import fault_point
from sidecar.manifest import Manifest, ManifestRef, ObjectEntry, crc32, write_manifest
from sidecar.store.base import Store


def upload_snapshot(
    store: Store,
    executor: Executor,
    prefix: str,
    data: memoryview,
    object_bytes: int,
    make_manifest: Callable[[list[ObjectEntry]], Manifest],
    on_bytes: Callable[[int], None] = lambda n: None,
    step: int | None = None,
) -> ManifestRef:
    """Upload ``data`` as objects ``<prefix>obj-NNNNN`` and then ``<prefix>MANIFEST``.

    Object keys are unique per save attempt (the caller's prefix), so nothing
    here ever overwrites a committed object. Raises the store's error on the
    first failed object; objects already written stay orphaned (never referenced
    by a MANIFEST) and are harmless.
    """

    def put(index: int, start: int) -> ObjectEntry:
        fault_point("sidecar.upload.object", step)
        piece = data[start : start + object_bytes]
        entry = ObjectEntry(f"{prefix}obj-{index:05d}", len(piece), crc32(piece))
        store.put(entry.key, piece)
        on_bytes(len(piece))
        return entry

    starts = range(0, len(data), object_bytes)
    futures = [executor.submit(put, i, s) for i, s in enumerate(starts)]
    try:
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
