"""torch.distributed.checkpoint (DCP) through the Strata sidecar.

Save and load with DCP's own API and planner, so DTensor / FSDP2 state saved on N ranks loads on
M ranks (DCP's planner reshards), while the bytes take Strata's data path (staging into reused
host buffers, shared memory, the sidecar's diffs and uploads, one job-level COMMIT)::

    from trainer_client import CheckpointClient
    from trainer_client.dcp import StrataReader, StrataWriter

    client = CheckpointClient(job="llm")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    writer = StrataWriter(client)                                    # one for the job
    dcp.save(state, storage_writer=writer, checkpoint_id=step)      # returns once committed
    # or staged once, into the client's reused staging buffers (the only stall and the only
    # copy: the save sends the tensors from there), the rest in the background:
    future = dcp.async_save(state, storage_writer=writer, checkpoint_id=step, process_group=group)

    # any number of ranks: the newest committed step (or StrataReader(client, step=...))
    dcp.load(state, storage_reader=StrataReader(client))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

How a save maps onto Strata (docs/guides/dcp.md has the whole design):

- every rank's ``write_data`` saves its write items as one Strata save of step ``step`` whose state
  is ``{"dcp": {item key: tensor}}`` (a BYTE_IO item as a uint8 tensor of DCP's bytes);
- the coordinator (rank 0) keeps its own items until ``finish``, where DCP hands it the global
  ``Metadata``: its save then carries the items and the Metadata as JSON (never pickle), and
  ``finish`` returns once the job-level COMMIT exists. DCP's finish and Strata's COMMIT are one
  commit: a step without the coordinator's save never commits, and nothing reads a step without
  its COMMIT.

A load reads the Metadata from rank 0's snapshot (its header only), then, rank by rank, the
snapshots holding what this rank's plan needs, through this rank's sidecar (its memory, a peer's,
or storage), whatever number of ranks saved them.

Values DCP pickles (BYTE_IO items: optimizer hyperparameters, plain Python values) are checked
with ``torch.load(weights_only=True)`` and pickled again before DCP's planner unpickles them:
bytes from a bucket never reach a full unpickler. Types the weights-only unpickler refuses can be
allowed with ``torch.serialization.add_safe_globals``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from sidecar.api import DCP_METADATA_KEY, RNG_STATE_KEY
from trainer_client import _loaders, _rng, _tree
from trainer_client._dcp_metadata import Location, MetadataError, decode, encode, item_key
from trainer_client._handles import SaveHandle
from trainer_client._reshard import per_rank_readers
from trainer_client._staging import Lease
from trainer_client.data import AllRanksState
from trainer_client.errors import NothingToRestore, RestoreError, SaveFailed

if TYPE_CHECKING:  # the client imports this module (for its DCP route), not the other way
    from trainer_client.client import CheckpointClient

log = logging.getLogger("strata.dcp")
T = TypeVar("T")

#: Keys of a DCP save's Strata state: the write items, and (rank 0) the Metadata as JSON.
ITEMS_KEY = "dcp"
METADATA_KEY = DCP_METADATA_KEY


def _step(checkpoint_id: str | os.PathLike[str] | int | None) -> int | None:
    """A DCP ``checkpoint_id`` as a Strata step: an int, or a string of digits."""
    if checkpoint_id is None:
        return None
    text = str(checkpoint_id).strip()
    if isinstance(checkpoint_id, bool) or not text.isdigit():
        raise ValueError(
            f"checkpoint_id {checkpoint_id!r}: a Strata checkpoint is named by its step, a "
            "non-negative integer"
        )
    return int(text)


class StrataWriter(StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` (and ``AsyncStager``) saving step ``step`` through ``client``.

    Every rank of the client's job takes part in every save, over DCP's default process group
    (or a group of the same ranks), with rank 0 as DCP's coordinator (its sidecar writes the
    COMMIT). The step is given here or as ``checkpoint_id`` (``dcp.save(..., checkpoint_id=step)``).
    ``dcp.save`` returns once the step is committed; a failure of any rank's save fails it on
    every rank. Keep one writer for the job (its staging buffers are reused from save to save)
    and one save of it in flight: wait for an ``async_save``'s future before the next save.

    As an ``AsyncStager`` (``dcp.async_save`` uses the writer for staging when no stager is
    given), ``stage()`` copies the local tensors (DTensor shards included) once, straight into
    the client's staging buffers (the shared-memory segment the sidecar reads), which is all the
    training thread waits for; planning, the send and the upload run in DCP's background thread,
    and the save sends the staged tensors from where ``stage()`` put them, without copying them
    again. Only when no buffer of the client is free (with shared memory: the sidecar holds the
    last committed snapshot in one, a save still in flight uses the other) does ``stage()`` copy
    into fresh memory instead (``last_stage_reused`` is then False), and that save copies again.
    """

    _synchronize_after_execute = False  # stage() is synchronous: nothing to wait for

    def __init__(self, client: CheckpointClient, step: int | None = None) -> None:
        super().__init__()
        self.client = client
        self.step = step
        self._coordinator = False
        #: the coordinator's own items, saved in finish() with the Metadata
        self._pending: dict[str, torch.Tensor] | None = None
        #: the client buffer the newest stage() staged into (None: fresh memory)
        self._lease: Lease | None = None
        #: where stage() copies when the client has no buffer to lend (reused while shapes hold)
        self._spare: list[torch.Tensor] = []
        #: the handle of the newest save (the coordinator's is durable when finish() returns)
        self.last_handle: Any = None
        #: seconds the newest stage() took (what dcp.async_save stalls the training thread for),
        #: and whether it copied into the client's buffers without allocating them
        self.last_stage_s = 0.0
        self.last_stage_reused = False

    # --- StorageWriter -------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        step = _step(checkpoint_id)
        if step is not None:
            self.step = step
        self._pending = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        s = self.client.settings
        if self.step is None:
            raise ValueError(
                "StrataWriter: no step to save: pass StrataWriter(client, step=N) or "
                "dcp.save(..., checkpoint_id=N)"
            )
        if not kwargs.get("use_collectives", True):
            raise ValueError(
                "StrataWriter: a save without collectives (use_collectives=False) has no global "
                "metadata; Strata commits one checkpoint for every rank"
            )
        rank = kwargs.get("rank")
        if rank is not None and rank != s.rank:
            raise ValueError(
                f"StrataWriter: DCP runs this process as rank {rank} but its Strata client is rank "
                f"{s.rank}: save over the default process group (every rank of the job)"
            )
        if is_coordinator != (s.rank == 0):
            raise ValueError(
                f"StrataWriter: DCP's coordinator must be rank 0 (its sidecar writes the COMMIT); "
                f"this is rank {s.rank}, coordinator={is_coordinator}"
            )
        self._coordinator = is_coordinator
        self._pending = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank = self.client.settings.rank
        items: dict[str, torch.Tensor] = {}
        results: list[WriteResult] = []
        for item in plan.items:
            key = item_key(item.index)
            if key in items:
                raise ValueError(f"StrataWriter: the plan writes {item.index} twice")
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                if not isinstance(data, io.BytesIO):
                    raise TypeError(f"{item.index.fqn}: a BYTE_IO item resolved to {type(data).__name__}")
                raw = data.getvalue()
                tensor = (
                    torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                    if raw
                    else torch.empty(0, dtype=torch.uint8)
                )
            else:
                if not isinstance(data, torch.Tensor):
                    raise TypeError(f"{item.index.fqn}: a tensor item resolved to {type(data).__name__}")
                tensor = data.detach()
            items[key] = tensor
            nbytes = tensor.numel() * tensor.element_size()
            results.append(
                WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=Location(rank, key, nbytes))
            )
        lease = self._lease
        if lease is not None:
            # The client sends a staged tensor from where stage() put it when the save lists the
            # staged tensors in the order they lie there, after what it copies into the room
            # before them: DCP's pickled values (made at planning, after stage(); a few KiB) and
            # any tensor not lying whole and contiguous there (a custom planner's narrowed views
            # or new tensors: a save names each tensor as one run of bytes). DCP's default planner
            # writes each staged tensor whole.
            order = {key: lease.offset(t) for key, t in items.items()}
            items = {key: items[key] for key in sorted(items, key=lambda k: _placement_order(order[k]))}
        if self._coordinator:
            self._pending = items  # saved with the Metadata, in finish()
        else:
            self._lease = None
            self.last_handle = self._save({ITEMS_KEY: items})
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._pending is None:
            raise RuntimeError("StrataWriter.finish() before write_data() on the coordinator")
        items, self._pending, self._lease = self._pending, None, None
        locations: dict[MetadataIndex, Location] = {}
        for per_rank in results:
            for wr in per_rank:
                if not isinstance(wr.storage_data, Location):
                    raise TypeError(
                        f"{wr.index}: written by another storage writer ({type(wr.storage_data).__name__})"
                    )
                locations[wr.index] = wr.storage_data
        text = encode(metadata, locations)
        handle = self._save({ITEMS_KEY: items, METADATA_KEY: text})
        self.last_handle = handle
        handle.result(self.client.settings.commit_timeout_s + 30)  # raises SaveFailed
        log.info("step %d committed through DCP (%d items)", self.step, len(locations))

    def _save(self, state: dict[str, Any]) -> Any:
        assert self.step is not None
        handle = self.client._save_plain(self.step, state)
        if handle.skipped:
            raise SaveFailed(f"step {self.step}: the save was skipped")
        return handle

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            return _step(checkpoint_id) is not None
        except ValueError:
            return False

    # --- AsyncStager ----------------------------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` whose tensors (DTensors' local shards) lie in the client's
        staging buffers, where its save sends them from: safe to train on once this returns.

        The one copy of a DCP async save: the client lends a buffer the sidecar no longer holds
        and no save is using (the double buffering of ``CheckpointClient``), so the save that
        follows never overwrites a snapshot still being sent or kept. When there is none, the
        tensors are copied into fresh memory (``last_stage_reused`` False) and that save copies
        them again, as a save of live tensors does."""
        t0 = time.perf_counter()
        found: list[tuple[str, torch.Tensor]] = []

        def collect(path: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
            found.append((repr(path), t))  # a unique name: the layout remembers tensors by it
            return t

        _walk(state_dict, (), collect)
        lease = self.client._lease(found, _arena_estimate(state_dict))
        if lease is not None:
            staged = iter(lease.views)
            self._spare = []  # a lease per save from here on, most likely
        else:  # a spare set reused from save to save; the save copies it into the client's buffers
            spare = self._spare
            if [(t.shape, t.dtype) for t in spare] != [(t.shape, t.dtype) for _, t in found]:
                spare = self._spare = [torch.empty(t.shape, dtype=t.dtype) for _, t in found]
            staged = iter([s.copy_(t) for s, (_, t) in zip(spare, found, strict=True)])
        out = _walk(state_dict, (), lambda _, t: next(staged))
        self._lease = lease
        self.last_stage_reused = lease is not None and not lease.allocated
        self.last_stage_s = time.perf_counter() - t0
        return out

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        lease, self._lease, self._spare = self._lease, None, []
        if lease is not None:  # staged, never saved: the client's buffer is free again
            self.client._return_lease(lease)


#: Bytes DCP's pickled form of a plain value takes, about (torch.save's zip container: ~1.3 KiB).
_PICKLED_VALUE_BYTES = 2048


def _walk(
    obj: Any, path: tuple[Any, ...], leaf: Callable[[tuple[Any, ...], torch.Tensor], torch.Tensor]
) -> Any:
    """``obj`` with each tensor (a DTensor's local shard, a ShardedTensor's local shards,
    detached) replaced by ``leaf(path, it)``."""
    if isinstance(obj, DTensor):
        local = leaf(path, obj.to_local().detach())
        # The same DTensor over the staged shard (its spec: mesh, placements, global shape).
        return DTensor(local, obj._spec, requires_grad=False)
    if isinstance(obj, ShardedTensor):  # TorchRec's sharded tables and their optimizer state
        shards = [
            Shard(leaf((*path, i), s.tensor.detach()), s.metadata) for i, s in enumerate(obj.local_shards())
        ]
        # The same ShardedTensor (global metadata: every rank's shards) over the staged shards,
        # as DCP's own stager rebuilds it; tensor methods (detach) are not defined on it.
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, obj.metadata(), process_group=obj._process_group, init_rrefs=obj._init_rrefs
        )
    if isinstance(obj, torch.Tensor):
        return leaf(path, obj.detach())
    if isinstance(obj, Mapping):
        return {k: _walk(v, (*path, k), leaf) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_walk(v, (*path, i), leaf) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_walk(v, (*path, i), leaf) for i, v in enumerate(obj))
    return obj  # plain values: DCP pickles them at planning time, off the training thread


def _arena_estimate(obj: Any) -> int:
    """Bytes a save of ``obj`` sends beside its tensors, about: DCP pickles each plain value (a
    list of plain values, a tuple: one value)."""
    if isinstance(obj, torch.Tensor):
        return 0
    if isinstance(obj, Mapping):
        return sum(_arena_estimate(v) for v in obj.values())
    if isinstance(obj, list) and any(isinstance(v, Mapping | list | torch.Tensor) for v in obj):
        return sum(_arena_estimate(v) for v in obj)
    if isinstance(obj, str | bytes):  # every rank's data position or random streams: ~21 KB a rank
        return _PICKLED_VALUE_BYTES + len(obj)
    return _PICKLED_VALUE_BYTES + (64 * len(obj) if isinstance(obj, list | tuple) else 0)


def _placement_order(offset: int | None) -> int:
    """Sort key of an item: what the client copies (None) first, then by offset."""
    return -1 if offset is None else offset


class StrataReader(StorageReader):
    """A DCP ``StorageReader`` loading a step saved through :class:`StrataWriter`, on any number of
    ranks. ``step``: the step to load (or ``checkpoint_id``); by default the step this attempt
    restores (the newest committed one when the job started). After a load from a checkpoint of
    another world size, this rank's next checkpoint is a full one.

    ``sources`` tells, after a load, where each rank's snapshot that was read came from
    (``memory``, ``peer``, ``storage``)."""

    def __init__(self, client: CheckpointClient, step: int | None = None) -> None:
        super().__init__()
        self.client = client
        self.step = step
        self.position: tuple[int, int] | None = None
        self.world_size = 0
        self.sources: dict[int, str] = {}
        #: each rank's snapshot that was read: its restore class (exact, or stored)
        self.classes: dict[int, str] = {}
        self._locations: dict[MetadataIndex, Location] | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        step = _step(checkpoint_id)
        if step is not None:
            self.step = step
        self.position, self._locations, self.sources, self.classes = None, None, {}, {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise RestoreError("a Strata DCP checkpoint has one global metadata, no rank-local ones")
        header, _ = self.client._read_rank(0, self.step, header_only=True)
        where = f"step {header.step} of {self.client.settings.namespace}/{self.client.settings.job}"
        try:
            skeleton = _tree.decode_skeleton(header.tree)
        except ValueError as exc:
            raise RestoreError(f"{where}: rank 0's snapshot: {exc}") from None
        root = skeleton["root"]
        text = root.get(METADATA_KEY) if isinstance(root, dict) else None
        if not isinstance(text, str):
            raise RestoreError(
                f"{where} was not saved through torch.distributed.checkpoint (rank 0's snapshot holds "
                "no DCP metadata): restore it with CheckpointClient.restore()"
            )
        try:
            metadata, locations = decode(text)
        except MetadataError as exc:
            raise RestoreError(f"{where}: {exc}") from None
        for index, loc in locations.items():
            if loc.rank >= header.world_size:
                raise RestoreError(
                    f"{where}: {index.fqn} lies on rank {loc.rank}, but {header.world_size} ranks saved it"
                )
        self.position = (int(header.attempt), int(header.step))
        self.world_size = int(header.world_size)
        self._locations = locations
        log.info(
            "loading step %d (saved by %d ranks) on rank %d of %d",
            header.step,
            header.world_size,
            self.client.settings.rank,
            self.client.settings.world_size,
        )
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._locations is None or self.position is None:
            raise RestoreError("StrataReader: metadata from elsewhere; let dcp.load call read_metadata()")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._locations is not None and self.position is not None
        attempt, step = self.position
        by_rank: dict[int, list[tuple[ReadItem, Location]]] = {}
        for req in plan.items:
            loc = self._locations.get(req.storage_index)
            if loc is None:
                raise RestoreError(f"step {step}: the checkpoint does not say where {req.storage_index} lies")
            by_rank.setdefault(loc.rank, []).append((req, loc))
        # One source rank at a time: at most one rank's snapshot is held here.
        for rank in sorted(by_rank):
            header, tensors = self.client._read_rank(rank, step, attempt)
            self.sources[rank] = header.source
            self.classes[rank] = header.restore_class or "stored"
            items = _items(header, tensors, f"step {step} rank {rank}")
            for req, loc in by_rank[rank]:
                src = items.get(loc.key)
                where = f"step {step}: {req.storage_index.fqn}"
                if src is None or src.numel() * src.element_size() != loc.nbytes:
                    raise RestoreError(
                        f"{where}: rank {rank}'s snapshot does not hold {loc.key!r} as recorded"
                    )
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, _checked_bytes(src, where))
                    continue
                piece = _narrow(src, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != piece.size():
                    raise RestoreError(
                        f"{where}: {tuple(piece.size())} stored, {tuple(target.size())} wanted"
                    )
                target.copy_(piece)
                planner.commit_tensor(req, target)
            del items, tensors
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            return _step(checkpoint_id) is not None
        except ValueError:
            return False


class _Saves:
    """``client.save`` of state DCP saves: the client's writer, the process group its background
    collectives run in, and the newest save."""

    def __init__(self, client: CheckpointClient) -> None:
        import torch.distributed as dist

        self.writer = StrataWriter(client)
        # A group of its own: the save's collectives run in DCP's thread beside training's.
        self.group = dist.new_group(backend="gloo")
        self.last: SaveHandle | None = None

    def wait(self, timeout: float | None = None) -> None:
        last = self.last
        if last is not None:
            futures_wait([last.durable], timeout)


def save_state(client: CheckpointClient, step: int, state: Any) -> SaveHandle:
    """``client.save(step, state)`` for state holding DTensors or ShardedTensors:
    ``dcp.async_save`` through the client's :class:`StrataWriter` (every rank takes part; DCP's
    planner decides which rank writes what), of the state's view (:class:`_View`: every rank's
    data reader positions and random streams as replicated values). Returns once ``stage()`` has
    copied the state into the client's staging buffers; ``durable`` once the step is committed.
    One DCP save is in flight at a time: the next waits for this one (a save cannot be skipped on
    one rank alone)."""
    import torch.distributed.checkpoint as dcp

    nested = _nested_modules_or_optimizers(state)
    if nested:
        raise _tree.StateError(
            f"step {step}: {nested}: state saved through torch.distributed.checkpoint holds its "
            "modules and optimizers at the top level (DCP saves the state dicts of those only); "
            "move them up, e.g. state = {'model': model, 'optimizer': optimizer, ...}"
        )
    saves = client._dcp_saves
    if saves is None:
        saves = client._dcp_saves = _Saves(client)
    saves.wait()
    handle = SaveHandle(step)
    t0 = time.perf_counter()
    view = _View(client, state, loading=False).view
    response = dcp.async_save(
        view, storage_writer=saves.writer, checkpoint_id=str(step), process_group=saves.group
    )
    # (a response with a staging future only comes from a stager whose stage() returns one)
    upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
    handle.stall_s = time.perf_counter() - t0
    handle.staged.set_result(None)
    writer = saves.writer

    def uploaded(done: Any) -> None:
        try:
            exc = done.exception()
        except BaseException as cancelled:  # a durable left unresolved would hang the next save
            exc = cancelled
        if exc is not None:
            handle.durable.set_exception(exc)
            return
        # This rank's save: durable once the job-level COMMIT exists (on the coordinator, already).
        own = writer.last_handle
        if own is None:
            handle.durable.set_exception(SaveFailed(f"step {step}: DCP saved nothing through Strata"))
            return
        own.durable.add_done_callback(lambda d: _copy_outcome(d, handle.durable))

    upload.add_done_callback(uploaded)
    saves.last = handle
    return handle


def _copy_outcome(src: Any, dst: Any) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


def load_resume(client: CheckpointClient, state: Any, step: int | None) -> int:
    """``client.restore(state)`` for state holding DTensors or ShardedTensors: ``dcp.load`` through a
    :class:`StrataReader` (``step``, or the step this attempt restores) into the state's view
    (:class:`_View`), then this rank's reader positions, random streams and loaders; the step loaded.
    RestoreError (from a nothing-to-restore cause, which ``resume()`` takes as a fresh start)
    when the job has no committed checkpoint."""
    import torch.distributed.checkpoint as dcp

    nested = _nested_modules_or_optimizers(state)
    if nested:
        raise RestoreError(
            f"{nested}: state loaded through torch.distributed.checkpoint holds its modules and "
            "optimizers at the top level (DCP loads the state dicts of those only); move them up, "
            "as they were when the checkpoint was saved"
        )
    if step is None:
        try:
            header, _ = client._read_rank(0, header_only=True)
        except RestoreError as exc:
            if isinstance(exc.__cause__, NothingToRestore):
                raise RestoreError(f"{exc} (loading sharded state through DCP)") from exc.__cause__
            raise
        step = int(header.step)
    reader = StrataReader(client, step=step)
    metadata = reader.read_metadata()
    _check_lazy_optimizers(state, metadata)
    prepared = _View(client, state, loading=True, saved=set(metadata.state_dict_metadata))
    dcp.load(prepared.view, storage_reader=reader, planner=_LoadPlanner())
    assert reader.position is not None
    prepared.loaded(reader.position[1], reader.world_size)
    client.last_restore = {
        "step": reader.position[1],
        "source": "dcp",
        "fallback_reason": "",
        "bytes": 0,
        "shared_memory": False,
        "replica_sources": {},
        "saved_by": reader.world_size,
        # each rank's snapshot that was read: where it came from (memory, peer, storage)
        "sources": dict(reader.sources),
        # one class for the gang's attempt ("mixed" would be a fault)
        "restore_class": next(iter(classes))
        if len(classes := set(reader.classes.values())) == 1
        else "mixed",
    }
    return reader.position[1]


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a TorchRec table with no shard on this rank does not
    make it take the checkpoint for one saved by torch 2.3 or older. DCP guesses so when a key the
    checkpoint holds is missing from this rank's flattened state dict but present under 2.3's
    names; a table-wise sharded table this rank holds no shard of is such a key, and under 2.3's
    names a nested plain value (a data reader's ``{"ranks": ...}``) is not found: "Missing key in
    checkpoint state_dict". The same check, with those tables left out of it."""

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        if self.flatten_state_dict:
            missing = set(self.metadata.state_dict_metadata) - set(self.state_dict)
            if missing:
                _version._derived_version = "2_3"
                try:
                    old, old_mappings = flatten_state_dict(self.original_state_dict)
                finally:
                    _version._derived_version = None
                if (set(old) - _shardless(self.original_state_dict)) & missing:
                    self.state_dict, self.mappings = old, old_mappings
        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)


