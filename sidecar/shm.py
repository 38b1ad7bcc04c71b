"""Shared-memory segments a trainer staged a save into (same host only).

The client creates its segments as memfds, allocated and faulted in whole, then sealed against
shrinking, growing and writes other than through its own mapping (``F_SEAL_SHRINK |
F_SEAL_GROW | F_SEAL_FUTURE_WRITE``), hands each one to the sidecar over its handover socket
in the shm dir (SCM_RIGHTS), copies its tensors into them and sends only a header naming
one. The sidecar maps a handed-over segment read-only only when its seals say the trainer can
never take a page back nor punch a hole, and it has no hole (a read fault there would
allocate a page charged to the sidecar), so a read of it never faults (a SIGBUS would take
down every job this sidecar serves) nor allocates; what the trainer writes into it after a
save is caught by the digests (the committed snapshot's segment is checked before a memory
restore). A restarted trainer restores from the held segment without a copy: the sidecar
lends it a descriptor of it on the same socket, under a one-time name (``strata-fd-...``).
A restore the sidecar assembles (or a held segment it cannot lend) is a memfd it writes with
``pwrite`` and seals against writes (``F_SEAL_WRITE``, which no one can lift), lent the same
way; only without a handover socket is it a file (``strata-held-p<pid>-r<random>``).

Older clients (or a host without memfd) create ``<shm_dir>/strata-<instance>-<n>``
files instead. A file can be truncated by its writer at any time, so the
sidecar never maps one: it opens it without blocking (a FIFO under the name
must not hang anyone), takes it over under a name of its own
(``strata-held-p<pid>-<instance>-<n>``, freeing the trainer's name) and copies
each save out of it with ``pread`` into memory of its own; a file that shrank
fails that save, and nothing else.

Segments are cached by name per rank, because the client reuses its segments for
every save. Of the names this sidecar took over or created, it removes its own: when
the rank's successor saves, when the sidecar stops, and (held names of sidecars
that are gone) when the next one starts. Files still under a trainer's names are
removed only once their owner is proven gone (``sidecar.api.shm_owners``: the lock it
held is free): when a trainer's Attach stream ends, at start and at stop. Memfds handed
over and never saved from are dropped with their handover connection.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import logging
import mmap
import os
import re
import resource
import selectors
import socket
import stat
import struct
import termios
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

from sidecar.api import SHM_HANDOVER_SOCKET, SHM_LENT_PATTERN, SHM_SEGMENT_PATTERN
from sidecar.api.shm_owners import remove_orphans
from sidecar.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)
_SEGMENT = re.compile(SHM_SEGMENT_PATTERN)
_SOCKET = re.compile(SHM_HANDOVER_SOCKET)
#: a held name: ``strata-held-p<pid>.<token>-...`` (see Segments._id)
#: not in every Python's fcntl (Linux 5.1+): writes through new descriptors and mappings, and
#: hole punching, fail; the writer's existing writable mapping keeps working
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
_SEALED_COPY = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_LENT = re.compile(SHM_LENT_PATTERN)
_HELD = re.compile(r"strata-held-p(([0-9]{1,10})\.[0-9a-f]{1,40})-[A-Za-z0-9._-]{1,200}")


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


class Segment:
    """What a save's segment name stands for: a sealed memfd mapped here (``mapped``, read in
    place), or a file of an older client (``fd``, copied out at each save: never mapped)."""

    def __init__(self, name: str, mapped: FdMapping | None = None, fd: int = -1, held: str = "") -> None:
        self.name, self.mapped, self.fd, self.held = name, mapped, fd, held
        if fd >= 0:  # closed once no save reads it any more (not while one does)
            weakref.finalize(self, os.close, fd)

    @property
    def in_place(self) -> bool:
        return self.mapped is not None

    def view(self, size: int) -> memoryview:
        """The first ``size`` bytes of a mapped segment, read-only."""
        assert self.mapped is not None
        if size > len(self.mapped):
            raise InvalidArgument(
                f"shared segment {self.name} holds {len(self.mapped)} bytes; the save declares {size}"
            )
        return memoryview(self.mapped)[:size]

    def read_into(self, buffer: memoryview, size: int) -> None:
        """Copy the first ``size`` bytes of a file segment into ``buffer``; InvalidArgument
        naming the segment when it holds fewer (its trainer shrank it)."""
        have = os.fstat(self.fd).st_size
        if have < size:
            raise InvalidArgument(
                f"shared segment {self.name} shrank to {have} bytes; the save declares {size}"
            )
        pos = 0
        while pos < size:
            n = os.preadv(self.fd, [buffer[pos:size]], pos)
            if n <= 0:
                raise InvalidArgument(
                    f"shared segment {self.name} shrank to {pos} bytes while the sidecar read it; "
                    f"the save declares {size}"
                )
            pos += n


#: segments a rank may have handed over beyond ``per_owner`` for saves not (yet) admitted
_UNADMITTED = 2


class Segments:
    """Client segments by name, at most ``per_owner`` per rank.

    A client stages into one segment or two (``STRATA_STAGING_BUFFERS``); a restarted client brings new
    ones, and its predecessor's are dropped. A snapshot holds a memoryview of a
    mapped segment, which keeps the mapping alive after it leaves this cache;
    dropping a name only stops reuse.
    """

    def __init__(self, directory: str, per_owner: int = 2, socket_mode: int = 0o600, tag: str = "") -> None:
        """``tag``: names this sidecar's handover socket in the shm dir, the same across its
        restarts (clients reconnect to it) and apart from other sidecars' sharing the directory
        (see :func:`socket_tag`); a random one without."""
        self.directory = directory
        self._per_owner = per_owner
        self._lock = threading.Lock()
        self._maps: dict[object, OrderedDict[str, Segment]] = {}
        with _LIVE_LOCK:
            # The PID, and a token: a restarted container's sidecar may get its predecessor's PID.
            self._id = f"{os.getpid()}.{next(_IDS)}{uuid.uuid4().hex[:6]}"
            _LIVE.add(self._id)
        self._prefix = f"strata-held-p{self._id}-"
        self._handover: Handover | None = None
        if directory:
            _remove_stale_held(directory)
            self.remove_orphans()
            try:
                tag = tag or uuid.uuid4().hex[:16]
                self._handover = Handover(directory, f".strata-segments-{tag}.sock", socket_mode)
            except OSError as exc:
                log.warning("shared-memory segments are taken as files only (copied at each save): %s", exc)

    @property
    def handover(self) -> str:
        """The name of the socket in the shm dir trainers hand segments over on as sealed memfds
        (capability ``save.shm.fd=<name>``), or "" where there is none."""
        return os.path.basename(self._handover.path) if self._handover is not None else ""

    def on_drop(self, drop: Callable[[str, object], str]) -> None:
        """``drop(name, owner)`` gives up what is held in segment ``name`` of rank ``owner`` when
        its trainer asks to stage into it again (SHM_STAGING_CAPABILITY): "" once done, else why
        not. Where it is not done, the trainer stages into a new segment and never this one again:
        it leaves the cache (its mapping lives as long as the snapshot held in it)."""
        if self._handover is not None:
            self._handover.on_drop = lambda name, inode: self._drop(drop, name, inode)

    def _drop(self, drop: Callable[[str, object], str], name: str, inode: tuple[int, int]) -> str:
        with self._lock:
            owner = next(
                (o for o, m in self._maps.items() if name in m and _inode(m[name]) == inode),
                None,
            )
        if owner is None:  # no save named this connection's segment: nothing is held in it
            return ""
        why = drop(name, owner)
        if why:
            with self._lock:
                maps = self._maps.get(owner)
                if maps is not None and name in maps:
                    self._forget(maps.pop(name))
        return why

    def held_name(self, name: str) -> str | None:
        """What a restoring trainer reads segment ``name``'s bytes from without a copy: a memfd
        segment lent back on the handover socket (a one-time name, SHM_LENT_PATTERN), or None
        (a file segment is copied at each save: its bytes are handed over in a copy)."""
        with self._lock:
            found = next((m[name] for m in self._maps.values() if name in m), None)
        if found is None or found.mapped is None or self._handover is None:
            return None
        return self._handover.lend(found.mapped)

    def remove_orphans(self) -> None:
        """Remove the segment files of trainers that are gone (their owner lock is free)."""
        if self.directory and (removed := remove_orphans(self.directory)):
            log.info("removed %d shared segment(s) of trainers that are gone: %s", len(removed), removed)

    def trainer_gone(self) -> None:
        """A trainer's connection ended: remove its segment files once its lock is free, a moment
        later (a dying process closes its descriptors one by one: the lock may outlast the
        connection)."""
        if self.directory:
            timer = threading.Timer(1.0, self.remove_orphans)
            timer.daemon = True
            timer.start()

    def acquire(self, name: str, owner: object) -> Segment:
        """Segment ``name`` of ``owner`` (a rank). Never blocks on the name (the caller holds no
        lock shared by other jobs): a memfd was handed over, a file is opened without blocking."""
        if not self.directory:
            raise FailedPrecondition("this sidecar does not accept shared-memory saves (--shm-dir is empty)")
        if _SEGMENT.fullmatch(name) is None:
            raise InvalidArgument(
                f"shared segment name {name!r} must be strata-<instance>-<n> ({SHM_SEGMENT_PATTERN}: "
                "the instance letters and digits, n a number)"
            )
        with self._lock:
            known = self._maps.get(owner)
            found = known.get(name) if known is not None else None
        if found is None:
            handed = self._handover.claim(name) if self._handover is not None else None
            found = Segment(name, mapped=map_fd(*handed)) if handed is not None else self._take_file(name)
        with self._lock:
            if any(name in m for o, m in self._maps.items() if o != owner):
                raise InvalidArgument(f"shared segment {name} is another rank's")
            maps = self._maps.setdefault(owner, OrderedDict())
            segment = maps.setdefault(name, found)
            maps.move_to_end(name)
            # Bounded before the save is admitted too: a client whose saves are all refused
            # cannot make the sidecar hold its segments without limit.
            while len(maps) > self._per_owner + _UNADMITTED:
                self._forget(maps.popitem(last=False)[1])
        return segment

    def admitted(self, name: str, owner: object) -> None:
        """Segment ``name`` of ``owner`` carries an admitted save: a predecessor's segments are
        done (a restarted trainer), and no more than ``per_owner`` are kept. Not on acquire: a
        save that is then refused (the rank holds enough snapshots) must not take the segments
        the rank's saves in flight use."""
        instance = _instance(name)
        with self._lock:
            maps = self._maps.get(owner)
            if maps is None:
                return
            for old in {_instance(n) for n in maps} - {instance}:
                self._sweep(maps, old)
            while len(maps) > self._per_owner:
                self._forget(maps.popitem(last=False)[1])

    def _take_file(self, name: str) -> Segment:
        """An older client's segment file, opened without following a link or blocking (a FIFO
        or device under the name is refused, not waited on), and taken over under our name."""
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except FileNotFoundError:
            raise FailedPrecondition(
                f"shared segment {name} was not handed over and is not in {self.directory} (a sidecar "
                "restart forgets segments; the trainer creates new ones)"
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
        held = self._prefix + name.removeprefix("strata-")
        try:  # ours now, under our name (the trainer's name is free for its next segment)
            os.rename(path, os.path.join(self.directory, held))
        except OSError as exc:
            log.warning("could not take over shared segment %s: %s", path, exc)
            held = ""
        return Segment(name, fd=fd, held=held)

    def handoff(self, blobs: list[memoryview], size: int) -> str:
        """A new segment holding ``blobs`` (``size`` bytes) for a restoring trainer to copy from;
        its name. Where there is a handover socket, a memfd written here (never through a writable
        mapping) and sealed against writes, shrinking and growing, lent under a one-time name
        (SHM_LENT_PATTERN): nobody can change or truncate its bytes, nor rename anything over it.
        Else a file in the directory, which the trainer removes (and must not map: its bytes are
        anyone's who can write the directory). OSError (no room) leaves nothing behind."""
        if self._handover is None:
            return self._handoff_file(blobs, size)
        fd = os.memfd_create("strata-restore", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, max(1, size))  # no room fails now, not as a fault later
            _write_all(fd, blobs)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALED_COPY)
        except BaseException:
            os.close(fd)
            raise
        return self._handover.lend_fd(fd)

    def restore_buffer(self, size: int) -> RestoreBuffer | None:
        """A new memfd of ``size`` bytes that a restore is read straight into and then lent
        (:meth:`lend_buffer`) with no copy; None where segments are not lent over a socket.
        OSError when there is no room."""
        if self._handover is None:
            return None
        return RestoreBuffer(size)

    def lendable_files(self) -> int:
        """The most descriptors one restore may lend (:meth:`lend_files`): 0 where nothing is
        lent over a socket; a sixteenth of what may be lent at once, so many ranks restore
        together (a step of more objects is read into a sealed copy instead)."""
        return 0 if self._handover is None else max(1, self._handover.max_lent // 16)

    def lend_files(self, fds: list[int]) -> str:
        """Lend ``fds`` (now this object's: read-only descriptors of a restore's object files) under
        one name; OSError (closed) where there is no handover socket or they are too many."""
        if self._handover is None:
            _close_fd(list(fds))
            raise OSError("no handover socket to lend files on")
        return self._handover.lend_fds(fds, files=True)

    def lend_buffer(self, buffer: RestoreBuffer) -> str:
        """Seal ``buffer`` (a seal against writes needs no writable
        mapping left) and lend it, as :meth:`handoff` lends its copy; OSError (nothing lent, the
        buffer still usable) where it cannot be sealed."""
        if self._handover is None:
            raise OSError("no handover socket to lend a restore buffer on")
        return self._handover.lend_fd(buffer.seal())

    def _handoff_file(self, blobs: list[memoryview], size: int) -> str:
        name = f"{self._prefix}r{uuid.uuid4().hex[:16]}"
        path = os.path.join(self.directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(1, size))  # ENOSPC now, not as a SIGBUS later
            _write_all(fd, blobs)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        return name

    def remove(self, name: str) -> None:
        """Drop a handed-over segment: a lent one is withdrawn, a file removed."""
        if _LENT.fullmatch(name) and self._handover is not None:
            self._handover.withdraw(name)
            return
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.directory, name))

    def pending(self, name: str) -> bool:
        """Whether the trainer has yet to take a handed-over segment: a lent one is not yet
        fetched (nor expired), a file is still there (the trainer removes it once read)."""
        if _LENT.fullmatch(name) and self._handover is not None:
            return self._handover.lent(name)
        return os.path.exists(os.path.join(self.directory, name))

    def _forget(self, segment: Segment) -> None:
        if segment.held:  # the file we took over (its descriptor closes with its last save)
            self.remove(segment.held)

    def _sweep(self, maps: OrderedDict[str, Segment], instance: str) -> None:
        """Forget an instance's segments (only ever what this sidecar took over)."""
        for name in [n for n in maps if _instance(n) == instance]:
            self._forget(maps.pop(name))

    def close(self) -> None:
        if self._handover is not None:
            self._handover.close()
        with self._lock:
            for maps in self._maps.values():
                for instance in {_instance(n) for n in maps}:
                    self._sweep(maps, instance)
            self._maps.clear()
        self.remove_orphans()
        with _LIVE_LOCK:
            _LIVE.discard(self._id)


