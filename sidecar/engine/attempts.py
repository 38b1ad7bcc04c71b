"""Generations and attempts: which gang generation a trainer belongs to (generation file,
--generation, or what the trainer declares), the client protocol check, the attempt (EPOCH)
each generation runs as (rank 0's sidecar allocates it in storage, other ranks wait for it),
the restore step a new attempt records (the operator's restore request, else the newest
usable commit), commits found unusable, and the operator's "stop"."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

from sidecar import manifest as mf
from sidecar.api import EXIT_LIMIT_SPENT, LIMIT_SPENT_MARKER, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
from sidecar.errors import (
    CorruptObject,
    FailedPrecondition,
    InvalidArgument,
    ObjectNotFound,
    PreconditionFailed,
    StrataError,
)
from sidecar.gang import JobGang, Position

from .held import Held
from .reports import Reports
from .state import Shared
from .types import Identity, JobKey, Slot

log = logging.getLogger(__name__)

#: The longest rank 0's sidecar waits for every rank's holdings report before it decides a
#: restore class (stored, when one is missing: a rank still being scheduled, say).
EXACT_WAIT_S = 60.0


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


class Attempts:
    def __init__(self, shared: Shared, held: Held, reports: Reports) -> None:
        self.shared = shared
        self.settings = shared.settings
        self.store = shared.store
        self.held = held
        self.reports = reports
        # Markers whose write to storage failed, per job, until a write succeeds: storage holds
        # every other marker (an operator clears them there, and the next attempt sees that).
        self._unusable: dict[JobKey, dict[Position, mf.UnusableMarker]] = {}
        # What each attempt's restore step passed over: (namespace, job, attempt) -> markers
        self._skipped: dict[tuple[str, str, int], list[mf.UnusableMarker]] = {}
        # The markers each restore decision read: (namespace, job, attempt it decided for) -> markers
        self._markers: dict[tuple[str, str, int], list[mf.UnusableMarker]] = {}
        # Single ranks of protocol-1 clients (which declare no generation): slot -> the
        # generation this sidecar gave the trainer process at its handshake (see greet).
        self._v1_solo: dict[Slot, str] = {}
        #: what this sidecar holds exactly for a rank as a generation starts (the engine sets it)
        self.holdings_of: Callable[[Identity, str], mf.Holdings] | None = None

    def generation_of(self, identity: Identity) -> mf.Generation:
        """The generation file when the sidecar has one (the launcher or a downward-API volume
        writes it), else what the trainer declares."""
        declared = identity.generation.strip()
        path = self.settings.generation_file
        if not path and self.settings.generation:
            if declared.startswith("solo-"):
                declared = ""
            try:
                fixed = self._in_place(identity, mf.Generation.parse(self.settings.generation))
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
                generation = self._in_place(identity, mf.Generation.parse(text))
            except ValueError as exc:
                raise FailedPrecondition(f"generation file {path}: {exc}") from None
            if declared and declared != str(generation):
                raise FailedPrecondition(
                    f"the trainer declares generation {declared}, but this pod's generation file says "
                    f"{generation}: a trainer of another gang generation reached this sidecar"
                )
            return generation
        if not declared:
            with self.shared.lock:
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

    def _in_place(self, identity: Identity, generation: mf.Generation) -> mf.Generation:
        """An in-place gang restart the operator asked for (Reports.restart_generation) wins over
        the pod's generation until the pod's own (its file follows the annotation the operator
        writes) is as new."""
        wanted = self.reports.restart_generation(identity.job_key)
        if wanted is not None and wanted.run == generation.run and wanted.restart > generation.restart:
            return wanted
        return generation

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
        with self.shared.lock:
            if handshake or identity.slot not in self._v1_solo:
                self._v1_solo[identity.slot] = f"solo-v1-{uuid.uuid4().hex[:16]}/0"

    def epoch_for(self, identity: Identity) -> mf.Epoch:
        """The attempt ``identity``'s generation runs as: rank 0's sidecar creates it (after
        settling what it still uploads), every other rank waits until it exists."""
        epoch = self._epoch_for(identity)
        self.reports.note_rank(identity, epoch)
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
        gang = self.shared.gang(identity.job_key)
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
                    self.adopt(gang, epoch)
            return epoch
        with gang.epoch_lock:
            with gang.cond:
                if gang.epoch is not None and gang.epoch.generation == str(generation):
                    return gang.epoch
            epoch = self._find_or_create_epoch(identity, gang, generation)
            self.adopt(gang, epoch)
            self.reports.retained(gang)
            return epoch

    def _find_or_create_epoch(self, identity: Identity, gang: JobGang, generation: mf.Generation) -> mf.Epoch:
        ns, job = identity.job_key
        deadline = time.monotonic() + self.settings.commit_timeout_s
        delay = 0.05
        # A lone rank's class is what it finds (see Restorer._wanted_class): no reports then.
        reported = not self.exact_classes or identity.world_size == 1
        if identity.rank == 0:
            self.held.settle(identity.job_key)
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
            if not reported:
                reported = True
                self._report_holdings(identity, generation)
            if identity.rank == 0:
                restore, reason = self.decide_restore(identity, fences)
                restore_class = self._restore_class(identity, generation, restore)
                if self.exact_classes:
                    self._forget_older_holdings(identity, generation, newest)
                try:
                    return mf.create_epoch(
                        self.store,
                        ns,
                        job,
                        generation,
                        identity.world_size,
                        restore,
                        fences,
                        reason,
                        restore_class,
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
            if self.shared.stopping.is_set() or time.monotonic() > deadline:
                raise FailedPrecondition(
                    f"{ns}/{job}: rank 0 of generation {generation} did not record its attempt within "
                    f"{self.settings.commit_timeout_s:.0f} s"
                )
            with gang.cond:
                gang.cond.wait(delay)
            delay = min(delay * 1.5, 1.0)

    @property
    def exact_classes(self) -> bool:
        """Whether attempts decide a restore class: lossy storage with --restore-class auto (else
        every restore gives what storage holds, which is exact for lossless checkpoints)."""
        quant = self.shared.quant
        return quant.enabled and quant.exact

    def _report_holdings(self, identity: Identity, generation: mf.Generation) -> None:
        """Tell rank 0's sidecar, through storage, what this rank's sidecar holds exactly as a
        generation starts. Best effort: a report that is not written makes the class stored."""
        if self.holdings_of is None:
            return
        self.held.settle(identity.job_key)  # what a completed stream commits is held, then
        report = self.holdings_of(identity, str(generation))
        key = mf.holdings_key(*identity.job_key, str(generation), identity.rank)
        try:
            self.store.put(key, report.to_json())
        except (StrataError, OSError) as exc:
            log.warning(
                "rank %d: holdings report not written (%s): the restore class is stored", identity.rank, exc
            )

    def _restore_class(self, identity: Identity, generation: mf.Generation, restore: Position | None) -> str:
        """ "exact" when every rank's sidecar reports it can restore ``restore`` exactly, else "".
        Waits for a report of every rank (the gang waits for every rank anyway), at most
        EXACT_WAIT_S; a rank not heard from by then makes the class stored."""
        if restore is None or not self.exact_classes or identity.world_size == 1:
            return ""
        ns, job = identity.job_key
        prefix = mf.holdings_prefix(ns, job, str(generation))
        world = identity.world_size
        reports: dict[int, mf.Holdings] = {}
        if self.holdings_of is not None:  # its own, known here whether or not its write went through
            reports[identity.rank] = mf.about(self.holdings_of(identity, str(generation)), restore)
        deadline = time.monotonic() + min(EXACT_WAIT_S, self.settings.commit_timeout_s)
        delay = 0.05
        while True:
            try:
                # bounded: a bucket full of junk under the prefix makes the class stored, no more
                keys = [o.key for o in self.store.list(prefix, limit=world + 64).objects]
            except (StrataError, OSError) as exc:
                log.warning(
                    "%s/%s: holdings reports unreadable (%s): the restore class is stored", ns, job, exc
                )
                return ""
            for key in keys:
                tail = key[len(prefix) :]
                if not tail.isdigit() or int(tail) >= world or int(tail) in reports:
                    continue
                rank = int(tail)
                try:
                    found = mf.Holdings.from_json(self.store.get(key), key)
                except CorruptObject as exc:
                    # an answer all the same: that rank holds nothing exactly (read once, not
                    # again at every poll until the wait is spent)
                    log.warning("%s/%s: %s unreadable (%s): rank %d holds nothing", ns, job, key, exc, rank)
                    reports[rank] = mf.Holdings(str(generation), rank)
                    continue
                except (StrataError, OSError) as exc:
                    log.warning("%s/%s: %s not read (%s); reading it again", ns, job, key, exc)
                    continue
                if found.generation == str(generation) and found.rank == rank:
                    reports[rank] = mf.about(found, restore)
                else:
                    reports[rank] = mf.Holdings(str(generation), rank)
            if mf.exact_everywhere(world, restore, reports):
                if self._inexact_before(identity, restore):
                    return ""
                log.info(
                    "%s/%s: every rank holds step %d exactly: the restore class is exact", ns, job, restore[1]
                )
                return "exact"
            if (
                len(reports) >= world
                or time.monotonic() > deadline
                or self.shared.stopping.is_set()
                # restarted again meanwhile: the next generation's rank 0 waits for this lock
                or self.shared.gang(identity.job_key).generation != generation
            ):
                missing = world - len(reports)
                log.info(
                    "%s/%s: step %d is not held exactly for every rank (%s): the restore class is stored",
                    ns,
                    job,
                    restore[1],
                    f"{missing} rank(s) not heard from" if missing else "some rank lost its copy",
                )
                return ""
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def note_inexact(self, identity: Identity, target: Position, why: str) -> None:
        """``identity``'s rank could not restore ``target`` exactly, which its attempt promised
        (its copy went, or what a peer sent did not match): recorded in storage, so the next
        attempt restoring it takes the stored class instead of trusting the same reports again."""
        key = mf.inexact_key(*identity.job_key, target)
        try:
            self.store.put(key, f"rank {identity.rank}: {why}\n".encode())
        except (StrataError, OSError) as exc:
            log.warning("rank %d: %s not written (%s)", identity.rank, key, exc)

    def _inexact_before(self, identity: Identity, restore: Position) -> bool:
        """Whether a rank of an earlier attempt failed to restore ``restore`` exactly (or that
        cannot be read now): the class is stored then."""
        key = mf.inexact_key(*identity.job_key, restore)
        try:
            found = self.store.head(key) is not None
        except (StrataError, OSError) as exc:
            log.warning("%s unreadable (%s): the restore class is stored", key, exc)
            return True
        if found:
            log.info(
                "%s: a rank of an earlier attempt could not restore step %d exactly: the "
                "restore class is stored",
                key,
                restore[1],
            )
        return found

    def _forget_older_holdings(
        self, identity: Identity, generation: mf.Generation, previous: mf.Epoch | None
    ) -> None:
        """Delete the holdings reports of the previous attempt's generation (best effort: they
        are small, and a report of another generation is never read). Never a newer one's (the
        gang may have been restarted again meanwhile, its ranks reporting already), and nothing
        is listed (a distrusted bucket's junk is never read)."""
        if previous is None or previous.generation == str(generation):
            return
        ns, job = identity.job_key
        ranks = max(previous.world_size, identity.world_size)
        try:
            self.store.delete([mf.holdings_key(ns, job, previous.generation, r) for r in range(ranks)])
        except (StrataError, OSError) as exc:
            log.info("%s/%s: older holdings reports not deleted (%s)", ns, job, exc)

    def reattempt(self, identity: Identity) -> mf.Epoch:
        """A new attempt for the same generation (world size 1 only), deciding its restore again."""
        gang = self.shared.gang(identity.job_key)
        generation = self.generation_of(identity)
        ns, job = identity.job_key
        deadline = time.monotonic() + self.settings.commit_timeout_s
        with gang.epoch_lock:
            while True:
                fences = gang.refresh_fences()
                restore, reason = self.decide_restore(identity, fences)
                try:
                    epoch = mf.create_epoch(self.store, ns, job, generation, 1, restore, fences, reason)
                except PreconditionFailed:
                    if time.monotonic() > deadline:
                        raise FailedPrecondition(f"{ns}/{job}: could not allocate an attempt") from None
                    time.sleep(0.1)
                    continue
                self.adopt(gang, epoch)
                return epoch

    def decide_restore(self, identity: Identity, fences: mf.Fences) -> tuple[Position | None, str]:
        """The restore step of a new attempt and how it was chosen (recorded in its EPOCH): the
        operator's one-shot restore request when this pod has one, else the newest usable commit."""
        ns, job = identity.job_key
        self._write_pending_markers(identity)
        markers = mf.unusable_markers(self.store, ns, job)
        with self.shared.lock:
            # what skipped_by reports for the attempt this decides, without another LIST
            self._markers[(ns, job, fences.newest_attempt + 1)] = markers
            while len(self._markers) > 256:
                self._markers.pop(next(iter(self._markers)))
            local = set(self._unusable.get(identity.job_key, {}))
        unusable = {mk.position for mk in markers} | local
        # After an in-place restart the pod's request file may still hold the previous release's
        # one-shot request (its annotation is cleared, the file follows late): the newest usable
        # commit it is (the operator never restarts in place with a rollback pending).
        in_place = self.reports.restart_generation(identity.job_key) is not None
        request = None if in_place else self.restore_request()
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

    def restore_request(self) -> str | None:
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

    def mark_unusable(
        self, identity: Identity, position: Position, reason: str, cause: str = "corrupt"
    ) -> mf.UnusableMarker:
        """Mark a commit this rank could not restore (``cause``: "missing" or "corrupt"), naming
        the rank, its generation and this sidecar as the writer."""
        gang = self.shared.gang(identity.job_key)
        by = (
            f"rank {identity.rank}/{identity.world_size} of generation {gang.generation or '?'}, "
            f"sidecar {socket.gethostname()} pid {os.getpid()}"
        )
        marker = mf.UnusableMarker(position[0], position[1], cause, reason, by, time.time())
        if not mf.mark_unusable(self.store, *identity.job_key, position, reason, cause, by):
            # Remembered here until written: a marker that failed to write must not send us round
            # in circles. A written one lives in storage only, where `strata markers --clear` works.
            with self.shared.lock:
                self._unusable.setdefault(identity.job_key, {})[position] = marker
        return marker

    def _write_pending_markers(self, identity: Identity) -> None:
        """Write again the markers whose write failed; each one written is storage's from then on."""
        with self.shared.lock:
            pending = list(self._unusable.get(identity.job_key, {}).values())
        for mk in pending:
            if mf.mark_unusable(self.store, *identity.job_key, mk.position, mk.detail, mk.cause, mk.by):
                with self.shared.lock:
                    job = self._unusable.get(identity.job_key, {})
                    job.pop(mk.position, None)
                    if not job:
                        self._unusable.pop(identity.job_key, None)

    def skipped_by(self, identity: Identity, epoch: mf.Epoch) -> list[mf.UnusableMarker]:
        """The marked commits ``epoch``'s restore step passed over: valid as the attempts before it
        fenced them, newer than what it restores. [] when the operator chose the step. Read once
        per attempt (one LIST, normally of nothing), or not at all where this sidecar decided it."""
        if epoch.restore_reason:
            return []
        key = (*identity.job_key, epoch.attempt)
        with self.shared.lock:
            found = self._skipped.get(key)
        if found is not None:
            return found
        with self.shared.lock:
            local = dict(self._unusable.get(identity.job_key, {}))
            read = self._markers.get(key)
        if read is None:  # this sidecar did not allocate the attempt
            read = mf.unusable_markers(self.store, *identity.job_key)
        markers = {mk.position: mk for mk in read}
        for position, mk in local.items():
            markers.setdefault(position, mk)
        fences = self.shared.gang(identity.job_key).fences
        earlier = {b: r for b, r in fences.restores.items() if b < epoch.attempt}

        def valid_then(attempt: int, step: int) -> bool:
            return all(step <= (-1 if r is None else r) for b, r in earlier.items() if b > attempt)

        restored = epoch.restore
        found = [
            mk
            for position, mk in sorted(markers.items())
            if position[0] < epoch.attempt
            and valid_then(*position)
            and (restored is None or position > restored)
        ]
        with self.shared.lock:
            self._skipped[key] = found
            while len(self._skipped) > 256:
                self._skipped.pop(next(iter(self._skipped)))
        return found

    def adopt(self, gang: JobGang, epoch: mf.Epoch) -> None:
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
        self.shared.metrics.attempt.labels(gang.job).set(epoch.attempt)
        self.held.drop_fenced((gang.namespace, gang.job), fences)
