"""One place that turns domain errors into gRPC statuses and checks the token.

Unix-socket peers are trusted (the socket's directory and mode are the access
control); TCP peers must send the shared token, because on a host-network pod
127.0.0.1 is reachable by everything on the node.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from sidecar.api import TOKEN_METADATA_KEY
from sidecar.errors import StrataError

log = logging.getLogger(__name__)

_OPEN_METHODS = ("/grpc.health.v1.Health/",)
#: Calls that hold a server thread while they wait (for a commit, a restore, a trainer's life).
BLOCKING_METHODS = frozenset(
    "/strata.v1.Checkpointer/" + m for m in ("WaitCommitted", "Restore", "Attach", "DescribeCheckpoint")
)


class ErrorInterceptor(grpc.ServerInterceptor):
    """``max_blocking``: blocking calls served at once. The server's pool has more threads than
    that, so saves and handshakes always find one; a blocking call beyond it is refused with
    RESOURCE_EXHAUSTED at once (clients retry) instead of queueing behind the others."""

    def __init__(
        self, token: str = "", max_blocking: int = 0, on_refused: Callable[[str], None] | None = None
    ) -> None:
        self._token = token
        self._max_blocking = max_blocking
        self._blocking = threading.BoundedSemaphore(max_blocking) if max_blocking else None
        self._on_refused = on_refused

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        open_method = method.startswith(_OPEN_METHODS)
        metadata = dict(details.invocation_metadata or ())
        sent_token = str(metadata.get(TOKEN_METADATA_KEY, ""))

        limited = self._blocking if method in BLOCKING_METHODS else None

        def authorize(context: grpc.ServicerContext) -> None:
            if open_method or context.peer().startswith("unix:"):
                return
            if not self._token or not hmac.compare_digest(sent_token, self._token):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"TCP clients must send {TOKEN_METADATA_KEY}")

        def admit(context: grpc.ServicerContext) -> None:
            if limited is not None and not limited.acquire(blocking=False):
                if self._on_refused is not None:
                    self._on_refused(method.rsplit("/", 1)[-1])
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{method}: {self._max_blocking} blocking calls are already running on this sidecar "
                    "(--max-blocking-rpcs); retry shortly, or raise the limit if this many ranks share it",
                )

        def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
                authorize(context)
                admit(context)
                try:
                    return behavior(request, context)
                except StrataError as exc:
                    context.abort(exc.code, str(exc))
                except Exception as exc:
                    log.exception("%s failed", method)
                    context.abort(grpc.StatusCode.INTERNAL, f"{method}: internal error: {exc!r}")
                finally:
                    if limited is not None:
                        limited.release()

            return wrapped

        def streaming(behavior: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
            def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                authorize(context)
                admit(context)
                try:
                    yield from behavior(request, context)
                except StrataError as exc:
                    context.abort(exc.code, str(exc))
                except Exception as exc:
                    log.exception("%s failed", method)
                    context.abort(grpc.StatusCode.INTERNAL, f"{method}: internal error: {exc!r}")
                finally:
                    if limited is not None:
                        limited.release()

            return wrapped

        if handler.unary_unary:
            return handler._replace(unary_unary=unary(handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=unary(handler.stream_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=streaming(handler.unary_stream))
        if handler.stream_stream:
            return handler._replace(stream_stream=streaming(handler.stream_stream))
        return handler
