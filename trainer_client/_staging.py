"""Host staging buffers: allocated and pre-faulted once, reused by every save.

The training thread's stall is the copy into these buffers and nothing else.
One flat uint8 buffer holds every tensor at a 64-byte aligned offset (so dtype
views are legal); it is pinned when any tensor lives on a GPU. The layout is
rebuilt only when the set of tensors changes (e.g. an optimizer creating its
state lazily after the first step).
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import itertools
import logging
import mmap
import os
import re
import socket
import threading
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sidecar.api import SHM_LENT_PATTERN
from sidecar.api.dtypes import ITEMSIZE
from sidecar.api.shm_owners import OwnerLock, remove_orphans

log = logging.getLogger("strata.client")

_ALIGN = 64


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint holds dtype {name!r}, which this torch build does not know")
    return dtype


@dataclass(frozen=True)
class Slot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int


#: not in every Python's fcntl (Linux 5.1+)
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)


class SharedSegment:
    """Shared memory the client stages saves into and the sidecar reads.

    With ``handover`` (a sidecar that takes them, ``save.shm.fd``) a memfd, fully allocated and
    sealed against shrinking, growing and any write but through this client's own mapping, handed
    to the sidecar over its socket: the sidecar maps only what its writer can never take back.
    Otherwise a file in the sidecar's tmpfs, which the sidecar takes over (renames) and copies at
    each save; ``owner``, the lock proving its creator alive, is held as long as it lives. Space
    is reserved with fallocate, so too little memory fails here with ENOSPC instead of killing
    the trainer with SIGBUS on first touch.
    """

    def __init__(
        self,
        directory: str,
        name: str,
        size: int,
        handover: Handover | None = None,
        owner: OwnerLock | None = None,
    ) -> None:
        self.name = name
        self.path = "" if handover is not None else os.path.join(directory, name)
        self._owner = owner
        #: the memfd (kept open while the segment lives; None for a file)
        self.fd: int | None = None
        if handover is not None:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        else:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(self.path, flags, 0o600)
        try:
            try:
                if handover is not None:
                    os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if self.path:
                    os.unlink(self.path)
                if exc.errno != errno.ENOSPC:
                    raise
                where = f"the shared-memory directory {directory}" if self.path else "shared memory"
                raise OSError(
                    exc.errno,
                    f"{where} is full: no room for a {size}-byte staging segment. Each rank needs one "
                    f"segment of its snapshot size (two with STRATA_STAGING_BUFFERS=2), and their "
                    f"pages count against the trainer container's memory limit: raise that "
                    f"emptyDir's sizeLimit (or the tmpfs size) and the trainer's memory limit by "
                    f"{size} bytes per segment per rank",
                ) from None
            if handover is not None:
                # Every page faulted in now (zeroed: what the first staging would do anyway), so
                # none reads as a hole (the sidecar refuses a segment with one).
                self._map = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            else:
                self._map = mmap.mmap(fd, size)
            if handover is not None:
                # After our own mapping: it stays writable, while FUTURE_WRITE refuses new writable
                # descriptors' writes and mappings and hole punching (the sidecar requires it: a
                # hole it read would be filled with pages charged to its memory).
                seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
                handover.send(name, fd)
                self.fd = fd
                weakref.finalize(self, os.close, fd)
        finally:
            if self.fd is None:
                os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self._registered = False

    def pin(self) -> None:
        """Page-lock for asynchronous GPU copies (what pin_memory=True does for torch.empty)."""
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.tensor.numel(), 0)
        self._registered = int(err) == 0
        if not self._registered:
            log.warning(
                "could not page-lock shared segment %s (cuda error %s); copies will sync", self.name, err
            )

    def release(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # normally the sidecar took it over already


class Handover:
    """The connection segments are handed to the sidecar on (``SHM_HANDOVER_CAPABILITY``): one
    message per segment, its name and its descriptor; the sidecar answers ``ok`` or why not.
    Segments handed over and not yet saved from live as long as the connection."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def send(self, name: str, fd: int) -> None:
        """Hand ``fd`` over as segment ``name``; OSError when the sidecar cannot be reached or
        refuses it (the answer says why)."""
        with self._lock:
            for attempt in range(2):  # a connection to a sidecar that restarted is dead: once more
                try:
                    if self._sock is None:
                        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
                        conn.settimeout(30)
                        try:
                            conn.connect(self.path)
                        except OSError:
                            conn.close()
                            raise
                        self._sock = conn
                    socket.send_fds(self._sock, [name.encode()], [fd])
                    answer = self._sock.recv(4096)
                except OSError:
                    self.close_locked()
                    if attempt:
                        raise
                    continue
                if not answer:
                    self.close_locked()
                    continue
                if answer != b"ok":
                    raise OSError(
                        f"the sidecar refused shared segment {name}: {answer.decode(errors='replace')}"
                    )
                return
            raise OSError(f"the sidecar closed {self.path} while taking shared segment {name}")

    def drop(self, name: str) -> None:
        """Ask the sidecar to give up what it holds in segment ``name`` before it is staged into
        again; OSError unless it did (the answer says why). Only on the connection the segment
        was handed over on: a new one (the sidecar restarted) is refused, as it should be."""
        with self._lock:
            if self._sock is None:
                raise OSError(f"the connection segment {name} was handed over on is gone")
            try:
                self._sock.send(b"drop " + name.encode())
                answer = self._sock.recv(4096)
            except OSError:
                self.close_locked()
                raise
        if answer != b"ok":
            raise OSError(f"the sidecar kept segment {name}: {answer.decode(errors='replace') or 'closed'}")

    def close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()


