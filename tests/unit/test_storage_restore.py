"""Restores from storage read each object once, in ranged reads straight into the restore
buffer (a memfd to lend, or process memory), its size checked against the MANIFEST before a
byte is read and its digest computed as the bytes land; a diff chain is replayed over that one
buffer."""

from __future__ import annotations

import dataclasses
import os
import tracemalloc
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_held_restore import Step, save_chain, tensor

from sidecar import manifest as mf
from sidecar.errors import CorruptObject, NotFound
from sidecar.pipeline import plan
from sidecar.pipeline.plan import read_snapshot
from sidecar.shm import RestoreBuffer
from sidecar.store import open_store
from sidecar.store.base import Store


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    url = f"memory://sr-{uuid.uuid4().hex}" if request.param == "memory" else f"file://{tmp_path}/store"
    with open_store(url) as s:
        yield s


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as ex:
        yield ex


def restored(store: Store, executor: ThreadPoolExecutor, saved: list[Step], s: Step, lent: bool) -> bytes:
    manifests = {x.step: x.manifest for x in saved}
    if not lent:
        (view,) = read_snapshot(store, s.manifest, manifests.__getitem__, executor)
        return bytes(view)
    buf = RestoreBuffer(s.manifest.total_bytes)
    try:
        assert read_snapshot(store, s.manifest, manifests.__getitem__, executor, dest=buf) == []
        out = b"".join(bytes(c) for c in buf.chunks())
        fd = buf.seal()  # nothing of it is still mapped: it can be lent
        os.close(fd)
        return out
    finally:
        buf.close()


@pytest.mark.parametrize("lent", [False, True])
@pytest.mark.parametrize("policy", ["full", "consecutive", "one-shot"])
def test_full_and_chains_restore_bitwise(store, executor, policy, lent):
    saved = save_chain(store, executor, "off", policy)
    assert {s.manifest.checkpoint for s in saved[1:]} == ({"full"} if policy == "full" else {"diff"})
    for s in (saved[0], saved[-1]):
        got = restored(store, executor, saved, s, lent)
        for t in s.manifest.tensors:
            assert tensor(got, t) == tensor(s.buffer, t), (s.step, t.name)


def test_a_full_checkpoint_is_one_read_per_object(store, executor):
    saved = save_chain(store, executor, "off", "full")
    s = saved[-1]
    before = store.requests["get"]
    buf = RestoreBuffer(s.manifest.total_bytes)
    try:
        read_snapshot(store, s.manifest, {s.step: s.manifest}.__getitem__, executor, dest=buf)
    finally:
        buf.close()
    assert store.requests["get"] - before == len(s.manifest.objects)


