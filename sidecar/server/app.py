"""Assemble and run a sidecar: storage, engine, gRPC (unix socket, optional TCP), health, metrics."""

from __future__ import annotations

import logging
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sidecar.api import channel_options, pb_grpc
from sidecar.config import SidecarSettings
from sidecar.engine import Engine
from sidecar.gang import PEER_MAX_MESSAGE_BYTES, Peers, PeerServicer, add_peer_servicer
from sidecar.metrics import Metrics
from sidecar.server.interceptor import ErrorInterceptor
from sidecar.server.servicer import CheckpointerServicer
from sidecar.server.unixsock import bind_private, prepare_directory
from sidecar.store import open_store
from sidecar.store.base import Store
from sidecar.store.probe import conditional_writes_unsupported

log = logging.getLogger(__name__)
SERVICE_NAME = "strata.v1.Checkpointer"
PEER_CHUNK_BYTES = (1 << 20) - (64 << 10)


class SidecarServer:
    """A running sidecar. ``stop()`` lets in-flight uploads finish first."""

    def __init__(self, settings: SidecarSettings, store: Store | None = None, metrics: Metrics | None = None):
        settings.validate()
        self.settings = settings
        self.store = store or open_settings_store(settings)
        self.metrics = metrics or Metrics()
        check_conditional_writes(self.store, settings, self.metrics)
        addresses = [p.strip() for p in settings.peers.split(",") if p.strip()]
        self.engine = Engine(settings, self.store, self.metrics, None)
        members = self.engine.redundancy.members
        if members is not None:  # every other member is a peer (hints, fetches, redundancy)
            addresses += [
                a for i, a in enumerate(members.addresses) if i != members.index and a not in addresses
            ]
        self.engine.set_peers(Peers(addresses))
        self.health = health.HealthServicer()
        # Every trainer holds one Attach stream open (a thread each) besides its blocking calls;
        # those are capped below the pool, so saves and handshakes always find a thread.
        self._grpc = grpc.server(
            ThreadPoolExecutor(max_workers=settings.max_blocking_rpcs + 16, thread_name_prefix="strata-grpc"),
            interceptors=[
                ErrorInterceptor(
                    settings.token,
                    settings.max_blocking_rpcs,
                    lambda method: self.metrics.busy_refusals.labels(method).inc(),
                )
            ],
            options=channel_options(settings.max_message_bytes),
        )
        self.servicer = CheckpointerServicer(self.engine, settings.storage, settings.max_message_bytes)
        pb_grpc.add_CheckpointerServicer_to_server(self.servicer, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        self._peer_grpc: grpc.Server | None = None
        if settings.peer_port:
            self._peer_grpc = grpc.server(
                ThreadPoolExecutor(max_workers=8, thread_name_prefix="strata-peer"),
                options=channel_options(min(settings.max_message_bytes, PEER_MAX_MESSAGE_BYTES)),
            )
            add_peer_servicer(
                PeerServicer(
                    self.engine.on_hint,
                    lambda req: self.engine.serve_fetch(req),  # looked up per call (tests wrap it)
                    # Under glibc's mmap threshold (tune_allocator): each message's buffers then
                    # come from the malloc arena, reused, instead of a fresh mapping to fault in.
                    min(PEER_CHUNK_BYTES, settings.max_message_bytes // 2),
                    on_protect=self.engine.on_protect,
                    on_parity=self.engine.serve_parity,
                ),
                self._peer_grpc,
            )
        self.socket_path = settings.socket
        self.peer_port = 0
        self.tcp_port = 0
        self.metrics_port = 0

    def start(self) -> SidecarServer:
        path = Path(self.socket_path)
        prepare_directory(path.parent, self.settings.socket_mode, self.settings.shm_dir)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
            path.unlink()
        # Bound privately and moved into place with its mode set: never reachable more widely.
        publish_socket = bind_private(self._grpc, path, self.settings.socket_mode)
        if self.settings.tcp_port:
            self.tcp_port = self._grpc.add_insecure_port(f"{self.settings.tcp_host}:{self.settings.tcp_port}")
        self._grpc.start()
        publish_socket()
        if self._peer_grpc is not None:
            self.peer_port = self._peer_grpc.add_insecure_port(
                f"{self.settings.peer_host}:{self.settings.peer_port}"
            )
            self._peer_grpc.start()
        if self.settings.metrics_port:
            self.metrics_port = self.metrics.serve(self.settings.metrics_port, self.settings.metrics_host)
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "strata sidecar serving on unix:%s%s, storage %s, metrics %s",
            path,
            f" and tcp {self.settings.tcp_host}:{self.tcp_port}" if self.tcp_port else "",
            self.settings.storage,
            f":{self.metrics_port}/metrics" if self.metrics_port else "off",
        )
        return self

    def wait(self) -> None:
        self._grpc.wait_for_termination()

    def drain(self, timeout: float, hurry: threading.Event | None = None) -> int:
        """Keep serving attached trainers (a final save on SIGTERM, its WaitCommitted) until
        every one detached, ``timeout`` passed or ``hurry`` is set; returns how many are left."""
        return self.servicer.wait_detached(timeout, hurry)

    def stop(self, grace: float = 5.0) -> None:
        self.health.enter_graceful_shutdown()
        self._grpc.stop(grace).wait()
        self.engine.close()
        if self._peer_grpc is not None:
            self._peer_grpc.stop(0).wait()
        self.metrics.shutdown()
        self.store.close()
        Path(self.socket_path).unlink(missing_ok=True)


def open_settings_store(settings: SidecarSettings) -> Store:
    if not settings.storage.startswith("s3://"):
        return open_store(settings.storage)
    return open_store(
        settings.storage,
        endpoint_url=settings.s3_endpoint or None,
        region=settings.s3_region,
        concurrency=settings.upload_concurrency,
        max_attempts=settings.storage_attempts,
    )


def check_conditional_writes(store: Store, settings: SidecarSettings, metrics: Metrics) -> None:
    """Probe If-None-Match/If-Match once at start: the commit protocol's create-only COMMIT and
    EPOCH records and LATEST's compare-and-swap rest on them."""
    problem = conditional_writes_unsupported(store, "")
    metrics.conditional_writes.set(0 if problem else 1)
    if problem is None:
        return
    if settings.conditional_writes == "require":
        raise ValueError(
            f"storage {settings.storage} does not honour conditional writes ({problem}); use storage "
            "that does (S3, MinIO, SeaweedFS 4.x) or start with --conditional-writes warn"
        )
    log.warning(
        "storage %s does not honour conditional writes (%s): running anyway (--conditional-writes warn). "
        "Two writers of one EPOCH or COMMIT can no longer be told apart; fencing still keeps a superseded "
        "gang's commits from being read as long as attempts are not allocated twice",
        settings.storage,
        problem,
    )


def yield_cpu(settings: SidecarSettings) -> None:
    """Lower this process's CPU priority (``--nice``): checkpointing must not slow training
    down when they share cores. Called by the sidecar's entry points, never by a library user."""
    if settings.nice:
        os.nice(settings.nice)


def serve(settings: SidecarSettings) -> SidecarServer:
    return SidecarServer(settings).start()
