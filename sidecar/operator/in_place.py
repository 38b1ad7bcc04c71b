"""In-place restarts: the trainers restart inside their pods (container restart rules); pods,
sidecars and their memory stay. Falls back to the pod-level restart."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from sidecar.coordinator import Failure, FailureKind
from sidecar.operator import names
from sidecar.operator.classify import classify_pod, is_terminal
from sidecar.operator.gang import (
    WatchedJob,
    index_of,
    is_gated,
    meta_of,
    next_generation,
    now_text,
    parse_time,
)
from sidecar.operator.release import GangRelease

__all__ = ["InPlaceRestart"]

#: Failure kinds an in-place restart may answer: the trainer crashed, raised or hung, and its pod,
#: sidecar and memory are intact. A pod or node lost, an eviction or a deletion need new pods.
IN_PLACE_KINDS = frozenset({FailureKind.EXIT_ERROR, FailureKind.SIGNAL, FailureKind.OOM, FailureKind.HANG})


class InPlaceRestart(GangRelease):
    """Restart a gang's trainer containers in place."""

    def _in_place_kind(self, job: WatchedJob, failure: Failure) -> bool:
        """Whether a restart for ``failure`` may try in place (the pods are checked when it starts)."""
        return (
            self.in_place_restart
            and job.kind == "Job"
            and failure.kind in IN_PLACE_KINDS
            and self._restore_request(job, first=False) is None  # a rollback needs a fresh release
        )

    def _in_place_problem(self, job: WatchedJob, gang: list[dict[str, Any]]) -> str | None:
        """Why the gang cannot restart in place, or None: every index has its pod of the current
        generation, running, not deleted, and its trainer container(s) carry the restart rule (the
        API server drops it where the ContainerRestartRules feature gate is off)."""
        indexes = {index_of(p) for p in gang}
        if len(gang) < job.world or (None not in indexes and not indexes >= set(range(job.world))):
            return f"{len(gang)} of {job.world} pods of the gang are left"
        for pod in gang:
            name = meta_of(pod).get("name")
            if is_terminal(pod) or meta_of(pod).get("deletionTimestamp"):
                return f"pod {name} ended or is being deleted"
            if (pod.get("status") or {}).get("phase") != "Running":
                return f"pod {name} is {(pod.get('status') or {}).get('phase') or 'not running'}"
            failure = classify_pod(pod, container=self.trainer_container)
            if failure is not None and failure.kind not in IN_PLACE_KINDS:
                return f"pod {name}: {failure.describe()}"
            trainers = [
                c
                for c in (pod.get("spec") or {}).get("containers") or []
                if self.trainer_container is None or c.get("name") == self.trainer_container
            ]
            if not trainers or not all(c.get("restartPolicyRules") for c in trainers):
                return (
                    f"pod {name} has no container restart rule on its trainer (Kubernetes before 1.34, "
                    "the ContainerRestartRules feature gate off, or admitted without --in-place-restart)"
                )
        return None

    async def _restart_in_place(
        self, job: WatchedJob, pods: list[dict[str, Any]], pending: Mapping[str, Any]
    ) -> None:
        """Restart the trainer containers and keep the pods: every sidecar is told the new
        generation in the answer to its next heartbeat, adopts it, and makes its trainers exit
        EXIT_RESTART_IN_PLACE (their restart rule restarts them); once every rank's sidecar
        acknowledged, the pods' generation annotation follows and the generation runs. Falls back
        to the pod-level restart when the gang cannot (a pod gone or not running, no restart rule)
        or the acknowledgements do not come within ``in_place_timeout_s``."""
        assert job.status is not None
        target = str(pending["generation"])
        current = job.status.get("generation")
        gang = [
            p
            for p in pods
            if not is_gated(p)
            and (meta_of(p).get("annotations") or {}).get(names.GENERATION_ANNOTATION) == current
        ]
        problem = self._in_place_problem(job, gang)
        if problem is not None:
            await self._fall_back(job, pending, problem)
            return
        not_before = parse_time(str(pending.get("notBefore"))) or 0.0
        if self.clock() < not_before:
            self._wake(job, not_before)
            return
        instructed = parse_time(str(pending.get("instructedAt") or ""))
        if instructed is None:
            instructed = self.clock()
            at = datetime.datetime.fromtimestamp(instructed, tz=datetime.UTC).strftime(
                "%Y-%m-%dT%H:%M:%S.%fZ"
            )
            job.acks.clear()
            await self._patch_status(job, {"pendingRestart": {**pending, "instructedAt": at}})
            await self._event(
                job,
                "InPlaceRestart",
                f"restarting the trainers of {len(gang)} pods in place as generation {target}: their "
                "sidecars are told at their next heartbeat; pods, sidecars and memory stay",
            )
        acked = {r for r, g in job.acks.items() if g == target}
        if acked >= set(range(job.world)):
            await self._finish_in_place(job, gang, target)
            return
        deadline = instructed + self.in_place_timeout_s
        if self.clock() >= deadline:
            await self._fall_back(
                job,
                pending,
                f"{len(acked)} of {job.world} ranks' sidecars acknowledged within "
                f"{self.in_place_timeout_s:g} s",
            )
            return
        self._wake(job, deadline)

    async def _finish_in_place(self, job: WatchedJob, gang: list[dict[str, Any]], target: str) -> None:
        started = now_text()
        for pod in gang:
            meta = meta_of(pod)
            # The generation file follows (a sidecar restarted later reads it); the one-shot restore
            # request of the previous release is spent.
            updated = await self._patch_pod(
                job,
                pod,
                {
                    "metadata": {
                        "annotations": {
                            names.GENERATION_ANNOTATION: target,
                            names.RESTORE_REQUEST_ANNOTATION: None,
                        }
                    }
                },
            )
            if updated is None:
                return  # gone: the gang is short of a pod, which the next reconcile finds
            if isinstance(updated, dict) and str(meta["name"]) in job.pods:
                job.pods[str(meta["name"])] = updated
        job.progress_at = self.clock()
        job.progress.clear()
        job.vanished.clear()
        job.stopped.clear()
        job.acks.clear()
        message = f"restarted the trainers of {len(gang)} pods in place as generation {target}"
        await self._patch_status(
            job,
            {
                "phase": "Running",
                "generation": target,
                "pendingRestart": None,
                "generationStartedAt": started,
                "restartMode": "in-place",
            },
            condition=("Restarting", "False", "RestartedInPlace", message),
        )
        await self._event(job, "GangRestartedInPlace", message)

    async def _fall_back(self, job: WatchedJob, pending: Mapping[str, Any], why: str) -> None:
        """The pod-level restart instead, as the next generation: sidecars that adopted the in-place
        one are fenced off like any earlier gang's. The restart is counted once."""
        fallback = {
            **{k: v for k, v in pending.items() if k != "instructedAt"},
            "mode": "pod",
            "generation": next_generation(str(pending["generation"])),
            "fallback": why,
        }
        job.acks.clear()
        await self._patch_status(job, {"pendingRestart": fallback})
        await self._event(
            job,
            "InPlaceRestartFallback",
            f"not restarting in place ({why}): restarting the gang's pods as generation "
            f"{fallback['generation']}",
            warning=True,
        )
        await self._restart(job, self._own_pods(job), fallback)

    def _in_place_answer(
        self, job: WatchedJob, item: Mapping[str, Any], pod: str | None
    ) -> dict[str, Any] | None:
        """While an in-place restart waits for its acknowledgements: note this rank's (its sidecar
        reports the generation it adopted), else the instruction for its sidecar."""
        assert job.status is not None
        pending = job.status.get("pendingRestart") or {}
        if pending.get("mode") != "in-place" or not pending.get("instructedAt"):
            return None
        target = str(pending.get("generation"))
        rank = item.get("rank")
        if not isinstance(rank, int):
            return None
        if target in (item.get("restart_generation"), item.get("generation")):
            if job.acks.get(rank) != target:
                job.acks[rank] = target
                if set(range(job.world)) <= {r for r, g in job.acks.items() if g == target}:
                    self._wake(job, self.clock())  # every rank acknowledged: finish the restart now
            return None
        if pod is not None and pod not in job.pods:
            return None  # not a pod of this gang the watch knows
        return {
            "namespace": job.namespace,
            "job": job.name,
            "restart": {"generation": target, "reason": str(pending.get("reason") or "")},
        }
