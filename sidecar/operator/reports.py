"""The operator's report endpoint: sidecars POST what they committed, deleted and saw; the operator turns
it into Checkpoint objects (and feeds heartbeats to the controller's hang detection).

The operator holds no storage credentials and is never on the commit path: a sidecar has committed to
storage before it reports, and a lost report only delays the Checkpoint object.

Wire (HTTPS)::

    POST /v1/reports
    Authorization: Bearer <projected service-account token, audience names.REPORT_AUDIENCE>
    {"reports": [item, ...]}

    200 {"accepted": n, "rejected": [{"index": i, "error": "..."}]}
    400 malformed body: not JSON, no "reports" list, larger than the cap
    401 missing, invalid, expired or wrong-audience token
    403 the token's pod may not report about a job named in an item (the whole batch is refused)
    503 the Kubernetes API failed; nothing was refused, send the batch again (writes are idempotent)

Items: ``{"kind": "commit", ...}`` (what :func:`objects.checkpoint_body` accepts), ``{"kind":
"delete", "namespace", "job", "step", "attempt"}`` (storage retention deleted that step), and
``{"kind": "heartbeat", "namespace", "job", "rank", "generation", "attempt", "restore_step", "step",
"saves", "time"}``, optionally with ``"restore_source"`` (memory, peer or storage) and ``"restored_step"``
(the rank's last restore, written on that step's Checkpoint as ``status.lastRestore``) and
``"restart_generation"`` (the in-place restart the sidecar adopted: its acknowledgement).

The answer may carry ``"instructions"``: the controller's answers to heartbeats (an in-place restart,
``{"namespace", "job", "restart": {"generation", "reason"}}``). The sidecars' own authenticated
reports are the channel: no listener in the pod, no credential for the operator to hold.

Public surface: :class:`Authenticator` (TokenReview and pod checks, cached), :class:`Identity`,
:class:`CheckpointWriter` (items to Checkpoints), :class:`Rejected`, :func:`make_app`,
:func:`start_server`, :class:`ReportServer`, :func:`server_ssl_context`.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import hashlib
import inspect
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from sidecar.operator import objects
from sidecar.operator.kube import Api, ApiError, path
from sidecar.operator.metrics import OperatorMetrics
from sidecar.operator.names import (
    API_VERSION,
    GROUP,
    JOB_LABEL,
    JOB_NAME_LABEL,
    JOBSET_NAME_LABEL,
    LATEST_LABEL,
    OPT_IN_LABEL,
    OPT_IN_VALUE,
    REPORT_AUDIENCE,
    VERSION,
)

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_ITEMS",
    "AttemptOf",
    "Authenticator",
    "CheckpointWriter",
    "Forbidden",
    "Identity",
    "OnHeartbeat",
    "Rejected",
    "ReportServer",
    "Unauthenticated",
    "make_app",
    "server_ssl_context",
    "start_server",
]

log = logging.getLogger("strata.operator.reports")

#: Cap on a request body: a commit report of a few thousand ranks fits many times over.
#: How long a refused token is answered from memory (no TokenReview for every retry of a bad one).
REFUSED_TTL_S = 10.0
MAX_BODY_BYTES = 4 * 1024 * 1024
#: Cap on the items of one batch.
MAX_ITEMS = 1000

_POD_NAME_KEY = "authentication.kubernetes.io/pod-name"
_POD_UID_KEY = "authentication.kubernetes.io/pod-uid"
_SA_PREFIX = "system:serviceaccount:"
_CHECKPOINT = "Checkpoint"

#: ``attempt_of(namespace, job)``: the newest attempt the controller knows and that attempt's restore
#: step (None: it restored nothing), or None when it knows no attempt of the job.
AttemptOf = Callable[[str, str], "tuple[int, int | None] | None"]
#: ``on_heartbeat(item, pod_name)``: the controller's hang detection and in-place restarts; may be a
#: coroutine function; what it returns (a dict) is an instruction the answer carries to the sidecar.
#: Told (namespace, job, step, Checkpoint name) of a job's newest Checkpoint whenever it changes: a
#: newer one was written, or a sweep removed the newest (then possibly (None, None)).
OnCommit = Callable[[str, str, "int | None", "str | None"], Awaitable[None]]
OnHeartbeat = Callable[[Mapping[str, Any], str], "Awaitable[dict[str, Any] | None] | dict[str, Any] | None"]


# ---- errors ------------------------------------------------------------------------------------------


class Unauthenticated(Exception):
    """401: the bearer token is missing, invalid, expired or for another audience."""


class Forbidden(Exception):
    """403: the token's pod may not report about a job named in the batch."""


