"""The storage contract against a real S3 server (SeaweedFS), plus what only S3
has: multipart upload, request counting per HTTP request, unreachable endpoints,
conditional writes through a proxy that drops their headers. Also the local
SeaweedFS manager itself."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from s3proxy import Request, S3Proxy

from sidecar import errors
from sidecar.local.seaweed import SeaweedError, SeaweedServer
from sidecar.store import Listing, ObjectInfo, open_store
from sidecar.store.probe import conditional_writes_unsupported
from sidecar.store.s3 import MiB, S3Store

# SeaweedFS lists in tree order, which matches byte order only while no key
# segment holds a byte below '/' next to a sibling directory (see
# sidecar/store/s3.py); these keys stay clear of that, the unit tests cover it.
KEYS = ["a/b", "a/c/d", "a/c/e", "a/c0", "a/d/x", "a0", "b"]


@pytest.fixture
def make_store(s3_store_url: tuple[str, str]) -> Iterator[Callable[..., S3Store]]:
    url, endpoint = s3_store_url
    opened: list[S3Store] = []

    def make(url: str = url, **options: Any) -> S3Store:
        options.setdefault("endpoint_url", endpoint)
        store = open_store(url, **options)
        assert isinstance(store, S3Store)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def store(make_store: Callable[..., S3Store]) -> S3Store:
    return make_store()


@pytest.fixture
def filled(store: S3Store) -> S3Store:
    for i, key in enumerate(KEYS):
        store.put(key, b"x" * (i + 1))
    store.requests.clear()
    return store


def keys(listing: Listing) -> list[str]:
    return [o.key for o in listing.objects]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- contract --------------------------------------------------------------------


def test_put_get_head_and_replace(store: S3Store) -> None:
    store.put("dir/obj", memoryview(b"xhellox")[1:-1])
    assert store.get("dir/obj") == b"hello"
    assert store.head("dir/obj") == ObjectInfo("dir/obj", 5)
    store.put("dir/obj", bytearray(b"replaced"))
    assert store.get("dir/obj") == b"replaced"
    store.put("empty", b"")
    assert store.get("empty") == b""


def test_missing_object(store: S3Store) -> None:
    with pytest.raises(errors.ObjectNotFound, match="nope/x"):
        store.get("nope/x")
    with pytest.raises(errors.ObjectNotFound):
        store.get_range("nope/x", 0, 4)
    with pytest.raises(errors.ObjectNotFound):
        store.get_range("nope/x", 0, 0)
    assert store.head("nope/x") is None


def test_get_range(store: S3Store) -> None:
    store.put("r", b"0123456789")
    assert store.get_range("r", 0, 3) == b"012"
    assert store.get_range("r", 4, 2) == b"45"
    assert store.get_range("r", 8, 100) == b"89"
    assert store.get_range("r", 10, 5) == b""
    assert store.get_range("r", 3, 0) == b""


def test_list(filled: S3Store) -> None:
    listing = filled.list("")
    assert keys(listing) == KEYS
    assert [o.size for o in listing.objects] == list(range(1, len(KEYS) + 1))
    assert keys(filled.list("a/c")) == ["a/c/d", "a/c/e", "a/c0"]
    top = filled.list("", delimiter="/")
    assert (keys(top), top.prefixes) == (["a0", "b"], ["a/"])
    below = filled.list("a/", delimiter="/")
    assert (keys(below), below.prefixes) == (["a/b", "a/c0"], ["a/c/", "a/d/"])
    assert keys(filled.list("", start_after="a/c/d")) == ["a/c/e", "a/c0", "a/d/x", "a0", "b"]
    assert keys(filled.list("", limit=2)) == ["a/b", "a/c/d"]
    seen: list[str] = []
    after: str | None = None
    while page := keys(filled.list("", start_after=after, limit=3)):
        seen += page
        after = page[-1]
    assert seen == KEYS


def test_delete(filled: S3Store) -> None:
    filled.delete(["a/b", "a/c/d", "missing"])
    assert keys(filled.list("")) == [k for k in KEYS if k not in ("a/b", "a/c/d")]
    filled.requests.clear()
    filled.delete([])
    assert filled.requests["delete"] == 0


def test_prefix_in_the_url_scopes_keys(
    make_store: Callable[..., S3Store], s3_store_url: tuple[str, str]
) -> None:
    url, _ = s3_store_url
    bucket = url.removeprefix("s3://").split("/")[0]
    whole, one, two = (
        make_store(f"s3://{bucket}"),
        make_store(f"s3://{bucket}/p/one"),
        make_store(f"s3://{bucket}/p/two"),
    )
    one.put("k", b"1")
    two.put("k", b"2")
    assert (one.get("k"), two.get("k")) == (b"1", b"2")
    assert keys(whole.list("p/")) == ["p/one/k", "p/two/k"]
    assert keys(one.list("")) == ["k"]


def test_invalid_keys_fail_before_any_request(store: S3Store) -> None:
    for key in ["", "/abs", "a//b", "a/../b"]:
        with pytest.raises(ValueError):
            store.put(key, b"x")
    assert sum(store.requests.values()) == 0


# -- conditional writes ----------------------------------------------------------


def test_put_returns_the_etag_that_reads_report(store: S3Store) -> None:
    etag = store.put("d/k", b"v")
    assert etag and '"' not in etag  # quotes stripped
    assert store.get_versioned("d/k") == (b"v", etag)
    info = store.head("d/k")
    assert info is not None and info.etag == etag
    with pytest.raises(errors.ObjectNotFound):
        store.get_versioned("d/missing")


def test_create_only_put_refuses_an_existing_key(store: S3Store) -> None:
    first = store.put("d/k", b"first", if_none_match=True)
    with pytest.raises(errors.PreconditionFailed, match="d/k"):
        store.put("d/k", b"second", if_none_match=True)
    assert store.get_versioned("d/k") == (b"first", first)


def test_if_match_replaces_only_the_version_it_names(store: S3Store) -> None:
    old = store.put("d/k", b"1")
    new = store.put("d/k", b"2", if_match=old)
    assert new != old
    with pytest.raises(errors.PreconditionFailed):
        store.put("d/k", b"3", if_match=old)
    assert store.get_versioned("d/k") == (b"2", new)
    newer = store.put("d/k", b"3", if_match=f'"{new}"')  # a quoted ETag is the same ETag
    assert store.get("d/k") == b"3"
    with pytest.raises(errors.PreconditionFailed):
        store.put("d/missing", b"x", if_match=newer)
    assert store.head("d/missing") is None
    assert store.requests["put"] == 5


def test_identical_content_keeps_the_s3_etag_and_if_match_still_works(store: S3Store) -> None:
    # SeaweedFS, like AWS for single-part objects, uses the content's MD5 as the ETag,
    # so rewriting identical bytes keeps it (file and memory stores make a new one).
    first = store.put("k", b"same")
    second = store.put("k", b"same")
    assert store.get_versioned("k")[1] == second
    third = store.put("k", b"same", if_match=second)
    assert store.head("k") == ObjectInfo("k", 4, third)
    assert {first, second, third} == {third}
    assert store.put("k", b"changed") != third  # new content, new ETag
    with pytest.raises(errors.PreconditionFailed):
        store.put("k", b"other", if_match=third)


def test_conditional_multipart_puts(make_store: Callable[..., S3Store]) -> None:
    store = make_store(part_bytes=5 * MiB, multipart_threshold=5 * MiB, concurrency=2)
    data = os.urandom(6 * MiB)
    etag = store.put("big", data, if_none_match=True)
    with pytest.raises(errors.PreconditionFailed):
        store.put("big", b"y" * (6 * MiB), if_none_match=True)
    with pytest.raises(errors.PreconditionFailed):
        store.put("big", b"y" * (6 * MiB), if_match="0" * 32)
    assert store.get_versioned("big") == (data, etag)
    newer = store.put("big", b"z" * (6 * MiB), if_match=etag)
    assert store.head("big") == ObjectInfo("big", 6 * MiB, newer)
    assert store._client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []


def test_racing_create_only_puts_have_one_winner(store: S3Store) -> None:
    for n in range(5):
        key = f"race/{n}/COMMIT"
        barrier = threading.Barrier(8)
        won: list[int] = []

        def create(
            i: int, key: str = key, barrier: threading.Barrier = barrier, won: list[int] = won
        ) -> None:
            barrier.wait()
            try:
                store.put(key, f"writer {i}".encode(), if_none_match=True)
                won.append(i)
            except errors.PreconditionFailed:
                pass

        threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1
        assert store.get(key) == f"writer {won[0]}".encode()


@pytest.mark.parametrize("prefix", ["", "ns/job/"])
def test_probe_finds_conditional_writes_honoured(store: S3Store, prefix: str) -> None:
    assert conditional_writes_unsupported(store, prefix) is None
    assert keys(store.list("")) == []


def test_probe_through_a_proxy_that_drops_conditional_headers(
    make_store: Callable[..., S3Store], s3_store_url: tuple[str, str]
) -> None:
    _, endpoint = s3_store_url
    with S3Proxy(endpoint, strip_conditional=True) as proxy:
        store = make_store(endpoint_url=proxy.endpoint)
        found = conditional_writes_unsupported(store, "ns/job/")
        assert found is not None
        assert "If-None-Match is ignored: a create-only PUT replaced an existing object" in found
        assert "If-Match is ignored" in found
        assert keys(store.list("")) == []


def test_probe_through_a_plain_proxy_is_satisfied_and_counted(
    make_store: Callable[..., S3Store], s3_store_url: tuple[str, str]
) -> None:
    _, endpoint = s3_store_url
    with S3Proxy(endpoint) as proxy:
        store = make_store(endpoint_url=proxy.endpoint)
        assert conditional_writes_unsupported(store, "ns/job/") is None
        assert proxy.count("PUT", key_contains="/ns/job/.strata-probe-") == 4
        assert dict(proxy.requests) == {("PUT", "object"): 4, ("POST", "bucket"): 1}  # POST ?delete
        assert proxy.log[0].key.startswith("strata/ns/job/.strata-probe-")


def test_proxy_passes_every_kind_of_request_through(
    make_store: Callable[..., S3Store], s3_store_url: tuple[str, str]
) -> None:
    _, endpoint = s3_store_url
    with S3Proxy(endpoint) as proxy:
        store = make_store(endpoint_url=proxy.endpoint, part_bytes=5 * MiB, multipart_threshold=5 * MiB)
        big = os.urandom(11 * MiB)
        store.put("a/big", big)  # multipart: POST create, 3 part PUTs, POST complete
        store.put("a/small", b"0123456789")
        store.put("a/empty", b"")
        assert store.get("a/big") == big
        assert store.get_range("a/small", 2, 3) == b"234"
        assert store.get("a/empty") == b""
        assert store.head("a/small") == ObjectInfo("a/small", 10)
        assert store.head("a/missing") is None
        with pytest.raises(errors.ObjectNotFound):
            store.get("a/missing")
        assert keys(store.list("a/")) == ["a/big", "a/empty", "a/small"]
        store.delete(["a/big", "a/small", "a/empty"])
        assert keys(store.list("")) == []
        assert proxy.requests[("GET", "list")] == 2
        assert proxy.requests[("HEAD", "object")] == 2
        assert proxy.count("PUT", key_endswith="a/big") == 3
        assert proxy.count("POST", key_endswith="a/big") == 2
        assert proxy.count("GET", key_contains="a/", exclude_endswith=("a/big",)) == 3
        assert proxy.count() == len(proxy.log) == sum(proxy.requests.values())
        proxy.reset()
        assert proxy.count() == 0 and not proxy.requests


class _FakeUpstream(BaseHTTPRequestHandler):
    """Answers the way SeaweedFS never does: chunked, or delimited by closing."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        if self.path.endswith("/chunked"):
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"hello ", b"chunked ", b"world"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"EOF")
            self.close_connection = True

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        seen = ",".join(h for h in ("If-None-Match", "If-Match") if h in self.headers)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Conditions", seen or "none")
        self.end_headers()
        self.wfile.write(body)