def _shardless(state_dict: dict[str, Any]) -> set[str]:
    """The fqns of the ShardedTensors in ``state_dict`` holding no shard on this rank."""
    flat, _ = flatten_state_dict(state_dict)
    return {fqn for fqn, v in flat.items() if isinstance(v, ShardedTensor) and not v.local_shards()}


class _RNGStreams:
    """This rank's global random streams, as a data reader of ``AllRanksState`` (its state: plain
    JSON values): every rank's gathered into one replicated value DCP saves."""

    def state_dict(self) -> dict[str, Any]:
        return _rng.to_json(_rng.capture())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("_View.loaded() restores this rank's own streams, or none")


class _View:
    """What ``client.save`` / ``client.resume`` hand DCP for ``state``: DCP saves plain values
    from its coordinator only, so every per-rank value goes in as every rank's, gathered into one
    replicated value (``AllRanksState``): each data reader found in ``state`` (a StatefulDataLoader,
    a ResumableLoader or ResumableDistributedSampler), and, with ``capture_rng``, the global
    random streams (under ``RNG_STATE_KEY``). Only the containers along the path to a reader are
    copied: everything else is the user's own, loaded in place.

    ``loading``: the readers' places hold placeholders of their saved form, filled by
    ``dcp.load``; :meth:`loaded` then hands each its value, writes back the plain values DCP put
    in the copied containers (``state["epoch"]``), restores the random streams and arms the
    loaders (``_loaders.after_restore``), in the order ``CheckpointClient.restore`` does.
    ``saved``: the fqns the checkpoint holds (a reader it lacks is named before anything loads)."""

    def __init__(
        self,
        client: CheckpointClient,
        state: Any,
        *,
        loading: bool,
        saved: set[str] | None = None,
    ) -> None:
        self.client = client
        self.state = state
        self.readers = [path for path, _ in per_rank_readers(state, ())]
        self.view: dict[str, Any] = dict(state)
        self.rng = client.settings.capture_rng
        if loading:
            assert saved is not None
            for path in self.readers:
                if _fqn((*path, "ranks")) not in saved:
                    raise RestoreError(
                        f"state{''.join(f'[{k!r}]' for k in path)} "
                        f"({type(_get(state, path)).__name__}): the checkpoint holds no position of "
                        "it for every rank (saved by client.save before per-rank readers were, or "
                        "without it): resume with the state it was saved with"
                    )
            self.rng = self.rng and _fqn((RNG_STATE_KEY, "ranks")) in saved
        for path in self.readers:
            reader = _get(state, path)
            self._put(path, {"ranks": ""} if loading else AllRanksState(reader).state_dict())
        if self.rng:
            self.view[RNG_STATE_KEY] = {"ranks": ""} if loading else AllRanksState(_RNGStreams()).state_dict()

    def _put(self, path: tuple[Any, ...], value: Any) -> None:
        """Set ``value`` at ``path`` of the view, copying the user's containers on the way."""
        node: Any = self.view
        for key in path[:-1]:
            child = node[key]
            if not getattr(child, "_strata_view_copy", False):
                child = _Copied(child) if isinstance(child, Mapping) else _CopiedList(child)
                node[key] = child
            node = child
        node[path[-1]] = value

    def loaded(self, step: int, saved_by: int) -> None:
        for path in self.readers:
            where = f"state{''.join(f'[{k!r}]' for k in path)}"
            try:
                AllRanksState(_get(self.state, path)).load_state_dict(_get(self.view, path))
            except ValueError as exc:
                raise RestoreError(f"step {step}: {where}: {exc}") from None
        _write_back(self.state, self.view, set(self.readers))
        if self.rng:
            self._restore_rng(step, saved_by)
        _loaders.after_restore(self.state)  # the loaders' next iter() must not redraw the epoch's seeds

    def _restore_rng(self, step: int, saved_by: int) -> None:
        s = self.client.settings
        try:
            ranks = json.loads(self.view[RNG_STATE_KEY]["ranks"])
        except (KeyError, TypeError, ValueError) as exc:
            raise RestoreError(f"step {step}: the saved random streams are not JSON ({exc})") from None
        if not isinstance(ranks, list) or len(ranks) != saved_by:
            raise RestoreError(f"step {step}: the saved random streams are not one per rank")
        if saved_by != s.world_size:  # another partition of the data: no stream continues a rank's
            log.warning(
                "step %d was saved by %d ranks: rank %d keeps its own random generators",
                step,
                saved_by,
                s.rank,
            )
            return
        try:
            _rng.restore(_rng.from_json(ranks[s.rank]))
        except (TypeError, ValueError) as exc:
            raise RestoreError(f"step {step}: rank {s.rank}'s saved random streams: {exc}") from None


