"""The StrataJob: its status (the controller's decisions, so a restarted operator carries on),
its settings from the workload's annotations, and the Events posted on it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sidecar.operator import annotations as table
from sidecar.operator import names, objects
from sidecar.operator.admission import opted_in
from sidecar.operator.gang import (
    ControllerBase,
    WatchedJob,
    meta_of,
    run_id,
)
from sidecar.operator.kube import ApiError, path

log = logging.getLogger("strata.operator")

__all__ = ["StrataJobGone", "StrataJobStatus"]

STRATAJOBS = ("strata.dev", "v1alpha1", "stratajobs")


class StrataJobGone(ApiError):
    """A write to a watched workload's StrataJob answered 404: it was deleted under the live
    workload (by hand, by the garbage collector, by a retention racing a resubmission). The
    controller forgets what it loaded, so the next reconcile recreates it."""


class StrataJobStatus(ControllerBase):
    """Load, create and patch the StrataJob of a watched workload; post Events on it."""

    def _stratajob_path(self, job: WatchedJob, subresource: str | None = None) -> str:
        return path(*STRATAJOBS, job.namespace, job.name, subresource)

    async def _load(self, job: WatchedJob) -> None:
        """Read (or create) the StrataJob; a new workload uid under a used name is a new run."""
        assert job.workload is not None
        found = await self.api.get(self._stratajob_path(job))
        workload = {
            "apiVersion": job.workload.get("apiVersion", "batch/v1"),
            "kind": job.kind,
            "metadata": {"name": job.name, "uid": job.uid},
        }
        parsed = self._parse_settings(job)
        fresh = parsed.run == "fresh"
        if found is None:
            body = objects.stratajob_body(
                job.namespace, job.name, workload, max_restarts=self._restart_limit(job)
            )
            try:
                found = await self.api.create(path(*STRATAJOBS, job.namespace), body)
            except ApiError as exc:
                if exc.status != 409:
                    raise
                found = await self.api.get(self._stratajob_path(job))
                assert found is not None
            lost, job.lost_status = job.lost_status, None
            if lost is not None:
                # Deleted under the live workload: what this process knew carries on (the restarts
                # spent, the generation running), rather than a new run beside the running gang.
                status = {k: v for k, v in lost.items() if k != "workloadDeletedAt"}
                log.warning(
                    "%s/%s: the StrataJob was deleted while the %s runs; recreated it",
                    job.namespace,
                    job.name,
                    job.kind,
                )
            else:
                status = self._new_run(job, found.get("status") or {}, resumed=False, fresh=fresh)
            job.stratajob = found
            job.status = dict(found.get("status") or {})
            job.seen_at = self.clock()
            await self._patch_status(job, status)
            return
        job.stratajob = found
        job.status = dict(found.get("status") or {})
        job.seen_at = self.clock()
        known_uid = ((found.get("spec") or {}).get("workload") or {}).get("uid")
        if known_uid != job.uid:
            # Resubmitted under the same name: a new run (its own retry budget), resuming the
            # checkpoints unless strata.dev/run says fresh.
            reference = {
                "apiVersion": workload["apiVersion"],
                "kind": job.kind,
                "name": job.name,
                "uid": job.uid,
            }
            await self._write(job, self._stratajob_path(job), {"spec": {"workload": reference}})
            status = self._new_run(job, job.status, resumed=not fresh, fresh=fresh)
            await self._patch_status(job, status)
            await self._event(
                job,
                "NewRun",
                f"{job.kind} {job.name} was resubmitted (uid {job.uid}): run {status['run']} "
                + ("starts fresh" if fresh else "resumes the newest committed step"),
            )

    def _new_run(
        self, job: WatchedJob, old: Mapping[str, Any], *, resumed: bool, fresh: bool
    ) -> dict[str, Any]:
        status: dict[str, Any] = {
            "phase": "Pending",
            "run": run_id(job.uid, job.kind),
            "runMode": "fresh" if fresh else "resumed",
            "generation": None,
            "generationStartedAt": None,
            "restarts": 0,
            "disruptions": 0,
            "restartLimit": self._restart_limit(job),
            "pendingRestart": None,
            "attempt": None,
            "restoreStep": None,
            "lastFailure": old.get("lastFailure") if resumed else None,
        }
        status["resumeFromApplied"] = None  # a new run applies the Job's resume-from once
        return status

    def _restart_limit(self, job: WatchedJob) -> int:
        """The StrataJob's ``restartLimit``: Strata's setting (a JobSet's is its own)."""
        return job.settings.max_restarts

    def _parse_settings(self, job: WatchedJob) -> table.JobSettings:
        assert job.workload is not None
        template_annotations = self._template_annotations(job)
        merged = {**template_annotations, **(meta_of(job.workload).get("annotations") or {})}
        parsed = table.parse(merged)
        job.problems = tuple(parsed.problems)
        job.settings = parsed.job
        return parsed.job

    def _template_annotations(self, job: WatchedJob) -> dict[str, str]:
        spec = (job.workload or {}).get("spec") or {}
        if job.kind == "JobSet":
            for replicated in spec.get("replicatedJobs") or []:
                template = ((replicated.get("template") or {}).get("spec") or {}).get("template") or {}
                if opted_in(template):
                    return dict(meta_of(template).get("annotations") or {})
            return {}
        return dict(meta_of(spec.get("template") or {}).get("annotations") or {})

    async def _check_settings(self, job: WatchedJob) -> None:
        before = job.problems
        self._parse_settings(job)
        assert job.status is not None
        if job.status.get("restartLimit") != self._restart_limit(job):
            await self._patch_status(job, {"restartLimit": self._restart_limit(job)})
        checked = any(c.get("type") == "SettingsValid" for c in job.status.get("conditions") or [])
        if job.problems == before and checked:
            return
        if job.problems:
            message = "; ".join(job.problems)
            await self._patch_status(
                job, {}, condition=("SettingsValid", "False", "InvalidAnnotations", message)
            )
            await self._event(job, "InvalidAnnotations", message, warning=True, on_workload=True)
        else:
            await self._patch_status(
                job, {}, condition=("SettingsValid", "True", "Valid", "every strata.dev annotation is valid")
            )

    async def _patch_status(
        self,
        job: WatchedJob,
        changes: Mapping[str, Any],
        condition: tuple[str, str, str, str] | None = None,
    ) -> None:
        assert job.status is not None
        patch = dict(changes)
        if condition is not None:
            patch["conditions"] = objects.set_condition(list(job.status.get("conditions") or []), *condition)
        if "lastHeartbeat" not in patch and job.status.get("lastHeartbeat"):
            patch["lastHeartbeat"] = job.status["lastHeartbeat"]
        await self._write(job, self._stratajob_path(job, "status"), {"status": patch})
        job.status.update(patch)

    async def _write(self, job: WatchedJob, url: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A merge patch of the job's StrataJob; a 404 (deleted under the live workload) makes the
        controller forget it and raises :class:`StrataJobGone`: the next reconcile recreates it."""
        try:
            updated: dict[str, Any] = await self.api.merge_patch(url, patch)
        except ApiError as exc:
            if exc.status != 404 or isinstance(exc, StrataJobGone):
                raise
            if job.status is not None:
                job.lost_status = dict(job.status)
            job.status = job.stratajob = None
            raise StrataJobGone(404, exc.reason, exc.message) from exc
        return updated

    async def _event(
        self, job: WatchedJob, reason: str, message: str, *, warning: bool = False, on_workload: bool = False
    ) -> None:
        """An Event on the StrataJob (``kubectl describe stratajob``), and on the Job when asked."""
        log.log(
            logging.WARNING if warning else logging.INFO,
            "%s/%s: %s: %s",
            job.namespace,
            job.name,
            reason,
            message,
        )
        targets = []
        if job.stratajob is not None:
            targets.append((names.API_VERSION, "StrataJob", meta_of(job.stratajob).get("uid", "")))
        if on_workload and job.workload is not None:
            targets.append((str(job.workload.get("apiVersion", "batch/v1")), job.kind, job.uid))
        for api_version, kind, uid in targets:
            involved = {
                "apiVersion": api_version,
                "kind": kind,
                "name": job.name,
                "namespace": job.namespace,
                "uid": uid,
            }
            body = objects.event_body(involved, reason, message, warning=warning)
            try:
                await self.api.create(path("", "v1", "events", job.namespace), body)
            except ApiError as exc:  # an Event is informational: never fail the decision for it
                log.warning("%s/%s: could not post Event %s: %s", job.namespace, job.name, reason, exc)