def test_proxy_relays_chunked_and_close_delimited_responses_on_one_connection() -> None:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _FakeUpstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        target = f"http://127.0.0.1:{upstream.server_address[1]}"
        for strip in (False, True):
            with S3Proxy(target, strip_conditional=strip) as proxy:
                conn = http.client.HTTPConnection(proxy.endpoint.removeprefix("http://"), timeout=10)
                try:
                    for path, body in [("/bkt/a/chunked", b"hello chunked world"), ("/bkt/a/eof", b"EOF")]:
                        conn.request("GET", path)
                        resp = conn.getresponse()
                        assert (resp.status, resp.read()) == (200, body)
                    sock = conn.sock
                    conn.request("PUT", "/bkt/a/k", body=b"data", headers={"If-None-Match": "*"})
                    resp = conn.getresponse()
                    assert (resp.status, resp.read()) == (200, b"data")
                    assert resp.getheader("X-Conditions") == ("none" if strip else "If-None-Match")
                    assert conn.sock is sock is not None  # the client connection was kept alive
                finally:
                    conn.close()
                assert proxy.requests == Counter({("GET", "object"): 2, ("PUT", "object"): 1})
                assert proxy.log[0] == Request("GET", "bkt", "a/chunked", "")
    finally:
        upstream.shutdown()
        upstream.server_close()


