"""Releasing a gang: write the generation and lift the gang gate on every pod at once, or release
replacements with the restore request stop once the restart limit is spent."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.operator import names
from sidecar.operator.classify import is_terminal
from sidecar.operator.gang import (
    WatchedJob,
    failed_indexes,
    index_of,
    is_gated,
    is_stopping,
    meta_of,
    now_text,
    owner_uid,
)
from sidecar.operator.kube import ApiError, path
from sidecar.operator.stopping import GangStopping

__all__ = ["GangRelease"]


class GangRelease(GangStopping):
    """Lift the gang gate of a whole generation at once."""

    async def _release(
        self, job: WatchedJob, pods: list[dict[str, Any]], generation: str, *, first: bool
    ) -> None:
        """Write the generation on every gated pod and lift the gates, once every index has its pod.
        Idempotent: pods a failed earlier attempt at this release already carry ``generation`` count
        as released, so a release cut short (an API error, an operator restart) completes."""
        assert job.status is not None and job.workload is not None
        live = [p for p in pods if not is_terminal(p) and not meta_of(p).get("deletionTimestamp")]
        gated = [p for p in live if is_gated(p)]
        done = [
            p
            for p in live
            if not is_gated(p)
            and (meta_of(p).get("annotations") or {}).get(names.GENERATION_ANNOTATION) == generation
        ]
        indexes = {index_of(p) for p in gated + done}
        ready = len(gated) + len(done) >= job.world if None in indexes else indexes >= set(range(job.world))
        if not ready:
            return  # the Job controller is still creating them: their ADDED events wake us
        # Taken before the patches: a replacement of a pod that vanishes meanwhile is younger.
        started = now_text()
        request = self._restore_request(job, first)
        for pod in gated:
            if not await self._lift_gate(
                job, pod, {names.GENERATION_ANNOTATION: generation, names.RESTORE_REQUEST_ANNOTATION: request}
            ):
                return  # gone: the release completes once its replacement is here (idempotent)
        changes: dict[str, Any] = {
            "phase": "Running",
            "generation": generation,
            "pendingRestart": None,
            "generationStartedAt": started,
            "restartMode": "pod",
        }
        resume_from = job.settings.resume_from if job.settings.resume_from_set else None
        if request is not None and job.settings.resume_from_set:
            changes["resumeFromApplied"] = str(resume_from) if resume_from is not None else "none"
        job.progress_at = self.clock()
        job.progress.clear()
        job.vanished.clear()
        job.stopped.clear()
        released = len(gated) + len(done)
        message = f"released {released} pods as generation {generation}" + (
            f", restoring {'nothing (fresh)' if request == 'none' else f'step {request}'} once"
            if request
            else ""
        )
        await self._patch_status(job, changes, condition=("Restarting", "False", "Released", message))
        await self._event(job, "GangReleased", message)

    async def _release_to_stop(self, job: WatchedJob, pods: list[dict[str, Any]]) -> None:
        """The job failed for good: once the old gang is gone, release its replacements with the
        restore request "stop". Their sidecars refuse the trainers, which exit 76, and the Job's
        podFailurePolicy rule (FailJob) ends the Job, freeing its quota. Never two gangs at once;
        all replacements at once (a lone one would wait for its peers); and only when the Job has
        that rule (without it each exit would be retried: the replacements stay gated)."""
        old = [p for p in pods if not is_gated(p) and not is_stopping(p) and not is_terminal(p)]
        live = [p for p in pods if not is_terminal(p) and not meta_of(p).get("deletionTimestamp")]
        gated = [p for p in live if is_gated(p)]
        if not gated or not await self._wait_gone(job, old):
            return
        if not self._fails_on_limit_spent(job):
            if not job.warned_no_failjob:
                job.warned_no_failjob = True
                await self._event(
                    job,
                    "ReplacementsKeptGated",
                    f"the Job has no podFailurePolicy rule onExitCodes In [{names.EXIT_LIMIT_SPENT}] action "
                    "FailJob, so its replacement pods stay gated (a trainer that exits would be retried): "
                    "delete the Job",
                    warning=True,
                    on_workload=True,
                )
            return
        # The Job controller re-creates neither a succeeded index nor one it gave up on (past
        # backoffLimitPerIndex): no replacement of theirs is waited for.
        succeeded = {index_of(p) for p in pods if (p.get("status") or {}).get("phase") == "Succeeded"}
        succeeded |= set(failed_indexes(job.workload))
        have = {index_of(p) for p in gated} | {index_of(p) for p in live if is_stopping(p)}
        if None not in have and not set(range(job.world)) - succeeded <= have:
            return  # the Job controller is still creating replacements
        generation = job.status.get("generation") if job.status else None
        stop = {names.GENERATION_ANNOTATION: generation, names.RESTORE_REQUEST_ANNOTATION: names.STOP_REQUEST}
        for pod in gated:
            if not await self._lift_gate(job, pod, stop):
                return
        await self._event(
            job,
            "ReleasedToStop",
            f"released {len(gated)} replacement pod(s) with the restore request {names.STOP_REQUEST!r}: "
            f"their trainers exit {names.EXIT_LIMIT_SPENT}, which the Job's podFailurePolicy turns into "
            "FailJob",
        )

    async def _lift_gate(
        self, job: WatchedJob, pod: dict[str, Any], annotations: Mapping[str, str | None]
    ) -> bool:
        """Write ``annotations`` (None removes one) and remove the gang gate, in one JSON patch that
        tests the gate's position first: a whole-list patch would put back a gate someone else (Kueue)
        removed meanwhile. When the list changed under it (422), the pod is read again and the patch
        retried once. False where the pod is gone (404: as if its DELETED event came, which a watch
        that expired never sends; the job reconciles again at once)."""
        meta = meta_of(pod)
        url = path("", "v1", "pods", job.namespace, str(meta["name"]))
        for retry in (False, True):
            try:
                updated = await self.api.json_patch(url, _release_ops(pod, annotations))
                break
            except ApiError as exc:
                if exc.status == 404:
                    return self._gone_now(job, pod)
                if exc.status != 422 or retry:
                    raise
            fresh = await self.api.get(url)
            if fresh is None:
                return self._gone_now(job, pod)
            pod = fresh
        job.released_uids.add(str(meta.get("uid")))
        if isinstance(updated, dict) and str(meta["name"]) in job.pods:
            job.pods[str(meta["name"])] = updated  # the watch brings the same; do not wait for it
        return True

    def _gone_now(self, job: WatchedJob, pod: dict[str, Any]) -> bool:
        """A pod found gone by a write (404): handled as its DELETED event; reconcile again."""
        self._gone(job, str(meta_of(pod)["name"]), pod)
        self._wake(job, self.clock())
        return False

    async def _patch_pod(
        self, job: WatchedJob, pod: dict[str, Any], patch: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Merge-patch a pod of the gang; None where it is gone (see :meth:`_gone_now`)."""
        name = str(meta_of(pod)["name"])
        try:
            return await self.api.merge_patch(path("", "v1", "pods", job.namespace, name), patch)
        except ApiError as exc:
            if exc.status != 404:
                raise
        self._gone_now(job, pod)
        return None

    def _fails_on_limit_spent(self, job: WatchedJob) -> bool:
        """The Job's podFailurePolicy fails it when a trainer exits EXIT_LIMIT_SPENT."""
        rules = (((job.workload or {}).get("spec") or {}).get("podFailurePolicy") or {}).get("rules") or []
        return any(
            r.get("action") == "FailJob"
            and (r.get("onExitCodes") or {}).get("operator") == "In"
            and names.EXIT_LIMIT_SPENT in ((r.get("onExitCodes") or {}).get("values") or [])
            for r in rules
        )

    def _restore_request(self, job: WatchedJob, first: bool) -> str | None:
        """The one-shot restore request for the next generation: ``strata.dev/resume-from`` once per
        value it takes, and "none" for the first generation of a fresh run."""
        assert job.status is not None
        if job.settings.resume_from_set:
            wanted = "none" if job.settings.resume_from is None else str(job.settings.resume_from)
            if job.status.get("resumeFromApplied") != wanted:
                return wanted
        if first and job.status.get("runMode") == "fresh":
            return "none"
        return None

    async def _earlier_run_gone(self, job: WatchedJob) -> bool:
        """A resubmitted Job's first gang waits for the pods of the earlier Job of its name (still
        Terminating, or orphaned): two runs never train side by side."""
        earlier = [p for p in job.pods.values() if owner_uid(p) != job.uid and not is_terminal(p)]
        if await self._wait_gone(job, earlier):
            return True
        if not job.warned_earlier_run:
            job.warned_earlier_run = True
            names_left = ", ".join(sorted(str(meta_of(p).get("name")) for p in earlier)[:5])
            await self._event(
                job,
                "WaitingForEarlierRun",
                f"{len(earlier)} pod(s) of an earlier {job.kind} named {job.name} still run ({names_left}); "
                "this run starts when they are gone (delete them if they were orphaned)",
                warning=True,
                on_workload=True,
            )
        return False


def _release_ops(pod: Mapping[str, Any], annotations: Mapping[str, str | None]) -> list[dict[str, Any]]:
    """The JSON patch (RFC 6902) that writes ``annotations`` and removes the gang gate: a ``test`` of
    each gate's position before its ``remove``, so no other gate is touched (gates.py does the same)."""
    ops: list[dict[str, Any]] = []
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    for i in reversed([i for i, g in enumerate(gates) if g.get("name") == names.GANG_GATE]):
        ops.append({"op": "test", "path": f"/spec/schedulingGates/{i}/name", "value": names.GANG_GATE})
        ops.append({"op": "remove", "path": f"/spec/schedulingGates/{i}"})
    held = meta_of(pod).get("annotations")
    if held is None:
        written = {k: v for k, v in annotations.items() if v is not None}
        if written:
            ops.append({"op": "add", "path": "/metadata/annotations", "value": written})
        return ops
    for key, value in annotations.items():
        pointer = "/metadata/annotations/" + key.replace("~", "~0").replace("/", "~1")
        if value is not None:
            ops.append({"op": "add", "path": pointer, "value": value})  # add replaces a value
        elif key in held:
            ops.append({"op": "remove", "path": pointer})
    return ops
