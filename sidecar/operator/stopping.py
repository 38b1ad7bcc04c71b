"""Stopping the old gang: evict what runs, delete what a disruption budget protects (marked
DisruptionTarget), fence what hangs in Terminating past its grace period. A pod that answers 404 to
any of these is gone, as if its DELETED event had come (a watch that expired never sends it)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sidecar.operator.classify import is_terminal
from sidecar.operator.gang import (
    WatchedJob,
    is_gated,
    meta_of,
    parse_time,
    with_disruption_target,
)
from sidecar.operator.kube import ApiError, path
from sidecar.operator.stratajob import StrataJobStatus

log = logging.getLogger("strata.operator")

__all__ = ["GangStopping"]


class GangStopping(StrataJobStatus):
    """Stop pods and wait for them to be gone."""

    async def _stop_pods(self, job: WatchedJob, pods: list[dict[str, Any]]) -> None:
        """Evict every pod that still runs (DisruptionTarget, which podFailurePolicy ignores); a
        PodDisruptionBudget's 429 falls back to a delete, any other 429 is retried."""
        for pod in pods:
            meta = meta_of(pod)
            uid = str(meta.get("uid"))
            # The index may lag our own evictions (the watch brings the deletion later): once each.
            if is_terminal(pod) or meta.get("deletionTimestamp") or is_gated(pod) or uid in job.stopped:
                continue
            job.stopped.add(uid)
            name = str(meta["name"])
            eviction = {
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": name, "namespace": job.namespace},
            }
            try:
                try:
                    await self.api.create(path("", "v1", "pods", job.namespace, name, "eviction"), eviction)
                except ApiError as exc:
                    if exc.status == 404:
                        self._gone(job, name, pod)
                        continue
                    if not exc.disruption_budget:
                        # API Priority and Fairness' 429 too: the apiserver is busy, no budget
                        # refused; the reconcile retries after its Retry-After.
                        raise
                    log.info(
                        "%s/%s: eviction of %s refused by a disruption budget; deleting it",
                        job.namespace,
                        job.name,
                        name,
                    )
                    await self._disrupt_and_delete(job, pod)
            except BaseException:
                job.stopped.discard(uid)  # not stopped after all: the retry tries again
                raise

    async def _disrupt_and_delete(self, job: WatchedJob, pod: Mapping[str, Any]) -> None:
        """What the taint manager and the pod GC do: mark the pod DisruptionTarget (so the Job's
        podFailurePolicy ignores it, as it ignores an eviction), then delete it."""
        meta = meta_of(pod)
        url = path("", "v1", "pods", job.namespace, str(meta["name"]))
        conditions = with_disruption_target(
            pod,
            "DeletionByStrataGangRestart",
            "Strata operator: the gang restarts (a disruption budget refused the eviction)",
        )
        try:
            await self.api.strategic_patch(url + "/status", {"status": {"conditions": conditions}})
        except ApiError as exc:
            if exc.status == 404:
                self._gone(job, str(meta["name"]), pod)
                return
            raise
        if not await self.api.delete(url):
            self._gone(job, str(meta["name"]), pod)

    async def _wait_gone(self, job: WatchedJob, pods: list[dict[str, Any]]) -> bool:
        """True once every pod in ``pods`` is terminal or gone. A pod still Terminating
        ``--fence-margin-seconds`` after its deletion deadline (its node is gone) is force-deleted:
        storage fences its attempt off, so nothing it still writes can commit, and without this its
        index never gets a replacement (podReplacementPolicy: Failed)."""
        now = self.clock()
        left = 0
        for pod in pods:
            meta = meta_of(pod)
            name = str(meta["name"])
            if is_terminal(pod) or name not in job.pods:
                continue  # ended, or gone from the index meanwhile (a 404 said so)
            left += 1
            # The apiserver sets deletionTimestamp to the end of the grace period.
            deadline = parse_time(meta.get("deletionTimestamp"))
            if deadline is None:
                continue
            if now < deadline + self.fence_margin_s:
                self._wake(job, deadline + self.fence_margin_s)
                continue
            url = path("", "v1", "pods", job.namespace, name)
            # As the pod GC does for pods of a lost node: terminal phase and DisruptionTarget first
            # (the Job controller counts a pod only once it is terminal, and the rule ignores it),
            # then the force delete.
            conditions = with_disruption_target(
                pod,
                "DeletionByStrataFence",
                "Strata operator: still Terminating past its grace period (its node is gone)",
            )
            try:
                await self.api.strategic_patch(
                    url + "/status", {"status": {"phase": "Failed", "conditions": conditions}}
                )
            except ApiError as exc:
                if exc.status != 404:
                    raise
                # Gone: its DELETED event never came (the watch expired meanwhile).
                self._gone(job, name, pod)
                left -= 1
                continue
            if not await self.api.delete(url, {"gracePeriodSeconds": 0}):
                self._gone(job, name, pod)  # already gone once terminal: fenced all the same
                left -= 1
            if name not in job.fenced:
                job.fenced.add(name)
                await self._event(
                    job,
                    "PodFenced",
                    f"pod {name} was still Terminating {now - deadline:.0f} s after its grace period ended "
                    f"(margin {self.fence_margin_s:.0f} s): force-deleted it; its attempt is fenced off in "
                    "storage",
                    warning=True,
                )
        return left == 0
