"""CheckpointClient: what a training script talks to.

    client = CheckpointClient(job="recsys")
    start = (client.resume(state) or -1) + 1
    for step in range(start, steps):
        train_step()
        client.save(step, state)          # returns after the host copy
    client.close()                        # waits for the last save

``save`` copies every tensor into reused host buffers (the only stall), then a
background thread streams the snapshot to the sidecar. The handle's
``staged`` future resolves when parameters may be mutated, ``durable`` when
the job-level COMMIT exists (or with the error that prevented it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from sidecar.api import PROTOCOL_VERSION, TOKEN_METADATA_KEY, channel_options, pb, pb_grpc
from sidecar.api.faults import fault_point
from trainer_client import _rng, _tree
from trainer_client._staging import Gate, HostBuffers, Stager, as_numpy_bytes, dtype_name, torch_dtype
from trainer_client.config import ClientSettings
from trainer_client.errors import RestoreError, SaveFailed, SaveSkipped, SidecarUnavailable

log = logging.getLogger("strata.client")
_RNG_KEY = "__strata_rng__"
CLIENT_VERSION = "0.1.0"


@dataclass(frozen=True)
class Committed:
    """What ``durable`` resolves to."""

    step: int
    commit_key: str


class SaveHandle:
    """Futures of one save, like DCP's ``AsyncSaveResponse``."""

    def __init__(self, step: int, skipped: bool = False) -> None:
        self.step = step
        self.skipped = skipped
        self.staged: Future[None] = Future()
        self.durable: Future[Committed] = Future()
        self.stall_s = 0.0

    def result(self, timeout: float | None = None) -> Committed:
        """Wait until durable; raises the save's error."""
        return self.durable.result(timeout)


