"""Checkpoint layout, manifest format and the commit protocol.

Layout under the store root (S3 and file backends alike)::

    <namespace>/<job>/steps/<step:012d>/a<attempt>-<save id>/rank-<r>/obj-<n>   data objects
    <namespace>/<job>/steps/<step:012d>/a<attempt>-<save id>/rank-<r>/MANIFEST  per rank, after its objects
    <namespace>/<job>/steps/<step:012d>/a<attempt>/COMMIT                       job level, create-only
    <namespace>/<job>/EPOCH/<attempt:08d>                                       one per attempt, create-only
    <namespace>/<job>/LATEST                                                    (attempt, step): a hint

Who owns what. The launcher or operator names each gang *generation* (a run
identity and its restart count). Storage allocates the *attempt*: the rank-0
sidecar of a generation creates the next ``EPOCH/<n>`` record (create-only)
naming its generation and the restore step R every rank of it loads. Fencing:
a commit of step s by attempt a is valid only if s <= R_b for every later
attempt b, so a superseded gang (a zombie) can still write, but what it writes
above the new restore step is never read, and a rollback stays rolled back.
COMMIT is attempt-scoped and create-only, so a zombie's void commit never
blocks the new attempt from committing the same step. "Newest" orders valid
commits by (attempt, step): a rollback is a newer attempt.

A step exists for readers only through a valid COMMIT, and readers trust only
the manifests (key and sha256) that COMMIT lists. A differential manifest names
its base by the base's COMMIT key and sha256.

Format 1 (the previous release; read, never written). One COMMIT per step at
``steps/<step:012d>/COMMIT``, no EPOCH records, LATEST ``{"step", "commit"}``, and
manifests that name their bases by step only (no ``base_commit``,
``required_commits`` nor per-tensor ``crc32``). Such a commit reads as attempt
:data:`LEGACY_ATTEMPT`, older than every attempt storage allocates, so the
first attempt of an upgraded job restores the newest format-1 commit and fences
off any format-1 commit above it, like any older attempt's. Its bases are named
by their format-1 COMMIT keys with an empty sha256 (the format recorded none;
the reader trusts that COMMIT as the previous release did).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import re
import secrets
import time
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any

import numpy as np
import xxhash

from sidecar.api import DCP_METADATA_KEY, MAX_STEP, MAX_WORLD_SIZE, RNG_STATE_KEY
from sidecar.errors import (
    Aborted,
    CorruptObject,
    FailedPrecondition,
    NotFound,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
)
from sidecar.store.base import Store

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
#: The oldest format this build reads (format 1: see the module docstring). Never written.
MIN_FORMAT_VERSION = 1
#: The attempt a format-1 commit reads as: older than any attempt storage allocates.
LEGACY_ATTEMPT = -1
#: Matched whole (fullmatch): with re.match, "$" also matches before a trailing newline.
_NAME_RE = re.compile(r"[a-z0-9]([a-z0-9._-]{0,251}[a-z0-9])?")
_STEP_DIR_RE = re.compile(r"/steps/(\d{12})/\Z")
_COMMIT_DIR_RE = re.compile(r"a(\d{4,})/")
_COMMIT_KEY_RE = re.compile(r"/steps/(\d{12})/a(\d{4,})/COMMIT\Z")
_LEGACY_COMMIT_KEY_RE = re.compile(r"/steps/(\d{12})/COMMIT\Z")
_EPOCH_RE = re.compile(r"/EPOCH/(\d{8,})\Z")

# What a reader of a bucket object parses is bounded before it is parsed: a larger or deeper body
# is damage (CorruptObject), never a reason to exhaust memory or recurse (json.loads recurses per
# level). A MANIFEST carries the state tree (the save path admits 128 levels and --max-tree-bytes,
# 16 MiB by default) and an entry per tensor (--max-tensors, 100,000): far below its bounds.
MAX_MANIFEST_BYTES = 512 << 20
MAX_MANIFEST_DEPTH = 512
#: COMMIT (a line per rank, MAX_WORLD_SIZE at most) and EPOCH (a line per earlier attempt).
MAX_RECORD_BYTES = 64 << 20
#: LATEST and the unusable markers: a few fields.
MAX_SMALL_RECORD_BYTES = 1 << 20
#: Every record but a MANIFEST nests a few levels.
MAX_RECORD_DEPTH = 16
#: What nesting depends on: quotes and brackets (escaped quotes and backslashes removed first).
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')


def _nesting(data: bytes, limit: int) -> bool:
    """Whether JSON ``data`` nests deeper than ``limit`` (brackets in strings do not count),
    without parsing it: a few passes at memory speed."""
    if len(data) <= limit:
        return False
    # Inside a string, "\\" and '\"' are the escapes that could hide or fake a quote; any other
    # escaped character is a letter or "/", which the translation drops with the backslash.
    structure = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    chars = np.frombuffer(structure, np.uint8)
    depth, quotes = 0, 0
    for at in range(0, len(chars), 1 << 22):  # in blocks: a few MiB of scratch at most
        block = chars[at : at + (1 << 22)]
        is_quote = block == 0x22
        seen = np.cumsum(is_quote) + quotes  # quotes up to here: odd inside a string
        outside = (seen & 1) == 0
        step = np.where((block == 0x5B) | (block == 0x7B), 1, np.where(is_quote, 0, -1)) * outside
        levels = np.cumsum(step) + depth
        if int(levels.max()) > limit:
            return True
        depth, quotes = int(levels[-1]), int(seen[-1])
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _load_json(
    data: bytes | bytearray | memoryview, key: str, what: str, max_bytes: int, max_depth: int
) -> Any:
    """The JSON value of a bucket object's body, its size and nesting checked before parsing;
    CorruptObject naming ``key`` for anything else than strict JSON within those bounds."""
    body = bytes(data)
    if len(body) > max_bytes:
        raise CorruptObject(key, f"{what} of {len(body)} bytes exceeds the {max_bytes} a reader accepts")
    if _nesting(body, max_depth):
        raise CorruptObject(key, f"{what} nested deeper than {max_depth} levels")
    try:
        return json.loads(body, parse_constant=_no_constant)
    except RecursionError:  # not reached within the bounds above; still damage if it is
        raise CorruptObject(key, f"{what} nested too deeply") from None
    except ValueError as exc:  # invalid JSON or UTF-8, an integer of too many digits
        raise CorruptObject(key, f"not a valid {what} ({exc})") from None


def check_name(kind: str, value: str) -> str:
    """Namespaces and job names become key segments: keep them DNS-label-like."""
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ValueError(f"{kind} {value!r} must be lowercase letters, digits, '.', '_' or '-' (<= 253)")
    return value


def job_prefix(namespace: str, job: str) -> str:
    return f"{check_name('namespace', namespace)}/{check_name('job', job)}/"


def peer_key(store: Store, namespace: str, job: str, create: bool = True) -> bytes:
    """The job's peer key (``<job>/PEER_KEY``, 64 hex digits), created once by whichever sidecar
    needs it first (create-only: every sidecar of the job ends up with the same key). It
    authenticates sidecar-to-sidecar fetches: whoever can read it can read the job's checkpoints
    in storage anyway, so serving them to a holder of the key grants nothing more."""
    key = job_prefix(namespace, job) + "PEER_KEY"
    try:
        body = store.get(key)
    except ObjectNotFound:
        if not create:
            raise
        body = secrets.token_hex(32).encode()
        try:
            store.put(key, body, if_none_match=True)
        except PreconditionFailed:
            body = store.get(key)
    try:
        raw = bytes.fromhex(body.decode())
    except (UnicodeDecodeError, ValueError):
        raw = b""
    if len(raw) != 32:
        raise CorruptObject(key, "not a peer key (64 hex digits)")
    return raw


def step_prefix(namespace: str, job: str, step: int) -> str:
    return f"{job_prefix(namespace, job)}steps/{step:012d}/"


def rank_prefix(namespace: str, job: str, step: int, attempt: int, save_id: str, rank: int) -> str:
    return f"{step_prefix(namespace, job, step)}a{attempt:04d}-{save_id}/rank-{rank}/"


def commit_key(namespace: str, job: str, step: int, attempt: int) -> str:
    if attempt == LEGACY_ATTEMPT:  # format 1: one COMMIT per step (read only)
        return step_prefix(namespace, job, step) + "COMMIT"
    return f"{step_prefix(namespace, job, step)}a{attempt:04d}/COMMIT"


def parse_commit_key(key: str) -> tuple[int, int]:
    """(attempt, step) of a COMMIT key (a format-1 key: LEGACY_ATTEMPT)."""
    m = _COMMIT_KEY_RE.search("/" + key)
    if m:
        return int(m.group(2)), int(m.group(1))
    m = _LEGACY_COMMIT_KEY_RE.search("/" + key)
    if m:
        return LEGACY_ATTEMPT, int(m.group(1))
    raise ValueError(f"{key!r} is not a COMMIT key")


def latest_key(namespace: str, job: str) -> str:
    return job_prefix(namespace, job) + "LATEST"


def epoch_prefix(namespace: str, job: str) -> str:
    return job_prefix(namespace, job) + "EPOCH/"


def epoch_key(namespace: str, job: str, attempt: int) -> str:
    return f"{epoch_prefix(namespace, job)}{attempt:08d}"


def crc32(data: bytes | bytearray | memoryview) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def xxh3(data: bytes | bytearray | memoryview) -> str:
    """The digest new manifests record: XXH3-64, ~5x cheaper than zlib's crc32 per GiB (and it
    releases the GIL), which matters because every save digests every tensor it holds."""
    return xxhash.xxh3_64_hexdigest(data)


def check_digest(entry: TensorEntry | ObjectEntry, data: bytes | bytearray | memoryview) -> str | None:
    """Why ``data`` is not what ``entry`` recorded ("" digest fields: nothing to check), or None.
    Manifests written before XXH3 carry crc32: both are read."""
    if entry.xxh3:
        got = xxh3(data)
        return None if got == entry.xxh3 else f"xxh3 {got} != {entry.xxh3}"
    if entry.crc32:
        got = crc32(data)
        return None if got == entry.crc32 else f"crc32 {got} != {entry.crc32}"
    return None


class Digest:
    """:func:`check_digest` of one object computed piece by piece, in order, as a read lands."""

    def __init__(self, entry: TensorEntry | ObjectEntry) -> None:
        self.entry = entry
        self._xxh3 = xxhash.xxh3_64() if entry.xxh3 else None
        self._crc = 0

    def update(self, piece: bytes | bytearray | memoryview) -> None:
        if self._xxh3 is not None:
            self._xxh3.update(piece)
        elif self.entry.crc32:
            self._crc = zlib.crc32(piece, self._crc)

    def check(self) -> str | None:
        if self._xxh3 is not None:
            got = self._xxh3.hexdigest()
            return None if got == self.entry.xxh3 else f"xxh3 {got} != {self.entry.xxh3}"
        if self.entry.crc32:
            got = f"{self._crc & 0xFFFFFFFF:08x}"
            return None if got == self.entry.crc32 else f"crc32 {got} != {self.entry.crc32}"
        return None


class StreamDigests:
    """What :func:`check_digest` says of each tensor, computed while a buffer's bytes go past in
    order (``update`` with increasing offsets), so the buffer is not read again."""

    def __init__(self, tensors: list[TensorEntry]) -> None:
        self._tensors = sorted(tensors, key=lambda t: t.offset)
        self._state: list[Any] = [xxhash.xxh3_64() if t.xxh3 else 0 for t in self._tensors]
        self._next = 0  # tensors before it are complete

    def update(self, at: int, chunk: bytes | memoryview) -> None:
        view = memoryview(chunk)
        end = at + len(view)
        i = self._next
        while i < len(self._tensors) and self._tensors[i].offset < end:
            t = self._tensors[i]
            lo, hi = max(at, t.offset), min(end, t.offset + t.nbytes)
            if hi > lo:
                piece = view[lo - at : hi - at]
                if t.xxh3:
                    self._state[i].update(piece)
                elif t.crc32:
                    self._state[i] = zlib.crc32(piece, self._state[i])
            if t.offset + t.nbytes > end:
                break
            i += 1
        self._next = i

    def check(self) -> str | None:
        """The first tensor whose bytes differ from their digest ("name: why"), or None."""
        for t, state in zip(self._tensors, self._state, strict=True):
            if t.xxh3 and (got := state.hexdigest()) != t.xxh3:
                return f"{t.name}: xxh3 {got} != {t.xxh3}"
            if not t.xxh3 and t.crc32 and (got := f"{state & 0xFFFFFFFF:08x}") != t.crc32:
                return f"{t.name}: crc32 {got} != {t.crc32}"
        return None


def _fields(cls: type, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of ``raw`` that ``cls`` knows: a later version's new field is not corruption."""
    known = {f.name for f in dataclass_fields(cls)}
    return {k: v for k, v in raw.items() if k in known}


