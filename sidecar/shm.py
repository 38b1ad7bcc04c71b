"""Shared-memory segments a trainer staged a save into (same host only).

The client creates ``<shm_dir>/strata-<instance>-<n>``, copies its tensors
into it and sends only a header naming it. The sidecar maps the file read-only
and renames it to a name of its own (``strata-held-p<pid>-<instance>-<n>``):
the trainer's name is free again, the sidecar's mapping keeps the committed
snapshot readable after the trainer is gone (REFT's process that outlives the
trainer), and the restarted trainer reads that snapshot straight from the held
name (a restore from memory at memory speed, not through gRPC). The sidecar
unlinks the held name when it forgets the mapping: when the trainer's successor
saves, or when the sidecar stops; a sidecar that crashed leaves them, and the
next one to start removes held names of sidecars that are gone.

The mapping is cached by name, because the client reuses its segments for
every save: mapping a GiB again would fault every page in once more.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import logging
import mmap
import os
import re
import stat
import threading
import uuid
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import numpy as np

from sidecar.api import SHM_NAME_PATTERN
from sidecar.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)
_NAME = re.compile(SHM_NAME_PATTERN)


def check_dir(directory: str) -> str:
    """The usable shm directory, or "" (shared-memory saves off) with a warning."""
    if not directory:
        return ""
    path = Path(directory)
    if not path.is_dir() or not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        log.warning("--shm-dir %s is not a writable directory; shared-memory saves are off", directory)
        return ""
    return str(path)


class FdMapping(mmap.mmap):
    """A shared mapping that keeps its file open while it lives, so a worker process can map the
    same pages (``/proc/<pid>/fd/<fd>``, see :func:`source_of`) however the file is renamed or
    unlinked meanwhile."""

    fd: int


def _keep_fd(mapped: FdMapping, fd: int) -> FdMapping:
    mapped.fd = fd
    weakref.finalize(mapped, os.close, fd)
    return mapped


def map_fd(fd: int, size: int, *, writable: bool = False) -> FdMapping:
    """A shared mapping of ``size`` bytes of ``fd``, which it owns from here (closed with it)."""
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return _keep_fd(FdMapping(fd, size, mmap.MAP_SHARED, prot), fd)
    except BaseException:
        os.close(fd)
        raise


def anonymous(size: int) -> FdMapping:
    """A writable zero-filled mapping of ``size`` bytes backed by a memfd: pages are allocated
    as they are written (a dropped stream costs only what it carried), and a worker process can
    map them as it maps a trainer's segment. OSError where there is no memfd (not Linux, or a
    seccomp profile that denies it)."""
    if not hasattr(os, "memfd_create"):
        raise OSError("memfd_create is not available on this platform")
    fd = os.memfd_create("strata-stream", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return map_fd(fd, size, writable=True)


class Source(NamedTuple):
    """Where another process of this user finds bytes of a :class:`FdMapping`: it opens
    ``/proc/<pid>/fd/<fd>`` and checks that it is still the file (``dev``, ``ino``)."""

    pid: int
    fd: int
    offset: int
    dev: int
    ino: int


def source_of(view: memoryview) -> Source | None:
    """Where ``view``'s bytes are for another process, or None when they are not in a
    :class:`FdMapping`."""
    owner = view.obj
    if not isinstance(owner, FdMapping) or owner.closed or not view.contiguous or not view.nbytes:
        return None
    start = np.frombuffer(view, np.uint8).ctypes.data
    base = np.frombuffer(owner, np.uint8).ctypes.data
    if not base <= start <= base + len(owner) - view.nbytes:
        return None
    info = os.fstat(owner.fd)
    return Source(os.getpid(), owner.fd, start - base, info.st_dev, info.st_ino)


class Segments:
    """Mappings of client segments by name, at most ``per_owner`` per rank.

    A client double-buffers (two segments); a restarted client brings new
    ones, and its predecessor's are dropped. A snapshot holds a memoryview of
    its segment, which keeps the mapping alive after it leaves this cache;
    dropping a name only stops reuse.
    """

    def __init__(self, directory: str, per_owner: int = 2) -> None:
        self.directory = directory
        self._per_owner = per_owner
        self._lock = threading.Lock()
        self._maps: dict[object, OrderedDict[str, FdMapping]] = {}
        with _LIVE_LOCK:
            # The PID, and a token: a restarted container's sidecar may get its predecessor's PID.
            self._id = f"{os.getpid()}.{next(_IDS)}{uuid.uuid4().hex[:6]}"
            _LIVE.add(self._id)
        self._prefix = f"strata-held-p{self._id}-"
        if directory:
            _remove_stale_held(directory)

    def held_name(self, name: str) -> str | None:
        """The name the segment ``name`` is held under in the directory, while it is there."""
        held = self._prefix + name.removeprefix("strata-")
        return held if os.path.exists(os.path.join(self.directory, held)) else None

    def view(self, name: str, size: int, owner: object) -> memoryview:
        """A read-only view of the first ``size`` bytes of segment ``name`` of ``owner`` (a rank)."""
        if not self.directory:
            raise FailedPrecondition("this sidecar does not accept shared-memory saves (--shm-dir is empty)")
        if not _NAME.fullmatch(name) or name.startswith("strata-held-"):
            raise InvalidArgument(
                f"shared segment name {name!r} must match {SHM_NAME_PATTERN} and not start with "
                "strata-held- (the sidecar's own names)"
            )
        instance = name.rsplit("-", 1)[0]
        with self._lock:
            maps = self._maps.setdefault(owner, OrderedDict())
            mapped = maps.get(name)
            if mapped is None:
                mapped = self._map(name)
                for old in {n.rsplit("-", 1)[0] for n in maps} - {instance}:
                    self._sweep(maps, old)  # a restarted trainer: its predecessor's segments are done
                maps[name] = mapped
                while len(maps) > self._per_owner:
                    self._forget(maps.popitem(last=False)[0])
            maps.move_to_end(name)
        if size > len(mapped):
            raise InvalidArgument(
                f"shared segment {name} holds {len(mapped)} bytes; the save declares {size}"
            )
        return memoryview(mapped)[:size]

    def _map(self, name: str) -> FdMapping:
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FailedPrecondition(
                f"shared segment {name} is not in {self.directory} (a sidecar restart forgets segments; "
                "the trainer creates new ones)"
            ) from None
        except OSError as exc:
            raise FailedPrecondition(f"cannot open shared segment {path}: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
                raise InvalidArgument(f"shared segment {path} is not a non-empty regular file")
        except BaseException:
            os.close(fd)
            raise
        mapped = map_fd(fd, info.st_size)  # keeps fd: encoding workers map the same pages
        try:  # ours now, under our name: a restarted trainer restores from it
            os.rename(path, os.path.join(self.directory, self._prefix + name.removeprefix("strata-")))
        except OSError as exc:
            log.warning("could not take over shared segment %s: %s", path, exc)
            with contextlib.suppress(OSError):
                os.unlink(path)
        return mapped

    def handoff(self, blobs: list[memoryview], size: int) -> str:
        """A new segment holding ``blobs`` (``size`` bytes), for a restoring trainer to copy from
        and remove; its name. OSError (a full tmpfs) leaves nothing behind."""
        name = f"{self._prefix}r{uuid.uuid4().hex[:16]}"
        path = os.path.join(self.directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(1, size))  # ENOSPC now, not as a SIGBUS later
            pos = 0
            for blob in blobs:
                while len(blob):
                    n = os.pwrite(fd, blob, pos)
                    pos, blob = pos + n, blob[n:]
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        return name

    def scratch(self, size: int) -> tuple[str, memoryview] | None:
        """A new writable segment of ``size`` bytes to assemble a restore in (then handed to the
        trainer as it is), or None without a shm dir or room in it."""
        if not self.directory or size <= 0:
            return None
        name = f"{self._prefix}r{uuid.uuid4().hex[:16]}"
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, size)
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            log.info("no room in %s for a %d-byte restore segment: %s", self.directory, size, exc)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        finally:
            os.close(fd)
        return name, memoryview(mapped)

    def remove(self, name: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.directory, name))

    def exists(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.directory, name))

    def _forget(self, name: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.directory, self._prefix + name.removeprefix("strata-")))

    def _sweep(self, maps: OrderedDict[str, FdMapping], instance: str) -> None:
        """Forget an instance's mappings and unlink any segment of it never mapped (the spare
        a crashed trainer had warmed up)."""
        for name in [n for n in maps if n.rsplit("-", 1)[0] == instance]:
            del maps[name]
            self._forget(name)
        for path in Path(self.directory).glob(f"{glob.escape(instance)}-*"):
            with contextlib.suppress(OSError):
                path.unlink()

    def close(self) -> None:
        with self._lock:
            for maps in self._maps.values():
                for instance in {n.rsplit("-", 1)[0] for n in maps}:
                    self._sweep(maps, instance)
            self._maps.clear()
        with _LIVE_LOCK:
            _LIVE.discard(self._id)


#: the Segments of this process (several sidecars run in one process in tests)
_LIVE: set[str] = set()
_LIVE_LOCK = threading.Lock()
_IDS = itertools.count()


def _remove_stale_held(directory: str) -> None:
    """Held segments of sidecars that are gone (a crash, or this process's predecessor in a
    restarted container, which may have had the same PID)."""
    for path in Path(directory).glob("strata-held-p*-*"):
        owner = path.name.removeprefix("strata-held-p").split("-", 1)[0]
        pid_text = owner.split(".", 1)[0]
        if not pid_text.isdigit():
            continue
        pid = int(pid_text)
        with _LIVE_LOCK:
            alive = owner in _LIVE if pid == os.getpid() else True
        if alive and pid != os.getpid():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive = False
            except PermissionError:
                pass
        if not alive:
            with contextlib.suppress(OSError):
                path.unlink()
