"""In-process store for unit tests. Stores opened with the same `memory://name`
share their objects (a module-level registry), so two components under test can
talk through one store the way they would through a bucket."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from urllib.parse import urlsplit

from sidecar import errors
from sidecar.store.base import (
    Buffer,
    Listing,
    ObjectInfo,
    Store,
    build_listing,
    check_conditions,
    check_list_args,
    validate_key,
    validate_prefix,
    validate_range,
)


class _Space:
    """One named namespace; the lock guards `objects` and `version`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: key -> (body, ETag)
        self.objects: dict[str, tuple[bytes, str]] = {}
        #: Bumped by every put, so ETags differ even for identical content.
        self.version = 0


_registry: dict[str, _Space] = {}
_registry_lock = threading.Lock()


class MemoryStore(Store):
    def __init__(self, name: str, prefix: str = "") -> None:
        if not name:
            raise ValueError("memory store needs a name: memory://<name>[/<prefix>]")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        super().__init__(f"memory://{name}" + (f"/{prefix}" if prefix else ""))
        self._root = f"{prefix}/" if prefix else ""
        with _registry_lock:
            self._space = _registry.setdefault(name, _Space())

    @classmethod
    def from_url(cls, url: str) -> MemoryStore:
        parts = urlsplit(url)
        if parts.scheme != "memory" or not parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"bad memory store url {url!r}: expected memory://<name>[/<prefix>]")
        return cls(parts.netloc, parts.path)

    def put(self, key: str, data: Buffer, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        full = self._root + validate_key(key)
        check_conditions(if_none_match, if_match)
        blob = bytes(data)  # a copy: the caller may reuse its buffer
        self._count("put")
        space = self._space
        with space.lock:
            current = space.objects.get(full)
            if if_none_match and current is not None:
                raise errors.PreconditionFailed(f"{self.url}/{key} exists (If-None-Match)")
            if if_match is not None and (current is None or current[1] != if_match):
                state = "is missing" if current is None else "changed"
                raise errors.PreconditionFailed(f"{self.url}/{key} {state} (If-Match {if_match})")
            space.version += 1
            etag = f"m{space.version:x}"
            space.objects[full] = (blob, etag)
        return etag

    def get(self, key: str) -> bytes:
        return self.get_versioned(key)[0]

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        full = self._root + validate_key(key)
        self._count("get")
        with self._space.lock:
            found = self._space.objects.get(full)
        if found is None:
            raise errors.ObjectNotFound(f"no such object: {self.url}/{key}")
        return found

    def get_range(self, key: str, start: int, length: int) -> bytes:
        validate_range(start, length)
        return self.get(key)[start : start + length]

    def head(self, key: str) -> ObjectInfo | None:
        full = self._root + validate_key(key)
        self._count("head")
        with self._space.lock:
            found = self._space.objects.get(full)
        return None if found is None else ObjectInfo(key, len(found[0]), found[1])

    def list(
        self,
        prefix: str = "",
        *,
        delimiter: str | None = None,
        start_after: str | None = None,
        limit: int | None = None,
    ) -> Listing:
        check_list_args(validate_prefix(prefix), delimiter, limit)
        self._count("list")
        full_prefix = self._root + prefix
        with self._space.lock:
            keys = sorted(k for k in self._space.objects if k.startswith(full_prefix))
            sizes = [len(self._space.objects[k][0]) for k in keys]
        lo = 0
        if start_after is not None:
            lo = bisect.bisect_right(keys, self._root + start_after)
        n = len(self._root)
        items = ((k[n:], s) for k, s in zip(keys[lo:], sizes[lo:], strict=True))
        return build_listing(items, prefix, delimiter, start_after, limit)

    def delete(self, keys: Iterable[str]) -> None:
        full = [self._root + validate_key(k) for k in keys]
        if not full:
            return
        self._count("delete")
        with self._space.lock:
            for k in full:
                self._space.objects.pop(k, None)