def sha256(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class ObjectEntry:
    key: str
    size: int
    #: the object's digest: crc32 (older manifests) or xxh3 (what this version writes)
    crc32: str = ""
    xxh3: str = ""


@dataclass
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    #: Offset into the concatenation of the manifest's objects.
    offset: int
    #: How the bytes are stored; "raw" is the tensor's bytes as-is (sidecar.pipeline.encode).
    encoding: str = "raw"
    #: Where the stored form sits in the objects' concatenation (-1: at ``offset``, ``nbytes`` long).
    stored_offset: int = -1
    stored_bytes: int = -1
    #: Quantization bit width, or the dtype it was downcast to; lossy when either is set.
    bits: int = 0
    cast: str = ""
    #: Relative L2 error of the lossy encoding (None: lossless).
    rel_l2_error: float | None = None
    #: Rows a diff wrote (-1: not a diff).
    changed_rows: int = -1
    role: str = ""
    #: How a diff found its rows: "lookups" (client tracking), "values" (byte comparison),
    #: "values: tracking missed a row" (a spot check caught an untracked change).
    tracking: str = ""
    #: digest of the tensor's bytes as the trainer saved them: a lossless restore, from memory or
    #: from storage, must reproduce it. crc32 in older manifests, xxh3 from this version on ("":
    #: not recorded).
    crc32: str = ""
    xxh3: str = ""

    def stored(self) -> tuple[int, int]:
        if self.stored_offset < 0:
            return self.offset, self.nbytes
        return self.stored_offset, self.stored_bytes

    @property
    def lossy(self) -> bool:
        return bool(self.bits or self.cast)


@dataclass
class ReplicaEntry:
    """A tensor replicated across a data-parallel group, as one rank of the group saw it: ``owner``
    saved it (the owner's ``tensors`` hold it); ``sample`` digests a fixed sample of this rank's
    own copy, so a replica that diverged from its owner's is caught at commit."""

    name: str
    #: its position in the state tree's flat tensor list
    index: int
    owner: int
    dtype: str
    shape: list[int]
    nbytes: int
    sample: str


@dataclass(frozen=True)
class CommitRef:
    """A committed step, named by its COMMIT's key and the sha256 of its body."""

    key: str
    sha256: str

    @property
    def attempt(self) -> int:
        return parse_commit_key(self.key)[0]

    @property
    def step(self) -> int:
        return parse_commit_key(self.key)[1]


@dataclass
class Manifest:
    namespace: str
    job: str
    step: int
    rank: int
    world_size: int
    attempt: int
    save_id: str
    total_bytes: int
    tree: Any
    tensors: list[TensorEntry]
    objects: list[ObjectEntry]
    created_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    kind: str = "strata.rank-manifest"
    #: "full", or "diff": diff tensors apply on top of ``base_commit`` restored.
    checkpoint: str = "full"
    base_step: int | None = None
    base_commit: CommitRef | None = None
    #: Every older step a restore of this one reads (GC keeps them while this one is kept).
    requires: list[int] = field(default_factory=list)
    required_commits: list[CommitRef] = field(default_factory=list)
    policy: str = ""
    #: Restores the job had seen when this was written (drives bit-width escalation).
    restores: int = 0
    #: Of those, the restores that gave lossy values (storage's form): under --restore-class auto
    #: they drive the escalation. Left out of the record when 0 (older readers refuse the field).
    storage_restores: int = 0
    #: The gang generation that wrote it.
    generation: str = ""
    #: Replicated tensors of the state: the ones another rank owns are not in ``tensors``. A field
    #: older readers ignore (the format stays 2): their restore then lacks those tensors, and the
    #: client refuses it ("does not fit this state") without marking the step unusable.
    replicas: list[ReplicaEntry] = field(default_factory=list)

    @property
    def dcp(self) -> bool:
        """This rank's state carries DCP's global metadata (the coordinator of a save through
        torch.distributed.checkpoint): the checkpoint loads on any number of ranks."""
        root = self.tree.get("root") if isinstance(self.tree, dict) else None
        return isinstance(root, dict) and DCP_METADATA_KEY in root

    def foreign(self) -> list[ReplicaEntry]:
        """The replicated tensors another rank saved (restore fetches them from their owners)."""
        return [r for r in self.replicas if r.owner != self.rank]

    def to_json(self) -> bytes:
        body = asdict(self)
        if not body["storage_restores"]:
            del body["storage_restores"]
        return json.dumps(body, indent=1, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str = "MANIFEST") -> Manifest:
        """A MANIFEST read from ``key``: every field of the type and range a writer writes, its
        objects all in its own rank directory, and that directory the one ``key`` names (when
        ``key`` is a MANIFEST key of the layout); CorruptObject naming the field otherwise."""
        raw = _load_json(data, key, "manifest", MAX_MANIFEST_BYTES, MAX_MANIFEST_DEPTH)
        try:
            if _check_format(raw, "strata.rank-manifest", key) == 1:
                _manifest_from_format1(raw)
            raw["tensors"] = _entries(TensorEntry, raw, "tensors")
            raw["objects"] = _entries(ObjectEntry, raw, "objects")
            raw["replicas"] = _entries(ReplicaEntry, raw, "replicas", required=False)
            if raw.get("base_commit") is not None:
                raw["base_commit"] = _entry(CommitRef, raw["base_commit"], "base_commit")
            raw["required_commits"] = _entries(CommitRef, raw, "required_commits", required=False)
            manifest = cls(**raw)
            manifest._check(key)
            return manifest
        except (TypeError, KeyError, ValueError) as exc:
            raise CorruptObject(key, f"not a valid manifest ({exc})") from None

    def _check(self, key: str) -> None:
        check_name("namespace", self.namespace)
        check_name("job", self.job)
        _whole("step", self.step, 0, MAX_STEP)
        _whole("world_size", self.world_size, 1, MAX_WORLD_SIZE)
        _whole("rank", self.rank, 0, self.world_size - 1)
        _whole("attempt", self.attempt, LEGACY_ATTEMPT)
        _whole("total_bytes", self.total_bytes, 0)
        _whole("restores", self.restores, 0)
        _whole("storage_restores", self.storage_restores, 0, self.restores)
        for name in ("save_id", "policy", "generation"):
            _text(name, getattr(self, name))
        if not self.save_id or "/" in self.save_id:
            raise ValueError(f"save_id {self.save_id!r} is not a key segment")
        _number("created_at", self.created_at)
        if self.checkpoint not in ("full", "diff"):
            raise ValueError(f"checkpoint {self.checkpoint!r} is neither 'full' nor 'diff'")
        if self.base_step is not None:
            _whole("base_step", self.base_step, 0, MAX_STEP)
        if not isinstance(self.requires, list):
            raise ValueError(f"requires {self.requires!r} is not a list")
        for i, required in enumerate(self.requires):
            _whole(f"requires[{i}]", required, 0, MAX_STEP)
        refs = [("base_commit", self.base_commit)] if self.base_commit is not None else []
        refs += [(f"required_commits[{i}]", r) for i, r in enumerate(self.required_commits)]
        for where, ref in refs:
            _commit_ref(where, ref)
        for i, t in enumerate(self.tensors):
            _tensor(f"tensors[{i}]", t)
        for i, replica in enumerate(self.replicas):
            _replica(f"replicas[{i}]", replica, self.world_size)
        home = self._home()
        for i, o in enumerate(self.objects):
            where = f"objects[{i}]"
            _text(f"{where}.key", o.key)
            _whole(f"{where}.size", o.size, 0)
            _text(f"{where}.crc32", o.crc32)
            _text(f"{where}.xxh3", o.xxh3)
            if not _in_dir(home, o.key):
                raise ValueError(
                    f"{where}.key {o.key!r} is not an object of rank {self.rank} of step {self.step} "
                    f"of {self.namespace}/{self.job}"
                )
        if key.endswith("/MANIFEST") and not _in_dir(home, key):
            raise ValueError(
                f"it is the MANIFEST of rank {self.rank} of step {self.step} (attempt {self.attempt}, "
                f"save {self.save_id}) of {self.namespace}/{self.job}, not the one of its key"
            )

    def _home(self) -> re.Pattern[str]:
        """The rank directory this manifest's objects (and the MANIFEST itself) lie in."""
        # Format 1 recorded the attempt its keys spell (read as LEGACY_ATTEMPT): any is its own.
        attempt = r"\d{4,}" if self.attempt == LEGACY_ATTEMPT else f"{self.attempt:04d}"
        return re.compile(
            re.escape(step_prefix(self.namespace, self.job, self.step))
            + f"a{attempt}-{re.escape(self.save_id)}/rank-{self.rank}/"
        )


def _in_dir(home: re.Pattern[str], key: str) -> bool:
    """``key`` names a file directly in ``home`` (no deeper path, no "." or ".." segment)."""
    m = home.match(key)
    rest = key[m.end() :] if m else ""
    return bool(rest) and "/" not in rest and rest not in (".", "..")


def _whole(name: str, value: Any, low: int, high: int = 1 << 63) -> None:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name} {value!r} is not an integer from {low} to {high}")


