"""Checkpoint layout, manifest format and the commit protocol.

Layout under the store root (S3 and file backends alike)::

    <namespace>/<job>/steps/<step:012d>/<attempt>/rank-<r>/obj-<n>   data objects
    <namespace>/<job>/steps/<step:012d>/<attempt>/rank-<r>/MANIFEST  per rank, after its objects
    <namespace>/<job>/steps/<step:012d>/COMMIT                       job level, last
    <namespace>/<job>/LATEST                                         pointer, a verified hint

``<attempt>`` is ``a<job attempt>-<save id>``: unique per save attempt, so a
retried or resumed save never overwrites anything. Only LATEST is rewritten.
A step exists for readers only through its COMMIT, and readers trust only the
manifests (key and sha256) that COMMIT lists.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

from sidecar.errors import Aborted, CorruptObject, FailedPrecondition, NotFound, ObjectNotFound
from sidecar.store.base import Store

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,251}[a-z0-9])?$")
_STEP_DIR_RE = re.compile(r"/steps/(\d{12})/$")


def check_name(kind: str, value: str) -> str:
    """Namespaces and job names become key segments: keep them DNS-label-like."""
    if not _NAME_RE.match(value):
        raise ValueError(f"{kind} {value!r} must be lowercase letters, digits, '.', '_' or '-' (<= 253)")
    return value


def job_prefix(namespace: str, job: str) -> str:
    return f"{check_name('namespace', namespace)}/{check_name('job', job)}/"


def step_prefix(namespace: str, job: str, step: int) -> str:
    return f"{job_prefix(namespace, job)}steps/{step:012d}/"


def rank_prefix(namespace: str, job: str, step: int, attempt: int, save_id: str, rank: int) -> str:
    return f"{step_prefix(namespace, job, step)}a{attempt:04d}-{save_id}/rank-{rank}/"


def commit_key(namespace: str, job: str, step: int) -> str:
    return step_prefix(namespace, job, step) + "COMMIT"


def latest_key(namespace: str, job: str) -> str:
    return job_prefix(namespace, job) + "LATEST"


def crc32(data: bytes | bytearray | memoryview) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


@dataclass
class ObjectEntry:
    key: str
    size: int
    crc32: str


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

    def stored(self) -> tuple[int, int]:
        if self.stored_offset < 0:
            return self.offset, self.nbytes
        return self.stored_offset, self.stored_bytes


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
    #: "full", or "diff": diff tensors apply on top of ``base_step`` restored.
    checkpoint: str = "full"
    base_step: int | None = None
    #: Every older step a restore of this one reads (GC keeps them while this one is kept).
    requires: list[int] = field(default_factory=list)
    policy: str = ""
    #: Restores the job had seen when this was written (drives bit-width escalation).
    restores: int = 0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str = "MANIFEST") -> Manifest:
        try:
            raw = json.loads(data)
            _check_format(raw, "strata.rank-manifest", key)
            raw["tensors"] = [TensorEntry(**t) for t in raw["tensors"]]
            raw["objects"] = [ObjectEntry(**o) for o in raw["objects"]]
            return cls(**raw)
        except (TypeError, KeyError, ValueError) as exc:
            raise CorruptObject(key, f"not a valid manifest ({exc})") from None


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
    format_version: int = FORMAT_VERSION
    kind: str = "strata.commit"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str = "COMMIT") -> Commit:
        try:
            raw = json.loads(data)
            _check_format(raw, "strata.commit", key)
            raw["manifests"] = [ManifestRef(**m) for m in raw["manifests"]]
            return cls(**raw)
        except (TypeError, KeyError, ValueError) as exc:
            raise CorruptObject(key, f"not a valid COMMIT ({exc})") from None

    def manifest_for(self, rank: int) -> ManifestRef:
        for ref in self.manifests:
            if ref.rank == rank:
                return ref
        raise NotFound(f"COMMIT of step {self.step} lists no manifest for rank {rank}")


def _check_format(raw: Any, kind: str, key: str) -> None:
    if not isinstance(raw, dict) or raw.get("kind") != kind:
        raise ValueError(f"expected kind {kind!r}")
    if raw.get("format_version") != FORMAT_VERSION:
        raise CorruptObject(
            key, f"format_version {raw.get('format_version')!r} is not supported (this build reads 1)"
        )


# --- commit protocol -------------------------------------------------------------------------


def write_manifest(store: Store, prefix: str, manifest: Manifest) -> ManifestRef:
    """Written after every object of the rank, so its presence means the data is whole."""
    body = manifest.to_json()
    key = prefix + "MANIFEST"
    store.put(key, body)
    return ManifestRef(manifest.rank, key, hashlib.sha256(body).hexdigest(), len(body))


def skip_key(namespace: str, job: str, step: int, attempt: int, rank: int) -> str:
    """Marker a rank leaves when it will not save this step, so the commit fails at once."""
    return f"{step_prefix(namespace, job, step)}a{attempt:04d}-skip/rank-{rank}/SKIPPED"


@dataclass
class StepState:
    committed: bool
    manifests: dict[int, str]  # rank -> MANIFEST key of the attempt
    skipped: list[int]  # ranks that reported they will not save the step


def step_state(store: Store, namespace: str, job: str, step: int, attempt: int) -> StepState:
    """Everything the commit protocol needs about one step, in one LIST."""
    prefix = step_prefix(namespace, job, step)
    state = StepState(False, {}, [])
    for obj in store.list(prefix).objects:
        rest = obj.key[len(prefix) :].split("/")
        if rest == ["COMMIT"]:
            state.committed = True
        elif len(rest) == 3 and rest[0].startswith(f"a{attempt:04d}-") and rest[1].startswith("rank-"):
            rank = int(rest[1].removeprefix("rank-"))
            if rest[2] == "MANIFEST":
                # Several saves of one step in one attempt: the newest key wins (keys are unique per save).
                state.manifests[rank] = max(state.manifests.get(rank, ""), obj.key)
            elif rest[2] == "SKIPPED":
                state.skipped.append(rank)
    return state


def write_commit(
    store: Store,
    namespace: str,
    job: str,
    step: int,
    world_size: int,
    attempt: int,
    state: StepState | None = None,
) -> Commit:
    """Write the job-level COMMIT once every rank's MANIFEST exists.

    Raises FailedPrecondition while ranks are missing (the caller polls) and
    Aborted when a rank reported it will not save the step (no point waiting).
    """
    state = state or step_state(store, namespace, job, step, attempt)
    if state.skipped:
        raise Aborted(f"step {step} cannot commit: rank(s) {sorted(state.skipped)} did not save it")
    keys = state.manifests
    missing = sorted(set(range(world_size)) - set(keys))
    if missing:
        raise FailedPrecondition(f"step {step}: no MANIFEST yet for ranks {missing}")
    refs: list[ManifestRef] = []
    requires: set[int] = set()
    total = 0
    for rank in range(world_size):
        body = store.get(keys[rank])
        manifest = Manifest.from_json(body, keys[rank])
        if manifest.world_size != world_size:
            raise FailedPrecondition(
                f"step {step}: rank {rank} saved with world size {manifest.world_size}, expected {world_size}"
            )
        total += manifest.total_bytes
        requires.update(manifest.requires)
        refs.append(ManifestRef(rank, keys[rank], hashlib.sha256(body).hexdigest(), len(body)))
    commit = Commit(namespace, job, step, world_size, attempt, total, refs, requires=sorted(requires))
    store.put(commit_key(namespace, job, step), commit.to_json())
    _advance_latest(store, namespace, job, step)
    return commit


def _advance_latest(store: Store, namespace: str, job: str, step: int) -> None:
    """LATEST only moves forward; a race can leave it behind, which readers tolerate."""
    key = latest_key(namespace, job)
    try:
        current = json.loads(store.get(key)).get("step", -1)
    except (ObjectNotFound, ValueError, AttributeError):
        current = -1
    if step > current:
        store.put(key, json.dumps({"step": step, "commit": commit_key(namespace, job, step)}).encode())


def read_commit(store: Store, namespace: str, job: str, step: int) -> Commit:
    key = commit_key(namespace, job, step)
    return Commit.from_json(store.get(key), key)


def is_committed(store: Store, namespace: str, job: str, step: int) -> bool:
    return store.head(commit_key(namespace, job, step)) is not None


def _step_dirs(store: Store, namespace: str, job: str, start_after: str | None = None) -> list[int]:
    listing = store.list(job_prefix(namespace, job) + "steps/", delimiter="/", start_after=start_after)
    steps = []
    for p in listing.prefixes:
        m = _STEP_DIR_RE.search("/" + p)
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


def committed_steps(store: Store, namespace: str, job: str) -> list[int]:
    """Every committed step, oldest first (a full listing: for ls and fallback, not the hot path)."""
    return [s for s in _step_dirs(store, namespace, job) if is_committed(store, namespace, job, s)]


def newest_committed(store: Store, namespace: str, job: str) -> int | None:
    """The newest committed step in O(1) requests: GET LATEST, one LIST of newer step
    prefixes, a HEAD of each newer step's COMMIT. A full listing only when LATEST is missing."""
    try:
        hint = int(json.loads(store.get(latest_key(namespace, job)))["step"])
    except ObjectNotFound:
        log.info("%s/%s: LATEST missing; scanning all steps", namespace, job)
        steps = committed_steps(store, namespace, job)
        return steps[-1] if steps else None
    except (ValueError, KeyError, TypeError):
        log.warning("%s/%s: LATEST is unreadable; scanning all steps", namespace, job)
        steps = committed_steps(store, namespace, job)
        return steps[-1] if steps else None
    newer = _step_dirs(store, namespace, job, start_after=step_prefix(namespace, job, hint))
    for step in reversed(newer):
        if is_committed(store, namespace, job, step):
            return step
    if is_committed(store, namespace, job, hint):
        return hint
    log.warning("%s/%s: LATEST names step %d without a COMMIT; scanning", namespace, job, hint)
    older = [s for s in committed_steps(store, namespace, job) if s < hint]
    return older[-1] if older else None