def open_segment(directory: str, name: str) -> int:
    """A read-only descriptor of the segment a restore header names: a held segment the sidecar
    lends back on its handover socket (SHM_LENT_PATTERN), else a file in ``directory``. OSError
    when it is not there (any more)."""
    lent = re.fullmatch(SHM_LENT_PATTERN, name)
    if lent is None:
        # O_NONBLOCK: a FIFO put under the name must not hang the restore (it is then refused)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        return os.open(os.path.join(directory, name), flags)
    return fetch_lent(directory, name, 1)[0]


#: descriptors one message on the handover socket may carry (the kernel's SCM_MAX_FD)
_MAX_FDS_PER_MESSAGE = 253


def fetch_lent(directory: str, name: str, count: int) -> list[int]:
    """The ``count`` descriptors the sidecar lends as ``name`` on its handover socket (they may
    come in several messages), now the caller's. OSError when it does not lend them (any more),
    or lends another number."""
    lent = re.fullmatch(SHM_LENT_PATTERN, name)
    if lent is None or count < 1:
        raise OSError(errno.EINVAL, f"{name!r} is not a lent segment")
    got: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as conn:
            conn.settimeout(30)
            conn.connect(os.path.join(directory, f".strata-segments-{lent.group(1)}.sock"))
            conn.send(b"get " + name.encode())
            while len(got) < count:
                answer, fds, _, _ = socket.recv_fds(conn, 4096, _MAX_FDS_PER_MESSAGE, socket.MSG_CMSG_CLOEXEC)
                got.extend(fds)
                said = re.fullmatch(rb"ok(?: ([0-9]{1,9}))?", answer)
                if said is None or not fds:
                    why = answer.decode(errors="replace") or "the connection ended"
                    raise OSError(errno.ENOENT, f"the sidecar did not lend it ({why})")
                total = int(said.group(1) or 1)  # each message says how many come in all
                if total != count or len(got) > count:
                    why = f"the sidecar lends {total} descriptors as {name}, not {count}"
                    raise OSError(errno.EPROTO, why)
    except BaseException:
        for fd in got:
            os.close(fd)
        raise
    return got


