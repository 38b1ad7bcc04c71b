"""Admitting saves: a save's header is validated (names, dtypes and sizes, offsets in a shared
segment, the snapshot size limit, the attempt's restore step) and given its place among the
rank's held snapshots and its share of the memory budget, or refused at once (counted). Then
the stream's chunks, its end (from there the snapshot commits even if the trainer dies), or
its abort."""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Iterable

from sidecar import manifest as mf
from sidecar.api import MAX_STEP
from sidecar.api.dtypes import expected_nbytes
from sidecar.budget import Reservation
from sidecar.config import SidecarSettings
from sidecar.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    StrataError,
)
from sidecar.faults import fault_point
from sidecar.pipeline import encode as enc

from .attempts import Attempts
from .commit import Commits
from .held import Held
from .reports import Reports
from .restore import Restorer
from .state import Shared
from .types import Identity, Snapshot, TensorSpec, zeroed

log = logging.getLogger(__name__)

#: Deepest nesting of a state tree: every reader of it (json, the client's decoder) recurses.
MAX_TREE_DEPTH = 128
#: Longest tensor name (UTF-8 bytes), and most dimensions of one tensor.
MAX_NAME_BYTES = 1024
MAX_DIMS = 64
#: Longest dtype or role of a tensor (both are short words: "bfloat16", "embedding").
MAX_WORD = 64
#: Parsing JSON can take ~24x its bytes (a list of empty objects): reserved before parsing.
PARSE_FACTOR = 32
#: What one declared tensor costs besides its name and bitmap: its entries (declared and
#: stored, with digests) and its lines in the MANIFEST, as measured, with room to spare.
TENSOR_COST = 2048


