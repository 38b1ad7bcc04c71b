"""How a restore's bytes reach the live state: from a shared segment the sidecar lends (a
sealed memfd, or a file from an older sidecar) or over the gRPC stream, each tensor's digest
checked as it is copied (``_verify``), straight into the live tensors where they can take it
(``InPlace``)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import stat
import threading
import warnings
from collections.abc import Iterator, MutableMapping
from typing import Any

import numpy as np
import torch

from sidecar.api import (
    DCP_METADATA_KEY,
    RNG_STATE_KEY,
    SHM_LENT_PATTERN,
    SHM_NAME_PATTERN,
    pb,
    progress,
)
from trainer_client import _tree, _verify
from trainer_client._staging import (
    as_numpy_bytes,
    dtype_name,
    fetch_lent,
    open_segment,
    torch_dtype,
)
from trainer_client.errors import (
    RestoreError,
)

log = logging.getLogger("strata.client")
_RNG_KEY = RNG_STATE_KEY


class SavedThroughDcp(RestoreError):
    """The step was saved through torch.distributed.checkpoint: its snapshots hold DCP's write
    items, not the state's tree, so it loads with ``dcp.load`` (whatever the state holds)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"step {step} was saved through torch.distributed.checkpoint")
        self.step = step


def saved_through_dcp(skeleton: dict[str, Any]) -> bool:
    root = skeleton.get("root")
    return isinstance(root, dict) and DCP_METADATA_KEY in root