def test_objects_larger_than_a_range_are_read_in_ranges_and_digested(store, executor, monkeypatch):
    monkeypatch.setattr(plan, "RANGE_BYTES", 64 << 10)
    saved = save_chain(store, executor, "off", "consecutive")
    before = store.requests["get"]
    for lent in (False, True):
        got = restored(store, executor, saved, saved[0], lent)
        assert got[: len(saved[0].buffer)] == saved[0].buffer
    ranges = sum(-(-o.size // (64 << 10)) for o in saved[0].manifest.objects)
    assert store.requests["get"] - before >= 2 * ranges > 2 * len(saved[0].manifest.objects)
    corrupt_one(store, saved[0].manifest.objects[0], at=100 << 10)  # in its second range
    with pytest.raises(CorruptObject, match=saved[0].manifest.objects[0].key):
        restored(store, executor, saved, saved[0], lent=True)


def corrupt_one(store: Store, o: mf.ObjectEntry, at: int = 7, data: bytes | None = None) -> None:
    if data is None:
        body = bytearray(store.get(o.key))
        body[at] ^= 0x01
        data = bytes(body)
    store.put(o.key, data)


@pytest.mark.parametrize("lent", [False, True])
@pytest.mark.parametrize("which", ["full", "diff"])
@pytest.mark.parametrize("how", ["flipped", "truncated", "longer"])
def test_a_damaged_object_is_refused_naming_it(store, executor, which, how, lent):
    saved = save_chain(store, executor, "off", "consecutive")
    s = saved[0] if which == "full" else saved[2]
    o = s.manifest.objects[-1]
    body = store.get(o.key)
    data = {"flipped": None, "truncated": body[:-1], "longer": body + b"\0"}[how]
    corrupt_one(store, o, data=data)
    with pytest.raises(CorruptObject, match=o.key):
        restored(store, executor, saved, saved[-1], lent)


def test_an_object_longer_than_its_manifest_says_is_refused_before_it_is_read(store, executor):
    saved = save_chain(store, executor, "off", "full")
    s = saved[-1]
    o = s.manifest.objects[0]
    huge = 64 * len(store.get(o.key))  # a bucket answering far more than the MANIFEST says
    store.put(o.key, bytes(huge))
    buf = RestoreBuffer(s.manifest.total_bytes)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptObject, match=f"{o.key}: size {huge} != {o.size} in the manifest"):
            read_snapshot(store, s.manifest, {s.step: s.manifest}.__getitem__, executor, dest=buf)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        buf.close()
    if store.url.startswith("file://"):  # (the memory store holds its objects in this process)
        assert peak < huge // 4


def test_a_replayed_chain_must_give_back_what_was_saved(store, executor):
    """Every object intact, but the newest MANIFEST records another digest for a tensor: the
    replayed chain is checked tensor by tensor (the restore falls back rather than serving it)."""
    saved = save_chain(store, executor, "off", "consecutive")
    s = saved[-1]
    bad = dataclasses.replace(s.manifest.tensors[1], xxh3="0" * 16, crc32="")
    manifest = dataclasses.replace(s.manifest, tensors=[s.manifest.tensors[0], bad, *s.manifest.tensors[2:]])
    from sidecar.engine.restore import _replayed_differs

    manifests = {x.step: x.manifest for x in saved}
    (view,) = read_snapshot(store, manifest, manifests.__getitem__, executor)
    assert _replayed_differs(manifest.tensors, view) == bad.name
    buf = RestoreBuffer(manifest.total_bytes)
    try:
        read_snapshot(store, manifest, manifests.__getitem__, executor, dest=buf)
        assert _replayed_differs(manifest.tensors, buf) == bad.name
        assert _replayed_differs(s.manifest.tensors, buf) is None
    finally:
        buf.close()


@pytest.mark.parametrize("lent", [False, True])
def test_a_diff_that_will_not_decode_is_corrupt_also_when_lent(store, executor, lent):
    """Its error leaves no view of the lent mapping behind (which would turn it into a
    BufferError at unmapping, one a restore does not fall back from)."""
    saved = save_chain(store, executor, "off", "consecutive")
    s = saved[-1]
    bad = dataclasses.replace(s.manifest.tensors[0], encoding="bogus")
    m = dataclasses.replace(s.manifest, tensors=[bad, *s.manifest.tensors[1:]])
    manifests = {x.step: x.manifest for x in saved}
    buf = RestoreBuffer(m.total_bytes) if lent else None
    try:
        with pytest.raises(CorruptObject, match=f"{bad.name}: unknown encoding"):
            read_snapshot(store, m, manifests.__getitem__, executor, dest=buf)
    finally:
        if buf is not None:
            buf.close()


def test_what_a_chain_holds_besides_the_snapshot_is_bounded_before_it_is_allocated(store, executor):
    saved = save_chain(store, executor, "off", "consecutive")
    manifests = {x.step: x.manifest for x in saved}
    s = saved[-1]
    chain = plan.load_chain(s.manifest, manifests.__getitem__)
    assert [m.step for m in chain] == [x.step for x in saved]
    held = plan.held_bytes(chain)  # the largest diff: the full one is read in place
    assert held == max(sum(o.size for o in x.manifest.objects) for x in saved[1:])
    assert plan.held_bytes(chain[:1]) == 0
    (view,) = read_snapshot(store, s.manifest, manifests.__getitem__, executor, max_held=held)
    for t in s.manifest.tensors:
        assert tensor(view, t) == tensor(s.buffer, t)
    # A MANIFEST claiming a far larger object than was reserved: refused, nothing allocated.
    d = saved[1].manifest
    huge = dataclasses.replace(d.objects[0], size=1 << 40)
    manifests[d.step] = dataclasses.replace(d, objects=[huge, *d.objects[1:]])
    tracemalloc.start()
    try:
        with pytest.raises(CorruptObject, match=rf"step {d.step}: its objects hold \d+ bytes, more than"):
            read_snapshot(store, s.manifest, manifests.__getitem__, executor, max_held=held)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * s.manifest.total_bytes + (1 << 20)


# --- S3 ranged reads against a bucket that misbehaves (answers faked at the client) -----------


class _Fp:
    """http.client's response under urllib3's: ``cut`` bytes of ``data``, then EOF or ``fail``."""

    def __init__(self, data: bytes, cut: int, fail: BaseException | None) -> None:
        self.data, self.cut, self.fail, self.pos = data, cut, fail, 0

    def readinto(self, dest: memoryview) -> int:
        n = min(len(dest), self.cut - self.pos)
        if n <= 0:
            if self.fail is not None:
                raise self.fail
            return 0
        dest[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


class _Raw:
    def __init__(self, fp: _Fp) -> None:
        self._fp, self.closed, self.released = fp, False, False

    def close(self) -> None:
        self.closed = True

    def release_conn(self) -> None:
        self.released = True


class _Body:
    def __init__(self, raw: _Raw) -> None:
        self._raw_stream = raw


OBJECT = bytes(range(256)) * 4


def faked_s3(monkeypatch, answers):
    """An S3Store whose GETs are answered by ``answers(first, last)`` -> (Content-Range or None,
    body bytes, bytes sent before it stops, what it then raises); the GETs' ranges and bodies
    are recorded."""
    from sidecar.store.s3 import S3Store

    store = S3Store("bkt", endpoint_url="http://127.0.0.1:9", max_attempts=3)
    gets: list[tuple[int, int]] = []
    raws: list[_Raw] = []

    def get_object(Bucket, Key, Range):  # boto3's names
        first, last = (int(x) for x in Range.removeprefix("bytes=").split("-"))
        gets.append((first, last))
        content_range, data, cut, fail = answers(first, last)
        raws.append(_Raw(_Fp(data, cut, fail)))
        resp = {"Body": _Body(raws[-1])}
        if content_range is not None:
            resp["ContentRange"] = content_range
        return resp

    monkeypatch.setattr(store._client, "get_object", get_object)
    return store, gets, raws


def whole(first: int, last: int, cut: int | None = None, fail: BaseException | None = None):
    data = OBJECT[first : last + 1]
    return f"bytes {first}-{last}/{len(OBJECT)}", data, len(data) if cut is None else cut, fail


@pytest.mark.parametrize("how", ["eof", "chunked"])
def test_an_s3_body_cut_short_is_read_on_from_where_it_stopped(monkeypatch, how):
    import http.client

    from sidecar.store.base import into

    fail = http.client.IncompleteRead(b"") if how == "chunked" else None
    store, gets, raws = faked_s3(
        monkeypatch, lambda a, b: whole(a, b, cut=300, fail=fail) if a == 0 else whole(a, b)
    )
    dest = memoryview(bytearray(len(OBJECT)))
    seen: list[tuple[int, int]] = []
    got = store.read_into(
        "k",
        0,
        len(OBJECT),
        into(dest),
        object_size=len(OBJECT),
        on_data=lambda at, p: seen.append((at, len(p))),
    )
    assert got == len(OBJECT) and bytes(dest) == OBJECT
    assert gets == [(0, len(OBJECT) - 1), (300, len(OBJECT) - 1)]
    assert raws[0].closed and not raws[0].released  # never back into the pool half read
    assert raws[1].released and not raws[1].closed
    assert sum(n for _, n in seen) == len(OBJECT)


def test_an_s3_body_that_keeps_failing_fails_after_max_attempts_each_connection_closed(monkeypatch):
    import http.client

    from sidecar.errors import StorageError
    from sidecar.store.base import into

    store, gets, raws = faked_s3(
        monkeypatch, lambda a, b: whole(a, b, cut=10, fail=http.client.IncompleteRead(b""))
    )
    dest = memoryview(bytearray(len(OBJECT)))
    with pytest.raises(StorageError, match="S3 get s3://bkt/k failed: IncompleteRead"):
        store.read_into("k", 0, len(OBJECT), into(dest))
    assert gets == [(0, 1023), (10, 1023), (20, 1023)]  # progress kept, then max_attempts
    assert all(r.closed for r in raws)
    assert bytes(dest[:30]) == OBJECT[:30]


@pytest.mark.parametrize(
    "content_range",
    [
        None,  # a 200: the whole object, the Range ignored
        "bytes 10--1/1024",
        "bytes 10-9/1024",  # no bytes at all
        "bytes 10-1023/1000",  # ends past the object
        "bytes 10-2047/4096",  # more than was asked
        "bytes 0-1023/1024",  # not where it was asked
        "items 10-1023/1024",
        "bytes 10-1023/*",
    ],
)
def test_a_malformed_content_range_is_a_bounded_failure(monkeypatch, content_range):
    from sidecar.errors import StorageError
    from sidecar.store.base import into

    store, gets, raws = faked_s3(monkeypatch, lambda a, b: (content_range, OBJECT, len(OBJECT), None))
    dest = memoryview(bytearray(len(OBJECT) - 10))
    with pytest.raises(StorageError, match="Content-Range"):
        store.read_into("k", 10, len(dest), into(dest))
    assert gets == [(10, 1023)] * store.max_attempts  # not one GET after another for ever
    assert all(r.closed and r._fp.pos == 0 for r in raws)  # no body read


def test_file_objects_are_regular_files_only(tmp_path):
    """A symlink or a FIFO where an object should be is no object: not followed, not blocked on."""
    from sidecar.errors import ObjectNotFound
    from sidecar.store.base import into

    store = open_store(f"file://{tmp_path}/store")
    store.put("real", b"bytes")
    secret = tmp_path / "secret"
    secret.write_bytes(b"not the store's")
    os.symlink(secret, tmp_path / "store" / "link")
    os.mkfifo(tmp_path / "store" / "fifo")
    dest = memoryview(bytearray(16))
    for key in ("link", "fifo"):
        for read in (
            lambda key: store.get(key),
            lambda key: store.get_versioned(key),
            lambda key: store.get_range(key, 0, 4),
            lambda key: store.read_into(key, 0, 4, into(dest)),
        ):
            with pytest.raises(ObjectNotFound, match="not a file"):
                read(key)
    assert store.get("real") == b"bytes" and store.get_range("real", 1, 2) == b"yt"


# --- a full checkpoint stored in place, lent as its objects' files --------------------------


def digested(s: Step) -> mf.Manifest:
    """``s``'s MANIFEST with every tensor's digest, as the sidecar records them."""
    tensors = [dataclasses.replace(t, xxh3=mf.xxh3(tensor(s.buffer, t))) for t in s.manifest.tensors]
    return dataclasses.replace(s.manifest, tensors=tensors)


def test_a_full_step_on_file_storage_opens_as_its_objects_files_in_order(tmp_path, executor):
    with open_store(f"file://{tmp_path}/store") as store:
        s = save_chain(store, executor, "off", "full")[-1]
        files = plan.open_objects(store, digested(s), most=64)
        assert files is not None and files.sizes == [o.size for o in s.manifest.objects]
        lent = files.duplicates()
        try:  # the lent descriptors, read one after another, are the snapshot itself
            got = b"".join(os.pread(fd, size, 0) for fd, size in zip(lent, files.sizes, strict=True))
        finally:
            for fd in lent:
                os.close(fd)
        assert got == s.buffer
        assert b"".join(bytes(c) for c in files.chunks()) == s.buffer  # what streams where not lent


def test_only_a_full_raw_step_of_file_storage_within_the_bound_is_lent_as_files(tmp_path, executor):
    with open_store(f"memory://sr-{uuid.uuid4().hex}") as memory:
        saved = save_chain(memory, executor, "off", "full")
        assert plan.open_objects(memory, digested(saved[-1]), most=64) is None  # no files there
    with open_store(f"file://{tmp_path}/store") as store:
        saved = save_chain(store, executor, "off", "consecutive")
        assert plan.open_objects(store, digested(saved[-1]), most=64) is None  # a diff
        full = digested(saved[0])
        assert plan.open_objects(store, full, most=len(full.objects) - 1) is None  # too many objects
        lossy = dataclasses.replace(full.tensors[0], encoding="int8")
        assert (
            plan.open_objects(store, dataclasses.replace(full, tensors=[lossy, *full.tensors[1:]]), 64)
            is None
        )
        undigested = dataclasses.replace(full.tensors[0], xxh3="")
        assert (
            plan.open_objects(store, dataclasses.replace(full, tensors=[undigested, *full.tensors[1:]]), 64)
            is None
        )
        assert plan.open_objects(store, full, most=64) is not None


@pytest.mark.parametrize("how", ["truncated", "longer", "missing", "symlink"])
def test_a_lent_object_file_of_another_size_or_kind_is_refused_when_opened(tmp_path, executor, how):
    with open_store(f"file://{tmp_path}/store") as store:
        saved = save_chain(store, executor, "off", "full")
        s = saved[-1]
        o = s.manifest.objects[-1]
        path = tmp_path / "store" / o.key
        body = path.read_bytes()
        if how == "missing":
            path.unlink()
        elif how == "symlink":
            (tmp_path / "elsewhere").write_bytes(body)
            path.unlink()
            path.symlink_to(tmp_path / "elsewhere")
        else:
            store.put(o.key, body[:-1] if how == "truncated" else body + b"\0")
        with pytest.raises((CorruptObject, NotFound), match=o.key):
            plan.open_objects(store, digested(s), most=64)


def test_a_lent_object_file_flipped_after_it_was_opened_fails_its_digest_when_streamed(tmp_path, executor):
    with open_store(f"file://{tmp_path}/store") as store:
        saved = save_chain(store, executor, "off", "full")
        s = saved[-1]
        files = plan.open_objects(store, digested(s), most=64)
        assert files is not None
        o = s.manifest.objects[0]
        with open(tmp_path / "store" / o.key, "r+b") as f:  # in place: the open descriptor sees it
            f.seek(3)
            byte = f.read(1)
            f.seek(3)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(CorruptObject, match=o.key):
            b"".join(bytes(c) for c in files.chunks())
