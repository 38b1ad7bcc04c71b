"""One memory budget for everything the sidecar holds of its own.

Charged here: snapshots received over gRPC (their buffers), what a save's header makes the
sidecar hold (``metadata``: its state tree parsed and as its MANIFEST carries it, its tensor
list), restore buffers (read from storage, or decoded from held lossy forms), restores read
ahead, and encode scratch (quantized and diffed payloads while they upload). Not charged:
shared-memory segments. The trainer creates and first touches them, so their pages belong to the
trainer container's memory limit and to the emptyDir's ``sizeLimit``: one segment per rank by
default, two with ``STRATA_STAGING_BUFFERS=2`` or redundancy (or after a refused drop), each the
rank's snapshot size. The chains' digests (``sidecar.engine.held``) are charged as encode
memory. What no reservation covers is bounded by a limit instead: one gRPC message
(--max-message-bytes), a state tree (--max-tree-bytes, before it is parsed), the tensors of one
save (--max-tensors), names and dimensions (sidecar.engine.admission).

A reservation that does not fit is refused with RESOURCE_EXHAUSTED, naming what asked, what is
held and the limit; nothing waits for memory, so nothing deadlocks on it. The limit comes from
``--memory-budget`` or, by default, a fraction of the container's cgroup memory limit (the
machine's RAM where there is none), leaving room for the interpreter, gRPC and numpy.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from sidecar.errors import FailedPrecondition, ResourceExhausted

log = logging.getLogger(__name__)

#: Share of the container's limit the budget may use by default; the rest is the process itself
#: (interpreter, boto3, gRPC buffers, numpy temporaries outside the encoders' accounting).
DEFAULT_FRACTION = 0.75
KINDS = ("snapshot", "metadata", "restore", "prefetch", "encode", "redundancy")


def cgroup_memory_limit(root: str = "/sys/fs/cgroup", proc_self: str = "/proc/self/cgroup") -> int | None:
    """This process's cgroup memory limit in bytes, or None when unlimited or unknown.

    cgroup v2: ``memory.max`` of the process's own cgroup (the container's, under Kubernetes),
    then of its parents; v1: ``memory/memory.limit_in_bytes`` (values near 2**63 mean none).
    """
    paths: list[Path] = []
    try:
        for line in Path(proc_self).read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and parts[0] == "0":  # v2 unified hierarchy
                p = Path(root) / parts[2].lstrip("/")
                while True:
                    paths.append(p / "memory.max")
                    if p == Path(root) or p.parent == p:
                        break
                    p = p.parent
    except OSError:
        pass
    paths.append(Path(root) / "memory.max")
    paths.append(Path(root) / "memory" / "memory.limit_in_bytes")
    for path in paths:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            continue
        try:
            value = int(text)
        except ValueError:
            continue
        if 0 < value < 1 << 60:
            return value
    return None


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


def default_limit() -> tuple[int, str]:
    """(bytes, where it came from) for ``--memory-budget 0``."""
    cgroup = cgroup_memory_limit()
    if cgroup is not None:
        return int(cgroup * DEFAULT_FRACTION), f"{DEFAULT_FRACTION:.0%} of the cgroup memory limit {cgroup}"
    ram = physical_memory()
    return int(ram * DEFAULT_FRACTION), f"{DEFAULT_FRACTION:.0%} of the machine's {ram} bytes of RAM"


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


class Reservation:
    """Bytes held against a :class:`MemoryBudget`; ``release()`` is idempotent."""

    def __init__(self, budget: MemoryBudget, kind: str, nbytes: int) -> None:
        self._budget = budget
        self.kind = kind
        self.nbytes = nbytes

    def release(self) -> None:
        if self.nbytes:
            self._budget._give_back(self.kind, self.nbytes)
            self.nbytes = 0

    def __del__(self) -> None:  # dropped without release (an unread restore): give it back
        self.release()

    def shrink(self, nbytes: int) -> None:
        """Keep only ``nbytes`` of it (the rest was freed)."""
        if 0 <= nbytes < self.nbytes:
            self._budget._give_back(self.kind, self.nbytes - nbytes)
            self.nbytes = nbytes


class MemoryBudget:
    def __init__(
        self,
        limit: int,
        source: str = "--memory-budget",
        on_change: Callable[[MemoryBudget], None] | None = None,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        if limit <= 0:
            raise ValueError(f"memory budget must be positive, got {limit}")
        self.limit = limit
        self.source = source
        self._lock = threading.RLock()  # a Reservation freed by the GC may release mid-reserve
        self._held: Counter[str] = Counter()
        self.peak = 0
        self.refused = 0
        self._on_change = on_change
        self._on_refused = on_refused

    @property
    def used(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def held(self) -> dict[str, int]:
        with self._lock:
            return {k: self._held.get(k, 0) for k in KINDS}

    def reserve(self, kind: str, nbytes: int, what: str, *, retry: bool = False) -> Reservation:
        """Hold ``nbytes`` for ``what``, or raise ResourceExhausted (it does not fit now) or
        FailedPrecondition (it never can), saying why. ``retry``: the caller frees something
        and asks again when it does not fit now, so that one is not counted as refused."""
        if kind not in KINDS:
            raise ValueError(f"unknown memory kind {kind!r}")
        nbytes = max(0, int(nbytes))
        if nbytes > self.limit:  # not a matter of waiting: say so with another status
            self._refused(kind)
            raise FailedPrecondition(
                f"{what} needs {human(nbytes)} of sidecar memory, more than its whole "
                f"{human(self.limit)} budget ({self.source}): use shared-memory saves (their pages "
                "are the trainer's) or raise the sidecar's memory limit or --memory-budget"
            )
        with self._lock:
            used = sum(self._held.values())
            if used + nbytes > self.limit:
                if not retry:
                    self._refused(kind)
                parts = ", ".join(f"{k} {human(v)}" for k, v in self._held.items() if v) or "nothing"
                raise ResourceExhausted(
                    f"{what} needs {human(nbytes)} of sidecar memory, but {human(used)} of its "
                    f"{human(self.limit)} budget ({self.source}) is held ({parts}). Save less often, "
                    "use shared-memory saves (their pages are the trainer's), or raise the sidecar's "
                    "memory limit or --memory-budget"
                )
            self._held[kind] += nbytes
            self.peak = max(self.peak, used + nbytes)
        self._changed()
        return Reservation(self, kind, nbytes)

    def _refused(self, kind: str) -> None:
        self.refused += 1
        if self._on_refused is not None:
            self._on_refused(kind)

    def _give_back(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self._held[kind] = max(0, self._held[kind] - nbytes)
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)


def tune_allocator() -> None:
    """Make freed buffers go back to the kernel (glibc): large blocks always mmap'ed, at most
    two malloc arenas. By default glibc raises its mmap threshold after each large free (up to
    32 MiB), so the encoders' block-sized temporaries land in per-thread arenas that keep the
    memory after they are freed: the process would hold far more than its budget charges.
    Called by the sidecar's entry points only (a process-wide setting)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return
    m_arena_max, m_mmap_threshold = -8, -3
    mallopt(m_mmap_threshold, 1 << 20)
    mallopt(m_arena_max, 2)
