"""The sidecar's core: holds snapshots in memory, drives upload and commit,
serves restores. The gRPC servicer only translates messages into these calls.

Memory policy per rank (REFT's double buffering): the newest committed
snapshot stays in memory for fast restore, plus at most
``max_held_snapshots - 1`` in flight. A save beyond that is refused with
RESOURCE_EXHAUSTED rather than queued: memory stays bounded and the trainer
learns at once.

Commit protocol (sidecar.manifest): every rank of a generation runs as the
attempt its rank-0 sidecar allocated in storage (EPOCH record) and restores
the step that record names. Rank 0's sidecar writes the job-level COMMIT once
every rank's MANIFEST is durable; other sidecars tell it so with hints
(sidecar.gang), and storage is asked only when hints are late.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sidecar import manifest as mf
from sidecar import reporting
from sidecar.api import EXIT_LIMIT_SPENT, LIMIT_SPENT_MARKER, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, pb
from sidecar.api.dtypes import expected_nbytes
from sidecar.budget import MemoryBudget, Reservation, default_limit
from sidecar.config import SidecarSettings
from sidecar.errors import (
    Aborted,
    AlreadyExists,
    CorruptObject,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ObjectNotFound,
    PreconditionFailed,
    ResourceExhausted,
    StorageError,
    StrataError,
)
from sidecar.faults import fault_point
from sidecar.gang import JobGang, Peers, Position
from sidecar.metrics import Metrics
from sidecar.pipeline import encode as enc
from sidecar.pipeline import upload_snapshot
from sidecar.pipeline.plan import Chain, SnapshotEncoder, decode_held, read_snapshot
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
    #: restart count as the trainer knows it (informational; storage allocates the attempt)
    attempt: int
    #: generation the trainer declares ("RUN/RESTART"); a generation file wins over it
    generation: str = ""

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

    @property
    def job_key(self) -> tuple[str, str]:
        return (self.namespace, self.job)


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
    #: storage-allocated attempt (EPOCH) of the generation that saved it
    attempt: int = 0
    generation: str = ""
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
    #: this rank's MANIFEST is durable (from then on the rank never reports a skip of the step)
    manifest_durable: bool = False
    #: the stored tensor entries (per-tensor crc32 of what the trainer saved; encodings)
    stored: list[mf.TensorEntry] = field(default_factory=list)
    #: its buffer's share of the memory budget (streamed saves; shared segments are the trainer's)
    memory: Reservation | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def position(self) -> Position:
        return (self.attempt, self.step)


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
    #: the restore buffer's share of the memory budget, released once the data is dropped
    memory: Reservation | None = None


class Engine:
    def __init__(
        self, settings: SidecarSettings, store: Store, metrics: Metrics, peers: Peers | None = None
    ) -> None:
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
        self._gangs: dict[tuple[str, str], JobGang] = {}
        self.peers = peers if peers is not None else Peers([])
        self.segments = Segments(check_dir(settings.shm_dir))
        self.quant = quantization(settings)
        limit, source = (
            (settings.memory_budget, "--memory-budget") if settings.memory_budget else default_limit()
        )
        self.memory = MemoryBudget(
            limit,
            source,
            on_change=self._memory_changed,
            on_refused=lambda kind: metrics.memory_refusals.labels(kind).inc(),
        )
        metrics.memory_budget.set(limit)
        # Per rank: the budget share of its held lossy forms (_held_layers)
        self._held_memory: dict[tuple[str, str, int], Reservation] = {}
        # Per rank: what its newest committed checkpoint consists of (for the next diff), and the
        # COMMIT of every step of that chain (diffs name their base by COMMIT key and sha256).
        self._chains: dict[tuple[str, str, int], Chain] = {}
        self._chain_refs: dict[tuple[str, str, int], dict[int, mf.CommitRef]] = {}
        # Per rank: the stored form of every lossy tensor of that chain, step by step, so a memory
        # restore gives exactly the values a storage restore gives (and every rank agrees).
        self._held_layers: dict[
            tuple[str, str, int], list[tuple[int, list[mf.TensorEntry], dict[str, bytes]]]
        ] = {}
        # Per job: restores seen, carried forward in manifests (bit-width escalation).
        self._restores: dict[tuple[str, str], int] = {}
        self._stopping = threading.Event()
        # Tests and chaos runs only: behave like a zombie that never learns of a newer attempt on
        # its commit path (the check-then-act race, made certain). Readers must still be safe.
        self._stale_fences = os.environ.get("STRATA_TEST_STALE_FENCES") == "1"
        self._unusable: dict[tuple[str, str], set[Position]] = {}
        # Restores read ahead by prefetch(): slot -> (position, ready event, data or None)
        self._prefetched: dict[
            tuple[str, str, int], tuple[Position | None, threading.Event, RestoreData | None]
        ] = {}
        # Single ranks of protocol-1 clients (which declare no generation): slot -> the
        # generation this sidecar gave the trainer process at its handshake (see greet).
        self._v1_solo: dict[tuple[str, str, int], str] = {}
        # Reports to the operator (sidecar.reporting; off without --report-url). Per rank, what its
        # heartbeats say; per job, the attempt of each step reported committed (for delete reports).
        self._beats: dict[tuple[str, str, int], dict[str, Any]] = {}
        self._reported: dict[tuple[str, str], dict[int, int]] = {}
        self.reporter = reporting.Reporter(
            settings.report_url,
            metrics.registry,
            token_file=settings.report_token_file,
            ca_file=settings.report_ca_file,
            heartbeat_s=settings.heartbeat_s,
            heartbeats=self._heartbeat_items,
        )

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _committer_for(self, identity: Identity) -> ThreadPoolExecutor:
        with self._lock:
            pool = self._committers.get(identity.slot)
            if pool is None:
                pool = ThreadPoolExecutor(1, thread_name_prefix=f"strata-commit-r{identity.rank}")
                self._committers[identity.slot] = pool
            return pool

    def close(self) -> None:
        """Finish uploads in progress; commits still waiting for other ranks give up. Peers
        learn that this sidecar's ranks save nothing more."""
        # Peers first, while every snapshot still counts as uploading: a step whose MANIFEST is
        # durable here may still commit without this sidecar, so nobody may abort it for us.
        ranks = {(s.identity.job_key, s.identity.rank, s.attempt) for s in self.snapshots()}
        for job_key, rank, attempt in ranks:
            self._announce_gone(job_key, rank, attempt, "its sidecar is stopping")
        self._stopping.set()
        for snap in self.snapshots():
            gang = self.gang(snap.identity.job_key)
            with gang.cond:
                gang.cond.notify_all()
        with self._lock:
            pools = list(self._committers.values())
        for pool in pools:
            pool.shutdown(wait=True)
        self._uploads.shutdown(wait=True)
        self.segments.close()
        self.peers.close()
        self.reporter.close(reporting.FLUSH_TIMEOUT_S)  # the commits just finished are reported too

    # --- generations and attempts -----------------------------------------------------------

    def gang(self, job_key: tuple[str, str]) -> JobGang:
        with self._lock:
            gang = self._gangs.get(job_key)
            if gang is None:
                gang = self._gangs[job_key] = JobGang(self.store, *job_key, self.settings.keep)
            return gang

    def generation_of(self, identity: Identity) -> mf.Generation:
        """The generation file when the sidecar has one (the launcher or a downward-API volume
        writes it), else what the trainer declares."""
        declared = identity.generation.strip()
        path = self.settings.generation_file
        if not path and self.settings.generation:
            if declared.startswith("solo-"):
                declared = ""
            try:
                fixed = mf.Generation.parse(self.settings.generation)
            except ValueError as exc:
                raise FailedPrecondition(f"--generation: {exc}") from None
            if declared and declared != str(fixed):
                raise FailedPrecondition(
                    f"the trainer declares generation {declared}, but this sidecar's is {fixed}: a trainer "
                    "of another gang generation reached this sidecar"
                )
            return fixed
        if path:
            if declared.startswith("solo-"):
                declared = ""  # a lone trainer's own default yields to the pod's file
            try:
                with open(path) as f:  # read each time: it changes when the gang restarts
                    text = f.read().strip()
            except OSError as exc:
                raise FailedPrecondition(f"cannot read the generation file {path}: {exc}") from None
            try:
                generation = mf.Generation.parse(text)
            except ValueError as exc:
                raise FailedPrecondition(f"generation file {path}: {exc}") from None
            if declared and declared != str(generation):
                raise FailedPrecondition(
                    f"the trainer declares generation {declared}, but this pod's generation file says "
                    f"{generation}: a trainer of another gang generation reached this sidecar"
                )
            return generation
        if not declared:
            with self._lock:
                declared = self._v1_solo.get(identity.slot, "") if identity.world_size == 1 else ""
        if not declared:
            raise FailedPrecondition(
                "no gang generation: run under `strata launch` or the operator, set STRATA_GENERATION="
                "RUN/RESTART for every rank, or give the sidecar --generation-file (a trainer client of "
                "protocol 1 never declares one: its ranks need the generation file)"
            )
        try:
            return mf.Generation.parse(declared)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None

    def greet(self, identity: Identity, protocol_version: int, handshake: bool = False) -> None:
        """Check the client's protocol. A protocol-1 client declares no generation: without a
        generation file, a single rank gets one of its own at each handshake (one trainer
        process, as a protocol-2 client's own "solo-" default), and at its first save or
        restore here when its handshake went to an earlier sidecar process."""
        check_protocol(protocol_version)
        if (
            protocol_version >= 2
            or identity.generation
            or self.settings.generation_file
            or self.settings.generation
        ):
            return
        if identity.world_size != 1:
            return  # generation_of refuses it, naming the generation file
        with self._lock:
            if handshake or identity.slot not in self._v1_solo:
                self._v1_solo[identity.slot] = f"solo-v1-{uuid.uuid4().hex[:16]}/0"

    def epoch_for(self, identity: Identity) -> mf.Epoch:
        """The attempt ``identity``'s generation runs as: rank 0's sidecar creates it (after
        settling what it still uploads), every other rank waits until it exists."""
        epoch = self._epoch_for(identity)
        self._note_rank(identity, epoch)
        return epoch

    def check_not_stopped(self, identity: Identity) -> None:
        """The operator spent the job's restart limit and released this pod only so that its trainer
        exits with EXIT_LIMIT_SPENT (the Job's podFailurePolicy then fails the Job): refuse it at
        the handshake, every restore and every attempt, so it never trains."""
        if self._read_restore_request() == "stop":
            raise FailedPrecondition(
                f"{LIMIT_SPENT_MARKER}: the operator stopped {identity.job_key[0]}/{identity.job_key[1]}; "
                f"nothing is restored or saved (the trainer exits {EXIT_LIMIT_SPENT})"
            )

    def _epoch_for(self, identity: Identity) -> mf.Epoch:
        self.check_not_stopped(identity)
        generation = self.generation_of(identity)
        gang = self.gang(identity.job_key)
        with gang.cond:
            if gang.epoch is not None and gang.epoch.generation == str(generation):
                return gang.epoch
            current = gang.generation
            if current is not None and current.run == generation.run and current.restart > generation.restart:
                raise FailedPrecondition(
                    f"generation {generation} is older than {current}, which this sidecar already serves"
                )
            if gang.generation != generation:
                gang.generation = generation
                gang.cond.notify_all()  # commits of the previous generation stop waiting soon
        if identity.rank != 0:
            # Never under epoch_lock: rank 0 of this very sidecar may be about to create it.
            epoch = self._find_or_create_epoch(identity, gang, generation)
            with gang.epoch_lock:
                if gang.epoch is None or gang.epoch.attempt < epoch.attempt:
                    self._adopt(gang, epoch)
            return epoch
        with gang.epoch_lock:
            with gang.cond:
                if gang.epoch is not None and gang.epoch.generation == str(generation):
                    return gang.epoch
            epoch = self._find_or_create_epoch(identity, gang, generation)
            self._adopt(gang, epoch)
            self._report_retained(gang)
            return epoch

    def _find_or_create_epoch(self, identity: Identity, gang: JobGang, generation: mf.Generation) -> mf.Epoch:
        ns, job = identity.job_key
        deadline = time.monotonic() + self.settings.commit_timeout_s
        delay = 0.05
        if identity.rank == 0:
            self._settle(identity)
        while True:
            with gang.cond:  # adopted by this sidecar's own rank 0 meanwhile?
                if gang.epoch is not None and gang.epoch.generation == str(generation):
                    return gang.epoch
            fences = gang.refresh_fences()
            newest = fences.newest
            if newest is not None and newest.generation == str(generation):
                return newest
            if str(generation) in fences.generations.values():
                raise FailedPrecondition(
                    f"{ns}/{job}: generation {generation} was superseded (attempt "
                    f"{fences.newest_attempt} runs generation {newest.generation if newest else '?'}); "
                    "this trainer belongs to a gang that was restarted"
                )
            if newest is not None:
                try:
                    there = mf.Generation.parse(newest.generation)
                except ValueError:
                    there = None
                if there is not None and there.run == generation.run and there.restart > generation.restart:
                    raise FailedPrecondition(
                        f"{ns}/{job}: generation {generation} was superseded by {there} (attempt "
                        f"{newest.attempt}); this trainer belongs to a gang that was restarted"
                    )
            if identity.rank == 0:
                restore, reason = self._decide_restore(identity, fences)
                try:
                    return mf.create_epoch(
                        self.store, ns, job, generation, identity.world_size, restore, fences, reason
                    )
                except PreconditionFailed:
                    # Another writer took that attempt number: read again, decide again.
                    if time.monotonic() > deadline:
                        raise FailedPrecondition(
                            f"{ns}/{job}: could not allocate an attempt within "
                            f"{self.settings.commit_timeout_s:.0f} s (other writers kept taking it)"
                        ) from None
                    time.sleep(delay)
                    delay = min(delay * 1.5, 1.0)
                    continue
            if self._stopping.is_set() or time.monotonic() > deadline:
                raise FailedPrecondition(
                    f"{ns}/{job}: rank 0 of generation {generation} did not record its attempt within "
                    f"{self.settings.commit_timeout_s:.0f} s"
                )
            with gang.cond:
                gang.cond.wait(delay)
            delay = min(delay * 1.5, 1.0)

    def _decide_restore(self, identity: Identity, fences: mf.Fences) -> tuple[Position | None, str]:
        """The restore step of a new attempt and how it was chosen (recorded in its EPOCH): the
        operator's one-shot restore request when this pod has one, else the newest usable commit."""
        ns, job = identity.job_key
        unusable = mf.unusable_commits(self.store, ns, job) | self._unusable.get(identity.job_key, set())
        request = self._restore_request()
        if request is None:
            return mf.newest_valid(self.store, ns, job, fences, exclude=unusable), ""
        if request == "none":
            log.info("%s/%s: restore request: none (a fresh start; older commits are fenced off)", ns, job)
            return None, "fresh"
        step = int(request)
        attempts = [
            a
            for a in mf.step_commits(self.store, ns, job, step)
            if fences.valid(a, step) and (a, step) not in unusable
        ]
        problem = "" if attempts else "it has no valid, usable COMMIT"
        if attempts:
            try:
                commit = mf.read_commit(self.store, ns, job, step, attempts[-1])
            except (ObjectNotFound, CorruptObject) as exc:
                problem = f"its COMMIT is unreadable ({exc})"
            else:
                if commit.world_size != identity.world_size:
                    problem = (
                        f"it was saved by {commit.world_size} ranks and this job runs {identity.world_size}"
                    )
        if problem:
            valid = sorted(
                {s for a, s in mf.valid_commits(self.store, ns, job, fences) if (a, s) not in unusable}
            )
            raise FailedPrecondition(
                f"{ns}/{job}: the operator's restore request names step {step}, but {problem}; "
                f"valid committed steps: {valid or 'none'}. Nothing was restored or deleted"
            )
        log.info("%s/%s: restore request: step %d (attempt %d)", ns, job, step, attempts[-1])
        return (attempts[-1], step), "requested"

    def _read_restore_request(self) -> str:
        """The restore request file's text ("" when there is none or it cannot be read: only a new
        attempt acts on it, and reports a bad one)."""
        path = self.settings.restore_request_file
        if not path:
            return ""
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return ""

    def _restore_request(self) -> str | None:
        """The pod's one-shot restore request: "none", a step number, "stop" (the restart limit is
        spent), or None (no file, or empty)."""
        path = self.settings.restore_request_file
        if not path:
            return None
        try:
            with open(path) as f:
                text = f.read().strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise FailedPrecondition(f"cannot read the restore request file {path}: {exc}") from None
        if not text:
            return None
        if text not in ("none", "stop") and not text.isdigit():
            raise FailedPrecondition(
                f"restore request file {path} holds {text[:64]!r}: expected a committed step number, "
                "none or stop"
            )
        return text

    def _mark_unusable(self, identity: Identity, position: Position, reason: str) -> None:
        # Also remembered here: a marker that failed to write must not send us round in circles.
        self._unusable.setdefault(identity.job_key, set()).add(position)
        mf.mark_unusable(self.store, *identity.job_key, position, reason)

    def _adopt(self, gang: JobGang, epoch: mf.Epoch) -> None:
        """Run as ``epoch`` from now on: snapshots and chains it fenced off are dropped."""
        with gang.cond:
            gang.epoch = epoch
            if epoch.attempt > gang.fences.newest_attempt:
                names = dict(gang.fences.generations)
                if gang.fences.newest is not None:
                    names[gang.fences.newest.attempt] = gang.fences.newest.generation
                gang.fences = mf.Fences(
                    {**gang.fences.restores, epoch.attempt: epoch.restore_step}, epoch, names
                )
            fences = gang.fences
            gang.cond.notify_all()
        self.metrics.attempt.labels(gang.job).set(epoch.attempt)
        with self._lock:
            for slot, held in self._slots.items():
                if slot[:2] != (gang.namespace, gang.job):
                    continue
                for snap in list(held):
                    if snap.state == "committed" and not fences.valid(*snap.position):
                        held.remove(snap)
                        _drop_buffer(snap)
                refs = self._chain_refs.get(slot, {})
                if any(not fences.valid(r.attempt, r.step) for r in refs.values()):
                    self._chains.pop(slot, None)
                    self._chain_refs.pop(slot, None)
                    self._held_layers.pop(slot, None)
                    self._account_held(slot)
        self._update_held_gauge()

    # --- reports to the operator (best effort; never on the commit path) --------------------

    def _note_rank(self, identity: Identity, epoch: mf.Epoch) -> None:
        """What this rank's heartbeats say: its generation and attempt (saves and step as they go)."""
        if not self.reporter.enabled:
            return
        with self._lock:
            beat = self._beats.get(identity.slot)
            if beat is None:
                beat = self._beats[identity.slot] = {
                    "kind": "heartbeat",
                    "namespace": identity.namespace,
                    "job": identity.job,
                    "rank": identity.rank,
                    "step": None,
                    "saves": 0,
                }
            beat.update(generation=epoch.generation, attempt=epoch.attempt, restore_step=epoch.restore_step)

    def _heartbeat_items(self) -> list[dict[str, Any]]:
        now = time.time()
        with self._lock:
            return [{**beat, "time": now} for beat in self._beats.values()]

    def _report_heartbeat(self, slot: tuple[str, str, int]) -> None:
        with self._lock:
            beat = self._beats.get(slot)
            item = None if beat is None else {**beat, "time": time.time()}
        if item is not None:
            self.reporter.report(item)

    def _location(self, namespace: str, job: str) -> str:
        return reporting.location(self.settings.storage, namespace, job)

    def _report_commit(
        self, commit: mf.Commit, ref: mf.CommitRef, bodies: dict[int, tuple[str, bytes]]
    ) -> None:
        """Queue the commit report; it is built in the reporting thread (off the commit path)."""
        if not self.reporter.enabled:
            return
        try:
            with self._lock:
                self._reported.setdefault((commit.namespace, commit.job), {})[commit.step] = commit.attempt
            where = self._location(commit.namespace, commit.job)
            self.reporter.report(lambda: reporting.commit_item(commit, ref.sha256, bodies, where))
        except Exception:  # a report never fails a commit
            log.exception("step %d committed; its report to the operator failed", commit.step)

    def _report_retained(self, gang: JobGang) -> None:
        """Rank 0 of a new attempt re-reports every retained committed step (the operator may
        have missed them while it was down), read from storage in the background."""
        if not self.reporter.enabled:
            return
        fences = gang.fences
        ns, job = gang.namespace, gang.job

        def read() -> None:
            try:
                positions = mf.valid_commits(self.store, ns, job, fences)
                with self._lock:
                    self._reported.setdefault((ns, job), {}).update({s: a for a, s in positions})
                items = reporting.stored_commit_items(self.store, ns, job, self._location(ns, job), positions)
                for item in items:
                    self.reporter.report(item)
                log.info("%s/%s: re-reported %d retained committed steps", ns, job, len(items))
            except Exception as exc:
                log.warning("%s/%s: retained steps not re-reported: %s", ns, job, exc)

        threading.Thread(target=read, name="strata-rereport", daemon=True).start()

    def _report_deletes(self, gang: JobGang, deleted: list[int], known: dict[int, list[int]]) -> None:
        if not deleted or not self.reporter.enabled:
            return
        key = (gang.namespace, gang.job)
        for step in deleted:
            with self._lock:
                attempt = self._reported.get(key, {}).pop(step, None)
            if attempt is None:  # not reported by this process: the newest valid commit retention knew
                attempts = [a for a in known.get(step, []) if gang.fences.valid(a, step)]
                if not attempts:
                    continue
                attempt = attempts[-1]
            self.reporter.report(reporting.delete_item(gang.namespace, gang.job, step, attempt))

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
        identity.validate()
        self.greet(identity, protocol_version)
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
        epoch = self.epoch_for(identity)
        if epoch.restore is not None and step <= epoch.restore[1]:
            raise AlreadyExists(
                f"step {step} of {identity.namespace}/{identity.job}: attempt {epoch.attempt} resumed from "
                f"step {epoch.restore[1]}; it saves later steps only (committed checkpoints are never "
                "overwritten)"
            )
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
                if snap.position == (epoch.attempt, step) and snap.state == "committed":
                    raise AlreadyExists(f"step {step} of {identity.namespace}/{identity.job} is committed")
            if len(held) >= self.settings.max_held_snapshots:
                busy = ", ".join(f"step {s.step} {s.state}" for s in held)
                raise ResourceExhausted(
                    f"rank {identity.rank} already holds {len(held)} snapshots ({busy}); "
                    "save less often or wait for the previous upload"
                )
            memory = None
            if segment is None:
                what = f"the streamed save of step {step} (rank {identity.rank})"
                try:
                    memory = self.memory.reserve("snapshot", offset, what, retry=True)
                except ResourceExhausted:
                    # The committed copy in memory is a cache (storage has it): give it up before
                    # refusing. The next checkpoint of this rank is then a full one.
                    for old in [s for s in held if s.state == "committed" and s.memory is not None]:
                        held.remove(old)
                        _drop_buffer(old)
                        log.info(
                            "rank %d: dropped step %d from memory to fit %s", identity.rank, old.step, what
                        )
                    memory = self.memory.reserve("snapshot", offset, what)
                buffer = _zeroed(offset)
            else:  # mapping is cheap (no page is touched); under the lock so a refused save maps nothing
                buffer = self.segments.view(segment[0], offset, identity.slot)
            snap = Snapshot(identity, step, save_id, entries, tree_value, offset, buffer, memory=memory)
            snap.attempt, snap.generation = epoch.attempt, epoch.generation
            snap.touched = {t.name: t.touched for t in tensors if t.touched}
            if segment is not None:
                snap.segment, snap.received = segment[0], offset
            held.append(snap)
            beat = self._beats.get(identity.slot)
            if beat is not None:
                beat["saves"] += 1
        self._update_held_gauge()
        self.rank_back(identity, epoch.attempt)  # saving: whatever a dropped stream said no longer holds
        return snap

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
        gang = self.gang(ident.job_key)
        t0 = time.perf_counter()
        encoder: SnapshotEncoder | None = None
        scratch: Reservation | None = None
        try:
            prefix = mf.rank_prefix(
                ident.namespace, ident.job, snap.step, snap.attempt, snap.save_id, ident.rank
            )
            encoder = self._encoder(snap)
            out = encoder.outcome
            refs = self._chain_refs.get(ident.slot, {})
            # Encoded pieces in flight plus the held copies of lossy forms (a lossless full is
            # uploaded as views of the buffer: nothing).
            scratch = self.memory.reserve(
                "encode", 2 * encoder.scratch_bytes(), f"encoding step {snap.step} (rank {ident.rank})"
            )

            built: list[mf.Manifest] = []

            def make_manifest(objects: list[mf.ObjectEntry]) -> mf.Manifest:
                snap.stored = out.tensors
                view = memoryview(snap.buffer)
                for t in out.tensors:  # what a lossless restore must reproduce, from any source
                    t.crc32 = mf.crc32(view[t.offset : t.offset + t.nbytes])
                if out.kind == "full" and all(t.stored_offset < 0 for t in out.tensors):
                    snap.objects = objects  # slices of the buffer
                manifest = mf.Manifest(
                    ident.namespace,
                    ident.job,
                    snap.step,
                    ident.rank,
                    ident.world_size,
                    snap.attempt,
                    snap.save_id,
                    snap.total_bytes,
                    snap.tree,
                    out.tensors,
                    objects,
                    checkpoint=out.kind,
                    base_step=out.base_step,
                    base_commit=None if out.base_step is None else refs[out.base_step],
                    requires=out.requires,
                    required_commits=[refs[s] for s in out.requires],
                    policy=self.settings.policy,
                    restores=snap.restores,
                    generation=snap.generation,
                )
                built.append(manifest)
                return manifest

            ref = upload_snapshot(
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
            snap.manifest_durable = True
            self.metrics.upload_duration.labels(job).observe(time.perf_counter() - t0)
            with gang.cond:
                news = gang.news(snap.position)
                news.manifests[ident.rank] = ref.key
                news.bodies[ident.rank] = built[0].to_json()  # the bytes write_manifest stored
                gang.cond.notify_all()
            self._hint(gang, snap.position, manifest=pb.ManifestHint(rank=ident.rank, key=ref.key))
            fault_point("sidecar.commit.before", snap.step)
            if ident.rank == 0:
                commit_ref = self._commit_as_rank0(snap, gang)
            else:
                commit_ref = self._await_commit(snap, gang)
        except (StrataError, OSError) as exc:
            if isinstance(exc, StorageError):
                self.metrics.storage_errors.labels(job, "put").inc()
            self.metrics.checkpoints.labels(job, "failed").inc()
            snap.state, snap.message = "failed", f"step {snap.step} not committed: {exc}"
            log.error("rank %d: %s", ident.rank, snap.message)
            self._release(snap)
            if not snap.manifest_durable and not isinstance(exc, Aborted):
                # Tell the other ranks' commit not to wait for this one (a durable MANIFEST
                # is never withdrawn: the step may still commit without this sidecar).
                try:
                    self._skip(ident, snap.attempt, snap.step, snap.message)
                except (StrataError, OSError) as marker_exc:
                    log.debug("could not leave the skip marker: %s", marker_exc)
            elif ident.rank == 0:  # no COMMIT will come: ranks waiting for it here and elsewhere stop
                with gang.cond:
                    gang.news(snap.position).skipped.setdefault(0, snap.message)
                    gang.cond.notify_all()
                self._hint(gang, snap.position, skip=pb.SkipHint(rank=0, reason=snap.message))
        except Exception as exc:  # never let a bug leave a waiter hanging
            log.exception("rank %d: unexpected error persisting step %d", ident.rank, snap.step)
            self.metrics.checkpoints.labels(job, "failed").inc()
            snap.state, snap.message = "failed", f"internal error: {exc!r}"
            self._release(snap)
        else:
            assert encoder is not None
            out = encoder.outcome
            if scratch is not None:  # the upload is done: only the held forms stay charged
                scratch.release()
            with self._lock:
                self._chains[ident.slot] = chain = encoder.next_chain()
                kept = {s: r for s, r in self._chain_refs.get(ident.slot, {}).items() if s in chain.steps}
                kept[snap.step] = commit_ref
                self._chain_refs[ident.slot] = kept
                layers = [x for x in self._held_layers.get(ident.slot, []) if x[0] in chain.steps[:-1]]
                layers.append((snap.step, out.tensors, out.held))
                self._held_layers[ident.slot] = layers if any(h for _, _, h in layers) else []
                self._account_held(ident.slot)
            self.metrics.encoded.labels(job, out.kind).inc()
            self.metrics.quantization_error.labels(job).set(out.max_error)
            if out.tracking_mismatches:
                self.metrics.value_diff_fallbacks.labels(job).inc(out.tracking_mismatches)
            if out.changed_ratio is not None:
                self.metrics.changed_rows.labels(job).set(out.changed_ratio)
            snap.state = "committed"
            snap.commit_key = commit_ref.key
            self.metrics.checkpoints.labels(job, "committed").inc()
            self.metrics.last_commit.labels(job).set(time.time())
            self.metrics.last_committed_step.labels(job).set(snap.step)
            log.info("rank %d: step %d committed (%d bytes)", ident.rank, snap.step, snap.total_bytes)
            self._keep_newest_committed(snap)
            with self._lock:
                beat = self._beats.get(ident.slot)
                if beat is not None:
                    beat["step"] = snap.step
        finally:
            if scratch is not None:
                scratch.release()
            snap.done.set()
        if snap.state == "committed" and ident.rank == 0:
            self._report_heartbeat(ident.slot)
            # After the trainer hears "committed": retention is not on the path to durable.
            self._collect_garbage(snap, gang)

    def _encoder(self, snap: Snapshot) -> SnapshotEncoder:
        """Full or diff against the rank's newest committed snapshot, if it is still held."""
        ident = snap.identity
        previous = None
        with self._lock:
            chain = self._chains.get(ident.slot)
            snap.restores = self._restores.get(ident.job_key, 0)
            for held in self._slots.get(ident.slot, []):
                if chain is not None and held.state == "committed" and held.step == chain.steps[-1]:
                    previous = memoryview(held.buffer)
            refs = self._chain_refs.get(ident.slot, {})
            if chain is not None and not all(s in refs for s in chain.steps):
                chain, previous = None, None  # a base without a known COMMIT: start a new chain
            hold = frozenset(n for _, _, held in self._held_layers.get(ident.slot, []) for n in held)
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
            check_fraction=self.settings.tracking_check_fraction,
            check_confidence=self.settings.tracking_check_confidence,
            hold=hold if chain is not None else frozenset(),
        )

    # --- the commit ------------------------------------------------------------------------

    def _hint(self, gang: JobGang, position: Position, **hint: Any) -> None:
        self.peers.send(
            pb.HintRequest(
                namespace=gang.namespace, job=gang.job, attempt=position[0], step=position[1], **hint
            )
        )

    def on_hint(self, req: pb.HintRequest) -> None:
        """A hint from another sidecar of the job (sidecar.gang.PeerServicer)."""
        self.gang((req.namespace, req.job)).apply_hint(req)

    def _poll_interval(self) -> float:
        # With peers, hints normally arrive first and storage is only a fallback; a sidecar that
        # serves every rank itself needs no polling at all; without peers, poll sooner.
        return self.settings.hint_fallback_s if self.peers else min(1.0, self.settings.hint_fallback_s)

    def _check_fence(self, gang: JobGang, position: Position, refresh: bool) -> None:
        if self._stale_fences:
            return
        fences = gang.refresh_fences() if refresh else gang.fences
        if not fences.valid(*position):
            self.metrics.superseded.labels(gang.job).inc()
            newest = fences.newest
            assert newest is not None
            raise Aborted(
                f"step {position[1]} of attempt {position[0]} superseded: attempt {newest.attempt} "
                f"(generation {newest.generation}) restores step {newest.restore_step}"
            )

    def _commit_as_rank0(self, snap: Snapshot, gang: JobGang) -> mf.CommitRef:
        ident = snap.identity
        position = snap.position
        deadline = time.monotonic() + self.settings.commit_timeout_s
        interval = self._poll_interval()
        next_poll = time.monotonic() + interval
        asked_after_restart = confirmed_gone = False
        while True:
            with gang.cond:
                news = gang.news(position)
                missing = sorted(set(range(ident.world_size)) - set(news.manifests))
                skipped = {r: why for r, why in news.skipped.items() if r in missing}
                gone = gang.gone_reason(position, missing)
                known = dict(news.manifests)
            if not missing:
                bodies = self._verified_manifests(gang, position, known, ident.world_size)
                if bodies is not None:
                    break
                continue
            if skipped:
                raise Aborted(f"step {snap.step} cannot commit: rank(s) {sorted(skipped)} did not save it")
            if gone:
                if not confirmed_gone:  # a MANIFEST hint may have been lost: ask storage once
                    confirmed_gone = True
                    next_poll = time.monotonic()
                else:
                    raise Aborted(f"step {snap.step} cannot commit: {gone}")
            self._check_fence(gang, position, refresh=False)
            if self._stopping.is_set():
                raise Aborted(f"step {snap.step}: the sidecar is stopping; ranks {missing} never saved it")
            with gang.cond:
                restarted = gang.generation is not None and str(gang.generation) != snap.generation
                elsewhere = gang.gone.get(snap.attempt, {})
                still = all(r in elsewhere and snap.step in elsewhere[r] for r in missing)
            if restarted and not still:
                # The gang restarted (its new rank 0 waits for this commit to settle) and no sidecar
                # said it is still uploading the missing ranks' snapshots: ask storage once, then stop.
                if asked_after_restart:
                    raise Aborted(
                        f"step {snap.step} of attempt {snap.attempt}: the gang restarted and ranks "
                        f"{missing} never saved it"
                    )
                asked_after_restart = True
                next_poll = time.monotonic()
            now = time.monotonic()
            if now > deadline:
                raise FailedPrecondition(
                    f"step {snap.step}: no MANIFEST from ranks {missing} "
                    f"after {self.settings.commit_timeout_s:.0f} s"
                )
            if now >= next_poll:  # hints are late: ask storage (one LIST), then wait longer
                state = mf.step_state(self.store, ident.namespace, ident.job, snap.step, snap.attempt)
                with gang.cond:
                    news = gang.news(position)
                    for rank, key in state.manifests.items():
                        news.manifests.setdefault(rank, key)
                    for rank in state.skipped:
                        news.skipped.setdefault(rank, "skip marker in storage")
                self._check_fence(gang, position, refresh=True)
                interval = min(interval * 2, 30.0)
                next_poll = time.monotonic() + interval
                continue
            with gang.cond:
                gang.cond.wait(min(next_poll, deadline) - now)
        # Storage decides: a newer attempt that fenced this step off wins over everything here.
        self._check_fence(gang, position, refresh=True)
        commit = mf.build_commit(
            ident.namespace, ident.job, snap.step, ident.world_size, snap.attempt, bodies, snap.generation
        )
        try:
            ref = mf.put_commit(self.store, commit)
        except PreconditionFailed as exc:
            raise Aborted(f"step {snap.step}: {exc}") from None
        with gang.cond:
            gang.news(position).committed = ref
            gang.retention.note_commit(commit)
            gang.cond.notify_all()
        self._hint(gang, position, commit=pb.CommitHint(key=ref.key))
        try:
            gang.latest_etag = mf.advance_latest(
                self.store, ident.namespace, ident.job, snap.attempt, snap.step, gang.latest_etag
            )
        except StorageError as exc:  # LATEST is a hint; discovery finds the COMMIT without it
            log.warning("step %d committed; LATEST not advanced: %s", snap.step, exc)
            gang.latest_etag = ""
        self._report_commit(commit, ref, bodies)  # after the COMMIT is durable, never before
        return ref

    def _verified_manifests(
        self, gang: JobGang, position: Position, known: dict[int, str], world_size: int
    ) -> dict[int, tuple[str, bytes]] | None:
        """Every rank's MANIFEST read back and checked (a hint is only a key); None after
        dropping a hint that does not hold up (the wait goes on)."""
        out: dict[int, tuple[str, bytes]] = {}
        for rank, key in known.items():
            with gang.cond:
                held = gang.news(position).bodies.get(rank)
            if held is not None:
                body = held
            else:
                try:
                    body = self.store.get(key)
                    m = mf.Manifest.from_json(body, key)
                    ok = key.startswith(mf.step_prefix(gang.namespace, gang.job, position[1])) and (
                        m.rank,
                        m.attempt,
                        m.step,
                        m.world_size,
                    ) == (rank, position[0], position[1], world_size)
                except (ObjectNotFound, CorruptObject):
                    ok = False
                if not ok:
                    log.warning(
                        "ignoring a hint: %s is not rank %d's MANIFEST of step %d", key, rank, position[1]
                    )
                    with gang.cond:
                        gang.news(position).manifests.pop(rank, None)
                    return None
                with gang.cond:
                    gang.news(position).bodies[rank] = body
            assert body is not None
            out[rank] = (key, body)
        return out

    def _await_commit(self, snap: Snapshot, gang: JobGang) -> mf.CommitRef:
        ident = snap.identity
        position = snap.position
        key = mf.commit_key(ident.namespace, ident.job, snap.step, snap.attempt)
        deadline = time.monotonic() + self.settings.commit_timeout_s
        interval = self._poll_interval()
        next_poll = time.monotonic() + interval
        asked_after_restart = False
        while True:
            with gang.cond:
                news = gang.news(position)
                if news.committed is not None:
                    return news.committed
                hinted, skipped = news.hinted_commit, dict(news.skipped)
                news.hinted_commit = ""
            poll = time.monotonic() >= next_poll
            if hinted == key or poll:
                ref = self._read_commit_for(key, ident.rank, snap)
                if ref is not None:
                    with gang.cond:
                        gang.news(position).committed = ref
                    return ref
                if poll:
                    state = mf.step_state(self.store, ident.namespace, ident.job, snap.step, snap.attempt)
                    skipped.update(
                        {r: "skip marker in storage" for r in state.skipped if r not in state.manifests}
                    )
                    self._check_fence(gang, position, refresh=True)
                    interval = min(interval * 2, 30.0)
                    next_poll = time.monotonic() + interval
            if skipped:
                raise Aborted(f"step {snap.step} cannot commit: rank(s) {sorted(skipped)} did not save it")
            with gang.cond:
                writer_gone = gang.gone_reason(position, [0])
            if writer_gone and poll:  # storage was asked just now and has no COMMIT
                raise Aborted(f"step {snap.step} cannot commit: {writer_gone}")
            if writer_gone:
                next_poll = time.monotonic()
                continue
            self._check_fence(gang, position, refresh=False)
            with gang.cond:
                restarted = gang.generation is not None and str(gang.generation) != snap.generation
            if restarted:  # a new generation runs here: ask storage once more, then stop waiting
                if asked_after_restart:
                    raise Aborted(
                        f"step {snap.step} of attempt {snap.attempt}: the gang restarted before it committed"
                    )
                asked_after_restart = True
                next_poll = time.monotonic()
                continue
            if self._stopping.is_set():
                # The MANIFEST is durable: rank 0 may still commit the step; say nothing to peers.
                raise Aborted(f"step {snap.step}: the sidecar stopped before rank 0 committed it")
            now = time.monotonic()
            if now > deadline:
                raise FailedPrecondition(f"rank 0 did not commit step {snap.step} in time")
            with gang.cond:
                if not gang.news(position).hinted_commit and gang.news(position).committed is None:
                    gang.cond.wait(max(0.0, min(next_poll, deadline) - now))

    def _read_commit_for(self, key: str, rank: int, snap: Snapshot) -> mf.CommitRef | None:
        """The COMMIT at ``key`` if it exists and lists this rank's MANIFEST of this save."""
        try:
            commit, digest = mf.read_commit_at(self.store, key)
        except ObjectNotFound:
            return None
        try:
            listed = commit.manifest_for(rank).key
        except NotFound:
            listed = ""
        if f"/a{snap.attempt:04d}-{snap.save_id}/rank-{rank}/" not in listed:
            raise Aborted(f"{key} does not list this rank's MANIFEST of step {snap.step}")
        return mf.CommitRef(key, digest)

    def _collect_garbage(self, snap: Snapshot, gang: JobGang) -> None:
        """Retention runs after rank 0's commit; a failure here never fails the save."""
        # The attempts retention knew of each step before the pass (for delete reports).
        known = (
            {step: list(attempts) for step, attempts in gang.retention._commits.items()}
            if self.reporter.enabled
            else {}
        )
        try:
            deleted = gang.retention.run(snap.attempt, gang.fences)
            self._report_deletes(gang, deleted, known)
        except (StrataError, OSError) as exc:
            log.warning(
                "retention of %s/%s failed (will retry after the next commit): %s",
                gang.namespace,
                gang.job,
                exc,
            )

    def _skip(self, identity: Identity, attempt: int, step: int, reason: str) -> None:
        gang = self.gang(identity.job_key)
        with gang.cond:
            news = gang.news((attempt, step))
            if identity.rank in news.manifests and news.bodies.get(identity.rank):
                return  # this rank's MANIFEST is durable: the step does not wait for it
            news.skipped.setdefault(identity.rank, reason)
            gang.cond.notify_all()
        self._hint(gang, (attempt, step), skip=pb.SkipHint(rank=identity.rank, reason=reason[:1024]))
        key = mf.skip_key(identity.namespace, identity.job, step, attempt, identity.rank)
        self.store.put(key, reason.encode()[:4096])
        log.info("rank %d will not save step %d: %s", identity.rank, step, reason)

    def report_skip(self, identity: Identity, step: int, reason: str) -> None:
        """The trainer will not save ``step``: the job-level commit of it fails at once."""
        identity.validate()
        epoch = self.epoch_for(identity)
        self._skip(identity, epoch.attempt, step, reason)

    def rank_gone(self, identity: Identity, attempt: int, reason: str) -> None:
        """The trainer's Attach stream (of ``attempt``) ended: it will save nothing more."""
        self._announce_gone(identity.job_key, identity.rank, attempt, reason)

    def rank_back(self, identity: Identity, attempt: int) -> None:
        """A trainer of ``attempt`` is here (again): it may save, whatever was said before."""
        gang = self.gang(identity.job_key)
        with gang.cond:
            was_gone = gang.gone.get(attempt, {}).pop(identity.rank, None) is not None
        if was_gone:
            self._hint(gang, (attempt, 0), gone=pb.GoneHint(rank=identity.rank, back=True))

    def peers_gone(
        self,
        identity: Identity,
        attempt: int,
        known: tuple[int, ...],
        timeout: float,
        until: threading.Event | None = None,
    ) -> tuple[int, ...]:
        """The other ranks of ``attempt`` that are gone (no step they have not saved yet can
        commit), as soon as that differs from ``known``, else after ``timeout`` or once ``until``
        is set (then call ``wake``)."""
        gang = self.gang(identity.job_key)

        def current() -> tuple[int, ...]:
            return tuple(sorted(r for r in gang.gone.get(attempt, {}) if r != identity.rank))

        def changed() -> bool:
            return current() != known or self._stopping.is_set() or (until is not None and until.is_set())

        with gang.cond:
            gang.cond.wait_for(changed, timeout)
            return current()

    def wake(self, identity: Identity) -> None:
        """Wake waiters of ``identity``'s job (``peers_gone``) to look at their ``until`` event."""
        gang = self.gang(identity.job_key)
        with gang.cond:
            gang.cond.notify_all()

    def _announce_gone(self, job_key: tuple[str, str], rank: int, attempt: int, reason: str) -> None:
        with self._lock:
            uploading = {  # complete streams: uploading, or durable and waiting for the COMMIT
                s.step
                for s in self._slots.get((*job_key, rank), [])
                if s.attempt == attempt and (s.state == "uploading" or s.manifest_durable)
            }
        gang = self.gang(job_key)
        with gang.cond:
            gang.gone.setdefault(attempt, {})[rank] = uploading
            gang.cond.notify_all()
        log.info(
            "rank %d of attempt %d: %s (still uploading steps %s)", rank, attempt, reason, sorted(uploading)
        )
        self._hint(
            gang, (attempt, 0), gone=pb.GoneHint(rank=rank, uploading=sorted(uploading), reason=reason)
        )

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
            _drop_buffer(snap)
        self._update_held_gauge()

    def _keep_newest_committed(self, snap: Snapshot) -> None:
        """Only the newest committed snapshot of a rank stays in memory."""
        with self._lock:
            held = self._slots.get(snap.identity.slot, [])
            committed = [s for s in held if s.state == "committed"]
            newest = max(committed, key=lambda s: s.position)
            for old in committed:
                if old is not newest:
                    held.remove(old)
                    _drop_buffer(old)
        self._update_held_gauge()

    def _memory_changed(self, budget: MemoryBudget) -> None:
        for kind, held in budget.held().items():
            self.metrics.memory_held.labels(kind).set(held)

    def _account_held(self, slot: tuple[str, str, int]) -> None:
        """Charge a rank's held lossy forms to the budget (caller holds ``self._lock``). When they
        do not fit they are dropped: memory restores of that chain then read storage."""
        old = self._held_memory.pop(slot, None)
        if old is not None:
            old.release()
        layers = self._held_layers.get(slot, [])
        size = sum(len(b) for _, _, held in layers for b in held.values())
        if not size:
            return
        try:
            what = f"rank {slot[2]}'s held lossy forms"
            self._held_memory[slot] = self.memory.reserve("encode", size, what)
        except (ResourceExhausted, FailedPrecondition) as exc:
            log.warning("rank %d: %s; its memory restores read storage instead", slot[2], exc)
            # A chain whose held forms have a gap cannot be replayed: the next checkpoint is full.
            self._held_layers[slot] = []
            self._chains.pop(slot, None)
            self._chain_refs.pop(slot, None)

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
        """The attempt's restore step (every rank of a generation restores the same one), or
        an explicit committed ``step``."""
        identity.validate()
        self.check_not_stopped(identity)
        ns, job = identity.job_key
        if step is not None:
            fences = self.gang(identity.job_key).refresh_fences()
            attempts = [a for a in mf.step_commits(self.store, ns, job, step) if fences.valid(a, step)]
            if not attempts:
                raise NotFound(f"step {step} of {ns}/{job} has no valid COMMIT")
            return self._served(identity, self._load(identity, (attempts[-1], step)))
        try:
            epoch = self.epoch_for(identity)
        except StorageError as exc:
            # Storage is unreachable: one rank alone cannot disagree with anyone, so it may
            # restore the newest snapshot this sidecar committed for it.
            held = self._newest_held(identity) if identity.world_size == 1 else None
            if held is None:
                raise
            log.warning("storage unreachable (%s); restoring step %d from memory", exc, held[1])
            memory = self._from_memory(identity, held)
            if memory is None:
                raise
            return self._served(identity, memory)
        target = self._newest_of_attempt(identity.job_key, epoch)
        if target is None:
            raise NotFound(f"no committed checkpoint for {ns}/{job}")
        try:
            return self._served(identity, self._load(identity, target))
        except (CorruptObject, NotFound) as exc:
            first_error = exc
        # Loud: the attempt's restore step is unusable here. Mark it, so no later attempt picks it.
        self.metrics.restore_fallbacks.labels(job).inc()
        log.error("%s/%s step %d is unusable (%s)", ns, job, target[1], first_error)
        self._mark_unusable(identity, target, f"rank {identity.rank}: {first_error}")
        if identity.world_size > 1:
            raise CorruptObject(
                str(first_error),
                f"every rank of an attempt restores the same step, so this gang cannot go on: step "
                f"{target[1]} is marked unusable and the next gang restart restores an older one",
            )
        # A single rank: a new attempt, right away, from the newest usable step.
        while True:
            epoch = self._reattempt(identity)
            older = epoch.restore
            if older is None:
                raise CorruptObject(
                    str(first_error), f"no restorable committed step at or before {target[1]}"
                )
            try:
                data = self._from_storage(identity, older)
            except (CorruptObject, NotFound) as exc:
                log.error("%s/%s step %d is unusable too: %s", ns, job, older[1], exc)
                self._mark_unusable(identity, older, f"rank {identity.rank}: {exc}")
                continue
            data.fallback_reason = f"step {target[1]} unusable ({first_error}); restored step {older[1]}"
            return self._served(identity, data)

    def _newest_of_attempt(self, job_key: tuple[str, str], epoch: mf.Epoch) -> Position | None:
        """A resumed gang restores the attempt's restore step; later in the same attempt, the
        newest step it committed since (a mid-run restore: pass a step for agreement)."""
        gang = self.gang(job_key)
        with gang.cond:
            own = [p for p, news in gang.steps.items() if p[0] == epoch.attempt and news.committed]
        return max(own) if own else epoch.restore

    def _reattempt(self, identity: Identity) -> mf.Epoch:
        """A new attempt for the same generation (world size 1 only), deciding its restore again."""
        gang = self.gang(identity.job_key)
        generation = self.generation_of(identity)
        ns, job = identity.job_key
        deadline = time.monotonic() + self.settings.commit_timeout_s
        with gang.epoch_lock:
            while True:
                fences = gang.refresh_fences()
                restore, reason = self._decide_restore(identity, fences)
                try:
                    epoch = mf.create_epoch(self.store, ns, job, generation, 1, restore, fences, reason)
                except PreconditionFailed:
                    if time.monotonic() > deadline:
                        raise FailedPrecondition(f"{ns}/{job}: could not allocate an attempt") from None
                    time.sleep(0.1)
                    continue
                self._adopt(gang, epoch)
                return epoch

    def _load(self, identity: Identity, target: Position) -> RestoreData:
        ahead = self._take_prefetched(identity, target)
        if ahead is not None:
            return ahead
        memory = self._from_memory(identity, target)
        if memory is not None:
            return memory
        return self._from_storage(identity, target)

    def _served(self, identity: Identity, data: RestoreData) -> RestoreData:
        """Count a restore; later checkpoints of the job carry the count (bit-width escalation)."""
        self.metrics.restores.labels(identity.job, data.source).inc()
        key = identity.job_key
        with self._lock:
            if data.source != "memory" or data.fallback_reason:
                # The trainer now holds something other than the snapshot this rank's chain ends
                # with (an older step, or a stored chain that may be damaged): start a new one.
                self._chains.pop(identity.slot, None)
                self._chain_refs.pop(identity.slot, None)
                self._held_layers.pop(identity.slot, None)
                self._account_held(identity.slot)
            # Every rank of a gang restart restores once: count the restart, not the ranks.
            if data.restores + 1 > self._restores.get(key, 0):
                self._restores[key] = data.restores + 1
        return data

    def prefetch(self, identity: Identity) -> None:
        """Read the attempt's restore step into memory in the background (asynchronous
        discovery: the restore that follows finds it ready)."""
        identity.validate()
        ready = threading.Event()
        with self._lock:
            current = self._prefetched.get(identity.slot)
            if current is not None and not current[1].is_set():
                return  # one is already loading
            self._prefetched[identity.slot] = (None, ready, None)

        def load() -> None:
            target, data = None, None
            try:
                target = self.epoch_for(identity).restore
                if target is not None and self._from_memory(identity, target) is None:
                    data = self._from_storage(identity, target, "prefetch")
                    log.info(
                        "rank %d: prefetched step %d (%d bytes)", identity.rank, target[1], data.total_bytes
                    )
            except (StrataError, OSError) as exc:
                log.warning("rank %d: prefetch failed, restore will retry: %s", identity.rank, exc)
            finally:
                with self._lock:
                    # Unless a save on this slot dropped the entry meanwhile (training went on).
                    if self._prefetched.get(identity.slot, (None, None, None))[1] is ready:
                        self._prefetched[identity.slot] = (target, ready, data)
                ready.set()

        threading.Thread(target=load, name=f"strata-prefetch-r{identity.rank}", daemon=True).start()

    def _take_prefetched(self, identity: Identity, target: Position) -> RestoreData | None:
        with self._lock:
            entry = self._prefetched.get(identity.slot)
        if entry is None:
            return None
        entry[1].wait(self.settings.commit_timeout_s)
        with self._lock:
            got, _, data = self._prefetched.pop(identity.slot, (None, entry[1], None))
        return data if got == target else None

    def _settle(self, identity: Identity) -> None:
        # Every rank of the job, not just this one: what a completed stream commits must be
        # seen before the restore step is decided.
        with self._lock:
            pending = [
                s
                for (ns, job, _), held in self._slots.items()
                if (ns, job) == identity.job_key
                for s in held
                if s.state == "uploading"
            ]
        deadline = time.monotonic() + self.settings.commit_timeout_s  # one bound for all of them
        for snap in pending:
            snap.done.wait(max(0.0, deadline - time.monotonic()))

    def _newest_held(self, identity: Identity) -> Position | None:
        with self._lock:
            held = [s.position for s in self._slots.get(identity.slot, []) if s.state == "committed"]
        return max(held) if held else None

    def _from_memory(self, identity: Identity, target: Position) -> RestoreData | None:
        found = None
        with self._lock:
            for snap in self._slots.get(identity.slot, []):
                if (
                    snap.position == target
                    and snap.state == "committed"
                    and snap.identity.world_size == identity.world_size
                ):
                    found, buf = snap, memoryview(snap.buffer)
            layers = list(self._held_layers.get(identity.slot, []))
        if found is None:
            return None
        if not self._intact(found, buf):
            return None
        if layers or any(t.lossy for t in found.stored):
            # Lossy tensors come back as storage gives them: the held stored forms, decoded the
            # same way (ranks restored from memory and from storage agree bit for bit).
            if not layers or layers[-1][0] != found.step:
                return None
            memory = self.memory.reserve("restore", len(buf), f"restoring step {target[1]} from memory")
            out = bytearray(buf)
            try:
                decode_held(memoryview(out), [(t, h) for _, t, h in layers], steps=[s for s, _, _ in layers])
            except ValueError as exc:
                log.error("rank %d: held stored forms unusable (%s); reading storage", identity.rank, exc)
                return None
            buf = memoryview(out)
        else:
            memory = None
        return RestoreData(
            target[1],
            found.tensors,
            found.tree,
            found.total_bytes,
            "memory",
            "",
            iter([buf]),
            found.restores,
            memory,
        )

    def _intact(self, snap: Snapshot, buf: memoryview) -> bool:
        """A shared segment is writable by its trainer: check every tensor still holds what was
        saved (the same crc32 a storage restore checks) before serving it."""
        for t in snap.stored:
            if t.lossy:
                continue  # its restored values come from the held stored form, not these bytes
            got = mf.crc32(buf[t.offset : t.offset + t.nbytes])
            if t.crc32 and got != t.crc32:
                log.error(
                    "rank %d: step %d in memory changed since it was saved (%s: crc32 %s != %s); "
                    "reading it from storage instead",
                    snap.identity.rank,
                    snap.step,
                    t.name,
                    got,
                    t.crc32,
                )
                return False
        return True

    def _from_storage(self, identity: Identity, target: Position, kind: str = "restore") -> RestoreData:
        ns, job = identity.job_key
        key = mf.commit_key(ns, job, target[1], target[0])
        commit = mf.Commit.from_json(self.store.get(key), key)
        if commit.world_size != identity.world_size:
            raise FailedPrecondition(
                f"step {target[1]} was saved by {commit.world_size} ranks; this job runs "
                f"{identity.world_size}. Changing the world size needs resharding, which this version "
                "does not do"
            )
        manifest = mf.load_manifest(self.store, commit, identity.rank)
        refs = {r.step: r for r in manifest.required_commits}

        def load(older: int) -> mf.Manifest:
            ref = refs.get(older)
            if ref is None:
                raise NotFound(f"step {target[1]} names no COMMIT for its base step {older}")
            return mf.load_manifest(self.store, mf.load_ref(self.store, ref), identity.rank)

        # A lossless full comes back as its objects; anything else is decoded into one buffer
        # while one step's objects are held (a step stores at most its raw size).
        plain = manifest.checkpoint == "full" and not any(t.lossy for t in manifest.tensors)
        need = manifest.total_bytes if plain else 2 * manifest.total_bytes
        memory = self.memory.reserve(kind, need, f"reading step {target[1]} from storage")
        pieces = read_snapshot(self.store, manifest, load, self._uploads)
        if len(pieces) == 1 and manifest.checkpoint == "diff":
            view = pieces[0]
            for t in manifest.tensors:  # the chain replayed must give back what was saved
                if t.crc32 and not t.lossy and mf.crc32(view[t.offset : t.offset + t.nbytes]) != t.crc32:
                    raise CorruptObject(f"step {target[1]}", f"{t.name} restored differs from what was saved")
        return RestoreData(
            target[1],
            manifest.tensors,
            manifest.tree,
            manifest.total_bytes,
            "storage",
            "",
            iter(pieces),
            manifest.restores,
            memory,
        )

    # --- queries --------------------------------------------------------------------------

    def list_checkpoints(self, namespace: str, job: str) -> list[tuple[mf.Commit, bool]]:
        out = []
        for attempt, step in mf.valid_commits(self.store, namespace, job):
            commit = mf.read_commit(self.store, namespace, job, step, attempt)
            out.append((commit, self.in_memory(namespace, job, (attempt, step))))
        return out

    def in_memory(self, namespace: str, job: str, position: Position) -> bool:
        with self._lock:
            return any(
                s.position == position and s.state == "committed"
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


def _drop_buffer(snap: Snapshot) -> None:
    snap.buffer = bytearray()
    if snap.memory is not None:
        snap.memory.release()


def _zeroed(size: int) -> bytearray | memoryview:
    """A writable zero-filled buffer whose pages are mapped as the stream fills them (an
    anonymous mapping), so a dropped stream costs only what it carried."""
    if size < 1 << 20:
        return bytearray(size)
    return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE))  # private: the sidecar's own pages


def check_protocol(version: int) -> None:
    """Serve clients of this protocol and of the one before it (rolling upgrades: the sidecar
    is upgraded first). What a protocol-1 client lacks, and what it gets instead:

    - Identity.generation: never sent. The sidecar's generation file wins anyway; without
      one, a single rank gets a generation of its own per handshake (as a protocol-2 client
      makes itself), several ranks are refused (see Engine.greet).
    - the Attach stream: never opened. A rank that never attached is never taken for gone
      (only an Attach stream that ends, or a peer's GoneHint, says a rank left), so nothing
      waits on it; its liveness falls back to the commit timeouts (--commit-timeout-s).
    """
    if not MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
        supported = " and ".join(str(v) for v in range(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION + 1))
        newer = version > PROTOCOL_VERSION
        raise FailedPrecondition(
            f"protocol version {version} is not supported; this sidecar speaks protocol "
            f"{PROTOCOL_VERSION} and serves clients of protocol {supported}. "
            + (
                "Upgrade the sidecar (roll out the new chart) before the trainer client"
                if newer
                else f"Upgrade the trainer client (strata-ckpt) to one speaking protocol {supported}"
            )
        )