class _Copied(dict[Any, Any]):
    """A container of the user's state copied into a :class:`_View` (written back after a load)."""

    _strata_view_copy = True


class _CopiedList(list[Any]):
    _strata_view_copy = True


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        node = node[key]
    return node


def _fqn(path: tuple[Any, ...]) -> str:
    """DCP's name of the value at ``path`` (its flattened state dict's key)."""
    return ".".join(str(k) for k in path)


def _write_back(original: Any, copy: Any, skip: set[tuple[Any, ...]], path: tuple[Any, ...] = ()) -> None:
    """Put into the user's ``original`` containers what ``dcp.load`` put into the view's copies of
    them (plain values it replaced: ``state["epoch"]``); the copies along readers' paths are
    walked, never put in."""
    keys = list(original) if isinstance(original, Mapping) else range(len(original))
    along = {p[:i] for p in skip for i in range(1, len(p))}  # containers holding a reader
    for key in keys:
        here = (*path, key)
        value = copy[key]
        if here in skip:
            continue
        # DCP replaces a container without tensors (a list holding a reader's saved form) whole:
        # walk it too, so the user's container, and the reader in it, stay.
        if getattr(value, "_strata_view_copy", False) or (
            here in along and isinstance(value, Mapping | list | tuple)
        ):
            _write_back(original[key], value, skip, here)
        elif value is not original[key] and not isinstance(original, tuple):
            original[key] = value