def _text(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} {value!r} is not a string")


def _number(name: str, value: Any) -> None:
    if type(value) not in (int, float) or value != value:
        raise ValueError(f"{name} {value!r} is not a number")


def _shape(name: str, value: Any) -> None:
    if not isinstance(value, list) or any(type(d) is not int or d < 0 for d in value):
        raise ValueError(f"{name} {value!r} is not a list of sizes")


def _entry(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: {type(raw).__name__} {str(raw)[:64]!r} is not an object")
    try:
        return cls(**_fields(cls, raw))
    except TypeError as exc:  # a field missing
        raise ValueError(f"{where}: {exc}") from None


def _entries(cls: type, raw: dict[str, Any], name: str, required: bool = True) -> list[Any]:
    items = raw[name] if required else raw.get(name, [])
    if not isinstance(items, list):
        raise ValueError(f"{name}: {type(items).__name__} is not a list")
    return [_entry(cls, item, f"{name}[{i}]") for i, item in enumerate(items)]


def _commit_ref(where: str, ref: CommitRef) -> None:
    _text(f"{where}.key", ref.key)
    _text(f"{where}.sha256", ref.sha256)
    try:
        parse_commit_key(ref.key)
    except ValueError:
        raise ValueError(f"{where}.key {ref.key!r} is not a COMMIT key") from None


def _tensor(where: str, t: TensorEntry) -> None:
    for name in ("name", "dtype", "encoding", "cast", "role", "tracking", "crc32", "xxh3"):
        _text(f"{where}.{name}", getattr(t, name))
    where = f"{where} ({t.name[:64]!r})"
    _shape(f"{where}.shape", t.shape)
    _whole(f"{where}.nbytes", t.nbytes, 0)
    _whole(f"{where}.offset", t.offset, 0)
    _whole(f"{where}.stored_offset", t.stored_offset, -1)
    _whole(f"{where}.stored_bytes", t.stored_bytes, -1)
    _whole(f"{where}.bits", t.bits, 0, 64)
    _whole(f"{where}.changed_rows", t.changed_rows, -1)
    if t.rel_l2_error is not None:
        _number(f"{where}.rel_l2_error", t.rel_l2_error)


def _replica(where: str, r: ReplicaEntry, world_size: int) -> None:
    for name in ("name", "dtype", "sample"):
        _text(f"{where}.{name}", getattr(r, name))
    _whole(f"{where}.index", r.index, 0)
    _whole(f"{where}.owner", r.owner, 0, world_size - 1)
    _shape(f"{where}.shape", r.shape)
    _whole(f"{where}.nbytes", r.nbytes, 0)


@dataclass
class ManifestRef:
    rank: int
    key: str
    sha256: str
    size: int


@dataclass
class Commit:
    namespace: str
    job: str
    step: int
    world_size: int
    attempt: int
    total_bytes: int
    manifests: list[ManifestRef]
    committed_at: float = field(default_factory=time.time)
    #: Older steps whose objects this one needs (bases of differential checkpoints); GC keeps them.
    requires: list[int] = field(default_factory=list)
    required_commits: list[CommitRef] = field(default_factory=list)
    generation: str = ""
    format_version: int = FORMAT_VERSION
    kind: str = "strata.commit"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str = "COMMIT") -> Commit:
        raw = _load_json(data, key, "COMMIT", MAX_RECORD_BYTES, MAX_RECORD_DEPTH)
        try:
            if _check_format(raw, "strata.commit", key) == 1:
                _commit_from_format1(raw)
            raw["manifests"] = _entries(ManifestRef, raw, "manifests")
            raw["required_commits"] = _entries(CommitRef, raw, "required_commits", required=False)
            commit = cls(**raw)
            commit._check(key)
            return commit
        except (TypeError, KeyError, ValueError) as exc:
            raise CorruptObject(key, f"not a valid COMMIT ({exc})") from None

    def _check(self, key: str) -> None:
        """Every field holds what a writer could have written, and they agree with each other and
        with the key: a COMMIT damaged anywhere is corrupt (a restore falls back), never a request
        to refuse (a damaged world_size must not read as "saved by another number of ranks")."""

        check_name("namespace", self.namespace)
        check_name("job", self.job)
        _whole("step", self.step, 0, MAX_STEP)
        _whole("attempt", self.attempt, LEGACY_ATTEMPT)
        # Bounded before anything is sized by it (the ranks below, a restore's per-rank state).
        _whole("world_size", self.world_size, 1, MAX_WORLD_SIZE)
        _whole("total_bytes", self.total_bytes, 0)
        _number("committed_at", self.committed_at)
        _text("generation", self.generation)
        if len(self.manifests) != self.world_size or any(m.rank != r for r, m in enumerate(self.manifests)):
            ranks = [m.rank for m in self.manifests[:8]]
            raise ValueError(
                f"world_size {self.world_size} but {len(self.manifests)} manifests, of ranks {ranks}..."
            )
        prefix = step_prefix(self.namespace, self.job, self.step)
        for i, m in enumerate(self.manifests):
            _whole(f"manifests[{i}].size", m.size, 0)
            _text(f"manifests[{i}].sha256", m.sha256)
            if (
                not isinstance(m.key, str)
                or not m.key.startswith(prefix)
                or not m.key.endswith(f"/rank-{m.rank}/MANIFEST")
            ):
                raise ValueError(f"manifest of rank {m.rank} names {m.key!r}, outside step {self.step}")
        if not isinstance(self.requires, list):
            raise ValueError(f"requires {self.requires!r} is not a list")
        for i, r in enumerate(self.requires):
            _whole(f"requires[{i}]", r, 0, MAX_STEP)
        for i, ref in enumerate(self.required_commits):
            _commit_ref(f"required_commits[{i}]", ref)
        try:
            named = parse_commit_key(key)
        except ValueError:
            return  # read from somewhere other than its key (a test, an export)
        if named != (self.attempt, self.step) or key != self.key:
            raise ValueError(
                f"it holds step {self.step} of attempt {self.attempt} of {self.namespace}/{self.job}"
            )

    @property
    def key(self) -> str:
        return commit_key(self.namespace, self.job, self.step, self.attempt)

    def manifest_for(self, rank: int) -> ManifestRef:
        for ref in self.manifests:
            if ref.rank == rank:
                return ref
        raise NotFound(f"COMMIT of step {self.step} lists no manifest for rank {rank}")


def _check_format(raw: Any, kind: str, key: str) -> int:
    """The object's format version, if this build reads it: FORMAT_VERSION, or format 1 for
    the kinds format 1 had (manifests and COMMITs)."""
    if not isinstance(raw, dict) or raw.get("kind") != kind:
        raise ValueError(f"expected kind {kind!r}")
    version = raw.get("format_version")
    readable = range(MIN_FORMAT_VERSION, FORMAT_VERSION + 1) if kind != "strata.epoch" else (FORMAT_VERSION,)
    if type(version) is not int or version not in readable:
        raise CorruptObject(
            key,
            f"format_version {version!r} is not supported (this build reads "
            f"{' and '.join(str(v) for v in readable)}, writes {FORMAT_VERSION}; a newer format needs "
            "a newer sidecar)",
        )
    return version


# --- format 1 (read only) --------------------------------------------------------------------


