"""Persist and commit (sidecar.manifest's protocol): one committer thread per rank encodes
each complete snapshot (full or diff against the rank's chain) and uploads it with its
MANIFEST; rank 0's sidecar writes the job-level COMMIT once every rank's MANIFEST is durable
and verified, other ranks await it. Hints to and from the job's other sidecars (sidecar.gang)
come first, storage is asked only when they are late; fences stop a superseded attempt. Also
retention after a commit, and what ends a step's wait early: skips, ranks gone (and back)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque

from sidecar import manifest as mf
from sidecar.api import pb
from sidecar.budget import Reservation
from sidecar.errors import (
    Aborted,
    CorruptObject,
    FailedPrecondition,
    NotFound,
    ObjectNotFound,
    PreconditionFailed,
    ResourceExhausted,
    StorageError,
    StrataError,
)
from sidecar.faults import fault_point
from sidecar.gang import JobGang, Position
from sidecar.pipeline import RangeDigests, upload_snapshot
from sidecar.pipeline.plan import Chain, HeldForms, SnapshotEncoder

from .held import Held
from .redundancy import Redundancy
from .reports import Reports
from .state import Shared
from .types import Identity, JobKey, Slot, Snapshot

log = logging.getLogger(__name__)

#: Longest reason a skip keeps (in memory per step, in its hint and its marker).
MAX_REASON = 1024


class Commits:
    def __init__(self, shared: Shared, held: Held, reports: Reports, redundancy: Redundancy) -> None:
        self.shared = shared
        self.settings = shared.settings
        self.store = shared.store
        self.metrics = shared.metrics
        self.memory = shared.memory
        self.stopping = shared.stopping
        self.held = held
        self.reports = reports
        self.redundancy = redundancy
        # One committer thread per rank while it has snapshots to persist (they persist in the
        # order they arrived, so a newer step never commits before an older one); it ends once
        # its queue is empty, so ranks that saved once keep no thread.
        self._queues: dict[Slot, deque[Snapshot]] = {}
        self._threads: set[threading.Thread] = set()
        # Tests and chaos runs only: behave like a zombie that never learns of a newer attempt on
        # its commit path (the check-then-act race, made certain). Readers must still be safe.
        self.stale_fences = os.environ.get("STRATA_TEST_STALE_FENCES") == "1"

    def submit(self, snap: Snapshot) -> None:
        """Persist and commit ``snap`` (complete) on its rank's committer thread."""
        slot = snap.identity.slot
        with self.shared.lock:
            queue = self._queues.get(slot)
            if queue is not None:  # its thread takes it after the ones before
                queue.append(snap)
                return
            queue = self._queues[slot] = deque([snap])
            thread = threading.Thread(
                target=self._drain, args=(slot, queue), name=f"strata-commit-r{snap.identity.rank}"
            )
            self._threads.add(thread)
        try:
            thread.start()
        except BaseException:  # no thread to be had: this save fails, the next may start one
            with self.shared.lock:
                self._queues.pop(slot, None)
                self._threads.discard(thread)
            raise

    def _drain(self, slot: Slot, queue: deque[Snapshot]) -> None:
        """Persist ``slot``'s snapshots in order; end when none is left. A snapshot stays at the
        head of the queue while it persists, so a submit meanwhile only appends."""
        while True:
            with self.shared.lock:
                if not queue:
                    del self._queues[slot]
                    self._threads.discard(threading.current_thread())
                    return
                snap = queue[0]
            try:
                self._persist(snap)
            except Exception:
                log.exception("rank %d: persisting step %d failed", snap.identity.rank, snap.step)
            finally:
                with self.shared.lock:
                    queue.popleft()

    def shutdown(self) -> None:
        """Wait for every committer thread (their commits finish or give up)."""
        while True:
            with self.shared.lock:
                threads = list(self._threads)
            if not threads:
                return
            for thread in threads:
                thread.join()

    def _persist(self, snap: Snapshot) -> None:
        ident = snap.identity
        job = ident.job
        gang = self.shared.gang(ident.job_key)
        t0 = time.perf_counter()
        encoder: SnapshotEncoder | None = None
        scratch: Reservation | None = None
        try:
            prefix = mf.rank_prefix(
                ident.namespace, ident.job, snap.step, snap.attempt, snap.save_id, ident.rank
            )
            encoder = self._encoder(snap)
            out = encoder.outcome
            refs = self.held.chain_refs.get(ident.slot, {})
            # Encoded pieces in flight plus the held copies of lossy forms (a lossless full is
            # uploaded as views of the buffer: nothing).
            scratch = self.memory.reserve(
                "encode", 2 * encoder.scratch_bytes(), f"encoding step {snap.step} (rank {ident.rank})"
            )

            built: list[mf.Manifest] = []
            # Stored as received: each tensor's digest comes from the pass that digests the objects.
            digests = None
            if encoder.stores_buffer:
                digests = RangeDigests([(t.offset, t.nbytes) for t in encoder.tensors])

            def make_manifest(objects: list[mf.ObjectEntry]) -> mf.Manifest:
                snap.stored = out.tensors
                view = memoryview(snap.buffer)
                # What a lossless restore must reproduce, from any source.
                if digests is not None:
                    for t, digest in zip(out.tensors, digests.hexdigests(), strict=True):
                        t.xxh3 = digest
                else:
                    for t in out.tensors:
                        t.xxh3 = mf.xxh3(view[t.offset : t.offset + t.nbytes])
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
                    storage_restores=snap.storage_restores,
                    generation=snap.generation,
                    replicas=snap.replicas,
                )
                built.append(manifest)
                return manifest

            ref = upload_snapshot(
                self.store,
                self.shared.uploads,
                prefix,
                encoder.pieces(),
                self.settings.object_bytes,
                make_manifest,
                self.metrics.uploaded_bytes.labels(job).inc,
                snap.step,
                max_in_flight=2 * self.settings.upload_concurrency,
                also=digests,
            )
            snap.manifest_durable = True
            self.metrics.upload_duration.labels(job).observe(time.perf_counter() - t0)
            with gang.cond:
                news = gang.news(snap.position)
                news.manifests[ident.rank] = ref.key
                news.bodies[ident.rank] = built[0].to_json()  # the bytes write_manifest stored
                news.durable.add(ident.rank)
                gang.cond.notify_all()
            self.shared.hint(gang, snap.position, manifest=pb.ManifestHint(rank=ident.rank, key=ref.key))
            fault_point("sidecar.commit.before", snap.step)
            if ident.rank == 0:
                commit_ref = self._commit_as_rank0(snap, gang)
            else:
                commit_ref = self._await_commit(snap, gang)
        except Exception as exc:  # a bug as well: never let a waiter here or on another rank hang
            expected = isinstance(exc, (StrataError, OSError))
            if isinstance(exc, StorageError):
                self.metrics.storage_errors.labels(job, "put").inc()
            self.metrics.checkpoints.labels(job, "failed").inc()
            why = str(exc) if expected else f"internal error: {exc!r}"
            snap.state, snap.message = "failed", f"step {snap.step} not committed: {why}"
            if expected:
                log.error("rank %d: %s", ident.rank, snap.message)
            else:
                log.exception("rank %d: unexpected error persisting step %d", ident.rank, snap.step)
            self.held.release(snap)
            self._fail_for_gang(snap, gang, aborted=isinstance(exc, Aborted))
        else:
            assert encoder is not None
            out = encoder.outcome
            if scratch is not None:  # the upload is done: only the held forms stay charged
                scratch.release()
            self.held.chain_committed(
                ident.slot, encoder.next_chain(), snap.step, commit_ref, out.tensors, out.held
            )
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
            self.held.keep_newest_committed(snap)
            self.reports.note_step(ident.slot, snap.step)
            self.redundancy.committed(snap)  # in the background: storage already has the step
        finally:
            if scratch is not None:
                scratch.release()
            with gang.cond:  # settled here: the MANIFEST bodies of the step are not needed any more
                news = gang.news(snap.position)
                for rank in range(ident.world_size) if ident.rank == 0 else (ident.rank,):
                    news.bodies.pop(rank, None)
            snap.done.set()
        if snap.state == "committed" and ident.rank == 0:
            self.reports.heartbeat(ident.slot)
            # After the trainer hears "committed": retention is not on the path to durable.
            self._collect_garbage(snap, gang)

    def _fail_for_gang(self, snap: Snapshot, gang: JobGang, aborted: bool) -> None:
        """``snap`` failed after its save was acknowledged: tell the job's other ranks at once."""
        ident = snap.identity
        if not snap.manifest_durable and not aborted:
            # Tell the other ranks' commit not to wait for this one (a durable MANIFEST
            # is never withdrawn: the step may still commit without this sidecar).
            try:
                self.skip(ident, snap.attempt, snap.step, snap.message)
            except Exception as marker_exc:  # the hint went out first; storage is the fallback
                log.warning("could not leave the skip marker: %s", marker_exc)
        elif ident.rank == 0:  # no COMMIT will come: ranks waiting for it here and elsewhere stop
            with gang.cond:
                gang.news(snap.position).skipped.setdefault(0, snap.message)
                gang.cond.notify_all()
            self.shared.hint(gang, snap.position, skip=pb.SkipHint(rank=0, reason=snap.message))

    def _encoder(self, snap: Snapshot) -> SnapshotEncoder:
        """Full or diff against the rank's newest committed snapshot, if it is still held."""
        chain, previous, hold, decoded = self.held.diff_base(snap)
        held = {n for _, forms in decoded for n in forms}
        # Comparing with a decoded base decodes one tensor at a time beside the snapshot.
        widest = max((t.nbytes for t in snap.tensors if t.name in held), default=0)
        what = f"decoding the base of step {snap.step} (rank {snap.identity.rank})"
        room = None
        if widest:
            try:
                room = self.memory.reserve("encode", widest, what)
            except (ResourceExhausted, FailedPrecondition) as exc:
                # Correct either way: against the exact bytes every row of those tables differs.
                log.warning("rank %d: %s; the diff compares with the exact bytes", snap.identity.rank, exc)
                decoded = []
        try:
            return self._encode_against(snap, chain, previous, hold, decoded)
        finally:
            if room is not None:
                room.release()

    def _encode_against(
        self,
        snap: Snapshot,
        chain: Chain | None,
        previous: memoryview | None,
        hold: frozenset[str],
        decoded: list[HeldForms],
    ) -> SnapshotEncoder:
        return SnapshotEncoder(
            snap.step,
            snap.tensors,
            memoryview(snap.buffer),
            policy=self.settings.policy,
            max_diffs=self.settings.max_diffs,
            quant=self.shared.quant,
            restores=snap.restores,
            storage_restores=snap.storage_restores,
            chain=chain,
            previous=previous,
            touched=snap.touched,
            workers=self.settings.encode_workers,
            pool=self.shared.encode_pool,
            check_fraction=self.settings.tracking_check_fraction,
            check_confidence=self.settings.tracking_check_confidence,
            hold=hold if chain is not None else frozenset(),
            decoded=decoded,
        )

    # --- the commit ------------------------------------------------------------------------

    def on_hint(self, req: pb.HintRequest) -> None:
        """A hint from another sidecar of the job (sidecar.gang.PeerServicer): checked, signed."""
        self.shared.take_hint(req)

    def _poll_interval(self) -> float:
        # With peers, hints normally arrive first and storage is only a fallback; a sidecar that
        # serves every rank itself needs no polling at all; without peers, poll sooner.
        return self.settings.hint_fallback_s if self.shared.peers else min(1.0, self.settings.hint_fallback_s)

    def _check_fence(self, gang: JobGang, position: Position, refresh: bool) -> None:
        if self.stale_fences:
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
            if self.stopping.is_set():
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
        self.shared.hint(gang, position, commit=pb.CommitHint(key=ref.key))
        try:
            gang.latest_etag = mf.advance_latest(
                self.store, ident.namespace, ident.job, snap.attempt, snap.step, gang.latest_etag
            )
        except StorageError as exc:  # LATEST is a hint; discovery finds the COMMIT without it
            log.warning("step %d committed; LATEST not advanced: %s", snap.step, exc)
            gang.latest_etag = ""
        self.reports.commit(commit, ref, bodies)  # after the COMMIT is durable, never before
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
                    gang.news(position).durable.add(rank)
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
                why = "; ".join(f"rank {r}: {reason}" for r, reason in sorted(skipped.items()))
                raise Aborted(
                    f"step {snap.step} cannot commit: rank(s) {sorted(skipped)} did not save it ({why})"
                )
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
            if self.stopping.is_set():
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
            if self.reports.enabled
            else {}
        )
        try:
            deleted = gang.retention.run(snap.attempt, gang.fences)
            self.reports.deletes(gang, deleted, known)
        except (StrataError, OSError) as exc:
            log.warning(
                "retention of %s/%s failed (will retry after the next commit): %s",
                gang.namespace,
                gang.job,
                exc,
            )

    def skip(self, identity: Identity, attempt: int, step: int, reason: str) -> None:
        reason = reason[:MAX_REASON]  # kept per step (and sent to peers): a trainer's text, bounded
        gang = self.shared.gang(identity.job_key)
        with gang.cond:
            news = gang.news((attempt, step))
            if identity.rank in news.manifests and identity.rank in news.durable:
                return  # this rank's MANIFEST is durable: the step does not wait for it
            news.skipped.setdefault(identity.rank, reason)
            gang.cond.notify_all()
        self.shared.hint(gang, (attempt, step), skip=pb.SkipHint(rank=identity.rank, reason=reason))
        key = mf.skip_key(identity.namespace, identity.job, step, attempt, identity.rank)
        self.store.put(key, reason.encode())
        log.info("rank %d will not save step %d: %s", identity.rank, step, reason)

    def rank_gone(self, identity: Identity, attempt: int, reason: str) -> None:
        """The trainer's Attach stream (of ``attempt``) ended: it will save nothing more."""
        self.announce_gone(identity.job_key, identity.rank, attempt, reason)

    def rank_back(self, identity: Identity, attempt: int) -> None:
        """A trainer of ``attempt`` is here (again): it may save, whatever was said before."""
        gang = self.shared.gang(identity.job_key)
        with gang.cond:
            was_gone = gang.gone.get(attempt, {}).pop(identity.rank, None) is not None
        if was_gone:
            self.shared.hint(gang, (attempt, 0), gone=pb.GoneHint(rank=identity.rank, back=True))

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
        gang = self.shared.gang(identity.job_key)

        def current() -> tuple[int, ...]:
            return tuple(sorted(r for r in gang.gone.get(attempt, {}) if r != identity.rank))

        def changed() -> bool:
            return current() != known or self.stopping.is_set() or (until is not None and until.is_set())

        with gang.cond:
            gang.cond.wait_for(changed, timeout)
            return current()

    def wake(self, identity: Identity) -> None:
        """Wake waiters of ``identity``'s job (``peers_gone``) to look at their ``until`` event."""
        gang = self.shared.gang(identity.job_key)
        with gang.cond:
            gang.cond.notify_all()

    def announce_gone(self, job_key: JobKey, rank: int, attempt: int, reason: str) -> None:
        # complete streams: uploading, or durable and waiting for the COMMIT
        uploading = self.held.uploading_steps((*job_key, rank), attempt)
        gang = self.shared.gang(job_key)
        with gang.cond:
            gang.gone.setdefault(attempt, {})[rank] = uploading
            gang.cond.notify_all()
        log.info(
            "rank %d of attempt %d: %s (still uploading steps %s)", rank, attempt, reason, sorted(uploading)
        )
        self.shared.hint(
            gang, (attempt, 0), gone=pb.GoneHint(rank=rank, uploading=sorted(uploading), reason=reason)
        )