def load_manifest(store: Store, commit: Commit, rank: int) -> Manifest:
    """The rank's manifest, checked against the sha256 that COMMIT recorded."""
    ref = commit.manifest_for(rank)
    body = store.get(ref.key)
    if hashlib.sha256(body).hexdigest() != ref.sha256:
        raise CorruptObject(ref.key, "sha256 differs from the one recorded in COMMIT")
    return Manifest.from_json(body, ref.key)


def read_object(store: Store, entry: ObjectEntry) -> bytes:
    data = store.get(entry.key)
    if len(data) != entry.size:
        raise CorruptObject(entry.key, f"size {len(data)} != {entry.size} in the manifest")
    if crc32(data) != entry.crc32:
        raise CorruptObject(entry.key, f"crc32 {crc32(data)} != {entry.crc32} in the manifest")
    return data


def collect_garbage(store: Store, namespace: str, job: str, keep: int) -> list[int]:
    """Delete every step older than the ``keep`` newest committed ones, except the bases
    and diffs those require. Returns the deleted steps.

    Safe against concurrent saves: only steps strictly older than the oldest kept
    committed step are touched, and every new save is newer than the newest
    committed step. A step's COMMIT goes first, so readers never see a COMMIT
    whose objects are half deleted.
    """
    if keep < 1:
        return []
    steps = _step_dirs(store, namespace, job)
    committed = [s for s in steps if is_committed(store, namespace, job, s)]
    if len(committed) <= keep:
        return []
    kept = committed[-keep:]
    needed = set(kept)
    for step in kept:
        needed.update(read_commit(store, namespace, job, step).requires)
    # Bases older than the oldest kept step stay; anything else older than it goes (a save in
    # progress is always newer than the newest committed step, so never among these).
    oldest_kept = kept[0]
    deleted = []
    for step in steps:
        if step >= oldest_kept or step in needed:
            continue
        store.delete([commit_key(namespace, job, step)])
        keys = [o.key for o in store.list(step_prefix(namespace, job, step)).objects]
        store.delete(keys)
        deleted.append(step)
    if deleted:
        log.info(
            "%s/%s: deleted %d old steps (%d..%d), keeping %s",
            namespace,
            job,
            len(deleted),
            deleted[0],
            deleted[-1],
            kept,
        )
    return deleted
