"""From a received snapshot to what is stored, and from stored steps back to a snapshot.

:class:`SnapshotEncoder` decides full or diff (the policy, the rank's :class:`Chain`
of committed steps, the previous snapshot still in memory), then encodes tensor by
tensor, lazily, so the upload of one tensor's objects overlaps the encoding of the
next. :func:`read_snapshot` restores a step: it follows ``base_step`` back to the
full checkpoint and applies each step's tensors in order, oldest first.

With quantization the stored checkpoint is lossy, so the snapshot held in memory (exact)
is not what a restore from storage gives. The encoder therefore also hands back the stored
form of every lossy tensor (:attr:`Outcome.held`, about bits/32 of a float32 table plus
the diffs' rows), and :func:`decode_held` replays it over the exact snapshot: a restore
served from memory is then bitwise the one storage would serve.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import math
import mmap
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Executor, wait
from dataclasses import dataclass, field, replace

import numpy as np

from sidecar import manifest as mf
from sidecar.api.dtypes import ITEMSIZE
from sidecar.errors import CorruptObject, NotFound
from sidecar.pipeline import encode as enc
from sidecar.pipeline.policy import start_new_full
from sidecar.pipeline.settings import Quantization
from sidecar.pipeline.workers import EncodePool
from sidecar.shm import RestoreBuffer
from sidecar.store.base import READ_PIECE_BYTES, Store
from sidecar.store.base import into as store_into

log = logging.getLogger(__name__)

Layout = tuple[tuple[str, str, tuple[int, ...], int], ...]
#: one step's held lossy forms: (its stored tensor entries, name -> stored form)
HeldForms = tuple[list[mf.TensorEntry], dict[str, bytes]]


def check_sample_size(untracked: int, fraction: float, confidence: float) -> int:
    """How many of ``untracked`` rows to compare so that, if at least ``ceil(fraction *
    untracked)`` of them changed, the check finds one with probability >= ``confidence``.

    Let U = ``untracked``, f = ``fraction``, c = ``confidence`` and m >= ceil(f*U) the
    changed rows among them. A uniform sample of k rows drawn without replacement misses
    every changed row with probability

        P(miss) = prod_{i=0}^{k-1} (U - m - i) / (U - i)
                <= ((U - m) / U)^k <= (1 - f)^k,

    each factor being at most (U - m)/U <= 1 - f. So (1 - f)^k <= 1 - c suffices:

        k = ceil(ln(1 - c) / ln(1 - f)),

    capped at U, where the check is exhaustive and misses nothing. This is the bound for
    sampling with replacement; without replacement it is conservative (f = 0.001,
    c = 0.999: 6,905 rows, where the exact product needs about 6,880 of a million).
    Fewer than ceil(f*U) changed rows may go unnoticed. f = 1 is read as "compare every
    untracked row" (the bound alone would ask for a single one).
    """
    if untracked <= 0:
        return 0
    if not 0 < fraction <= 1 or not 0 < confidence < 1:
        raise ValueError(f"check fraction {fraction} must be in (0, 1] and confidence {confidence} in (0, 1)")
    if fraction >= 1:
        return untracked
    k = math.ceil(math.log1p(-confidence) / math.log1p(-fraction))
    return min(max(k, 1), untracked)


def layout_of(tensors: list[mf.TensorEntry]) -> Layout:
    return tuple((t.name, t.dtype, tuple(t.shape), t.offset) for t in tensors)


@dataclass(frozen=True)
class Chain:
    """What a rank's newest committed checkpoint consists of, for the next diff."""

    layout: Layout
    full_step: int
    #: steps a restore of the newest committed one reads, oldest (the full one) first
    steps: tuple[int, ...]
    #: per diffed tensor, rows changed since the full checkpoint
    since_full: dict[str, np.ndarray]
    #: sizes of the diffs since the full one, as fractions of a full checkpoint's size
    sizes: tuple[float, ...]
    #: per diffed tensor, a digest per group of rows (``enc.row_digests``: at most 1/32 of its
    #: bytes, charged to the memory budget with the chain's held forms) in the newest step, kept when
    #: that step's bytes were not compared with a copy of the step before (none was held: the
    #: trainer stages into a single segment, which the sidecar gives back before it is staged
    #: into again); the next diff compares digests then (None: only bytes can be compared)
    digests: dict[str, np.ndarray] | None = None


@dataclass
class Outcome:
    """Filled in while encoding; read after the upload."""

    kind: str = "full"
    base_step: int | None = None
    requires: list[int] = field(default_factory=list)
    tensors: list[mf.TensorEntry] = field(default_factory=list)
    stored_bytes: int = 0
    changed_ratio: float | None = None
    #: a diff's size over a full checkpoint's (both priced with the same encodings)
    size_fraction: float = 1.0
    max_error: float = 0.0
    tracking_mismatches: int = 0
    #: the stored bytes (exactly as written into the objects) of every tensor stored lossily,
    #: and of every tensor named in the encoder's ``hold``: what :func:`decode_held` replays
    held: dict[str, bytes] = field(default_factory=dict)


