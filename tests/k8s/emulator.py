"""An emulated Kubernetes API for operator tests: kmock's emulator with the gaps a real operator and
the real `kubectl` run into filled in.

kmock's `KubernetesEmulator` keeps objects in memory and serves list/watch/get/create/patch/delete.
On top of it, this class: sets and bumps `metadata.resourceVersion` (plus `uid`,
`creationTimestamp`, `generation`) on every write and replays missed events to a watch that names a
`resourceVersion`; expands `generateName`; answers a failed JSON-patch (e.g. a `test` op) and a
stale `resourceVersion` with 422 / 409 and a Status body; filters list/watch/collection-delete by
`labelSelector` and `fieldSelector`; serves PUT (replace) and collection DELETE; answers
`Accept: ...;as=Table` with a meta.k8s.io/v1 Table (a CRD's additionalPrinterColumns when the CRD
was created through the API, else Name + Age); and registers CRDs created through the API for
discovery, so `kubectl get <plural>` finds them.

Faults a real apiserver shows, as small knobs (see "faults" below): watches that expire (an ERROR
event with a 410 Expired Status, the event log compacted so that a re-watch from an older
resourceVersion gets 410 too) and an outage of a resource's lists and watches meanwhile
(``watch_outage``: what happens then reaches no client as an event); connections reset (open
watch streams, and the next requests that match); and the next requests that match answered with a
status such as 429 with Retry-After or a 5xx. Every injected fault is recorded in ``faults``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import datetime
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import kubernetes_validate
from kmock._internal import apps, dicts, enums, rendering
from typing_extensions import override

CRD = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
PODS = kmock.resource("", "v1", "pods")
TOKENREVIEWS = kmock.resource("authentication.k8s.io", "v1", "tokenreviews")

# Built-in resources the tests (and kopf/kubectl) touch: (group, version, plural, kind, namespaced).
BUILTINS: list[tuple[str, str, str, str, bool]] = [
    ("", "v1", "pods", "Pod", True),
    ("", "v1", "events", "Event", True),
    ("", "v1", "namespaces", "Namespace", False),
    ("", "v1", "configmaps", "ConfigMap", True),
    ("", "v1", "secrets", "Secret", True),
    ("", "v1", "services", "Service", True),
    ("", "v1", "serviceaccounts", "ServiceAccount", True),
    ("batch", "v1", "jobs", "Job", True),
    ("authentication.k8s.io", "v1", "tokenreviews", "TokenReview", False),
    # JobSet is a CRD in a real cluster; served here as if it were installed.
    ("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet", True),
    ("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False),
]
VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]

_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the apiserver's generateName alphabet


def _now(later_s: float = 0) -> str:
    moment = datetime.datetime.now(tz=datetime.UTC) + datetime.timedelta(seconds=later_s)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _age(timestamp: str | None) -> str:
    """A timestamp as kubectl shows it: 5s, 3m, 2h, 4d."""
    if not timestamp:
        return "<unknown>"
    try:
        then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return "<invalid>"
    seconds = max(0, int((datetime.datetime.now(tz=datetime.UTC) - then).total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 2 * 3600:
        return f"{seconds // 60}m"
    if seconds < 2 * 86400:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def _compile(pattern: str | None) -> re.Pattern[str] | None:
    return None if pattern is None else re.compile(pattern)


def _status(code: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=code, reason=reason, message=message, details={})


# ---- selectors ---------------------------------------------------------------------------------------


def _split_terms(selector: str) -> list[str]:
    """Split on commas outside parentheses: `a in (x,y),b!=z` -> ['a in (x,y)', 'b!=z']."""
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current.strip())
            current = ""
        else:
            current += char
    terms.append(current.strip())
    return [term for term in terms if term]


_SET_TERM = re.compile(r"^(?P<key>[^\s!=]+)\s+(?P<op>in|notin)\s+\((?P<values>[^)]*)\)$")
_EQ_TERM = re.compile(r"^(?P<key>[^\s!=]+)\s*(?P<op>==|=|!=)\s*(?P<value>.*)$")


def label_matcher(selector: str | None) -> Callable[[Mapping[str, str]], bool]:
    """Equality- and set-based label selectors: `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a)`,
    `k`, `!k`."""
    terms: list[tuple[str, str, set[str]]] = []  # (key, operator, values)
    for term in _split_terms(selector or ""):
        if m := _SET_TERM.match(term):
            terms.append((m["key"], m["op"], {v.strip() for v in m["values"].split(",") if v.strip()}))
        elif m := _EQ_TERM.match(term):
            terms.append((m["key"], "notin" if m["op"] == "!=" else "in", {m["value"].strip()}))
        elif term.startswith("!"):
            terms.append((term[1:].strip(), "absent", set()))
        else:
            terms.append((term, "exists", set()))

    def matches(labels: Mapping[str, str]) -> bool:
        for key, op, values in terms:
            if op == "in" and labels.get(key) not in values:
                return False
            if op == "notin" and labels.get(key) in values:
                return False
            if (op == "absent") == (key in labels) and op in ("absent", "exists"):
                return False
        return True

    return matches


def field_matcher(selector: str | None) -> Callable[[Mapping[str, Any]], bool]:
    """Field selectors `path=v`, `path==v`, `path!=v` on any dotted path of the object (the apiserver
    allows a few per kind: metadata.name, metadata.namespace, status.phase, involvedObject.*)."""
    checks: list[Callable[[Mapping[str, Any]], bool]] = []
    for term in _split_terms(selector or ""):
        m = _EQ_TERM.match(term)
        if m is None:
            raise _status(400, "BadRequest", f"invalid field selector term {term!r}")
        path, value, negate = m["key"].split("."), m["value"].strip(), m["op"] == "!="

        def check(
            obj: Mapping[str, Any], path: list[str] = path, value: str = value, neg: bool = negate
        ) -> bool:
            found: Any = obj
            for part in path:
                found = found.get(part) if isinstance(found, Mapping) else None
            actual = "" if found is None else str(found)
            return (actual != value) if neg else (actual == value)

        checks.append(check)
    return lambda obj: all(check(obj) for check in checks)


# ---- JSONPath for printer columns ------------------------------------------------------------------------

_JSONPATH_TOKEN = re.compile(
    r"\.([A-Za-z0-9_-]+)|\[(\d+)\]|\[\?\(@\.([A-Za-z0-9_.-]+)\s*==\s*[\"']([^\"']*)[\"']\)\]"
)


def jsonpath(obj: Any, path: str) -> list[Any]:
    """The subset of JSONPath that printer columns use: `.a.b`, `[0]`, `[?(@.type=="Ready")]`."""
    path = path.strip().removeprefix("{").removesuffix("}").removeprefix("$")
    current: list[Any] = [obj]
    for m in _JSONPATH_TOKEN.finditer(path):
        field, index, filter_key, filter_value = m.groups()
        nxt: list[Any] = []
        for item in current:
            if field is not None and isinstance(item, Mapping) and field in item:
                nxt.append(item[field])
            elif index is not None and isinstance(item, list) and int(index) < len(item):
                nxt.append(item[int(index)])
            elif filter_key is not None and isinstance(item, list):
                for element in item:
                    value: Any = element
                    for part in filter_key.split("."):
                        value = value.get(part) if isinstance(value, Mapping) else None
                    if value is not None and str(value) == filter_value:
                        nxt.append(element)
        current = nxt
    return current


# ---- the emulator ---------------------------------------------------------------------------------------


@attrs.define
class Token:
    """A projected service-account token as the emulated TokenReview knows it."""

    namespace: str
    service_account: str
    pod_name: str
    pod_uid: str
    audiences: list[str]
    expires: float | None = None  # unix time
    uid: str = attrs.field(factory=lambda: str(uuid.uuid4()))

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"

    def extra(self) -> dict[str, list[str]]:
        return {
            "authentication.kubernetes.io/pod-name": [self.pod_name],
            "authentication.kubernetes.io/pod-uid": [self.pod_uid],
        }


#: What ends a watch stream (an item on the resource's event bus that is no watch event).
_EXPIRE, _RESET = "strata-emulator:expire", "strata-emulator:reset"


@dataclasses.dataclass
class _Rule:
    """The next ``left`` requests that match get ``status`` (a number) or a reset (None)."""

    left: int
    status: int | None
    method: str | None
    path: re.Pattern[str] | None
    agent: str | None
    retry_after: float | None = None
    applied: bool = False  # a reset after the request took effect (only its answer is lost)

    def matches(self, request: rendering.Request) -> bool:
        return (
            (self.method is None or str(request.method.value).upper() == self.method.upper())
            and (self.path is None or self.path.search(request.url.path) is not None)
            and (self.agent is None or self.agent in request.headers.get("User-Agent", ""))
        )


def _expired(since: int, compacted: int) -> dict[str, Any]:
    """The watch event a real apiserver sends when the resourceVersion asked for is compacted."""
    return {
        "type": "ERROR",
        "object": {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "message": f"too old resource version: {since} ({compacted})",
            "reason": "Expired",
            "code": 410,
        },
    }


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with resourceVersions, generateName, selectors, PUT, collection
    DELETE, 422 on failed patches, Tables for kubectl, and CRD discovery."""

    _rv: int = attrs.field(default=0, init=False)
    # Every watch event ever published, with its resourceVersion: a watch from a resourceVersion
    # replays what it missed.
    _log: list[tuple[int, kmock.resource, dict[str, Any]]] = attrs.field(factory=list, init=False)
    #: Tokens a TokenReview accepts: token -> Token (who it names, its audiences, when it expires).
    tokens: dict[str, Token] = attrs.field(factory=dict, init=False)
    #: Pods (namespace, name) whose PodDisruptionBudget refuses an eviction (429), as a PDB would.
    pdb_blocked: set[tuple[str, str]] = attrs.field(factory=set, init=False)
    #: Pods (namespace, name) -> how many more evictions API Priority and Fairness throttles: a 429
    #: with Retry-After and a plain-text body, as the apiserver's APF filter writes it (no Status).
    apf_throttled: dict[tuple[str, str], int] = attrs.field(factory=dict, init=False)
    #: Pods evicted through the Eviction API, in order.
    evictions: list[str] = attrs.field(factory=list, init=False)
    #: Keep every request for assertions (kmock's history). Off for benchmarks: kmock matches each
    #: new request against the whole history, which grows slower with every request.
    keep_requests: bool = True
    #: The Kubernetes version /version reports ("major.minor").
    server_version: str = "1.35"
    #: Validate created pods strictly against ``server_version``'s schema (422 as the apiserver
    #: refuses a field it does not know, e.g. a regular container's restartPolicy before 1.34).
    validate_pods: bool = False
    _inflight: set[int] = attrs.field(factory=set, init=False)
    #: Watches from a resourceVersion below this get 410 Expired (the log up to it is compacted).
    _compacted: int = attrs.field(default=0, init=False)
    #: Resources whose lists and watches wait (an outage, see ``watch_outage``): resource -> its end.
    _outages: dict[kmock.resource, asyncio.Event] = attrs.field(factory=dict, init=False)
    _rules: list[_Rule] = attrs.field(factory=list, init=False)
    #: Every fault injected: (time.monotonic(), what, method, path), what being "expired", "reset"
    #: or the status answered (e.g. "429").
    faults: list[tuple[float, str, str, str]] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for group, version, plural, kind, namespaced in BUILTINS:
            self.resources[kmock.resource(group, version, plural)] = kmock.ResourceInfo(
                kind=kind, namespaced=namespaced, singular=kind.lower(), verbs=VERBS
            )

    # -- state ------------------------------------------------------------------------------------------

    @property
    def resource_version(self) -> int:
        """The latest resourceVersion handed out (a cluster-wide counter, as in etcd)."""
        return self._rv

    def _key(self, request: rendering.Request, name: str | None) -> tuple[kmock.resource, str | None, str]:
        assert request.resource is not None and name is not None
        return (request.resource, request.namespace, name)

    def _live(self, key: tuple[kmock.resource, str | None, str]) -> kmock.Object | None:
        if key in self._objects and not self._objects[key].deleted:
            obj: kmock.Object = self._objects[key]
            return obj
        return None

    async def _publish(self, resource: kmock.resource, kind: str, raw: Mapping[str, Any]) -> None:
        event = {"type": kind, "object": copy.deepcopy(dict(raw))}
        self._log.append((self._rv, resource, event))
        await self._buses[resource].put(event)

    def _bump(self, body: dict[str, Any]) -> dict[str, Any]:
        self._rv += 1
        body.setdefault("metadata", {})["resourceVersion"] = str(self._rv)
        return body

    def _selected(self, request: rendering.Request) -> list[kmock.Object]:
        labels = label_matcher(request.params.get("labelSelector"))
        fields = field_matcher(request.params.get("fieldSelector"))
        found: list[kmock.Object] = []
        for (resource, namespace, name), obj in self._objects.items():
            if resource != request.resource or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            if request.name is not None and name != request.name:
                continue
            raw = obj.raw
            if labels(raw.get("metadata", {}).get("labels") or {}) and fields(raw):
                found.append(obj)
        return found

    def _matches(self, request: rendering.Request, raw: Mapping[str, Any]) -> bool:
        meta = raw.get("metadata", {})
        return (
            (request.namespace is None or meta.get("namespace") == request.namespace)
            and (request.name is None or meta.get("name") == request.name)
            and label_matcher(request.params.get("labelSelector"))(meta.get("labels") or {})
            and field_matcher(request.params.get("fieldSelector"))(raw)
        )

    def _check_rv(self, stored: Mapping[str, Any], wanted: Any) -> None:
        current = stored.get("metadata", {}).get("resourceVersion")
        if wanted and str(wanted) != current:
            raise _status(
                409,
                "Conflict",
                "Operation cannot be fulfilled: the object has been modified; "
                "please apply your changes to the latest version and try again",
            )

    async def _write(self, request: rendering.Request, key: Any, new: dict[str, Any]) -> dict[str, Any]:
        """Store a new version of an existing object; deleting it if it is released from deletion."""
        obj = self._objects[key]
        old_meta = obj.raw.get("metadata", {})
        meta = new.setdefault("metadata", {})
        for field in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp"):
            if field in old_meta:
                meta[field] = old_meta[field]
        if new.get("spec") != obj.raw.get("spec"):
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        self._bump(new)
        obj.create(new)
        assert request.resource is not None
        await self._publish(request.resource, "MODIFIED", new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            obj.delete()
            await self._publish(request.resource, "DELETED", new)
        return new

    async def _delete_one(self, request: rendering.Request, key: Any) -> dict[str, Any]:
        obj = self._objects[key]
        raw: dict[str, Any] = copy.deepcopy(obj.raw)
        meta = raw.setdefault("metadata", {})
        assert request.resource is not None
        grace = self._grace(request, raw) if request.resource == PODS else 0
        if meta.get("deletionTimestamp") and grace > 0:
            return raw  # already being deleted: nothing to do
        if meta.get("finalizers") or grace > 0:
            # A pod on a node is deleted gracefully: it stays, Terminating, until its kubelet (or a
            # force delete, gracePeriodSeconds=0) removes it.
            # As the apiserver does: a pod's deletionTimestamp is when its grace period ends.
            meta.setdefault("deletionTimestamp", _now(grace if request.resource == PODS else 0))
            if request.resource == PODS:
                meta["deletionGracePeriodSeconds"] = grace
            self._bump(raw)
            obj.create(raw)
            await self._publish(request.resource, "MODIFIED", raw)
        else:
            self._bump(raw)
            obj.create(raw)
            obj.delete()
            await self._publish(request.resource, "DELETED", raw)
        return raw

    @staticmethod
    def _grace(request: rendering.Request, raw: Mapping[str, Any]) -> int:
        """A pod deletion's grace period: the request's (query or DeleteOptions), else the pod's."""
        if not raw.get("spec", {}).get("nodeName") or raw.get("status", {}).get("phase") in (
            "Succeeded",
            "Failed",
        ):
            return 0  # the apiserver removes unscheduled and terminal pods at once
        options = request.data if isinstance(request.data, Mapping) else {}
        given = request.params.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
        if given is not None:
            return int(given)
        return int(raw.get("spec", {}).get("terminationGracePeriodSeconds", 30))

    async def _evict(self, request: rendering.Request) -> dict[str, Any]:
        """The Eviction API: 429 when a PodDisruptionBudget forbids it, else the pod gets the
        DisruptionTarget condition and is deleted gracefully."""
        key = self._key(request, request.name)
        obj = self._live(key)
        if obj is None:
            raise kmock.KubernetesObjectNotFoundError()
        if (request.namespace or "", request.name or "") in self.pdb_blocked:
            # The eviction registry's refusal: a Status whose cause says DisruptionBudget.
            raise kmock.KubernetesError(
                status=429,
                reason="TooManyRequests",
                message="Cannot evict pod as it would violate the pod's disruption budget.",
                details={
                    "causes": [
                        {
                            "reason": "DisruptionBudget",
                            "message": "The disruption budget pdb needs 2 healthy pods and has 2 currently",
                        }
                    ]
                },
            )
        raw: dict[str, Any] = copy.deepcopy(obj.raw)
        if not raw.get("metadata", {}).get("deletionTimestamp"):
            conditions = [
                c
                for c in raw.setdefault("status", {}).get("conditions") or []
                if c.get("type") != "DisruptionTarget"
            ]
            conditions.append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "EvictionByEvictionAPI",
                    "message": "Eviction API: evicting",
                    "lastTransitionTime": _now(),
                }
            )
            raw["status"]["conditions"] = conditions
            self._bump(raw)
            obj.create(raw)
            assert request.resource is not None
            await self._publish(request.resource, "MODIFIED", raw)
            self.evictions.append(str(request.name))
            await self._delete_one(request, key)
        return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success"}

    def _review(self, body: Any) -> dict[str, Any]:
        """A TokenReview answered from ``tokens``: unknown, expired or wrong-audience tokens are not
        authenticated (the apiserver's answer, with an error string)."""
        spec = body.get("spec", {}) if isinstance(body, Mapping) else {}
        token = self.tokens.get(spec.get("token", ""))
        wanted = list(spec.get("audiences") or [])
        status: dict[str, Any] = {"authenticated": False}
        if token is None:
            status["error"] = "invalid bearer token"
        elif token.expires is not None and token.expires < time.time():
            status["error"] = "invalid bearer token, token has expired"
        elif wanted and not set(wanted) & set(token.audiences):
            status["error"] = "invalid bearer token, token audiences is invalid for the current server"
        else:
            status = {
                "authenticated": True,
                "user": {"username": token.username, "uid": token.uid, "extra": token.extra()},
                "audiences": [a for a in token.audiences if not wanted or a in wanted],
            }
        return {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "metadata": {"creationTimestamp": None},
            "spec": dict(spec),
            "status": status,
        }

    # -- faults -----------------------------------------------------------------------------------------

    def _compact(self) -> None:
        """Compact the event log: a watch from any resourceVersion handed out so far gets 410 (a
        new one, with nothing after it, lets a list's resourceVersion be watched from)."""
        self._rv += 1
        self._compacted = self._rv
        self._log.clear()

    def _fault(self, what: str, method: str = "", path: str = "") -> None:
        self.faults.append((time.monotonic(), what, method, path))

    async def expire_watches(self, resource: kmock.resource = PODS) -> None:
        """End every open watch of ``resource`` with an ERROR event carrying a 410 Expired Status (as
        the apiserver does once a watch's resourceVersion is compacted away) and compact the event
        log: a re-watch from an older resourceVersion gets 410 too, so clients list again."""
        self._compact()
        self._fault("expired", "WATCH", resource.plural or "")
        await self._buses[resource].put(_EXPIRE)

    @contextlib.asynccontextmanager
    async def watch_outage(self, resource: kmock.resource = PODS) -> AsyncIterator[None]:
        """Open watches of ``resource`` expire (``expire_watches``), and its lists and watches wait
        until the block ends: what happens to such objects meanwhile (a pod deleted) reaches no
        client as an event; a client sees it only in the state a later list shows."""
        ended = self._outages.setdefault(resource, asyncio.Event())
        ended.clear()
        await self.expire_watches(resource)
        try:
            yield
        finally:
            self._compact()  # nothing of the outage is replayed to a re-watch
            del self._outages[resource]
            ended.set()

    async def reset_watches(self, resource: kmock.resource | None = None) -> None:
        """Reset the connections of open watch streams (of ``resource``, else of all): clients see
        the stream break and watch again from the last resourceVersion they saw."""
        self._fault("reset", "WATCH", "" if resource is None else resource.plural or "")
        for bus in [self._buses[resource]] if resource is not None else list(self._buses.values()):
            await bus.put(_RESET)

    def reset_next(
        self,
        n: int = 1,
        *,
        method: str | None = None,
        path: str | None = None,
        agent: str | None = None,
        applied: bool = False,
    ) -> None:
        """Reset the connection of each of the next ``n`` requests that match: ``method`` (e.g.
        "PATCH"), ``path`` (a regular expression searched in the URL path), ``agent`` (a part of the
        User-Agent). ``applied``: the request takes effect first and only its answer is lost (the
        client cannot tell which happened)."""
        self._rules.append(_Rule(n, None, method, _compile(path), agent, applied=applied))

    def fail_next(
        self,
        n: int,
        status: int,
        *,
        method: str | None = None,
        path: str | None = None,
        agent: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        """Answer each of the next ``n`` requests that match (as in ``reset_next``) with ``status``
        (429 TooManyRequests, a 5xx) and a Status body, with a Retry-After header when given (the
        apiserver's APF and its 503s send one); the request takes no effect."""
        self._rules.append(_Rule(n, status, method, _compile(path), agent, retry_after=retry_after))

    def _rule_for(self, request: rendering.Request) -> _Rule | None:
        for rule in self._rules:
            if rule.left > 0 and rule.matches(request):
                rule.left -= 1
                return rule
        self._rules[:] = [r for r in self._rules if r.left > 0]
        return None

    def _refused(self, rule: _Rule, request: rendering.Request) -> aiohttp.web.StreamResponse:
        assert rule.status is not None
        method, path = str(request.method.value).upper(), request.url.path
        self._fault(str(rule.status), method, path)
        reason = {429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}.get(
            rule.status, "InternalError"
        )
        details: dict[str, Any] = {}
        headers = {}
        if rule.retry_after is not None:
            details["retryAfterSeconds"] = int(rule.retry_after)
            headers["Retry-After"] = f"{rule.retry_after:g}"
        body = {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "message": f"the server answers {rule.status} (injected)",
            "reason": reason,
            "details": details,
            "code": rule.status,
        }
        return aiohttp.web.json_response(body, status=rule.status, headers=headers)

    def _reset(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        self._fault("reset", str(request.method.value).upper(), request.url.path)
        raw = request._raw_request
        if raw is not None and raw.transport is not None:
            raw.transport.abort()  # the client reads a broken connection, no answer
        return aiohttp.web.Response(status=500)  # never reaches the client

    # -- writes -----------------------------------------------------------------------------------------

    @override
    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if self.keep_requests:
            return await self._handle_one(request)
        self._inflight.add(id(request))
        try:
            return await self._handle_one(request)
        finally:
            # Forget what was answered; requests still being served (watch streams) stay.
            self._inflight.discard(id(request))
            self._requests[:] = [r for r in self._requests if id(r) in self._inflight]

    async def _handle_one(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        rule = self._rule_for(request) if self._rules else None
        if rule is not None and rule.status is not None:
            return self._refused(rule, request)
        if rule is not None and not rule.applied:
            return self._reset(request)
        response = await self._serve_one(request)
        if rule is not None:
            return self._reset(request)
        return response

    async def _serve_one(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None:
            return await apps.RawHandler._handle(self, request)

        if request.resource == TOKENREVIEWS and request.method == enums.method.POST:
            return aiohttp.web.json_response(self._review(request.data), status=201)
        async with self._lock:
            if request.method == enums.method.POST and request.subresource == "eviction":
                key = (request.namespace or "", request.name or "")
                if self.apf_throttled.get(key, 0) > 0:
                    self.apf_throttled[key] -= 1
                    return aiohttp.web.Response(
                        status=429,
                        text="Too many requests, please try again later.\n",
                        headers={"Retry-After": "1"},
                    )
                return aiohttp.web.json_response(await self._evict(request), status=201)
            if request.action == enums.action.CREATE:
                await self._create(request)
            elif request.action == enums.action.UPDATE and request.name is not None:
                await self._patch(request)
            elif request.action == enums.action.DELETE and request.name is not None:
                if self._live(self._key(request, request.name)) is None:
                    raise kmock.KubernetesObjectNotFoundError()
                await self._delete_one(request, self._key(request, request.name))
            elif request.method == enums.method.PUT and request.name is not None:
                return aiohttp.web.json_response(await self._replace(request))
            elif request.method == enums.method.DELETE and request.name is None:
                for obj in self._selected(request):
                    meta = obj.raw.get("metadata", {})
                    await self._delete_one(request, (request.resource, meta.get("namespace"), meta["name"]))
                return aiohttp.web.json_response(
                    {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success"}
                )
        return await apps.RawHandler._handle(self, request)

    async def _create(self, request: rendering.Request) -> None:
        assert request.resource is not None
        if not isinstance(request.data, dict):
            raise _status(400, "BadRequest", "the body must be a JSON object")
        body: dict[str, Any] = copy.deepcopy(request.data)
        meta = body.setdefault("metadata", {})
        if request.namespace is not None:
            meta["namespace"] = request.namespace
        namespace = meta.get("namespace")
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise _status(422, "Invalid", "metadata.name or metadata.generateName is required")
            while True:
                name = prefix + "".join(random.choices(_NAME_CHARS, k=5))
                if self._live((request.resource, namespace, name)) is None:
                    break
            meta["name"] = name
        key = (request.resource, namespace, meta["name"])
        if self.validate_pods and request.resource.plural == "pods" and not request.resource.group:
            try:
                kubernetes_validate.validate(
                    {"apiVersion": "v1", "kind": "Pod", **body}, self.server_version, strict=True
                )
            except kubernetes_validate.ValidationError as e:
                first = str(e).splitlines()[0]  # the rest is the whole schema
                raise _status(422, "Invalid", f"Pod {meta['name']!r} is invalid: {first}") from e
        if self._live(key) is not None:
            raise _status(409, "AlreadyExists", f"{request.resource.plural} {meta['name']!r} already exists")
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        self._bump(body)
        if key in self._objects:
            self._objects[key].create(body)
        else:
            self._objects[key] = body
        # kmock's own create/fetch fallbacks find the object by the name in the request's body.
        request.data.setdefault("metadata", {})["name"] = meta["name"]
        await self._publish(request.resource, "ADDED", body)
        if request.resource == CRD:
            self._register_crd(body)

    async def _patch(self, request: rendering.Request) -> None:
        key = self._key(request, request.name)
        obj = self._live(key)
        if obj is None:
            raise kmock.KubernetesObjectNotFoundError()
        if isinstance(request.data, Mapping):
            self._check_rv(obj.raw, request.data.get("metadata", {}).get("resourceVersion"))
        try:
            new = dict(dicts.patch_dict(copy.deepcopy(obj.raw), request.data or {}))
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
            # The apiserver answers an unappliable JSON patch (a failed `test` op included) with 422.
            raise _status(
                422, "Invalid", f"the server rejected our request due to an error in our request: {e}"
            ) from e
        await self._write(request, key, new)

    async def _replace(self, request: rendering.Request) -> dict[str, Any]:
        key = self._key(request, request.name)
        obj = self._live(key)
        if obj is None:
            raise kmock.KubernetesObjectNotFoundError()
        if not isinstance(request.data, dict):
            raise _status(400, "BadRequest", "the body must be a JSON object")
        body: dict[str, Any] = copy.deepcopy(request.data)
        self._check_rv(obj.raw, body.get("metadata", {}).get("resourceVersion"))
        if request.subresource == "status":  # PUT .../status replaces the status only
            body = {**copy.deepcopy(obj.raw), "status": body.get("status")}
        return await self._write(request, key, body)

    # -- reads ------------------------------------------------------------------------------------------

    @override
    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        if request.resource not in self._get_resources():
            raise kmock.KubernetesResourceNotFoundError()
        await self._outage_over(request.resource)
        async with self._lock:
            items = [copy.deepcopy(obj.raw) for obj in self._selected(request)]
        if self._wants_table(request):
            return self._table(request, items)
        info = self.resources[request.resource]
        return {
            "apiVersion": f"{request.resource.group}/{request.resource.version}"
            if request.resource.group
            else request.resource.version,
            "kind": f"{info.kind}List" if info.kind else "List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    @override
    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        async with self._lock:
            obj = self._live(self._key(request, request.name))
            raw = None if obj is None else copy.deepcopy(obj.raw)
        if raw is None:
            raise kmock.KubernetesObjectNotFoundError()
        if self._wants_table(request):
            return self._table(request, [raw])
        return raw

    async def _outage_over(self, resource: kmock.resource | None) -> None:
        while resource is not None and (ended := self._outages.get(resource)) is not None:
            await ended.wait()

    @override
    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""  # send the headers now
        assert request.resource is not None
        await self._outage_over(request.resource)
        since = request.params.get("resourceVersion")
        bus = self._buses[request.resource]
        async with self._lock:
            expired = bool(since and since.isdigit() and 0 < int(since) < self._compacted)
            if expired:
                events = [_expired(int(str(since)), self._compacted)]
            elif since and since.isdigit() and int(since) > 0:
                events = [
                    event
                    for rv, resource, event in self._log
                    if rv > int(since) and resource == request.resource
                    if self._matches(request, event["object"])
                ]
            else:
                events = [
                    {"type": "ADDED", "object": copy.deepcopy(obj.raw)} for obj in self._selected(request)
                ]
            # Writes publish under the lock: what comes after this snapshot is on the bus after the
            # mark, so a watch that resumes (after a reset) misses nothing.
            marker = await bus.mark()
        if expired:  # the resourceVersion was compacted away: one ERROR event, and the end
            await bus.unmark(marker)
            yield events[0]
            return
        try:
            for event in events:
                yield event
            async for event in bus.stream(since=marker):  # pragma: no branch
                if event == _EXPIRE:
                    yield _expired(int(since or 0), self._compacted)
                    return
                if event == _RESET:
                    raw = request._raw_request
                    if raw is not None and raw.transport is not None:
                        raw.transport.abort()
                    return
                if self._matches(request, event.get("object", {})):
                    yield event
        finally:
            with contextlib.suppress(Exception):
                await bus.unmark(marker)

    @override
    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        listing = await super()._serve_version(request)
        # kmock names the core group version "/v1"; clients (kubectl) need "v1".
        if isinstance(listing, dict) and listing.get("groupVersion", "").startswith("/"):
            listing["groupVersion"] = listing["groupVersion"][1:]
        return listing

    @override
    async def _serve_server_version(self, request: rendering.Request) -> rendering.Payload:
        major, minor = self.server_version.split(".")
        return {
            "major": major,
            "minor": minor,
            "gitVersion": f"v{self.server_version}.0",
            "platform": "linux/amd64",
        }

    # -- tables -----------------------------------------------------------------------------------------

    @staticmethod
    def _wants_table(request: rendering.Request) -> bool:
        accept = request.headers.get("Accept", "")
        return "as=Table" in accept

    def _printer_columns(self, request: rendering.Request) -> list[dict[str, Any]] | None:
        resource = request.resource
        assert resource is not None
        for (res, _, _), obj in self._objects.items():
            if res != CRD or obj.deleted:
                continue
            spec = obj.raw.get("spec", {})
            if spec.get("group") != resource.group or spec.get("names", {}).get("plural") != resource.plural:
                continue
            for version in spec.get("versions", []):
                if version.get("name") == resource.version and version.get("additionalPrinterColumns"):
                    columns: list[dict[str, Any]] = version["additionalPrinterColumns"]
                    return columns
        return None

    def _table(self, request: rendering.Request, items: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
        name_column = {
            "name": "Name",
            "type": "string",
            "format": "name",
            "description": "Name",
            "priority": 0,
        }
        columns = self._printer_columns(request)
        if columns is None:
            columns = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        definitions = [name_column] + [
            {
                "name": column["name"],
                "type": column.get("type", "string"),
                "format": column.get("format", ""),
                "description": column.get("description", ""),
                "priority": column.get("priority", 0),
            }
            for column in columns
        ]
        full = request.params.get("includeObject") == "Object"
        rows = []
        for item in items:
            cells: list[Any] = [item.get("metadata", {}).get("name")]
            for column in columns:
                found = jsonpath(item, column.get("jsonPath", ""))
                if column.get("type") == "date":
                    cells.append(_age(found[0]) if found else None)
                elif not found:
                    cells.append(None)
                else:
                    cells.append(found[0] if len(found) == 1 else ",".join(str(v) for v in found))
            partial = {
                "apiVersion": "meta.k8s.io/v1",
                "kind": "PartialObjectMetadata",
                "metadata": item.get("metadata", {}),
            }
            rows.append({"cells": cells, "object": dict(item) if full else partial})
        return {
            "apiVersion": "meta.k8s.io/v1",
            "kind": "Table",
            "metadata": {"resourceVersion": str(self._rv)},
            "columnDefinitions": definitions,
            "rows": rows,
        }

    # -- CRDs -------------------------------------------------------------------------------------------

    def _register_crd(self, crd: Mapping[str, Any]) -> None:
        spec = crd.get("spec", {})
        names = spec.get("names", {})
        for version in spec.get("versions", []):
            self.resources[kmock.resource(spec["group"], version["name"], names["plural"])] = (
                kmock.ResourceInfo(
                    kind=names.get("kind"),
                    namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                    singular=names.get("singular") or names.get("kind", "").lower(),
                    shortnames=names.get("shortNames", []),
                    categories=names.get("categories", []),
                    verbs=VERBS,
                    subresources=list(version.get("subresources", {}).keys()),
                )
            )