def _legacy_ref(namespace: str, job: str, step: int) -> dict[str, str]:
    # Format 1 named a base by its step only: its COMMIT, with no digest to check it against.
    return {"key": commit_key(namespace, job, int(step), LEGACY_ATTEMPT), "sha256": ""}


def _manifest_from_format1(raw: dict[str, Any]) -> None:
    """A format-1 manifest's fields as format 2 names them (in place); format_version stays 1."""
    if "base_commit" in raw or "required_commits" in raw:
        raise ValueError("a format-1 manifest with format-2 fields")
    ns, job = raw["namespace"], raw["job"]
    base = raw.get("base_step")
    raw["base_commit"] = None if base is None else _legacy_ref(ns, job, base)
    raw["required_commits"] = [_legacy_ref(ns, job, s) for s in raw.get("requires", [])]
    # Its saves ran outside any attempt storage allocated: never one of a format-2 attempt.
    raw["attempt"] = LEGACY_ATTEMPT


def _commit_from_format1(raw: dict[str, Any]) -> None:
    """A format-1 COMMIT's fields as format 2 names them (in place); format_version stays 1."""
    if "required_commits" in raw:
        raise ValueError("a format-1 COMMIT with format-2 fields")
    raw["required_commits"] = [_legacy_ref(raw["namespace"], raw["job"], s) for s in raw.get("requires", [])]
    raw["attempt"] = LEGACY_ATTEMPT


def is_legacy_key(key: str) -> bool:
    """A format-1 COMMIT key (``steps/<step>/COMMIT``)."""
    return _LEGACY_COMMIT_KEY_RE.search("/" + key) is not None


# --- generations, epochs and fences ----------------------------------------------------------


@dataclass(frozen=True, order=True)
class Generation:
    """A gang generation: the run's identity and its restart count ("RUN/RESTART")."""

    run: str
    restart: int

    @classmethod
    def parse(cls, text: str) -> Generation:
        run, sep, restart = text.strip().rpartition("/")
        if not sep or not run or not restart.isdigit() or len(run) > 200 or any(c.isspace() for c in run):
            raise ValueError(f"generation {text.strip()!r} must look like RUN/RESTART, e.g. 7f3c9a/2")
        return cls(run, int(restart))

    def __str__(self) -> str:
        return f"{self.run}/{self.restart}"


@dataclass
class Epoch:
    """``EPOCH/<attempt>``: an attempt of the job, allocated by storage."""

    attempt: int
    generation: str
    world_size: int
    #: The step (and the attempt that committed it) every rank of this attempt restores;
    #: None when there was nothing to restore.
    restore_step: int | None
    restore_attempt: int | None
    #: every earlier attempt: [[attempt, restore step or null, generation], ...] (the fences)
    history: list[list[Any]] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    kind: str = "strata.epoch"
    #: How the restore step was chosen when the operator asked: "requested" (its one-shot restore
    #: request named the step) or "fresh" (it asked for none); "" for the default, the newest usable
    #: commit. Left out of the record when "", so default records stay readable by older sidecars.
    restore_reason: str = ""
    #: Earlier attempts whose restore step was unknown when this record was written (their own
    #: records were damaged): left out of ``history``, since a guess would drop or invent a fence.
    #: Left out of the record when empty; an older sidecar refuses a record that has it.
    unknown_restores: list[int] = field(default_factory=list)
    #: "exact" when every rank could restore the restore step as its trainer saved it (its own
    #: memory, or a peer's exact copy): every rank then does, lossy tensors included; "" (left out
    #: of the record): every rank restores lossy tensors as storage holds them. One class for the
    #: gang, so replicas never diverge.
    restore_class: str = ""

    def to_json(self) -> bytes:
        body = asdict(self)
        for optional in ("restore_reason", "unknown_restores", "restore_class"):
            if not body[optional]:
                del body[optional]
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str = "EPOCH") -> Epoch:
        raw = _load_json(data, key, "EPOCH record", MAX_RECORD_BYTES, MAX_RECORD_DEPTH)
        try:
            _check_format(raw, "strata.epoch", key)
            epoch = cls(**raw)
            epoch._check()
            return epoch
        except (TypeError, KeyError, ValueError) as exc:
            raise CorruptObject(key, f"not a valid EPOCH record ({exc})") from None

    def _check(self) -> None:
        _whole("attempt", self.attempt, 0)
        _whole("world_size", self.world_size, 0, MAX_WORLD_SIZE)  # 0: unknown (a repaired record)
        _text("generation", self.generation)
        _text("restore_reason", self.restore_reason)
        if self.restore_class not in ("", "exact"):
            raise ValueError(f"restore_class {self.restore_class!r} is neither 'exact' nor empty")
        _number("created_at", self.created_at)
        if self.restore_step is not None:
            _whole("restore_step", self.restore_step, 0, MAX_STEP)
        if self.restore_attempt is not None:
            _whole("restore_attempt", self.restore_attempt, LEGACY_ATTEMPT)
        if not isinstance(self.history, list):
            raise ValueError(f"history {type(self.history).__name__} is not a list")
        for i, h in enumerate(self.history):
            if not isinstance(h, list) or len(h) not in (2, 3):
                raise ValueError(f"history[{i}] {h!r} is not [attempt, restore step, generation]")
            _whole(f"history[{i}] attempt", h[0], 0)
            if h[1] is not None:
                _whole(f"history[{i}] restore step", h[1], 0, MAX_STEP)
            if len(h) > 2:
                _text(f"history[{i}] generation", h[2])

    @property
    def restore(self) -> tuple[int, int] | None:
        if self.restore_step is None or self.restore_attempt is None:
            return None
        return (self.restore_attempt, self.restore_step)


#: entries one holdings report may list (a sidecar holds a few snapshots per rank it serves)
MAX_HOLDINGS = 4096


def holdings_prefix(namespace: str, job: str, generation: str) -> str:
    digest = hashlib.sha256(generation.encode()).hexdigest()[:16]
    return f"{job_prefix(namespace, job)}HOLDS/{digest}/"


def holdings_key(namespace: str, job: str, generation: str, rank: int) -> str:
    return f"{holdings_prefix(namespace, job, generation)}{rank:06d}"


def inexact_key(namespace: str, job: str, position: tuple[int, int]) -> str:
    """``INEXACT/<attempt>-<step>``: some rank could not restore this commit exactly although
    its attempt's EPOCH said every rank could; later attempts restore it in the stored class."""
    return f"{job_prefix(namespace, job)}INEXACT/{position[0]}-{position[1]}"


@dataclass
class Holdings:
    """``HOLDS/<generation>/<rank>``: what the sidecar of ``rank`` holds exactly (as trainers
    saved it) when a generation starts, so rank 0's sidecar can decide the attempt's restore
    class. ``own``: the rank's own committed snapshots ([attempt, step]); ``copies``: other
    ranks' snapshots held as a buddy's copy ([rank, attempt, step]); ``parity``: parity held over
    a group ([[ranks], attempt, step]), which rebuilds a rank exactly when the group's other
    ranks hold their own."""

    generation: str
    rank: int
    own: list[list[int]] = field(default_factory=list)
    copies: list[list[int]] = field(default_factory=list)
    parity: list[list[Any]] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    kind: str = "strata.holdings"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str = "HOLDS") -> Holdings:
        raw = _load_json(data, key, "holdings report", 1 << 20, 8)
        try:
            _check_format(raw, "strata.holdings", key)
            found = cls(**raw)
            found._check()
            return found
        except (TypeError, KeyError, ValueError) as exc:
            raise CorruptObject(key, f"not a valid holdings report ({exc})") from None

    def _check(self) -> None:
        _text("generation", self.generation)
        _whole("rank", self.rank, 0, MAX_WORLD_SIZE)
        for name in ("own", "copies", "parity"):
            entries = getattr(self, name)
            if not isinstance(entries, list) or len(entries) > MAX_HOLDINGS:
                raise ValueError(f"{name} is not a list of at most {MAX_HOLDINGS} entries")
        for e in self.own:
            if not isinstance(e, list) or len(e) != 2:
                raise ValueError(f"own entry {e!r} is not [attempt, step]")
            _whole("own attempt", e[0], LEGACY_ATTEMPT)
            _whole("own step", e[1], 0, MAX_STEP)
        for e in self.copies:
            if not isinstance(e, list) or len(e) != 3:
                raise ValueError(f"copies entry {e!r} is not [rank, attempt, step]")
            _whole("copies rank", e[0], 0, MAX_WORLD_SIZE)
            _whole("copies attempt", e[1], LEGACY_ATTEMPT)
            _whole("copies step", e[2], 0, MAX_STEP)
        for e in self.parity:
            if not isinstance(e, list) or len(e) != 3 or not isinstance(e[0], list) or len(e[0]) > 256:
                raise ValueError(f"parity entry {e!r} is not [[ranks], attempt, step]")
            for r in e[0]:
                _whole("parity rank", r, 0, MAX_WORLD_SIZE)
            _whole("parity attempt", e[1], LEGACY_ATTEMPT)
            _whole("parity step", e[2], 0, MAX_STEP)


def about(report: Holdings, target: tuple[int, int]) -> Holdings:
    """``report`` with only its entries about commit ``target``: what the decision needs, so a
    gang's reports (up to 1 MiB each) are never all held whole."""
    attempt, step = target
    return Holdings(
        report.generation,
        report.rank,
        [e for e in report.own if e == [attempt, step]],
        [e for e in report.copies if e[1:] == [attempt, step]],
        [e for e in report.parity if (e[1], e[2]) == target],
    )


