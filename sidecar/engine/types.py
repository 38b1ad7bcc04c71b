"""The engine's data: who saves (Identity), what a save declares (TensorSpec), a snapshot as
the sidecar holds it (Snapshot), what a restore serves (RestoreData), and the two helpers
that allocate and drop a snapshot's buffer."""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from sidecar import manifest as mf
from sidecar.api import MAX_WORLD_SIZE, pb
from sidecar.budget import Reservation
from sidecar.errors import InvalidArgument
from sidecar.gang import Position
from sidecar.pipeline.plan import ObjectFiles
from sidecar.shm import RestoreBuffer, anonymous

log = logging.getLogger(__name__)

#: (namespace, job, rank): one trainer rank's place in the engine
Slot = tuple[str, str, int]
#: (namespace, job)
JobKey = tuple[str, str]


def check_job(namespace: str, job: str) -> JobKey:
    """A job a request names, or INVALID_ARGUMENT saying which name is malformed."""
    try:
        return (mf.check_name("namespace", namespace), mf.check_name("job", job))
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


@dataclass(frozen=True)
class Identity:
    namespace: str
    job: str
    rank: int
    world_size: int
    #: restart count as the trainer knows it (informational; storage allocates the attempt)
    attempt: int
    #: generation the trainer declares ("RUN/RESTART"); a generation file wins over it
    generation: str = ""

    def validate(self) -> None:
        check_job(self.namespace, self.job)
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise InvalidArgument(f"world size {self.world_size} is not from 1 to {MAX_WORLD_SIZE}")
        if self.rank >= self.world_size:
            raise InvalidArgument(f"rank {self.rank} is outside world size {self.world_size}")

    @property
    def slot(self) -> Slot:
        return (self.namespace, self.job, self.rank)

    @property
    def job_key(self) -> JobKey:
        return (self.namespace, self.job)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    #: Where the tensor sits in a shared segment (chunked saves pack tensors; this is ignored).
    offset: int = 0
    role: str = ""
    #: rows the client saw looked up since the newest committed checkpoint (packed bits)
    touched: bytes = b""


@dataclass
class Snapshot:
    identity: Identity
    step: int
    save_id: str
    tensors: list[mf.TensorEntry]
    tree: object
    total_bytes: int
    buffer: bytearray | memoryview
    #: storage-allocated attempt (EPOCH) of the generation that saved it
    attempt: int = 0
    generation: str = ""
    received: int = 0
    #: Shared segment the bytes live in (the client wrote them; verify before serving from memory).
    segment: str = ""
    #: The objects as uploaded, when they are ``buffer`` itself cut in slices (a lossless full).
    objects: list[mf.ObjectEntry] = field(default_factory=list)
    #: Restores the job had seen when this was saved, and those of them that gave lossy values.
    restores: int = 0
    storage_restores: int = 0
    #: tensor name -> packed bitmap of rows the client tracked as looked up
    touched: dict[str, bytes] = field(default_factory=dict)
    state: str = "receiving"  # receiving -> uploading -> committed | failed | aborted
    message: str = ""
    commit_key: str = ""
    #: this rank's MANIFEST is durable (from then on the rank never reports a skip of the step)
    manifest_durable: bool = False
    #: the stored tensor entries (per-tensor digest of what the trainer saved; encodings)
    stored: list[mf.TensorEntry] = field(default_factory=list)
    #: replicated tensors of the state, as this rank declared them (others own some of them)
    replicas: list[mf.ReplicaEntry] = field(default_factory=list)
    #: its buffer's share of the memory budget (streamed saves; shared segments are the trainer's)
    memory: Reservation | None = None
    #: the share of its header (tree, tensor list) in the memory budget, shared segments too
    metadata: Reservation | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def position(self) -> Position:
        return (self.attempt, self.step)


