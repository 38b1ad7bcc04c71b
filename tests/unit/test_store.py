"""The storage contract (sidecar/store/base.py), on the file and memory backends.

tests/integration/test_s3_store.py checks the same behaviour against SeaweedFS.
"""

from __future__ import annotations

import array
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sidecar import errors
from sidecar.store import Listing, ObjectInfo, Store, open_store
from sidecar.store import file as file_store
from sidecar.store.base import Buffer
from sidecar.store.file import TMP_MARK, FileStore
from sidecar.store.memory import MemoryStore
from sidecar.store.probe import conditional_writes_unsupported

# Includes keys whose segments hold bytes below '/' ('-'), where byte order and
# tree order differ: "a-c" < "a/b" byte-wise.
KEYS = ["a/b", "a-c", "a0", "a/c/d", "a/c/e", "a/c0", "a/c-1/x", "b"]


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "memory":
        s = open_store(f"memory://{uuid.uuid4().hex}/root")
    else:
        s = open_store((tmp_path / "store").as_uri())
    yield s
    s.close()


@pytest.fixture
def filled(store: Store) -> Store:
    for i, key in enumerate(KEYS):
        store.put(key, b"x" * (i + 1))
    store.requests.clear()
    return store


def keys(listing: Listing) -> list[str]:
    return [o.key for o in listing.objects]


# -- objects ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [b"hello", bytearray(b"hello"), memoryview(b"xhellox")[1:-1], b""],
    ids=["bytes", "bytearray", "memoryview", "empty"],
)
def test_put_then_get_returns_the_same_bytes(store: Store, data: bytes | bytearray | memoryview) -> None:
    store.put("dir/obj", data)
    assert store.get("dir/obj") == bytes(data)
    assert store.head("dir/obj") == ObjectInfo("dir/obj", len(bytes(data)))


def test_put_accepts_a_typed_memoryview(store: Store) -> None:
    floats = array.array("f", [1.0, 2.0, 3.0])
    store.put("f32", memoryview(floats))
    assert store.get("f32") == floats.tobytes()


def test_put_replaces_an_existing_object(store: Store) -> None:
    store.put("k", b"old")
    store.put("k", b"new!")
    assert store.get("k") == b"new!"


def test_put_keeps_no_reference_to_the_callers_buffer(store: Store) -> None:
    buf = bytearray(b"abc")
    store.put("k", buf)
    buf[:] = b"zzz"
    assert store.get("k") == b"abc"


def test_missing_object(store: Store) -> None:
    with pytest.raises(errors.ObjectNotFound, match="nope/x"):
        store.get("nope/x")
    with pytest.raises(errors.ObjectNotFound):
        store.get_range("nope/x", 0, 1)
    assert store.head("nope/x") is None


def test_a_prefix_is_not_an_object(filled: Store) -> None:
    assert filled.head("a/c") is None
    with pytest.raises(errors.ObjectNotFound):
        filled.get("a/c")


def test_get_range(store: Store) -> None:
    store.put("r", b"0123456789")
    assert store.get_range("r", 0, 3) == b"012"
    assert store.get_range("r", 4, 2) == b"45"
    assert store.get_range("r", 8, 100) == b"89"  # clipped at the end
    assert store.get_range("r", 10, 5) == b""  # starts at the end
    assert store.get_range("r", 3, 0) == b""
    with pytest.raises(ValueError):
        store.get_range("r", -1, 2)
    with pytest.raises(ValueError):
        store.get_range("r", 0, -2)


def test_delete(filled: Store) -> None:
    filled.delete(["a/b", "a/c/d", "missing", "a/c"])  # missing keys and prefixes are fine
    assert keys(filled.list("")) == sorted(set(KEYS) - {"a/b", "a/c/d"})
    filled.requests.clear()
    filled.delete([])
    assert filled.requests["delete"] == 0


# -- listing ---------------------------------------------------------------------


def test_list_is_byte_ordered(filled: Store) -> None:
    listing = filled.list("")
    assert keys(listing) == sorted(KEYS)
    assert listing.prefixes == []
    assert {o.key: o.size for o in listing.objects} == {k: i + 1 for i, k in enumerate(KEYS)}


def test_list_prefix_need_not_end_at_a_segment(filled: Store) -> None:
    assert keys(filled.list("a/c")) == ["a/c-1/x", "a/c/d", "a/c/e", "a/c0"]
    assert keys(filled.list("a/c/")) == ["a/c/d", "a/c/e"]
    assert keys(filled.list("zzz")) == []