class Admission:
    def __init__(
        self,
        shared: Shared,
        held: Held,
        attempts: Attempts,
        commits: Commits,
        restorer: Restorer,
        reports: Reports,
    ) -> None:
        self.shared = shared
        self.settings = shared.settings
        self.metrics = shared.metrics
        self.memory = shared.memory
        self.held = held
        self.attempts = attempts
        self.commits = commits
        self.restorer = restorer
        self.reports = reports

    def begin_save(
        self,
        protocol_version: int,
        identity: Identity,
        step: int,
        save_id: str,
        tensors: list[TensorSpec],
        tree: bytes,
        segment: tuple[str, int] | None = None,
        replicas: list[mf.ReplicaEntry] | None = None,
    ) -> Snapshot:
        """Validate a header and reserve memory for the snapshot, or raise (counted as refused).

        With ``segment`` (name, size) the bytes are already in a shared segment
        at the tensors' offsets, and the snapshot is complete once admitted. ``replicas``: the
        state's replicated tensors (those another rank owns are not in ``tensors``).
        """
        metadata: list[Reservation] = []  # the header's share of the budget, kept once admitted
        try:
            return self._admit(
                protocol_version, identity, step, save_id, tensors, tree, segment, replicas or [], metadata
            )
        except StrataError:
            _release(metadata)
            self.metrics.checkpoints.labels(identity.job, "refused").inc()
            raise
        except BaseException:
            _release(metadata)
            raise

    def _admit(
        self,
        protocol_version: int,
        identity: Identity,
        step: int,
        save_id: str,
        tensors: list[TensorSpec],
        tree: bytes,
        segment: tuple[str, int] | None,
        replicas: list[mf.ReplicaEntry],
        metadata: list[Reservation],
    ) -> Snapshot:
        identity.validate()
        self.attempts.greet(identity, protocol_version)
        self.restorer.forget_prefetched(identity.slot)  # training has started: no read-ahead restore
        if step < 0:
            raise InvalidArgument(f"step must be >= 0, got {step}")
        if step > MAX_STEP:
            raise InvalidArgument(f"step must be <= {MAX_STEP} (keys hold 12 digits), got {step}")
        if not save_id or not save_id.replace("-", "").isalnum() or len(save_id) > 64:
            raise InvalidArgument(f"save_id {save_id!r} must be 1-64 letters, digits or '-'")
        check_header_limits(self.settings, tensors, replicas, tree)
        entries: list[mf.TensorEntry] = []
        names: set[str] = set()
        offset = 0
        for t in tensors:
            if t.name in names:
                raise InvalidArgument(f"duplicate tensor name {t.name!r}")
            names.add(t.name)
            try:
                expect = expected_nbytes(t.dtype, t.shape)
            except ValueError as exc:
                raise InvalidArgument(f"tensor {t.name!r}: {exc}") from None
            if expect != t.nbytes:
                raise InvalidArgument(
                    f"tensor {t.name!r}: {t.nbytes} bytes declared, but {t.dtype}{list(t.shape)} is {expect}"
                )
            if segment is not None:
                if t.offset < offset:
                    raise InvalidArgument(
                        f"tensor {t.name!r} at offset {t.offset} overlaps the one before (ends at {offset})"
                    )
                offset = t.offset
            if t.touched and len(t.touched) != (enc.rows_of(t.shape) + 7) // 8:
                raise InvalidArgument(
                    f"tensor {t.name!r}: touched-rows bitmap of {len(t.touched)} bytes for "
                    f"{enc.rows_of(t.shape)} rows"
                )
            entries.append(mf.TensorEntry(t.name, t.dtype, list(t.shape), t.nbytes, offset, role=t.role))
            offset += t.nbytes
        _check_replicas(identity, entries, replicas)
        if segment is not None and offset > segment[1]:
            raise InvalidArgument(f"tensors end at byte {offset}, beyond shared segment size {segment[1]}")
        if offset > self.settings.max_snapshot_bytes:
            raise InvalidArgument(
                f"snapshot of {offset} bytes exceeds the sidecar's --max-snapshot-bytes "
                f"{self.settings.max_snapshot_bytes}"
            )
        if self.shared.quant.patterns and not any(self.shared.quant.matches(e.name, e.role) for e in entries):
            raise InvalidArgument(
                f"--quantize-match {','.join(self.shared.quant.patterns)!r} matches no tensor of this save "
                f"(names look like {', '.join(e.name for e in entries[:3])})"
            )
        tree_value = self._read_header(identity, step, tensors, replicas, tree, metadata)
        epoch = self.attempts.epoch_for(identity)
        if epoch.restore is not None and step <= epoch.restore[1]:
            raise AlreadyExists(
                f"step {step} of {identity.namespace}/{identity.job}: attempt {epoch.attempt} resumed from "
                f"step {epoch.restore[1]}; it saves later steps only (committed checkpoints are never "
                "overwritten)"
            )
        # Before the lock every job shares: a client-named file is opened here (never blocking).
        source = self.shared.segments.acquire(segment[0], identity.slot) if segment is not None else None
        in_place = source is not None and source.in_place
        buffer: bytearray | memoryview
        with self.shared.lock:
            held = self.held.open_slot_locked(identity)
            for snap in held:
                if in_place and segment is not None and snap.segment == segment[0]:
                    raise FailedPrecondition(
                        f"shared segment {segment[0]} still holds step {snap.step} ({snap.state}); "
                        "a client must stage into its other segment"
                    )
                if snap.step == step and snap.state in ("receiving", "uploading"):
                    raise Aborted(f"a save of step {step} for rank {identity.rank} is still in progress")
                if snap.position == (epoch.attempt, step) and snap.state == "committed":
                    raise AlreadyExists(f"step {step} of {identity.namespace}/{identity.job} is committed")
            if len(held) >= self.settings.max_held_snapshots:
                busy = ", ".join(f"step {s.step} {s.state}" for s in held)
                raise ResourceExhausted(
                    f"rank {identity.rank} already holds {len(held)} snapshots ({busy}); "
                    "save less often or wait for the previous upload"
                )
            if segment is not None:
                self.shared.segments.admitted(segment[0], identity.slot)
            memory = None
            if source is not None and source.in_place:  # a sealed memfd: read where it lies
                buffer = source.view(offset)
            else:  # streamed, or copied out of a segment file (which its writer may shrink)
                kind = "streamed" if source is None else "shared-memory"
                what = f"the {kind} save of step {step} (rank {identity.rank})"
                try:
                    memory = self.memory.reserve("snapshot", offset, what, retry=True)
                except ResourceExhausted:
                    # The committed copy in memory is a cache (storage has it): give it up before
                    # refusing. The next checkpoint of this rank is then a full one.
                    self.held.drop_committed_locked(identity, what)
                    memory = self.memory.reserve("snapshot", offset, what)
                # Shareable with the encoding workers when there are some and it may be quantized.
                pool = self.shared.encode_pool is not None and self.shared.quant.enabled
                buffer = zeroed(offset, shareable=pool)
            snap = Snapshot(identity, step, save_id, entries, tree_value, offset, buffer, memory=memory)
            snap.attempt, snap.generation = epoch.attempt, epoch.generation
            snap.metadata = metadata[0] if metadata else None
            snap.touched = {t.name: t.touched for t in tensors if t.touched}
            snap.replicas = list(replicas)
            if in_place and segment is not None:
                snap.segment, snap.received = segment[0], offset
            held.append(snap)
            self.reports.count_save_locked(identity.slot)
        if source is not None and not in_place:
            try:
                source.read_into(memoryview(buffer), offset)
            except BaseException:
                self.held.release(snap)
                raise
            snap.received = offset
        self.held.update_gauge()
        self.commits.rank_back(
            identity, epoch.attempt
        )  # saving: whatever a dropped stream said no longer holds
        return snap

    def _read_header(
        self,
        identity: Identity,
        step: int,
        tensors: list[TensorSpec],
        replicas: list[mf.ReplicaEntry],
        tree: bytes,
        metadata: list[Reservation],
    ) -> object:
        """The state tree, checked whole, with what the header costs the sidecar charged to the
        budget (appended to ``metadata``): before parsing, the most parsing may take; after, what
        the tree and the tensor list are measured to hold until the snapshot is dropped."""
        what = (
            f"the state tree ({len(tree)} bytes) and {len(tensors) + len(replicas)} tensor entries "
            f"of step {step} (rank {identity.rank})"
        )
        entries = header_cost(tensors, replicas)
        metadata.append(self._reserve_metadata(identity, PARSE_FACTOR * len(tree) + entries, what))
        value, held = parse_tree(tree)
        if held + entries <= metadata[0].nbytes:
            metadata[0].shrink(held + entries)
        else:
            metadata.pop().release()
            metadata.append(self._reserve_metadata(identity, held + entries, what))
        return value

    def _reserve_metadata(self, identity: Identity, nbytes: int, what: str) -> Reservation:
        try:
            return self.memory.reserve("metadata", nbytes, what, retry=True)
        except ResourceExhausted:  # the rank's committed copy in memory is a cache: give it up first
            with self.shared.lock:
                self.held.drop_committed_locked(identity, what)
            self.held.update_gauge()
            return self.memory.reserve("metadata", nbytes, what)

    def write_chunk(self, snap: Snapshot, data: bytes) -> None:
        end = snap.received + len(data)
        if end > snap.total_bytes:
            raise InvalidArgument(
                f"stream carries more than the {snap.total_bytes} bytes its header declared"
            )
        snap.buffer[snap.received : end] = data
        snap.received = end
        fault_point("sidecar.receive.chunk", snap.step)

    def finish(self, snap: Snapshot, footer_total: int, stall_s: float, skipped: int) -> None:
        """The stream is complete: from here the snapshot commits even if the trainer dies."""
        if snap.segment:
            fault_point("sidecar.receive.chunk", snap.step)  # the shared-memory save's "bytes arrived"
        if snap.received != snap.total_bytes or footer_total != snap.total_bytes:
            raise InvalidArgument(
                f"stream ended with {snap.received} bytes (footer says {footer_total}); "
                f"header declared {snap.total_bytes}"
            )
        job = snap.identity.job
        self.metrics.received_bytes.labels(job).inc(snap.total_bytes)
        self.metrics.save_stall.labels(job).observe(max(stall_s, 0.0))
        if skipped:
            self.metrics.saves_skipped.labels(job).inc(skipped)
        snap.state = "uploading"
        self.held.remember(snap)
        self.commits.submit(snap)

    def abort(self, snap: Snapshot, reason: str) -> None:
        """Drop an incomplete stream; nothing of it was written."""
        if snap.state != "receiving":
            return
        snap.state, snap.message = "aborted", reason
        self.metrics.checkpoints.labels(snap.identity.job, "aborted").inc()
        log.warning("save of step %d (rank %d) aborted: %s", snap.step, snap.identity.rank, reason)
        self.held.release(snap)
        snap.done.set()


