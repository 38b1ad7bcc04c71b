"""A directory as a store: one file per key, written the way DCP's filesystem
writer does (temporary file in the same directory, fsync, rename, fsync the
directory), so a crash leaves either the old object or the new one.

Conditional puts lock the key (flock on a lock file beside it) so that they
exclude each other; create-only ones publish with link(), which, unlike
rename(), never replaces an existing file. ETags come from the file's inode
number, mtime and size: a new file for every put, so a new ETag.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

from sidecar import errors
from sidecar.store.base import (
    READ_PIECE_BYTES,
    Buffer,
    Listing,
    ObjectInfo,
    OnData,
    Place,
    Store,
    build_listing,
    check_conditions,
    check_list_args,
    check_size,
    validate_key,
    validate_prefix,
    validate_range,
)

#: Temporary files start with this; keys may not, so list() can skip them safely.
TMP_MARK = ".strata-tmp-"


def _check_segments(key: str) -> str:
    if any(seg.startswith(TMP_MARK) for seg in key.split("/")):
        raise ValueError(f"invalid object key {key!r}: segments may not start with {TMP_MARK!r}")
    return key


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Objects from this size up are written with O_DIRECT where the filesystem takes it: the bytes
#: go from the caller's buffer to the disk, not copied into the page cache and written back
#: from there (kernel CPU a node's cores are short of: docs/benchmarks/notes.md has the
#: figures), nor evict a checkpoint's worth of the trainer's cached files. A later read comes
#: from the disk, not the cache.
DIRECT_MIN_BYTES = 1 << 20
#: O_DIRECT wants buffer, length and file offset aligned to the device's block (4096 covers
#: 512-byte and 4 KiB devices); a tail shorter than this is written through the page cache.
_DIRECT_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: how a filesystem or a buffer says "not with O_DIRECT" (before writing anything)
_NO_DIRECT = frozenset({errno.EINVAL, errno.EOPNOTSUPP})


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for ``fd``; False where the filesystem refuses it (tmpfs before
    Linux 6.6, say)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
    except OSError as exc:
        if exc.errno in _NO_DIRECT:
            return False
        raise
    return True


def _write_all(fd: int, data: Buffer) -> None:
    """Write ``data`` at ``fd``'s offset: its aligned bulk with O_DIRECT where that works (an
    unaligned buffer, or a filesystem without it, is refused with EINVAL before any byte is
    written, and the rest goes through the page cache), the rest buffered."""
    view = memoryview(data).cast("B")
    size, pos = len(view), 0
    bulk = size - size % _DIRECT_ALIGN if _O_DIRECT and size >= DIRECT_MIN_BYTES else 0
    if bulk and _set_direct(fd, True):
        try:
            while pos < bulk:
                pos += os.write(fd, view[pos:bulk])
        except OSError as exc:
            if exc.errno not in _NO_DIRECT:
                raise
        finally:
            _set_direct(fd, False)
    while pos < size:
        pos += os.write(fd, view[pos:])


def _etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


_clock_lock = threading.Lock()
_last_ns = 0


def _unique_ns() -> int:
    """Wall-clock nanoseconds, strictly increasing within this process."""
    global _last_ns
    with _clock_lock:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        return _last_ns


@contextlib.contextmanager
def _key_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on the lock file of the key at `path`.

    The lock file is unlinked on release, so it neither shows up anywhere nor
    keeps delete() from pruning the directory. Whoever opened the old file and
    was waiting on it sees, once it holds the lock, that the path now names
    another file (or none) and starts over, so two holders never coexist.
    (A crash while holding it leaves the file behind, like a crashed put's
    temporary file: list() skips both.)
    """
    digest = hashlib.blake2b(os.fsencode(path.name), digest_size=8).hexdigest()
    lock = path.with_name(f"{TMP_MARK}lock-{digest}")  # hashed: a long key name must still fit
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.stat(lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
        except BaseException:
            os.close(fd)
            raise
        if current:
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)  # while still holding it; see above
        os.close(fd)


