"""S3 (or any S3-compatible endpoint, SeaweedFS in tests) through boto3.

Large objects go up with multipart upload, parts in parallel from slices of
the caller's buffer; S3 makes a multipart object visible only at
CompleteMultipartUpload, which keeps put() all-or-nothing.

Conditional puts send If-None-Match: * or If-Match: "<etag>" on PutObject, or
on CompleteMultipartUpload for large bodies. ETags are returned without their
quotes. SeaweedFS 4.x honours both headers atomically (quoted or unquoted
If-Match), answering 412 PreconditionFailed, also for If-Match on a missing
key, where AWS may answer 404.

SeaweedFS quirks (4.x, measured): listings come in tree order, which differs
from S3's byte order only when a key segment holds a byte below '/' (e.g. "a-c"
sorts after "a/b" there); and StartAfter="a/c" skips every key under "a/c/"
although they sort after it. start_after values that are full object keys or
end with '/' behave as on S3. This module sorts each listing it returns but
cannot repair a `limit` cut made in tree order.
"""

from __future__ import annotations

import contextlib
import http.client
import math
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar
from urllib.parse import urlsplit

import boto3
import botocore.exceptions
from botocore.config import Config

from sidecar import errors
from sidecar.store.base import (
    READ_PIECE_BYTES,
    Buffer,
    Listing,
    ObjectInfo,
    OnData,
    Place,
    Store,
    check_conditions,
    check_list_args,
    check_size,
    validate_key,
    validate_prefix,
    validate_range,
)

MiB = 1 << 20
#: Multipart defaults: objects from DEFAULT_MULTIPART_THRESHOLD bytes up go in parts of
#: DEFAULT_PART_BYTES (the benchmark's plain-boto3 floor uses the same).
DEFAULT_PART_BYTES = 16 * MiB
DEFAULT_MULTIPART_THRESHOLD = 32 * MiB
_MAX_PARTS = 10_000  # S3's limit per multipart upload
#: The largest body one PutObject takes (S3 answers EntityTooLarge above): larger ones go in parts.
MAX_PUT_BYTES = 5 << 30
_DELETE_BATCH = 1000  # S3's limit per DeleteObjects
_MISSING = frozenset({"NoSuchKey", "404", "NotFound"})
#: A conditional write lost (412), or raced another conditional write on the key (409).
_PRECONDITION = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})

#: Operation name -> request kind. Every write-class request counts as "put",
#: matching how S3 bills them (PUT, COPY, POST and LIST share a price tier).
_KINDS = {
    "PutObject": "put",
    "CreateMultipartUpload": "put",
    "UploadPart": "put",
    "CompleteMultipartUpload": "put",
    "AbortMultipartUpload": "put",
    "GetObject": "get",
    "HeadObject": "head",
    "HeadBucket": "head",
    "ListObjectsV2": "list",
    "DeleteObjects": "delete",
    "DeleteObject": "delete",
    "CreateBucket": "create_bucket",
}

_T = TypeVar("_T")

#: How reading a GET's body fails (a chunked body cut short: http.client.IncompleteRead);
#: each counts as one of max_attempts.
_READ_FAILURES = (
    OSError,
    ValueError,
    http.client.HTTPException,
    botocore.exceptions.BotoCoreError,
    errors.StorageError,
)


class ViewBody:
    """A request body reading a buffer in place: botocore copies a memoryview body into bytes
    (``tobytes()``: a copy of every byte into freshly faulted pages, ~40% of an upload's CPU).
    File-like, so botocore sends it as it reads (Content-Length from seek/tell, rewound by
    seek(0) for a retry). A read returns a view of at least ``min_read`` bytes whatever it is
    asked for: urllib3 asks 16 KiB at a time and sends what it gets, so a GiB goes in ~256 sends,
    not ~65,000 Python calls."""

    min_read = 4 * MiB

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def read(self, size: int = -1) -> memoryview:
        end = len(self._view) if size is None or size < 0 else self._pos + max(size, self.min_read)
        out = self._view[self._pos : end]
        self._pos += len(out)
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, len(self._view))[whence]
        self._pos = min(max(base + offset, 0), len(self._view))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