# -- multipart -------------------------------------------------------------------


def test_multipart_round_trip_is_byte_exact(make_store: Callable[..., S3Store]) -> None:
    store = make_store(part_bytes=8 * MiB, multipart_threshold=8 * MiB, concurrency=4)
    data = bytearray(os.urandom(40 * MiB + 12345))
    store.put("big/object", memoryview(data))
    # create + 6 parts (5 full, 1 short) + complete; every write-class request counts as a put
    assert store.requests["put"] == 8
    assert store.head("big/object") == ObjectInfo("big/object", len(data))
    assert store.get("big/object") == data
    assert store.get_range("big/object", 8 * MiB - 10, 20) == data[8 * MiB - 10 : 8 * MiB + 10]


def test_a_single_put_from_a_view_is_byte_exact(make_store: Callable[..., S3Store]) -> None:
    store = make_store(multipart_threshold=64 * MiB)  # one PutObject, sent from the buffer itself
    data = bytearray(os.urandom(9 * MiB + 3))
    store.put("one/object", memoryview(data)[1:])
    assert store.requests["put"] == 1
    assert store.get("one/object") == data[1:]


def test_failed_multipart_leaves_nothing(
    make_store: Callable[..., S3Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(part_bytes=5 * MiB, multipart_threshold=5 * MiB, concurrency=2)
    real_upload_part = store._client.upload_part

    def flaky_upload_part(**kwargs: Any) -> Any:
        if kwargs["PartNumber"] == 3:
            raise OSError("injected part failure")
        return real_upload_part(**kwargs)

    monkeypatch.setattr(store._client, "upload_part", flaky_upload_part)
    with pytest.raises(errors.StorageError, match=r"upload_part 3 .*big/object.*injected"):
        store.put("big/object", os.urandom(16 * MiB))
    assert store.head("big/object") is None
    uploads = store._client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])
    assert uploads == []  # aborted


