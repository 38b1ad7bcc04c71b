"""From a received snapshot to what is stored, and from stored steps back to a snapshot.

:class:`SnapshotEncoder` decides full or diff (the policy, the rank's :class:`Chain`
of committed steps, the previous snapshot still in memory), then encodes tensor by
tensor, lazily, so the upload of one tensor's objects overlaps the encoding of the
next. :func:`read_snapshot` restores a step: it follows ``base_step`` back to the
full checkpoint and applies each step's tensors in order, oldest first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace

import numpy as np

from sidecar import manifest as mf
from sidecar.api.dtypes import ITEMSIZE
from sidecar.errors import CorruptObject, NotFound
from sidecar.pipeline import encode as enc
from sidecar.pipeline.policy import start_new_full
from sidecar.pipeline.settings import Quantization
from sidecar.store.base import Store

log = logging.getLogger(__name__)

Layout = tuple[tuple[str, str, tuple[int, ...], int], ...]


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


class SnapshotEncoder:
    """Encodes one rank's snapshot at ``step``.

    ``previous`` is the newest committed snapshot's buffer (same rank, still in
    memory) and ``chain`` what it consists of; without both the checkpoint is full.
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
        chain: Chain | None = None,
        previous: memoryview | None = None,
        touched: dict[str, bytes] | None = None,
        workers: int = 1,
        spot_checks: int = 256,
    ) -> None:
        self.step = step
        self.tensors = tensors
        self.buffer = buffer
        self.policy = policy
        self.quant = quant
        self.bits = quant.bits(restores)
        self.workers = workers
        self.outcome = Outcome()
        self._chain = chain
        self._write: dict[str, np.ndarray] = {}
        self._since: dict[str, np.ndarray] = {}
        self._warned: set[str] = set()
        self._touched = touched or {}
        self._spot_checks = spot_checks
        self._tracking: dict[str, str] = {}
        layout = layout_of(tensors)
        self._layout = layout
        usable = (
            policy != "full"
            and chain is not None
            and previous is not None
            and chain.layout == layout
            and bool(chain.since_full)  # something large enough to diff
            and len(chain.sizes) < max_diffs
        )
        if usable:
            assert chain is not None and previous is not None
            self._plan_diff(chain, previous)

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

    def _plan_diff(self, chain: Chain, previous: memoryview) -> None:
        delta: dict[str, np.ndarray] = {}
        for t in self.tensors:
            if t.name in chain.since_full:
                cur = enc.as_rows(self.buffer[t.offset : t.offset + t.nbytes], t.shape)
                old = enc.as_rows(previous[t.offset : t.offset + t.nbytes], t.shape)
                delta[t.name] = self._changed(t.name, cur, old)
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

    def _changed(self, name: str, cur: np.ndarray, old: np.ndarray) -> np.ndarray:
        """Rows that changed: the client's lookup bitmap, spot-checked, or a byte comparison."""
        bitmap = self._touched.get(name)
        if bitmap is None:
            self._tracking[name] = "values"
            return enc.changed_rows(cur, old)
        looked_up = np.unpackbits(np.frombuffer(bitmap, np.uint8), count=len(cur), bitorder="little")
        mask = looked_up.astype(np.bool_)
        others = np.flatnonzero(~mask)
        if len(others) > self._spot_checks:
            # Deterministic per step and tensor, so a rerun checks the same rows.
            rng = np.random.default_rng([self.step, len(name), *name.encode()[:16]])
            others = rng.choice(others, self._spot_checks, replace=False)
        if enc.changed_rows(cur[others], old[others]).any():
            log.warning(
                "step %d: %s changed in rows it did not look up (weight decay? an edit outside "
                "training?); diffing it by value in this save",
                self.step,
                name,
            )
            self.outcome.tracking_mismatches += 1
            self._tracking[name] = "values: tracking missed a row"
            return enc.changed_rows(cur, old)
        self._tracking[name] = "lookups"
        return mask

    # --- encoding -------------------------------------------------------------------------

    def pieces(self) -> Iterator[memoryview | bytes]:
        """The stored bytes, tensor by tensor; ``outcome.tensors`` grows as they are produced."""
        o = self.outcome
        lossless = o.kind == "full" and not any(self._lossy(t) for t in self.tensors)
        if lossless:
            # Stored as received, alignment padding included: no copy at all.
            o.tensors = [replace(t) for t in self.tensors]
            o.stored_bytes = len(self.buffer)
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
            return Chain(self._layout, self.step, (self.step,), since, ())
        chain = self._chain
        assert chain is not None
        size = o.size_fraction
        steps = (*chain.steps, self.step) if self.policy == "consecutive" else (chain.full_step, self.step)
        return replace(chain, steps=steps, since_full=self._since, sizes=(*chain.sizes, size))


# --- restore -------------------------------------------------------------------------------------


def read_snapshot(
    store: Store,
    manifest: mf.Manifest,
    load: Callable[[int], mf.Manifest],
    executor: Executor,
    max_chain: int = 1024,
) -> list[memoryview]:
    """The snapshot buffer ``manifest`` describes, as consecutive pieces.

    ``load(step)`` returns the same rank's manifest of an older committed step. A
    lossless full checkpoint comes back as its objects (no copy); anything else is
    decoded into one buffer, replaying the chain of diffs from its full checkpoint.
    Raises ``CorruptObject``/``NotFound`` naming what is missing or damaged.
    """
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
    first = chain[0]
    if len(chain) == 1 and all(t.encoding == "raw" and t.stored_offset < 0 for t in first.tensors):
        return [memoryview(b) for b in _objects(store, first, executor)]
    out = bytearray(manifest.total_bytes)
    view = memoryview(out)
    for m in chain:
        try:
            stream = b"".join(_objects(store, m, executor))
        except (CorruptObject, NotFound) as exc:
            if m is manifest:
                raise
            raise CorruptObject(
                f"step {m.step}", f"step {manifest.step} needs step {m.step}, which cannot be read: {exc}"
            ) from None
        for t in m.tensors:
            start, size = t.stored()
            if start + size > len(stream):
                raise CorruptObject(f"step {m.step}", f"{t.name} lies beyond the stored bytes")
            try:
                enc.decode_into(
                    view[t.offset : t.offset + t.nbytes],
                    memoryview(stream)[start : start + size],
                    t.encoding,
                    t.dtype,
                    t.shape,
                    t.cast,
                )
            except ValueError as exc:
                raise CorruptObject(f"step {m.step}", f"{t.name}: {exc}") from None
    return [view]


def _objects(store: Store, manifest: mf.Manifest, executor: Executor) -> list[bytes]:
    """Read and verify every object before handing out a byte: a restore is all or nothing."""
    futures = [executor.submit(mf.read_object, store, o) for o in manifest.objects]
    return [f.result() for f in futures]