def _body(data: Buffer) -> bytes | ViewBody:
    """What put sends: bytes as they are, any other buffer in place."""
    return data if isinstance(data, bytes) else ViewBody(memoryview(data).cast("B"))


def _no_expect_continue(params: dict[str, Any], **_: Any) -> None:
    """Send bodies without ``Expect: 100-continue``, which botocore adds for every file-like one
    (:class:`ViewBody`): a server or proxy that never answers 100 would hold each PUT a second
    before the body goes. A request refused anyway (a lost condition) then sends its body in vain."""
    params.get("headers", {}).pop("Expect", None)


def _unquote(etag: str) -> str:
    return etag.strip('"')


def _range_of(resp: dict[str, Any], start: int, end: int) -> tuple[int, int]:
    """(The object's size, the bytes this body holds) of the response to a GET of bytes
    ``start``-``end``: its Content-Range, "bytes first-last/size", must be a part of that range,
    ``first`` = ``start`` <= ``last`` <= ``end`` and ``last`` < ``size`` (the bucket is not
    trusted: a body of no bytes or of more than was asked would read on forever or overrun)."""
    found = str(resp.get("ContentRange", ""))
    unit, _, spec = found.partition(" ")
    span, _, size = spec.partition("/")
    first, _, last = span.partition("-")
    if (
        unit == "bytes"
        and first.isdigit()
        and last.isdigit()
        and size.isdigit()
        and start == int(first) <= int(last) <= end
        and int(last) < int(size)
    ):
        return int(size), int(last) - start + 1
    raise errors.StorageError(f"a GET of bytes {start}-{end} answered Content-Range {found!r}")


def _read_body(raw: Any, at: int, length: int, place: Place, on_data: OnData | None, got: list[int]) -> None:
    """``length`` bytes of an HTTP body into ``place``'s buffers from range offset ``at``, a
    piece at a time, counted in ``got[0]`` as they land (short: the body ended)."""
    readinto = getattr(getattr(raw, "_fp", None), "readinto", None) or raw.readinto
    while got[0] < length:
        pos = got[0]
        dest = place(at + pos, min(READ_PIECE_BYTES, length - pos))
        n = readinto(dest)
        if not n:
            break
        if on_data is not None:
            on_data(at + pos, dest[:n])
        got[0] = pos + n


def _conditions(if_none_match: bool, if_match: str | None) -> dict[str, str]:
    if if_none_match:
        return {"IfNoneMatch": "*"}
    if if_match is not None:
        return {"IfMatch": f'"{_unquote(if_match)}"'}  # RFC 7232's quoted form
    return {}