def _optimizers_at(node: Any) -> Iterator[tuple[tuple[Any, ...], torch.optim.Optimizer]]:
    """(path, optimizer) of each optimizer in ``node``, however deeply nested in its mappings,
    lists and tuples (each container once): DCP names its values by that path
    (``train.optimizer.state...``)."""
    return _objects_at(node, torch.optim.Optimizer)


def _objects_at(
    node: Any, kind: type[T], path: tuple[Any, ...] = (), seen: set[int] | None = None
) -> Iterator[tuple[tuple[Any, ...], T]]:
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, kind):
        yield path, node
    elif isinstance(node, Mapping):
        for k, v in node.items():
            yield from _objects_at(v, kind, (*path, k), seen)
    elif isinstance(node, list | tuple):
        for i, v in enumerate(node):
            yield from _objects_at(v, kind, (*path, i), seen)


def _nested_modules_or_optimizers(state: Any) -> str:
    """The modules and optimizers below the top level of ``state``, named, or "". DCP calls
    ``state_dict()`` on the top-level values only: one nested deeper would be pickled whole
    (a module's code and all), and no resume could load it."""
    nested = [
        f"state{''.join(f'[{k!r}]' for k in path)} ({type(obj).__name__})"
        for kind in (torch.nn.Module, torch.optim.Optimizer)
        for path, obj in _objects_at(state, kind)
        if len(path) > 1
    ]
    return ", ".join(nested)


