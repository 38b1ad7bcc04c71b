"""Shared-memory segments a trainer staged a save into (same host only).

The client creates ``<shm_dir>/strata-<instance>-<n>``, copies its tensors
into it and sends only a header naming it. The sidecar maps the file read-only
and unlinks it at once: from then on the memory lives exactly as long as one of
the two processes maps it, so a crashed trainer leaves nothing behind in the
tmpfs, and the sidecar's mapping keeps the committed snapshot readable after
the trainer is gone (REFT's process that outlives the trainer).

The mapping is cached by name, because the client reuses its segments for
every save: mapping a GiB again would fault every page in once more.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import mmap
import os
import re
import stat
import threading
from collections import OrderedDict
from pathlib import Path

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
        self._maps: dict[object, OrderedDict[str, mmap.mmap]] = {}

    def view(self, name: str, size: int, owner: object) -> memoryview:
        """A read-only view of the first ``size`` bytes of segment ``name`` of ``owner`` (a rank)."""
        if not self.directory:
            raise FailedPrecondition("this sidecar does not accept shared-memory saves (--shm-dir is empty)")
        if not _NAME.fullmatch(name):
            raise InvalidArgument(f"shared segment name {name!r} must match {SHM_NAME_PATTERN}")
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
                    maps.popitem(last=False)
            maps.move_to_end(name)
        if size > len(mapped):
            raise InvalidArgument(
                f"shared segment {name} holds {len(mapped)} bytes; the save declares {size}"
            )
        return memoryview(mapped)[:size]

    def _map(self, name: str) -> mmap.mmap:
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
            mapped = mmap.mmap(fd, info.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            os.unlink(path)  # ours now: the memory goes when the last mapping does
        except OSError as exc:
            log.warning("could not unlink shared segment %s: %s", path, exc)
        return mapped

    def _sweep(self, maps: OrderedDict[str, mmap.mmap], instance: str) -> None:
        """Forget an instance's mappings and unlink any segment of it never mapped (the spare
        a crashed trainer had warmed up)."""
        for name in [n for n in maps if n.rsplit("-", 1)[0] == instance]:
            del maps[name]
        for path in Path(self.directory).glob(f"{glob.escape(instance)}-*"):
            with contextlib.suppress(OSError):
                path.unlink()

    def close(self) -> None:
        with self._lock:
            for maps in self._maps.values():
                for instance in {n.rsplit("-", 1)[0] for n in maps}:
                    self._sweep(maps, instance)
            self._maps.clear()