def exact_everywhere(world_size: int, target: tuple[int, int], reports: dict[int, Holdings]) -> bool:
    """Whether every rank of a gang of ``world_size`` can restore ``target`` exactly, by the
    reports of its ranks' sidecars: from its own memory, a buddy's copy, or parity over a group
    whose other ranks hold their own."""
    attempt, step = target
    own = {r for r, h in reports.items() if [attempt, step] in h.own}
    covered = set(own)

    def holds_parity_of(rank: int, lost: int) -> bool:
        found = reports.get(rank)
        return found is not None and any((a, s) == target and lost in ranks for ranks, a, s in found.parity)

    for holder, h in reports.items():
        covered.update(e[0] for e in h.copies if e[1:] == [attempt, step])
        for ranks, a, s in h.parity:
            if (a, s) != target:
                continue
            # a holder's parity lists the other members of its group
            group = set(ranks) | {holder}
            missing = group - own
            if len(missing) != 1:  # XOR rebuilds one lost member's share, no more
                continue
            (lost,) = missing
            # the rebuild XORs the parity every other member of the group holds: all of it
            if all(holds_parity_of(r, lost) for r in group - missing):
                covered.add(lost)
    return all(r in covered for r in range(world_size))


@dataclass
class Fences:
    """Every attempt's restore step, as of the newest epoch read: which commits are valid."""

    #: attempt -> its restore step (None: it restored nothing)
    restores: dict[int, int | None] = field(default_factory=dict)
    newest: Epoch | None = None
    #: attempt -> the generation it ran, for every attempt before the newest
    generations: dict[int, str] = field(default_factory=dict)
    #: attempt -> why its record is unreadable (newer than ``newest``, or one ``newest`` carries
    #: as unknown): its number is taken
    damaged: dict[int, str] = field(default_factory=dict)
    #: attempts whose restore step is unknown (a damaged record, now or when a later record was
    #: written): :meth:`valid` takes them to fence nothing off (every checkpoint stays listed and
    #: restorable by step), and :func:`newest_valid` never picks a commit they may have fenced
    unknown: set[int] = field(default_factory=set)

    @property
    def newest_attempt(self) -> int:
        return max(-1 if self.newest is None else self.newest.attempt, max(self.damaged, default=-1))

    def floor(self, attempt: int) -> int | None:
        """The largest step attempt ``attempt`` may have validly committed (None: no bound)."""
        bound: int | None = None
        for b, r in self.restores.items():
            if b > attempt:
                r = -1 if r is None else r
                bound = r if bound is None else min(bound, r)
        return bound

    def valid(self, attempt: int, step: int) -> bool:
        bound = self.floor(attempt)
        return bound is None or step <= bound

    def superseded(self, attempt: int) -> bool:
        return self.newest_attempt > attempt


def read_fences(store: Store, namespace: str, job: str, known: Fences | None = None) -> Fences:
    """The fences as of the newest epoch: one LIST (after the newest known record), plus one
    GET when there is a newer record (it carries the history of all earlier ones).

    A damaged newest record (it does not parse, or names another attempt) does not make the job
    unreadable: the fences come from the newest record before it that reads, the damaged
    attempt's own restore step is unknown (:attr:`Fences.unknown`), and the record is reported
    (:attr:`Fences.damaged`, a warning naming ``strata repair-epoch``). The next attempt's record
    carries that history on, the damaged attempt as unknown (until its record is repaired). A
    record of a newer format is no damage: it still raises."""
    start_after = (
        None if known is None or known.newest is None else epoch_key(namespace, job, known.newest.attempt)
    )
    listing = store.list(epoch_prefix(namespace, job), start_after=start_after)
    numbered = [(int(m.group(1)), o.key) for o in listing.objects if (m := _EPOCH_RE.search("/" + o.key))]
    if not numbered:
        return known if known is not None else Fences()
    damaged: dict[int, str] = {}
    fences = None
    for attempt, key in sorted(numbered, reverse=True):
        try:
            epoch = _read_epoch(store, key, attempt)
        except CorruptObject as exc:
            if getattr(exc, "newer_format", False):
                raise
            damaged[attempt] = str(exc)
            continue
        restores: dict[int, int | None] = {int(h[0]): h[1] for h in epoch.history}
        generations = {int(h[0]): str(h[2]) for h in epoch.history if len(h) > 2}
        restores[epoch.attempt] = epoch.restore_step
        fences = Fences(restores, epoch, generations, unknown=set(epoch.unknown_restores))
        for u in sorted(fences.unknown):  # repaired since this record was written?
            fences.restores.pop(u, None)
            try:
                earlier = _read_epoch(store, epoch_key(namespace, job, u), u)
            except CorruptObject as exc:
                damaged[u] = str(exc)
            except ObjectNotFound:
                damaged[u] = "the record is missing"
            else:
                fences.unknown.discard(u)
                fences.restores[u] = earlier.restore_step
                fences.generations[u] = earlier.generation
        break
    if fences is None:
        base = known if known is not None else Fences()
        fences = Fences(dict(base.restores), base.newest, dict(base.generations), unknown=set(base.unknown))
        damaged = {**base.damaged, **damaged}
    fences.unknown |= set(damaged)
    if damaged:
        fences.damaged = damaged
        _report_damaged(namespace, job, fences)
    return fences


def _read_epoch(store: Store, key: str, attempt: int) -> Epoch:
    body = store.get(key)
    try:
        epoch = Epoch.from_json(body, key)
    except CorruptObject as exc:
        try:
            version = _load_json(body, key, "EPOCH record", MAX_RECORD_BYTES, MAX_RECORD_DEPTH).get(
                "format_version"
            )
        except (CorruptObject, AttributeError):
            version = None
        # A newer sidecar's record is no damage: its fences cannot be guessed around.
        exc.newer_format = type(version) is int and version > FORMAT_VERSION  # type: ignore[attr-defined]
        raise
    if epoch.attempt != attempt or not isinstance(epoch.history, list):
        raise CorruptObject(key, f"EPOCH record says attempt {epoch.attempt}")
    unknown = epoch.unknown_restores
    if not isinstance(unknown, list) or any(type(u) is not int or not 0 <= u < attempt for u in unknown):
        raise CorruptObject(key, f"not a valid EPOCH record (unknown_restores: {unknown!r})")
    try:
        for h in epoch.history:
            int(h[0])
            if h[1] is not None and type(h[1]) is not int:
                raise TypeError(f"restore step {h[1]!r}")
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise CorruptObject(key, f"not a valid EPOCH record (history: {exc})") from None
    return epoch


_reported_damage: set[str] = set()


def _report_damaged(namespace: str, job: str, fences: Fences) -> None:
    """Warn once per process and record of each damaged EPOCH record, with the repair command."""
    for attempt, why in sorted(fences.damaged.items()):
        key = epoch_key(namespace, job, attempt)
        if key in _reported_damage:
            continue
        _reported_damage.add(key)
        log.error("%s/%s: %s", namespace, job, damaged_epoch_text(namespace, job, attempt, why))


def epoch_damage(store: Store, namespace: str, job: str, attempt: int) -> str | None:
    """Why the EPOCH record of ``attempt`` does not read, or None (it reads)."""
    key = epoch_key(namespace, job, attempt)
    try:
        _read_epoch(store, key, attempt)
    except CorruptObject as exc:
        return str(exc)
    return None


def damaged_epoch_text(namespace: str, job: str, attempt: int, why: str) -> str:
    return (
        f"EPOCH record of attempt {attempt} is damaged ({why}); the fences come from the records "
        f"before it and every checkpoint stays reachable. Repair it with: strata repair-epoch "
        f"--namespace {namespace} --job {job} --attempt {attempt} --restore-step <the step that "
        "attempt restored, or none> (with --storage/--s3-endpoint)"
    )


def create_epoch(
    store: Store,
    namespace: str,
    job: str,
    generation: Generation,
    world_size: int,
    restore: tuple[int, int] | None,
    fences: Fences,
    reason: str = "",
    restore_class: str = "",
) -> Epoch:
    """Create the next EPOCH record (create-only) naming ``generation`` and its restore point
    (and ``reason``, how it was chosen: see :attr:`Epoch.restore_reason`).

    Raises PreconditionFailed when another writer took that number first: the caller
    re-reads the fences and decides again.
    """
    attempt = fences.newest_attempt + 1
    if fences.newest_attempt < 0:  # a job's first EPOCH: above any save a format-1 release left
        attempt = max(attempt, _legacy_attempt_floor(store, namespace, job, restore))
    names = dict(fences.generations)
    if fences.newest is not None:
        names[fences.newest.attempt] = fences.newest.generation
    history: list[list[Any]] = [
        [a, r, names.get(a, "")] for a, r in sorted(fences.restores.items()) if a not in fences.unknown
    ]
    epoch = Epoch(
        attempt,
        str(generation),
        world_size,
        None if restore is None else restore[1],
        None if restore is None else restore[0],
        history,
        restore_reason=reason,
        # a damaged record's fence is carried on as unknown, never dropped
        unknown_restores=sorted(fences.unknown),
        restore_class=restore_class if restore is not None else "",
    )
    store.put(epoch_key(namespace, job, attempt), epoch.to_json(), if_none_match=True)
    log.info(
        "%s/%s: attempt %d for generation %s restores %s",
        namespace,
        job,
        attempt,
        generation,
        "nothing" if restore is None else f"step {restore[1]} (attempt {restore[0]})",
    )
    return epoch