def load_target(state: MutableMapping[str, Any], skeleton: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint loads into: the live state, and the RNG states when it captured them."""
    target = dict(state)
    root = skeleton.get("root")
    if isinstance(root, dict) and _RNG_KEY in root:
        target[_RNG_KEY] = None
    return target


class InPlace:
    """The live state's CPU tensors a restore from a shared segment copies into directly.

    Loading copies every tensor into the live state anyway, so a segment restore writes each
    tensor straight to the live one it would be copied into: one copy instead of two, into pages
    already faulted in (fresh tensors cost a page fault per 4 KiB). Only whole, contiguous,
    unshared tensors qualify, and only once the checkpoint is known to fit the state; a restore
    that streams over gRPC keeps fresh tensors, so a broken stream leaves the state untouched.
    """

    def __init__(self, state: MutableMapping[str, Any]) -> None:
        self.state = state

    def targets(self, header: pb.RestoreHeader) -> list[torch.Tensor] | None:
        if header.replicas:  # the skeleton also names other ranks' tensors: the plain path
            return None
        try:
            live = dict(_tree.flatten(dict(self.state)).tensors)
        except _tree.StateError:
            return None
        seen: set[int] = set()
        out: list[torch.Tensor] = []
        for m in header.tensors:
            t = live.get(m.name)
            if t is not None and writable_whole(t, m, seen):
                seen.add(t.data_ptr())
                out.append(t.detach())
            else:
                out.append(torch.empty(tuple(m.shape), dtype=torch_dtype(m.dtype)))
        skeleton = _tree.decode_skeleton(header.tree)
        try:  # refuse before anything live is overwritten, as load_into would after
            _tree.check_fits(load_target(self.state, skeleton), skeleton, out)
        except (TypeError, ValueError) as exc:
            raise RestoreError(f"step {header.step} does not fit this state: {exc}") from exc
        return out


def writable_whole(t: torch.Tensor, meta: pb.TensorMeta, seen: set[int]) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and t.numel() > 0
        and dtype_name(t.dtype) == meta.dtype
        and list(t.shape) == list(meta.shape)
        and t.untyped_storage().nbytes() == t.nbytes  # not a view into a larger buffer
        and t.data_ptr() not in seen
    )


class SegmentGone(Exception):
    pass


class SegmentChanged(SegmentGone):
    """The segment's bytes are not what was saved: the sidecar's own copy, checked, comes over gRPC."""


class FilesUnusable(SegmentGone):
    """Object files lent for a restore that cannot be used: refused to this process, gone, or
    (``changed``) not what was saved. The sidecar then reads them itself, checking each object."""

    def __init__(self, message: str, changed: bool = False, refused: bool = False) -> None:
        super().__init__(message)
        self.changed, self.refused = changed, refused


def from_segment(header: pb.RestoreHeader, shm_dir: str, targets: list[_verify.Target]) -> None:
    """Copy the tensors from the shared segment a restore header names, checking each against
    its digest as it goes. A lent descriptor is mapped only when its seals say no page can be
    taken back (no SIGBUS here), and a copy made for this restore (``shm_handoff``) is trusted
    without digests (lossy tensors have none) only when sealed against writes. A file is never
    mapped (its writer may truncate it): it is read with ``preadv``, a short read meaning it is gone."""
    name = header.shm.name
    if not re.fullmatch(SHM_NAME_PATTERN, name) or not shm_dir:
        raise RestoreError(f"the sidecar named shared segment {name!r}, which is not one")
    if header.shm_files:
        from_files(header, shm_dir, targets)
        return
    try:
        fd = open_segment(shm_dir, name)
    except OSError as exc:
        raise SegmentGone(f"shared segment {name}: {exc.strerror or exc}") from None
    try:
        found = os.fstat(fd)
        size = found.st_size
        if not stat.S_ISREG(found.st_mode):
            raise SegmentChanged(f"shared segment {name} is not a regular file")
        if size < header.total_bytes:
            raise SegmentGone(f"shared segment {name} holds {size} bytes, not {header.total_bytes}")
        if not re.fullmatch(SHM_LENT_PATTERN, name):
            read_file_segment(fd, name, targets)
            return
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        need = fcntl.F_SEAL_SHRINK | (fcntl.F_SEAL_WRITE if header.shm_handoff else 0)
        if seals & need != need:
            raise SegmentChanged(f"shared segment {name} is not sealed against {seal_names(need & ~seals)}")
        if header.shm_handoff:
            # A copy made for this restore, sealed: read with preadv (no page tables to build
            # for a mapping and tear down), and let go of in the background: the last close
            # frees its pages, which need not hold up the restore.
            try:
                bad = _verify.copy_checked(fd, targets)
            except EOFError as exc:
                raise SegmentGone(f"shared segment {name}: {exc}") from None
            freeing = threading.Thread(target=os.close, args=(fd,), name="strata-free", daemon=True)
            freeing.start()
            fd = -1  # the thread's now (closed below if it never started)
        else:
            # Populated at once: one call maps every page instead of a fault per 4 KiB.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            with mmap.mmap(fd, header.total_bytes, flags, mmap.PROT_READ) as mapped:
                source = np.frombuffer(mapped, np.uint8)
                try:
                    with warnings.catch_warnings():  # read-only source: torch only reads it here
                        warnings.simplefilter("ignore", UserWarning)
                        bad = _verify.copy_checked(source, targets)
                finally:
                    del source
    finally:
        if fd >= 0:
            os.close(fd)
    if bad is not None:
        raise SegmentChanged(f"shared segment {name}: {bad}")


def from_files(header: pb.RestoreHeader, shm_dir: str, targets: list[_verify.Target]) -> None:
    """Read a step from storage out of its object files, which the sidecar lends read-only: once,
    straight into the tensors, on every core the process may use, while the disk reads ahead.
    The files are the bucket's: every tensor must carry a digest, and each is checked."""
    name, sizes = header.shm.name, list(header.shm_files)
    if not re.fullmatch(SHM_LENT_PATTERN, name) or sum(sizes) != header.total_bytes:
        raise RestoreError(
            f"the sidecar lent files as {name!r} for {sum(sizes)} of {header.total_bytes} bytes"
        )
    if any(not t.digest for t in targets):
        raise FilesUnusable(f"files lent as {name}: a tensor has no digest to check it by", changed=True)
    try:
        fds = fetch_lent(shm_dir, name, len(sizes))
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise FilesUnusable(f"files lent as {name}: {why}", refused="refused" in why) from None
    try:
        for fd, size in zip(fds, sizes, strict=True):
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_size != size:
                why = f"files lent as {name}: one is not a regular file of {size} bytes"
                raise FilesUnusable(why, changed=True)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead window
        try:
            bad = _verify.copy_checked(_verify.Files(fds, sizes), targets)
        except EOFError as exc:
            raise FilesUnusable(f"files lent as {name}: {exc}", changed=True) from None
    finally:
        for fd in fds:
            os.close(fd)
    if bad is not None:
        raise FilesUnusable(f"files lent as {name}: {bad}", changed=True)


def seal_names(bits: int) -> str:
    names = [("F_SEAL_SHRINK", fcntl.F_SEAL_SHRINK), ("F_SEAL_WRITE", fcntl.F_SEAL_WRITE)]
    return " and ".join(what for what, bit in names if bits & bit)


def read_file_segment(fd: int, name: str, targets: list[_verify.Target]) -> None:
    """Read each tensor of a segment file straight into its destination and check its digest."""
    digests = _verify.StreamCheck(targets)
    for index, target in enumerate(targets):
        pos, dst = 0, target.dst.data  # a writable uint8 view of the destination
        while pos < len(dst):
            n = os.preadv(fd, [dst[pos:]], target.offset + pos)
            if n <= 0:
                raise SegmentGone(f"shared segment {name} shrank while being read")
            pos += n
        digests.update(index, 0, len(dst))
    try:
        digests.check()
    except _verify.DigestMismatch as exc:
        raise SegmentChanged(f"shared segment {name}: {exc}") from None


def end_restore(stream: Iterator[pb.RestoreResponse], header: pb.RestoreHeader, shm_dir: str) -> None:
    """Give up on a restore that named a shared segment: the call ends, a handoff is removed."""
    stream.cancel()  # type: ignore[attr-defined]  # a grpc call: the sidecar stops waiting
    drop_handoff(header, shm_dir)


def drop_handoff(header: pb.RestoreHeader, shm_dir: str) -> None:
    """Remove a handoff file made for this restore (a lent descriptor is the sidecar's to drop)."""
    if header.shm_handoff and not re.fullmatch(SHM_LENT_PATTERN, header.shm.name):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(shm_dir, header.shm.name))


