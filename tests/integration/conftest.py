"""Fixtures for tests that run a real sidecar over real gRPC sockets."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.config import SidecarSettings
from sidecar.metrics import Metrics
from sidecar.server import SidecarServer
from trainer_client import CheckpointClient


@pytest.fixture
def make_sidecar(short_tmp: Path) -> Iterator[Callable[..., SidecarServer]]:
    """Start sidecars in this process, each with its own metrics registry."""
    started: list[SidecarServer] = []

    def make(storage: str | None = None, **options: Any) -> SidecarServer:
        shm = short_tmp / "shm"  # each test its own "tmpfs", so it can see what is left in it
        shm.mkdir(exist_ok=True)
        settings = SidecarSettings(
            shm_dir=options.pop("shm_dir", str(shm)),
            storage=storage or f"file://{short_tmp}/store",
            socket=options.pop("socket", str(short_tmp / f"sc{len(started)}.sock")),
            metrics_port=options.pop("metrics_port", 0),
            commit_timeout_s=options.pop("commit_timeout_s", 30.0),
            keep=options.pop("keep", 0),  # tests inspect the whole history unless they test retention
            **options,
        )
        server = SidecarServer(settings, metrics=Metrics()).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop(grace=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def two_pods(make_sidecar, s3_store_url):
    """Two sidecars on one bucket, each told where the other serves hints."""
    url, endpoint = s3_store_url
    ports = [free_port(), free_port()]

    def make(**options):
        return [
            make_sidecar(
                url, s3_endpoint=endpoint, peer_port=ports[i], peers=f"127.0.0.1:{ports[1 - i]}", **options
            )
            for i in range(2)
        ]

    return make, url, endpoint


@pytest.fixture
def make_client() -> Iterator[Callable[..., CheckpointClient]]:
    clients: list[CheckpointClient] = []

    def make(server: SidecarServer, job: str = "job", **options: Any) -> CheckpointClient:
        options.setdefault("connect_timeout_s", 10.0)
        options.setdefault("commit_timeout_s", 60.0)
        client = CheckpointClient(job=job, socket=server.socket_path, **options)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close(wait=False)


def settled(read: Callable[[], Any], expected: Any, timeout: float = 10.0) -> Any:
    """``read()`` once it equals ``expected`` (or its last value after ``timeout``): for effects the
    sidecar applies just after a commit is reported, such as retention."""
    deadline = time.monotonic() + timeout
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def hold_stream(client: CheckpointClient, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the client's save streams wait (before their header) until the returned event is set."""
    gate = threading.Event()
    original = client._requests

    def held(*args: Any, **kwargs: Any) -> Iterator[Any]:
        gate.wait(30)
        yield from original(*args, **kwargs)

    monkeypatch.setattr(client, "_requests", held)
    return gate


@pytest.fixture
def job_name() -> str:
    return "job-" + uuid.uuid4().hex[:8]


class TcpProxy:
    """A loopback TCP forwarder that a test can cut, to make storage really unreachable."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._cut:
                    client.close()
                    continue
                try:
                    upstream = socket.create_connection(self._target)
                except OSError:
                    client.close()
                    continue
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def retarget(self, host: str, port: int) -> None:
        """Forward new connections to another upstream (a restarted server) and accept them again."""
        with self._lock:
            self._target = (host, port)
            self._cut = False

    def cut(self) -> None:
        """Drop every connection and refuse new ones."""
        with self._lock:
            self._cut = True
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.cut()
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                conn.close()


def two_rank_job_with_a_damaged_step(
    make_sidecar: Callable[..., SidecarServer],
    make_client: Callable[..., CheckpointClient],
    job: str,
    tmp_path: Path,
    prefix: str,
) -> tuple[str, str, Callable[[SidecarServer, str], list[CheckpointClient]]]:
    """A 2-rank job (generation ``<prefix>/0``) that committed steps 1 and 2 (``w`` = 10 * step +
    rank) to file storage, then one byte of rank 1's data of step 2 flipped, its sidecar stopped.
    (the storage url, the damaged object's key, ``gang(sidecar, generation)`` making the 2 ranks)."""
    import torch

    from sidecar import manifest as mf

    storage = f"file://{tmp_path}/store"
    server = make_sidecar(storage)

    def gang(on: SidecarServer, generation: str) -> list[CheckpointClient]:
        return [make_client(on, job, rank=r, world_size=2, generation=generation) for r in range(2)]

    ranks = gang(server, f"{prefix}/0")
    for step in (1, 2):
        handles = [c.save(step, {"w": torch.full((4096,), 10.0 * step + r)}) for r, c in enumerate(ranks)]
        assert [h.durable.result(30).step for h in handles] == [step, step]
    for c in ranks:
        c.close()
    server.stop(grace=1)
    commit = mf.read_commit(server.store, "default", job, 2)
    key = mf.load_manifest(server.store, commit, 1).objects[0].key  # rank 1's data of step 2
    path = tmp_path / "store" / key
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    return storage, key, gang