def _inode(segment: Segment) -> tuple[int, int] | None:
    """The device and inode of a mapped segment's memfd (None for a file segment)."""
    if segment.mapped is None:
        return None
    info = os.fstat(segment.mapped.fd)
    return info.st_dev, info.st_ino


def _instance(name: str) -> str:
    """The client instance of a name that matched SHM_SEGMENT_PATTERN."""
    return name.split("-")[1]


class Handover:
    """The socket trainers hand their sealed memfd segments over on (``SHM_HANDOVER_CAPABILITY``).

    One thread serves every connection, without blocking on any: a message is one name and one
    descriptor, checked (a memfd without holes, sealed against shrinking, growing and new
    writes) and kept until a save names it (:meth:`claim`), at most ``MAX_PENDING`` per
    connection (the oldest is dropped), and dropped with its connection. What it may hold open
    (connections, their pending descriptors, lent ones) is at most a quarter of the process's
    open-files limit, so a client opening connections cannot starve the rest of the sidecar.
    """

    MAX_PENDING = 8
    #: names a connection handed over that it may ``drop`` (the newest)
    MAX_HANDED = 64
    MAX_CONNECTIONS = 1024
    #: descriptors lent at once, all names together (a restore from files lends one per object)
    MAX_LENT = 4096
    #: descriptors one answer to ``get`` carries (the kernel's SCM_MAX_FD is 253); more follow
    #: in further messages
    FDS_PER_MESSAGE = 200
    LEND_S = 120.0
    _NEEDED = (
        ("F_SEAL_SHRINK", fcntl.F_SEAL_SHRINK),
        ("F_SEAL_GROW", fcntl.F_SEAL_GROW),
        ("F_SEAL_FUTURE_WRITE", F_SEAL_FUTURE_WRITE),
    )

    def __init__(self, directory: str, name: str, socket_mode: int) -> None:
        if not hasattr(os, "memfd_create"):
            raise OSError("this platform has no memfd_create")
        self.path = os.path.join(directory, name)
        self._listener = _listen(self.path, socket_mode)
        self._inode = os.stat(self.path).st_ino
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[int, int, socket.socket]] = {}  # name -> fd, size, connection
        self._by_conn: dict[socket.socket, list[str]] = {}
        #: per connection, the names it handed over and their memfds' device and inode (it alone
        #: may ``drop`` them, and only the segment it handed over under that name)
        self._handed: dict[socket.socket, list[tuple[str, tuple[int, int]]]] = {}
        #: gives the committed snapshot held in a segment up (``drop``): "" once done, else why not
        self.on_drop: Callable[[str, tuple[int, int]], str] | None = None
        #: drops run here, off the selector thread (one may hash a snapshot); their connections
        #: are read again once answered (``_rearm``)
        self._drops = ThreadPoolExecutor(2, thread_name_prefix="strata-shm-drop")
        self._rearm: list[socket.socket] = []
        #: one-time names of what is lent to restoring trainers: read-only fds, expiry
        self._lent: OrderedDict[str, tuple[list[int], float]] = OrderedDict()
        #: names lent as files (not sealed memfds): given only to a trainer that cannot write them
        self._files: set[str] = set()
        self._lent_fds = 0
        self._prefix = "strata-fd-" + name.removeprefix(".strata-segments-").removesuffix(".sock") + "-"
        assert _SOCKET.fullmatch(name), name
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self.max_lent, self.max_connections = self.fd_limits(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self._thread = threading.Thread(target=self._serve, name="strata-shm-handover", daemon=True)
        self._thread.start()

    @classmethod
    def fd_limits(cls, nofile: int) -> tuple[int, int]:
        """The most lent descriptors and connections for an open-files limit of ``nofile``: a
        connection holds itself and up to ``MAX_PENDING`` descriptors; all of them together at
        most a quarter of the limit (``RLIM_INFINITY``: the class's maxima)."""
        if nofile == resource.RLIM_INFINITY or nofile < 0:
            return cls.MAX_LENT, cls.MAX_CONNECTIONS
        share = nofile // 4
        lent = max(1, min(cls.MAX_LENT, share // 4))
        connections = max(1, min(cls.MAX_CONNECTIONS, (share - lent) // (1 + cls.MAX_PENDING)))
        return lent, connections

    def claim(self, name: str) -> tuple[int, int] | None:
        """The descriptor and size of segment ``name``, now the caller's; None if not handed over."""
        with self._lock:
            entry = self._pending.pop(name, None)
            if entry is None:
                return None
            self._by_conn[entry[2]].remove(name)
        return entry[0], entry[1]

    def lend(self, mapped: FdMapping) -> str | None:
        """A one-time name under which a trainer gets a read-only descriptor of ``mapped``'s
        segment on this socket; None where it cannot be reopened read-only."""
        try:
            fd = os.open(f"/proc/self/fd/{mapped.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            log.info("cannot lend a held segment read-only (%s); a restore gets a copy", exc)
            return None
        return self.lend_fd(fd)

    def lend_fd(self, fd: int) -> str:
        """A one-time name under which a trainer gets ``fd`` (now this object's) on this socket."""
        return self.lend_fds([fd])

    def lend_fds(self, fds: list[int], files: bool = False) -> str:
        """A one-time name under which a trainer gets ``fds`` (now this object's), in order, on
        this socket; the oldest names lent go first where there would be more than ``max_lent``
        descriptors. OSError (the descriptors closed) when ``fds`` alone are more. ``files``:
        read-only descriptors of files, given only where :func:`lend_refusal` finds no reason not to."""
        if not 0 < len(fds) <= self.max_lent:
            _close_fd(list(fds))
            raise OSError(errno.EMFILE, f"{len(fds)} descriptors to lend; at most {self.max_lent} at once")
        name = self._prefix + uuid.uuid4().hex
        now = time.monotonic()
        with self._lock:
            self._expire_locked(now)
            while self._lent and self._lent_fds + len(fds) > self.max_lent:
                self._close_locked(self._lent.popitem(last=False)[1][0])
            self._lent[name] = (list(fds), now + self.LEND_S)
            self._lent_fds += len(fds)
            if files:
                self._files.add(name)
        return name

    def _close_locked(self, fds: list[int]) -> None:
        self._files.intersection_update(self._lent)
        self._lent_fds -= len(fds)
        _close_fd(fds)

    def lent(self, name: str) -> bool:
        """Whether ``name`` is still lent: neither fetched by a trainer nor expired nor withdrawn."""
        with self._lock:
            self._expire_locked(time.monotonic())
            return name in self._lent

    def withdraw(self, name: str) -> None:
        """Stop lending ``name`` (a trainer that has its descriptor already keeps it)."""
        with self._lock:
            entry = self._lent.pop(name, None)
            if entry is not None:
                self._close_locked(entry[0])

    def _expire_locked(self, now: float) -> None:
        for name in [n for n, (_, until) in self._lent.items() if until < now]:
            self._close_locked(self._lent.pop(name)[0])

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(10)
        self._drops.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for fds, _ in self._lent.values():
                self._close_locked(fds)
            self._lent.clear()
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._inode:  # still ours, not a successor's
                os.unlink(self.path)

    def _serve(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._selector.select():
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._rearm_answered()
                    else:
                        self._receive(key.fileobj)  # type: ignore[arg-type]
        except Exception:  # never expected: the sidecar goes on, taking segment files only
            log.exception("the shared-memory handover socket stopped")
        finally:
            with self._lock:
                for conn in list(self._by_conn):
                    self._drop_locked(conn)
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()
            self._selector.close()

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        with self._lock:
            if len(self._by_conn) >= self.max_connections:
                conn.close()
                return
            self._by_conn[conn] = []
        conn.setblocking(False)
        self._selector.register(conn, selectors.EVENT_READ)

    def _receive(self, conn: socket.socket) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(conn, 256, 4)
        except BlockingIOError:
            return
        except OSError:
            data, fds, flags = b"", [], 0
        if not data and not fds:  # the trainer closed it (or it broke)
            with self._lock:
                self._drop_locked(conn)
            return
        lent: list[int] = []
        if data.startswith(b"get ") and not fds and _unread(conn):
            answer = "error: read the previous answer on this connection first"
        elif data.startswith(b"get ") and not fds:
            answer, lent = self._give(data[4:].decode("ascii", "replace"), conn)
        elif data.startswith(b"drop ") and not fds:
            # Not a message more from this connection until it is answered.
            self._selector.unregister(conn)
            self._drops.submit(self._answer_drop, data[5:].decode("ascii", "replace"), conn)
            return
        else:
            answer = self._take(data, fds, flags, conn)
        try:
            if not lent:
                conn.send(answer.encode())
            if len(lent) > 1:  # every message says how many come in all
                answer = f"{answer} {len(lent)}"
            for at in range(0, len(lent), self.FDS_PER_MESSAGE):
                socket.send_fds(conn, [answer.encode()], lent[at : at + self.FDS_PER_MESSAGE])
        except OSError:  # a full or broken socket: the trainer learns nothing and saves by file
            with self._lock:
                self._drop_locked(conn)
        finally:
            _close_fd(lent)  # the trainer has its own descriptors now

    def _give(self, name: str, conn: socket.socket) -> tuple[str, list[int]]:
        """What is lent as ``name``: its read-only descriptors, once (the caller sends and closes them)."""
        with self._lock:
            self._expire_locked(time.monotonic())
            entry = self._lent.pop(name, None)
            files = name in self._files
            self._files.discard(name)
            if entry is not None:
                self._lent_fds -= len(entry[0])
        if entry is None:
            return f"error: no segment is lent as {name!r} (it was fetched already, or expired)", []
        if files and (why := lend_refusal(conn)):
            _close_fd(entry[0])
            return f"error: refused: {why}", []
        return "ok", entry[0]

    def _answer_drop(self, name: str, conn: socket.socket) -> None:
        try:
            answer = self._drop(name, conn)
        except Exception as exc:  # never expected: the trainer stages into a new segment
            log.exception("giving up what segment %s holds failed", name)
            answer = f"error: internal error: {type(exc).__name__}"
        try:
            conn.send(answer.encode())
        except OSError:
            with self._lock:
                self._drop_locked(conn)
            return
        with self._lock:
            self._rearm.append(conn)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"r")

    def _rearm_answered(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_r.recv(4096)
        with self._lock:
            conns, self._rearm = self._rearm, []
            for conn in conns:
                if conn in self._by_conn:
                    self._selector.register(conn, selectors.EVENT_READ)

    def _drop(self, name: str, conn: socket.socket) -> str:
        """The trainer stages into segment ``name`` again: what is held in it goes first. Only on
        the connection that handed it over (no one else knows the name, yet it is not a secret),
        and only the memfd it handed over under that name (another connection may hand one over
        under a name a save of another rank already named)."""
        with self._lock:
            inode = next((i for n, i in reversed(self._handed.get(conn, ())) if n == name), None)
        if inode is None:
            return f"error: segment {name!r} was not handed over on this connection"
        if self.on_drop is None:
            return "error: this sidecar does not take segments back"
        why = self.on_drop(name, inode)
        return f"error: {why}" if why else "ok"

    def _take(self, data: bytes, fds: list[int], flags: int, conn: socket.socket) -> str:
        if len(fds) != 1 or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            for fd in fds:
                os.close(fd)
            return f"error: a message carries one segment name and one descriptor (got {len(fds)})"
        fd = fds[0]
        name = data.decode("ascii", "replace")
        why = self._check(name, fd)
        if why:
            os.close(fd)
            return f"error: {why}"
        info = os.fstat(fd)
        size = info.st_size
        with self._lock:
            if name in self._pending or conn not in self._by_conn:
                os.close(fd)
                return f"error: segment {name} was handed over already"
            names = self._by_conn[conn]
            while len(names) >= self.MAX_PENDING:
                os.close(self._pending.pop(names.pop(0))[0])
            names.append(name)
            self._pending[name] = (fd, size, conn)
            handed = self._handed.setdefault(conn, [])
            handed.append((name, (info.st_dev, info.st_ino)))
            del handed[: -self.MAX_HANDED]
        return "ok"

    def _check(self, name: str, fd: int) -> str:
        if not _SEGMENT.fullmatch(name):
            return f"segment name {name!r} must be strata-<instance>-<n> ({SHM_SEGMENT_PATTERN})"
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            return f"segment {name} is not a non-empty memfd"
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        missing = [what for what, bit in self._NEEDED if not seals & bit]
        if missing:
            return (
                f"segment {name} is not sealed with {' and '.join(missing)}: its writer could take "
                "pages from under the sidecar or punch holes in it (create it with "
                "memfd_create(MFD_ALLOW_SEALING), fallocate it, map it, then add "
                "F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE)"
            )
        # A hole would be filled by the sidecar's first read of it, with pages charged to the
        # sidecar's memory (a sparse 64 GiB segment would get it killed); with FUTURE_WRITE no new
        # hole can be punched, so the check holds for the segment's life. (A page fallocated but
        # never touched reads as a hole too: the client faults its pages in before handing over.)
        try:
            hole = os.lseek(fd, 0, os.SEEK_HOLE)
        except OSError:
            hole = 0
        if hole < info.st_size:
            return (
                f"segment {name} has a hole at byte {hole} of {info.st_size}: every page of a segment "
                "must be allocated and faulted in (posix_fallocate, then mmap with MAP_POPULATE) "
                "before it is handed over"
            )
        return ""

    def _drop_locked(self, conn: socket.socket) -> None:
        self._handed.pop(conn, None)
        for name in self._by_conn.pop(conn, []):
            os.close(self._pending.pop(name)[0])
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()


class RestoreBuffer:
    """A restore's bytes in a new memfd, written with pwrite (no writable mapping: a mapping's
    page tables cost about as much again as the pages here), then sealed against writes,
    shrinking and growing and lent: what the trainer maps is what was written here, not a copy.
    Its pages are allocated by the writes themselves: allocating them first (fallocate) costs a
    third as much again on top of the writes, and the room is the memory budget's to find
    before this buffer is made."""

    def __init__(self, size: int) -> None:
        fd = os.memfd_create("strata-restore", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.size = size
        self._fds = [fd]
        self._closer = weakref.finalize(self, _close_fd, self._fds)

    @property
    def fd(self) -> int:
        if not self._fds:
            raise ValueError("the restore buffer was sealed or closed")
        return self._fds[0]

    def write(self, at: int, piece: memoryview) -> None:
        while len(piece):
            n = os.pwrite(self.fd, piece, at)
            at, piece = at + n, piece[n:]

    def read(self, at: int, into: memoryview) -> None:
        pos = 0
        while pos < len(into):
            n = os.preadv(self.fd, [into[pos:]], at + pos)
            if n <= 0:
                raise OSError(f"restore buffer ends at {at + pos} of {self.size} bytes")
            pos += n

    def chunks(self, piece: int = 1 << 20) -> Iterator[memoryview]:
        """The bytes in order, a piece at a time (a restore streamed over gRPC)."""
        for at in range(0, self.size, piece):
            out = memoryview(bytearray(min(piece, self.size - at)))
            self.read(at, out)
            yield out

    @contextlib.contextmanager
    def writable(self) -> Iterator[memoryview]:
        """A writable view of the bytes, its pages mapped as they are touched (a diff writes a
        few rows); unmapped on leaving, which sealing needs."""
        mapped = mmap.mmap(self.fd, max(1, self.size), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        view = memoryview(mapped)
        part = view[: self.size]
        try:
            yield part
        except BaseException:
            # A view the error's traceback still holds keeps the mapping (until it goes): that
            # BufferError must not replace the error itself.
            with contextlib.suppress(BufferError):
                _unmap(part, view, mapped)
            raise
        _unmap(part, view, mapped)  # BufferError if a view escaped: then nothing can be sealed

    def seal(self) -> int:
        """Seal the memfd and hand its descriptor over (the caller's now)."""
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALED_COPY)
        self._closer.detach()
        return self._fds.pop()

    def close(self) -> None:
        self._closer()


def lend_refusal(conn: socket.socket) -> str:
    """Why the process on the other end of ``conn`` must not be lent a checkpoint's files: "" if
    it may.

    A lent file is not sealed the way a memfd is: whoever holds its descriptor can try to reopen
    it read-write through /proc/self/fd, and root, a process with CAP_DAC_OVERRIDE or CAP_FOWNER,
    or one handed the descriptors by another, gets through whatever the file's mode says (peer
    credentials are the connecting process's at connect time, and say nothing of capabilities).
    So files go only where that adds nothing: to a process in this process's mount namespace
    (local processes), which reaches the same files by path with the same rights. A trainer in a
    container of its own gets the sealed copy instead."""
    try:
        pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    except OSError as exc:
        return f"the trainer's credentials cannot be read ({exc.strerror})"
    if not _same_mounts(pid):
        return (
            "the trainer runs in another mount namespace (a container of its own): "
            "files are lent to local processes only"
        )
    return ""


def _unread(conn: socket.socket) -> bool:
    """Whether the trainer has not yet read an earlier answer on ``conn`` (descriptors in flight
    count against this process's open-files limit until they are read)."""
    try:
        return struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0] > 0
    except OSError:
        return False


def _same_mounts(pid: int) -> bool:
    """Whether process ``pid`` (as this process sees it) shares this process's mount namespace."""
    try:
        return pid > 0 and os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino
    except OSError:  # not visible here, or not ours to inspect
        return False


def _unmap(part: memoryview, view: memoryview, mapped: mmap.mmap) -> None:
    part.release()
    view.release()
    mapped.close()


def _close_fd(fds: list[int]) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())


def _write_all(fd: int, blobs: list[memoryview]) -> None:
    pos = 0
    for blob in blobs:
        while len(blob):
            n = os.pwrite(fd, blob, pos)
            pos, blob = pos + n, blob[n:]


def socket_tag(grpc_socket: str) -> str:
    """The tag of the handover socket of the sidecar serving ``grpc_socket``."""
    return hashlib.sha256(os.path.abspath(grpc_socket).encode()).hexdigest()[:16]


def _listen(path: str, mode: int) -> socket.socket:
    """A listening SOCK_SEQPACKET socket at ``path``: one a sidecar that is gone left there is
    replaced, a live one (another sidecar on this gRPC socket) or anything else is not (OSError)."""
    if os.path.lexists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.settimeout(1)
            probe.connect(path)
        except ConnectionRefusedError:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)  # nobody listens: a sidecar that crashed
        except OSError:
            pass
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(path)  # EADDRINUSE where anything is still there: never replaced
        os.chmod(path, mode)  # what connects can only hand over descriptors, which are checked
        sock.listen(64)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


#: the Segments of this process (several sidecars run in one process in tests)
_LIVE: set[str] = set()
_LIVE_LOCK = threading.Lock()
_IDS = itertools.count()


def _remove_stale_held(directory: str) -> None:
    """Held segments of sidecars that are gone (a crash, or this process's predecessor in a
    restarted container, which may have had the same PID)."""
    for path in Path(directory).glob("strata-held-p*"):
        held = _HELD.fullmatch(path.name)
        if held is None:
            continue
        owner, pid = held.group(1), int(held.group(2))
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