def _check_lazy_optimizers(state: Any, metadata: Metadata) -> None:
    """RestoreError naming an optimizer of ``state`` whose parameters' state the checkpoint holds
    but which has not created it yet (it does so lazily, at its first step): DCP loads into the
    state dict the live optimizer gives, so that state would silently stay unloaded."""
    saved = metadata.state_dict_metadata
    for path, opt in _optimizers_at(state):
        params = getattr(opt, "params", None)  # TorchRec's KeyedOptimizer: its parameters by name
        if isinstance(params, Mapping):
            named = list(params.items())
        else:  # torch's state dict numbers the parameters in the order of its groups
            named = [(str(i), p) for i, p in enumerate(p for g in opt.param_groups for p in g["params"])]
        prefix = _fqn((*path, "state"))
        lazy = [
            name
            for name, p in named
            if p not in opt.state and any(fqn.startswith(f"{prefix}.{name}.") for fqn in saved)
        ]
        if lazy:
            raise RestoreError(
                f"state{''.join(f'[{k!r}]' for k in path)} ({type(opt).__qualname__}): the checkpoint "
                f"holds optimizer state for {len(lazy)} parameters it has not created yet (e.g. "
                f"{lazy[0]}): create its state before resuming (TorchRec: optimizer.init_state(); "
                "other optimizers: one step), as its first step would"
            )