class SnapshotEncoder:
    """Encodes one rank's snapshot at ``step``.

    ``previous`` is the newest committed snapshot's buffer (same rank, still in
    memory) and ``chain`` what it consists of; without ``previous`` the diff compares the
    chain's row digests, and without those either the checkpoint is full. Whenever there is no
    ``previous`` (and diffs are possible) this step's row digests are computed for the next one.
    """

    def __init__(
        self,
        step: int,
        tensors: list[mf.TensorEntry],
        buffer: memoryview,
        *,
        policy: str,
        max_diffs: int,
        quant: Quantization,
        restores: int,
        storage_restores: int = 0,
        chain: Chain | None = None,
        previous: memoryview | None = None,
        touched: dict[str, bytes] | None = None,
        workers: int = 1,
        pool: EncodePool | None = None,
        check_fraction: float = 0.001,
        check_confidence: float = 0.999,
        check_rows: int | None = None,
        hold: frozenset[str] = frozenset(),
        decoded: Sequence[HeldForms] = (),
    ) -> None:
        """``touched`` maps a tracked tensor to the client's bitmap of looked-up rows; its
        other rows are spot-checked, sized by :func:`check_sample_size` from
        ``check_fraction`` and ``check_confidence`` (``check_rows`` forces the sample size,
        for tests).

        ``hold`` names tensors whose stored form the caller already holds for this chain:
        they are held again (``outcome.held``) even where this step stores them exactly, so
        the chain of held forms has no gap (a table lossy in the full checkpoint whose
        diff fell back to exact rows, say). Lossily stored tensors are held regardless.

        ``decoded``: the chain's held forms, oldest first, when the trainer restored
        ``previous`` from memory and so holds its lossy tensors as storage gives them: those
        tensors are compared with their decoded values, not with the exact bytes of
        ``previous`` (which every row of a quantized table differs from)."""
        self.step = step
        self.tensors = tensors
        self.buffer = buffer
        self.policy = policy
        self.quant = quant
        self.bits = quant.bits(restores, storage_restores)
        self.workers = workers
        self.pool = pool
        self.outcome = Outcome()
        self._chain = chain
        self._write: dict[str, np.ndarray] = {}
        self._since: dict[str, np.ndarray] = {}
        self._warned: set[str] = set()
        self._touched = touched or {}
        if not 0 < check_fraction <= 1 or not 0 < check_confidence < 1:
            raise ValueError(
                f"check_fraction {check_fraction} must be in (0, 1] and check_confidence "
                f"{check_confidence} in (0, 1)"
            )
        if check_rows is not None and check_rows < 0:
            raise ValueError(f"check_rows must be >= 0, got {check_rows}")
        self._check_fraction = check_fraction
        self._check_confidence = check_confidence
        self._check_rows = check_rows
        self._tracking: dict[str, str] = {}
        #: this step's row digests of the diffable tensors, kept in the chain for the next diff
        self._digests: dict[str, np.ndarray] | None = None
        self._hold = hold
        self._decoded = decoded
        layout = layout_of(tensors)
        self._layout = layout
        # Digests stand for the previous bytes only where the trainer holds them exactly (not
        # lossy forms decoded from the held ones: those differ from what was digested).
        comparable = previous is not None or (chain is not None and chain.digests is not None and not decoded)
        usable = (
            policy != "full"
            and chain is not None
            and comparable
            and chain.layout == layout
            and bool(chain.since_full)  # something large enough to diff
            and len(chain.sizes) < max_diffs
        )
        digest = policy != "full" and previous is None
        if digest:
            self._digests = {}
        if usable:
            assert chain is not None
            self._plan_diff(chain, previous)
        if digest:
            assert self._digests is not None
            for t in tensors:
                if t.name not in self._digests and enc.diffable(t.shape, t.nbytes):
                    rows = enc.as_rows(buffer[t.offset : t.offset + t.nbytes], t.shape)
                    self._digests[t.name] = enc.row_digests(rows)

    # --- the decision ---------------------------------------------------------------------

    def _lossy(self, t: mf.TensorEntry) -> bool:
        return self.quant.matches(t.name, t.role) and enc.quantizable(t.dtype, t.shape)

    def _estimate(self, t: mf.TensorEntry, changed: int | None) -> int:
        lossy = self._lossy(t)
        if changed is None:
            kind = "cast" if lossy and self.quant.cast else "quantized" if lossy and self.bits else "raw"
        else:
            kind = (
                "rows-diff-cast"
                if lossy and self.quant.cast
                else "rows-diff-quantized"
                if lossy and self.bits
                else "rows-diff"
            )
        return enc.encoded_bytes(kind, t.shape, ITEMSIZE[t.dtype], changed or 0, self.bits)

    def _plan_diff(self, chain: Chain, previous: memoryview | None) -> None:
        delta: dict[str, np.ndarray] = {}
        for t in self.tensors:
            if t.name in chain.since_full:
                cur = enc.as_rows(self.buffer[t.offset : t.offset + t.nbytes], t.shape)
                if previous is not None:
                    old = enc.as_rows(self._base(t, previous[t.offset : t.offset + t.nbytes]), t.shape)
                    delta[t.name] = self._changed(t.name, cur, old)
                else:
                    assert chain.digests is not None
                    delta[t.name] = self._changed_digests(t.name, cur, chain.digests.get(t.name))
        since = {name: chain.since_full[name] | d for name, d in delta.items()}
        write = delta if self.policy == "consecutive" else since
        estimate = sum(
            self._estimate(t, int(write[t.name].sum()) if t.name in write else None) for t in self.tensors
        )
        full = sum(self._estimate(t, None) for t in self.tensors)
        size = estimate / max(full, 1)
        if self.policy == "intermittent" and start_new_full((*chain.sizes, size)):
            log.info(
                "step %d: a diff would be %.0f%% of a full checkpoint; starting a new baseline",
                self.step,
                100 * size,
            )
            return
        self._write, self._since = write, since
        o = self.outcome
        o.kind = "diff"
        o.size_fraction = size
        if self.policy == "consecutive":
            o.base_step, o.requires = chain.steps[-1], list(chain.steps)
        else:
            o.base_step, o.requires = chain.full_step, [chain.full_step]
        rows = sum(len(m) for m in write.values())
        o.changed_ratio = sum(int(m.sum()) for m in write.values()) / rows if rows else 0.0

    def _base(self, t: mf.TensorEntry, exact: memoryview) -> memoryview | bytearray:
        """``t`` in the snapshot the trainer holds: ``exact`` unless the trainer restored it
        decoded from held forms, then those decoded (as :func:`decode_held` does)."""
        forms = [
            (e, held[t.name])
            for tensors, held in self._decoded
            if t.name in held
            for e in tensors
            if e.name == t.name
        ]
        if not forms:
            return exact
        out = bytearray(exact)
        for e, form in forms:
            enc.decode_into(out, form, e.encoding, e.dtype, e.shape, e.cast)
        return out

    def _changed_digests(self, name: str, cur: np.ndarray, old: np.ndarray | None) -> np.ndarray:
        """Rows that changed, from the previous step's digests (one per group of rows,
        :func:`enc.digest_group`): every group digested and compared, or, with the client's
        lookup bitmap, a sample of the groups without a looked-up row checked as :meth:`_changed`
        does and only the groups with one digested anew (a group's rows change together)."""
        assert self._digests is not None
        rows, width = cur.shape
        if old is None or old.shape != (enc.digest_groups(rows, width), enc.DIGEST_WIDTH):
            self._digests[name] = enc.row_digests(cur)  # never expected: all differ
            return np.ones(rows, np.bool_)
        bitmap = self._touched.get(name)
        if bitmap is not None:
            g = enc.digest_group(width)
            mask = self._tracked(name, rows, bitmap)
            touched = np.unique(np.flatnonzero(mask) // g)
            marked = np.zeros(len(old), np.bool_)
            marked[touched] = True
            # Rows sharing a group with a looked-up one cannot be checked against their digest.
            others = np.unique(self._sample(name, mask, enc.rows_of_groups(marked, rows, width)) // g)
            if not (enc.group_digests(cur, others) != old[others]).any():
                new = old.copy()
                new[touched] = enc.group_digests(cur, touched)
                self._digests[name] = new
                return mask
            self._mismatch(name)
        else:
            self._tracking[name] = "values"
        new = enc.row_digests(cur)
        self._digests[name] = new
        return enc.rows_of_groups(np.asarray((new != old).any(axis=1)), rows, width)

    def _tracked(self, name: str, rows: int, bitmap: bytes) -> np.ndarray:
        looked_up = np.unpackbits(np.frombuffer(bitmap, np.uint8), count=rows, bitorder="little")
        return looked_up.astype(np.bool_)

    def _sample(self, name: str, mask: np.ndarray, unchecked: np.ndarray | None = None) -> np.ndarray:
        """The rows not looked up that are checked (all, or a sample sized by
        :func:`check_sample_size`), recording in ``_tracking`` how many; none of ``unchecked``
        (rows that cannot be checked)."""
        untracked = int(len(mask) - np.count_nonzero(mask))
        others = np.flatnonzero(~(mask if unchecked is None else mask | unchecked))
        if self._check_rows is not None:
            k = min(self._check_rows, len(others))
        else:
            k = min(check_sample_size(untracked, self._check_fraction, self._check_confidence), len(others))
        if k < len(others):
            # Deterministic per step and tensor, so a rerun checks the same rows, and
            # different from step to step. Sorted, so the gather walks memory forwards.
            rng = np.random.default_rng([self.step % (1 << 63), _name_seed(name)])
            picked = rng.choice(len(others), k, replace=False)
            picked.sort()
            others = others[picked]
        if not untracked:
            self._tracking[name] = "lookups (every row looked up)"
        elif k == untracked:
            self._tracking[name] = f"lookups (checked all {untracked} untracked rows)"
        else:
            self._tracking[name] = f"lookups (checked {k} of {untracked} untracked rows)"
        return others

    def _mismatch(self, name: str) -> None:
        log.warning(
            "step %d: %s changed in rows it did not look up (weight decay? an edit outside "
            "training?); diffing it by value in this save",
            self.step,
            name,
        )
        self.outcome.tracking_mismatches += 1
        self._tracking[name] = "values: tracking missed a row"

    def _changed(self, name: str, cur: np.ndarray, old: np.ndarray) -> np.ndarray:
        """Rows that changed: the client's lookup bitmap, spot-checked, or a byte comparison.

        The untracked rows are sampled (see :func:`check_sample_size`) and compared; if
        any of them changed, the bitmap is not trusted and the whole tensor is compared.
        """
        bitmap = self._touched.get(name)
        if bitmap is None:
            self._tracking[name] = "values"
            return enc.changed_rows(cur, old)
        mask = self._tracked(name, len(cur), bitmap)
        others = self._sample(name, mask)
        if enc.changed_rows(cur[others], old[others]).any():
            self._mismatch(name)
            return enc.changed_rows(cur, old)
        return mask

    # --- encoding -------------------------------------------------------------------------

    def scratch_bytes(self) -> int:
        """Bytes the stored form needs beyond the snapshot buffer: encoded tensors (quantized,
        cast, diffed); tensors stored raw in a full checkpoint are views of the buffer."""
        total = 0
        for t in self.tensors:
            mask = self._write.get(t.name)
            if mask is None and not self._lossy(t):
                continue
            total += self._estimate(t, None if mask is None else int(mask.sum()))
            if self._lossy(t) and t.dtype != "float32":
                total += t.nbytes * 2  # widened to float32 for quantizing
        return total

    @property
    def stores_buffer(self) -> bool:
        """Whether :meth:`pieces` is the snapshot buffer as received (a lossless full checkpoint):
        offsets in the stored bytes are then offsets in the buffer."""
        return self.outcome.kind == "full" and not any(self._lossy(t) for t in self.tensors)

    def pieces(self) -> Iterator[memoryview | bytes]:
        """The stored bytes, tensor by tensor; ``outcome.tensors`` grows as they are produced."""
        o = self.outcome
        if self.stores_buffer:
            # Stored as received, alignment padding included: no copy at all.
            o.tensors = [replace(t) for t in self.tensors]
            o.stored_bytes = len(self.buffer)
            o.held = {
                t.name: bytes(self.buffer[t.offset : t.offset + t.nbytes])
                for t in self.tensors
                if t.name in self._hold
            }
            yield self.buffer
            return
        pos = 0
        for t in self.tensors:
            data = self.buffer[t.offset : t.offset + t.nbytes]
            encoded = self._encode(t, data)
            entry = replace(
                t,
                encoding=encoded.encoding,
                stored_offset=pos,
                stored_bytes=encoded.nbytes,
                bits=encoded.bits,
                cast=encoded.cast,
                rel_l2_error=encoded.error,
                changed_rows=encoded.changed,
                tracking=self._tracking.get(t.name, "") if encoded.changed >= 0 else "",
            )
            o.tensors.append(entry)
            if entry.bits or entry.cast or t.name in self._hold:
                # A copy: pieces may be views of the snapshot buffer, which is replaced later.
                pieces = encoded.pieces
                o.held[t.name] = (
                    pieces[0] if len(pieces) == 1 and isinstance(pieces[0], bytes) else b"".join(pieces)
                )
            if encoded.error is not None:
                o.max_error = max(o.max_error, encoded.error)
            pos += encoded.nbytes
            yield from encoded.pieces
        o.stored_bytes = pos

    def _encode(self, t: mf.TensorEntry, data: memoryview) -> enc.Encoded:
        mask = self._write.get(t.name)
        if self._lossy(t):
            try:
                return enc.encode(
                    data,
                    t.dtype,
                    t.shape,
                    mask=mask,
                    bits=self.bits,
                    cast=self.quant.cast,
                    workers=self.workers,
                    pool=self.pool,
                )
            except ValueError as exc:
                if t.name not in self._warned:
                    log.warning("step %d: %s stored exactly: %s", self.step, t.name, exc)
                    self._warned.add(t.name)
        return enc.encode(data, t.dtype, t.shape, mask=mask)

    def next_chain(self) -> Chain:
        """The chain once this checkpoint is committed (call after ``pieces`` is exhausted)."""
        o = self.outcome
        if o.kind == "full":
            since = {
                t.name: np.zeros(enc.rows_of(t.shape), np.bool_)
                for t in self.tensors
                if enc.diffable(t.shape, t.nbytes)
            }
            return Chain(self._layout, self.step, (self.step,), since, (), self._digests)
        chain = self._chain
        assert chain is not None
        size = o.size_fraction
        steps = (*chain.steps, self.step) if self.policy == "consecutive" else (chain.full_step, self.step)
        return replace(
            chain, steps=steps, since_full=self._since, sizes=(*chain.sizes, size), digests=self._digests
        )


def base_digests(
    tensors: list[mf.TensorEntry], buffer: memoryview, names: Sequence[str], decoded: Sequence[HeldForms] = ()
) -> dict[str, np.ndarray]:
    """Row digests of the tensors ``names`` as the trainer holds them: ``buffer`` (a committed
    snapshot), with the lossy ones decoded from ``decoded`` where it restored them so (as
    :meth:`SnapshotEncoder._base` compares)."""
    out: dict[str, np.ndarray] = {}
    for t in tensors:
        if t.name not in names:
            continue
        data: memoryview | bytearray = buffer[t.offset : t.offset + t.nbytes]
        forms = [(e, h[t.name]) for entries, h in decoded if t.name in h for e in entries if e.name == t.name]
        if forms:
            data = bytearray(data)
            for e, form in forms:
                enc.decode_into(data, form, e.encoding, e.dtype, e.shape, e.cast)
        out[t.name] = enc.row_digests(enc.as_rows(data, t.shape))
    return out


def _name_seed(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


# --- restore -------------------------------------------------------------------------------------


def load_chain(
    manifest: mf.Manifest, load: Callable[[int], mf.Manifest], max_chain: int = 1024
) -> list[mf.Manifest]:
    """The steps a restore of ``manifest`` replays, oldest (the full checkpoint) first: ``load(step)``
    returns the same rank's manifest of an older committed step. Raises ``CorruptObject`` where a
    base cannot be read, has another layout, or the chain is too long or starts with a diff."""
    chain = [manifest]
    while chain[-1].base_step is not None:
        if len(chain) > max_chain:
            raise CorruptObject(manifest.job, f"step {manifest.step}: chain of diffs longer than {max_chain}")
        base = chain[-1].base_step
        try:
            older = load(base)
        except (CorruptObject, NotFound) as exc:
            raise CorruptObject(
                f"step {base}", f"step {manifest.step} needs step {base}, which cannot be read: {exc}"
            ) from None
        if layout_of(older.tensors) != layout_of(chain[-1].tensors):
            raise CorruptObject(f"step {base}", f"step {chain[-1].step} diffs against a different layout")
        chain.append(older)
    chain.reverse()
    if chain[0].checkpoint != "full":
        raise CorruptObject(f"step {chain[0].step}", "the chain does not start with a full checkpoint")
    return chain


class ObjectFiles:
    """A step's objects opened read-only, in order, where their bytes one after another are the
    snapshot itself (a full checkpoint stored raw, in place) and every tensor has an XXH3 digest:
    lent as they are to a trainer that copies and checks each tensor itself (one pass from the
    disk into its live tensors, no memory here), or read here a piece at a time (:meth:`chunks`),
    each object's digest checked."""

    def __init__(self, objects: Sequence[mf.ObjectEntry], fds: list[int]) -> None:
        self.objects = list(objects)
        self._fds = fds
        self._closer = weakref.finalize(self, _close_all, fds)

    @property
    def sizes(self) -> list[int]:
        return [o.size for o in self.objects]

    def release(self) -> list[tuple[int, int]]:
        """The descriptors with their objects' sizes, now the caller's to close (see :func:`close_files`)."""
        self._closer.detach()
        fds, self._fds = list(self._fds), []
        return list(zip(fds, self.sizes, strict=True))

    def duplicates(self) -> list[int]:
        """New descriptors of the same files, in order (the caller's to close)."""
        out: list[int] = []
        try:
            for fd in self._fds:
                out.append(os.dup(fd))
        except BaseException:
            _close_all(out)
            raise
        return out

    def chunks(self) -> Iterator[memoryview]:
        """The snapshot's bytes in order, each object's size and digest checked as it is read."""
        try:
            for o, fd in zip(self.objects, list(self._fds), strict=True):
                digest, pos = mf.Digest(o), 0
                while pos < o.size:
                    piece = memoryview(bytearray(min(READ_PIECE_BYTES, o.size - pos)))
                    n = os.preadv(fd, [piece], pos)
                    if n <= 0:
                        raise CorruptObject(o.key, f"size {pos} != {o.size} in the manifest")
                    digest.update(piece[:n])
                    yield piece[:n]
                    pos += n
                if (why := digest.check()) is not None:
                    raise CorruptObject(o.key, f"{why} in the manifest")
        finally:
            self.close()

    def close(self) -> None:
        self._closer()


def _close_all(fds: list[int]) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())


#: madvise(2): fault a range's pages in for reading, no copy (Linux 5.14); Python names it from 3.13
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def into_page_cache(files: list[tuple[int, int]]) -> None:
    """Read files (descriptor, the size its MANIFEST gives) into the page cache without copying a
    byte out of it (MADV_POPULATE_READ on a read-only mapping of that size, nothing where the
    kernel lacks it), then close them. A file cut short meanwhile fails that call (EFAULT); the
    mapping is never touched, so nothing can fault here; a file grown since is read no further."""
    try:
        for fd, size in files:
            try:
                if size <= 0 or os.fstat(fd).st_size < size:
                    continue
                with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mapped:
                    mapped.madvise(_MADV_POPULATE_READ)
            except OSError as exc:
                if exc.errno == errno.EINVAL:  # a kernel without it
                    return
    finally:
        close_files(files)


def close_files(files: list[tuple[int, int]]) -> None:
    _close_all([fd for fd, _ in files])
    files.clear()


def open_objects(store: Store, manifest: mf.Manifest, most: int) -> ObjectFiles | None:
    """``manifest``'s objects as files to lend (see :class:`ObjectFiles`), each checked to be a
    regular file of its manifest size; None where the store holds no files, the step is not
    stored in place with a digest for every tensor, or it has more than ``most`` objects.
    CorruptObject/NotFound as a read would raise them."""
    if (
        manifest.checkpoint != "full"
        or not 0 < len(manifest.objects) <= most
        or not _in_place(manifest, manifest.total_bytes)
        or not all(t.xxh3 for t in manifest.tensors)
    ):
        return None
    fds: list[int] = []
    try:
        for o in manifest.objects:
            fd = store.open_object(o.key, o.size)
            if fd is None:
                _close_all(fds)
                return None
            fds.append(fd)
    except BaseException:
        _close_all(fds)
        raise
    return ObjectFiles(manifest.objects, fds)


def held_bytes(chain: Sequence[mf.Manifest]) -> int:
    """The most bytes :func:`read_snapshot` holds besides the snapshot while replaying ``chain``
    (from :func:`load_chain`): the stored size of its largest step that is decoded rather than read
    in place. As the manifests say: a caller reserves it before reading and passes it as
    ``max_held``. (Not bounded by the snapshot's size: a diff of every row outgrows its tensor.)"""
    size = chain[-1].total_bytes
    return max(
        (_stored_size(m) for i, m in enumerate(chain) if not (i == 0 and _in_place(m, size))), default=0
    )


def _stored_size(m: mf.Manifest) -> int:
    return sum(o.size for o in m.objects)


def read_snapshot(
    store: Store,
    manifest: mf.Manifest,
    load: Callable[[int], mf.Manifest],
    executor: Executor,
    max_chain: int = 1024,
    dest: memoryview | RestoreBuffer | None = None,
    max_held: int | None = None,
) -> list[memoryview]:
    """The snapshot buffer ``manifest`` describes, in one piece: written into ``dest`` (the
    snapshot's size: a writable buffer, or a memfd to lend; then nothing is returned) or into a
    new buffer, returned.

    ``load(step)`` returns the same rank's manifest of an older committed step (see
    :func:`load_chain`). The chain is replayed in one pass over the buffer: the full checkpoint's
    objects are read straight into it where they hold the tensors' raw bytes at their offsets (else
    decoded into it), then each diff's tensors are decoded over it in order, oldest first. Every
    object is read with ranged GETs in parallel into its place, its size checked against the
    manifest before a byte is read and its digest computed as the bytes land. Only a step that must
    be decoded (diffs, lossy tensors) is held besides, one step at a time, and none of more than
    ``max_held`` bytes (see :func:`held_bytes`) is allocated.
    Raises ``CorruptObject``/``NotFound`` naming what is missing or damaged.
    """
    chain = load_chain(manifest, load, max_chain)
    out: list[memoryview] = []
    if dest is None:
        dest = memoryview(bytearray(manifest.total_bytes))
        out.append(dest)
    size = len(dest) if isinstance(dest, memoryview) else dest.size
    if size != manifest.total_bytes:
        raise ValueError(f"a {size}-byte buffer for a {manifest.total_bytes}-byte snapshot")
    for m in chain:
        try:
            if m is chain[0] and _in_place(m, size):
                read_objects(store, m.objects, dest, executor)
                continue
            need = _stored_size(m)
            if max_held is not None and need > max_held:
                raise CorruptObject(
                    f"step {m.step}", f"its objects hold {need} bytes, more than the {max_held} reserved"
                )
            stored = memoryview(bytearray(need))
            read_objects(store, m.objects, stored, executor)
        except (CorruptObject, NotFound) as exc:
            if m is manifest:
                raise
            raise CorruptObject(
                f"step {m.step}", f"step {manifest.step} needs step {m.step}, which cannot be read: {exc}"
            ) from None
        with _writable(dest) as view:
            _decode_step(m, stored, view)
        del stored
    return out


@contextlib.contextmanager
def _writable(dest: memoryview | RestoreBuffer) -> Iterator[memoryview]:
    if isinstance(dest, memoryview):
        yield dest
    else:
        with dest.writable() as view:
            yield view


def _decode_step(m: mf.Manifest, stored: memoryview, view: memoryview) -> None:
    for t in m.tensors:
        start, size = t.stored()
        if start < 0 or size < 0 or start + size > len(stored):
            raise CorruptObject(f"step {m.step}", f"{t.name} lies beyond the stored bytes")
        if t.offset < 0 or t.offset + t.nbytes > len(view):
            raise CorruptObject(f"step {m.step}", f"{t.name} lies beyond the snapshot")
        why = _decoded(view[t.offset : t.offset + t.nbytes], stored[start : start + size], t)
        if why is not None:
            raise CorruptObject(f"step {m.step}", f"{t.name}: {why}")


def _decoded(out: memoryview, payload: memoryview, t: mf.TensorEntry) -> str | None:
    """Decode ``t`` into ``out``, or say why it does not decode. Only the message leaves: the
    error's traceback holds views of ``out``, and a mapping with views left cannot be unmapped."""
    try:
        enc.decode_into(out, payload, t.encoding, t.dtype, t.shape, t.cast)
    except ValueError as exc:
        return str(exc)
    return None


def _in_place(m: mf.Manifest, size: int) -> bool:
    """Whether ``m``'s objects, one after another, are the snapshot buffer itself: every tensor
    stored raw at its own offset, the objects exactly the snapshot's length."""
    return sum(o.size for o in m.objects) == size and all(
        t.encoding == "raw" and t.stored_offset < 0 and not t.cast for t in m.tensors
    )


#: The most bytes one GET asks for: an object up to this size is one request whose digest is
#: computed as it lands; a larger one is read in ranges of this size in parallel, then digested.
RANGE_BYTES = 64 << 20


def read_objects(
    store: Store, objects: Sequence[mf.ObjectEntry], into: memoryview | RestoreBuffer, executor: Executor
) -> None:
    """Read ``objects`` one after another into ``into`` (exactly their total size), in parallel
    ranged reads, each object's size and digest checked: all of them or ``CorruptObject``/
    ``NotFound`` naming the first that failed. A buffer is read into in place; a memfd is
    written from one small buffer per read, reused. So in-flight memory is ``into`` itself plus
    at most a piece per read, however large the objects the bucket sends (their sizes are checked
    before their bodies are read). ``into`` is the caller's, sized from manifests, which come
    from the bucket too: bound it before allocating it (see :func:`held_bytes`)."""
    total = len(into) if isinstance(into, memoryview) else into.size
    if sum(o.size for o in objects) != total:
        raise ValueError(f"{len(objects)} objects for a {total}-byte buffer")
    tasks: list[tuple[mf.ObjectEntry, int, int, int]] = []  # object, its offset in into, range
    at = 0
    for o in objects:
        for lo in range(0, max(1, o.size), RANGE_BYTES):
            tasks.append((o, at, lo, min(RANGE_BYTES, o.size - lo)))
        at += o.size

    def read(task: tuple[mf.ObjectEntry, int, int, int]) -> None:
        o, base, lo, n = task
        digest = mf.Digest(o) if n == o.size else None  # else digested once whole, below
        if isinstance(into, memoryview):
            place = store_into(into[base + lo : base + lo + n])

            def landed(pos: int, piece: memoryview) -> None:
                if digest is not None:
                    digest.update(piece)

        else:
            scratch = memoryview(bytearray(min(READ_PIECE_BYTES, n)))

            def place(pos: int, want: int) -> memoryview:
                return scratch[:want]

            def landed(pos: int, piece: memoryview) -> None:
                into.write(base + lo + pos, piece)
                if digest is not None:
                    digest.update(piece)

        got = store.read_into(o.key, lo, n, place, object_size=o.size, on_data=landed)
        if got != n:
            raise CorruptObject(o.key, f"size {lo + got} != {o.size} in the manifest")
        why = digest.check() if digest is not None else None
        if why is not None:
            raise CorruptObject(o.key, f"{why} in the manifest")

    futures = [executor.submit(read, t) for t in tasks]
    wait(futures, return_when=FIRST_EXCEPTION)
    for f in futures:
        f.cancel()
    wait(futures)  # nothing may still write into ``into`` once this returns
    for f in futures:
        exc = None if f.cancelled() else f.exception()
        if exc is not None:
            raise exc
    at = 0
    for o in objects:
        if o.size > RANGE_BYTES:
            why = _digest_of(o, into, at)
            if why is not None:
                raise CorruptObject(o.key, f"{why} in the manifest")
        at += o.size


def _digest_of(o: mf.ObjectEntry, into: memoryview | RestoreBuffer, at: int) -> str | None:
    if isinstance(into, memoryview):
        return mf.check_digest(o, into[at : at + o.size])
    digest, piece = mf.Digest(o), memoryview(bytearray(min(READ_PIECE_BYTES, o.size)))
    for lo in range(0, o.size, len(piece)):
        chunk = piece[: min(len(piece), o.size - lo)]
        into.read(at + lo, chunk)
        digest.update(chunk)
    return digest.check()


def decode_held(
    view: memoryview,
    layers: list[tuple[list[mf.TensorEntry], dict[str, bytes]]],
    *,
    steps: Sequence[int] | None = None,
) -> None:
    """Turn the exact newest snapshot in ``view`` into what a restore from storage gives.

    ``view`` is a writable buffer of the snapshot's size holding the exact bytes of the
    newest committed snapshot; ``layers`` its chain, oldest (the full checkpoint) first,
    each as (that step's tensor entries as stored, that step's :attr:`Outcome.held`).
    Every held tensor is decoded from its held forms layer by layer, as
    :func:`read_snapshot` decodes stored bytes, so it comes out bitwise equal to a
    storage restore; tensors never held keep the exact bytes (lossless storage restores
    them exactly). ``steps`` (the layers' step numbers) only names steps in errors.

    Raises ``ValueError`` naming the tensor and step when the held forms cannot
    reproduce storage: a lossy entry without a held form, a layer missing one for a
    tensor an earlier layer held, a held form of the wrong size or naming no tensor of
    the layer. Those are found before ``view`` is touched; a held form that fails to
    decode leaves ``view`` partly decoded. Either way the caller restores from storage.
    """
    if steps is not None and len(steps) != len(layers):
        raise ValueError(f"{len(steps)} step numbers for {len(layers)} layers")

    def label(i: int) -> str:
        where = f"step {steps[i]}" if steps is not None else f"layer {i}"
        return where + (" (the full checkpoint)" if i == 0 else "")

    started: set[str] = set()
    for i, (tensors, held) in enumerate(layers):
        names = {t.name for t in tensors}
        unknown = sorted(held.keys() - names)
        if unknown:
            raise ValueError(f"{label(i)} holds {unknown[0]}, a tensor its manifest does not list")
        for t in tensors:
            payload = held.get(t.name)
            if payload is None:
                if t.name in started:
                    raise ValueError(f"{t.name}: {label(i)} has no held form, yet an earlier step held one")
                if t.lossy:
                    raise ValueError(f"{t.name}: {label(i)} stored it lossily, but holds no stored form")
                continue
            size = t.stored()[1]
            if len(payload) != size:
                raise ValueError(
                    f"{t.name}: {label(i)} holds {len(payload)} bytes of a {size}-byte stored form"
                )
            if t.offset < 0 or t.offset + t.nbytes > len(view):
                raise ValueError(f"{t.name}: {label(i)} places it beyond the {len(view)}-byte snapshot")
            started.add(t.name)
    for i, (tensors, held) in enumerate(layers):
        for t in tensors:
            payload = held.get(t.name)
            if payload is None:
                continue
            try:
                enc.decode_into(
                    view[t.offset : t.offset + t.nbytes], payload, t.encoding, t.dtype, t.shape, t.cast
                )
            except ValueError as exc:
                raise ValueError(f"{t.name}: the form {label(i)} holds does not decode: {exc}") from None