@dataclass
class RestoreData:
    step: int
    tensors: list[mf.TensorEntry]
    tree: object
    total_bytes: int
    source: str
    fallback_reason: str
    chunks: Iterator[memoryview]
    restores: int = 0
    #: the restore buffer's share of the memory budget, released once the data is dropped
    memory: Reservation | None = None
    #: replicated tensors other ranks saved, and the attempt of the COMMIT served (with ``step``)
    replicas: list[mf.ReplicaEntry] = field(default_factory=list)
    attempt: int = 0
    #: the shared segment (name in --shm-dir, bytes) holding exactly these bytes, when there is one
    segment: tuple[str, int] | None = None
    #: the ranks that saved the commit served (set for reads of any rank: it may differ from the
    #: reader's world size)
    world_size: int = 0
    #: of the restores counted in ``restores``, those that gave lossy values (the stored class)
    storage_restores: int = 0
    #: "exact": every tensor as the trainer saved it (lossy ones included); "stored": lossy
    #: tensors as storage holds them
    restore_class: str = "stored"
    #: the memfd ``chunks`` lie in, to be sealed and lent as it is (no copy into a handed-over
    #: segment); None where the bytes are in process memory
    lendable: RestoreBuffer | None = None
    #: the step's objects as files, lent to the trainer as they are (``chunks`` reads them here
    #: where they cannot be lent); None where the bytes are in memory
    files: ObjectFiles | None = None


def drop_buffer(snap: Snapshot) -> None:
    snap.buffer = bytearray()
    for memory in (snap.memory, snap.metadata):
        if memory is not None:
            memory.release()


def outcome_of(snap: Snapshot) -> Snapshot:
    """What a dropped snapshot leaves for the trainer's WaitCommitted: its final state without
    its tree, tensor lists or bytes (up to a thousand of them are remembered)."""
    return dataclasses.replace(
        snap,
        tensors=[],
        tree=None,
        buffer=bytearray(),
        objects=[],
        touched={},
        stored=[],
        replicas=[],
        memory=None,
        metadata=None,
    )


def zeroed(size: int, shareable: bool = False) -> bytearray | memoryview:
    """A writable zero-filled buffer whose pages are mapped as the stream fills them (an
    anonymous mapping), so a dropped stream costs only what it carried. ``shareable``: in a
    memfd, which encoding worker processes map too (sidecar.shm), where there is one."""
    if size < 1 << 20:
        return bytearray(size)
    if shareable:
        try:
            return memoryview(anonymous(size))
        except OSError as exc:  # no memfd (not Linux, a seccomp profile): quantized in process
            log.debug("no memfd for a streamed save: %s", exc)
    return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE))


def _metas(tensors: list[mf.TensorEntry], exact: bool) -> list[pb.TensorMeta]:
    # The saved bytes' digest, which the reader checks while it copies; under the stored class a
    # lossy tensor comes back decoded, other bytes than the digest was taken of.
    return [
        pb.TensorMeta(
            name=t.name,
            dtype=t.dtype,
            shape=t.shape,
            nbytes=t.nbytes,
            offset=t.offset,
            xxh3="" if t.lossy and not exact else t.xxh3,
        )
        for t in tensors
    ]


def _replica_ref(r: mf.ReplicaEntry) -> pb.ReplicaRef:
    return pb.ReplicaRef(
        name=r.name,
        index=r.index,
        owner=r.owner,
        dtype=r.dtype,
        shape=r.shape,
        nbytes=r.nbytes,
        sample=r.sample,
    )


def restore_header(data: RestoreData) -> pb.RestoreHeader:
    """What a restore stream (or a peer's fetch) starts with."""
    return pb.RestoreHeader(
        step=data.step,
        tensors=_metas(data.tensors, data.restore_class == "exact"),
        restore_class=data.restore_class,
        tree=json.dumps(data.tree).encode(),
        total_bytes=data.total_bytes,
        source=data.source,
        fallback_reason=data.fallback_reason,
        replicas=[_replica_ref(r) for r in data.replicas],
        attempt=data.attempt,
        world_size=data.world_size,
    )
