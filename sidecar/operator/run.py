"""The operator process: kopf watches, the controller decides, the report endpoint turns sidecar
reports into Checkpoints, and a metrics endpoint serves ``strata_operator_*``.

``strata operator --help`` starts it; tests start :func:`serve` on their own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf
from kopf._core.engines.peering import Identity  # a NewType of str: kopf exports no alias

from sidecar.operator import certs, names, reports, webhook
from sidecar.operator.admission import opted_in
from sidecar.operator.controller import Controller
from sidecar.operator.inject import InjectConfig
from sidecar.operator.kube import Api, ApiError, ServerVersion, _credentials
from sidecar.operator.metrics import OperatorMetrics

__all__ = ["Operator", "OperatorConfig", "build_registry", "serve"]

log = logging.getLogger("strata.operator")

#: kopf's watches: how long the apiserver keeps one open; kopf's other requests: their limits.
WATCH_SERVER_TIMEOUT_S = 300
CONNECT_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 60.0
#: After kopf lists the pods again (its watch expired), the pod index is checked this much later
#: (one LIST for the burst of listed pods).
RELIST_SETTLE_S = 0.5


@dataclass(frozen=True)
class OperatorConfig:
    kubeconfig: str | None = None  # None: in-cluster, else $KUBECONFIG / ~/.kube/config
    #: Name of the trainer container: only its exit counts as a training failure (None: any).
    trainer_container: str | None = None
    fence_margin_s: float = 30.0
    #: --in-place-restart: a trainer's crash or hang restarts the trainer containers in place (the
    #: webhook adds the container restart rule; see docs/kubernetes/operator.md); else new pods.
    in_place_restart: bool = False
    in_place_timeout_s: float = 60.0
    #: How long a stuck cause (ImagePullBackOff, Unschedulable, ...) must show before the StrataJob's
    #: Stuck condition, an Event and the metrics report it (< 0: off); see sidecar/operator/stuck.py.
    stuck_grace_s: float = 30.0
    #: How often every StrataJob is checked for an expired retention (strata.dev/retention).
    retention_sweep_s: float = 3600.0
    #: Age before a Checkpoint with neither a StrataJob nor a workload of its job's name is deleted.
    orphan_grace_s: float = 600.0
    #: How often the API server's version is read again (it gates the restart rule: 1.34+).
    version_check_s: float = 600.0
    #: How often the pod index is checked against one LIST of the opted-in pods (per watched
    #: namespace, else cluster-wide), and soon after kopf lists again; 0: never.
    pod_resync_s: float = 60.0
    #: kopf peering name for more than one replica (None: standalone, one replica).
    peering: str | None = None
    #: Watch only these namespaces (the chart's namespaced mode, with Roles only); empty: all.
    namespaces: tuple[str, ...] = ()
    #: The report endpoint (HTTPS when cert and key are given); port 0 picks a free one, None: off.
    report_host: str = "0.0.0.0"
    report_port: int | None = 8443
    #: HTTPS from files (e.g. a cert-manager Secret mounted), reloaded when they change; ``tls_ca_file``
    #: is the CA injected sidecars are told to trust.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    #: HTTPS from a CA the operator manages in this Secret of ``tls_namespace`` (see
    #: :mod:`sidecar.operator.certs`), for ``tls_service``'s DNS names; it keeps the ``caBundle`` of
    #: the webhook configurations named in ``webhook_configurations`` current.
    tls_secret: str | None = None
    tls_namespace: str = ""
    tls_service: str = ""
    webhook_configurations: tuple[str, ...] = ()
    tls_policy: certs.TlsPolicy = field(default_factory=certs.TlsPolicy)
    tls_check_s: float = 300.0
    #: Prometheus metrics (``strata_operator_*``); None: not served.
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None
    #: The webhooks (``/mutate-pods``, ``/validate-workloads``) share the report endpoint's server;
    #: None: the mutating webhook adds only the gang gate, no sidecar.
    inject: InjectConfig | None = None


def _owned_by_jobset(body: Mapping[str, Any]) -> bool:
    meta = body.get("metadata") or {}
    if names.JOBSET_NAME_LABEL in (meta.get("labels") or {}):
        return True
    return any(ref.get("kind") == "JobSet" for ref in meta.get("ownerReferences") or [])


def build_registry(controller: Controller, kubeconfig: str | None = None) -> kopf.OperatorRegistry:
    """kopf handlers feeding ``controller``: Jobs and JobSets whose pod template opts in, and
    opted-in pods. Watch events only (``on.event``): kopf writes nothing to these objects."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        found = _credentials(kubeconfig)
        token = found.headers.get("Authorization", "").removeprefix("Bearer ") or None
        return kopf.ConnectionInfo(
            server=found.host,
            token=token,
            insecure=found.ssl is False,
            ca_path=found.ca_path,
        )

    def job_opted_in(body: Mapping[str, Any], **_: Any) -> bool:
        template = (body.get("spec") or {}).get("template") or {}
        return opted_in(template) and not _owned_by_jobset(body)

    @kopf.on.event("batch", "v1", "jobs", registry=registry, when=job_opted_in)
    async def job_event(event: Mapping[str, Any], body: Mapping[str, Any], **_: Any) -> None:
        await controller.on_job(event.get("type"), dict(body))

    def jobset_opted_in(body: Mapping[str, Any], **_: Any) -> bool:
        for replicated in (body.get("spec") or {}).get("replicatedJobs") or []:
            if opted_in(((replicated.get("template") or {}).get("spec") or {}).get("template") or {}):
                return True
        return False

    @kopf.on.event(names.JOBSET_API_GROUP, "v1alpha2", "jobsets", registry=registry, when=jobset_opted_in)
    async def jobset_event(event: Mapping[str, Any], body: Mapping[str, Any], **_: Any) -> None:
        await controller.on_job(event.get("type"), dict(body))

    @kopf.on.event("", "v1", "pods", registry=registry, labels={names.OPT_IN_LABEL: names.OPT_IN_VALUE})
    async def pod_event(event: Mapping[str, Any], body: Mapping[str, Any], **_: Any) -> None:
        await controller.on_pod(event.get("type"), dict(body))

    return registry