def _release(reservations: list[Reservation]) -> None:
    for r in reservations:
        r.release()


def check_header_limits(
    settings: SidecarSettings, tensors: list[TensorSpec], replicas: list[mf.ReplicaEntry], tree: bytes
) -> None:
    """Bound what a header may declare before anything of it is looked at further."""
    count = len(tensors) + len(replicas)
    if count > settings.max_tensors:
        raise InvalidArgument(
            f"save declares {count} tensors and replicas, more than --max-tensors {settings.max_tensors}"
        )
    for kind, name, dims in [("tensor", t.name, len(t.shape)) for t in tensors] + [
        ("replicated tensor", r.name, len(r.shape)) for r in replicas
    ]:
        size = len(name.encode("utf-8", "surrogatepass"))
        if size > MAX_NAME_BYTES:
            raise InvalidArgument(
                f"{kind} {name[:64]!r}...: name of {size} bytes, more than the limit of "
                f"{MAX_NAME_BYTES} bytes"
            )
        if dims > MAX_DIMS:
            raise InvalidArgument(f"{kind} {name!r}: {dims} dimensions, more than the limit of {MAX_DIMS}")
    for t in tensors:  # echoed in errors and kept in the MANIFEST: short words
        for field, text in (("dtype", t.dtype), ("role", t.role)):
            if len(text) > MAX_WORD:
                raise InvalidArgument(
                    f"tensor {t.name!r}: {field} of {len(text)} characters, more than the limit of {MAX_WORD}"
                )
    if len(tree) > settings.max_tree_bytes:
        raise InvalidArgument(
            f"state tree of {len(tree)} bytes exceeds --max-tree-bytes {settings.max_tree_bytes} "
            "(large values belong in tensors)"
        )