def test_list_with_delimiter_rolls_up_common_prefixes(filled: Store) -> None:
    top = filled.list("", delimiter="/")
    assert keys(top) == ["a-c", "a0", "b"]
    assert top.prefixes == ["a/"]
    below = filled.list("a/", delimiter="/")
    assert keys(below) == ["a/b", "a/c0"]
    assert below.prefixes == ["a/c-1/", "a/c/"]
    partial = filled.list("a/c", delimiter="/")
    assert keys(partial) == ["a/c0"]
    assert partial.prefixes == ["a/c-1/", "a/c/"]


def test_list_start_after_is_exclusive_and_byte_ordered(filled: Store) -> None:
    assert keys(filled.list("", start_after="a/c/d")) == ["a/c/e", "a/c0", "a0", "b"]
    # A prefix as start_after: keys below it sort after it, so they are included.
    assert keys(filled.list("", start_after="a/c")) == ["a/c-1/x", "a/c/d", "a/c/e", "a/c0", "a0", "b"]
    assert keys(filled.list("a/", start_after="a")) == ["a/b", "a/c-1/x", "a/c/d", "a/c/e", "a/c0"]
    assert keys(filled.list("", start_after="zzz")) == []


def test_list_limit_counts_objects_and_prefixes(filled: Store) -> None:
    assert keys(filled.list("", limit=3)) == sorted(KEYS)[:3]
    listing = filled.list("", delimiter="/", limit=2)
    assert (keys(listing), listing.prefixes) == (["a-c"], ["a/"])
    with pytest.raises(ValueError):
        filled.list("", limit=0)


def test_list_pages_with_start_after_and_limit(filled: Store) -> None:
    seen: list[str] = []
    after: str | None = None
    while page := keys(filled.list("", start_after=after, limit=3)):
        seen += page
        after = page[-1]
    assert seen == sorted(KEYS)


def test_list_rejects_bad_arguments(store: Store) -> None:
    with pytest.raises(ValueError):
        store.list("/abs")
    with pytest.raises(ValueError):
        store.list("a/../b")
    with pytest.raises(ValueError):
        store.list("", delimiter="")


def test_requests_are_counted(store: Store) -> None:
    store.put("k", b"1")
    store.get("k")
    store.get_range("k", 0, 1)
    store.head("k")
    store.list("")
    store.delete(["k"])
    assert dict(store.requests) == {"put": 1, "get": 2, "head": 1, "list": 1, "delete": 1}


# -- keys ------------------------------------------------------------------------

BAD_KEYS = ["", "/abs", "a//b", "a/", "a/../b", "..", "./a", "a/./b", "nul\x00"]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_invalid_keys_are_rejected_before_any_request(store: Store, key: str) -> None:
    for call in (
        lambda: store.put(key, b"x"),
        lambda: store.put(key, b"x", if_none_match=True),
        lambda: store.put(key, b"x", if_match="e"),
        lambda: store.get(key),
        lambda: store.get_versioned(key),
        lambda: store.get_range(key, 0, 1),
        lambda: store.head(key),
        lambda: store.delete([key]),
    ):
        with pytest.raises(ValueError, match="invalid object key"):
            call()
    assert sum(store.requests.values()) == 0


def test_concurrent_puts_all_land(store: Store) -> None:
    def writer(t: int) -> None:
        for i in range(20):
            store.put(f"t{t}/k{i:02d}", f"{t}-{i}".encode())

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.list("").objects) == 160
    assert store.get("t7/k19") == b"7-19"
    assert store.requests["put"] == 160


# -- conditional writes ----------------------------------------------------------


def test_put_returns_the_etag_that_reads_report(store: Store) -> None:
    etag = store.put("d/k", b"v")
    assert isinstance(etag, str) and etag
    assert store.get_versioned("d/k") == (b"v", etag)
    info = store.head("d/k")
    assert info is not None and info.etag == etag
    with pytest.raises(errors.ObjectNotFound, match="d/missing"):
        store.get_versioned("d/missing")