def repair_epoch(
    store: Store,
    namespace: str,
    job: str,
    attempt: int,
    restore: tuple[int, int] | None,
    fences: Fences,
    generation: str,
) -> Epoch:
    """Overwrite the damaged record of ``attempt``: the history of every attempt before it, as
    the readable records tell (``fences``), and ``restore``, the step it restored."""
    if epoch_damage(store, namespace, job, attempt) is None:
        raise ValueError(f"the EPOCH record of attempt {attempt} is not damaged")
    names = dict(fences.generations)
    if fences.newest is not None:
        names[fences.newest.attempt] = fences.newest.generation
    history: list[list[Any]] = [
        [a, r, names.get(a, "")]
        for a, r in sorted(fences.restores.items())
        if a < attempt and a not in fences.unknown
    ]
    epoch = Epoch(
        attempt,
        generation,
        0,
        None if restore is None else restore[1],
        None if restore is None else restore[0],
        history,
        restore_reason="requested",
        unknown_restores=sorted(u for u in fences.unknown if u < attempt),
    )
    store.put(epoch_key(namespace, job, attempt), epoch.to_json())
    _reported_damage.discard(epoch_key(namespace, job, attempt))
    log.warning("%s/%s: rewrote the damaged EPOCH record of attempt %d", namespace, job, attempt)
    return epoch


def _legacy_attempt_floor(store: Store, namespace: str, job: str, restore: tuple[int, int] | None) -> int:
    """One past the highest attempt a format-1 release named in save directories of steps above
    ``restore``: the new attempt saves only such steps, and a save directory of the same attempt
    number must not look like one of its own to :func:`step_state`. One LIST for a new job."""
    floor = 0
    after = -1 if restore is None else restore[1]
    for step in _step_dirs(store, namespace, job):
        if step <= after:
            continue
        prefix = step_prefix(namespace, job, step)
        for obj in store.list(prefix).objects:
            head = obj.key[len(prefix) :].split("/", 1)[0]
            m = re.fullmatch(r"a(\d{4,})-.+", head)
            if m:
                floor = max(floor, int(m.group(1)) + 1)
    return floor


# --- commit protocol -------------------------------------------------------------------------


def write_manifest(store: Store, prefix: str, manifest: Manifest) -> ManifestRef:
    """Written after every object of the rank, so its presence means the data is whole."""
    body = manifest.to_json()
    key = prefix + "MANIFEST"
    if len(body) > MAX_MANIFEST_BYTES:  # no reader would take it: fail the save, not a restore
        raise FailedPrecondition(
            f"the MANIFEST of rank {manifest.rank} would be {len(body)} bytes, over the "
            f"{MAX_MANIFEST_BYTES} readers accept (fewer tensors or a smaller state tree)"
        )
    store.put(key, body)
    return ManifestRef(manifest.rank, key, sha256(body), len(body))


def skip_key(namespace: str, job: str, step: int, attempt: int, rank: int) -> str:
    """Marker a rank leaves when it will not save this step, so the commit fails at once."""
    return f"{step_prefix(namespace, job, step)}a{attempt:04d}-skip/rank-{rank}/SKIPPED"


@dataclass
class StepState:
    committed: bool
    manifests: dict[int, str]  # rank -> MANIFEST key of the attempt
    skipped: list[int]  # ranks that reported they will not save the step


def step_state(store: Store, namespace: str, job: str, step: int, attempt: int) -> StepState:
    """What the commit protocol needs about one step of one attempt, in one LIST (the slow
    fallback when hints from other sidecars do not arrive)."""
    prefix = step_prefix(namespace, job, step)
    state = StepState(False, {}, [])
    for obj in store.list(prefix).objects:
        rest = obj.key[len(prefix) :].split("/")
        if rest == [f"a{attempt:04d}", "COMMIT"]:
            state.committed = True
        elif len(rest) == 3 and rest[0].startswith(f"a{attempt:04d}-") and rest[1].startswith("rank-"):
            rank = int(rest[1].removeprefix("rank-"))
            if rest[2] == "MANIFEST":
                # Several saves of one step in one attempt: the newest key wins (keys are unique per save).
                state.manifests[rank] = max(state.manifests.get(rank, ""), obj.key)
            elif rest[2] == "SKIPPED":
                state.skipped.append(rank)
    return state


def build_commit(
    namespace: str,
    job: str,
    step: int,
    world_size: int,
    attempt: int,
    manifests: dict[int, tuple[str, bytes]],
    generation: str = "",
) -> Commit:
    """The COMMIT listing ``manifests`` (rank -> (key, body as stored)), checked for consistency."""
    refs: list[ManifestRef] = []
    requires: set[int] = set()
    required: dict[str, CommitRef] = {}
    parsed: dict[int, Manifest] = {}
    total = 0
    for rank in range(world_size):
        key, body = manifests[rank]
        manifest = Manifest.from_json(body, key)
        if (manifest.step, manifest.rank, manifest.attempt) != (step, rank, attempt):
            raise FailedPrecondition(
                f"step {step}: {key} holds step {manifest.step} rank {manifest.rank} "
                f"attempt {manifest.attempt}, not rank {rank} of attempt {attempt}"
            )
        if manifest.world_size != world_size:
            raise FailedPrecondition(
                f"step {step}: rank {rank} saved with world size {manifest.world_size}, expected {world_size}"
            )
        parsed[rank] = manifest
        total += manifest.total_bytes
        requires.update(manifest.requires)
        required.update((r.key, r) for r in manifest.required_commits)
        refs.append(ManifestRef(rank, key, sha256(body), len(body)))
    check_replicas(step, parsed)
    return Commit(
        namespace,
        job,
        step,
        world_size,
        attempt,
        total,
        refs,
        requires=sorted(requires),
        required_commits=sorted(required.values(), key=lambda r: r.key),
        generation=generation,
    )


def replicated(manifests: list[Manifest]) -> bool:
    """Every rank of a commit (two or more) saved the same state: each tensor is replicated across
    all of them (one owner stores it, every other rank names that owner), and the trees are equal,
    save for the client's RNG states (each rank's own) and empty tensors. Such a checkpoint loads
    on any number of ranks (``client.resume()`` gives every rank the owners' tensors)."""
    if len(manifests) < 2:
        return False

    def plain(tree: Any) -> Any:
        root = tree.get("root") if isinstance(tree, dict) else None
        if not isinstance(root, dict):
            return tree
        return {**tree, "root": {k: v for k, v in root.items() if k != RNG_STATE_KEY}}

    first = plain(manifests[0].tree)
    if any(plain(m.tree) != first for m in manifests[1:]):
        return False
    owners = [{r.name: r.owner for r in m.replicas} for m in manifests]
    for m in manifests:
        for t in m.tensors:
            if t.name.startswith(f"{RNG_STATE_KEY}.") or 0 in t.shape:
                continue
            if any(named.get(t.name) != m.rank for named in owners):
                return False
    return True


def check_replicas(step: int, manifests: dict[int, Manifest]) -> None:
    """Every replicated tensor of the step is held by its owner, as every rank declared it, and every
    rank's sampled copy equals the owner's; else Aborted naming the ranks and tensors (a replica that
    diverged is a training bug: committing the owner's copy for everyone would hide it)."""
    problems: list[str] = []
    held_by = {rank: {t.name: t for t in m.tensors} for rank, m in manifests.items()}
    declared_by = {rank: {r.name: r for r in m.replicas} for rank, m in manifests.items()}
    for rank, manifest in sorted(manifests.items()):
        for r in manifest.replicas:
            if r.owner not in manifests:
                problems.append(f"rank {rank} says rank {r.owner} saves {r.name}, outside the job")
                continue
            held = held_by[r.owner].get(r.name)
            theirs = declared_by[r.owner].get(r.name)
            if held is None or (theirs is not None and theirs.owner != r.owner):
                problems.append(f"rank {rank} says rank {r.owner} saves {r.name}, but rank {r.owner} did not")
            elif (held.dtype, list(held.shape)) != (r.dtype, list(r.shape)):
                problems.append(
                    f"{r.name}: rank {rank} holds {r.dtype}{list(r.shape)}, its owner rank {r.owner} "
                    f"saved {held.dtype}{list(held.shape)}"
                )
            elif theirs is None:
                continue  # the owner saved everything (a sidecar without replica support): nothing to compare
            elif theirs.sample != r.sample:
                problems.append(
                    f"{r.name}: rank {rank}'s replica differs from its owner rank {r.owner}'s (sampled "
                    f"digest {r.sample} != {theirs.sample})"
                )
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise Aborted(
            f"replicated tensors of step {step} disagree across the data-parallel group "
            f"({shown}). The replicas diverged (a data-parallel bug: ranks updated them differently), "
            "or the ranks declared different replication (or run sidecars of different versions)"
        )


def put_commit(store: Store, commit: Commit) -> CommitRef:
    """Write COMMIT create-only. A 412 is fine when the object there is this very commit (a
    retried PUT whose first attempt succeeded); anything else there raises PreconditionFailed."""
    body = commit.to_json()
    key = commit.key
    try:
        store.put(key, body, if_none_match=True)
    except PreconditionFailed:
        try:
            there = Commit.from_json(store.get(key), key)
        except (ObjectNotFound, CorruptObject):
            raise PreconditionFailed(f"{key} exists and is not readable as a COMMIT") from None
        if there.manifests != commit.manifests:
            raise PreconditionFailed(f"{key} was already written by another writer") from None
        body = store.get(key)
    return CommitRef(key, sha256(body))


def write_commit(
    store: Store,
    namespace: str,
    job: str,
    step: int,
    world_size: int,
    attempt: int,
    state: StepState | None = None,
) -> Commit:
    """Write the job-level COMMIT once every rank's MANIFEST of the attempt exists (found by
    LIST), then advance LATEST. Raises FailedPrecondition while ranks are missing and Aborted
    when a rank that has no MANIFEST reported it will not save the step."""
    state = state or step_state(store, namespace, job, step, attempt)
    missing = sorted(set(range(world_size)) - set(state.manifests))
    skipped = sorted(set(state.skipped) & set(missing))  # a MANIFEST wins over a skip marker
    if skipped:
        raise Aborted(f"step {step} cannot commit: rank(s) {skipped} did not save it")
    if missing:
        raise FailedPrecondition(f"step {step}: no MANIFEST yet for ranks {missing}")
    bodies = {r: (state.manifests[r], store.get(state.manifests[r])) for r in range(world_size)}
    commit = build_commit(namespace, job, step, world_size, attempt, bodies)
    put_commit(store, commit)
    advance_latest(store, namespace, job, attempt, step)
    return commit


