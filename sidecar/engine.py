"""The sidecar's core: holds snapshots in memory, drives upload and commit,
serves restores. The gRPC servicer only translates messages into these calls.

Memory policy per rank (REFT's double buffering): the newest committed
snapshot stays in memory for fast restore, plus at most
``max_held_snapshots - 1`` in flight. A save beyond that is refused with
RESOURCE_EXHAUSTED rather than queued: memory stays bounded and the trainer
learns at once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sidecar import manifest as mf
from sidecar.api import PROTOCOL_VERSION
from sidecar.api.dtypes import expected_nbytes
from sidecar.api.faults import fault_point
from sidecar.config import SidecarSettings
from sidecar.errors import (
    Aborted,
    AlreadyExists,
    CorruptObject,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StorageError,
    StrataError,
)
from sidecar.metrics import Metrics
from sidecar.pipeline import encode as enc
from sidecar.pipeline import upload_snapshot
from sidecar.pipeline.plan import Chain, SnapshotEncoder, read_snapshot
from sidecar.pipeline.settings import quantization
from sidecar.shm import Segments, check_dir
from sidecar.store.base import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Identity:
    namespace: str
    job: str
    rank: int
    world_size: int
    attempt: int

    def validate(self) -> None:
        try:
            mf.check_name("namespace", self.namespace)
            mf.check_name("job", self.job)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if self.world_size < 1 or self.rank >= self.world_size:
            raise InvalidArgument(f"rank {self.rank} is outside world size {self.world_size}")

    @property
    def slot(self) -> tuple[str, str, int]:
        return (self.namespace, self.job, self.rank)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    #: Where the tensor sits in a shared segment (chunked saves pack tensors; this is ignored).
    offset: int = 0
    role: str = ""
    #: rows the client saw looked up since the newest committed checkpoint (packed bits)
    touched: bytes = b""


@dataclass
class Snapshot:
    identity: Identity
    step: int
    save_id: str
    tensors: list[mf.TensorEntry]
    tree: object
    total_bytes: int
    buffer: bytearray | memoryview
    received: int = 0
    #: Shared segment the bytes live in (the client wrote them; verify before serving from memory).
    segment: str = ""
    #: The objects as uploaded, when they are ``buffer`` itself cut in slices (a lossless full).
    objects: list[mf.ObjectEntry] = field(default_factory=list)
    #: Restores the job had seen when this was saved.
    restores: int = 0
    #: tensor name -> packed bitmap of rows the client tracked as looked up
    touched: dict[str, bytes] = field(default_factory=dict)
    state: str = "receiving"  # receiving -> uploading -> committed | failed | aborted
    message: str = ""
    commit_key: str = ""
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class RestoreData:
    step: int
    tensors: list[mf.TensorEntry]
    tree: object
    total_bytes: int
    source: str
    fallback_reason: str
    chunks: Iterator[memoryview]
    restores: int = 0


class Engine:
    def __init__(self, settings: SidecarSettings, store: Store, metrics: Metrics) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.started = time.time()
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, str, int], list[Snapshot]] = {}
        self._outcomes: OrderedDict[str, Snapshot] = OrderedDict()
        self._uploads = ThreadPoolExecutor(settings.upload_concurrency, thread_name_prefix="strata-upload")
        # One committer thread per rank: a rank's snapshots persist in the order they arrived,
        # so a newer step never commits before an older one.
        self._committers: dict[tuple[str, str, int], ThreadPoolExecutor] = {}
        self._attempts: dict[tuple[str, str], int] = {}
        self.segments = Segments(check_dir(settings.shm_dir))
        self.quant = quantization(settings)
        # Per rank: what its newest committed checkpoint consists of (for the next diff).
        self._chains: dict[tuple[str, str, int], Chain] = {}
        # Per job: restores seen, carried forward in manifests (bit-width escalation).
        self._restores: dict[tuple[str, str], int] = {}
        self._stopping = threading.Event()
        # Restores read ahead by prefetch(): slot -> (step, ready event, data or None)
        self._prefetched: dict[
            tuple[str, str, int], tuple[int | None, threading.Event, RestoreData | None]
        ] = {}

    def _committer_for(self, identity: Identity) -> ThreadPoolExecutor:
        with self._lock:
            pool = self._committers.get(identity.slot)
            if pool is None:
                pool = ThreadPoolExecutor(1, thread_name_prefix=f"strata-commit-r{identity.rank}")
                self._committers[identity.slot] = pool
            return pool

    def close(self) -> None:
        """Finish uploads in progress; commits still waiting for other ranks give up."""
        self._stopping.set()
        with self._lock:
            pools = list(self._committers.values())
        for pool in pools:
            pool.shutdown(wait=True)
        self._uploads.shutdown(wait=True)
        self.segments.close()

    # --- save -----------------------------------------------------------------------------

    def begin_save(
        self,
        protocol_version: int,
        identity: Identity,
        step: int,
        save_id: str,
        tensors: list[TensorSpec],
        tree: bytes,
        segment: tuple[str, int] | None = None,
    ) -> Snapshot:
        """Validate a header and reserve memory for the snapshot, or raise (counted as refused).

        With ``segment`` (name, size) the bytes are already in a shared segment
        at the tensors' offsets, and the snapshot is complete once admitted.
        """
        try:
            return self._admit(protocol_version, identity, step, save_id, tensors, tree, segment)
        except StrataError:
            self.metrics.checkpoints.labels(identity.job, "refused").inc()
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
    ) -> Snapshot:
        check_protocol(protocol_version)
        identity.validate()
        self.note_attempt(identity)
        with self._lock:  # training has started: a read-ahead restore is no longer wanted
            self._prefetched.pop(identity.slot, None)
        if step < 0:
            raise InvalidArgument(f"step must be >= 0, got {step}")
        if not save_id or not save_id.replace("-", "").isalnum() or len(save_id) > 64:
            raise InvalidArgument(f"save_id {save_id!r} must be 1-64 letters, digits or '-'")
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
        if segment is not None and offset > segment[1]:
            raise InvalidArgument(f"tensors end at byte {offset}, beyond shared segment size {segment[1]}")
        if offset > self.settings.max_snapshot_bytes:
            raise InvalidArgument(
                f"snapshot of {offset} bytes exceeds the sidecar's --max-snapshot-bytes "
                f"{self.settings.max_snapshot_bytes}"
            )
        if self.quant.patterns and not any(self.quant.matches(e.name, e.role) for e in entries):
            raise InvalidArgument(
                f"--quantize-match {','.join(self.quant.patterns)!r} matches no tensor of this save "
                f"(names look like {', '.join(e.name for e in entries[:3])})"
            )
        try:
            tree_value = json.loads(tree) if tree else None
        except ValueError as exc:
            raise InvalidArgument(f"state tree is not valid JSON: {exc}") from None
        self._check_not_committed(identity, step)
        buffer: bytearray | memoryview
        with self._lock:
            held = self._slots.setdefault(identity.slot, [])
            for snap in held:
                if segment is not None and snap.segment == segment[0]:
                    raise FailedPrecondition(
                        f"shared segment {segment[0]} still holds step {snap.step} ({snap.state}); "
                        "a client must stage into its other segment"
                    )
                if snap.step == step and snap.state in ("receiving", "uploading"):
                    raise Aborted(f"a save of step {step} for rank {identity.rank} is still in progress")
                if snap.step == step and snap.state == "committed":
                    raise AlreadyExists(f"step {step} of {identity.namespace}/{identity.job} is committed")
            if len(held) >= self.settings.max_held_snapshots:
                busy = ", ".join(f"step {s.step} {s.state}" for s in held)
                raise ResourceExhausted(
                    f"rank {identity.rank} already holds {len(held)} snapshots ({busy}); "
                    "save less often or wait for the previous upload"
                )
            if segment is None:
                buffer = bytearray(offset)
            else:  # mapping is cheap (no page is touched); under the lock so a refused save maps nothing
                buffer = self.segments.view(segment[0], offset, identity.slot)
            snap = Snapshot(identity, step, save_id, entries, tree_value, offset, buffer)
            snap.touched = {t.name: t.touched for t in tensors if t.touched}
            if segment is not None:
                snap.segment, snap.received = segment[0], offset
            held.append(snap)
        self._update_held_gauge()
        return snap

    def _check_not_committed(self, identity: Identity, step: int) -> None:
        try:
            committed = mf.is_committed(self.store, identity.namespace, identity.job, step)
        except StorageError as exc:
            # Storage down: accept into memory; the upload will report the failure.
            log.warning("could not check whether step %d is committed: %s", step, exc)
            return
        if committed:
            raise AlreadyExists(
                f"step {step} of {identity.namespace}/{identity.job} is already committed; "
                "committed checkpoints are never overwritten"
            )

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
        self._remember(snap)
        self._committer_for(snap.identity).submit(self._persist, snap)

    def abort(self, snap: Snapshot, reason: str) -> None:
        """Drop an incomplete stream; nothing of it was written."""
        if snap.state != "receiving":
            return
        snap.state, snap.message = "aborted", reason
        self.metrics.checkpoints.labels(snap.identity.job, "aborted").inc()
        log.warning("save of step %d (rank %d) aborted: %s", snap.step, snap.identity.rank, reason)
        self._release(snap)
        snap.done.set()

    def _persist(self, snap: Snapshot) -> None:
        ident = snap.identity
        job = ident.job
        t0 = time.perf_counter()
        try:
            prefix = mf.rank_prefix(
                ident.namespace, ident.job, snap.step, ident.attempt, snap.save_id, ident.rank
            )

            encoder = self._encoder(snap)
            out = encoder.outcome

            def make_manifest(objects: list[mf.ObjectEntry]) -> mf.Manifest:
                if out.kind == "full" and all(t.stored_offset < 0 for t in out.tensors):
                    snap.objects = objects  # slices of the buffer: a memory restore can verify them
                return mf.Manifest(
                    ident.namespace,
                    ident.job,
                    snap.step,
                    ident.rank,
                    ident.world_size,
                    ident.attempt,
                    snap.save_id,
                    snap.total_bytes,
                    snap.tree,
                    out.tensors,
                    objects,
                    checkpoint=out.kind,
                    base_step=out.base_step,
                    requires=out.requires,
                    policy=self.settings.policy,
                    restores=snap.restores,
                )

            upload_snapshot(
                self.store,
                self._uploads,
                prefix,
                encoder.pieces(),
                self.settings.object_bytes,
                make_manifest,
                self.metrics.uploaded_bytes.labels(job).inc,
                snap.step,
                max_in_flight=2 * self.settings.upload_concurrency,
            )
            self.metrics.upload_duration.labels(job).observe(time.perf_counter() - t0)
            fault_point("sidecar.commit.before", snap.step)
            if ident.rank == 0:
                self._commit_as_rank0(snap)
            else:
                self._await_commit(snap)
        except (StrataError, OSError) as exc:
            if isinstance(exc, StorageError):
                self.metrics.storage_errors.labels(job, "put").inc()
            self.metrics.checkpoints.labels(job, "failed").inc()
            snap.state, snap.message = "failed", f"step {snap.step} not committed: {exc}"
            log.error("rank %d: %s", ident.rank, snap.message)
            self._release(snap)
            if not isinstance(exc, Aborted):  # tell the other ranks' commit not to wait for this one
                try:
                    self.report_skip(ident, snap.step, snap.message)
                except (StrataError, OSError) as marker_exc:
                    log.debug("could not leave the skip marker: %s", marker_exc)
        except Exception as exc:  # never let a bug leave a waiter hanging
            log.exception("rank %d: unexpected error persisting step %d", ident.rank, snap.step)
            self.metrics.checkpoints.labels(job, "failed").inc()
            snap.state, snap.message = "failed", f"internal error: {exc!r}"
            self._release(snap)
        else:
            with self._lock:
                self._chains[ident.slot] = encoder.next_chain()
            self.metrics.encoded.labels(job, out.kind).inc()
            self.metrics.quantization_error.labels(job).set(out.max_error)
            if out.tracking_mismatches:
                self.metrics.value_diff_fallbacks.labels(job).inc(out.tracking_mismatches)
            if out.changed_ratio is not None:
                self.metrics.changed_rows.labels(job).set(out.changed_ratio)
            snap.state = "committed"
            snap.commit_key = mf.commit_key(ident.namespace, ident.job, snap.step)
            self.metrics.checkpoints.labels(job, "committed").inc()
            self.metrics.last_commit.labels(job).set(time.time())
            self.metrics.last_committed_step.labels(job).set(snap.step)
            log.info("rank %d: step %d committed (%d bytes)", ident.rank, snap.step, snap.total_bytes)
            self._keep_newest_committed(snap)
        finally:
            snap.done.set()
        if snap.state == "committed" and ident.rank == 0:
            # After the trainer hears "committed": retention is not on the path to durable.
            self._collect_garbage(ident)

    def _encoder(self, snap: Snapshot) -> SnapshotEncoder:
        """Full or diff against the rank's newest committed snapshot, if it is still held."""
        ident = snap.identity
        previous = None
        with self._lock:
            chain = self._chains.get(ident.slot)
            snap.restores = self._restores.get((ident.namespace, ident.job), 0)
            for held in self._slots.get(ident.slot, []):
                if chain is not None and held.state == "committed" and held.step == chain.steps[-1]:
                    previous = memoryview(held.buffer)
        return SnapshotEncoder(
            snap.step,
            snap.tensors,
            memoryview(snap.buffer),
            policy=self.settings.policy,
            max_diffs=self.settings.max_diffs,
            quant=self.quant,
            restores=snap.restores,
            chain=chain,
            previous=previous,
            touched=snap.touched,
            workers=self.settings.encode_workers,
        )

    def _commit_as_rank0(self, snap: Snapshot) -> None:
        ident = snap.identity
        deadline = time.monotonic() + self.settings.commit_timeout_s
        while True:
            state = mf.step_state(self.store, ident.namespace, ident.job, snap.step, ident.attempt)
            if state.skipped:
                raise Aborted(
                    f"step {snap.step} cannot commit: rank(s) {sorted(state.skipped)} did not save it"
                )
            missing = sorted(set(range(ident.world_size)) - set(state.manifests))
            if not missing:
                mf.write_commit(
                    self.store, ident.namespace, ident.job, snap.step, ident.world_size, ident.attempt, state
                )
                return
            if self._stopping.is_set():
                raise Aborted(f"step {snap.step}: the sidecar is stopping; ranks {missing} never saved it")
            # A restarted gang means missing ranks will never save this step, unless their
            # complete streams are being uploaded right here.
            if self._superseded(ident) and not self._uploading_here(ident, snap.step, missing):
                raise Aborted(f"step {snap.step} of attempt {ident.attempt} superseded by a restarted gang")
            if time.monotonic() > deadline:
                raise FailedPrecondition(
                    f"step {snap.step}: no MANIFEST from ranks {missing} "
                    f"after {self.settings.commit_timeout_s:.0f} s"
                )
            time.sleep(0.05)

    def _collect_garbage(self, ident: Identity) -> None:
        """Retention runs after rank 0's commit; a failure here never fails the save."""
        try:
            mf.collect_garbage(self.store, ident.namespace, ident.job, self.settings.keep)
        except (StrataError, OSError) as exc:
            log.warning(
                "retention of %s/%s failed (will retry after the next commit): %s",
                ident.namespace,
                ident.job,
                exc,
            )

    def _await_commit(self, snap: Snapshot) -> None:
        ident = snap.identity
        deadline = time.monotonic() + self.settings.commit_timeout_s
        while True:
            if self._superseded(ident) and not self._uploading_here(ident, snap.step, [0]):
                raise Aborted(f"step {snap.step} of attempt {ident.attempt} superseded by a restarted gang")
            state = mf.step_state(self.store, ident.namespace, ident.job, snap.step, ident.attempt)
            if state.committed:
                return
            if state.skipped:
                raise Aborted(
                    f"step {snap.step} cannot commit: rank(s) {sorted(state.skipped)} did not save it"
                )
            if time.monotonic() > deadline or self._stopping.is_set():
                raise FailedPrecondition(f"rank 0 did not commit step {snap.step} in time")
            time.sleep(0.1)

    def _superseded(self, ident: Identity) -> bool:
        with self._lock:
            return self._attempts.get((ident.namespace, ident.job), ident.attempt) > ident.attempt

    def _uploading_here(self, ident: Identity, step: int, ranks: list[int]) -> bool:
        with self._lock:
            for rank in ranks:
                held = self._slots.get((ident.namespace, ident.job, rank), [])
                if not any(
                    s.step == step and s.state == "uploading" and s.identity.attempt == ident.attempt
                    for s in held
                ):
                    return False
        return True

    def note_attempt(self, identity: Identity) -> None:
        """Remember the newest attempt of each job (any call carrying an identity)."""
        key = (identity.namespace, identity.job)
        with self._lock:
            if identity.attempt > self._attempts.get(key, -1):
                self._attempts[key] = identity.attempt

    def report_skip(self, identity: Identity, step: int, reason: str) -> None:
        """Leave the marker that makes the job-level commit of ``step`` fail at once."""
        identity.validate()
        self.note_attempt(identity)
        key = mf.skip_key(identity.namespace, identity.job, step, identity.attempt, identity.rank)
        self.store.put(key, reason.encode()[:4096])
        log.info("rank %d will not save step %d: %s", identity.rank, step, reason)

    def _remember(self, snap: Snapshot) -> None:
        with self._lock:
            self._outcomes[snap.save_id] = snap
            while len(self._outcomes) > 1024:
                self._outcomes.popitem(last=False)

    def _release(self, snap: Snapshot) -> None:
        with self._lock:
            held = self._slots.get(snap.identity.slot, [])
            if snap in held:
                held.remove(snap)
            snap.buffer = bytearray()
        self._update_held_gauge()

    def _keep_newest_committed(self, snap: Snapshot) -> None:
        """Only the newest committed snapshot of a rank stays in memory."""
        with self._lock:
            held = self._slots.get(snap.identity.slot, [])
            committed = [s for s in held if s.state == "committed"]
            newest = max(committed, key=lambda s: s.step)
            for old in committed:
                if old is not newest:
                    held.remove(old)
                    old.buffer = bytearray()
        self._update_held_gauge()

    def _update_held_gauge(self) -> None:
        with self._lock:
            total = sum(len(s.buffer) for held in self._slots.values() for s in held)
        self.metrics.held_bytes.set(total)

    def wait_committed(self, identity: Identity, step: int, save_id: str, timeout: float) -> Snapshot | None:
        """The snapshot once it is final (or still pending at the timeout); None if unknown."""
        with self._lock:
            snap = self._outcomes.get(save_id)
        if snap is None:
            return None
        snap.done.wait(timeout)
        return snap

    # --- restore --------------------------------------------------------------------------

    def open_restore(self, identity: Identity, step: int | None) -> RestoreData:
        identity.validate()
        self.note_attempt(identity)
        ns, job = identity.namespace, identity.job
        if step is None:
            # A stream that completed before the trainer died is being committed right now;
            # a restarted trainer must see it, so let it finish first.
            self._settle(identity)
            target = self._newest_step(identity)
            if target is None:
                raise NotFound(f"no committed checkpoint for {ns}/{job}")
        else:
            target = step
        ahead = self._take_prefetched(identity, target)
        if ahead is not None:
            return self._served(identity, ahead)
        memory = self._from_memory(identity, target)
        if memory is not None:
            return self._served(identity, memory)
        try:
            return self._served(identity, self._from_storage(identity, target))
        except (CorruptObject, NotFound) as exc:
            if step is not None:
                raise
            first_error = exc
        # Loud fallback: the newest step is unusable; walk back through older committed ones.
        self.metrics.restore_fallbacks.labels(job).inc()
        log.error(
            "%s/%s step %d is unusable (%s); falling back to an older committed step",
            ns,
            job,
            target,
            first_error,
        )
        for older in reversed([s for s in mf.committed_steps(self.store, ns, job) if s < target]):
            try:
                data = self._from_storage(identity, older)
            except (CorruptObject, NotFound) as exc:
                log.error("%s/%s step %d is unusable too: %s", ns, job, older, exc)
                continue
            data.fallback_reason = f"step {target} unusable ({first_error}); restored step {older}"
            return self._served(identity, data)
        raise CorruptObject(str(first_error), f"no restorable committed step at or before {target}")

    def _served(self, identity: Identity, data: RestoreData) -> RestoreData:
        """Count a restore; later checkpoints of the job carry the count (bit-width escalation)."""
        self.metrics.restores.labels(identity.job, data.source).inc()
        key = (identity.namespace, identity.job)
        with self._lock:
            if data.source != "memory" or data.fallback_reason:
                # The trainer now holds something other than the snapshot this rank's chain ends
                # with (an older step, or a stored chain that may be damaged): start a new one.
                self._chains.pop(identity.slot, None)
            # Every rank of a gang restart restores once: count the restart, not the ranks.
            if data.restores + 1 > self._restores.get(key, 0):
                self._restores[key] = data.restores + 1
        return data

    def prefetch(self, identity: Identity) -> None:
        """Read the newest committed step into memory in the background (asynchronous
        discovery: the restore that follows finds it ready)."""
        identity.validate()
        self.note_attempt(identity)
        ready = threading.Event()
        with self._lock:
            current = self._prefetched.get(identity.slot)
            if current is not None and not current[1].is_set():
                return  # one is already loading
            self._prefetched[identity.slot] = (None, ready, None)

        def load() -> None:
            step, data = None, None
            try:
                self._settle(identity)
                step = self._newest_step(identity)
                if step is not None and self._from_memory(identity, step) is None:
                    data = self._from_storage(identity, step)
                    log.info("rank %d: prefetched step %d (%d bytes)", identity.rank, step, data.total_bytes)
            except (StrataError, OSError) as exc:
                log.warning("rank %d: prefetch failed, restore will retry: %s", identity.rank, exc)
            finally:
                with self._lock:
                    # Unless a save on this slot dropped the entry meanwhile (training went on).
                    if self._prefetched.get(identity.slot, (None, None, None))[1] is ready:
                        self._prefetched[identity.slot] = (step, ready, data)
                ready.set()

        threading.Thread(target=load, name=f"strata-prefetch-r{identity.rank}", daemon=True).start()

    def _take_prefetched(self, identity: Identity, step: int) -> RestoreData | None:
        with self._lock:
            entry = self._prefetched.get(identity.slot)
        if entry is None:
            return None
        entry[1].wait(self.settings.commit_timeout_s)
        with self._lock:
            got_step, _, data = self._prefetched.pop(identity.slot, (None, entry[1], None))
        return data if got_step == step else None

    def _settle(self, identity: Identity) -> None:
        # Every rank of the job, not just this one: all local ranks must see the same newest step.
        with self._lock:
            pending = [
                s
                for (ns, job, _), held in self._slots.items()
                if (ns, job) == (identity.namespace, identity.job)
                for s in held
                if s.state == "uploading"
            ]
        for snap in pending:
            snap.done.wait(self.settings.commit_timeout_s)

    def _newest_step(self, identity: Identity) -> int | None:
        try:
            return mf.newest_committed(self.store, identity.namespace, identity.job)
        except StorageError as exc:
            # Storage unreachable: the newest snapshot this sidecar committed is still good.
            with self._lock:
                held = [s for s in self._slots.get(identity.slot, []) if s.state == "committed"]
            if held:
                log.warning("storage unreachable (%s); restoring step %d from memory", exc, held[-1].step)
                return held[-1].step
            raise

    def _from_memory(self, identity: Identity, step: int) -> RestoreData | None:
        found = None
        with self._lock:
            for snap in self._slots.get(identity.slot, []):
                if (
                    snap.step == step
                    and snap.state == "committed"
                    and snap.identity.world_size == identity.world_size
                ):
                    found, buf = snap, memoryview(snap.buffer)
        if found is None or (found.segment and not self._intact(found, buf)):
            return None
        return RestoreData(
            step, found.tensors, found.tree, found.total_bytes, "memory", "", iter([buf]), found.restores
        )

    def _intact(self, snap: Snapshot, buf: memoryview) -> bool:
        """A shared segment is writable by its trainer: check it still holds what was uploaded
        (when the objects are its slices; an encoded checkpoint is trusted as held)."""
        if not snap.objects:
            return True
        start = 0
        for obj in snap.objects:
            got = mf.crc32(buf[start : start + obj.size])
            if got != obj.crc32:
                log.error(
                    "rank %d: step %d in shared memory changed since upload (%s: crc32 %s != %s); "
                    "reading it from storage instead",
                    snap.identity.rank,
                    snap.step,
                    obj.key,
                    got,
                    obj.crc32,
                )
                return False
            start += obj.size
        return start == len(buf)

    def _from_storage(self, identity: Identity, step: int) -> RestoreData:
        ns, job = identity.namespace, identity.job
        commit = mf.read_commit(self.store, ns, job, step)
        if commit.world_size != identity.world_size:
            raise FailedPrecondition(
                f"step {step} was saved by {commit.world_size} ranks; this job runs {identity.world_size}. "
                "Changing the world size needs resharding, which this version does not do"
            )
        manifest = mf.load_manifest(self.store, commit, identity.rank)

        def load(older: int) -> mf.Manifest:
            return mf.load_manifest(self.store, mf.read_commit(self.store, ns, job, older), identity.rank)

        pieces = read_snapshot(self.store, manifest, load, self._uploads)
        return RestoreData(
            step,
            manifest.tensors,
            manifest.tree,
            manifest.total_bytes,
            "storage",
            "",
            iter(pieces),
            manifest.restores,
        )

    # --- queries --------------------------------------------------------------------------

    def list_checkpoints(self, namespace: str, job: str) -> list[tuple[mf.Commit, bool]]:
        out = []
        for step in mf.committed_steps(self.store, namespace, job):
            commit = mf.read_commit(self.store, namespace, job, step)
            out.append((commit, self.in_memory(namespace, job, step)))
        return out

    def in_memory(self, namespace: str, job: str, step: int) -> bool:
        with self._lock:
            return any(
                s.step == step and s.state == "committed"
                for (ns, jb, _), held in self._slots.items()
                if ns == namespace and jb == job
                for s in held
            )

    def describe(self, namespace: str, job: str, step: int, rank: int) -> tuple[mf.Commit, bytes]:
        commit = mf.read_commit(self.store, namespace, job, step)
        ref = commit.manifest_for(rank)
        return commit, self.store.get(ref.key)

    def snapshots(self) -> list[Snapshot]:
        with self._lock:
            return [s for held in self._slots.values() for s in held]


def check_protocol(version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise FailedPrecondition(
            f"protocol version {version} is not supported; this sidecar speaks {PROTOCOL_VERSION}. "
            "Upgrade the trainer client and the sidecar together"
        )
