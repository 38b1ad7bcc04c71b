"""Snapshots held in memory, per rank: the list admission appends to, the save outcomes a
trainer asks about, the newest committed snapshot kept for fast restore (REFT's double
buffering; with a single staging segment, until the trainer stages into it again), each rank's
diff chain with its COMMITs and held lossy forms, their share of the memory budget, and the
held-bytes gauge.

Every table here is guarded by the shared lock (``Shared.lock``); methods whose name ends in
``_locked`` (and ``account``) expect the caller to hold it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from sidecar import manifest as mf
from sidecar.budget import Reservation
from sidecar.errors import FailedPrecondition, ResourceExhausted
from sidecar.gang import Position
from sidecar.pipeline.plan import Chain, HeldForms, base_digests, layout_of

from .state import Shared
from .types import Identity, JobKey, Slot, Snapshot, drop_buffer, outcome_of

log = logging.getLogger(__name__)

#: One step of a chain's held lossy forms: (step, its stored tensor entries, name -> stored form)
Layer = tuple[int, list[mf.TensorEntry], dict[str, bytes]]


class Held:
    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.slots: dict[Slot, list[Snapshot]] = {}
        self.outcomes: OrderedDict[str, Snapshot] = OrderedDict()
        # Per rank: the budget share of its held lossy forms (layers)
        self.layer_memory: dict[Slot, Reservation] = {}
        # Per rank: what its newest committed checkpoint consists of (for the next diff), and the
        # COMMIT of every step of that chain (diffs name their base by COMMIT key and sha256).
        self.chains: dict[Slot, Chain] = {}
        self.chain_refs: dict[Slot, dict[int, mf.CommitRef]] = {}
        # Per rank: the stored form of every lossy tensor of that chain, step by step, so a memory
        # restore gives exactly the values a storage restore gives (and every rank agrees).
        self.layers: dict[Slot, list[Layer]] = {}
        # Per rank: the step its trainer restored from memory with lossy tensors decoded: until its
        # next commit the trainer holds that step as storage gives it, not the exact bytes held.
        self.decoded: dict[Slot, int] = {}
        # Per job: restores seen, and those that gave lossy values, carried forward in manifests
        # (bit-width escalation).
        self.restores: dict[JobKey, int] = {}
        self.storage_restores: dict[JobKey, int] = {}

    # --- snapshots ---------------------------------------------------------------------------

    def open_slot_locked(self, identity: Identity) -> list[Snapshot]:
        """The list of ``identity``'s rank's held snapshots, a new one for a rank this sidecar
        holds nothing of, within ``--max-ranks`` (caller holds the lock). At the cap, ranks that
        hold nothing are retired first (their chain with them: their next checkpoint is full);
        a save of one more is refused. Per-rank state must not grow with the identities a
        client names: every job on this sidecar would run out of memory and threads."""
        held = self.slots.get(identity.slot)
        if held is not None:
            return held
        cap = self.shared.settings.max_ranks
        if len(self.slots) >= cap:
            for slot in [s for s, h in self.slots.items() if not h]:
                del self.slots[slot]
            for slot in (
                self.chains.keys() | self.chain_refs.keys() | self.layers.keys() | self.decoded.keys()
            ) - self.slots.keys():
                self.decoded.pop(slot, None)
                self.chains.pop(slot, None)
                self.chain_refs.pop(slot, None)
                self.layers.pop(slot, None)
                self.account(slot)
        if len(self.slots) >= cap:
            raise ResourceExhausted(
                f"this sidecar holds snapshots of {len(self.slots)} ranks, its --max-ranks "
                f"(STRATA_MAX_RANKS) {cap}: rank {identity.rank} of {identity.namespace}/{identity.job} "
                "can save once one of them holds nothing"
            )
        held = self.slots[identity.slot] = []
        return held

    def remember(self, snap: Snapshot) -> None:
        with self.shared.lock:
            self.outcomes[snap.save_id] = snap
            while len(self.outcomes) > 1024:
                self.outcomes.popitem(last=False)

    def release(self, snap: Snapshot) -> None:
        with self.shared.lock:
            held = self.slots.get(snap.identity.slot, [])
            if snap in held:
                held.remove(snap)
            self._drop_locked(snap)
        self.update_gauge()

    def _drop_locked(self, snap: Snapshot) -> None:
        """Give up what ``snap`` holds; its outcome stays known, without its tree and tensors."""
        drop_buffer(snap)
        if self.outcomes.get(snap.save_id) is snap:
            self.outcomes[snap.save_id] = outcome_of(snap)

    def keep_newest_committed(self, snap: Snapshot) -> None:
        """Only the newest committed snapshot of a rank stays in memory."""
        with self.shared.lock:
            held = self.slots.get(snap.identity.slot, [])
            committed = [s for s in held if s.state == "committed"]
            newest = max(committed, key=lambda s: s.position)
            for old in committed:
                if old is not newest:
                    held.remove(old)
                    self._drop_locked(old)
        self.update_gauge()

    def drop_segment(
        self, name: str, slot: Slot, busy: Callable[[JobKey, Position], bool] | None = None
    ) -> str:
        """The trainer of rank ``slot`` is about to stage into its shared segment ``name`` again
        (one staging segment): the committed snapshot held in it goes from memory first, so that
        no memory restore, holdings report or diff reads it while it is overwritten. Storage has
        it; the rank's chain stays (its digests stand for the bytes). Not while ``busy`` says the
        step is being read for peers (they would get torn bytes): the trainer then stages into a
        new segment. "" once done, else why not (of that rank's own steps only).

        The next diff needs the chain's digests of what the trainer holds: the encoder kept them
        unless this step was compared with a copy, or the trainer restored it with lossy tensors
        decoded; then they are computed here, from the bytes while they are intact, when a diff
        can follow (not under policy full, nor at the end of a chain)."""
        with self.shared.lock:
            found = [s for s in self.slots.get(slot, []) if s.segment == name]
            for snap in found:
                if snap.state != "committed":
                    return f"segment {name} holds step {snap.step}, still {snap.state}"
                if busy is not None and busy(snap.identity.job_key, snap.position):
                    return f"step {snap.step} in segment {name} is being copied to peers"
            todo = []
            chain = self.chains.get(slot)
            for snap in found:
                decoded = self.decoded.get(slot) == snap.step
                if (
                    chain is not None
                    and chain.steps[-1] == snap.step
                    and (chain.digests is None or decoded)
                    and self._diff_may_follow(chain, snap)
                ):
                    forms = [(t, h) for _, t, h in self.layers.get(slot, [])] if decoded else []
                    todo.append((chain, snap, memoryview(snap.buffer), forms))
        for chain, snap, view, forms in todo:  # the trainer waits; nothing else writes these bytes
            digests = self._base_digests(chain, snap, view, forms)
            with self.shared.lock:
                if self.chains.get(slot) is chain:
                    self.chains[slot] = replace(chain, digests=digests)
                    if digests is not None:
                        self.decoded.pop(slot, None)  # the digests are of the decoded values
                    self.account(slot)
        with self.shared.lock:
            for snap in [s for s in self.slots.get(slot, []) if s.segment == name]:
                self.slots[slot].remove(snap)
                self._drop_locked(snap)
                log.info(
                    "rank %d: step %d leaves memory, its trainer stages into its segment again",
                    snap.identity.rank,
                    snap.step,
                )
        self.update_gauge()
        return ""

    def _diff_may_follow(self, chain: Chain, snap: Snapshot) -> bool:
        """Whether the next checkpoint after ``chain`` may be a diff: digests are needed then only."""
        settings = self.shared.settings
        return (
            settings.policy != "full"
            and bool(chain.since_full)
            and len(chain.sizes) < settings.max_diffs
            and chain.layout == layout_of(snap.tensors)
        )

    def _base_digests(
        self, chain: Chain, snap: Snapshot, view: memoryview, forms: list[HeldForms]
    ) -> dict[str, np.ndarray] | None:
        """The digests of the snapshot in ``view`` as its trainer holds it; None (the next
        checkpoint is full) where they cannot be computed within the memory budget."""
        names = list(chain.since_full)
        if any(t.offset + t.nbytes > len(view) for t in snap.tensors if t.name in names):
            return None
        decoded = {n for _, h in forms for n in h}
        widest = max((t.nbytes for t in snap.tensors if t.name in decoded), default=0)
        rank = snap.identity.rank
        room = None
        try:
            if widest:  # a decoded tensor is copied, one at a time, as commit._encoder does
                room = self.shared.memory.reserve(
                    "encode", widest, f"digesting step {snap.step} (rank {rank})"
                )
            return base_digests(snap.tensors, view, names, forms)
        except (ResourceExhausted, FailedPrecondition, ValueError, MemoryError) as exc:
            log.warning(
                "rank %d: no digests of step %d (%s); its next checkpoint is full", rank, snap.step, exc
            )
            return None
        finally:
            if room is not None:
                room.release()

    def drop_committed_locked(self, identity: Identity, what: str) -> None:
        """Give up the committed copies in memory of ``identity``'s rank (caller holds the lock):
        they are a cache (storage has them)."""
        held = self.slots.get(identity.slot, [])
        for old in [s for s in held if s.state == "committed" and s.memory is not None]:
            held.remove(old)
            self._drop_locked(old)
            log.info("rank %d: dropped step %d from memory to fit %s", identity.rank, old.step, what)

    def drop_fenced(self, job_key: JobKey, fences: mf.Fences) -> None:
        """Drop the job's committed snapshots and chains that ``fences`` fenced off."""
        with self.shared.lock:
            for slot, held in self.slots.items():
                if slot[:2] != job_key:
                    continue
                for snap in list(held):
                    if snap.state == "committed" and not fences.valid(*snap.position):
                        held.remove(snap)
                        self._drop_locked(snap)
                refs = self.chain_refs.get(slot, {})
                if any(not fences.valid(r.attempt, r.step) for r in refs.values()):
                    self.chains.pop(slot, None)
                    self.chain_refs.pop(slot, None)
                    self.layers.pop(slot, None)
                    self.decoded.pop(slot, None)
                    self.account(slot)
        self.update_gauge()

    def update_gauge(self) -> None:
        with self.shared.lock:
            total = sum(len(s.buffer) for held in self.slots.values() for s in held)
        self.shared.metrics.held_bytes.set(total)

    def wait_committed(self, save_id: str, timeout: float) -> Snapshot | None:
        """The snapshot once it is final (or still pending at the timeout); None if unknown."""
        with self.shared.lock:
            snap = self.outcomes.get(save_id)
        if snap is None:
            return None
        snap.done.wait(timeout)
        return snap

    def snapshots(self) -> list[Snapshot]:
        with self.shared.lock:
            return [s for held in self.slots.values() for s in held]

    def uploading_steps(self, slot: Slot, attempt: int) -> set[int]:
        """Steps of ``attempt`` whose stream is complete: uploading, or durable and waiting for
        the COMMIT."""
        with self.shared.lock:
            return {
                s.step
                for s in self.slots.get(slot, [])
                if s.attempt == attempt and (s.state == "uploading" or s.manifest_durable)
            }

    def settle(self, job_key: JobKey) -> None:
        """Wait (one bound for all of them) until the job's uploading snapshots are final."""
        # Every rank of the job, not just this one: what a completed stream commits must be
        # seen before the restore step is decided.
        with self.shared.lock:
            pending = [
                s
                for (ns, job, _), held in self.slots.items()
                if (ns, job) == job_key
                for s in held
                if s.state == "uploading"
            ]
        deadline = time.monotonic() + self.shared.settings.commit_timeout_s  # one bound for all of them
        for snap in pending:
            snap.done.wait(max(0.0, deadline - time.monotonic()))

    def newest_committed(self, identity: Identity) -> Position | None:
        with self.shared.lock:
            held = [s.position for s in self.slots.get(identity.slot, []) if s.state == "committed"]
        return max(held) if held else None

    def committed_copy(
        self, identity: Identity, target: Position
    ) -> tuple[Snapshot, memoryview, list[Layer]] | None:
        """The committed snapshot of ``target`` still in memory (same world size), a view of its
        buffer and the rank's held lossy forms; None when it is not held."""
        found = None
        with self.shared.lock:
            for snap in self.slots.get(identity.slot, []):
                if (
                    snap.position == target
                    and snap.state == "committed"
                    and snap.identity.world_size == identity.world_size
                ):
                    found, buf = snap, memoryview(snap.buffer)
            layers = list(self.layers.get(identity.slot, []))
        if found is None:
            return None
        return found, buf, layers

    def exact_positions(self, identity: Identity) -> list[list[int]]:
        """The commits of ``identity``'s rank held in memory as its trainer saved them (same world
        size): what a holdings report lists as its own."""
        with self.shared.lock:
            return [
                list(s.position)
                for s in self.slots.get(identity.slot, [])
                if s.state == "committed" and s.identity.world_size == identity.world_size
            ]

    def world_size_of(self, job_key: JobKey, position: Position) -> int | None:
        """The number of ranks that saved the commit ``position`` of the job, when this sidecar holds
        one of its committed snapshots (else None)."""
        with self.shared.lock:
            for (ns, jb, _), held in self.slots.items():
                if (ns, jb) != job_key:
                    continue
                for s in held:
                    if s.position == position and s.state == "committed":
                        return s.identity.world_size
        return None

    def in_memory(self, namespace: str, job: str, position: Position) -> bool:
        with self.shared.lock:
            return any(
                s.position == position and s.state == "committed"
                for (ns, jb, _), held in self.slots.items()
                if ns == namespace and jb == job
                for s in held
            )

    # --- chains ------------------------------------------------------------------------------

    def diff_base(
        self, snap: Snapshot
    ) -> tuple[Chain | None, memoryview | None, frozenset[str], list[HeldForms]]:
        """What ``snap`` may be encoded against: the rank's chain, the buffer of its newest
        committed snapshot while it is still held, the tensors whose lossy forms are held, and,
        when the trainer restored that snapshot from memory with its lossy tensors decoded, the
        chain's held forms (the base to compare is then the decoded one). Sets
        ``snap.restores`` to the job's restores."""
        ident = snap.identity
        previous = None
        with self.shared.lock:
            chain = self.chains.get(ident.slot)
            snap.restores = self.restores.get(ident.job_key, 0)
            snap.storage_restores = min(snap.restores, self.storage_restores.get(ident.job_key, 0))
            for held in self.slots.get(ident.slot, []):
                if chain is not None and held.state == "committed" and held.step == chain.steps[-1]:
                    previous = memoryview(held.buffer)
            refs = self.chain_refs.get(ident.slot, {})
            if chain is not None and not all(s in refs for s in chain.steps):
                chain, previous = None, None  # a base without a known COMMIT: start a new chain
            layers = self.layers.get(ident.slot, [])
            hold = frozenset(n for _, _, held in layers for n in held)
            decoded = (
                [(t, h) for _, t, h in layers]
                if chain is not None and self.decoded.get(ident.slot) == chain.steps[-1]
                else []
            )
        return chain, previous, hold, decoded

    def chain_committed(
        self,
        slot: Slot,
        chain: Chain,
        step: int,
        ref: mf.CommitRef,
        tensors: list[mf.TensorEntry],
        forms: dict[str, bytes],
    ) -> None:
        """``step`` committed as the end of ``chain``: keep the COMMITs and held lossy forms of
        the chain's steps, drop the rest."""
        with self.shared.lock:
            self.chains[slot] = chain
            self.decoded.pop(slot, None)  # the trainer holds exactly this snapshot
            kept = {s: r for s, r in self.chain_refs.get(slot, {}).items() if s in chain.steps}
            kept[step] = ref
            self.chain_refs[slot] = kept
            layers = [x for x in self.layers.get(slot, []) if x[0] in chain.steps[:-1]]
            layers.append((step, tensors, forms))
            self.layers[slot] = layers if any(h for _, _, h in layers) else []
            self.account(slot)

    def restored(
        self,
        identity: Identity,
        keep_chain: bool,
        restores: int,
        storage_restores: int = 0,
        exact: bool = False,
    ) -> None:
        """The trainer of ``identity`` restored a checkpoint saved after ``restores`` restores
        (``storage_restores`` of them lossy), ``exact``ly as saved or with lossy tensors as
        storage holds them. Unless ``keep_chain``, the rank's chain ends: the next checkpoint is
        full. If it is kept, holds lossy forms and the restore handed them out decoded, the next
        diff compares with those values, else every row of a quantized table would differ from
        the exact bytes held; after an exact restore it compares with the exact bytes, as if
        training had never stopped (storage's forms of the rows it skips are those values')."""
        key = identity.job_key
        with self.shared.lock:
            chain = self.chains.get(identity.slot)
            if keep_chain and not exact and chain is not None and self.layers.get(identity.slot):
                self.decoded[identity.slot] = chain.steps[-1]
            else:
                self.decoded.pop(identity.slot, None)
            if not keep_chain:
                self.chains.pop(identity.slot, None)
                self.chain_refs.pop(identity.slot, None)
                self.layers.pop(identity.slot, None)
                self.account(identity.slot)
            # Every rank of a gang restart restores once: count the restart, not the ranks.
            if restores + 1 > self.restores.get(key, 0):
                self.restores[key] = restores + 1
            lossy = storage_restores + (0 if exact else 1)
            if lossy > self.storage_restores.get(key, 0):
                self.storage_restores[key] = lossy

    def account(self, slot: Slot) -> None:
        """Charge a rank's held lossy forms and its chain's digests to the budget (caller holds
        the shared lock). Digests that do not fit are dropped (the next checkpoint is full unless
        the previous snapshot is still held); lossy forms that do not fit are dropped too: memory
        restores of that chain then read storage."""
        old = self.layer_memory.pop(slot, None)
        if old is not None:
            old.release()
        layers = self.layers.get(slot, [])
        size = sum(len(b) for _, _, held in layers for b in held.values())
        chain = self.chains.get(slot)
        digests = sum(d.nbytes for d in chain.digests.values()) if chain and chain.digests else 0
        if not size + digests:
            return
        what = f"rank {slot[2]}'s held lossy forms and digests"
        try:
            self.layer_memory[slot] = self.shared.memory.reserve("encode", size + digests, what)
            return
        except (ResourceExhausted, FailedPrecondition) as exc:
            if digests:
                log.warning("rank %d: %s; its next diff needs a held copy to compare with", slot[2], exc)
                assert chain is not None
                self.chains[slot] = replace(chain, digests=None)
        if not size:
            return
        try:
            what = f"rank {slot[2]}'s held lossy forms"
            self.layer_memory[slot] = self.shared.memory.reserve("encode", size, what)
        except (ResourceExhausted, FailedPrecondition) as exc:
            log.warning("rank %d: %s; its memory restores read storage instead", slot[2], exc)
            # A chain whose held forms have a gap cannot be replayed: the next checkpoint is full.
            self.layers[slot] = []
            self.chains.pop(slot, None)
            self.chain_refs.pop(slot, None)
