"""Reports to the operator (sidecar.reporting; off without --report-url): each rank's heartbeat
(generation, attempt, saves, step, where its last restore came from, the generation of an in-place
restart it adopted), every commit, the retained steps a new attempt re-reports, and retention's
deletes. Best effort, and never on the commit path.

The operator's answers may carry instructions (sidecar.reporting): an in-place gang restart names
the generation the gang runs next. :meth:`Reports.restart_generation` is what the attempts and the
Attach streams read: that generation wins over the pod's generation file until the file (the
operator writes the pod annotation too) catches up."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from sidecar import manifest as mf
from sidecar import reporting
from sidecar.gang import JobGang

from .state import Shared
from .types import Identity, JobKey, Slot

log = logging.getLogger(__name__)


class Reports:
    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        settings = shared.settings
        # Per rank, what its heartbeats say; per job, the attempt of each step reported committed
        # (for delete reports).
        self._beats: dict[Slot, dict[str, Any]] = {}
        self._reported: dict[JobKey, dict[int, int]] = {}
        # In-place restarts the operator asked for: per job, the generation to run next.
        self._restarts: dict[JobKey, mf.Generation] = {}
        self.reporter = reporting.Reporter(
            settings.report_url,
            shared.metrics.registry,
            token_file=settings.report_token_file,
            ca_file=settings.report_ca_file,
            heartbeat_s=settings.heartbeat_s,
            heartbeats=self._heartbeat_items,
            on_instruction=self.on_instruction,
        )

    @property
    def enabled(self) -> bool:
        return self.reporter.enabled

    def note_rank(self, identity: Identity, epoch: mf.Epoch) -> None:
        """What this rank's heartbeats say: its generation and attempt (saves and step as they go)."""
        if not self.reporter.enabled:
            return
        with self.shared.lock:
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
                known = self._restarts.get(identity.job_key)
                if known is not None:
                    beat["restart_generation"] = str(known)
            beat.update(generation=epoch.generation, attempt=epoch.attempt, restore_step=epoch.restore_step)

    def count_save_locked(self, slot: Slot) -> None:
        """One more save admitted for ``slot`` (caller holds the shared lock)."""
        beat = self._beats.get(slot)
        if beat is not None:
            beat["saves"] += 1

    def note_step(self, slot: Slot, step: int) -> None:
        """``step`` of ``slot`` committed."""
        with self.shared.lock:
            beat = self._beats.get(slot)
            if beat is not None:
                beat["step"] = step

    def note_restore(self, slot: Slot, step: int, source: str, restore_class: str = "") -> None:
        """``slot`` restored ``step`` from ``source`` (memory, peer or storage), of
        ``restore_class`` (exact or stored): its heartbeats say so, and the operator writes it on
        that step's Checkpoint. Called once a restore was served whole (a replica fetch for
        another rank does not count)."""
        with self.shared.lock:
            beat = self._beats.get(slot)
            if beat is not None:
                beat["restore_source"] = source
                beat["restored_step"] = step
                if restore_class:
                    beat["restore_class"] = restore_class

    # --- in-place restarts ------------------------------------------------------------------

    def on_instruction(self, instruction: dict[str, Any]) -> None:
        """An instruction from the operator's answer (the reporting thread calls it). Only
        ``{"namespace", "job", "restart": {"generation": "RUN/RESTART", "reason": "..."}}`` is
        known; anything else is logged and ignored (a newer operator may send more)."""
        restart = instruction.get("restart")
        if not isinstance(restart, dict):
            log.info("ignored an instruction from the operator: %s", sorted(instruction))
            return
        key = (str(instruction.get("namespace", "")), str(instruction.get("job", "")))
        self.adopt_restart(key, str(restart.get("generation", "")), str(restart.get("reason", "")))

    def adopt_restart(self, job_key: JobKey, generation: str, reason: str = "") -> bool:
        """Run ``job_key``'s next trainers as ``generation`` (an in-place gang restart): attached
        trainers of an older generation are told to exit (servicer.Attach). Only a newer
        generation of the same run is taken; True when it was."""
        try:
            wanted = mf.Generation.parse(generation)
        except ValueError as exc:
            log.warning("%s/%s: in-place restart instruction ignored: %s", *job_key, exc)
            return False
        with self.shared.lock:
            known = self._restarts.get(job_key)
            if known is not None and (known.run, known.restart) >= (wanted.run, wanted.restart):
                return False
            self._restarts[job_key] = wanted
            for slot, beat in self._beats.items():
                if slot[:2] == job_key:
                    beat["restart_generation"] = str(wanted)
        log.warning(
            "%s/%s: the operator restarts the gang in place as generation %s%s: attached trainers "
            "exit and restart, and restore from this sidecar's memory",
            *job_key,
            wanted,
            f" ({reason})" if reason else "",
        )
        gang = self.shared.gang(job_key)
        with gang.cond:
            gang.cond.notify_all()
        self.beat_now(job_key)  # the operator counts the acknowledgements
        return True

    def restart_generation(self, job_key: JobKey) -> mf.Generation | None:
        """The generation an in-place restart asked ``job_key`` to run next, or None."""
        with self.shared.lock:
            return self._restarts.get(job_key)

    def restart_for(self, job_key: JobKey, generation: str) -> str:
        """The generation a trainer running as ``generation`` must restart as (an in-place restart
        named a newer one of the same run), else ""."""
        wanted = self.restart_generation(job_key)
        try:
            running = mf.Generation.parse(generation)
        except ValueError:
            return ""
        if wanted is None or wanted.run != running.run or wanted.restart <= running.restart:
            return ""
        return str(wanted)

    def beat_now(self, job_key: JobKey) -> None:
        """Queue every rank's heartbeat of ``job_key`` now, not at the next period."""
        now = time.time()
        with self.shared.lock:
            items = [{**b, "time": now} for slot, b in self._beats.items() if slot[:2] == job_key]
        for item in items:
            self.reporter.report(item)

    def _heartbeat_items(self) -> list[dict[str, Any]]:
        now = time.time()
        with self.shared.lock:
            return [{**beat, "time": now} for beat in self._beats.values()]

    def heartbeat(self, slot: Slot) -> None:
        with self.shared.lock:
            beat = self._beats.get(slot)
            item = None if beat is None else {**beat, "time": time.time()}
        if item is not None:
            self.reporter.report(item)

    def _location(self, namespace: str, job: str) -> str:
        return reporting.location(self.shared.settings.storage, namespace, job)

    def commit(self, commit: mf.Commit, ref: mf.CommitRef, bodies: dict[int, tuple[str, bytes]]) -> None:
        """Queue the commit report; it is built in the reporting thread (off the commit path)."""
        if not self.reporter.enabled:
            return
        try:
            with self.shared.lock:
                self._reported.setdefault((commit.namespace, commit.job), {})[commit.step] = commit.attempt
            where = self._location(commit.namespace, commit.job)
            self.reporter.report(lambda: reporting.commit_item(commit, ref.sha256, bodies, where))
        except Exception:  # a report never fails a commit
            log.exception("step %d committed; its report to the operator failed", commit.step)

    def retained(self, gang: JobGang) -> None:
        """Rank 0 of a new attempt re-reports every retained committed step (the operator may
        have missed them while it was down), read from storage in the background."""
        if not self.reporter.enabled:
            return
        fences = gang.fences
        ns, job = gang.namespace, gang.job
        store = self.shared.store

        def read() -> None:
            try:
                positions = mf.valid_commits(store, ns, job, fences)
                with self.shared.lock:
                    self._reported.setdefault((ns, job), {}).update({s: a for a, s in positions})
                items = reporting.stored_commit_items(store, ns, job, self._location(ns, job), positions)
                for item in items:
                    self.reporter.report(item)
                log.info("%s/%s: re-reported %d retained committed steps", ns, job, len(items))
            except Exception as exc:
                log.warning("%s/%s: retained steps not re-reported: %s", ns, job, exc)

        threading.Thread(target=read, name="strata-rereport", daemon=True).start()

    def deletes(self, gang: JobGang, deleted: list[int], known: dict[int, list[int]]) -> None:
        if not deleted or not self.reporter.enabled:
            return
        key = (gang.namespace, gang.job)
        for step in deleted:
            with self.shared.lock:
                attempt = self._reported.get(key, {}).pop(step, None)
            if attempt is None:  # not reported by this process: the newest valid commit retention knew
                attempts = [a for a in known.get(step, []) if gang.fences.valid(a, step)]
                if not attempts:
                    continue
                attempt = attempts[-1]
            self.reporter.report(reporting.delete_item(gang.namespace, gang.job, step, attempt))

    def close(self) -> None:
        self.reporter.close(reporting.FLUSH_TIMEOUT_S)
