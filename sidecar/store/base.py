"""The storage contract every backend implements, plus the helpers they share."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType

from sidecar import errors

Buffer = bytes | bytearray | memoryview
#: Where a read puts its bytes: (offset in the range, bytes still wanted) -> a writable buffer
#: of 1 to that many bytes (a slice of the destination, or a small buffer reused).
Place = Callable[[int, int], memoryview]
#: Called with each piece of a read as it lands, in order, and its offset in the range (a
#: digest computed while the bytes are still in cache, a copy out of a reused buffer).
OnData = Callable[[int, memoryview], None]
#: Pieces a read hands to ``on_data``: small enough to stay in cache between copy and digest.
READ_PIECE_BYTES = 1 << 20


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    #: The object's ETag where it came cheaply (head()); "" in listings. Not part of
    #: equality: an ObjectInfo names an object and its size, whichever call produced it.
    etag: str = field(default="", compare=False)


@dataclass
class Listing:
    objects: list[ObjectInfo] = field(default_factory=list)
    #: "Common prefixes" (each ending with the delimiter) when list() is given a delimiter.
    prefixes: list[str] = field(default_factory=list)


class Store(ABC):
    """A flat namespace of immutable byte objects: S3, a local directory, or memory.

    Contract, identical across backends (tests/unit/test_store.py and
    tests/integration/test_s3_store.py run the same cases on each):

    - Keys are '/'-separated and relative to the store root (the prefix in the
      URL). A valid key is non-empty, has no leading '/', no empty, '.' or '..'
      segment and no NUL; anything else raises ValueError before any request.
    - put() makes an object visible whole or not at all, never partially, to
      every reader of the same store, and returns the new object's ETag (an
      opaque string). An unconditional put() on an existing key replaces it.
      Conditional puts refuse with errors.PreconditionFailed, writing nothing:
      `if_none_match=True` creates only (refused when the key exists);
      `if_match=etag` replaces only the object with that ETag (refused when it
      changed or is missing). Among conditional puts racing on one key exactly
      one wins each round. Giving both conditions is a ValueError. An
      unconditional put racing a conditional one on the same key is not
      ordered against it; callers do not mix the two on one key.
    - ETags: get_versioned() and head() return the ETag put() returned. On the
      file and memory backends every successful put() makes a new ETag, even
      for identical content; on S3 the ETag is the server's (an MD5 of the
      content for single-part objects), so rewriting identical bytes keeps it.
    - get()/get_range()/read_into() raise errors.ObjectNotFound for a missing
      key; every other backend failure raises errors.StorageError (after the
      backend's own retries). read_into() given `object_size` raises
      errors.CorruptObject when the object has another size, reading no more
      than the caller's buffer holds.
    - list() returns keys in byte-lexicographic order, all pages unless
      `limit` is given; `limit` counts objects plus common prefixes, like S3's
      MaxKeys. `start_after` is exclusive. With a delimiter, keys sharing the
      next segment after `prefix` roll up into one common prefix.
    - delete() ignores missing keys.
    - requests counts backend requests by kind ("put", "get", "head", "list",
      "delete"; a conditional put is a "put"), for metrics and for tests that
      bound request counts.

    Call order: open (open_store), then any operations from any number of
    threads, then close() once. Backends are thread-safe.

    Backend differences worth knowing: the file backend cannot hold both
    "a/b" and "a/b/c" (a path is a file or a directory), and raises
    StorageError on such a put; S3 and memory allow it. SeaweedFS orders
    listings as a tree rather than byte-lexicographically when a key segment
    contains a byte below '/' (such as '-' or '.') and is compared with a
    sibling directory; see sidecar/store/s3.py.
    """

    url: str
    requests: Counter[str]

    def __init__(self, url: str) -> None:
        self.url = url
        self.requests = Counter()
        self._requests_lock = threading.Lock()

    def _count(self, op: str, n: int = 1) -> None:
        with self._requests_lock:
            self.requests[op] += n

    @abstractmethod
    def put(self, key: str, data: Buffer, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Store `data` under `key`, atomically, and return its ETag.

        Unconditionally it replaces an existing object; `if_none_match` (create
        only) and `if_match` (replace that version only) raise
        errors.PreconditionFailed instead when their condition does not hold.
        """

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object; errors.ObjectNotFound when missing."""

    @abstractmethod
    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The whole object and its ETag, read together; errors.ObjectNotFound when missing."""

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Up to `length` bytes from offset `start`; shorter (possibly empty) past the end."""

    def read_into(
        self,
        key: str,
        start: int,
        length: int,
        place: Place,
        *,
        object_size: int | None = None,
        on_data: OnData | None = None,
    ) -> int:
        """Read up to ``length`` of the object's bytes from offset ``start`` into the buffers
        ``place`` gives, never more than asked, and return how many came: fewer only where the
        object ends first. With ``object_size``, an object of any other size is refused
        (errors.CorruptObject) before its bytes are read. ``on_data`` sees every piece as it
        lands, in order. This generic form copies out of get_range(); backends read straight
        into the buffers."""
        validate_range(start, length)
        if object_size is not None:
            info = self.head(key)
            if info is None:
                raise errors.ObjectNotFound(f"no such object: {self.url}/{key}")
            check_size(key, info.size, object_size)
        data = memoryview(self.get_range(key, start, length))[:length]
        pos = 0
        while pos < len(data):
            dest = place(pos, min(READ_PIECE_BYTES, len(data) - pos))
            n = len(dest)
            dest[:] = data[pos : pos + n]
            if on_data is not None:
                on_data(pos, dest)
            pos += n
        return pos

    def open_object(self, key: str, size: int) -> int | None:
        """A read-only descriptor of the object's bytes (the caller's to close), for a reader in
        another process that copies them out itself; only where the object is a local file of
        exactly ``size`` bytes (else errors.CorruptObject). None: this store holds no files."""
        return None

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """Size and ETag of the object, or None when missing."""

    @abstractmethod
    def list(
        self,
        prefix: str = "",
        *,
        delimiter: str | None = None,
        start_after: str | None = None,
        limit: int | None = None,
    ) -> Listing:
        """Objects (and common prefixes) whose keys start with `prefix`."""

    @abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Remove the objects; missing keys are fine."""

    def close(self) -> None:  # noqa: B027 - optional hook; most backends hold nothing
        """Release connections and threads. The store is unusable afterwards."""

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def validate_key(key: str) -> str:
    """Return `key` if it is a valid object key, else raise ValueError (see Store)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid object key {key!r}: must be a non-empty string")
    if key.startswith("/"):
        raise ValueError(f"invalid object key {key!r}: must be relative (no leading '/')")
    if "\x00" in key:
        raise ValueError(f"invalid object key {key!r}: contains NUL")
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise ValueError(f"invalid object key {key!r}: empty, '.' or '..' segment")
    return key


def validate_prefix(prefix: str) -> str:
    """Like validate_key, but "" and a trailing '/' are allowed (a prefix need not be a key)."""
    if prefix == "":
        return prefix
    validate_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


def check_conditions(if_none_match: bool, if_match: str | None) -> None:
    """Reject condition combinations no backend can honour, before any request."""
    if if_none_match and if_match is not None:
        raise ValueError("put() takes if_none_match or if_match, not both")
    if if_match is not None and not if_match:
        raise ValueError("if_match must be a non-empty ETag")


def check_size(key: str, size: int, expected: int) -> None:
    """An object whose size is not the one its reader was told (a MANIFEST's) is refused."""
    if size != expected:
        raise errors.CorruptObject(key, f"size {size} != {expected} in the manifest")


def into(dest: memoryview) -> Place:
    """The :data:`Place` of a read into ``dest`` itself: no copy after the read."""
    return lambda pos, n: dest[pos : pos + n]


def validate_range(start: int, length: int) -> None:
    if start < 0 or length < 0:
        raise ValueError(f"invalid byte range: start={start} length={length} (both must be >= 0)")


def build_listing(
    keys: Iterable[tuple[str, int]],
    prefix: str,
    delimiter: str | None,
    start_after: str | None,
    limit: int | None,
) -> Listing:
    """S3 ListObjectsV2 semantics over `keys`, which must come in lexicographic order.

    The local backends use this so their listings match S3 exactly; `keys` may
    be a lazy iterator, and it is consumed only as far as `limit` needs.
    """
    check_list_args(prefix, delimiter, limit)
    listing = Listing()
    count = 0
    last_prefix: str | None = None
    for key, size in keys:
        if not key.startswith(prefix) or (start_after is not None and key <= start_after):
            continue
        if delimiter:
            cut = key.find(delimiter, len(prefix))
            if cut >= 0:
                common = key[: cut + len(delimiter)]
                if common != last_prefix:
                    if limit is not None and count >= limit:
                        break
                    listing.prefixes.append(common)
                    last_prefix = common
                    count += 1
                continue
        if limit is not None and count >= limit:
            break
        listing.objects.append(ObjectInfo(key, size))
        count += 1
    return listing


def check_list_args(prefix: str, delimiter: str | None, limit: int | None) -> None:
    validate_prefix(prefix)
    if delimiter == "":
        raise ValueError("delimiter must be None or a non-empty string")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be None or >= 1, got {limit}")