class Rejected(Exception):
    """One item refused (the rest of the batch goes on): ``reason`` is "superseded" or "invalid"."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# ---- authentication ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who a token names: a pod, by the service account it runs as."""

    namespace: str
    service_account: str
    pod_name: str
    pod_uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod_name}"


def _token_expiry(token: str) -> float | None:
    """The ``exp`` claim of a JWT, unverified (the TokenReview verified it): a cache never keeps a
    review past it. None when the token is not a JWT or has no expiry."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (ValueError, TypeError):
        return None
    exp = payload.get("exp") if isinstance(payload, dict) else None
    return float(exp) if isinstance(exp, int | float) and not isinstance(exp, bool) else None


class _TtlCache:
    """A bounded map whose entries expire at their own deadline; the least recently used goes first."""

    def __init__(self, max_entries: int) -> None:
        self._entries: collections.OrderedDict[Any, tuple[float, Any]] = collections.OrderedDict()
        self._max = max_entries

    def get(self, key: Any, now: float) -> Any:
        found = self._entries.get(key)
        if found is None:
            return None
        deadline, value = found
        if now >= deadline:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return value

    def put(self, key: Any, value: Any, deadline: float) -> None:
        self._entries[key] = (deadline, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class Authenticator:
    """Tokens to pod identities (TokenReview), and whether a pod may report about a job (its labels).

    Successful reviews are cached by the token's SHA-256 (never the token) for ``ttl`` seconds and
    never past the token's own ``exp``; pod lookups by (namespace, name, uid) for ``ttl``. Failures
    are not cached. ``clock`` is wall time (JWT expiries are unix times).
    """

    def __init__(
        self,
        api: Api,
        *,
        audience: str = REPORT_AUDIENCE,
        ttl: float = 60.0,
        max_entries: int = 4096,
        clock: Callable[[], float] = time.time,
        workload_uid: Callable[[str, str], str | None] | None = None,
    ) -> None:
        self.api = api
        self.audience = audience
        self.ttl = ttl
        self.clock = clock
        self.workload_uid = workload_uid
        self._reviews = _TtlCache(max_entries)
        self._refused = _TtlCache(max_entries)
        self._pods = _TtlCache(max_entries)

    async def authenticate(self, token: str) -> Identity:
        """The pod a token names; Unauthenticated when the apiserver does not vouch for it (ApiError
        when the apiserver cannot answer)."""
        if not token:
            raise Unauthenticated("missing bearer token")
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self.clock()
        cached: Identity | None = self._reviews.get(key, now)
        if cached is not None:
            return cached
        refused: str | None = self._refused.get(key, now)
        if refused is not None:  # a refused token costs one TokenReview per REFUSED_TTL_S, not per request
            raise Unauthenticated(refused)
        try:
            return await self._review(token, key, now)
        except Unauthenticated as exc:
            self._refused.put(key, str(exc), now + REFUSED_TTL_S)
            raise

    async def _review(self, token: str, key: str, now: float) -> Identity:
        expiry = _token_expiry(token)
        if expiry is not None and expiry <= now:
            raise Unauthenticated("token has expired")
        review = await self.api.create(
            path("authentication.k8s.io", "v1", "tokenreviews"),
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": {"token": token, "audiences": [self.audience]},
            },
        )
        status = review.get("status") or {}
        if not status.get("authenticated"):
            # The apiserver's error string names the problem (expired, audience), never the token.
            raise Unauthenticated(f"token not authenticated: {status.get('error') or 'no reason given'}")
        if self.audience not in (status.get("audiences") or []):
            raise Unauthenticated(f"token is not for audience {self.audience!r}")
        user = status.get("user") or {}
        username = str(user.get("username") or "")
        if not username.startswith(_SA_PREFIX) or len(username.split(":")) != 4:
            raise Unauthenticated(f"token is not a service account's: {username!r}")
        _, _, namespace, account = username.split(":")
        extra = user.get("extra") or {}
        pod_names = extra.get(_POD_NAME_KEY) or []
        pod_uids = extra.get(_POD_UID_KEY) or []
        if not pod_names or not pod_uids:
            raise Unauthenticated("token is not bound to a pod (use a projected service-account token)")
        identity = Identity(namespace, account, str(pod_names[0]), str(pod_uids[0]))
        deadline = now + self.ttl if expiry is None else min(now + self.ttl, expiry)
        self._reviews.put(key, identity, deadline)
        return identity

    async def jobs_of(self, identity: Identity) -> frozenset[str]:
        """The jobs (Job or JobSet names) the identity's pod belongs to; Forbidden when the pod is gone
        or is another pod of the same name."""
        key = (identity.namespace, identity.pod_name, identity.pod_uid)
        now = self.clock()
        cached: frozenset[str] | None = self._pods.get(key, now)
        if cached is not None:
            return cached
        pod = await self.api.get(path("", "v1", "pods", identity.namespace, identity.pod_name))
        if pod is None:
            raise Forbidden(f"pod {identity} does not exist")
        meta = pod.get("metadata") or {}
        if meta.get("uid") != identity.pod_uid:
            raise Forbidden(f"pod {identity} is not the pod the token was issued to (uid differs)")
        jobs = self._owning_jobs(identity.namespace, meta)
        self._pods.put(key, jobs, now + self.ttl)
        return jobs

    def _owning_jobs(self, namespace: str, meta: Mapping[str, Any]) -> frozenset[str]:
        """The job a pod belongs to: opted in, and controlled by that Job (the ownerReference the Job
        controller sets, with the uid of the Job the operator watches when it knows it), or by a Job
        of that JobSet. This catches mistakes and other jobs' pods; a pod creator of the same
        namespace can copy all of it (the trust boundary is the namespace, docs/kubernetes/operator.md)."""
        labels = meta.get("labels") or {}
        if labels.get(OPT_IN_LABEL) != OPT_IN_VALUE:
            return frozenset()
        owner = next(
            (r for r in meta.get("ownerReferences") or [] if r.get("controller") and r.get("kind") == "Job"),
            None,
        )
        if owner is None:
            return frozenset()
        jobset = labels.get(JOBSET_NAME_LABEL)
        if jobset:
            return (
                frozenset({str(jobset)})
                if str(owner.get("name", "")).startswith(f"{jobset}-")
                else frozenset()
            )
        job = str(owner.get("name", ""))
        if labels.get(JOB_NAME_LABEL) not in (None, job):
            return frozenset()
        known = self.workload_uid(namespace, job) if self.workload_uid is not None else None
        if known is not None and owner.get("uid") != known:
            return frozenset()
        return frozenset({job})

    async def authorize(self, identity: Identity, items: list[Any]) -> None:
        """Forbidden unless the pod may report about every (namespace, job) the items name. Items that
        name neither as strings are left for validation to reject."""
        named = {
            (item["namespace"], item["job"])
            for item in items
            if isinstance(item, Mapping)
            and isinstance(item.get("namespace"), str)
            and isinstance(item.get("job"), str)
        }
        if not named:
            return
        for namespace, job in sorted(named):
            if namespace != identity.namespace:
                raise Forbidden(f"pod {identity} may not report about job {namespace}/{job}")
        jobs = await self.jobs_of(identity)
        for namespace, job in sorted(named):
            if job not in jobs:
                raise Forbidden(f"pod {identity} may not report about job {namespace}/{job}")


# ---- Checkpoint writing ------------------------------------------------------------------------------


def _checkpoints(namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    return path(GROUP, VERSION, "checkpoints", namespace, name, subresource)


def _field(
    item: Mapping[str, Any], key: str, kind: type | tuple[type, ...], *, nullable: bool = False
) -> Any:
    what = f"{item.get('kind')} report"
    if key not in item:
        raise ValueError(f"{what} lacks {key!r}")
    value = item[key]
    if value is None and nullable:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in kinds) + (" or None" if nullable else "")
        raise ValueError(f"{what} key {key!r} must be {names}, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise ValueError(f"{what} key {key!r} must be >= 0, got {value}")
    return value


def _heartbeat(item: Mapping[str, Any]) -> dict[str, Any]:
    """The heartbeat with its keys checked (ValueError naming the first bad one)."""
    for key, kind, nullable in (
        ("namespace", str, False),
        ("job", str, False),
        ("rank", int, False),
        ("generation", str, False),
        ("attempt", int, True),
        ("restore_step", int, True),
        ("step", int, True),
        ("saves", int, False),
        ("time", (int, float), False),
    ):
        _field(item, key, kind, nullable=nullable)
    for key, kind in (
        ("restore_source", str),
        ("restored_step", int),
        ("restart_generation", str),
        ("restore_class", str),
    ):
        if key in item:
            _field(item, key, kind, nullable=True)
    if item.get("restore_class") not in (None, *RESTORE_CLASSES):
        raise ValueError(
            f"heartbeat key 'restore_class' must be one of {', '.join(RESTORE_CLASSES)}, "
            f"got {item['restore_class']!r}"
        )
    if item.get("restore_source") not in (None, *RESTORE_SOURCES):
        raise ValueError(
            f"heartbeat key 'restore_source' must be one of {', '.join(RESTORE_SOURCES)}, "
            f"got {item['restore_source']!r}"
        )
    return dict(item)


#: Where a rank's restore may come from (the sidecar's RestoreData.source).
RESTORE_SOURCES = ("memory", "peer", "storage")
#: exact: every tensor as saved; stored: lossy tensors as storage holds them
RESTORE_CLASSES = ("exact", "stored")
#: A Checkpoint's lastRestore is written at most this often while ranks keep reporting.
RESTORE_WRITE_S = 5.0


def _delete_target(item: Mapping[str, Any]) -> tuple[str, str, int, int]:
    """(namespace, job, step, attempt) of a delete report, checked (ValueError naming the bad key)."""
    namespace = _field(item, "namespace", str)
    job = _field(item, "job", str)
    step = _field(item, "step", int)
    attempt = _field(item, "attempt", int)
    objects.checkpoint_name(job, step)
    return namespace, job, step, attempt


@dataclasses.dataclass
class _Restores:
    """Where the ranks of ``attempt`` restored one step from, and what was written of it."""

    attempt: int
    sources: dict[int, str] = dataclasses.field(default_factory=dict)
    written: dict[int, str] = dataclasses.field(default_factory=dict)
    classes: dict[int, str] = dataclasses.field(default_factory=dict)
    at: float = 0.0


@dataclasses.dataclass
class _Job:
    """What the writer knows of one job's Checkpoints (loaded by one LIST on first sight)."""

    steps: set[int]
    latest: int | None
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    loaded_at: float = dataclasses.field(default_factory=time.monotonic)


