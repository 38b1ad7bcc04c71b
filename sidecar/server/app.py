"""Assemble and run a sidecar: storage, engine, gRPC (unix socket, optional TCP), health, metrics."""

from __future__ import annotations

import logging
import os
import resource
import socket
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
                    on_chain=self.engine.serve_chain,
                ),
                self._peer_grpc,
            )
        self.socket_path = settings.socket
        self.peer_port = 0
        self.tcp_port = 0
        self.metrics_port = 0

    def start(self) -> SidecarServer:
        path = Path(self.socket_path)
        if path.parent.exists() and not path.parent.is_dir():
            raise ValueError(f"--socket {path}: {path.parent} is not a directory")
        try:
            prepare_directory(path.parent, self.settings.socket_mode, self.settings.shm_dir)
        except OSError as exc:
            raise ValueError(
                f"--socket {path}: cannot create its directory {path.parent}: {exc.strerror or exc}"
            ) from None
        refuse_live_socket(path)
        published = False
        try:
            # Every port is bound before the socket appears: a sidecar that cannot serve never
            # takes the socket's path.
            try:
                publish_socket = bind_private(self._grpc, path, self.settings.socket_mode)
            except (OSError, RuntimeError) as exc:  # grpc's failed bind is a RuntimeError
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                raise ValueError(f"--socket {path}: cannot create a socket in {path.parent}: {why}") from None
            if self.settings.tcp_port:
                self.tcp_port = _bind(
                    self._grpc, "--tcp-port", self.settings.tcp_host, self.settings.tcp_port
                )
            if self._peer_grpc is not None:
                self.peer_port = _bind(
                    self._peer_grpc, "--peer-port", self.settings.peer_host, self.settings.peer_port
                )
            if self.settings.metrics_port:
                try:
                    self.metrics_port = self.metrics.serve(
                        self.settings.metrics_port, self.settings.metrics_host
                    )
                except OSError as exc:
                    raise ValueError(
                        f"--metrics-port {self.settings.metrics_port}: cannot serve on "
                        f"{self.settings.metrics_host}:{self.settings.metrics_port}: {exc.strerror or exc}"
                    ) from None
            self._grpc.start()
            publish_socket()
            published = True
            if self._peer_grpc is not None:
                self._peer_grpc.start()
        except BaseException:
            self._abort(published)
            raise
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

    def _abort(self, published: bool) -> None:
        """Undo a start that failed half-way; the socket's path is left alone unless it is ours."""
        self._grpc.stop(0).wait()
        if self._peer_grpc is not None:
            self._peer_grpc.stop(0).wait()
        self.metrics.shutdown()
        self.engine.close()
        self.store.close()
        if published:
            Path(self.socket_path).unlink(missing_ok=True)

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


def refuse_live_socket(path: Path) -> None:
    """A socket another sidecar still serves on is never replaced (its trainers would lose it); a
    stale one, left by a sidecar that died, is. Anything else at the path is never touched."""
    if not (path.exists() or path.is_symlink()):
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise ValueError(f"--socket {path} exists and is not a socket; refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # stale: nobody listens
            return
        except OSError as exc:
            raise ValueError(
                f"--socket {path}: cannot tell whether a sidecar still serves there "
                f"({exc.strerror or exc}); refusing to replace it"
            ) from None
    raise ValueError(
        f"--socket {path}: another sidecar is serving there; stop it first or give this one another --socket"
    )


def _bind(server: grpc.Server, flag: str, host: str, port: int) -> int:
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:  # grpc raises on a failed bind (older releases return 0)
        raise ValueError(f"{flag} {port}: cannot serve on {host}:{port}: {exc}") from None
    if not bound:
        raise ValueError(f"{flag} {port}: cannot serve on {host}:{port} (in use, or not an address here)")
    return int(bound)


def open_settings_store(settings: SidecarSettings) -> Store:
    try:
        return _open_settings_store(settings)
    except ValueError as exc:
        raise ValueError(f"--storage: {exc}") from None


def _open_settings_store(settings: SidecarSettings) -> Store:
    if not settings.storage.startswith("s3://"):
        return open_store(settings.storage)
    return open_store(
        settings.storage,
        endpoint_url=settings.s3_endpoint or None,
        region=settings.s3_region,
        concurrency=settings.upload_concurrency,
        # A snapshot's objects (object_bytes at most) go up in parallel already: each is one
        # PutObject, not CreateMultipartUpload + parts + Complete (~6x the requests, and the
        # per-request CPU of botocore and the server, for no more parallelism). Objects over
        # 5 GiB go in parts all the same: S3Store caps this at what one PutObject takes.
        multipart_threshold=settings.object_bytes + 1,
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


def raise_nofile() -> int:
    """Raise this process's soft limit on open files to its hard limit: every rank's segments,
    the handover socket's descriptors and the storage connections count against it (the
    handover socket is sized from it). The soft limit it runs with now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.info("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return soft


def serve(settings: SidecarSettings) -> SidecarServer:
    raise_nofile()
    return SidecarServer(settings).start()
