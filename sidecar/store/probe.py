"""Check, with a throwaway object, that a store really honours conditional writes.

Some S3-compatible servers (and proxies in front of them) accept If-None-Match
and If-Match but ignore them; the commit protocol would then silently lose its
create-only and compare-and-swap guarantees. Run this once at startup.
"""

from __future__ import annotations

import contextlib
import uuid

from sidecar import errors
from sidecar.store.base import Store, validate_prefix


def conditional_writes_unsupported(store: Store, prefix: str) -> str | None:
    """None when `store` honours If-None-Match and If-Match under `prefix`, else a
    one-line description of what it ignored. Storage errors propagate.

    Costs four PUTs and a DELETE. The probe key, `<prefix>.strata-probe-<hex>`,
    is valid on every backend and unique, so concurrent probes never meet.
    """
    validate_prefix(prefix)
    key = f"{prefix}.strata-probe-{uuid.uuid4().hex}"
    ignored: list[str] = []
    try:
        etag = store.put(key, b"strata probe 1", if_none_match=True)
        try:
            etag = store.put(key, b"strata probe 2", if_none_match=True)
            ignored.append("If-None-Match is ignored: a create-only PUT replaced an existing object")
        except errors.PreconditionFailed:
            pass
        stale = uuid.uuid4().hex  # an ETag no object has
        try:
            etag = store.put(key, b"strata probe 3", if_match=stale)
            ignored.append("If-Match is ignored: a PUT with a wrong ETag replaced the object")
        except errors.PreconditionFailed:
            pass
        try:
            store.put(key, b"strata probe 4", if_match=etag)
        except errors.PreconditionFailed:
            ignored.append("If-Match is broken: a PUT with the ETag the last PUT returned was refused")
    finally:
        with contextlib.suppress(errors.StorageError):
            store.delete([key])
    return "; ".join(ignored) or None
