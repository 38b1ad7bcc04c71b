"""A small async Kubernetes API client for the operator's own writes (StrataJob, Checkpoint, pods,
Events, evictions, TokenReviews).

kopf watches; this writes. One aiohttp session, the credentials of a kubeconfig or of the pod's
service account (resolved by the ``kubernetes`` package's loaders), and a call counter so the
benchmark and the metrics can say how many API calls a restart took.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import ssl
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

__all__ = ["RESTART_RULES_SINCE", "Api", "ApiError", "ServerVersion", "path", "transient"]

log = logging.getLogger("strata.operator")

#: Container restart rules (``restartPolicy``/``restartPolicyRules`` on a regular container) exist
#: from Kubernetes 1.34; an older apiserver refuses such a pod ("may not be set for non-init
#: containers"), and the Job controller would retry its creation forever.
RESTART_RULES_SINCE = (1, 34)

#: Every request's limits: the whole request, the connection (TCP and TLS), and each read (a
#: connection the apiserver stopped answering, half-open after its restart, fails within it).
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=30, connect=10, sock_read=20)
USER_AGENT = "strata-operator"


class ApiError(Exception):
    """A non-2xx answer: its HTTP status, the Status reason and the apiserver's message, the
    reasons of its causes (``details.causes``) and the seconds it asks to wait (Retry-After)."""

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        *,
        causes: tuple[str, ...] = (),
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.causes = causes
        self.retry_after = retry_after

    @property
    def disruption_budget(self) -> bool:
        """A 429 from the Eviction API because a PodDisruptionBudget refuses it (cause
        DisruptionBudget). Any other 429 (API Priority and Fairness, a plain-text body with
        Retry-After) is a busy apiserver: retry it, do not treat it as a refusal."""
        return self.status == 429 and (
            "DisruptionBudget" in self.causes or "disruption budget" in self.message.lower()
        )


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is what a busy or restarting apiserver causes, worth a retry: a broken or
    refused connection, a timeout, 429 (API Priority and Fairness), 5xx, and 409 (a write that
    raced another)."""
    if isinstance(exc, ApiError):
        return exc.status in (409, 429) or exc.status >= 500
    return isinstance(exc, (aiohttp.ClientError, OSError, TimeoutError))


def _retry_after(header: str | None, details: Mapping[str, Any]) -> float | None:
    """Seconds from a Retry-After header (delta-seconds) or a Status's details.retryAfterSeconds."""
    for value in (header, details.get("retryAfterSeconds")):
        try:
            if value is not None:
                return max(0.0, float(value))
        except (TypeError, ValueError):
            continue  # an HTTP date or garbage: no hint
    return None