class SegmentFactory:
    """Creates this client's segments, ``strata-<instance>-<n>`` with an instance unique per
    client: memfds handed over to the sidecar where it takes them (``handover``: its socket's
    name in the shm dir), else files in the shm dir, which it holds an owner lock for
    (``sidecar.api.shm_owners``). It first removes the files of clients that are gone (a
    predecessor killed before its first save left its spare segments there)."""

    def __init__(self, directory: str, handover: str = "") -> None:
        self.directory = directory
        self.instance = uuid.uuid4().hex[:16]
        self._count = itertools.count()
        self._handover = Handover(os.path.join(directory, handover)) if handover else None
        self._owner: OwnerLock | None = None
        if removed := remove_orphans(directory):
            log.info("removed %d shared segment(s) of trainers that are gone: %s", len(removed), removed)

    def create(self, size: int) -> SharedSegment:
        name = f"strata-{self.instance}-{next(self._count)}"
        if self._handover is not None:
            try:
                return SharedSegment(self.directory, name, size, self._handover)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise
                # The sidecar's socket is gone or refused it: files, which it copies at each save.
                log.warning("shared segments go through files from now on: %s", exc)
                self._handover.close()
                self._handover = None
        if self._owner is None:
            self._owner = OwnerLock(self.directory, self.instance)
        return SharedSegment(self.directory, name, size, owner=self._owner)

    def drop(self, segment: SharedSegment) -> None:
        """``segment`` is staged into again: the sidecar gives up the snapshot it holds in it
        first (a memfd it reads in place); OSError if it does not. A file segment needs nothing:
        the sidecar copied it at the save."""
        if segment.fd is None:
            return
        if self._handover is None:
            raise OSError("segments are no longer handed over")
        self._handover.drop(segment.name)

    def close(self) -> None:
        """Stop handing over; the owner lock goes (the caller released the segments first)."""
        if self._handover is not None:
            self._handover.close()
        if self._owner is not None:
            self._owner.release()
            self._owner = None