class FileStore(Store):
    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        path = Path(root)
        if not path.is_absolute():
            raise ValueError(f"file store root must be an absolute path, got {str(root)!r}")
        self.root = path
        super().__init__(path.as_uri())
        if create:
            path.mkdir(parents=True, exist_ok=True)
        elif not path.is_dir():
            raise errors.StorageError(f"file store root {path} is not a directory")

    @classmethod
    def from_url(cls, url: str, **options: bool) -> FileStore:
        parts = urlsplit(url)
        if parts.scheme != "file" or parts.netloc not in ("", "localhost") or not parts.path:
            raise ValueError(f"bad file store url {url!r}: expected file:///absolute/path")
        if parts.query or parts.fragment:
            raise ValueError(f"bad file store url {url!r}: no query or fragment allowed")
        return cls(unquote(parts.path), **options)

    def _path(self, key: str) -> Path:
        return self.root / _check_segments(validate_key(key))

    def _fail(self, op: str, key: str, exc: OSError) -> errors.StorageError:
        return errors.StorageError(f"file store {op} {self.root}/{key} failed: {exc}")

    # -- writes -----------------------------------------------------------------

    def put(self, key: str, data: Buffer, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        path = self._path(key)
        check_conditions(if_none_match, if_match)
        self._count("put")
        # A concurrent delete() may prune the (then empty) parent directory
        # between our mkdir and our open; one retry recreates it.
        for attempt in range(3):
            try:
                self._makedirs(path.parent)
                if not if_none_match and if_match is None:
                    return self._write_atomically(path, data)
                # Create-only puts lock too, so the two conditions on one key exclude each other.
                with _key_lock(path):
                    if if_match is not None:
                        return self._replace_if_match(key, path, data, if_match)
                    return self._create_exclusively(key, path, data)
            except FileNotFoundError as exc:
                if attempt == 2:
                    raise self._fail("put", key, exc) from exc
            except IsADirectoryError as exc:
                raise errors.StorageError(
                    f"file store cannot put {key!r}: other keys exist under {key}/ "
                    "(a path cannot be both a file and a directory)"
                ) from exc
            except NotADirectoryError as exc:
                raise errors.StorageError(
                    f"file store cannot put {key!r}: a parent of it is itself an object"
                ) from exc
            except OSError as exc:
                raise self._fail("put", key, exc) from exc
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _makedirs(self, directory: Path) -> None:
        """mkdir -p, fsyncing each new directory's parent so the new entries survive a crash."""
        missing: list[Path] = []
        d = directory
        while d != self.root and not d.is_dir():
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):
                d.mkdir()
            _fsync_dir(d.parent)

    def _write_tmp(self, path: Path, data: Buffer) -> tuple[Path, str]:
        """A durable temporary file beside `path` holding `data`, and the ETag it will have there."""
        tmp = path.with_name(f"{TMP_MARK}{uuid.uuid4().hex}")
        try:
            with open(tmp, "xb", buffering=0) as f:
                # Whatever the umask: only this user writes it (its descriptors are lent to
                # trainers, who must not be able to reopen them for writing).
                os.fchmod(f.fileno(), stat.S_IMODE(os.fstat(f.fileno()).st_mode) & ~0o022)
                _write_all(f.fileno(), data)
                # A fine-grained mtime that never repeats: the kernel stamps files with a
                # coarse clock, and a freed inode number is soon reused, so two versions
                # of one size could otherwise share an ETag.
                ns = _unique_ns()
                os.utime(f.fileno(), ns=(ns, ns))
                os.fsync(f.fileno())
                etag = _etag(os.fstat(f.fileno()))  # rename() and link() keep inode and mtime
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return tmp, etag

    def _write_atomically(self, path: Path, data: Buffer) -> str:
        tmp, etag = self._write_tmp(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(path.parent)
        return etag

    def _replace_if_match(self, key: str, path: Path, data: Buffer, if_match: str) -> str:
        # Under the key lock: no conditional put can slip in between this check and the rename.
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise errors.PreconditionFailed(f"{self.url}/{key} is missing (If-Match {if_match})") from None
        if not stat.S_ISREG(st.st_mode) or _etag(st) != if_match:
            raise errors.PreconditionFailed(f"{self.url}/{key} changed (If-Match {if_match})")
        return self._write_atomically(path, data)

    def _create_exclusively(self, key: str, path: Path, data: Buffer) -> str:
        # link() publishes the finished file atomically and fails if the name exists:
        # open(O_EXCL) on the final path would expose a half-written file, and
        # rename() would replace whatever an unconditional put left there.
        tmp, etag = self._write_tmp(path, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            if path.is_dir():
                raise IsADirectoryError(errno.EISDIR, "is a directory", str(path)) from None
            raise errors.PreconditionFailed(f"{self.url}/{key} exists (If-None-Match)") from None
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        _fsync_dir(path.parent)
        return etag

    def delete(self, keys: Iterable[str]) -> None:
        paths = [(k, self._path(k)) for k in keys]
        if not paths:
            return
        self._count("delete")
        for key, path in paths:
            try:
                path.unlink()
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                continue  # missing (a directory is a prefix, not an object)
            except OSError as exc:
                raise self._fail("delete", key, exc) from exc
            self._prune(path.parent)

    def _prune(self, directory: Path) -> None:
        """Remove now-empty parents, so they neither pile up nor block a later put of that key."""
        d = directory
        while d != self.root:
            try:
                d.rmdir()
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    return
                raise
            d = d.parent

    # -- reads ------------------------------------------------------------------

    def _open(self, op: str, key: str) -> int:
        """A descriptor of the regular file holding ``key``, else ObjectNotFound: a symlink there
        is not followed and a FIFO does not block the open (O_NONBLOCK; regular files read as
        ever), and neither is read (list and head show only regular files too)."""
        path = self._path(key)
        self._count(op)
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise errors.ObjectNotFound(f"no such object: {self.url}/{key}") from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink
                raise errors.ObjectNotFound(f"no such object: {self.url}/{key} (not a file)") from exc
            raise self._fail(op, key, exc) from exc
        try:
            mode = os.fstat(fd).st_mode
        except OSError as exc:
            os.close(fd)
            raise self._fail(op, key, exc) from exc
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise errors.ObjectNotFound(f"no such object: {self.url}/{key} (not a file)")
        return fd

    def get(self, key: str) -> bytes:
        return self.get_versioned(key)[0]

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        fd = self._open("get", key)
        try:
            with open(fd, "rb", closefd=False) as f:
                st = os.fstat(fd)  # the file we read, even if a put renames over it now
                return f.read(), _etag(st)
        except OSError as exc:
            raise self._fail("get", key, exc) from exc
        finally:
            os.close(fd)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        validate_range(start, length)
        fd = self._open("get", key)
        try:
            with open(fd, "rb", closefd=False) as f:
                f.seek(start)
                return f.read(length)
        except OSError as exc:
            raise self._fail("get", key, exc) from exc
        finally:
            os.close(fd)

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
        validate_range(start, length)
        fd = self._open("get", key)
        try:
            if object_size is not None:  # the file we read, even if a put renames over it now
                check_size(key, os.fstat(fd).st_size, object_size)
            pos = 0
            while pos < length:
                dest = place(pos, min(READ_PIECE_BYTES, length - pos))
                n = os.preadv(fd, [dest], start + pos)
                if n <= 0:
                    break
                if on_data is not None:
                    on_data(pos, dest[:n])
                pos += n
            return pos
        except OSError as exc:
            raise self._fail("get", key, exc) from exc
        finally:
            os.close(fd)

    def open_object(self, key: str, size: int) -> int | None:
        fd = self._open("get", key)
        try:
            check_size(key, os.fstat(fd).st_size, size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        self._count("head")
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise self._fail("head", key, exc) from exc
        return ObjectInfo(key, st.st_size, _etag(st)) if stat.S_ISREG(st.st_mode) else None

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
        # Start the walk at the deepest directory the prefix names.
        base = prefix[: prefix.rfind("/") + 1]
        try:
            items = self._walk(self.root / base if base else self.root, base, prefix, start_after)
            return build_listing(items, prefix, delimiter, start_after, limit)
        except OSError as exc:
            raise self._fail("list", prefix, exc) from exc

    def _walk(
        self, directory: Path, base: str, prefix: str, start_after: str | None
    ) -> Iterator[tuple[str, int]]:
        """Yield (key, size) under `directory` in byte-lexicographic key order, lazily.

        Sorting a directory's entries by name, with '/' appended to
        subdirectories, gives global key order: all keys below directory "x"
        start with "x/", and no sibling's sort key is a prefix of another's.
        """
        try:
            with os.scandir(directory) as it:
                entries = [(e.name + "/" if e.is_dir(follow_symlinks=False) else e.name, e) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return
        entries.sort(key=lambda pair: pair[0])
        for name, entry in entries:
            if name.startswith(TMP_MARK):
                continue
            key = base + name
            if name.endswith("/"):
                # Skip subtrees that cannot match the prefix or lie wholly at/before start_after.
                if not (key.startswith(prefix) or prefix.startswith(key)):
                    continue
                if start_after is not None and key < start_after and not start_after.startswith(key):
                    continue
                yield from self._walk(Path(entry.path), key, prefix, start_after)
            elif (
                entry.is_file(follow_symlinks=False)
                and key.startswith(prefix)
                and (start_after is None or key > start_after)
            ):
                try:
                    yield key, entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue  # deleted while we walked
