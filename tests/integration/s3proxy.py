"""A loopback HTTP/1.1 reverse proxy for S3 that records every request and can
drop conditional-write headers, to stand in for a store that ignores them.

Stdlib only. It understands just enough HTTP for boto3 against SeaweedFS:
request bodies by Content-Length, responses by Content-Length or chunked (or
read to EOF), keep-alive on both sides.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

# Per-connection headers (RFC 9110 7.6.1): each side of the proxy sets its own.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
#: Also not forwarded from requests: the 100 Continue is this proxy's to send (BaseHTTPRequestHandler
#: does), and Content-Length is set again from the body actually read.
_REQUEST_ONLY = frozenset({"expect", "content-length"})
_CONDITIONAL = frozenset({"if-none-match", "if-match"})
_CHUNK = 1 << 16


class Request(NamedTuple):
    method: str
    bucket: str
    key: str
    query: str


def classify(method: str, bucket: str, key: str, query: str) -> str:
    """'list' for a bucket listing, 'object' for anything addressing a key, else 'bucket'."""
    if key:
        return "object"
    params = parse_qs(query, keep_blank_values=True)
    if method == "GET" and ("list-type" in params or "prefix" in params):
        return "list"
    return "bucket"


class S3Proxy:
    """Forwards http://127.0.0.1:PORT to `upstream_endpoint` (http:// only).

    `requests` counts (method, kind) and `log` keeps every Request, both
    guarded by one lock. With strip_conditional, If-None-Match and If-Match
    never reach the server; that only works where the server does not check
    signatures (SeaweedFS here runs without auth), since SigV4 signs them.
    """

    def __init__(self, upstream_endpoint: str, *, strip_conditional: bool = False) -> None:
        parts = urlsplit(upstream_endpoint)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise ValueError(f"upstream must be http://host:port, got {upstream_endpoint!r}")
        self.upstream = (parts.hostname, parts.port)
        self.strip_conditional = strip_conditional
        self.requests: Counter[tuple[str, str]] = Counter()
        self.log: list[Request] = []
        self._lock = threading.Lock()
        self._handlers: set[_Handler] = set()
        self._idle = threading.Condition(self._lock)
        self._server = _Server(self)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None
        #: armed failures: [method, key substring, times left]
        self._missing: list[list[Any]] = []

    def answer_missing(self, method: str, key_contains: str, times: int = 1) -> None:
        """Answer the next ``times`` requests of ``method`` on a key containing ``key_contains``
        with S3's 404 NoSuchKey, without forwarding them: a bucket that loses sight of an object
        for a moment (a lagging replica, a proxy's hiccup)."""
        with self._lock:
            self._missing.append([method, key_contains, times])

    def missing_left(self) -> int:
        with self._lock:
            return sum(m[2] for m in self._missing)

    def _take_missing(self, request: Request) -> bool:
        with self._lock:
            for armed in self._missing:
                if armed[2] > 0 and armed[0] == request.method and armed[1] in request.key:
                    armed[2] -= 1
                    return True
        return False

    def start(self) -> S3Proxy:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and drop every connection, clients' and upstream ones."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()
        with self._lock:
            for handler in self._handlers:
                with contextlib.suppress(OSError):
                    handler.connection.shutdown(socket.SHUT_RDWR)  # ends its keep-alive loop
            self._idle.wait_for(lambda: not self._handlers, timeout=10)

    def __enter__(self) -> S3Proxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def record(self, request: Request) -> None:
        with self._lock:
            self.log.append(request)
            self.requests[(request.method, classify(*request))] += 1

    def count(
        self,
        method: str | None = None,
        key_contains: str | None = None,
        key_endswith: str | None = None,
        exclude_endswith: tuple[str, ...] = (),
    ) -> int:
        """Recorded requests with this method whose key matches every filter given."""
        with self._lock:
            log = list(self.log)
        return sum(
            1
            for r in log
            if (method is None or r.method == method)
            and (key_contains is None or key_contains in r.key)
            and (key_endswith is None or r.key.endswith(key_endswith))
            and not (exclude_endswith and r.key.endswith(exclude_endswith))
        )

    def reset(self) -> None:
        with self._lock:
            self.log.clear()
            self.requests.clear()

    def _register(self, handler: _Handler) -> None:
        with self._lock:
            self._handlers.add(handler)

    def _unregister(self, handler: _Handler) -> None:
        with self._lock:
            self._handlers.discard(handler)
            self._idle.notify_all()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, proxy: S3Proxy) -> None:
        self.proxy = proxy
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    """One client connection (possibly many requests); it keeps one upstream connection."""

    protocol_version = "HTTP/1.1"  # keep-alive, as boto3's connection pool expects
    server: _Server
    _upstream: http.client.HTTPConnection | None = None

    def setup(self) -> None:
        super().setup()
        self.server.proxy._register(self)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._drop_upstream()
            self.server.proxy._unregister(self)

    def log_message(self, format: str, *args: object) -> None:
        pass  # the proxy's record is its log

    def do_GET(self) -> None:
        self._forward()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _forward(self) -> None:
        proxy = self.server.proxy
        split = urlsplit(self.path)
        bucket, _, key = unquote(split.path).lstrip("/").partition("/")
        request = Request(self.command, bucket, key, split.query)
        proxy.record(request)
        if proxy._take_missing(request):
            self._drain_body()
            self._answer_missing(key)
            return

        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._refuse(411, "chunked request bodies are not supported; send Content-Length")
            return
        length = self.headers.get("Content-Length")
        body = self.rfile.read(int(length)) if length is not None else None
        drop = _HOP_BY_HOP | _REQUEST_ONLY | (_CONDITIONAL if proxy.strip_conditional else frozenset())
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in drop]

        try:
            response = self._send_upstream(headers, body)
        except OSError as exc:
            self._refuse(502, f"upstream unreachable: {exc}")
            return
        try:
            self._relay(response)
        except BaseException:
            # Part of the response may still sit on the upstream connection, and the client
            # got a truncated one: neither connection can carry another request.
            self._drop_upstream()
            self.close_connection = True
            raise
        finally:
            response.close()

    def _send_upstream(self, headers: list[tuple[str, str]], body: bytes | None) -> http.client.HTTPResponse:
        # A reused upstream connection may have been closed by the server while idle;
        # then the request never reached it, and one retry on a fresh connection is safe.
        for attempt in (1, 2):
            reused = self._upstream is not None
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*self.server.proxy.upstream, timeout=120)
            conn = self._upstream
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in headers:
                    conn.putheader(name, value)
                if body is not None:
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body)
                return conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._drop_upstream()
                if not reused or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _relay(self, response: http.client.HTTPResponse) -> None:
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        no_body = self.command == "HEAD" or response.status in (204, 304) or response.status < 200
        if no_body:
            self.end_headers()  # a HEAD's Content-Length passed through above, as the server sent it
        elif response.chunked:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := response.read1(_CHUNK):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
        elif response.length is not None:
            self.end_headers()
            while chunk := response.read(_CHUNK):
                self.wfile.write(chunk)
        else:  # delimited by the server closing: buffer it, to keep the client connection
            data = response.read()
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        self.wfile.flush()
        if response.will_close:
            self._drop_upstream()

    def _drop_upstream(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None

    def _drain_body(self) -> None:
        length = self.headers.get("Content-Length")
        if length is not None:
            self.rfile.read(int(length))

    def _answer_missing(self, key: str) -> None:
        data = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchKey</Code>'
            f"<Message>The specified key does not exist.</Message><Key>{key}</Key></Error>"
        ).encode()
        self.send_response_only(404, "Not Found")
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()

    def _refuse(self, status: int, why: str) -> None:
        data = why.encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
        self.close_connection = True
