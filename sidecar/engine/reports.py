"""Reports to the operator (sidecar.reporting; off without --report-url): each rank's heartbeat
(generation, attempt, saves, step), every commit, the retained steps a new attempt re-reports,
and retention's deletes. Best effort, and never on the commit path."""

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
        self.reporter = reporting.Reporter(
            settings.report_url,
            shared.metrics.registry,
            token_file=settings.report_token_file,
            ca_file=settings.report_ca_file,
            heartbeat_s=settings.heartbeat_s,
            heartbeats=self._heartbeat_items,
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
