"""Storage backends behind one interface (see base.Store for the contract)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from sidecar.store.base import Listing, ObjectInfo, Store

__all__ = ["Listing", "ObjectInfo", "Store", "open_store"]


def open_store(url: str, **options: Any) -> Store:
    """Open the store a URL names: s3://bucket[/prefix], file:///abs/path or memory://name[/prefix].

    `options` go to the backend (S3: endpoint_url, region, access_key,
    secret_key, part_bytes, multipart_threshold, concurrency, max_attempts,
    retry_mode, connect_timeout, read_timeout, page_size; file: create).
    A malformed URL raises ValueError naming it.
    """
    try:
        return _open(url, options)
    except ValueError as exc:
        if url in str(exc):
            raise
        raise ValueError(f"bad store url {url!r}: {exc}") from exc


def _open(url: str, options: dict[str, Any]) -> Store:
    scheme = urlsplit(url).scheme
    # Backends import lazily, so that e.g. a file-only tool does not pay for importing boto3.
    if scheme == "s3":
        from sidecar.store.s3 import S3Store

        return S3Store.from_url(url, **options)
    if scheme == "file":
        from sidecar.store.file import FileStore

        return FileStore.from_url(url, **options)
    if scheme == "memory":
        from sidecar.store.memory import MemoryStore

        if options:
            raise TypeError(f"memory store takes no options, got {sorted(options)}")
        return MemoryStore.from_url(url)
    raise ValueError(f"unsupported store url {url!r}: expected s3://, file:// or memory://")
