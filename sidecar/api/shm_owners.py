"""Proof that the trainer which created segment files in the shm dir is gone, and their removal.

A client that stages into files (``strata-<instance>-<n>``, SHM_SEGMENT_PATTERN) first creates
``.strata-owner-<instance>`` (SHM_OWNER_PATTERN) in the same directory and holds an exclusive
``flock`` on it for as long as any of its files may be used. The kernel drops that lock when the
last descriptor of it closes, however the trainer dies (SIGKILL, OOM kill) and only then: a
forked child that inherited it keeps it. So whoever takes the lock knows its owner is gone, and
removes the owner's files still under its names (a file the sidecar took over is renamed, and
the sidecar's) and then the lock file: the trainer's successor when it starts, and the sidecar
(see ``sidecar.shm.Segments.remove_orphans``). A name proves nothing by itself: only files owned
by the lock file's own user are removed, and the files of a client that holds no such lock (an
older one) never are.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import time
import weakref

from sidecar.api import SHM_SEGMENT_PATTERN

SHM_OWNER_PATTERN = r"\.strata-owner-([A-Za-z0-9]{1,64})"
_OWNER = re.compile(SHM_OWNER_PATTERN)
_SEGMENT = re.compile(SHM_SEGMENT_PATTERN)


class OwnerLock:
    """``.strata-owner-<instance>`` in ``directory``, created and locked (OSError if it cannot
    be): the proof that this process's ``strata-<instance>-<n>`` files are in use."""

    def __init__(self, directory: str, instance: str) -> None:
        self.path = os.path.join(directory, f".strata-owner-{instance}")
        assert _OWNER.fullmatch(os.path.basename(self.path)), instance
        for attempt in range(50):
            try:
                fd = os.open(
                    self.path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
                )
            except FileExistsError:
                # A sweeper took our new file's lock before we did and has not unlinked it yet:
                # it will, at once (the instance is ours alone), so wait a moment and create it.
                time.sleep(0.002 * (attempt + 1))
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # A sweeper that opened it between our create and our lock saw no owner and
                # removed it (holding the lock, so it is gone by now): create it again.
                if os.lstat(self.path).st_ino == os.fstat(fd).st_ino:
                    self.fd = fd
                    self._closer = weakref.finalize(self, os.close, fd)
                    return
            except OSError:
                pass
            os.close(fd)
        raise OSError(f"could not create and lock {self.path}")

    def release(self) -> None:
        """Remove the lock file (this client's files are gone) and drop the lock."""
        if self._closer.alive:
            with contextlib.suppress(OSError):
                if os.lstat(self.path).st_ino == os.fstat(self.fd).st_ino:
                    os.unlink(self.path)
            self._closer()


def remove_orphans(directory: str) -> list[str]:
    """Remove the segment files (and owner files) in ``directory`` whose owner is gone; the
    segment names removed. Never blocks: an owner lock held is skipped, not waited on."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    by_instance: dict[str, list[str]] = {}
    for name in names:
        if found := _SEGMENT.fullmatch(name):
            by_instance.setdefault(found.group(1), []).append(name)
    removed: list[str] = []
    for name in names:
        if found := _OWNER.fullmatch(name):
            removed += _remove_if_gone(directory, name, by_instance.get(found.group(1), []))
    return removed


def _remove_if_gone(directory: str, owner: str, segments: list[str]) -> list[str]:
    path = os.path.join(directory, owner)
    try:  # never a FIFO's open that blocks, nor a symlink followed
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return []
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return []
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its owner lives
            return []
        removed = []
        for name in segments:
            segment = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                found = os.lstat(segment)
                # The owner's own files only: an owner file someone else made for a name proves
                # nothing about the files of the user who chose that name.
                if stat.S_ISREG(found.st_mode) and found.st_uid == info.st_uid:
                    os.unlink(segment)
                    removed.append(name)
        with contextlib.suppress(OSError):
            if os.lstat(path).st_ino == info.st_ino:  # last: a crash before leaves it to retry
                os.unlink(path)
        return removed
    finally:
        os.close(fd)