def advance_latest(store: Store, namespace: str, job: str, attempt: int, step: int, etag: str = "") -> str:
    """Move LATEST forward to (attempt, step) with compare-and-swap; never backward.

    ``etag``: LATEST's ETag as this writer last left it (saves a GET when nobody else wrote
    since). Returns LATEST's ETag afterwards ("" when it was left alone)."""
    key = latest_key(namespace, job)
    body = json.dumps(
        {"attempt": attempt, "step": step, "commit": commit_key(namespace, job, step, attempt)}
    ).encode()
    for _ in range(8):
        if etag:
            try:
                return store.put(key, body, if_match=etag)
            except PreconditionFailed:
                etag = ""  # someone else wrote it: read and compare
                continue
        try:
            current, etag = store.get_versioned(key)
        except ObjectNotFound:
            try:
                return store.put(key, body, if_none_match=True)
            except PreconditionFailed:
                continue
        here = _latest_position(current)
        if here is not None and here >= (attempt, step):
            return ""
    log.warning("%s/%s: LATEST contended; left as it is (a hint: discovery verifies it)", namespace, job)
    return ""


def _latest_position(body: bytes) -> tuple[int, int] | None:
    try:
        raw = _load_json(body, "LATEST", "LATEST", MAX_SMALL_RECORD_BYTES, MAX_RECORD_DEPTH)
        if "attempt" not in raw and is_legacy_key(str(raw.get("commit", ""))):
            return (LEGACY_ATTEMPT, int(raw["step"]))  # format 1's LATEST: {"step", "commit"}
        return (int(raw["attempt"]), int(raw["step"]))
    except (CorruptObject, ValueError, KeyError, TypeError, AttributeError):
        return None


def read_commit_at(store: Store, key: str) -> tuple[Commit, str]:
    """The COMMIT at ``key`` and the sha256 of its body."""
    body = store.get(key)
    return Commit.from_json(body, key), sha256(body)


def load_ref(store: Store, ref: CommitRef) -> Commit:
    """The COMMIT a reference names, checked against its sha256."""
    body = store.get(ref.key)
    # Format 1 recorded no digest of a base's COMMIT (and only format 1 wrote such keys).
    unchecked = not ref.sha256 and is_legacy_key(ref.key)
    if not unchecked and sha256(body) != ref.sha256:
        raise CorruptObject(ref.key, "sha256 differs from the one the referring manifest recorded")
    return Commit.from_json(body, ref.key)


def _step_dirs(store: Store, namespace: str, job: str, start_after: str | None = None) -> list[int]:
    listing = store.list(job_prefix(namespace, job) + "steps/", delimiter="/", start_after=start_after)
    steps = []
    for p in listing.prefixes:
        m = _STEP_DIR_RE.search("/" + p)
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


def step_commits(store: Store, namespace: str, job: str, step: int) -> list[int]:
    """Attempts that wrote a COMMIT of ``step`` (valid or not): one LIST for the commit
    directories ``a<attempt>/`` (they hold nothing but the COMMIT), then a HEAD of each, since
    some stores (SeaweedFS) keep a directory after its last object is deleted. A format-1
    COMMIT (an object right in the step directory) counts as LEGACY_ATTEMPT."""
    prefix = step_prefix(namespace, job, step)
    listing = store.list(prefix, delimiter="/")
    out = []
    if any(o.key == prefix + "COMMIT" for o in listing.objects):
        out.append(LEGACY_ATTEMPT)
    for p in listing.prefixes:
        m = _COMMIT_DIR_RE.fullmatch(p[len(prefix) :])
        if m and store.head(commit_key(namespace, job, step, int(m.group(1)))) is not None:
            out.append(int(m.group(1)))
    return sorted(out)


def valid_commits(
    store: Store, namespace: str, job: str, fences: Fences | None = None
) -> list[tuple[int, int]]:
    """Every valid commit as (attempt, step), oldest first: a full listing, for ls, retention
    and fallbacks, not the restart path."""
    fences = fences if fences is not None else read_fences(store, namespace, job)
    out: list[tuple[int, int]] = []
    for step in _step_dirs(store, namespace, job):
        out.extend((a, step) for a in step_commits(store, namespace, job, step) if fences.valid(a, step))
    return sorted(out)


def committed_steps(store: Store, namespace: str, job: str, fences: Fences | None = None) -> list[int]:
    """Steps with a valid commit, oldest first (a full listing)."""
    return sorted({s for _, s in valid_commits(store, namespace, job, fences)})


def unusable_prefix(namespace: str, job: str) -> str:
    return job_prefix(namespace, job) + "UNUSABLE/"


#: Why a rank could not restore a commit (a marker's ``cause``): "missing", an object it names
#: stayed missing after retries (a bucket that lost it, or one whose listing lags); "corrupt", an
#: object it names differs from what was committed (size, digest, or a body that does not parse);
#: "unknown", a marker of an older release (its body is only the reason text).
MARKER_CAUSES = ("missing", "corrupt", "unknown")
_MARKER_RE = re.compile(r"/(\d{12})-(?:a(\d{4,})|v1)\Z")


@dataclass
class UnusableMarker:
    """``UNUSABLE/<step>-a<attempt>``: some rank could not restore that commit, so no later attempt
    restores it, until an operator clears the marker (``strata markers --clear``)."""

    attempt: int
    step: int
    cause: str
    detail: str
    #: who wrote it: the rank, its generation and the sidecar (host, process)
    by: str = ""
    at: float = 0.0
    key: str = ""

    @property
    def position(self) -> tuple[int, int]:
        return (self.attempt, self.step)

    def describe(self) -> str:
        who = f"; marked by {self.by}" if self.by else ""
        when = f" at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(self.at))}" if self.at else ""
        return f"step {self.step} (attempt {self.attempt}) {self.cause}: {self.detail}{who}{when}"


def _marker_key(namespace: str, job: str, position: tuple[int, int]) -> str:
    attempt, step = position
    tag = "v1" if attempt == LEGACY_ATTEMPT else f"a{attempt:04d}"
    return f"{unusable_prefix(namespace, job)}{step:012d}-{tag}"


def mark_unusable(
    store: Store,
    namespace: str,
    job: str,
    position: tuple[int, int],
    reason: str,
    cause: str = "corrupt",
    by: str = "",
) -> bool:
    """Record that a rank could not restore (attempt, step), why (``cause``: see MARKER_CAUSES)
    and who found it: no later attempt restores it, and each says so. False when the write
    failed (logged)."""
    if cause not in MARKER_CAUSES:
        raise ValueError(f"marker cause {cause!r} is not one of {MARKER_CAUSES}")
    body = {
        "kind": "strata.unusable",
        "cause": cause,
        "detail": reason[:4096],
        "by": by[:256],
        "at": time.time(),
    }
    try:
        store.put(_marker_key(namespace, job, position), json.dumps(body, sort_keys=True).encode())
    except StorageError as exc:
        log.warning("could not mark step %d unusable: %s", position[1], exc)
        return False
    return True


def _parse_marker(key: str, body: bytes) -> UnusableMarker | None:
    m = _MARKER_RE.search("/" + key)
    if not m:
        return None
    attempt = LEGACY_ATTEMPT if m.group(2) is None else int(m.group(2))
    step = int(m.group(1))
    try:
        raw = _load_json(body, key, "marker", MAX_SMALL_RECORD_BYTES, MAX_RECORD_DEPTH)
    except CorruptObject:
        raw = None
    if isinstance(raw, dict) and raw.get("kind") == "strata.unusable":
        cause = raw.get("cause")
        at = raw.get("at")
        return UnusableMarker(
            attempt,
            step,
            cause if cause in MARKER_CAUSES else "unknown",
            str(raw.get("detail", "")),
            str(raw.get("by", "")),
            float(at) if isinstance(at, (int, float)) and at == at else 0.0,
            key,
        )
    # An older release's marker: the reason as text.
    return UnusableMarker(attempt, step, "unknown", body.decode("utf-8", "replace")[:4096], "", 0.0, key)


def unusable_markers(store: Store, namespace: str, job: str) -> list[UnusableMarker]:
    """Every marker of the job, oldest commit first (one LIST, normally empty, and a GET each)."""
    out = []
    for o in store.list(unusable_prefix(namespace, job)).objects:
        if not _MARKER_RE.search("/" + o.key):
            continue
        try:
            body = store.get(o.key)
        except ObjectNotFound:
            continue  # cleared meanwhile
        marker = _parse_marker(o.key, body)
        if marker is not None:
            out.append(marker)
    return sorted(out, key=lambda mk: mk.position)


def clear_markers(
    store: Store, namespace: str, job: str, steps: set[int] | None = None
) -> list[UnusableMarker]:
    """Delete the markers of ``steps`` (None: all): their commits are restorable again. Returns
    what was cleared."""
    gone = [mk for mk in unusable_markers(store, namespace, job) if steps is None or mk.step in steps]
    if gone:
        store.delete([mk.key for mk in gone])
    return gone


def unusable_commits(store: Store, namespace: str, job: str) -> set[tuple[int, int]]:
    """Commits some rank failed to restore (one LIST, normally empty)."""
    out = set()
    for o in store.list(unusable_prefix(namespace, job)).objects:
        m = _MARKER_RE.search("/" + o.key)
        if m:
            attempt = LEGACY_ATTEMPT if m.group(2) is None else int(m.group(2))
            out.add((attempt, int(m.group(1))))
    return out