def committed_step(client: CheckpointClient) -> int | None:
    """The step a ``StrataReader(client)`` loads (the step this attempt restores: the newest
    committed one when the job started; later, the newest this attempt committed), or None when
    the job has no committed checkpoint yet::

        step = committed_step(client)
        if step is not None:
            dcp.load(state, storage_reader=StrataReader(client, step=step))
    """
    try:
        header, _ = client._read_rank(0, header_only=True)
    except RestoreError as exc:
        if isinstance(exc.__cause__, NothingToRestore):
            return None
        raise
    return int(header.step)


def _items(header: Any, tensors: list[torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The write items of a rank's snapshot (its ``dcp`` dict)."""
    try:
        value = _tree.rebuild(_tree.decode_skeleton(header.tree), tensors)
    except ValueError as exc:
        raise RestoreError(f"{where}: {exc}") from None
    items = value.get(ITEMS_KEY) if isinstance(value, dict) else None
    if not isinstance(items, dict) or not all(isinstance(t, torch.Tensor) for t in items.values()):
        raise RestoreError(f"{where} was not saved through torch.distributed.checkpoint (no DCP items)")
    return items


def _narrow(t: torch.Tensor, offsets: Iterable[int], lengths: Iterable[int]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start + length > t.size(dim):
            raise RestoreError(
                f"a read of [{start}, {start + length}) along dim {dim} of a {tuple(t.size())} chunk"
            )
        t = t.narrow(dim, start, length)
    return t


def _checked_bytes(t: torch.Tensor, where: str) -> io.BytesIO:
    """DCP's pickled value, loaded with the weights-only unpickler and pickled again: what DCP's
    planner then unpickles (with full pickle) was written here, from plain values."""
    raw = t.contiguous().numpy().tobytes()
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:
        raise RestoreError(
            f"{where}: refused: the stored value does not load with torch.load(weights_only=True) "
            f"({exc}); allow its types with torch.serialization.add_safe_globals if you trust them"
        ) from None
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out


__all__ = ["StrataReader", "StrataWriter", "committed_step"]
