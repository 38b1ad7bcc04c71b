"""Restores: the attempt's restore step (every rank of a generation restores the same one)
or an explicit committed step, served from what prefetch read ahead, from the snapshot still
held in memory (checked against what was saved), or from storage (a diff chain replayed);
an unusable step is marked and, for a single rank, the next usable one is restored. Also the
queries: committed checkpoints, which are in memory, one rank's MANIFEST."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from sidecar import manifest as mf
from sidecar.api import RESHARD_MARKER, pb
from sidecar.budget import Reservation
from sidecar.errors import (
    CorruptObject,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ObjectNotFound,
    StorageError,
    StrataError,
)
from sidecar.gang import (
    STREAM_MAC_KEY,
    Behind,
    Position,
    fetch_mac,
    fetched_chunk,
    sign_fetch,
    stream_opener,
)
from sidecar.pipeline.plan import (
    close_files,
    decode_held,
    held_bytes,
    into_page_cache,
    load_chain,
    open_objects,
    read_snapshot,
)
from sidecar.shm import RestoreBuffer
from sidecar.store.base import READ_PIECE_BYTES

from .attempts import Attempts
from .held import Held
from .redundancy import Redundancy
from .state import Shared
from .types import Identity, JobKey, RestoreData, Slot, Snapshot, check_job, restore_header, zeroed

#: what a prefetch leaves for a step storage holds as files (see ``Restorer.prefetched``)
FROM_FILES = "files"
#: prefetches reading a step's files into the page cache at once (the rest skip it)
_WARMING = threading.BoundedSemaphore(2)

log = logging.getLogger(__name__)

#: Pauses between reads of a step whose object storage answered missing, before it counts as
#: "missing" (marked unusable): ~3.75 s of patience for a bucket's momentary 404.
MISSING_RETRY_DELAYS_S = (0.25, 0.5, 1.0, 2.0)


def _cause(exc: Exception) -> str:
    """A marker's cause: an object still missing after the retries, or anything else damaged."""
    return "missing" if isinstance(exc, ObjectNotFound) else "corrupt"


