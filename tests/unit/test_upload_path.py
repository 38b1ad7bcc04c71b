"""The save path's upload: one digest pass per byte, S3 bodies sent from the caller's buffer
without SDK checksums, one PutObject per snapshot object, file objects written past the page
cache."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import xxhash
from botocore.awsrequest import AWSResponse
from botocore.utils import determine_content_length

from sidecar.config import SidecarSettings
from sidecar.manifest import Manifest, ObjectEntry
from sidecar.pipeline import RangeDigests, upload
from sidecar.server.app import open_settings_store
from sidecar.store import file as file_store
from sidecar.store.file import FileStore
from sidecar.store.memory import MemoryStore
from sidecar.store.s3 import MAX_PUT_BYTES, S3Store, ViewBody

MiB = 1 << 20


def test_view_body_reads_in_place_and_rewinds() -> None:
    data = bytearray(os.urandom(10 * MiB + 7))
    body = ViewBody(memoryview(data))
    assert determine_content_length(body) == len(data)  # botocore's Content-Length
    first = body.read(16 * 1024)  # urllib3's block: a larger view comes back
    assert isinstance(first, memoryview) and first.obj is data and len(first) == ViewBody.min_read
    rest = b"".join(iter(lambda: body.read(16 * 1024), b""))
    assert bytes(first) + rest == data and body.tell() == len(data)
    body.seek(0)  # a retry
    assert bytes(body.read()) == data


class _Raw:
    def stream(self, **_: Any) -> Any:
        yield b""


def test_an_s3_put_sends_the_buffer_itself_with_no_sdk_checksum() -> None:
    store = S3Store("bkt", endpoint_url="http://127.0.0.1:9")
    sent: list[Any] = []

    def answer(request: Any, **_: Any) -> AWSResponse:  # before-send: nothing reaches the network
        sent.append(request)
        return AWSResponse(request.url, 200, {"ETag": '"e"'}, _Raw())

    store._client.meta.events.register_first("before-send.s3.PutObject", answer)
    data = bytearray(os.urandom(3 * MiB))
    assert store.put("k", memoryview(data)) == "e"
    (request,) = sent
    assert isinstance(request.body, ViewBody) and request.body._view.obj is data  # no copy
    headers = {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}
    assert int(headers["content-length"]) == len(data)
    assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
    # Our own xxh3 in the MANIFEST is the integrity check: no CRC or MD5 pass by the SDK.
    assert not [k for k in headers if k.startswith("x-amz-checksum") or k == "content-md5"]
    assert "x-amz-sdk-checksum-algorithm" not in headers
    # No Expect: 100-continue (botocore's default for a file-like body): a server or proxy that
    # never answers 100 would hold every object a second.
    assert "expect" not in headers
    store.close()


def test_multipart_parts_go_without_expect_continue_too() -> None:
    store = S3Store("bkt", endpoint_url="http://127.0.0.1:9", part_bytes=5 * MiB, multipart_threshold=5 * MiB)
    sent: list[Any] = []

    def answer(request: Any, **_: Any) -> AWSResponse:
        sent.append(request)
        return AWSResponse(request.url, 200, {"ETag": '"p"'}, _Raw())

    store._client.meta.events.register_first("before-send.s3.UploadPart", answer)
    client = store._client  # (this store's own client: nothing to undo)
    client.create_multipart_upload = lambda **kw: {"UploadId": "u"}
    client.complete_multipart_upload = lambda **kw: {"ETag": '"m"'}
    assert store.put("k", bytearray(6 * MiB)) == "m"
    assert len(sent) == 2 and not [r for r in sent if "Expect" in r.headers]
    store.close()


def test_multipart_parts_are_views_of_the_callers_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    store = S3Store("bkt", endpoint_url="http://127.0.0.1:9", part_bytes=5 * MiB, multipart_threshold=5 * MiB)
    data = bytearray(os.urandom(12 * MiB))
    bodies: dict[int, bytes] = {}

    def upload_part(**kw: Any) -> dict[str, str]:
        assert isinstance(kw["Body"], ViewBody) and kw["Body"]._view.obj is data
        bodies[kw["PartNumber"]] = bytes(kw["Body"].read())
        return {"ETag": f'"{kw["PartNumber"]}"'}

    client = store._client
    monkeypatch.setattr(client, "create_multipart_upload", lambda **kw: {"UploadId": "u"})
    monkeypatch.setattr(client, "upload_part", upload_part)
    monkeypatch.setattr(client, "complete_multipart_upload", lambda **kw: {"ETag": '"m"'})
    assert store.put("k", data) == "m"
    assert b"".join(bodies[i] for i in sorted(bodies)) == data
    store.close()


def test_the_sidecars_s3_store_puts_each_object_whole() -> None:
    settings = SidecarSettings(storage="s3://bkt/p", s3_endpoint="http://127.0.0.1:9", object_bytes=8 * MiB)
    store = open_settings_store(settings)
    assert isinstance(store, S3Store)
    assert store.multipart_threshold > settings.object_bytes
    config = store._client.meta.config
    assert config.request_checksum_calculation == "when_required"
    store.close()


def test_objects_above_what_one_put_object_takes_go_multipart() -> None:
    """S3 refuses a PutObject body over 5 GiB (EntityTooLarge): a larger --object-bytes still
    uploads, those objects in parts."""
    settings = SidecarSettings(storage="s3://bkt/p", s3_endpoint="http://127.0.0.1:9", object_bytes=6 << 30)
    store = open_settings_store(settings)
    assert isinstance(store, S3Store)
    assert store.multipart_threshold == MAX_PUT_BYTES + 1  # a 5 GiB object is still one PutObject
    store.close()


@pytest.mark.parametrize(
    "ranges", [[(0, 10), (5, 10)], [(0, 10), (0, 1)], [(20, 5), (0, 21)], [(0, -1)], [(-1, 2)]]
)
def test_range_digests_refuse_overlapping_ranges(ranges: list[tuple[int, int]]) -> None:
    with pytest.raises(ValueError, match=r"overlaps|negative"):
        RangeDigests(ranges)


def test_range_digests_match_one_shot_digests_across_chunk_edges() -> None:
    data = memoryview(os.urandom(10_000))
    ranges = [(0, 1000), (0, 0), (1000, 4096), (5096, 1), (5200, 4800), (6000, 0)]  # empty: anywhere
    digests = RangeDigests(ranges)
    for at in range(0, len(data), 777):
        digests.update(at, data[at : at + 777])
    assert digests.hexdigests() == [xxhash.xxh3_64_hexdigest(data[o : o + n]) for o, n in ranges]


def test_upload_digests_every_byte_once_for_objects_and_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload, "DIGEST_CHUNK", 1000)
    digested = 0
    real = xxhash.xxh3_64

    class Counting:
        def __init__(self) -> None:
            self._h = real()

        def update(self, chunk: memoryview) -> None:
            nonlocal digested
            digested += len(chunk)
            self._h.update(chunk)

        def hexdigest(self) -> str:
            return self._h.hexdigest()

    monkeypatch.setattr(upload.xxhash, "xxh3_64", Counting)
    buffer = memoryview(os.urandom(10_000))
    ranges = [(0, 3000), (3000, 6500), (9500, 500)]
    tensors = RangeDigests(ranges)
    store = MemoryStore("t")
    objects: list[ObjectEntry] = []

    def manifest(entries: list[ObjectEntry]) -> Manifest:
        objects.extend(entries)
        return Manifest("ns", "job", 1, 0, 1, 0, "s", len(buffer), {}, [], entries)

    with ThreadPoolExecutor(2) as pool:
        upload.upload_snapshot(store, pool, "p/", [buffer], 4096, manifest, also=tensors)
    assert [o.size for o in objects] == [4096, 4096, 1808]
    for o in objects:
        assert o.xxh3 == xxhash.xxh3_64_hexdigest(store.get(o.key))
    assert tensors.hexdigests() == [xxhash.xxh3_64_hexdigest(buffer[a : a + n]) for a, n in ranges]
    assert digested == 2 * len(buffer)  # each byte once for its object, once for its tensor (in cache)


def _direct_supported(directory: Path) -> bool:
    with open(directory / "probe", "wb", buffering=0) as f:
        return file_store._set_direct(f.fileno(), True)


@pytest.mark.parametrize("skew", [0, 1])  # a page-aligned buffer (as a snapshot's), or not
def test_large_objects_go_to_the_file_store_past_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skew: int
) -> None:
    size = file_store.DIRECT_MIN_BYTES + 3 * 4096 + 123  # an unaligned tail as well
    region = mmap.mmap(-1, size + 4096)
    region[skew : skew + size] = os.urandom(size)
    data = memoryview(region)[skew : skew + size]
    direct: list[int] = []  # bytes written with O_DIRECT on
    real_write = os.write

    def write(fd: int, chunk: Any) -> int:
        n = real_write(fd, chunk)
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            direct.append(n)
        return n

    monkeypatch.setattr(file_store.os, "write", write)
    store = FileStore(tmp_path / "store")
    store.put("obj", data)
    assert store.get("obj") == data  # every byte, the tail too
    if _direct_supported(tmp_path) and not skew:
        assert sum(direct) == size - size % 4096
    else:
        assert not direct  # refused before a byte: all through the page cache
    data.release()
    region.close()


def test_a_filesystem_without_o_direct_gets_every_byte_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fcntl = fcntl.fcntl

    def refusing(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # as tmpfs before Linux 6.6
        return int(real_fcntl(fd, cmd, arg))

    monkeypatch.setattr(file_store.fcntl, "fcntl", refusing)
    data = os.urandom(file_store.DIRECT_MIN_BYTES + 4096)
    store = FileStore(tmp_path / "store")
    store.put("obj", data)
    assert store.get("obj") == data