def test_create_only_put_refuses_an_existing_key(store: Store) -> None:
    first = store.put("d/k", b"first", if_none_match=True)
    with pytest.raises(errors.PreconditionFailed, match="d/k"):
        store.put("d/k", b"second", if_none_match=True)
    assert store.get_versioned("d/k") == (b"first", first)
    store.put("d/plain", b"unconditional")
    with pytest.raises(errors.PreconditionFailed):
        store.put("d/plain", b"x", if_none_match=True)
    assert store.get("d/plain") == b"unconditional"


def test_if_match_replaces_only_the_version_it_names(store: Store) -> None:
    old = store.put("d/k", b"1")
    new = store.put("d/k", b"2", if_match=old)
    assert new != old
    with pytest.raises(errors.PreconditionFailed):
        store.put("d/k", b"3", if_match=old)  # stale
    with pytest.raises(errors.PreconditionFailed):
        store.put("d/k", b"3", if_match="not-an-etag")
    assert store.get_versioned("d/k") == (b"2", new)
    with pytest.raises(errors.PreconditionFailed):
        store.put("d/missing", b"x", if_match=new)
    assert store.head("d/missing") is None


def test_etag_changes_on_every_put_even_for_identical_content(store: Store) -> None:
    etags = [store.put("k", b"same")]
    for _ in range(30):  # enough for a reused inode number within one clock tick
        etags.append(store.put("k", b"same"))
    etags.append(store.put("k", b"same", if_match=etags[-1]))
    assert len(set(etags)) == len(etags)
    with pytest.raises(errors.PreconditionFailed):
        store.put("k", b"same", if_match=etags[-2])


def test_conditions_are_checked_before_any_request(store: Store) -> None:
    with pytest.raises(ValueError, match="not both"):
        store.put("k", b"x", if_none_match=True, if_match="e")
    with pytest.raises(ValueError, match="non-empty"):
        store.put("k", b"x", if_match="")
    assert sum(store.requests.values()) == 0


def test_conditional_puts_count_as_puts(store: Store) -> None:
    etag = store.put("k", b"1", if_none_match=True)
    store.put("k", b"2", if_match=etag)
    with pytest.raises(errors.PreconditionFailed):
        store.put("k", b"3", if_none_match=True)
    store.get_versioned("k")
    assert dict(store.requests) == {"put": 3, "get": 1}


def race(n: int, attempt: Callable[[int], object]) -> list[int]:
    """Run attempt(i) for i in range(n) at once; the i that did not raise PreconditionFailed."""
    barrier = threading.Barrier(n)
    won: list[int] = []
    failures: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            attempt(i)
            won.append(i)
        except errors.PreconditionFailed:
            pass
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    return won


def test_racing_create_only_puts_have_one_winner(store: Store) -> None:
    for n in range(10):
        key = f"race/{n}/COMMIT"

        def create(i: int, key: str = key) -> None:
            store.put(key, f"writer {i}".encode(), if_none_match=True)

        won = race(8, create)
        assert len(won) == 1
        assert store.get(key) == f"writer {won[0]}".encode()


def test_racing_compare_and_swaps_have_one_winner(store: Store) -> None:
    etag = store.put("LATEST", b"0")
    for n in range(10):
        new: dict[int, str] = {}

        def swap(i: int, seen: str = etag, new: dict[int, str] = new, n: int = n) -> None:
            new[i] = store.put("LATEST", f"{n}-{i}".encode(), if_match=seen)

        won = race(8, swap)
        assert len(won) == 1
        body, etag = store.get_versioned("LATEST")
        assert (body, etag) == (f"{n}-{won[0]}".encode(), new[won[0]])


def test_create_only_and_if_match_on_one_key_exclude_each_other(store: Store) -> None:
    for n in range(10):
        key = f"mixed/{n}"
        stale = store.put(key, b"v0")
        store.delete([key])

        # The key is missing: the creates race for it, the stale compare-and-swaps all lose.
        def write(i: int, key: str = key, stale: str = stale) -> None:
            if i % 2:
                store.put(key, f"w{i}".encode(), if_none_match=True)
            else:
                store.put(key, f"w{i}".encode(), if_match=stale)

        won = race(8, write)
        assert len(won) == 1 and won[0] % 2 == 1
        assert store.get(key) == f"w{won[0]}".encode()


@pytest.mark.parametrize("prefix", ["", "ns/job/", "ns/job"])
def test_probe_finds_conditional_writes_honoured(store: Store, prefix: str) -> None:
    store.put("ns/job/keep", b"1")
    assert conditional_writes_unsupported(store, prefix) is None
    assert keys(store.list("")) == ["ns/job/keep"]  # the probe object is gone
    assert store.requests["put"] == 1 + 4


