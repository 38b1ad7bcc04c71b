"""A loopback TCP proxy that paces the bytes it forwards to a fixed rate per direction, shared by
all its connections: storage shaped to what one node gets of an object store."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import threading
import time
from typing import Any


class Pace:
    """A shared schedule: ``take(n)`` returns when ``n`` more bytes fit under ``rate`` bytes/s."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
        if start > now:
            time.sleep(start - now)


class ThrottledProxy:
    def __init__(self, target: str, rate_bytes_s: float) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host.split("//")[-1], int(port))
        self.rate = rate_bytes_s
        self.up, self.down = Pace(rate_bytes_s), Pace(rate_bytes_s)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name="throttle-accept", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._conns += [client, upstream]
            for src, dst, pace in ((client, upstream, self.up), (upstream, client, self.down)):
                threading.Thread(target=self._pipe, args=(src, dst, pace), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, pace: Pace) -> None:
        try:
            while data := src.recv(256 << 10):
                pace.take(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.close()


def _serve(target: str, rate: float, port: Any, stop: Any) -> None:
    proxy = ThrottledProxy(target, rate)
    port.value = proxy.port
    stop.wait()
    proxy.close()


class ProxyProcess:
    """A ThrottledProxy in its own process: its pumping holds no GIL of the benchmark's."""

    def __init__(self, target: str, rate_bytes_s: float) -> None:
        ctx = mp.get_context("spawn")
        self._port = ctx.Value("i", 0)
        self._stop = ctx.Event()
        self._proc = ctx.Process(
            target=_serve, args=(target, rate_bytes_s, self._port, self._stop), daemon=True
        )
        self._proc.start()
        deadline = time.monotonic() + 30
        while not self._port.value:
            if not self._proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the throttling proxy did not start")
            time.sleep(0.02)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._port.value}"

    def close(self) -> None:
        self._stop.set()
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