class CheckpointClient:
    """Saves and restores one rank's training state through the Strata sidecar.

    ``optimizers``: optimizers whose parameters and state may be staged while
    the next forward/backward runs (overlapped staging). An optimizer step
    pre-hook waits for the copy before the step mutates them. Everything else
    (buffers such as BatchNorm statistics, Embedding(max_norm=...) weights,
    RNG, data-reader state) is still copied inside ``save()``.
    """

    def __init__(
        self,
        job: str | None = None,
        *,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        settings: ClientSettings | None = None,
        **overrides: Any,
    ) -> None:
        self.settings = settings or ClientSettings.from_env(job=job, **overrides)
        s = self.settings
        self._identity = pb.Identity(
            namespace=s.namespace, job=s.job, rank=s.rank, world_size=s.world_size, attempt=s.attempt
        )
        self._channel = grpc.insecure_channel(s.target, options=channel_options(s.max_message_bytes))
        self._stub = pb_grpc.CheckpointerStub(self._channel)
        self._metadata = ((TOKEN_METADATA_KEY, s.token),) if s.token else ()
        self.server_info = self._handshake()
        self._buffers = HostBuffers()
        self._stager = Stager(self._buffers)
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="strata-send")
        self._waiter = ThreadPoolExecutor(2, thread_name_prefix="strata-durable")
        self._lock = threading.Lock()
        self._inflight: Future[None] | None = None
        self._last: SaveHandle | None = None
        self._gate = Gate()
        self._overlap: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self._skipped_unreported = 0
        beat = os.environ.get("STRATA_HEARTBEAT_FILE")
        self._heartbeat = Path(beat) if beat else None
        #: step, source ("memory"/"storage") and fallback reason of the newest restore
        self.last_restore: dict[str, Any] | None = None
        self.stats = {"saves": 0, "skipped": 0, "failed": 0, "first_save_stall_s": 0.0, "last_stall_s": 0.0}
        for opt in optimizers:
            self.register_optimizer(opt)
        if self.settings.resume != "never":
            # Asynchronous discovery: the sidecar starts reading the newest step while the
            # trainer builds its model; resume() then finds it in memory.
            self._prefetch = self._stub.Prefetch.future(  # keep a reference: a dropped call is cancelled
                pb.PrefetchRequest(identity=self._identity), timeout=30, metadata=self._metadata
            )

    # --- connection -----------------------------------------------------------------------

    def _handshake(self) -> pb.HandshakeResponse:
        req = pb.HandshakeRequest(
            protocol_version=PROTOCOL_VERSION,
            client_version=CLIENT_VERSION,
            capabilities=["save.stream", "restore.stream"],
            identity=self._identity,
        )
        try:
            return self._stub.Handshake(
                req, timeout=self.settings.connect_timeout_s, wait_for_ready=True, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise SidecarUnavailable(
                    f"cannot reach the Strata sidecar at {self.settings.target} within "
                    f"{self.settings.connect_timeout_s:.0f} s: is it running? "
                    "(set STRATA_SOCKET or STRATA_ADDRESS)"
                ) from None
            raise SidecarUnavailable(f"sidecar refused the handshake: {exc.details()}") from None

    def close(self, wait: bool = True) -> None:
        """Finish (or drop) outstanding saves and close the connection."""
        if wait and self._last is not None:
            try:
                self._last.durable.result(self.settings.commit_timeout_s)
            except Exception as exc:
                log.warning("last save (step %d) did not become durable: %s", self._last.step, exc)
        for hook in self._hooks:
            hook.remove()
        self._sender.shutdown(wait=wait)
        self._waiter.shutdown(wait=wait)
        self._channel.close()

    def __enter__(self) -> CheckpointClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- overlapped staging ---------------------------------------------------------------

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Stage this optimizer's parameters and state in the background; its
        ``step()`` waits until the copy is done."""
        self._overlap.append(optimizer)
        self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self._gate.wait()))

    def _deferrable(self, state: Any) -> set[tuple[int, int]]:
        """(data_ptr, nbytes) of tensors only an optimizer step mutates."""
        keys: set[tuple[int, int]] = set()
        for opt in self._overlap:
            for group in opt.param_groups:
                for p in group["params"]:
                    keys.add(_tensor_key(p))
            for per_param in opt.state.values():
                for v in per_param.values():
                    if isinstance(v, torch.Tensor):
                        keys.add(_tensor_key(v))
        for module in _modules(state):
            for sub in module.modules():
                # Embedding(max_norm=...) renormalises its weight in place during forward.
                weight = getattr(sub, "weight", None)
                if getattr(sub, "max_norm", None) is not None and isinstance(weight, torch.Tensor):
                    keys.discard(_tensor_key(weight))
        return keys

    # --- save -----------------------------------------------------------------------------

    def save(self, step: int, state: MutableMapping[str, Any]) -> SaveHandle:
        """Snapshot ``state`` at ``step``; returns once the synchronous copy is done."""
        t0 = time.perf_counter()
        with self._lock:
            # Busy while the previous snapshot streams or uploads: the sidecar holds one in
            # flight besides the committed one, so another would only be refused.
            previous = self._last
            busy = (self._inflight is not None and not self._inflight.done()) or (
                previous is not None and not previous.durable.done()
            )
            if busy and self.settings.when_busy == "skip":
                return self._skip(step)
        if busy:
            if self._inflight is not None:
                self._inflight.result()  # _send never raises; it fails the handle instead
            if previous is not None:
                futures_wait([previous.durable])
        handle = SaveHandle(step)
        if self._heartbeat is not None:
            self._heartbeat.touch()  # progress, for the launcher's hang detection
        full = dict(state)
        if self.settings.capture_rng:
            full[_RNG_KEY] = _rng.capture()
        flat = _tree.flatten(full)
        first = self._buffers.ensure(flat.tensors)
        deferred: list[int] = []
        if self._overlap:
            keys = self._deferrable(state)
            deferred = [i for i, (_, t) in enumerate(flat.tensors) if _tensor_key(t) in keys]
        later = set(deferred)
        self._stager.copy(flat.tensors, [i for i in range(len(flat.tensors)) if i not in later])
        if deferred:
            self._gate.close()
        stall = time.perf_counter() - t0
        handle.stall_s = stall
        self.stats["saves"] += 1
        self.stats["last_stall_s"] = stall
        if first and self.stats["first_save_stall_s"] == 0.0:
            self.stats["first_save_stall_s"] = stall
        with self._lock:
            skipped, self._skipped_unreported = self._skipped_unreported, 0
            self._inflight = self._sender.submit(
                self._send, handle, flat, deferred, _tree.encode_skeleton(flat.skeleton), stall, skipped
            )
            self._last = handle
        if not deferred:
            # CPU copies are complete; GPU copies are ordered before later compute by the stream wait.
            handle.staged.set_result(None)
        return handle

    def _skip(self, step: int) -> SaveHandle:
        handle = SaveHandle(step, skipped=True)
        self.stats["skipped"] += 1
        self._skipped_unreported += 1
        log.info("step %d: save skipped, the previous one is still in flight", step)
        handle.staged.set_result(None)
        handle.durable.set_exception(
            SaveSkipped(f"step {step} skipped: the previous save was still in flight")
        )
        self._waiter.submit(self._report_skip, step, "skipped: the previous save was still in flight")
        return handle

    def _report_skip(self, step: int, reason: str) -> None:
        """Skips are collective: other ranks' saves of this step must not wait for this rank."""
        req = pb.ReportSkipRequest(identity=self._identity, step=step, reason=reason)
        try:
            self._stub.ReportSkip(req, timeout=30, metadata=self._metadata)
        except grpc.RpcError as exc:
            log.debug("could not report the skip of step %d: %s", step, exc)

    def _send(
        self,
        handle: SaveHandle,
        flat: _tree.Flat,
        deferred: list[int],
        tree: bytes,
        stall: float,
        skipped: int,
    ) -> None:
        try:
            if deferred:
                try:
                    self._stager.copy(flat.tensors, deferred)
                finally:
                    self._gate.open()
                handle.staged.set_result(None)
            self._stager.synchronize()
            save_id = uuid.uuid4().hex[:16]
            delay, deadline = 0.05, time.monotonic() + self.settings.rpc_timeout_s
            while True:
                try:
                    ack = self._stub.Save(
                        self._requests(handle.step, save_id, tree, stall, skipped),
                        timeout=self.settings.rpc_timeout_s,
                        metadata=self._metadata,
                    )
                    break
                except grpc.RpcError as exc:
                    # The sidecar holds its limit of snapshots. Under "wait" the user chose to
                    # block rather than lose a save: keep the buffers and retry with backoff.
                    busy = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    if not (busy and self.settings.when_busy == "wait" and time.monotonic() < deadline):
                        raise
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
        except Exception as exc:
            self._fail(handle, exc)
            self._waiter.submit(self._report_skip, handle.step, f"save failed: {exc}")
            return
        finally:
            if not handle.staged.done():
                handle.staged.set_result(None)
        fault_point("client.saved", handle.step)
        self._waiter.submit(self._await_durable, handle, ack.save_id)

    def _requests(
        self, step: int, save_id: str, tree: bytes, stall: float, skipped: int
    ) -> Iterator[pb.SaveRequest]:
        bufs = self._buffers
        yield pb.SaveRequest(
            header=pb.SaveHeader(
                protocol_version=PROTOCOL_VERSION,
                identity=self._identity,
                step=step,
                save_id=save_id,
                tensors=[
                    pb.TensorMeta(
                        name=s.name, dtype=dtype_name(s.dtype), shape=list(s.shape), nbytes=s.nbytes
                    )
                    for s in bufs.slots
                ],
                tree=tree,
                stall_seconds=stall,
                skipped_saves=skipped,
            )
        )
        for chunk in bufs.chunks(self.settings.chunk_bytes):
            fault_point("client.stream.chunk", step)
            yield pb.SaveRequest(chunk=chunk)
        # Every byte is sent, the footer is not: the sidecar must drop this stream. (A point after
        # the last yield would fire only if gRPC happened to resume the generator once more.)
        fault_point("client.stream.footer", step)
        yield pb.SaveRequest(footer=pb.SaveFooter(total_bytes=bufs.total_bytes))

    def _await_durable(self, handle: SaveHandle, save_id: str) -> None:
        deadline = time.monotonic() + self.settings.commit_timeout_s
        req = pb.WaitCommittedRequest(identity=self._identity, step=handle.step, save_id=save_id)
        try:
            while True:
                req.timeout_seconds = max(0.0, min(30.0, deadline - time.monotonic()))
                status = self._stub.WaitCommitted(
                    req, timeout=req.timeout_seconds + 30, metadata=self._metadata
                )
                if status.state == pb.COMMIT_STATE_COMMITTED:
                    handle.durable.set_result(Committed(handle.step, status.commit_key))
                    return
                if status.state == pb.COMMIT_STATE_FAILED:
                    raise SaveFailed(status.message)
                if time.monotonic() >= deadline:
                    raise SaveFailed(
                        f"step {handle.step} not committed within {self.settings.commit_timeout_s} s"
                    )
        except Exception as exc:
            self._fail(handle, exc)

    def _fail(self, handle: SaveHandle, exc: BaseException) -> None:
        if isinstance(exc, grpc.RpcError):
            code = exc.code()
            exc = SaveFailed(f"step {handle.step}: {code.name}: {exc.details()}")
        elif not isinstance(exc, SaveFailed):
            exc = SaveFailed(f"step {handle.step}: {exc!r}")
        self.stats["failed"] += 1
        log.warning("%s", exc)
        if not handle.durable.done():
            handle.durable.set_exception(exc)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the newest save is durable (or failed); never raises its error."""
        if self._last is not None:
            try:
                self._last.durable.result(timeout)
            except Exception as exc:
                log.debug("newest save failed: %s", exc)

    # --- restore --------------------------------------------------------------------------

    def resume(self, state: MutableMapping[str, Any]) -> int | None:
        """Apply the resume policy: restore the newest committed step (``auto``,
        ``require``) or nothing (``never``). Returns the restored step or None."""
        policy = self.settings.resume
        if policy == "never":
            return None
        try:
            return self.restore(state)
        except RestoreError as exc:
            if policy == "require" or not isinstance(exc.__cause__, _NothingToRestore):
                raise
            log.info(
                "no committed checkpoint for %s/%s; starting fresh",
                self.settings.namespace,
                self.settings.job,
            )
            return None

    def restore(self, state: MutableMapping[str, Any], step: int | None = None) -> int:
        """Load a committed step (newest by default) into ``state`` in place."""
        req = pb.RestoreRequest(protocol_version=PROTOCOL_VERSION, identity=self._identity)
        if step is not None:
            req.step = step
        try:
            stream = self._stub.Restore(req, timeout=self.settings.rpc_timeout_s, metadata=self._metadata)
            header, tensors = _receive(stream)
        except grpc.RpcError as exc:
            code = exc.code()
            msg = f"restore of {self.settings.namespace}/{self.settings.job}: {exc.details()}"
            if code == grpc.StatusCode.NOT_FOUND:
                raise RestoreError(msg) from _NothingToRestore()
            if code == grpc.StatusCode.UNAVAILABLE:
                raise SidecarUnavailable(msg) from None
            raise RestoreError(f"{code.name}: {msg}") from None
        if header.fallback_reason:
            log.error("restore fell back: %s", header.fallback_reason)
        skeleton = _tree.decode_skeleton(header.tree)
        target = dict(state)
        root = skeleton.get("root")
        if isinstance(root, dict) and _RNG_KEY in root:
            target[_RNG_KEY] = None
        try:
            _tree.load_into(target, skeleton, tensors)
        except (TypeError, ValueError) as exc:
            raise RestoreError(f"step {header.step} does not fit this state: {exc}") from exc
        for key in state:
            state[key] = target[key]
        rng_state = target.get(_RNG_KEY)
        if self.settings.capture_rng and rng_state:
            _rng.restore(rng_state)
        self.last_restore = {
            "step": int(header.step),
            "source": header.source,
            "fallback_reason": header.fallback_reason,
            "bytes": int(header.total_bytes),
        }
        log.info("restored step %d from %s (%d bytes)", header.step, header.source, header.total_bytes)
        return int(header.step)


class _NothingToRestore(Exception):
    pass


def _receive(stream: Iterator[pb.RestoreResponse]) -> tuple[pb.RestoreHeader, list[torch.Tensor]]:
    """Read a restore stream straight into freshly allocated tensors."""
    first = next(stream, None)
    if first is None or first.WhichOneof("msg") != "header":
        raise RestoreError("restore stream did not start with a header")
    header = first.header
    tensors = [torch.empty(tuple(m.shape), dtype=torch_dtype(m.dtype)) for m in header.tensors]
    targets = [as_numpy_bytes(t) for t in tensors if t.numel()]
    index, pos = 0, 0
    for msg in stream:
        data = memoryview(msg.chunk)
        while data:
            if index >= len(targets):
                raise RestoreError("restore stream carries more bytes than its header declared")
            dst = targets[index]
            take = min(len(data), dst.size - pos)
            dst[pos : pos + take] = data[:take]
            data = data[take:]
            pos += take
            if pos == dst.size:
                index, pos = index + 1, 0
    if index != len(targets):
        raise RestoreError(f"restore stream ended early: {index} of {len(targets)} tensors complete")
    return header, tensors


def _tensor_key(t: torch.Tensor) -> tuple[int, int]:
    return (t.data_ptr(), t.numel() * t.element_size())


def _modules(state: Any) -> Iterator[torch.nn.Module]:
    if isinstance(state, torch.nn.Module):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _modules(v)
    elif isinstance(state, list | tuple):
        for v in state:
            yield from _modules(v)


__all__ = ["CheckpointClient", "Committed", "SaveHandle"]
