"""Domain errors. Each carries the gRPC status it maps to (one interceptor does
the mapping, so servicers stay thin) and whether retrying can help."""

from __future__ import annotations

import grpc


class StrataError(Exception):
    """Base of every error Strata raises on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    #: Permanent errors never succeed on retry; temporary ones may.
    temporary: bool = False


class InvalidArgument(StrataError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class AlreadyExists(StrataError):
    code = grpc.StatusCode.ALREADY_EXISTS


class NotFound(StrataError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(StrataError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(StrataError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    temporary = True


class Unauthenticated(StrataError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Aborted(StrataError):
    """The stream ended early or was cancelled; nothing was kept."""

    code = grpc.StatusCode.ABORTED
    temporary = True


class StorageError(StrataError):
    """The storage backend failed (unreachable, throttled, 5xx after retries)."""

    code = grpc.StatusCode.UNAVAILABLE
    temporary = True


class ObjectNotFound(StorageError, NotFound):
    code = grpc.StatusCode.NOT_FOUND
    temporary = False


class PreconditionFailed(StorageError):
    """A conditional write lost: the object exists (If-None-Match) or changed (If-Match)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    temporary = False


class CorruptObject(StrataError):
    """A stored object's size or checksum does not match what its manifest says."""

    code = grpc.StatusCode.DATA_LOSS

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"corrupt object {key}: {why}")
        self.key = key


class CommandFailed(Exception):
    """A ``strata`` command could not do its work for a reason it can say in one line (a process it
    started died, say): reported without a traceback, exit status 1."""