class HostBuffers:
    """One staging area. With a ``SegmentFactory`` it lives in shared memory the
    sidecar reads directly (``segment`` names it); otherwise in private memory,
    pinned when tensors live on a GPU."""

    def __init__(self, segments: SegmentFactory | None = None) -> None:
        self._key: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...] | None = None
        self.slots: list[Slot] = []
        self.views: list[torch.Tensor] = []
        self.flat: torch.Tensor | None = None
        self.allocations = 0
        self._segments = segments
        self.segment: SharedSegment | None = None

    @property
    def shared(self) -> bool:
        return self._segments is not None

    def reset(self) -> None:
        """Forget the buffer: the next ``ensure`` allocates a new one (a new segment)."""
        self._key = None
        self.views, self.flat = [], None
        if self.segment is not None:
            self.segment.release()
            self.segment = None

    def _allocate(self, size: int, pin: bool) -> torch.Tensor:
        if self._segments is None:
            return torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        self.segment = self._segments.create(size)
        if pin:
            self.segment.pin()
        return self.segment.tensor

    def fits(self, tensors: list[tuple[str, torch.Tensor]]) -> bool:
        """Laid out for these tensors already (``ensure`` would not allocate)."""
        return self._key is not None and self._key == _layout_key(tensors)

    def ensure(self, tensors: list[tuple[str, torch.Tensor]], pin: bool | None = None) -> bool:
        """Make the buffer fit these tensors; True when it had to (re)allocate. ``pin``: page-lock
        it (default: when a tensor lives on a GPU; given where the tensors are meta ones)."""
        key = _layout_key(tensors)
        if key == self._key:
            return False
        slots, offset = [], 0
        for name, t in tensors:
            if dtype_name(t.dtype) not in ITEMSIZE:
                raise TypeError(
                    f"{name}: dtype {t.dtype} cannot be checkpointed; supported: {', '.join(ITEMSIZE)}"
                )
            nbytes = t.numel() * t.element_size()
            slots.append(Slot(name, t.dtype, tuple(t.shape), nbytes, offset))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        if pin is None:
            pin = any(t.is_cuda for _, t in tensors)
        pin = pin and torch.cuda.is_available()
        self.reset()  # free the old buffer before allocating the new one
        flat = self._allocate(max(offset, 1), pin)
        flat.zero_()  # pre-fault every page now, not during the first timed copy
        self.flat = flat
        self.views = [flat[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in slots]
        self.slots = slots
        self._key = key
        self.allocations += 1
        return True

    @property
    def total_bytes(self) -> int:
        """Bytes of a chunked save: the tensors back to back."""
        return total_bytes(self.slots)

    @property
    def span_bytes(self) -> int:
        """Bytes of a shared-memory save: up to the end of the last tensor, padding included."""
        return span_bytes(self.slots)

    def chunks(self, chunk_bytes: int, slots: list[Slot] | None = None) -> Iterator[bytes]:
        """The bytes of ``slots`` (default: the layout's) packed back to back (no alignment
        padding), in chunks."""
        assert self.flat is not None
        raw = memoryview(self.flat.numpy().data)
        pending: list[memoryview] = []
        size = 0
        for s in self.slots if slots is None else slots:
            pos, end = s.offset, s.offset + s.nbytes
            while pos < end:
                take = min(end - pos, chunk_bytes - size)
                pending.append(raw[pos : pos + take])
                size += take
                pos += take
                if size == chunk_bytes:
                    yield b"".join(pending)
                    pending, size = [], 0
        if pending:
            yield b"".join(pending)


def _layout_key(
    tensors: list[tuple[str, torch.Tensor]],
) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
    return tuple((name, t.dtype, tuple(t.shape)) for name, t in tensors)


def total_bytes(slots: list[Slot]) -> int:
    return sum(s.nbytes for s in slots)


def span_bytes(slots: list[Slot]) -> int:
    return max((s.offset + s.nbytes for s in slots), default=0)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


#: The first slot of a lent buffer's layout: room for what a save sends that was not staged.
ARENA = "\0arena"


def lease_layout(
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]], sent: set[str], arena: int
) -> tuple[list[tuple[str, torch.Tensor]], list[int]]:
    """The layout of a buffer a DCP writer stages into, as meta tensors, and each spec's slot in
    it: the arena first, then the tensors the previous such save sent from where they were staged,
    then the others (those DCP had another rank write). So a save whose plan is the previous one's
    sends one run of bytes, the arena's unused end being its only gap."""
    order = sorted(range(len(specs)), key=lambda i: specs[i][0] not in sent)  # stable
    layout = [(ARENA, torch.empty(arena, dtype=torch.uint8, device="meta"))]
    where = [0] * len(specs)
    for i in order:
        name, dtype, shape = specs[i]
        where[i] = len(layout)
        layout.append((name, torch.empty(shape, dtype=dtype, device="meta")))
    return layout, where


@dataclass
class Placement:
    """Where a save's tensors go in a lent buffer: ``slots`` (in the save's order, offsets
    increasing), the indices of the tensors to copy into the arena, and the names of the layout's
    slots sent as they were staged."""

    slots: list[Slot]
    copies: list[int]
    sent: set[str]