# -- request counting ------------------------------------------------------------


def test_each_list_page_is_one_request(make_store: Callable[..., S3Store]) -> None:
    store = make_store(page_size=3)
    for i in range(10):
        store.put(f"k{i:02d}", b"x")
    store.requests.clear()
    assert len(store.list("").objects) == 10
    assert store.requests["list"] == 4  # pages of 3, 3, 3, 1
    store.requests.clear()
    assert len(store.list("", limit=5).objects) == 5
    assert store.requests["list"] == 2  # 3 + 2: no page past the limit
    assert dict(store.requests) == {"list": 2}


def test_requests_are_counted_by_kind(store: S3Store) -> None:
    store.put("k", b"1")
    store.get("k")
    store.get_range("k", 0, 1)
    store.head("k")
    store.head("missing")
    store.list("")
    store.delete(["k"])
    assert dict(store.requests) == {"put": 1, "get": 2, "head": 2, "list": 1, "delete": 1}


# -- failures --------------------------------------------------------------------


def test_unreachable_endpoint_fails_fast_with_storage_error() -> None:
    store = open_store(
        "s3://bucket/p",
        endpoint_url=f"http://127.0.0.1:{closed_port()}",
        max_attempts=2,
        connect_timeout=0.5,
        read_timeout=1.0,
    )
    try:
        started = time.monotonic()
        with pytest.raises(errors.StorageError, match=r"put s3://bucket/p/some/key") as info:
            store.put("some/key", b"x")
        assert not isinstance(info.value, errors.ObjectNotFound)
        with pytest.raises(errors.StorageError, match="get"):
            store.get("some/key")
        assert time.monotonic() - started < 10
        assert store.requests["put"] == 2  # both attempts were real requests
    finally:
        store.close()


