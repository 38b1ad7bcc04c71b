"""Checkpointer servicer: translate protobuf messages to engine calls, nothing more."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc

from sidecar import __version__
from sidecar.api import (
    DEFAULT_CHUNK_BYTES,
    PROTOCOL_VERSION,
    SHM_HANDOVER_CAPABILITY,
    SHM_STAGING_CAPABILITY,
    pb,
    pb_grpc,
)
from sidecar.budget import Reservation
from sidecar.engine import Engine, Identity, RestoreData, TensorSpec, check_protocol, restore_header
from sidecar.errors import Aborted, InvalidArgument, NotFound, StrataError
from sidecar.manifest import Commit, ReplicaEntry

log = logging.getLogger(__name__)
CAPABILITIES = ["save.stream", "restore.stream", "restore.memory", "save.replicas", "restore.any_rank"]
_COMMIT_STATES = {
    "receiving": pb.COMMIT_STATE_PENDING,
    "uploading": pb.COMMIT_STATE_PENDING,
    "committed": pb.COMMIT_STATE_COMMITTED,
    "failed": pb.COMMIT_STATE_FAILED,
    "aborted": pb.COMMIT_STATE_FAILED,
}


def _identity(msg: pb.Identity) -> Identity:
    return Identity(msg.namespace, msg.job, msg.rank, msg.world_size, msg.attempt, msg.generation)


def _info(commit: Commit, in_memory: bool) -> pb.CheckpointInfo:
    return pb.CheckpointInfo(
        step=commit.step,
        world_size=commit.world_size,
        total_bytes=commit.total_bytes,
        committed_at=commit.committed_at,
        commit_key=commit.key,
        in_memory=in_memory,
    )


def _replica(r: pb.ReplicaRef) -> ReplicaEntry:
    return ReplicaEntry(r.name, r.index, r.owner, r.dtype, list(r.shape), r.nbytes, r.sample)


class CheckpointerServicer(pb_grpc.CheckpointerServicer):
    def __init__(self, engine: Engine, storage_url: str, max_message_bytes: int) -> None:
        self.engine = engine
        self.storage_url = storage_url
        self.max_message_bytes = max_message_bytes
        self.chunk_bytes = min(DEFAULT_CHUNK_BYTES, max_message_bytes // 2)
        #: open Attach streams (trainers alive), for the drain on SIGTERM
        self._attached = 0
        self._attached_cond = threading.Condition()

    def Handshake(self, request: pb.HandshakeRequest, context: grpc.ServicerContext) -> pb.HandshakeResponse:
        check_protocol(request.protocol_version)  # protocol 1 and 2 (sidecar.engine.check_protocol)
        if request.HasField("identity") and request.identity.job:
            identity = _identity(request.identity)
            identity.validate()
            self.engine.greet(identity, request.protocol_version, handshake=True)
            self.engine.check_not_stopped(identity)  # the restart limit is spent: exit at once
            self.engine.generation_of(identity)  # a trainer without a usable generation learns it now
        shm_dir = self.engine.segments.directory
        return pb.HandshakeResponse(
            protocol_version=PROTOCOL_VERSION,  # the newest it speaks; it serves the client's own
            server_version=__version__,
            capabilities=CAPABILITIES
            + (["save.shm"] if shm_dir else [])
            + (
                [
                    SHM_HANDOVER_CAPABILITY + handover,
                    SHM_STAGING_CAPABILITY + ("2" if self.engine.redundancy.enabled else "1"),
                ]
                if (handover := self.engine.segments.handover)
                else []
            ),
            shm_dir=shm_dir,
            max_message_bytes=self.max_message_bytes,
            max_snapshot_bytes=self.engine.settings.max_snapshot_bytes,
            storage_url=self.storage_url,
        )

    def Save(self, request_iterator: Iterator[pb.SaveRequest], context: grpc.ServicerContext) -> pb.SaveAck:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("msg") != "header":
            raise InvalidArgument("a save stream must start with a SaveHeader")
        h = first.header
        shared = h.HasField("shm")
        snap = self.engine.begin_save(
            h.protocol_version,
            _identity(h.identity),
            h.step,
            h.save_id,
            [
                TensorSpec(t.name, t.dtype, tuple(t.shape), t.nbytes, t.offset, t.role, t.touched_rows)
                for t in h.tensors
            ],
            h.tree,
            (h.shm.name, h.shm.size) if shared else None,
            [_replica(r) for r in h.replicas],
        )
        try:
            for msg in request_iterator:
                kind = msg.WhichOneof("msg")
                if kind == "chunk" and shared:
                    raise InvalidArgument("a shared-memory save carries no chunks")
                if kind == "chunk":
                    self.engine.write_chunk(snap, msg.chunk)
                elif kind == "footer":
                    self.engine.finish(snap, msg.footer.total_bytes, h.stall_seconds, h.skipped_saves)
                    return pb.SaveAck(step=snap.step, save_id=snap.save_id, bytes_received=snap.received)
                else:
                    raise InvalidArgument("a second SaveHeader inside one save stream")
            raise Aborted(f"save stream of step {snap.step} ended before its footer")
        except grpc.RpcError:
            self.engine.abort(snap, "client cancelled the stream")
            raise Aborted(f"save stream of step {snap.step} was cancelled") from None
        except BaseException as exc:
            self.engine.abort(snap, str(exc) or type(exc).__name__)
            raise

    def WaitCommitted(
        self, request: pb.WaitCommittedRequest, context: grpc.ServicerContext
    ) -> pb.CommitStatus:
        snap = self.engine.wait_committed(
            _identity(request.identity), request.step, request.save_id, request.timeout_seconds
        )
        if snap is None:
            raise NotFound(f"no save {request.save_id!r} of step {request.step} is known to this sidecar")
        return pb.CommitStatus(
            state=_COMMIT_STATES[snap.state], step=snap.step, message=snap.message, commit_key=snap.commit_key
        )

    def Restore(
        self, request: pb.RestoreRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.RestoreResponse]:
        self.engine.greet(_identity(request.identity), request.protocol_version)
        step = request.step if request.HasField("step") else None
        if request.HasField("of_rank"):
            attempt = request.attempt if request.HasField("attempt") else None
            data = self.engine.open_rank(
                _identity(request.identity), request.of_rank, step, attempt, request.header_only
            )
        elif request.header_only:
            raise InvalidArgument("header_only is for reads of a rank's snapshot (of_rank)")
        else:
            data = self.engine.open_restore(
                _identity(request.identity), step, files_ok=request.shm_ok and request.files_ok
            )
        header = restore_header(data)
        if request.header_only:
            yield pb.RestoreResponse(header=header)
            return
        lent = self._lend_files(data) if data.files is not None else ""
        if data.files is not None and not lent:
            # Read here after all, as any restore: a damaged object then marks its step unusable.
            data.files.close()
            data = self.engine.open_restore(_identity(request.identity), step, files_ok=False)
            header = restore_header(data)
        if request.shm_ok and data.segment is not None:
            # Held in a shared segment: the client copies from it directly (no bytes on the wire).
            header.shm.CopyFrom(pb.SharedSegment(name=data.segment[0], size=data.segment[1]))
            yield pb.RestoreResponse(header=header)
        elif lent and data.files is not None:
            # Stored in place as files: their descriptors are lent; the trainer reads them itself.
            header.shm.CopyFrom(pb.SharedSegment(name=lent, size=data.total_bytes))
            header.shm_files.extend(data.files.sizes)
            header.shm_handoff = True
            try:
                yield pb.RestoreResponse(header=header)
                self._until_taken(lent, context)
            finally:
                self.engine.segments.remove(lent)
        elif request.shm_ok and (handed := self._handoff(data)) is not None:
            # Assembled here (a peer, storage, a file segment's copy): one copy into a sealed
            # segment lent to the client beats gRPC's copies by far; the call stays open until
            # the client took it (its memory is charged until then).
            name, blobs, memory = handed
            header.shm.CopyFrom(pb.SharedSegment(name=name, size=data.total_bytes))
            header.shm_handoff = True
            try:
                yield pb.RestoreResponse(header=header)
                self._until_taken(name, context)
            finally:
                self.engine.segments.remove(name)
                memory.release()
                del blobs
        else:
            yield pb.RestoreResponse(header=header)
            for blob in data.chunks:
                for start in range(0, len(blob), self.chunk_bytes):
                    yield pb.RestoreResponse(chunk=bytes(blob[start : start + self.chunk_bytes]))
        if not request.HasField("of_rank"):  # served whole: the heartbeats say where it came from
            self.engine.reports.note_restore(
                _identity(request.identity).slot, data.step, data.source, data.restore_class
            )

    def _until_taken(self, name: str, context: grpc.ServicerContext) -> None:
        """Keep the call open until the client took a handed-over segment (fetched the lent
        descriptor, or removed the file), at most two minutes; then make sure it is withdrawn."""
        deadline = time.monotonic() + 120
        while self.engine.segments.pending(name) and context.is_active() and time.monotonic() < deadline:
            time.sleep(0.005)
        self.engine.segments.remove(name)

    def _lend_files(self, data: RestoreData) -> str:
        """Lend a restore's object files under one name; "" where they cannot be lent."""
        assert data.files is not None
        try:
            name = self.engine.segments.lend_files(data.files.duplicates())
        except OSError as exc:
            log.warning("a restore's object files could not be lent (%s); streaming their bytes", exc)
            return ""
        data.files.close()
        data.chunks = iter(())
        return name

    def _handoff(self, data: RestoreData) -> tuple[str, list[memoryview], Reservation] | None:
        """Copy a restore's bytes into a new shared segment; None (and ``data.chunks`` put back)
        when there is no shm dir, the budget or the tmpfs has no room."""
        if not self.engine.segments.directory:
            return None
        if data.lendable is not None and data.memory is not None:
            # Read from storage straight into a memfd: sealed and lent as it is, no copy.
            data.chunks = iter(())
            try:
                return self.engine.segments.lend_buffer(data.lendable), [], data.memory
            except (BufferError, OSError) as exc:
                log.warning("a restore buffer could not be lent as it is (%s); lending a copy", exc)
                data.chunks = data.lendable.chunks()
        blobs = [memoryview(b) for b in data.chunks]
        data.chunks = iter(blobs)
        try:
            memory = self.engine.memory.reserve("restore", data.total_bytes, "a restore handed over in shm")
        except StrataError:
            return None
        try:
            name = self.engine.segments.handoff(blobs, data.total_bytes)
        except OSError as exc:
            memory.release()
            log.info("restore over gRPC: no room for a shared copy (%s)", exc)
            return None
        return name, blobs, memory

    def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: grpc.ServicerContext
    ) -> pb.ListCheckpointsResponse:
        found = self.engine.list_checkpoints(request.namespace, request.job)
        return pb.ListCheckpointsResponse(checkpoints=[_info(c, mem) for c, mem in found])

    def DescribeCheckpoint(
        self, request: pb.DescribeCheckpointRequest, context: grpc.ServicerContext
    ) -> pb.DescribeCheckpointResponse:
        commit, body = self.engine.describe(request.namespace, request.job, request.step, request.rank)
        in_memory = self.engine.in_memory(request.namespace, request.job, (commit.attempt, commit.step))
        return pb.DescribeCheckpointResponse(info=_info(commit, in_memory), manifest_json=body.decode())

    def ReportSkip(
        self, request: pb.ReportSkipRequest, context: grpc.ServicerContext
    ) -> pb.ReportSkipResponse:
        self.engine.report_skip(_identity(request.identity), request.step, request.reason)
        return pb.ReportSkipResponse()

    def Prefetch(self, request: pb.PrefetchRequest, context: grpc.ServicerContext) -> pb.PrefetchResponse:
        self.engine.prefetch(_identity(request.identity), files_ok=request.files_ok)
        return pb.PrefetchResponse()

    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> Iterator[pb.AttachEvent]:
        identity = _identity(request.identity)
        identity.validate()
        ended = threading.Event()

        def on_end() -> None:
            ended.set()
            self.engine.wake(identity)

        context.add_callback(on_end)
        epoch = self.engine.epoch_for(identity)
        self.engine.rank_back(identity, epoch.attempt)
        with self._attached_cond:
            self._attached += 1
        try:
            yield pb.AttachEvent(attempt=epoch.attempt)
            known: tuple[int, ...] = ()
            told = ""
            try:
                while not ended.is_set() and context.is_active():
                    if self.engine.stopping:
                        return
                    # The operator restarts the gang in place: the trainer exits (and its
                    # container restarts) to run as the new generation.
                    restart = self.engine.reports.restart_for(identity.job_key, epoch.generation)
                    if restart and restart != told:
                        told = restart
                        yield pb.AttachEvent(attempt=epoch.attempt, restart_generation=restart)
                    # Tell the trainer at once when a peer of its attempt is gone: a save on
                    # SIGTERM then knows no step can commit and lets the gang restart at once.
                    gone = self.engine.peers_gone(identity, epoch.attempt, known, 1.0, until=ended)
                    if gone != known and not ended.is_set():
                        known = gone
                        reason = f"rank(s) {list(gone)} left attempt {epoch.attempt}" if gone else ""
                        yield pb.AttachEvent(attempt=epoch.attempt, gone_ranks=gone, gone_reason=reason)
            finally:
                if not self.engine.stopping:
                    self.engine.rank_gone(identity, epoch.attempt, "its trainer went away")
                    self.engine.segments.trainer_gone()
        finally:
            with self._attached_cond:
                self._attached -= 1
                self._attached_cond.notify_all()

    def wait_detached(self, timeout: float, hurry: threading.Event | None = None) -> int:
        """Wait until no trainer is attached, ``timeout`` passes or ``hurry`` is set; returns how
        many are still attached (the sidecar's drain on SIGTERM)."""
        deadline = time.monotonic() + timeout
        with self._attached_cond:
            while self._attached and not (hurry is not None and hurry.is_set()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._attached_cond.wait(min(left, 0.1))
            return self._attached

    def GetStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        return pb.StatusResponse(
            server_version=__version__,
            storage_url=self.storage_url,
            uptime_seconds=time.time() - self.engine.started,
            snapshots=[
                pb.SnapshotStatus(
                    namespace=s.identity.namespace,
                    job=s.identity.job,
                    rank=s.identity.rank,
                    step=s.step,
                    state=s.state,
                    bytes=s.total_bytes,
                )
                for s in self.engine.snapshots()
            ],
        )