class IgnoresConditions(MemoryStore):
    """A store that accepts conditional headers and ignores them, as some S3 lookalikes do."""

    def put(self, key: str, data: Buffer, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        return super().put(key, data)


class RefusesEveryIfMatch(MemoryStore):
    def put(self, key: str, data: Buffer, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        if if_match is not None:
            raise errors.PreconditionFailed("no")
        return super().put(key, data, if_none_match=if_none_match)


def test_probe_names_what_a_store_ignores() -> None:
    ignoring = IgnoresConditions(uuid.uuid4().hex)
    found = conditional_writes_unsupported(ignoring, "p/")
    assert found == (
        "If-None-Match is ignored: a create-only PUT replaced an existing object; "
        "If-Match is ignored: a PUT with a wrong ETag replaced the object"
    )
    assert keys(ignoring.list("")) == []
    refusing = RefusesEveryIfMatch(uuid.uuid4().hex)
    found = conditional_writes_unsupported(refusing, "")
    assert found is not None and found.startswith("If-Match is broken")
    assert keys(refusing.list("")) == []


def test_probe_lets_storage_errors_through_and_still_cleans_up() -> None:
    class Failing(MemoryStore):
        calls = 0

        def put(
            self, key: str, data: Buffer, *, if_none_match: bool = False, if_match: str | None = None
        ) -> str:
            self.calls += 1
            if self.calls == 2:
                raise errors.StorageError("backend down")
            return super().put(key, data, if_none_match=if_none_match, if_match=if_match)

    failing = Failing(uuid.uuid4().hex)
    with pytest.raises(errors.StorageError, match="backend down"):
        conditional_writes_unsupported(failing, "")
    assert keys(failing.list("")) == []


# -- file backend ----------------------------------------------------------------


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_file_put_leaves_no_temporary_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("x/y", b"1" * 1000)
    store.put("x/y", b"2")
    assert files_under(tmp_path) == ["x/y"]
    assert keys(store.list("")) == ["x/y"]


def test_file_crash_between_write_and_rename_leaves_the_old_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileStore(tmp_path)
    store.put("keep", b"old")

    def crash(src: object, dst: object) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(errors.StorageError, match="simulated crash"):
        store.put("new", b"data")
    with pytest.raises(errors.StorageError):
        store.put("keep", b"newer")
    monkeypatch.undo()
    assert store.head("new") is None
    assert store.get("keep") == b"old"
    assert files_under(tmp_path) == ["keep"]


def test_file_conditional_puts_leave_no_lock_or_temporary_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    etag = store.put("d/k", b"1", if_none_match=True)
    with pytest.raises(errors.PreconditionFailed):
        store.put("d/k", b"2", if_none_match=True)
    store.put("d/k", b"3", if_match=etag)
    with pytest.raises(errors.PreconditionFailed):
        store.put("d/k", b"4", if_match=etag)
    assert files_under(tmp_path) == ["d/k"]
    store.delete(["d/k"])
    assert list(tmp_path.iterdir()) == []  # the emptied directory was pruned


def test_file_lock_file_is_invisible_while_held(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("d/k", b"1")
    store.put("e/k", b"1")
    with file_store._key_lock(tmp_path / "d" / "k"):
        assert any(p.name.startswith(TMP_MARK) for p in (tmp_path / "d").iterdir())
        assert keys(store.list("")) == ["d/k", "e/k"]
        listing = store.list("d/", delimiter="/")
        assert (keys(listing), listing.prefixes) == (["d/k"], [])
        store.put("d/k", b"unconditional puts do not wait for the lock")
        store.delete(["d/k"])  # the held lock file keeps the directory; nothing breaks
    assert files_under(tmp_path) == ["e/k"]


def test_file_create_only_waits_for_a_held_lock(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    (tmp_path / "d").mkdir()
    done = threading.Event()

    def create() -> None:
        store.put("d/k", b"late", if_none_match=True)
        done.set()

    with file_store._key_lock(tmp_path / "d" / "k"):
        writer = threading.Thread(target=create)
        writer.start()
        assert not done.wait(0.2)
    writer.join(5)
    assert done.is_set() and store.get("d/k") == b"late"
    assert files_under(tmp_path) == ["d/k"]


def test_file_create_only_over_a_directory_is_not_a_lost_race(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("a/b/c", b"1")
    with pytest.raises(errors.StorageError, match="a path cannot be both") as info:
        store.put("a/b", b"2", if_none_match=True)
    assert not isinstance(info.value, errors.PreconditionFailed)
    with pytest.raises(errors.PreconditionFailed):
        store.put("a/b", b"2", if_match="x")  # a directory is not an object


def test_file_crash_before_link_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStore(tmp_path)

    def crash(src: object, dst: object) -> None:
        raise OSError("simulated crash before link")

    monkeypatch.setattr(os, "link", crash)
    with pytest.raises(errors.StorageError, match="simulated crash"):
        store.put("d/new", b"data", if_none_match=True)
    monkeypatch.undo()
    assert store.head("d/new") is None
    assert [p.name for p in (tmp_path / "d").iterdir()] == []


def test_file_etag_names_the_file_that_was_read(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    etag = store.put("k", b"1")
    st = (tmp_path / "k").stat()
    assert etag == f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"
    assert store.head("k") == ObjectInfo("k", 1, etag)


def test_file_list_skips_in_flight_temporary_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("d/k", b"1")
    (tmp_path / "d" / f"{TMP_MARK}abc").write_bytes(b"partial")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / f"{TMP_MARK}abc").write_bytes(b"partial")  # a directory holding only a tmp file
    listing = store.list("", delimiter="/")
    assert (keys(listing), listing.prefixes) == ([], ["d/"])
    assert keys(store.list("")) == ["d/k"]
    with pytest.raises(ValueError):
        store.put(f"d/{TMP_MARK}x", b"1")


def test_file_delete_prunes_empty_directories(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "root")
    store.put("a/b/c", b"1")
    store.put("a/d", b"1")
    store.delete(["a/b/c"])
    assert sorted(p.name for p in (tmp_path / "root").rglob("*")) == ["a", "d"]
    store.put("a/b", b"now a file")  # the emptied directory no longer blocks this key
    assert store.get("a/b") == b"now a file"
    store.delete(["a/b", "a/d"])
    assert list((tmp_path / "root").iterdir()) == []


def test_file_cannot_hold_a_key_and_keys_below_it(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("a/b/c", b"1")
    with pytest.raises(errors.StorageError, match="a path cannot be both"):
        store.put("a/b", b"2")
    store.put("x", b"1")
    with pytest.raises(errors.StorageError, match="parent of it is itself an object"):
        store.put("x/y", b"2")


def test_file_store_url_round_trips(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/with%20space")
    assert isinstance(store, FileStore)
    assert store.root == tmp_path / "with space"
    assert store.url == (tmp_path / "with space").as_uri()
    store.put("k", b"1")
    assert (tmp_path / "with space" / "k").read_bytes() == b"1"


# -- memory backend --------------------------------------------------------------


def test_memory_stores_with_the_same_name_share_objects() -> None:
    name = uuid.uuid4().hex
    one, two, other = (
        open_store(f"memory://{name}"),
        open_store(f"memory://{name}"),
        open_store("memory://x" + name),
    )
    one.put("k", b"shared")
    assert two.get("k") == b"shared"
    assert other.head("k") is None


def test_memory_prefix_scopes_keys() -> None:
    name = uuid.uuid4().hex
    whole, scoped = MemoryStore(name), MemoryStore.from_url(f"memory://{name}/jobs/j1")
    scoped.put("k", b"1")
    assert keys(whole.list("")) == ["jobs/j1/k"]
    assert keys(scoped.list("")) == ["k"]
    assert scoped.url == f"memory://{name}/jobs/j1"


# -- open_store ------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "gs://bucket/x",
        "bucket/prefix",
        "/abs/path",
        "s3://",
        "s3:///prefix",
        "s3://ab/x",
        "s3://bucket/a/../b",
        "file://relative/path",
        "file://",
        "memory://",
        "memory://name?x=1",
    ],
)
def test_open_store_rejects_bad_urls(url: str) -> None:
    with pytest.raises(ValueError) as info:
        open_store(url)
    assert repr(url) in str(info.value)


def test_open_store_names_the_url_for_unknown_schemes() -> None:
    with pytest.raises(ValueError, match=r"gs://b/x.*s3://, file:// or memory://"):
        open_store("gs://b/x")