def test_missing_bucket_is_a_storage_error_not_a_missing_object(seaweed: SeaweedServer) -> None:
    store = open_store(f"s3://nobucket-{uuid.uuid4().hex[:8]}", endpoint_url=seaweed.endpoint)
    try:
        with pytest.raises(errors.StorageError) as info:
            store.get("k")
        assert not isinstance(info.value, errors.ObjectNotFound)
    finally:
        store.close()


def test_create_bucket_if_missing(seaweed: SeaweedServer) -> None:
    store = open_store(f"s3://made-{uuid.uuid4().hex[:8]}/x", endpoint_url=seaweed.endpoint)
    assert isinstance(store, S3Store)
    try:
        store.create_bucket_if_missing()
        store.create_bucket_if_missing()  # idempotent
        store.put("k", b"1")
        assert store.get("k") == b"1"
    finally:
        store.close()


# -- the local SeaweedFS manager -------------------------------------------------


def test_seaweed_server_lifecycle(short_tmp: Path) -> None:
    server = SeaweedServer(short_tmp / "data").start()
    pid = server.pid
    assert (short_tmp / "data" / "weed.pid").read_text().strip() == str(pid)
    server.create_bucket("life")
    with open_store("s3://life", endpoint_url=server.endpoint) as store:
        store.put("k", b"1")
        assert store.get("k") == b"1"
    server.stop(timeout=0)
    server.stop()  # idempotent
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not (short_tmp / "data" / "weed.pid").exists()