def header_cost(tensors: list[TensorSpec], replicas: list[mf.ReplicaEntry]) -> int:
    """Bytes the sidecar holds for a header's tensor list while the snapshot lives."""
    return sum(TENSOR_COST + 3 * len(t.name) + len(t.touched) for t in tensors) + sum(
        TENSOR_COST + 3 * len(r.name) for r in replicas
    )


def _constant(name: str) -> object:
    raise InvalidArgument(f"state tree holds {name}, which is not JSON (tag non-finite floats)")


def parse_tree(tree: bytes) -> tuple[object, int]:
    """A save's state tree, strict JSON (no NaN or Infinity, every number finite) at most
    MAX_TREE_DEPTH deep, and the bytes it makes the sidecar hold: the parsed value, the MANIFEST
    that carries it (indented, ASCII) and the copies made while writing that."""
    if not tree:
        return None, 0
    try:
        value = json.loads(tree, parse_constant=_constant)
    except RecursionError:
        raise InvalidArgument(f"state tree nested deeper than {MAX_TREE_DEPTH} levels") from None
    except ValueError as exc:
        raise InvalidArgument(f"state tree is not valid JSON: {exc}") from None
    python = 0  # the parsed objects
    text = len(tree)  # the MANIFEST's copy: the bytes, plus indentation and escapes
    size = sys.getsizeof
    stack: list[tuple[dict[str, object] | list[object], int]] = []  # iterative: depth is checked
    if isinstance(value, (dict, list)):
        stack.append((value, 0))
    else:
        python, text = _leaf(value, python, text)
    while stack:
        node, depth = stack.pop()
        if depth >= MAX_TREE_DEPTH:
            raise InvalidArgument(f"state tree nested deeper than {MAX_TREE_DEPTH} levels")
        python += size(node)
        text += len(node) * (depth + 8)
        if type(node) is dict:
            for key in node:
                python += size(key)
                if not key.isascii():
                    text += 6 * len(key)
            children: Iterable[object] = node.values()
        else:
            children = node
        for child in children:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1))  # type: ignore[arg-type]
            elif kind is int or kind is bool or child is None:
                python += size(child)
            else:
                python, text = _leaf(child, python, text)
    # Writing a MANIFEST copies the tree (dataclasses.asdict) and holds its text twice (str, bytes).
    return value, 2 * python + 2 * text


def _leaf(value: object, python: int, text: int) -> tuple[int, int]:
    """``parse_tree``'s sums past a string or number."""
    python += sys.getsizeof(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument("state tree holds a number that is not finite (too large for a double)")
        text += 24  # repr() may be longer than the text it came from (1e15)
    elif isinstance(value, str) and not value.isascii():
        text += 6 * len(value)
    return python, text


def _check_replicas(
    identity: Identity, entries: list[mf.TensorEntry], replicas: list[mf.ReplicaEntry]
) -> None:
    """A replica this rank owns is one of its tensors, as declared; one another rank owns is not;
    names and tree positions are unique; the owner is a rank of the job."""
    own = {e.name: e for e in entries}
    names: set[str] = set()
    indexes: set[int] = set()
    for r in replicas:
        what = f"replicated tensor {r.name!r}"
        if r.name in names or r.index in indexes:
            raise InvalidArgument(f"{what}: declared twice (name or tree index {r.index})")
        names.add(r.name)
        indexes.add(r.index)
        if r.owner >= identity.world_size:
            raise InvalidArgument(f"{what}: owner rank {r.owner} is outside world size {identity.world_size}")
        try:
            if expected_nbytes(r.dtype, tuple(r.shape)) != r.nbytes:
                raise ValueError(f"{r.nbytes} bytes declared for {r.dtype}{list(r.shape)}")
        except ValueError as exc:
            raise InvalidArgument(f"{what}: {exc}") from None
        if len(r.sample) != 8 or any(c not in "0123456789abcdef" for c in r.sample):
            raise InvalidArgument(f"{what}: sample {r.sample!r} is not a crc32 (8 hex digits)")
        held = own.get(r.name)
        if r.owner == identity.rank:
            if held is None:
                raise InvalidArgument(f"{what}: this rank owns it but did not send it")
            if (held.dtype, list(held.shape)) != (r.dtype, list(r.shape)):
                raise InvalidArgument(
                    f"{what}: declared {r.dtype}{list(r.shape)}, sent {held.dtype}{held.shape}"
                )
        elif held is not None:
            raise InvalidArgument(f"{what}: rank {r.owner} owns it, yet this rank sent it too")