#: How long the writer trusts what it knows of a job's Checkpoints before one LIST reloads (and
#: repairs) it: another writer may have acted meanwhile (an operator upgrade's overlap, a drained
#: pod still finishing a write), which could leave a second Checkpoint labelled latest.
RELOAD_S = 600.0


class CheckpointWriter:
    """Report items to Checkpoint objects (and heartbeats to ``on_heartbeat``).

    Commits upsert ``<job>-<step>`` (create; on conflict update spec and labels if the report's attempt
    is not older than the stored one), then write its status through the status subresource, keep
    ``strata.dev/latest`` on the job's newest step, and post a ``Committed`` Event. Commits of a
    superseded attempt (older than the newest known attempt, for a step past that attempt's restore
    step) are rejected and change nothing. Checkpoints are not owned by the Job (they outlive it) unless
    ``owner_references`` names an owner (``strata.dev/owned-by-workload``).
    """

    def __init__(
        self,
        api: Api,
        *,
        attempt_of: AttemptOf | None = None,
        on_heartbeat: OnHeartbeat | None = None,
        metrics: OperatorMetrics | None = None,
        on_commit: OnCommit | None = None,
        current_generation: Callable[[str, str], str | None] | None = None,
        reload_s: float = RELOAD_S,
        owner_references: Callable[[str, str], list[dict[str, Any]] | None] | None = None,
    ) -> None:
        self.api = api
        self.reload_s = reload_s
        #: (namespace, job) -> the ownerReferences its Checkpoints get (strata.dev/owned-by-workload).
        self.owner_references = owner_references
        self.attempt_of = attempt_of
        self.on_heartbeat = on_heartbeat
        self.on_commit = on_commit
        self.current_generation = current_generation
        self.metrics = metrics if metrics is not None else OperatorMetrics()
        self.metrics.track_api(api)
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._loading: dict[tuple[str, str], asyncio.Lock] = {}
        # Newest attempt (and its restore step) seen in heartbeats, per (namespace, job).
        self._heard: dict[tuple[str, str], tuple[int, int | None]] = {}
        # Restores reported in heartbeats: (namespace, job, step) -> the attempt, rank -> source, what
        # was written, and when.
        self._restores: dict[tuple[str, str, int], _Restores] = {}

    # -- knowledge ----------------------------------------------------------------------------------------

    def attempt(self, namespace: str, job: str) -> tuple[int, int | None] | None:
        """The newest attempt known (from the controller and from heartbeats) and its restore step."""
        told = self.attempt_of(namespace, job) if self.attempt_of is not None else None
        heard = self._heard.get((namespace, job))
        if told is None or (heard is not None and heard[0] > told[0]):
            return heard
        return told

    def latest(self, namespace: str, job: str) -> int | None:
        """The step this writer labelled latest, None when it has not seen the job (or it has none)."""
        state = self._jobs.get((namespace, job))
        return None if state is None else state.latest

    def forget(self, namespace: str, job: str) -> None:
        """Drop what the writer knows of a job (e.g. its workload was deleted): the next report about it
        LISTs its Checkpoints again."""
        self._jobs.pop((namespace, job), None)
        self._loading.pop((namespace, job), None)
        self._heard.pop((namespace, job), None)

    def _hear(self, namespace: str, job: str, attempt: int | None, restore_step: int | None) -> bool:
        """Note the attempt a heartbeat names; True when it is newer than any heard before."""
        if attempt is None:
            return False
        key = (namespace, job)
        heard = self._heard.get(key)
        if (
            heard is None
            or attempt > heard[0]
            or (attempt == heard[0] and heard[1] is None and restore_step is not None)
        ):
            self._heard[key] = (attempt, restore_step)
            return heard is None or attempt > heard[0]
        return False

    async def _sweep(self, namespace: str, job: str, attempt: int, restore_step: int | None) -> None:
        """A new attempt restored ``restore_step`` (None: nothing): older attempts' steps after it are
        fenced off in storage and can never be restored, so their Checkpoints go (one LIST, one
        DELETE each), and ``strata.dev/latest`` moves to the newest step still valid."""
        state = await self._job(namespace, job)
        async with state.lock:
            listing = await self.api.request(
                "GET", _checkpoints(namespace), params={"labelSelector": f"{JOB_LABEL}={job}"}
            )
            fenced = [
                item
                for item in (listing or {}).get("items") or []
                if int((item.get("spec") or {}).get("attempt", attempt)) < attempt
                and (restore_step is None or int(item["spec"]["step"]) > restore_step)
            ]
            for item in fenced:
                meta = item["metadata"]
                preconditions = {"uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")}
                try:
                    await self.api.delete(
                        _checkpoints(namespace, meta["name"]),
                        {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": preconditions},
                    )
                except ApiError as exc:
                    if exc.status != 409:  # changed meanwhile (a newer report): leave it
                        raise
                    continue
                state.steps.discard(int(item["spec"]["step"]))
                log.info(
                    "%s/%s: attempt %d restored %s: Checkpoint %s (attempt %s) is fenced off, removed",
                    namespace,
                    job,
                    attempt,
                    "nothing" if restore_step is None else f"step {restore_step}",
                    meta["name"],
                    item["spec"].get("attempt"),
                )
            if fenced and (state.latest is None or state.latest not in state.steps):
                state.latest = None
                for candidate in sorted(state.steps, reverse=True):
                    if await self._label(namespace, objects.checkpoint_name(job, candidate), "true"):
                        state.latest = candidate
                        break
                    state.steps.discard(candidate)
                if self.on_commit is not None:
                    latest = state.latest
                    await self.on_commit(
                        namespace,
                        job,
                        latest,
                        None if latest is None else objects.checkpoint_name(job, latest),
                    )

    async def _job(self, namespace: str, job: str) -> _Job:
        key = (namespace, job)
        known = self._jobs.get(key)
        if known is not None and time.monotonic() - known.loaded_at < self.reload_s:
            return known
        async with self._loading.setdefault(key, asyncio.Lock()):
            known = self._jobs.get(key)
            if known is not None and time.monotonic() - known.loaded_at < self.reload_s:
                return known
            listing = await self.api.request(
                "GET", _checkpoints(namespace), params={"labelSelector": f"{JOB_LABEL}={job}"}
            )
            found = {
                int(item["spec"]["step"]): item
                for item in (listing or {}).get("items") or []
                if isinstance((item.get("spec") or {}).get("step"), int)
            }
            state = _Job(steps=set(found), latest=max(found) if found else None)
            # Repair what a previous operator may have left half-done: exactly the newest is latest.
            for step, item in found.items():
                labelled = ((item.get("metadata") or {}).get("labels") or {}).get(LATEST_LABEL)
                wanted = "true" if step == state.latest else "false"
                if labelled != wanted:
                    await self._label(namespace, item["metadata"]["name"], wanted)
            self._jobs[key] = state
            return state

    async def _label(self, namespace: str, name: str, latest: str) -> bool:
        try:
            await self.api.merge_patch(
                _checkpoints(namespace, name), {"metadata": {"labels": {LATEST_LABEL: latest}}}
            )
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    # -- items --------------------------------------------------------------------------------------------

    async def write(self, item: Any, pod_name: str, received: float | None = None) -> dict[str, Any] | None:
        """Apply one report item. Rejected for an invalid or superseded item; ApiError when the API
        fails (the item can be sent again). ``received`` is the ``time.monotonic()`` it arrived.
        Returns the instruction for the sidecar that the answer carries, if any."""
        received = time.monotonic() if received is None else received
        if not isinstance(item, Mapping):
            raise Rejected("invalid", f"a report item must be an object, got {type(item).__name__}")
        kind = item.get("kind")
        # Validate first: a ValueError from here on would be ours (or the controller's), not the item's.
        try:
            if kind == "commit":
                body = objects.checkpoint_body(item)
            elif kind == "delete":
                target = _delete_target(item)
            elif kind == "heartbeat":
                beat = _heartbeat(item)
            else:
                raise ValueError(f"report key 'kind' must be commit, delete or heartbeat, got {kind!r}")
        except ValueError as exc:
            raise Rejected("invalid", str(exc)) from exc
        if kind == "commit":
            await self._commit(body, received)
        elif kind == "delete":
            await self._delete(*target)
        else:
            return await self._beat(beat, pod_name)
        return None

    async def _restored(self, beat: Mapping[str, Any]) -> None:
        """Write where the ranks restored a step from on its Checkpoint (``status.lastRestore``):
        per source, the ranks that reported it for the newest attempt that restored the step."""
        source, step, attempt = beat.get("restore_source"), beat.get("restored_step"), beat.get("attempt")
        if source is None or not isinstance(step, int) or not isinstance(attempt, int):
            return
        key = (beat["namespace"], beat["job"], step)
        state = self._restores.get(key)
        if state is None or attempt > state.attempt:
            state = self._restores[key] = _Restores(attempt)
            while len(self._restores) > 10_000:  # bounded: the oldest entries go
                self._restores.pop(next(iter(self._restores)))
        elif attempt < state.attempt:
            return
        state.sources[int(beat["rank"])] = str(source)
        if beat.get("restore_class") in RESTORE_CLASSES:
            state.classes[int(beat["rank"])] = str(beat["restore_class"])
        if state.sources == state.written:
            return
        now = time.monotonic()
        if state.written and now - state.at < RESTORE_WRITE_S:
            return  # the next heartbeat writes the rest
        counts = collections.Counter(state.sources.values())
        body = {
            "attempt": attempt,
            "source": next(iter(counts)) if len(counts) == 1 else "mixed",
            "ranks": len(state.sources),
            **{s: counts.get(s, 0) for s in RESTORE_SOURCES},
        }
        classes = set(state.classes.values())
        if classes:  # one class for the gang by design; "mixed" would be a fault to see
            body["restoreClass"] = classes.pop() if len(classes) == 1 else "mixed"
        body |= {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        name = objects.checkpoint_name(beat["job"], step)
        try:
            await self.api.merge_patch(
                _checkpoints(beat["namespace"], name, "status"), {"status": {"lastRestore": body}}
            )
        except ApiError as exc:
            if exc.status != 404:
                raise
            log.debug("Checkpoint %s/%s not found: its restore is not recorded", beat["namespace"], name)
        state.written = dict(state.sources)
        state.at = now

    async def _beat(self, beat: dict[str, Any], pod_name: str) -> dict[str, Any] | None:
        known = (
            self.current_generation(beat["namespace"], beat["job"])
            if self.current_generation is not None
            else None
        )
        # Only the current generation's sidecars say which attempt runs now (a stopping sidecar of an
        # earlier one must not move it, nor sweep Checkpoints).
        current = known is None or beat["generation"] == known
        key = (beat["namespace"], beat["job"])
        before = self._heard.get(key)
        if current and self._hear(beat["namespace"], beat["job"], beat["attempt"], beat["restore_step"]):
            try:
                await self._sweep(beat["namespace"], beat["job"], beat["attempt"], beat["restore_step"])
            except BaseException:
                # Not swept: the resent heartbeat must find this attempt new again.
                if before is None:
                    self._heard.pop(key, None)
                else:
                    self._heard[key] = before
                raise
        if current:
            await self._restored(beat)
        if self.on_heartbeat is None:
            return None
        try:
            done = self.on_heartbeat(beat, pod_name)
            if inspect.isawaitable(done):
                done = await done
        except Exception:
            # The controller's trouble, not the sidecar's: the heartbeat is taken, the error counted.
            self.metrics.reconcile_errors.inc()
            log.exception("hang detection failed on a heartbeat from pod %s", pod_name)
            return None
        return done if isinstance(done, dict) else None

    def _superseded(self, namespace: str, job: str, step: int, attempt: int) -> str | None:
        known = self.attempt(namespace, job)
        if known is None:
            return None
        newest, restore = known
        if attempt < newest and (restore is None or step > restore):
            since = "restored nothing" if restore is None else f"restored step {restore}"
            return (
                f"attempt {attempt} of job {namespace}/{job} is superseded by attempt {newest} "
                f"({since}): step {step} is not recorded"
            )
        return None

    async def _commit(self, body: dict[str, Any], received: float) -> None:
        meta, spec = body["metadata"], body["spec"]
        namespace, name = meta["namespace"], meta["name"]
        job, step, attempt = spec["job"], spec["step"], spec["attempt"]
        if (why := self._superseded(namespace, job, step, attempt)) is not None:
            raise Rejected("superseded", why)
        state = await self._job(namespace, job)
        async with state.lock:
            if (why := self._superseded(namespace, job, step, attempt)) is not None:
                raise Rejected("superseded", why)
            newest = state.latest is None or step >= state.latest
            labels = {**meta["labels"], LATEST_LABEL: "true" if newest else "false"}
            meta["labels"] = labels
            owners = self.owner_references(namespace, job) if self.owner_references is not None else None
            if owners:
                meta["ownerReferences"] = owners
            # A real apiserver drops status on create (the status subresource is on): it is written
            # below; generation 1 is what a fresh object gets.
            body["status"] = objects.checkpoint_status(spec, observed_generation=1)
            stored = await self._upsert(body)
            wanted = objects.checkpoint_status(
                spec, (stored.get("status") or {}).get("conditions"), stored["metadata"].get("generation")
            )
            if (stored.get("status") or {}).get("lastRestore"):
                wanted["lastRestore"] = stored["status"]["lastRestore"]
            if _status_differs(stored.get("status"), wanted):
                stored = await self.api.merge_patch(
                    _checkpoints(namespace, name, "status"), {"status": wanted}
                )
            if newest and state.latest is not None and state.latest != step:
                await self._label(namespace, objects.checkpoint_name(job, state.latest), "false")
            state.steps.add(step)
            if newest:
                state.latest = step
            self.metrics.report_to_cr.observe(max(0.0, time.monotonic() - received))
        ranks = f"{len(spec['ranks'])}/{spec['worldSize']}"
        await self._event(
            stored,
            "Committed",
            f"step {step} attempt {attempt} committed by {ranks} ranks, {spec['bytes']} bytes"
            + (f" ({spec['type']} on {spec['baseStep']})" if spec["type"] == "diff" else " (full)"),
        )
        if newest and self.on_commit is not None:
            await self.on_commit(namespace, job, step, name)

    async def _upsert(self, body: dict[str, Any]) -> dict[str, Any]:
        meta, spec = body["metadata"], body["spec"]
        namespace, name = meta["namespace"], meta["name"]
        for _ in range(5):
            try:
                return await self.api.create(_checkpoints(namespace), body)
            except ApiError as exc:
                if exc.status != 409:
                    raise
            stored = await self.api.get(_checkpoints(namespace, name))
            if stored is None:
                continue  # deleted in between: create it again
            held = int((stored.get("spec") or {}).get("attempt", -1))
            if spec["attempt"] < held:
                raise Rejected(
                    "superseded",
                    f"Checkpoint {namespace}/{name} holds attempt {held}; "
                    f"the report of attempt {spec['attempt']} does not change it",
                )
            stored_meta = stored.get("metadata") or {}
            patch = {
                "metadata": {
                    "labels": meta["labels"],
                    "resourceVersion": stored_meta.get("resourceVersion"),
                    **({"ownerReferences": meta["ownerReferences"]} if meta.get("ownerReferences") else {}),
                },
                "spec": spec,
            }
            try:
                return await self.api.merge_patch(_checkpoints(namespace, name), patch)
            except ApiError as exc:
                if exc.status not in (404, 409):
                    raise
        raise ApiError(409, "Conflict", f"Checkpoint {namespace}/{name} kept changing; not written")

    async def _delete(self, namespace: str, job: str, step: int, attempt: int) -> None:
        name = objects.checkpoint_name(job, step)
        state = await self._job(namespace, job)
        async with state.lock:
            for _ in range(5):
                stored = await self.api.get(_checkpoints(namespace, name))
                if stored is None:
                    break
                held = (stored.get("spec") or {}).get("attempt")
                if held != attempt:
                    log.info(
                        "retention of attempt %s deleted step %s of %s/%s; "
                        "Checkpoint %s holds attempt %s: kept",
                        attempt,
                        step,
                        namespace,
                        job,
                        name,
                        held,
                    )
                    return
                stored_meta = stored.get("metadata") or {}
                preconditions = {
                    "uid": stored_meta.get("uid"),
                    "resourceVersion": stored_meta.get("resourceVersion"),
                }
                try:
                    await self.api.delete(
                        _checkpoints(namespace, name),
                        {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": preconditions},
                    )
                    break
                except ApiError as exc:
                    if exc.status != 409:
                        raise
            else:
                raise ApiError(409, "Conflict", f"Checkpoint {namespace}/{name} kept changing; not deleted")
            state.steps.discard(step)
            if state.latest == step:
                state.latest = None
                for candidate in sorted(state.steps, reverse=True):
                    if await self._label(namespace, objects.checkpoint_name(job, candidate), "true"):
                        state.latest = candidate
                        break
                    state.steps.discard(candidate)

    async def _event(self, involved: Mapping[str, Any], reason: str, message: str) -> None:
        """A Normal Event on a Checkpoint; a failure is logged, never fails the report."""
        meta = involved.get("metadata") or {}
        namespace = meta.get("namespace", "default")
        event = objects.event_body(
            {
                "apiVersion": API_VERSION,
                "kind": _CHECKPOINT,
                "name": meta.get("name"),
                "namespace": namespace,
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            reason,
            message,
        )
        try:
            await self.api.create(path("", "v1", "events", namespace), event)
        except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
            log.warning(
                "could not post Event %s on Checkpoint %s/%s: %s", reason, namespace, meta.get("name"), exc
            )


def _status_differs(current: Any, wanted: Mapping[str, Any]) -> bool:
    """Whether the stored status needs writing (a real apiserver drops status on create)."""
    if not isinstance(current, Mapping):
        return True

    def strip(status: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in status.items() if v is not None}

    return strip(current) != strip(wanted)


# ---- the HTTP server ---------------------------------------------------------------------------------


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _read_bounded(request: web.Request, limit: int) -> bytes | None:
    """The body, or None when it is larger than ``limit`` (reading stops there)."""
    if request.content_length is not None and request.content_length > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.read(64 * 1024)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)


def make_app(
    authenticator: Authenticator,
    writer: CheckpointWriter,
    metrics: OperatorMetrics | None = None,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_items: int = MAX_ITEMS,
) -> web.Application:
    """The report endpoint (``POST /v1/reports``) and ``GET /healthz``, as an aiohttp application."""
    counted = metrics if metrics is not None else writer.metrics
    counted.track_api(authenticator.api)

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def reports(request: web.Request) -> web.Response:
        received = time.monotonic()
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            counted.reject("token")
            return _error(401, "missing bearer token (Authorization: Bearer <service-account token>)")
        if request.content_length is not None and request.content_length > max_body_bytes:
            return _error(400, f"body larger than {max_body_bytes} bytes")
        try:
            identity = await authenticator.authenticate(token)
        except Unauthenticated as exc:
            counted.reject("token")
            log.info("report refused (401) from %s: %s", request.remote, exc)
            return _error(401, str(exc))
        except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
            counted.reconcile_errors.inc()
            log.warning("TokenReview failed: %s", exc)
            return _error(503, f"could not review the token: {exc}")
        raw = await _read_bounded(request, max_body_bytes)
        if raw is None:
            return _error(400, f"body larger than {max_body_bytes} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            return _error(400, f"body is not JSON: {exc}")
        items = body.get("reports") if isinstance(body, dict) else None
        if not isinstance(items, list):
            return _error(400, 'body must be an object with a "reports" list')
        if len(items) > max_items:
            return _error(400, f"a batch holds at most {max_items} reports, got {len(items)}")
        try:
            await authenticator.authorize(identity, items)
        except Forbidden as exc:
            counted.reject("forbidden")
            for item in items:
                counted.report(item.get("kind") if isinstance(item, Mapping) else None, "rejected")
            log.warning("report refused (403): %s", exc)
            return _error(403, str(exc))
        except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
            counted.reconcile_errors.inc()
            log.warning("pod lookup for %s failed: %s", identity, exc)
            return _error(503, f"could not look up pod {identity}: {exc}")
        accepted = 0
        rejected: list[dict[str, Any]] = []
        instructions: list[dict[str, Any]] = []
        for index, item in enumerate(items):
            kind = item.get("kind") if isinstance(item, Mapping) else None
            try:
                instruction = await writer.write(item, identity.pod_name, received)
            except Rejected as exc:
                counted.reject(exc.reason)
                counted.report(kind, "rejected")
                rejected.append({"index": index, "error": exc.message})
                log.info("report %d from pod %s rejected (%s): %s", index, identity, exc.reason, exc.message)
            except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
                counted.reconcile_errors.inc()
                log.warning("writing report %d from pod %s failed: %s", index, identity, exc)
                return _error(
                    503, f"the Kubernetes API failed on report {index}: {exc}; send the batch again"
                )
            else:
                counted.report(kind, "accepted")
                accepted += 1
                if instruction is not None and instruction not in instructions:
                    instructions.append(instruction)
        answer: dict[str, Any] = {"accepted": accepted, "rejected": rejected}
        if instructions:
            answer["instructions"] = instructions
        return web.json_response(answer)

    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_post("/v1/reports", reports)
    app.router.add_get("/healthz", healthz)
    return app


@dataclasses.dataclass
class ReportServer:
    """A started report endpoint: its runner and the port it bound (useful with port 0)."""

    runner: web.AppRunner
    port: int

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_server(
    app: web.Application,
    host: str = "0.0.0.0",
    port: int = 8443,
    ssl_context: ssl.SSLContext | None = None,
) -> ReportServer:
    """Serve ``app`` on host:port (HTTPS with ``ssl_context``) on the running loop."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    addresses = runner.addresses
    bound = int(addresses[0][1]) if addresses else port
    return ReportServer(runner, bound)


def server_ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A TLS server context from a certificate chain and its key (PEM files, e.g. a cert-manager Secret)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context