#: Restores over the stream from this many bytes show a progress bar (when stderr is a terminal).
SHOWN_RESTORE_BYTES = 1 << 30


def receive(
    stream: Iterator[pb.RestoreResponse], shm_dir: str = "", in_place: InPlace | None = None
) -> tuple[pb.RestoreHeader, list[torch.Tensor]]:
    """Read a restore stream straight into freshly allocated tensors.

    The stream is the snapshot buffer, ``total_bytes`` long; tensor i occupies
    ``[offset, offset + nbytes)`` of it (gaps are alignment padding). A header naming a shared
    segment (``shm``) means the buffer is that segment instead: no chunks follow, and the tensors
    are copied into the live state's own where ``in_place`` finds them. A restore into a live
    state (``in_place``) of a step saved through DCP ends at the header: SavedThroughDcp.
    """
    first = next(stream, None)
    if first is None or first.WhichOneof("msg") != "header":
        raise RestoreError("restore stream did not start with a header")
    header = first.header
    if in_place is not None and saved_through_dcp(_tree.decode_skeleton(header.tree)):
        end_restore(stream, header, shm_dir)
        raise SavedThroughDcp(int(header.step))
    tensors: list[torch.Tensor] | None = None
    if header.HasField("shm") and in_place is not None:
        try:
            tensors = in_place.targets(header)
        except RestoreError:
            end_restore(stream, header, shm_dir)
            raise
    if tensors is None:
        tensors = [torch.empty(tuple(m.shape), dtype=torch_dtype(m.dtype)) for m in header.tensors]
    targets = [
        _verify.Target(m.offset, as_numpy_bytes(t), m.xxh3, m.name)
        for m, t in zip(header.tensors, tensors, strict=True)
        if t.numel()
    ]
    if header.HasField("shm"):
        try:
            from_segment(header, shm_dir, targets)
        except SegmentGone:
            stream.cancel()  # type: ignore[attr-defined]  # a grpc call: the sidecar stops waiting
            raise
        finally:
            drop_handoff(header, shm_dir)  # a copy made for this restore (ends the call)
        for _ in stream:  # nothing more comes; let the call end
            raise RestoreError("the sidecar sent chunks after naming a shared segment")
        return header, tensors
    index, pos = 0, 0
    digests = _verify.StreamCheck(targets)  # each piece hashed just after it is written
    long = header.total_bytes >= SHOWN_RESTORE_BYTES
    shown = progress.bar(header.total_bytes, f"restore step {header.step}") if long else progress.OFF
    for msg in stream:
        data = memoryview(msg.chunk)
        shown.update(len(data))
        end = pos + len(data)
        while index < len(targets) and targets[index].offset < end:
            start, dst = targets[index].offset, targets[index].dst
            lo, hi = max(start, pos), min(start + dst.size, end)
            if hi > lo:
                dst[lo - start : hi - start] = data[lo - pos : hi - pos]
                digests.update(index, lo - start, hi - start)
            if start + dst.size > end:
                break
            index += 1
        pos = end
    shown.close()
    if pos != header.total_bytes or index != len(targets):
        raise RestoreError(
            f"restore stream ended after {pos} of {header.total_bytes} bytes "
            f"({index} of {len(targets)} tensors complete)"
        )
    try:
        digests.check()
    except _verify.DigestMismatch as exc:
        raise RestoreError(f"step {header.step} from {header.source}: {exc}") from None
    return header, tensors


def unverified(header: pb.RestoreHeader) -> int:
    """The header's tensors that carry no digest (their bytes were copied unchecked), logged."""
    unverified = sum(1 for m in header.tensors if m.nbytes and not m.xxh3)
    if unverified:
        # none at all: a sidecar that predates digests in the header; some: lossy tensors
        (log.warning if unverified == len(header.tensors) else log.info)(
            "step %d: %d of %d tensors carry no digest; their bytes were not checked",
            header.step,
            unverified,
            len(header.tensors),
        )
    return unverified