class Restorer:
    def __init__(
        self, shared: Shared, held: Held, attempts: Attempts, redundancy: Redundancy | None = None
    ) -> None:
        self.shared = shared
        self.settings = shared.settings
        self.store = shared.store
        self.metrics = shared.metrics
        self.memory = shared.memory
        self.held = held
        self.attempts = attempts
        self.redundancy = redundancy if redundancy is not None else Redundancy(shared, held)
        # Restores read ahead by prefetch(): slot -> (position, ready event, data or None)
        #: per slot: the step read ahead, set once done, and its data (FROM_FILES: storage holds
        #: it as files, read into the page cache; the restore opens them)
        self.prefetched: dict[Slot, tuple[Position | None, threading.Event, RestoreData | str | None]] = {}
        # The step each slot's restore read or reads (a Prefetch that arrives after its Restore,
        # as the client sends both without waiting, must not read the step a second time).
        self._loading: dict[Slot, Position] = {}
        #: COMMITs read for reads of any rank: (namespace, job, attempt, step) -> COMMIT
        self._commits: dict[tuple[str, str, int, int], mf.Commit] = {}

    def open_restore(self, identity: Identity, step: int | None, files_ok: bool = False) -> RestoreData:
        """The attempt's restore step (every rank of a generation restores the same one), or
        an explicit committed ``step``. ``files_ok``: the trainer can take a step from storage as
        its objects' files (``RestoreData.files``) where the store holds it so."""
        identity.validate()
        self.attempts.check_not_stopped(identity)
        ns, job = identity.job_key
        if step is not None:
            fences = self.shared.gang(identity.job_key).refresh_fences()
            attempts = [a for a in mf.step_commits(self.store, ns, job, step) if fences.valid(a, step)]
            if not attempts:
                raise NotFound(f"step {step} of {ns}/{job} has no valid COMMIT")
            chosen = (attempts[-1], step)
            # the attempt's restore step named explicitly takes the attempt's class, as the ranks
            # that restore it implicitly (or read it ahead) do
            wanted = self._wanted_class(identity, self._epoch_if_any(identity), chosen)
            return self._served(identity, self._retrying(identity, chosen, self._loader(wanted, files_ok)))
        try:
            epoch = self.attempts.epoch_for(identity)
        except StorageError as exc:
            # Storage is unreachable: one rank alone cannot disagree with anyone, so it may
            # restore the newest snapshot this sidecar committed for it.
            held = self.held.newest_committed(identity) if identity.world_size == 1 else None
            if held is None:
                raise
            log.warning("storage unreachable (%s); restoring step %d from memory", exc, held[1])
            memory = self._from_memory(identity, held, exact=self.attempts.exact_classes)
            if memory is None:
                raise
            return self._served(identity, memory)
        target = self._newest_of_attempt(identity.job_key, epoch)
        if target is None:
            raise NotFound(f"no committed checkpoint for {ns}/{job}")
        try:
            data = self._retrying(
                identity, target, self._loader(self._wanted_class(identity, epoch, target), files_ok)
            )
        except (CorruptObject, NotFound) as exc:
            first_error = exc
        else:
            return self._served(identity, self._report_skipped(identity, epoch, data))
        # Loud: the attempt's restore step is unusable here. Mark it, so no later attempt picks it.
        self.metrics.restore_fallbacks.labels(job).inc()
        cause = _cause(first_error)
        log.error("%s/%s step %d is unusable (%s: %s)", ns, job, target[1], cause, first_error)
        marked = [
            self.attempts.mark_unusable(identity, target, f"rank {identity.rank}: {first_error}", cause)
        ]
        if identity.world_size > 1:
            raise CorruptObject(
                str(first_error),
                f"every rank of an attempt restores the same step, so this gang cannot go on: step "
                f"{target[1]} is marked unusable ({cause}) and the next gang restart restores an older one",
            )
        # A single rank: a new attempt, right away, from the newest usable step.
        stored = functools.partial(self._from_storage, files_ok=files_ok)
        while True:
            epoch = self.attempts.reattempt(identity)
            older = epoch.restore
            if older is None:
                raise CorruptObject(
                    str(first_error), f"no restorable committed step at or before {target[1]}"
                )
            try:
                data = self._retrying(identity, older, stored)
            except (CorruptObject, NotFound) as exc:
                log.error("%s/%s step %d is unusable too (%s: %s)", ns, job, older[1], _cause(exc), exc)
                marked.append(
                    self.attempts.mark_unusable(identity, older, f"rank {identity.rank}: {exc}", _cause(exc))
                )
                continue
            return self._served(identity, self._report_skipped(identity, epoch, data, marked))

    def _retrying(
        self, identity: Identity, target: Position, load: Callable[[Identity, Position], RestoreData]
    ) -> RestoreData:
        """``load``, read again while an object it needs is missing: a bucket may answer 404 for a
        moment (a lagging replica, a proxy's hiccup), and marking a step unusable is for good."""
        for delay in (*MISSING_RETRY_DELAYS_S, None):
            try:
                return load(identity, target)
            except ObjectNotFound as exc:
                if delay is None:
                    raise
                log.warning(
                    "rank %d: step %d: %s; reading it again in %.2f s", identity.rank, target[1], exc, delay
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _report_skipped(
        self,
        identity: Identity,
        epoch: mf.Epoch,
        data: RestoreData,
        marked: list[mf.UnusableMarker] | None = None,
    ) -> RestoreData:
        """Name every newer commit the attempt's restore step passed over, and why (its marker), in
        the restore's fallback reason: a restore of an older step is never silent. ``marked``: what
        this very restore marked (counted as a fallback already)."""
        if (data.attempt, data.step) != epoch.restore:
            return data  # a mid-run restore of the attempt's own commit
        found = {mk.position: mk for mk in marked or []}
        for mk in self.attempts.skipped_by(identity, epoch):
            found.setdefault(mk.position, mk)
        skipped = [found[p] for p in sorted(found, reverse=True)]
        if not skipped:
            return data
        if not marked:
            self.metrics.restore_fallbacks.labels(identity.job).inc()
        why = "; ".join(mk.describe() for mk in skipped)
        data.fallback_reason = f"skipped {len(skipped)} unusable step(s): {why}; restored step {data.step}"
        log.error("rank %d: %s", identity.rank, data.fallback_reason)
        return data

    def _newest_of_attempt(self, job_key: JobKey, epoch: mf.Epoch) -> Position | None:
        """A resumed gang restores the attempt's restore step; later in the same attempt, the
        newest step it committed since (a mid-run restore: pass a step for agreement)."""
        gang = self.shared.gang(job_key)
        with gang.cond:
            own = [p for p, news in gang.steps.items() if p[0] == epoch.attempt and news.committed]
        return max(own) if own else epoch.restore

    def _wanted_class(self, identity: Identity, epoch: mf.Epoch | None, target: Position) -> str:
        """The restore class of ``target`` for ``identity``: "exact" or "stored" as the attempt's
        EPOCH decided for its restore step (every rank alike); "either" (exact when held, else
        stored) where one rank alone restores; "stored" for other restores of a gang."""
        if not self.attempts.exact_classes:
            return "stored"
        if epoch is not None and target == epoch.restore and identity.world_size > 1:
            return "exact" if epoch.restore_class == "exact" else "stored"
        return "either" if identity.world_size == 1 else "stored"

    def _epoch_if_any(self, identity: Identity) -> mf.Epoch | None:
        """The attempt ``identity`` runs as (its client's attach recorded it), or None when it
        cannot be had now."""
        if not self.attempts.exact_classes:
            return None
        try:
            return self.attempts.epoch_for(identity)
        except StrataError as exc:
            log.info("rank %d: no attempt to take a restore class from (%s)", identity.rank, exc)
            return None

    def _loader(self, wanted: str, files_ok: bool = False) -> Callable[[Identity, Position], RestoreData]:
        def load(identity: Identity, target: Position) -> RestoreData:
            data = self._load(identity, target, wanted, files_ok)
            if wanted == "stored" and self.attempts.exact_classes and not any(t.lossy for t in data.tensors):
                # The same bytes either way: a rank without lossy tensors reports its gang's class
                # (a Checkpoint whose ranks report two classes says "mixed", a fault).
                data.restore_class = "stored"
            return data

        return load

    def _load(
        self, identity: Identity, target: Position, wanted: str = "stored", files_ok: bool = False
    ) -> RestoreData:
        world = self._saved_by(identity.job_key, target)
        if world != identity.world_size:
            # Before any path that serves "this rank's" snapshot (memory, peers, parity, storage):
            # rank r of another world size saved something else. The client reads the ranks that
            # saved it instead (open_rank), when its state allows.
            raise FailedPrecondition(_other_world(target, world, identity.world_size))
        with self.shared.lock:
            self._loading[identity.slot] = target
            while len(self._loading) > 4096:  # bounded: the oldest entries go
                self._loading.pop(next(iter(self._loading)))
        ahead = self._take_prefetched(identity, target)
        if ahead == FROM_FILES:  # where the read ahead found it, lossless: as a prefetched step
            return self._from_storage(identity, target, files_ok=files_ok)
        if isinstance(ahead, RestoreData):
            lossy = any(t.lossy for t in ahead.tensors)
            if wanted == "either" or ahead.restore_class == wanted or not lossy:
                return ahead
            if ahead.memory is not None:
                ahead.memory.release()
        if wanted != "stored":
            exact = (
                self._from_memory(identity, target, exact=True)
                or self._from_peer(identity, target, own=True, exact=True)
                or self._from_parity(identity, target, exact=True)
            )
            if exact is not None:
                return exact
            if wanted == "exact":
                ns, job = identity.job_key
                self.attempts.note_inexact(identity, target, "its exact copy is gone")
                raise FailedPrecondition(
                    f"rank {identity.rank} of {ns}/{job}: this attempt restores step {target[1]} exactly "
                    "on every rank (its EPOCH's restore class), but this rank's exact copy is gone (not "
                    "in this sidecar's memory, and no peer holds it); the gang restarts, and the next "
                    "attempt restores what storage holds on every rank"
                )
        memory = self._from_memory(identity, target)
        if memory is not None:
            return memory
        # This member's memory does not have it (its pod was lost, or its sidecar restarted): the
        # other members' memory (a buddy's copy, or parity rebuilt), then storage. Peers serve only
        # the bytes as saved: asked above already when an exact restore was tried.
        if wanted == "stored":
            peer = self._from_peer(identity, target, own=True) or self._from_parity(identity, target)
            if peer is not None:
                return peer
        return self._from_storage(identity, target, files_ok=files_ok)

    def _served(self, identity: Identity, data: RestoreData) -> RestoreData:
        """Count a restore; later checkpoints of the job carry the count (bit-width escalation)."""
        self.metrics.restores.labels(identity.job, data.source).inc()
        self.metrics.restore_classes.labels(identity.job, data.restore_class).inc()
        # Unless it is from memory as saved, the trainer now holds something other than the
        # snapshot this rank's chain ends with (an older step, or a stored chain that may be
        # damaged): start a new one.
        self.held.restored(
            identity,
            data.source == "memory" and not data.fallback_reason,
            data.restores,
            data.storage_restores,
            exact=data.restore_class == "exact",
        )
        return data

    def open_rank(
        self,
        identity: Identity,
        owner: int,
        step: int | None = None,
        attempt: int | None = None,
        header_only: bool = False,
    ) -> RestoreData:
        """What rank ``owner`` saved at a commit, for a rank of the same job, whatever number of
        ranks saved it: the replicated tensors a restoring rank did not save itself (same world
        size), or a rank's share of a checkpoint being resharded (DCP's planner decides what to
        read; this only serves whole snapshots). The commit: ``(attempt, step)``; ``step`` alone,
        the newest valid commit of that step; neither, the step this attempt restores. From this
        sidecar's memory, else a peer's, else storage. ``header_only``: the tree and tensor list
        without bytes (only the MANIFEST is read). Nothing of ``identity``'s own restore state
        changes, except that reading a commit of another world size ends its diff chain (its next
        checkpoint is full)."""
        identity.validate()
        self.attempts.check_not_stopped(identity)
        target = self._commit_position(identity, step, attempt)
        world = self._saved_by(identity.job_key, target)
        if owner >= world:
            raise InvalidArgument(
                f"rank {owner}: step {target[1]} (attempt {target[0]}) was saved by {world} ranks, "
                f"0 to {world - 1}"
            )
        of = dataclasses.replace(identity, rank=owner, world_size=world)
        if header_only:
            head = self._header(of, target)
            head.world_size = world
            return head
        found: RestoreData | None = None
        wanted = "stored"
        if world == identity.world_size and self.attempts.exact_classes:
            try:
                wanted = self._wanted_class(identity, self.attempts.epoch_for(identity), target)
            except StrataError:
                wanted = "stored"
        if wanted != "stored":
            # the owner's replicated tensors as the rest of this restore gives them: exactly
            found = (
                self._from_memory(of, target, exact=True)
                or self._from_peer(of, target, exact=True)
                # parity rebuilds this member's own ranks (another rank's read would rebuild a
                # share no one here needs, and hold it)
                or (self._from_parity(of, target, exact=True) if owner == identity.rank else None)
            )
            if found is None and wanted == "exact":
                # Storage's form would differ from the owner's exact values: replicas would
                # diverge. The gang restarts; the next attempt restores the stored class.
                self.attempts.note_inexact(identity, target, f"rank {owner}'s exact copy is not held")
                raise FailedPrecondition(
                    f"rank {identity.rank}: this attempt restores step {target[1]} exactly on every "
                    f"rank, but no member holds rank {owner}'s snapshot as saved (its member was "
                    "rebuilt from parity, or its copy is gone); the gang restarts, and the next "
                    "attempt restores what storage holds on every rank"
                )
        if found is None:
            found = self._from_memory(of, target) or self._from_peer(of, target)
        data = found if found is not None else self._from_storage(of, target)
        data.world_size = world
        if wanted == "stored" and self.attempts.exact_classes and not any(t.lossy for t in data.tensors):
            data.restore_class = "stored"  # the same bytes either way: the gang's class (see _loader)
        if world == identity.world_size:
            reads, read_bytes = self.metrics.replica_reads, self.metrics.replica_read_bytes
            if owner == identity.rank:
                # the rank's own snapshot (DCP's reader restores this way): a restore, counted
                # for auto's bits and ending the chain as a whole restore from there would
                self.held.restored(
                    identity,
                    data.source == "memory",
                    data.restores,
                    data.storage_restores,
                    exact=data.restore_class == "exact",
                )
        else:
            reads, read_bytes = self.metrics.reshard_reads, self.metrics.reshard_read_bytes
            # This rank now holds state another world size saved: its next checkpoint is full.
            self.held.restored(identity, False, data.restores)
        reads.labels(identity.job, data.source).inc()
        read_bytes.labels(identity.job, data.source).inc(data.total_bytes)
        log.info(
            "rank %d: step %d: tensors of rank %d of %d (%d bytes) from %s",
            identity.rank,
            target[1],
            owner,
            world,
            data.total_bytes,
            data.source,
        )
        return data

    def _commit_position(self, identity: Identity, step: int | None, attempt: int | None) -> Position:
        """The valid commit a read of any rank names (see open_rank)."""
        ns, job = identity.job_key
        if attempt is not None and step is None:
            raise InvalidArgument("a read of a rank's snapshot that names the attempt names the step too")
        if step is None:
            target = self._newest_of_attempt(identity.job_key, self.attempts.epoch_for(identity))
            if target is None:
                raise NotFound(f"no committed checkpoint for {ns}/{job}")
            return target
        fences = self.shared.gang(identity.job_key).refresh_fences()
        if attempt is None:
            attempts = [a for a in mf.step_commits(self.store, ns, job, step) if fences.valid(a, step)]
            if not attempts:
                raise NotFound(f"step {step} of {ns}/{job} has no valid COMMIT")
            return attempts[-1], step
        if not fences.valid(attempt, step):
            raise NotFound(f"step {step} of attempt {attempt} is not a valid commit of {ns}/{job}")
        return attempt, step

    def _saved_by(self, job_key: JobKey, target: Position) -> int:
        """The number of ranks that saved the commit ``target``: from a snapshot of it held here
        (no storage request, as a memory restore makes none), else its COMMIT."""
        world = self.held.world_size_of(job_key, target)
        return world if world is not None else self._commit(job_key, target).world_size

    def _commit(self, job_key: JobKey, target: Position) -> mf.Commit:
        """A COMMIT, read once (they are create-only, never rewritten)."""
        key = (*job_key, *target)
        with self.shared.lock:
            found = self._commits.get(key)
        if found is not None:
            return found
        ckey = mf.commit_key(job_key[0], job_key[1], target[1], target[0])
        commit = mf.Commit.from_json(self.store.get(ckey), ckey)
        with self.shared.lock:
            self._commits[key] = commit
            while len(self._commits) > 256:
                self._commits.pop(next(iter(self._commits)))
        return commit

    def _header(self, identity: Identity, target: Position) -> RestoreData:
        """``identity``'s snapshot of ``target`` without its bytes: as held in memory, else as its
        MANIFEST describes it."""
        copy = self.held.committed_copy(identity, target)
        if copy is not None:
            snap = copy[0]
            tensors, tree, total, restores = snap.tensors, snap.tree, snap.total_bytes, snap.restores
            replicas, source = snap.replicas, "memory"
        else:
            manifest = mf.load_manifest(self.store, self._commit(identity.job_key, target), identity.rank)
            tensors, tree, total, restores = (
                manifest.tensors,
                manifest.tree,
                manifest.total_bytes,
                manifest.restores,
            )
            replicas, source = manifest.replicas, "storage"
        return RestoreData(
            target[1],
            tensors,
            tree,
            total,
            source,
            "",
            iter(()),
            restores,
            None,
            [r for r in replicas if r.owner != identity.rank],
            target[0],
        )

    def serve_fetch(
        self, req: pb.FetchRequest
    ) -> tuple[pb.RestoreHeader, Iterator[memoryview | bytes], bytes]:
        """A peer sidecar asks for the tensors of a rank this sidecar serves, at a commit: from
        memory only (NotFound otherwise), lossless only (a lossy form is decoded from storage by
        whoever needs it), to holders of the job's peer key. Returns the data and the key (the
        stream's MAC)."""
        identity = Identity(req.namespace, req.job, req.rank, req.world_size, 0)
        identity.validate()
        target = (int(req.attempt), int(req.step))
        with self.shared.lock:
            known = any(ns == req.namespace and jb == req.job for ns, jb, _ in self.held.slots)
        if not known and not self.redundancy.knows(
            req.namespace, req.job
        ):  # an unknown job costs nothing: storage is not asked for its key
            raise NotFound(f"{req.namespace}/{req.job} has no rank on this sidecar")
        key = self.shared.authenticate(
            identity.job_key, req.protocol, req.issued_at, req.nonce, lambda k: fetch_mac(k, req), req.mac
        )
        # the bytes as saved, lossy tensors included: a stored form is decoded from storage by
        # whoever needs it
        data = self._from_memory(identity, target, exact=True)
        if data is None:
            copy = self.redundancy.replica_fetch(req)  # a buddy's copy held here
            if copy is not None:
                return copy[0], copy[1], key
            raise NotFound(
                f"rank {req.rank} step {req.step} (attempt {req.attempt}) is not held here losslessly"
            )
        data.source = "peer"
        return restore_header(data), data.chunks, key

    def _checkable(
        self, identity: Identity, target: Position, exact: bool = False
    ) -> tuple[mf.Manifest, bytes] | None:
        """The rank's MANIFEST of ``target`` and the job's peer key, when what a peer sends can be
        checked against it: every tensor digested, lossless unless ``exact`` (a lossy tensor's
        digest is of the bytes as saved, which peers hold) (else None: storage then)."""
        ns, job = identity.job_key
        try:
            key = mf.commit_key(ns, job, target[1], target[0])
            manifest = mf.load_manifest(
                self.store, mf.Commit.from_json(self.store.get(key), key), identity.rank
            )
            secret = self.shared.peer_key(identity.job_key)
        except (StrataError, OSError) as exc:
            log.info("rank %d: no peer fetch (%s)", identity.rank, exc)
            return None
        if any((t.lossy and not exact) or not (t.xxh3 or t.crc32) for t in manifest.tensors):
            return None  # lossy forms are decoded from storage; bytes without a digest stay unchecked
        return manifest, secret

    def _from_parity(self, identity: Identity, target: Position, exact: bool = False) -> RestoreData | None:
        """This member's share rebuilt from its group's parity and survivors, checked against the
        rank's MANIFEST, or None (storage then)."""
        if self.redundancy.mode != "parity":
            return None
        checkable = self._checkable(identity, target, exact)
        if checkable is None:
            return None
        manifest, _ = checkable
        budget = self.settings.peer_fetch_timeout_s + 4 * manifest.total_bytes / 50e6
        view = self.redundancy.rebuild(identity.job_key, identity.rank, identity.world_size, target, budget)
        if view is None:
            return None
        for t in manifest.tensors:
            why = (
                mf.check_digest(t, view[t.offset : t.offset + t.nbytes])
                if len(view) == manifest.total_bytes
                else "size"
            )
            if why is not None:
                log.error(
                    "rank %d: step %d rebuilt from parity differs from what was saved (%s: %s); "
                    "reading storage",
                    identity.rank,
                    target[1],
                    t.name,
                    why,
                )
                self.metrics.peer_rebuilds.labels(identity.job, "parity", "failed").inc()
                return None
        log.info(
            "rank %d: step %d rebuilt from the parity of its group (no storage read)",
            identity.rank,
            target[1],
        )
        return _peer_data(manifest, target, view, None)

    def _from_peer(
        self, identity: Identity, target: Position, own: bool = False, exact: bool = False
    ) -> RestoreData | None:
        """The rank's tensors from the peer sidecar that holds them in memory (or, with ``own``,
        a buddy's copy of this member's own rank), checked against the rank's MANIFEST (every
        tensor's digest), or None (no peers, none holds it, a lossy step, or what came back does
        not match: storage then)."""
        if not self.shared.peers:
            return None
        members = self.redundancy.members
        first = None
        if own:
            if self.redundancy.mode != "buddy" or members is None:
                return None
            first = members.addresses[members.buddy(members.index)]
        checkable = self._checkable(identity, target, exact)
        if checkable is None:
            return None
        manifest, secret = checkable
        ns, job = identity.job_key
        req = pb.FetchRequest(
            namespace=ns,
            job=job,
            rank=identity.rank,
            world_size=identity.world_size,
            attempt=target[0],
            step=target[1],
            issued_at=time.time(),
        )
        sign_fetch(secret, req)
        expected = {t.name: (t.offset, t.nbytes) for t in manifest.tensors}
        # the base budget, plus the transfer at a conservative 50 MB/s
        budget = self.settings.peer_fetch_timeout_s + manifest.total_bytes / 50e6
        for address, header, stream in self.shared.peers.fetch(req, budget, first=first, only=own):
            if {m.name: (m.offset, m.nbytes) for m in header.tensors} != expected or (
                header.total_bytes != manifest.total_bytes
            ):
                stream.cancel()
                log.warning(
                    "peer %s answered rank %d step %d with another layout", address, identity.rank, target[1]
                )
                continue
            memory = self.memory.reserve(
                "restore", manifest.total_bytes, f"fetching step {target[1]} from a peer"
            )
            # In memory of the sidecar's own: a file in the shm dir could be shrunk under a mapping
            # of it by any trainer there (a SIGBUS); a shared-memory restore gets a copy.
            buf = memoryview(zeroed(manifest.total_bytes))
            pos = 0
            mac = stream_opener(secret, req.mac, stream)

            digests = mf.StreamDigests(manifest.tensors)  # checked as it comes, not read again

            def take(
                item: tuple[int, bytes],
                buf: memoryview = buf,
                mac: Any = mac,
                digests: mf.StreamDigests = digests,
            ) -> None:
                at, chunk = item
                chunk = mac.apply(chunk)  # decrypted, in order (a buffer reused per chunk)
                buf[at : at + len(chunk)] = chunk
                digests.update(at, chunk)

            behind = Behind(take, depth=32)
            try:
                try:
                    for msg in stream:
                        chunk = fetched_chunk(msg)
                        end = pos + len(chunk)
                        if end > len(buf):
                            raise ValueError("more bytes than the header declared")
                        behind.put((pos, chunk))
                        pos = end
                finally:
                    behind.close()
                if pos != len(buf):
                    raise ValueError(f"stream ended after {pos} of {len(buf)} bytes")
                trailer = dict(stream.trailing_metadata() or ())
                if not mac.verify(trailer.get(STREAM_MAC_KEY, "")):
                    raise ValueError("the bytes do not carry the job's stream MAC (changed on the way?)")
                why = digests.check()
                if why is not None:
                    raise ValueError(why)
                view = memoryview(buf)
            except BaseException as exc:
                stream.cancel()
                memory.release()
                if not isinstance(exc, (grpc.RpcError, ValueError, OSError)):
                    raise
                log.warning(
                    "fetch of rank %d step %d from peer %s unusable: %s",
                    identity.rank,
                    target[1],
                    address,
                    exc,
                )
                continue
            if own:
                self.metrics.peer_rebuilds.labels(identity.job, "replica", "ok").inc()
                log.info(
                    "rank %d: step %d from member %s's copy (no storage read)",
                    identity.rank,
                    target[1],
                    address,
                )
            return _peer_data(manifest, target, view, memory)
        return None

    def prefetch(self, identity: Identity, files_ok: bool = False) -> None:
        """Read the attempt's restore step into memory in the background (asynchronous
        discovery: the restore that follows finds it ready); ``files_ok``: one storage holds as
        files into the page cache instead, for the restore to lend (see :meth:`open_restore`)."""
        identity.validate()
        ready = threading.Event()
        with self.shared.lock:
            current = self.prefetched.get(identity.slot)
            if current is not None and not current[1].is_set():
                return  # one is already loading
            self.prefetched[identity.slot] = (None, ready, None)

        def load() -> None:
            target, data = None, None
            warm: list[tuple[int, int]] = []
            try:
                epoch = self.attempts.epoch_for(identity)
                target = epoch.restore
                self.attempts.skipped_by(identity, epoch)  # read now, so the restore asks storage nothing
                with self.shared.lock:
                    loading = self._loading.get(identity.slot)
                if target is not None and loading == target:
                    log.info(
                        "rank %d: step %d is being restored already; nothing to prefetch",
                        identity.rank,
                        target[1],
                    )
                elif target is not None and self._saved_by(identity.job_key, target) != identity.world_size:
                    # Another number of ranks saved it: this rank's restore reads other ranks'
                    # snapshots (a DCP load), or is refused; nothing of its own to read ahead.
                    log.info(
                        "rank %d: step %d was saved by another number of ranks; nothing to prefetch",
                        identity.rank,
                        target[1],
                    )
                elif (
                    target is not None
                    and (wanted := self._wanted_class(identity, epoch, target))
                    and self._from_memory(identity, target, exact=wanted != "stored") is None
                ):
                    if wanted != "stored":
                        data = self._from_peer(identity, target, own=True, exact=True) or self._from_parity(
                            identity, target, True
                        )
                    if data is None and wanted == "either":
                        data = self._from_storage(identity, target, "prefetch", files_ok=files_ok)
                    elif wanted == "stored":  # peers of a lossless step, or storage's form
                        data = (
                            self._from_peer(identity, target, own=True)
                            or self._from_parity(identity, target)
                            or self._from_storage(identity, target, "prefetch", files_ok=files_ok)
                        )
                    if data is None:
                        raise NotFound(f"step {target[1]}: no exact copy to read ahead")
                    if data.files is not None:  # read into the page cache below; the restore opens them again
                        warm = data.files.release()
                    log.info(
                        "rank %d: prefetched step %d (%d bytes) from %s",
                        identity.rank,
                        target[1],
                        data.total_bytes,
                        data.source,
                    )
            except (StrataError, OSError) as exc:
                log.warning("rank %d: prefetch failed, restore will retry: %s", identity.rank, exc)
            finally:
                with self.shared.lock:
                    # Unless a save on this slot dropped the entry meanwhile (training went on).
                    if self.prefetched.get(identity.slot, (None, None, None))[1] is ready:
                        self.prefetched[identity.slot] = (target, ready, FROM_FILES if warm else data)
                ready.set()
            # A step to be read from its files: nothing is held for it (descriptors are not
            # kept between calls), the restore need not wait for this, and the trainer's reads
            # find what it read already in the page cache. At most a few at once in all.
            if warm and _WARMING.acquire(blocking=False):
                try:
                    into_page_cache(warm)
                finally:
                    _WARMING.release()
            else:
                close_files(warm)

        threading.Thread(target=load, name=f"strata-prefetch-r{identity.rank}", daemon=True).start()

    def _take_prefetched(self, identity: Identity, target: Position) -> RestoreData | str | None:
        with self.shared.lock:
            entry = self.prefetched.get(identity.slot)
        if entry is None:
            return None
        entry[1].wait(self.settings.commit_timeout_s)
        with self.shared.lock:
            got, _, data = self.prefetched.pop(identity.slot, (None, entry[1], None))
        return data if got == target else None

    def _from_memory(self, identity: Identity, target: Position, exact: bool = False) -> RestoreData | None:
        """The committed snapshot held here, checked against its digests: with ``exact``, as its
        trainer saved it (lossy tensors too); else lossy tensors decoded from their held stored
        forms, as storage gives them."""
        copy = self.held.committed_copy(identity, target)
        if copy is None:
            return None
        found, buf, layers = copy
        if not self._intact(found, buf, exact):
            if exact:  # gone for good: the next holdings report must not list it
                with self.shared.lock:
                    self.held.drop_committed_locked(identity, "a changed shared segment")
            return None
        lossy = bool(layers) or any(t.lossy for t in found.stored)
        if lossy and not exact:
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
            segment = None
        else:
            memory = None
            held = self.shared.segments.held_name(found.segment) if found.segment else None
            segment = (held, len(buf)) if held else None
        return RestoreData(
            target[1],
            _with_digests(found.tensors, found.stored),
            found.tree,
            found.total_bytes,
            "memory",
            "",
            iter([buf]),
            found.restores,
            memory,
            [r for r in found.replicas if r.owner != identity.rank],
            target[0],
            segment,
            storage_restores=found.storage_restores,
            restore_class="exact" if exact or not lossy else "stored",
        )

    def _intact(self, snap: Snapshot, buf: memoryview, exact: bool = False) -> bool:
        """A shared segment is writable by its trainer: check every tensor still holds what was
        saved (the same digest a storage restore checks) before serving it."""
        for t in snap.stored:
            if t.lossy and not exact:
                continue  # its restored values come from the held stored form, not these bytes
            why = mf.check_digest(t, buf[t.offset : t.offset + t.nbytes])
            if why is not None:
                log.error(
                    "rank %d: step %d in memory changed since it was saved (%s: %s); "
                    "reading it from storage instead",
                    snap.identity.rank,
                    snap.step,
                    t.name,
                    why,
                )
                return False
        return True

    def _from_storage(
        self, identity: Identity, target: Position, kind: str = "restore", files_ok: bool = False
    ) -> RestoreData:
        commit = self._commit(identity.job_key, target)  # read once: _load asked for it too
        if commit.world_size != identity.world_size:
            raise FailedPrecondition(_other_world(target, commit.world_size, identity.world_size))
        manifest = mf.load_manifest(self.store, commit, identity.rank)
        refs = {r.step: r for r in manifest.required_commits}

        def load(older: int) -> mf.Manifest:
            ref = refs.get(older)
            if ref is None:
                raise NotFound(f"step {target[1]} names no COMMIT for its base step {older}")
            return mf.load_manifest(self.store, mf.load_ref(self.store, ref), identity.rank)

        # A lossless full is read straight into the buffer; anything else is decoded into it
        # while one step's objects are held besides: reserved, as the manifests size them,
        # before a byte is allocated (the reader refuses a step larger than that).
        chain = {m.step: m for m in load_chain(manifest, load)}  # read once, replayed below
        if files_ok:
            # Stored in place, as files: lent as they are, the trainer reads them once, straight
            # into its tensors, while the disk reads ahead (no copy in memory here at all).
            files = open_objects(self.store, manifest, self.shared.segments.lendable_files())
            if files is not None:
                return _stored(manifest, target, files.chunks(), None, files=files)
        held = held_bytes(list(chain.values()))
        need = manifest.total_bytes + held
        memory = self.memory.reserve(kind, need, f"reading step {target[1]} from storage")
        # Where restores are lent over the handover socket, into the memfd that is then sealed
        # and lent as it is: the bytes are written once, by the read.
        try:
            lent = self.shared.segments.restore_buffer(manifest.total_bytes)
        except OSError as exc:
            log.info("restore read into process memory: no room for a shared buffer (%s)", exc)
            lent = None
        try:
            pieces = read_snapshot(
                self.store, manifest, chain.__getitem__, self.shared.uploads, dest=lent, max_held=held
            )
            memory.shrink(manifest.total_bytes)  # a step held besides is gone
            if manifest.checkpoint == "diff":  # the chain replayed must give back what was saved
                why = _replayed_differs(manifest.tensors, lent if lent is not None else pieces[0])
                if why is not None:
                    raise CorruptObject(f"step {target[1]}", f"{why} restored differs from what was saved")
        except BaseException:
            if lent is not None:
                lent.close()
            raise
        # Read back only where a trainer takes no segment (its restore is streamed over gRPC).
        chunks = lent.chunks() if lent is not None else iter(pieces)
        return _stored(manifest, target, chunks, memory, lendable=lent)

    # --- queries -----------------------------------------------------------------------------

    def list_checkpoints(self, namespace: str, job: str) -> list[tuple[mf.Commit, bool]]:
        check_job(namespace, job)
        out = []
        for attempt, step in mf.valid_commits(self.store, namespace, job):
            commit = mf.read_commit(self.store, namespace, job, step, attempt)
            out.append((commit, self.held.in_memory(namespace, job, (attempt, step))))
        return out

    def describe(self, namespace: str, job: str, step: int, rank: int) -> tuple[mf.Commit, bytes]:
        check_job(namespace, job)
        if step < 0 or rank < 0:
            raise InvalidArgument(f"step and rank must be >= 0, got step {step}, rank {rank}")
        commit = mf.read_commit(self.store, namespace, job, step)
        ref = commit.manifest_for(rank)
        return commit, self.store.get(ref.key)

    def forget_prefetched(self, slot: Slot) -> None:
        """Drop what prefetch read (or reads) ahead for ``slot``."""
        with self.shared.lock:
            self.prefetched.pop(slot, None)
            self._loading.pop(slot, None)


def _stored(
    manifest: mf.Manifest,
    target: Position,
    chunks: Iterator[memoryview],
    memory: Reservation | None,
    **where: Any,
) -> RestoreData:
    """A restore of ``manifest``'s step from storage; ``where``: its bytes' ``files`` or ``lendable``."""
    return RestoreData(
        target[1],
        manifest.tensors,
        manifest.tree,
        manifest.total_bytes,
        "storage",
        "",
        chunks,
        manifest.restores,
        memory,
        manifest.foreign(),
        target[0],
        storage_restores=manifest.storage_restores,
        restore_class="stored" if any(t.lossy for t in manifest.tensors) else "exact",
        **where,
    )


def _other_world(target: Position, saved_by: int, world_size: int) -> str:
    return (
        f"{RESHARD_MARKER}: step {target[1]} was saved by {saved_by} ranks; this job runs "
        f"{world_size}. A restore gives each rank what that rank saved; a client that can reshard "
        "reads every rank's snapshot instead (replicated state), and DTensor/FSDP2 state saved "
        "through torch.distributed.checkpoint loads with trainer_client.dcp's StrataReader, "
        "whose planner reshards"
    )


def _replayed_differs(tensors: list[mf.TensorEntry], buf: memoryview | RestoreBuffer) -> str | None:
    """The first lossless tensor of a replayed chain whose bytes are not what was saved, or None;
    a memfd is read a piece at a time (mapping it would cost its page tables)."""
    exact = [t for t in tensors if not t.lossy]
    if isinstance(buf, memoryview):
        return next((t.name for t in exact if mf.check_digest(t, buf[t.offset : t.offset + t.nbytes])), None)
    digests = mf.StreamDigests(exact)
    piece = memoryview(bytearray(min(READ_PIECE_BYTES, max(1, buf.size))))
    for at in range(0, buf.size, len(piece)):
        chunk = piece[: min(len(piece), buf.size - at)]
        buf.read(at, chunk)
        digests.update(at, chunk)
    why = digests.check()  # "name: why"
    return None if why is None else why.split(": ", 1)[0]


def _with_digests(tensors: list[mf.TensorEntry], stored: list[mf.TensorEntry]) -> list[mf.TensorEntry]:
    """``tensors`` (as a save declared them) with the digests and encodings of the entries stored
    for them, so the restore header carries what the reader checks its copy against."""
    by_name = {(t.name, t.offset, t.nbytes): t for t in stored}
    out = []
    for t in tensors:
        s = by_name.get((t.name, t.offset, t.nbytes))
        out.append(
            t if s is None else dataclasses.replace(t, xxh3=s.xxh3, crc32=s.crc32, bits=s.bits, cast=s.cast)
        )
    return out


def _peer_data(
    manifest: mf.Manifest, target: Position, view: memoryview, memory: Reservation | None
) -> RestoreData:
    """A rank's snapshot of ``target`` that came from other members, as its MANIFEST describes it:
    the bytes as saved (peers hold and serve nothing else), every digest checked."""
    return RestoreData(
        target[1],
        manifest.tensors,
        manifest.tree,
        manifest.total_bytes,
        "peer",
        "",
        iter([view]),
        manifest.restores,
        memory,
        manifest.foreign(),
        target[0],
        storage_restores=manifest.storage_restores,
        restore_class="exact",
    )