def newest_valid(
    store: Store,
    namespace: str,
    job: str,
    fences: Fences | None = None,
    exclude: set[tuple[int, int]] | frozenset[tuple[int, int]] = frozenset(),
) -> tuple[int, int] | None:
    """The newest valid commit, (attempt, step), in a constant number of requests: GET LATEST,
    one LIST of newer step directories, one LIST per newer step, one HEAD of LATEST's COMMIT.
    A full listing only when LATEST is missing, unreadable or names a void commit."""
    fences = fences if fences is not None else read_fences(store, namespace, job)
    if fences.unknown:
        return _newest_across_unknown(store, namespace, job, fences, exclude)
    try:
        hint = _latest_position(store.get(latest_key(namespace, job)))
    except ObjectNotFound:
        log.info("%s/%s: LATEST missing; scanning all steps", namespace, job)
        hint = None
    else:
        if hint is None:
            log.warning("%s/%s: LATEST is unreadable; scanning all steps", namespace, job)
    if hint is not None and fences.valid(*hint) and hint not in exclude:
        newer = [
            (a, s)
            for s in _step_dirs(store, namespace, job, start_after=step_prefix(namespace, job, hint[1]))
            if s > hint[1]  # the hint's own directory rolls up after its prefix too
            for a in step_commits(store, namespace, job, s)
            if a >= hint[0] and fences.valid(a, s) and (a, s) not in exclude
        ]
        if newer:
            return max(newer)
        if store.head(commit_key(namespace, job, hint[1], hint[0])) is not None:
            return hint
        log.warning("%s/%s: LATEST names step %d without a COMMIT; scanning", namespace, job, hint[1])
    elif hint is not None:
        log.info("%s/%s: LATEST names a fenced-off or unusable commit; scanning", namespace, job)
    found = [p for p in valid_commits(store, namespace, job, fences) if p not in exclude]
    return max(found) if found else None


def _newest_across_unknown(
    store: Store,
    namespace: str,
    job: str,
    fences: Fences,
    exclude: set[tuple[int, int]] | frozenset[tuple[int, int]],
) -> tuple[int, int] | None:
    """:func:`newest_valid` when an attempt's restore step is unknown (its EPOCH record is
    damaged). Attempt U saved only steps above its restore step, and every later attempt's fence
    bounds what came before it too: a valid commit of U or a later attempt is newer than anything
    U kept valid, so the newest of those is the pick. Without one, the newest older commit may be
    one U fenced off (a rollback): refused, naming the record and its repair, rather than guessed.
    The restore step is not recoverable from U's own saves (their records name no restore step)."""
    top = max(fences.unknown)
    found = [p for p in valid_commits(store, namespace, job, fences) if p not in exclude]
    if not found or max(found)[0] >= top:
        return max(found) if found else None
    newest = max(found)
    key = epoch_key(namespace, job, top)
    why = fences.damaged.get(top, "unreadable when a later record was written").removeprefix(
        f"corrupt object {key}: "
    )
    raise CorruptObject(
        key,
        f"the EPOCH record of attempt {top} is damaged ({why}) and that attempt committed no usable "
        f"step: step {newest[1]} (attempt {newest[0]}) may be one it fenced off (a rollback), so no "
        f"step is picked automatically. Repair the record with: strata repair-epoch --namespace "
        f"{namespace} --job {job} --attempt {top} --restore-step <the step that attempt restored, or "
        "none> (with --storage/--s3-endpoint), or restore an explicit step; `strata ls` lists them",
    )


def newest_committed(store: Store, namespace: str, job: str) -> int | None:
    """The step of the newest valid commit."""
    found = newest_valid(store, namespace, job)
    return None if found is None else found[1]


def read_commit(store: Store, namespace: str, job: str, step: int, attempt: int | None = None) -> Commit:
    """The COMMIT of ``step`` by ``attempt``; by default the newest valid one of that step."""
    if attempt is None:
        fences = read_fences(store, namespace, job)
        attempts = [a for a in step_commits(store, namespace, job, step) if fences.valid(a, step)]
        if not attempts:
            raise ObjectNotFound(f"no valid COMMIT of step {step} for {namespace}/{job}")
        attempt = attempts[-1]
    key = commit_key(namespace, job, step, attempt)
    return Commit.from_json(store.get(key), key)


def is_committed(store: Store, namespace: str, job: str, step: int) -> bool:
    try:
        read_commit(store, namespace, job, step)
    except ObjectNotFound:
        return False
    return True


def load_manifest(store: Store, commit: Commit, rank: int) -> Manifest:
    """The rank's manifest, checked against the sha256 that COMMIT recorded."""
    ref = commit.manifest_for(rank)
    body = store.get(ref.key)
    if sha256(body) != ref.sha256:
        raise CorruptObject(ref.key, "sha256 differs from the one recorded in COMMIT")
    manifest = Manifest.from_json(body, ref.key)
    for name, want in (
        ("namespace", commit.namespace),
        ("job", commit.job),
        ("step", commit.step),
        ("attempt", commit.attempt),
        ("rank", rank),
        ("world_size", commit.world_size),
    ):
        if getattr(manifest, name) != want:
            raise CorruptObject(
                ref.key,
                f"its {name} {getattr(manifest, name)!r} is not the {want!r} of the COMMIT listing it "
                f"({commit.key}, rank {rank})",
            )
    return manifest


def read_object(store: Store, entry: ObjectEntry) -> bytes:
    data = store.get(entry.key)
    if len(data) != entry.size:
        raise CorruptObject(entry.key, f"size {len(data)} != {entry.size} in the manifest")
    why = check_digest(entry, data)
    if why is not None:
        raise CorruptObject(entry.key, f"{why} in the manifest")
    return data


# --- retention -------------------------------------------------------------------------------


class Retention:
    """Deletes what the ``keep`` newest valid commits do not need, for one job.

    Only the rank-0 sidecar of the newest attempt runs it, and it re-reads the fences
    first: a superseded sidecar deletes nothing. Kept: the ``keep`` newest valid commits
    in (attempt, step) order and every commit they require. Deleted: whole step
    directories older than the oldest kept step that hold nothing kept or required
    (saves in progress are always newer than the newest commit). A step's COMMITs go
    before its objects, so readers never see a COMMIT whose objects are half deleted.

    What it learnt of a step's commits is cached (COMMIT objects never change), so a
    steady state costs about four requests per commit.
    """

    def __init__(self, store: Store, namespace: str, job: str, keep: int) -> None:
        self.store, self.namespace, self.job, self.keep = store, namespace, job, keep
        self._commits: dict[int, list[int]] = {}  # step -> attempts with a COMMIT
        self._requires: dict[tuple[int, int], set[int]] = {}
        self._deleted: set[int] = set()

    def note_commit(self, commit: Commit) -> None:
        attempts = self._commits.setdefault(commit.step, [])
        if commit.attempt not in attempts:
            bisect.insort(attempts, commit.attempt)
        self._requires[(commit.attempt, commit.step)] = set(commit.requires) | {
            r.step for r in commit.required_commits
        }

    def run(self, attempt: int, fences: Fences | None = None) -> list[int]:
        """Returns the deleted steps; [] when ``attempt`` is superseded or keep is 0."""
        if self.keep < 1:
            return []
        fences = read_fences(self.store, self.namespace, self.job, fences)
        if fences.superseded(attempt):
            log.info(
                "%s/%s: attempt %d is superseded; retention deletes nothing",
                self.namespace,
                self.job,
                attempt,
            )
            return []
        # Directories this pass deleted may linger empty (SeaweedFS keeps them): never again.
        steps = [s for s in _step_dirs(self.store, self.namespace, self.job) if s not in self._deleted]
        # A cold cache (first pass, or collect_garbage) looks at every directory once.
        newest_known = max((s for s, a in self._commits.items() if a), default=1 << 62)
        for step in steps:
            # Unknown directories below the newest known commit are history or torn saves: look
            # once. Newer ones are saves in flight, which retention never touches.
            if step not in self._commits and step < newest_known:
                self._commits[step] = step_commits(self.store, self.namespace, self.job, step)
        for gone in set(self._commits) - set(steps):
            del self._commits[gone]
        valid = sorted(
            (a, s) for s, attempts in self._commits.items() for a in attempts if fences.valid(a, s)
        )
        if len(valid) <= self.keep:
            return []
        kept = valid[-self.keep :]
        needed = {s for _, s in kept}
        for position in kept:
            if position not in self._requires:
                commit = read_commit(self.store, self.namespace, self.job, position[1], position[0])
                self.note_commit(commit)
            needed |= self._requires[position]
        oldest_kept = min(s for _, s in kept)
        deleted = []
        for step in steps:
            if step >= oldest_kept or step in needed:
                continue
            # Listed now, so a late COMMIT (a zombie's) goes before the objects too.
            keys = [o.key for o in self.store.list(step_prefix(self.namespace, self.job, step)).objects]
            commits = [k for k in keys if k.endswith("/COMMIT")]
            if commits:
                self.store.delete(commits)
            self.store.delete([k for k in keys if not k.endswith("/COMMIT")])
            self._commits.pop(step, None)
            self._deleted.add(step)
            deleted.append(step)
        if deleted:
            log.info(
                "%s/%s: deleted %d old steps (%d..%d), keeping %s",
                self.namespace,
                self.job,
                len(deleted),
                deleted[0],
                deleted[-1],
                [s for _, s in kept],
            )
        return deleted


def collect_garbage(store: Store, namespace: str, job: str, keep: int) -> list[int]:
    """One retention pass as the newest attempt would run it (see :class:`Retention`)."""
    fences = read_fences(store, namespace, job)
    return Retention(store, namespace, job, keep).run(fences.newest_attempt, fences)