def path(
    group: str,
    version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path of a resource, a collection, or a subresource."""
    base = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    if namespace is not None:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    if name is not None:
        base += f"/{name}"
    if subresource is not None:
        base += f"/{subresource}"
    return base


@dataclasses.dataclass
class _Credentials:
    host: str
    headers: dict[str, str]
    ssl: ssl.SSLContext | bool
    ca_path: str | None = None
    #: Re-reads a rotating token (the pod's projected service-account token): "Bearer ..." or None.
    refresh: Callable[[], str | None] | None = None


def _credentials(kubeconfig: str | None) -> _Credentials:
    import kubernetes

    configuration = kubernetes.client.Configuration()
    try:
        if kubeconfig is None:
            try:
                kubernetes.config.load_incluster_config(client_configuration=configuration)
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config(client_configuration=configuration)
        else:
            kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    except (kubernetes.config.ConfigException, OSError) as exc:
        if kubeconfig:
            raise ValueError(f"--kubeconfig {kubeconfig}: not a usable kubeconfig ({exc})") from None
        raise ValueError(
            "--kubeconfig: none given, not in a pod, and $KUBECONFIG or ~/.kube/config is not a usable "
            f"kubeconfig ({exc})"
        ) from None
    headers: dict[str, str] = {}
    # The loaders store "Bearer <token>" (exec plugins and service-account tokens alike).
    token = configuration.api_key.get("authorization") or configuration.api_key.get("BearerToken")
    if token:
        headers["Authorization"] = token if token.lower().startswith("bearer ") else f"Bearer {token}"
    context: ssl.SSLContext | bool = True
    if configuration.host.startswith("https"):
        if not configuration.verify_ssl:
            context = False
        else:
            context = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
            if configuration.cert_file:
                context.load_cert_chain(configuration.cert_file, configuration.key_file)
    refresh = None
    hook = getattr(configuration, "refresh_api_key_hook", None)
    if hook is not None:

        def refresh() -> str | None:
            hook(configuration)  # the in-cluster loader re-reads the token file once it is due
            token = configuration.api_key.get("authorization") or configuration.api_key.get("BearerToken")
            return None if not token else token if token.lower().startswith("bearer ") else f"Bearer {token}"

    return _Credentials(
        configuration.host.rstrip("/"), headers, context, configuration.ssl_ca_cert or None, refresh
    )


class Api:
    """Async JSON calls to one apiserver. ``calls`` counts every request sent."""

    def __init__(
        self,
        host: str,
        headers: Mapping[str, str] | None = None,
        ssl_context: Any = True,
        refresh: Callable[[], str | None] | None = None,
    ) -> None:
        self.host = host.rstrip("/")
        self._refresh = refresh
        self._headers = dict(headers or {})
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self.calls = 0

    @classmethod
    def from_config(cls, kubeconfig: str | None = None) -> Api:
        """In-cluster credentials when ``kubeconfig`` is None and the pod has them, else the kubeconfig
        (``$KUBECONFIG`` or ~/.kube/config when None)."""
        found = _credentials(kubeconfig)
        return cls(found.host, found.headers, found.ssl, found.refresh)

    async def close(self) -> None:
        """Close the connections; later calls fail (503) rather than open new ones."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        url: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        """The decoded JSON answer; ApiError for any non-2xx status."""
        if self._closed:
            raise ApiError(503, "ClientClosed", "the API client was closed (the operator is stopping)")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=REQUEST_TIMEOUT, connector=aiohttp.TCPConnector(ssl=self._ssl)
            )
        if self._refresh is not None and (token := self._refresh()):
            self._headers["Authorization"] = token  # projected tokens rotate (about hourly)
        headers = {**self._headers, "Accept": "application/json", "User-Agent": USER_AGENT}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        self.calls += 1
        async with self._session.request(
            method, self.host + url, data=data, params=params, headers=headers
        ) as response:
            text = await response.text()
            try:
                decoded = json.loads(text) if text else None
            except ValueError:
                decoded = None
            if response.status >= 300:
                reason = decoded.get("reason", "") if isinstance(decoded, dict) else ""
                message = decoded.get("message", text) if isinstance(decoded, dict) else text
                details = (decoded.get("details") if isinstance(decoded, dict) else None) or {}
                details = details if isinstance(details, dict) else {}
                causes = tuple(
                    str(c.get("reason", "")) for c in details.get("causes") or [] if isinstance(c, dict)
                )
                raise ApiError(
                    response.status,
                    reason or response.reason or "",
                    str(message)[:500],
                    causes=causes,
                    retry_after=_retry_after(response.headers.get("Retry-After"), details),
                )
            return decoded

    async def get(self, url: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            found: dict[str, Any] = await self.request("GET", url)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return found

    async def create(self, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
        created: dict[str, Any] = await self.request("POST", url, dict(body))
        return created

    async def merge_patch(self, url: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        patched: dict[str, Any] = await self.request(
            "PATCH", url, dict(patch), content_type="application/merge-patch+json"
        )
        return patched

    async def strategic_patch(self, url: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A strategic merge patch (built-in kinds only): lists merge by key, e.g. conditions by type."""
        patched: dict[str, Any] = await self.request(
            "PATCH", url, dict(patch), content_type="application/strategic-merge-patch+json"
        )
        return patched

    async def json_patch(self, url: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        patched: dict[str, Any] = await self.request(
            "PATCH", url, ops, content_type="application/json-patch+json"
        )
        return patched

    async def delete(self, url: str, body: Mapping[str, Any] | None = None) -> bool:
        """True when deleted (or being deleted); False when it was already gone."""
        try:
            await self.request("DELETE", url, dict(body) if body is not None else None)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True


def parse_version(body: Any) -> tuple[int, int] | None:
    """(major, minor) of a ``/version`` answer, or None; managed clusters say e.g. minor "33+"."""
    if not isinstance(body, Mapping):
        return None
    major = re.match(r"\d+", str(body.get("major", "")))
    minor = re.match(r"\d+", str(body.get("minor", "")))
    if major and minor:
        return int(major.group()), int(minor.group())
    found = re.match(r"v?(\d+)\.(\d+)", str(body.get("gitVersion", "")))
    return (int(found.group(1)), int(found.group(2))) if found else None


class ServerVersion:
    """The apiserver's version, read at start and refreshed (:meth:`run`): an upgrade of the control
    plane changes what pods may carry. Until it is known, features it gates are off (a pod without
    them is admitted everywhere)."""

    def __init__(self, api: Api, *, in_place_restart: bool = False) -> None:
        self.api = api
        self.in_place_restart = in_place_restart
        self.version: tuple[int, int] | None = None
        self._said: bool | None = None

    @property
    def restart_rules(self) -> bool:
        """Whether the server accepts container restart rules on regular containers (1.34+)."""
        return self.version is not None and self.version >= RESTART_RULES_SINCE

    async def refresh(self) -> None:
        """Read ``/version``; a failed read keeps the last known version."""
        try:
            found = parse_version(await self.api.request("GET", "/version"))
        except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as exc:
            log.warning("reading the API server's version failed: %r", exc)
            return
        if found is not None:
            self.version = found
        if self.in_place_restart and self._said != self.restart_rules:
            self._said = self.restart_rules  # said once, and again only when an upgrade changes it
            shown = "unknown" if self.version is None else f"{self.version[0]}.{self.version[1]}"
            if self.restart_rules:
                log.info("in-place restarts on: the API server (%s) accepts container restart rules", shown)
            else:
                log.warning(
                    "in-place restarts need container restart rules (Kubernetes %d.%d+); the API server is "
                    "%s: the webhook adds none and gangs restart with new pods",
                    *RESTART_RULES_SINCE,
                    shown,
                )

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh()