def _settings(config: OperatorConfig) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.posting.level = logging.WARNING  # kopf's own Events: only its problems
    settings.posting.reporting_component = "strata-operator"
    # The apiserver ends each watch after server_timeout; the client gives up shortly after, and
    # kopf's inactivity timeout (70 s without an event; the apiserver sends a bookmark every minute)
    # notices a connection that went half-open (an apiserver restarted) sooner.
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_S
    settings.watching.client_timeout = WATCH_SERVER_TIMEOUT_S + 30
    settings.watching.connect_timeout = CONNECT_TIMEOUT_S
    settings.networking.connect_timeout = CONNECT_TIMEOUT_S
    settings.networking.request_timeout = REQUEST_TIMEOUT_S
    settings.queueing.exit_timeout = 1.0
    settings.queueing.idle_timeout = 1.0
    settings.networking.error_backoffs = [0.5, 1, 2, 5, 10]
    if config.peering:
        settings.peering.name = config.peering
        settings.peering.standalone = False
        # kopf pauses a replica that sees a live peer of higher priority, and pauses ALL replicas of
        # equal priority (the default 0) until one of them is gone: every replica needs its own.
        # The oldest replica wins: the priority falls with the start time (ms), and six random low
        # digits make a tie of two replicas started in the same millisecond a one-in-a-million chance
        # (int64 until the year 2262; kopf and the apiserver keep integers exact). A replica started
        # later (a rolling update's) never outranks the acting one, so it waits instead of taking
        # over while the old one still acts; it takes over once the acting one exits and removes its
        # entry from the peering object (or that entry expires, ``lifetime`` s after the last
        # keep-alive, if it died). Below kopf's default 0: a developer's `kopf run --peering` at the
        # default priority pauses the deployed replicas, as kopf intends.
        settings.peering.priority = -(time.time_ns() // 1_000_000 * 1_000_000 + random.randrange(1_000_000))
        settings.peering.stealth = True  # no debug line per keep-alive; "not found" still logged
    else:
        settings.peering.standalone = True
    return settings


@dataclass
class Operator:
    """A running operator: its controller, report writer, metrics, and where it serves."""

    controller: Controller
    writer: reports.CheckpointWriter
    metrics: OperatorMetrics
    api: Api
    report_url: str | None
    metrics_port: int | None
    #: The served certificate's source (None: plain HTTP).
    tls: certs.SecretTls | certs.FileTls | None = None


async def _refresh_pods_ca(
    controller: Controller, tls: certs.SecretTls | certs.FileTls, interval_s: float
) -> None:
    """Keep the CA bundle in running pods current (a rotation, a cert-manager renewal, pods admitted
    by an earlier operator): every ``interval_s``, only pods whose copy differs are patched."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await controller.refresh_report_ca(tls.ca_pem)
        except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as exc:
            log.warning("report CA refresh failed (retried in %.0f s): %r", interval_s, exc)


async def _resync_pods(controller: Controller, namespaces: tuple[str, ...], interval_s: float) -> None:
    """Check the pod index against a LIST of the opted-in pods every ``interval_s``, and shortly
    after kopf listed them again (a watch that expired, 410: the deletions of its gap send no
    DELETED event). One LIST per watched namespace, else one cluster-wide, whatever the job count."""
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(controller.relisted.wait(), interval_s)
            await asyncio.sleep(RELIST_SETTLE_S)  # the rest of the listing arrives first
        controller.relisted.clear()
        for namespace in namespaces or (None,):
            try:
                await controller.resync_pods(namespace)
            except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as exc:
                log.warning("listing the opted-in pods failed (retried in %.0f s): %r", interval_s, exc)
            except Exception:  # a bug must not end the checks for good
                log.exception("checking the pod index failed (retried in %.0f s)", interval_s)


def _identity() -> str:
    pod = os.environ.get("POD_ID") or socket.gethostname()
    return f"{pod}/{os.getpid()}/{uuid.uuid4().hex[:6]}"


async def _tls(
    config: OperatorConfig, api: Api, metrics: OperatorMetrics
) -> certs.SecretTls | certs.FileTls | None:
    if config.tls_secret:
        if not (config.tls_namespace and config.tls_service):
            raise ValueError("the operator-managed CA (tls_secret) needs tls_namespace and tls_service")
        managed = certs.SecretTls(
            api,
            namespace=config.tls_namespace,
            secret=config.tls_secret,
            service=config.tls_service,
            webhook_configurations=config.webhook_configurations,
            policy=config.tls_policy,
            on_change=metrics.tls_changed,
        )
        await managed.reconcile()  # serve nothing before a certificate exists
        metrics.track_tls(managed)
        return managed
    if config.tls_cert_file and config.tls_key_file:
        files = certs.FileTls(config.tls_cert_file, config.tls_key_file, config.tls_ca_file)
        metrics.track_tls(files)
        return files
    return None


@contextlib.asynccontextmanager
async def serve(config: OperatorConfig, *, metrics: OperatorMetrics | None = None) -> AsyncIterator[Operator]:
    """Run the operator on the current event loop until the context exits."""
    metrics = metrics if metrics is not None else OperatorMetrics()
    api = Api.from_config(config.kubeconfig)
    metrics.track_api(api)
    controller = Controller(
        api,
        metrics=metrics,
        trainer_container=config.trainer_container,
        fence_margin_s=config.fence_margin_s,
        in_place_restart=config.in_place_restart,
        in_place_timeout_s=config.in_place_timeout_s,
        stuck_grace_s=config.stuck_grace_s,
        retention_sweep_s=config.retention_sweep_s,
        orphan_grace_s=config.orphan_grace_s,
    )
    writer = reports.CheckpointWriter(
        api,
        attempt_of=controller.attempt_of,
        on_heartbeat=controller.on_heartbeat,
        on_commit=controller.on_commit,
        current_generation=controller.current_generation,
        metrics=metrics,
        owner_references=controller.owner_references,
    )
    controller.on_expired = writer.forget
    server: reports.ReportServer | None = None
    report_url = None
    tls = await _tls(config, api, metrics)
    version = ServerVersion(api, in_place_restart=config.in_place_restart)
    await version.refresh()  # before the webhook serves: it decides the container restart rule
    background = [asyncio.create_task(version.run(config.version_check_s))]
    if config.pod_resync_s > 0:
        background.append(
            asyncio.create_task(_resync_pods(controller, config.namespaces, config.pod_resync_s))
        )
    if tls is not None:
        background.append(asyncio.create_task(tls.run(config.tls_check_s)))
        background.append(
            asyncio.create_task(_refresh_pods_ca(controller, tls, min(config.tls_check_s, 30.0)))
        )
    if config.report_port is not None:
        authenticator = reports.Authenticator(api, workload_uid=controller.workload_uid)
        app = reports.make_app(authenticator, writer, metrics)
        webhook.add_routes(
            app,
            config.inject,
            report_ca=(lambda: tls.ca_pem) if tls is not None else None,
            shape_of=controller.shape_of,
            restart_rules=lambda: version.restart_rules,
            name_taken=controller.name_taken,
        )
        context = tls.context if tls is not None else None
        server = await reports.start_server(app, config.report_host, config.report_port, context)
        host = "127.0.0.1" if config.report_host in ("0.0.0.0", "") else config.report_host
        report_url = f"{'https' if context else 'http'}://{host}:{server.port}"
    metrics_port = (
        metrics.serve(config.metrics_port, config.metrics_host) if config.metrics_port is not None else None
    )
    registry = build_registry(controller, config.kubeconfig)
    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=registry,
            settings=_settings(config),
            clusterwide=not config.namespaces,
            namespaces=config.namespaces,
            standalone=config.peering is None,
            # kopf would ask getpass.getuser(), which fails for a uid without a passwd entry (the
            # image's 65532): the pod's name (POD_ID, as kopf documents) or the host's, unique.
            identity=Identity(_identity()),
            peering_name=config.peering,
            stop_flag=stop,
            ready_flag=ready,
        )
    )
    waiter = asyncio.ensure_future(ready.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # raises why kopf could not start
        # Once kopf watches: the sweep skips the workloads it already knows.
        background.append(asyncio.create_task(controller.run_retention(config.namespaces)))
        log.info("operator ready: reports at %s, metrics on port %s", report_url, metrics_port)
        yield Operator(controller, writer, metrics, api, report_url, metrics_port, tls)
    finally:
        waiter.cancel()
        for job in background:
            job.cancel()
        controller.close()
        if server is not None:
            await server.close()
        await api.close()  # first: kopf waits for every task it did not start, open connections too
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        if metrics_port is not None:
            metrics.shutdown()