class S3Store(Store):
    """s3://bucket[/prefix]. Options: endpoint_url (any S3-compatible server;
    implies path-style addressing), region, access_key/secret_key (default:
    boto3's chain), part_bytes/multipart_threshold/concurrency for multipart
    (AWS rejects parts under 5 MiB except the last; the part size grows to stay
    within 10,000 parts), max_attempts (total, including the first),
    retry_mode ("standard" or "adaptive"), connect/read timeouts in seconds,
    page_size (keys per LIST request, at most 1000)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        access_key: str | None = None,
        secret_key: str | None = None,
        part_bytes: int = DEFAULT_PART_BYTES,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        concurrency: int = 4,
        max_attempts: int = 5,
        retry_mode: str = "standard",
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        page_size: int = 1000,
    ) -> None:
        if len(bucket) < 3:
            raise ValueError(f"bad S3 bucket name {bucket!r}: at least 3 characters")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        if min(part_bytes, multipart_threshold, concurrency, max_attempts, page_size) < 1:
            raise ValueError(
                "part_bytes, multipart_threshold, concurrency, max_attempts and page_size must be >= 1"
            )
        super().__init__(f"s3://{bucket}" + (f"/{prefix}" if prefix else ""))
        self.bucket = bucket
        self._root = f"{prefix}/" if prefix else ""
        self.part_bytes = part_bytes
        self.multipart_threshold = min(multipart_threshold, MAX_PUT_BYTES + 1)
        self.concurrency = concurrency
        self.page_size = min(page_size, 1000)  # S3 never returns more than 1000 per page
        self.max_attempts = max_attempts

        session = boto3.session.Session()
        if access_key is None and secret_key is None and endpoint_url and session.get_credentials() is None:
            # An S3-compatible server without IAM (SeaweedFS as started by
            # sidecar.local) accepts any signature, but boto3 must sign with something.
            access_key = secret_key = "strata"
        config = Config(
            region_name=region,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"mode": retry_mode, "total_max_attempts": max_attempts},  # attempts, not retries
            max_pool_connections=max(10, concurrency + 4),
            # No SHA-256 of every body over TLS (~1 CPU-s per GiB): integrity rests on TLS plus
            # the digest (xxh3) of every object that the manifest records and restore checks.
            s3={"addressing_style": "path", "payload_signing_enabled": False}
            if endpoint_url
            else {"payload_signing_enabled": False},
            # boto3 >= 1.36 sends CRC trailers by default; they have corrupted
            # objects on SeaweedFS. Sign the payload the classic way instead.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._client: Any = session.client(
            "s3",
            endpoint_url=endpoint_url,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=config,
        )
        # before-send fires once per HTTP attempt, so retries and LIST pages all count.
        self._client.meta.events.register("before-send.s3", self._on_send)
        self._client.meta.events.register_last("before-call.s3", _no_expect_continue)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> S3Store:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"bad S3 store url {url!r}: expected s3://<bucket>[/<prefix>]")
        if parts.query or parts.fragment:
            raise ValueError(f"bad S3 store url {url!r}: no query or fragment allowed")
        return cls(parts.netloc, parts.path, **options)

    def _on_send(self, event_name: str, **_: Any) -> None:
        op = event_name.rsplit(".", 1)[-1]
        self._count(_KINDS.get(op, op))
        # Returning None lets botocore send the request.

    def _call(self, op: str, key: str, fn: Callable[[], _T]) -> _T:
        """Run one client call, mapping botocore failures onto domain errors."""
        try:
            return fn()
        except botocore.exceptions.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _MISSING:
                raise errors.ObjectNotFound(f"no such object: s3://{self.bucket}/{key}") from exc
            if code in _PRECONDITION:
                raise errors.PreconditionFailed(
                    f"S3 {op} s3://{self.bucket}/{key}: precondition failed ({code})"
                ) from exc
            raise errors.StorageError(f"S3 {op} s3://{self.bucket}/{key} failed: {exc}") from exc
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            raise errors.StorageError(f"S3 {op} s3://{self.bucket}/{key} failed: {exc}") from exc

    # -- writes -----------------------------------------------------------------

    def put(self, key: str, data: Buffer, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        full = self._root + validate_key(key)
        check_conditions(if_none_match, if_match)
        conditions = _conditions(if_none_match, if_match)
        view = memoryview(data).cast("B")
        # botocore retries a conditional PUT like any other. When the first attempt
        # succeeded but its response was lost, the retry comes back 412 against our
        # own object: the caller must read the object back to tell its write from another's.
        try:
            if view.nbytes < self.multipart_threshold:
                body = _body(data)
                resp = self._call(
                    "put",
                    full,
                    lambda: self._client.put_object(Bucket=self.bucket, Key=full, Body=body, **conditions),
                )
            else:
                resp = self._put_multipart(full, view, conditions)
        except errors.ObjectNotFound as exc:
            if if_match is None:
                raise
            # AWS answers If-Match on a missing key with 404 rather than 412.
            raise errors.PreconditionFailed(
                f"S3 put s3://{self.bucket}/{full}: precondition failed (object missing)"
            ) from exc
        return _unquote(str(resp["ETag"]))

    def _put_multipart(self, full: str, view: memoryview, conditions: dict[str, str]) -> dict[str, Any]:
        if conditions and not conditions.keys() <= self._complete_conditions():
            raise ValueError(
                f"this botocore cannot send {sorted(conditions)} on CompleteMultipartUpload: conditional "
                f"puts must stay below multipart_threshold ({self.multipart_threshold} bytes)"
            )
        size = view.nbytes
        part = max(self.part_bytes, math.ceil(size / _MAX_PARTS))
        created = self._call(
            "create_multipart_upload",
            full,
            lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=full),
        )
        upload_id: str = created["UploadId"]

        def upload(number: int, offset: int) -> dict[str, Any]:
            body = ViewBody(view[offset : offset + part])  # sent from the caller's buffer, no copy
            resp = self._call(
                f"upload_part {number}",
                full,
                lambda: self._client.upload_part(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number, Body=body
                ),
            )
            return {"PartNumber": number, "ETag": resp["ETag"]}

        pool = self._executor()
        futures: list[Future[dict[str, Any]]] = [
            pool.submit(upload, i + 1, off) for i, off in enumerate(range(0, size, part))
        ]
        try:
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for f in done:
                f.result()  # re-raises the first failure, if any
            parts = [f.result() for f in futures]
            # The condition is checked here, at the one request that makes the object visible.
            return self._call(
                "complete_multipart_upload",
                full,
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    **conditions,
                ),
            )
        except BaseException:
            for f in futures:
                f.cancel()
            wait(futures)  # running parts finish (or fail) before we abort under them
            # Best effort; on real S3 a lifecycle rule reaps whatever an abort leaves.
            with contextlib.suppress(
                botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError
            ):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            raise

    def _complete_conditions(self) -> set[str]:
        """The conditional headers this botocore's CompleteMultipartUpload takes (>= 1.35.x: both)."""
        shape = self._client.meta.service_model.operation_model("CompleteMultipartUpload").input_shape
        return {"IfNoneMatch", "IfMatch"} & set(shape.members)

    def _executor(self) -> ThreadPoolExecutor:
        # Shared by all puts of this store: `concurrency` bounds parts in flight store-wide.
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="strata-s3-part")
            return self._pool

    def delete(self, keys: Iterable[str]) -> None:
        full = [self._root + validate_key(k) for k in keys]
        for i in range(0, len(full), _DELETE_BATCH):
            batch = full[i : i + _DELETE_BATCH]
            resp = self._call(
                "delete",
                batch[0],
                lambda batch=batch: self._client.delete_objects(  # type: ignore[misc]
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                ),
            )
            failed = [e for e in resp.get("Errors", []) if e.get("Code") not in _MISSING]
            if failed:
                first = failed[0]
                raise errors.StorageError(
                    f"S3 delete s3://{self.bucket}/{first.get('Key')} failed: "
                    f"{first.get('Code')}: {first.get('Message')} ({len(failed)} keys failed)"
                )

    def create_bucket_if_missing(self) -> None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except botocore.exceptions.ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) not in ("404", "NoSuchBucket", "NotFound"):
                raise errors.StorageError(f"S3 head_bucket s3://{self.bucket} failed: {exc}") from exc
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            raise errors.StorageError(f"S3 head_bucket s3://{self.bucket} failed: {exc}") from exc
        try:
            self._client.create_bucket(Bucket=self.bucket)
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise errors.StorageError(f"S3 create_bucket s3://{self.bucket} failed: {exc}") from exc
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            raise errors.StorageError(f"S3 create_bucket s3://{self.bucket} failed: {exc}") from exc

    # -- reads ------------------------------------------------------------------

    def _read_body(self, full: str, **kwargs: Any) -> tuple[bytes, str]:
        def fetch() -> tuple[bytes, str]:
            resp = self._client.get_object(Bucket=self.bucket, Key=full, **kwargs)
            body = resp["Body"]
            try:
                return bytes(body.read()), _unquote(str(resp.get("ETag", "")))
            finally:
                body.close()

        return self._call("get", full, fetch)

    def get(self, key: str) -> bytes:
        return self._read_body(self._root + validate_key(key))[0]

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        return self._read_body(self._root + validate_key(key))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        validate_range(start, length)
        full = self._root + validate_key(key)
        if length == 0:
            # "bytes=5-4" is not a range S3 honours (it would send the whole
            # object); only existence matters here.
            if self.head(key) is None:
                raise errors.ObjectNotFound(f"no such object: s3://{self.bucket}/{full}")
            return b""
        try:
            return self._read_body(full, Range=f"bytes={start}-{start + length - 1}")[0]
        except errors.StorageError as exc:
            cause = exc.__cause__
            if isinstance(cause, botocore.exceptions.ClientError) and (
                cause.response.get("Error", {}).get("Code") == "InvalidRange"
            ):
                return b""  # start at or past the end of an existing object
            raise

    def read_into(
        self,
        key: str,
        start: int,
        length: int,
        place: Place,
        *,
        object_size: int | None = None,
        on_data: OnData | None = None,
    ) -> int:
        """One ranged GET whose body goes from the socket straight into the buffers ``place``
        gives (urllib3's readinto reads into a new bytes object and copies: the HTTP response
        under it is read instead). A body cut short is read on from where it stopped, up to
        max_attempts GETs in all."""
        validate_range(start, length)
        full = self._root + validate_key(key)
        if not length:
            info = self.head(key)
            if info is None:
                raise errors.ObjectNotFound(f"no such object: s3://{self.bucket}/{full}")
            if object_size is not None:
                check_size(key, info.size, object_size)
            return 0
        pos, failures = 0, 0
        end = start + length - 1
        while pos < length:
            try:
                resp = self._call(
                    "get",
                    full,
                    lambda first=start + pos: self._client.get_object(  # type: ignore[misc]
                        Bucket=self.bucket, Key=full, Range=f"bytes={first}-{end}"
                    ),
                )
            except errors.StorageError as exc:
                cause = exc.__cause__
                if isinstance(cause, botocore.exceptions.ClientError) and (
                    cause.response.get("Error", {}).get("Code") == "InvalidRange"
                ):
                    if object_size is not None:  # it ends before the range: shorter than it should be
                        info = self.head(key)
                        check_size(key, -1 if info is None else info.size, object_size)
                    return pos  # start at or past the end of an existing object
                raise
            raw = resp["Body"]._raw_stream  # urllib3's response, unread
            got = [0]  # what came before a failure counts: on_data saw it already
            body, failure = 0, None
            try:
                size, body = _range_of(resp, start + pos, end)
                if object_size is not None:
                    check_size(key, size, object_size)  # before a byte of the body is read
                _read_body(raw, pos, body, place, on_data, got)
            except errors.CorruptObject:
                raise
            except _READ_FAILURES as exc:
                failure = exc
            finally:
                if got[0] == body and body:
                    raw.release_conn()  # read to its end: the connection serves the next GET
                else:
                    raw.close()  # cut short, refused or failed: never back into the pool
            pos += got[0]
            if failure is None and got[0] == body:
                if start + pos >= size:
                    break  # the object ends here
                continue
            # A failed GET, or one cut short: read on from here, a bounded number of times.
            failures += 1
            if failures >= self.max_attempts:
                if failure is not None:
                    raise errors.StorageError(
                        f"S3 get s3://{self.bucket}/{full} failed: {failure}"
                    ) from failure
                raise errors.StorageError(
                    f"S3 get s3://{self.bucket}/{full}: the body ended after {pos} of {length} bytes"
                )
        return pos

    def head(self, key: str) -> ObjectInfo | None:
        full = self._root + validate_key(key)
        try:
            resp = self._call("head", full, lambda: self._client.head_object(Bucket=self.bucket, Key=full))
        except errors.ObjectNotFound:
            return None
        return ObjectInfo(key, int(resp["ContentLength"]), _unquote(str(resp.get("ETag", ""))))

    def list(
        self,
        prefix: str = "",
        *,
        delimiter: str | None = None,
        start_after: str | None = None,
        limit: int | None = None,
    ) -> Listing:
        check_list_args(validate_prefix(prefix), delimiter, limit)
        n = len(self._root)
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._root + prefix}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        if start_after is not None:
            kwargs["StartAfter"] = self._root + start_after
        listing = Listing()
        remaining = limit
        while True:
            kwargs["MaxKeys"] = self.page_size if remaining is None else min(remaining, self.page_size)
            page = self._call("list", kwargs["Prefix"], lambda: self._client.list_objects_v2(**kwargs))
            contents = page.get("Contents", [])
            common = page.get("CommonPrefixes", [])
            listing.objects.extend(ObjectInfo(o["Key"][n:], int(o["Size"])) for o in contents)
            listing.prefixes.extend(p["Prefix"][n:] for p in common)
            if remaining is not None:
                remaining -= len(contents) + len(common)
            if not page.get("IsTruncated") or (remaining is not None and remaining <= 0):
                break
            kwargs["ContinuationToken"] = page["NextContinuationToken"]
        listing.objects.sort(key=lambda o: o.key)
        listing.prefixes.sort()
        return listing

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._client.close()