def test_seaweed_cli_start_and_stop(short_tmp: Path) -> None:
    env_file, pidfile = short_tmp / "s3.env", short_tmp / "weed.pid"
    cmd = [sys.executable, "-m", "sidecar.local.seaweed"]
    proc = subprocess.Popen(
        [
            *cmd,
            "start",
            "--dir",
            str(short_tmp / "d"),
            "--pidfile",
            str(pidfile),
            "--env-file",
            str(env_file),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("http://127.0.0.1:")
        assert env_file.read_text() == f"STRATA_S3_ENDPOINT={endpoint}\n"
        weed_pid = int(pidfile.read_text())
        subprocess.run([*cmd, "stop", "--pidfile", str(pidfile), "--timeout", "0.5"], check=True, timeout=30)
        assert proc.wait(timeout=30) == 0
        with pytest.raises(ProcessLookupError):
            os.kill(weed_pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_seaweed_start_failure_shows_the_log(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = short_tmp / "weed"
    fake.write_text("#!/bin/sh\necho 'boom: cannot start' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr("sidecar.local.seaweed.find_weed", lambda: str(fake))
    server = SeaweedServer(short_tmp / "data")
    with pytest.raises(SeaweedError, match=r"(?s)exited early with status 3.*boom: cannot start"):
        server.start(timeout=10)
    server.stop()  # nothing left to stop; still fine


# -- restore reads ---------------------------------------------------------------


def test_read_into_reads_a_range_straight_into_place(store: S3Store) -> None:
    from sidecar.store.base import into

    body = os.urandom(3 * MiB + 5)
    store.put("big", body)
    dest = memoryview(bytearray(len(body)))
    seen: list[tuple[int, int]] = []
    store.requests.clear()
    got = store.read_into(
        "big",
        0,
        len(body),
        into(dest),
        object_size=len(body),
        on_data=lambda at, p: seen.append((at, len(p))),
    )
    assert (got, bytes(dest)) == (len(body), body)
    assert store.requests["get"] == 1  # one GET, its body read in pieces as it lands
    assert [at for at, _ in seen] == [sum(n for _, n in seen[:i]) for i in range(len(seen))]
    mid = memoryview(bytearray(10))
    assert store.read_into("big", MiB, 10, into(mid)) == 10 and bytes(mid) == body[MiB : MiB + 10]
    tail = memoryview(bytearray(10))
    assert store.read_into("big", len(body) - 4, 10, into(tail)) == 4  # the object ends first
    assert bytes(tail[:4]) == body[-4:]
    assert store.read_into("big", len(body), 10, into(tail)) == 0
    with pytest.raises(errors.ObjectNotFound):
        store.read_into("missing", 0, 10, into(tail))


@pytest.mark.parametrize("told", [MiB, 40 * MiB])
def test_read_into_refuses_an_object_of_another_size_before_its_body(store: S3Store, told: int) -> None:
    import tracemalloc

    from sidecar.store.base import into

    store.put("odd", bytes(32 * MiB))
    dest = memoryview(bytearray(min(told, 32 * MiB)))
    tracemalloc.start()
    try:
        with pytest.raises(errors.CorruptObject, match=f"odd: size {32 * MiB} != {told} in the manifest"):
            store.read_into("odd", 0, len(dest), into(dest), object_size=told)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MiB  # what the bucket sent beyond the MANIFEST's size was never read


def test_a_snapshot_is_read_from_s3_into_a_lent_buffer_bitwise(store: S3Store) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from sidecar import manifest as mf
    from sidecar.errors import CorruptObject
    from sidecar.pipeline import plan
    from sidecar.shm import RestoreBuffer

    parts = [os.urandom(3 * MiB), os.urandom(MiB + 17)]
    data = b"".join(parts)
    objects = []
    for i, part in enumerate(parts):
        store.put(f"snap/obj-{i}", part)
        objects.append(mf.ObjectEntry(f"snap/obj-{i}", len(part), xxh3=mf.xxh3(part)))
    tensors = [mf.TensorEntry("w", "uint8", [len(data)], len(data), 0, xxh3=mf.xxh3(data))]
    manifest = mf.Manifest("ns", "job", 1, 0, 1, 0, "s", len(data), {}, tensors, objects)
    buf = RestoreBuffer(len(data))
    try:
        with ThreadPoolExecutor(4) as pool:
            store.requests.clear()
            plan.read_snapshot(store, manifest, lambda s: manifest, pool, dest=buf)
            assert store.requests["get"] == 2
            assert b"".join(bytes(c) for c in buf.chunks()) == data
            store.put("snap/obj-1", parts[1][:-1] + bytes([parts[1][-1] ^ 1]))
            with pytest.raises(CorruptObject, match="snap/obj-1: xxh3"):
                plan.read_snapshot(store, manifest, lambda s: manifest, pool, dest=buf)
    finally:
        buf.close()