class Lease:
    """A client staging buffer lent to a DCP writer's ``stage()`` (``CheckpointClient._lease``).

    ``views`` are the staged tensors, in the order the writer gave them. The save whose state
    holds them sends them from where they lie (``place``): their bytes are copied once, by
    ``stage()``. Its memory stays valid while a view lives, even once the client has given the
    buffer to another save (a revoked lease): that save then copies from the views."""

    def __init__(
        self,
        index: int,
        bufs: HostBuffers,
        where: list[int],
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        estimate: int,
        pin: bool,
        allocated: bool,
    ) -> None:
        assert bufs.flat is not None
        self.index, self.bufs, self.flat = index, bufs, bufs.flat
        self.views = [bufs.views[w] for w in where]
        self.specs, self.estimate, self.pin, self.allocated = specs, estimate, pin, allocated
        self.layout = list(bufs.slots)
        self._starts = [s.offset for s in self.layout]
        self.arena = self.layout[0].nbytes
        #: aligned bytes the last ``place`` needed in the arena
        self.needed = 0

    @property
    def valid(self) -> bool:
        """The client still holds this buffer as it was lent (not reset or laid out anew)."""
        return self.bufs.flat is self.flat

    def offset(self, t: torch.Tensor) -> int | None:
        """Where ``t``'s bytes lie in the lent buffer, past the arena; None when they do not lie
        there as one contiguous run (not staged, a strided view, a lazy conj/neg view)."""
        try:
            if (
                t.device.type != "cpu"
                or t.layout != torch.strided
                or not t.numel()
                or not t.is_contiguous()
                or t.is_conj()
                or t.is_neg()
                or t.untyped_storage().data_ptr() != self.flat.data_ptr()
            ):
                return None
        except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass without storage
            return None
        off = t.data_ptr() - self.flat.data_ptr()
        if off < self.arena or off + t.numel() * t.element_size() > self.flat.numel():
            return None
        return off

    def place(self, tensors: list[tuple[str, torch.Tensor]]) -> Placement | None:
        """Slots for ``tensors`` in the lent buffer: those lying in it (in increasing order) where
        they lie, the others copied into the arena (they must come first); None when the arena
        is too small (``needed`` says what it takes)."""
        slots: list[Slot] = []
        copies: list[int] = []
        sent: set[str] = set()
        pos, fits, self.needed = 0, True, 0
        for i, (name, t) in enumerate(tensors):
            if dtype_name(t.dtype) not in ITEMSIZE:
                raise TypeError(
                    f"{name}: dtype {t.dtype} cannot be checkpointed; supported: {', '.join(ITEMSIZE)}"
                )
            nbytes = t.numel() * t.element_size()
            off = self.offset(t) if nbytes else pos
            if off is not None and off >= pos:
                slots.append(Slot(name, t.dtype, tuple(t.shape), nbytes, off))
                if nbytes:
                    sent.add(self.layout[bisect.bisect_right(self._starts, off) - 1].name)
                    pos = off + nbytes
                continue
            start = _aligned(pos)
            self.needed += _aligned(nbytes)
            if start + nbytes > self.arena:
                fits = False
                continue
            slots.append(Slot(name, t.dtype, tuple(t.shape), nbytes, start))
            copies.append(i)
            pos = start + nbytes
        return Placement(slots, copies, sent) if fits else None


class Stager:
    """Copies live tensors into the host buffers.

    ``copy(indices)`` runs in the caller's thread; on GPU it only enqueues
    copies on a side stream and records an event, and makes the compute stream
    wait for it, so later in-place updates cannot overtake the copy.
    """

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None
        self.event: torch.cuda.Event | None = None

    def copy(
        self,
        views: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
        tensors: list[tuple[str, torch.Tensor]],
        indices: list[int],
    ) -> None:
        """Copy ``tensors[i]`` into ``views[i]`` for each i of ``indices``."""
        cuda = [i for i in indices if tensors[i][1].is_cuda]
        with torch.no_grad():
            for i in indices:
                if not tensors[i][1].is_cuda:
                    views[i].copy_(tensors[i][1])
            if cuda:
                if self._stream is None:
                    self._stream = torch.cuda.Stream()
                compute = torch.cuda.current_stream()
                self._stream.wait_stream(compute)
                with torch.cuda.stream(self._stream):
                    for i in cuda:
                        views[i].copy_(tensors[i][1], non_blocking=True)
                    self.event = self._stream.record_event()
                compute.wait_stream(self._stream)

    def synchronize(self) -> None:
        """Block until the GPU copies have landed in host memory."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None


def as_numpy_bytes(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 view of a contiguous CPU tensor's memory."""
    return t.reshape(-1).view(torch.uint8).numpy()


class Gate:
    """A reusable "staging finished" flag the optimizer pre-hook waits on."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._event.set()

    def close(self) -> None:
        self._event.clear()

    def open(self) -> None:
        self._event.set()

    def wait(self) -> None:
        self._event.wait()
