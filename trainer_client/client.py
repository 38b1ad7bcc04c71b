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

import contextlib
import logging
import operator
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
import torch
import torch.distributed as dist

from sidecar.api import (
    DCP_METADATA_KEY,
    EXIT_RESTART_IN_PLACE,
    LIMIT_SPENT_MARKER,
    MAX_STEP,
    PROTOCOL_VERSION,
    RESHARD_MARKER,
    RNG_STATE_KEY,
    SHM_HANDOVER_CAPABILITY,
    SHM_HANDOVER_SOCKET,
    SHM_STAGING_CAPABILITY,
    TOKEN_METADATA_KEY,
    channel_options,
    pb,
    pb_grpc,
)
from sidecar.faults import fault_point
from trainer_client import _loaders, _receive, _replicas, _reshard, _rng, _state, _tree
from trainer_client._handles import Committed, SaveHandle
from trainer_client._overlap import Deferral, Overlap
from trainer_client._overlap import tensor_key as _tensor_key
from trainer_client._preempt import SigtermWatch
from trainer_client._staging import (
    HostBuffers,
    Lease,
    Placement,
    SegmentFactory,
    Slot,
    Stager,
    dtype_name,
    lease_layout,
    span_bytes,
    total_bytes,
)
from trainer_client._tracking import RowTracker
from trainer_client.config import ClientSettings
from trainer_client.errors import (
    NothingToRestore,
    Preempted,
    RestartInPlace,
    RestartLimitSpent,
    RestoreError,
    SaveFailed,
    SaveSkipped,
    SidecarUnavailable,
    TornSnapshot,
)

T = TypeVar("T")
_DDP = torch.nn.parallel.DistributedDataParallel

log = logging.getLogger("strata.client")
_RNG_KEY = RNG_STATE_KEY
CLIENT_VERSION = "0.1.0"
#: Seconds a DCP writer's stage() waits for the previous save (already sent) to be committed
#: before staging outside this client's buffers (see CheckpointClient._lease).
LEASE_WAIT_S = 2.0
#: Seconds between the in-place restart instruction and the client ending the process itself
#: (STRATA_RESTART_GRACE_S): a training thread that reaches save() meanwhile exits through
#: RestartInPlace instead.
RESTART_GRACE_S = 2.0


class CheckpointClient:
    """Saves and restores one rank's training state through the Strata sidecar.

    Overlapped staging: the parameters and state of the optimizers in the saved ``state`` (and of
    ``optimizers``) are copied while the next forward/backward runs; an optimizer step pre-hook
    waits for the copy before the step mutates them. Only what is proven untouched until the copy
    ends is deferred (``trainer_client._overlap``: optimizers whose step hooks run, nothing that
    forward or backward writes, version counters checked); everything else (BatchNorm
    statistics, Embedding(max_norm=...) weights, fused TBE tables, RNG, data-reader state) is
    copied inside ``save()``. A deferred tensor changed outside ``optimizer.step()`` before its
    copy ended fails that save with :class:`TornSnapshot` (nothing committed) and its optimizer
    is copied inside ``save()`` from then on; writes through ``.data`` escape the check: turn
    overlap off with ``overlap="off"`` (STRATA_OVERLAP=off) for such scripts.

    Staging buffers are allocated and pre-faulted off the training thread once the state is known
    (``resume()``/``restore()``, and again after the first optimizer step creates lazy state), so
    the first ``save()`` stalls for the copy, not for page faults.

    ``save_on_sigterm``: seconds (counted from the signal) a save after SIGTERM may take to become
    durable; None (default, or STRATA_SAVE_ON_SIGTERM_S unset) leaves SIGTERM alone. Kubernetes
    sends SIGTERM to a preempted or drained pod and kills it ``terminationGracePeriodSeconds``
    later. With a budget, a SIGTERM handler (installed by a client created in the main thread,
    calling the handler it replaced if that is a Python function, put back by ``close()``) only
    sets :attr:`preempted`; the next ``save()`` is the safe point: it waits for a save already in
    flight (it counts), saves that step, waits for it to become durable within the budget, logs
    the outcome and raises :class:`Preempted` (a ``SystemExit`` with status 143, 128 + SIGTERM,
    no traceback). When a peer rank of this attempt is already gone (a gang restart evicts the
    survivors) no step can commit: that ``save()`` skips the save and raises at once. Save at
    the next step after the signal::

        client = CheckpointClient(save_on_sigterm=20)
        for step in range(start, steps):
            train_step()
            if step % 100 == 0 or client.preempted:
                client.save(step, state)   # after SIGTERM: save, wait durable, exit 143
    """

    def __init__(
        self,
        job: str | None = None,
        *,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        replicated: Iterable[Any] = (),
        settings: ClientSettings | None = None,
        **overrides: Any,
    ) -> None:
        self.settings = settings or ClientSettings.from_env(job=job, **overrides)
        s = self.settings
        self._identity = pb.Identity(
            namespace=s.namespace,
            job=s.job,
            rank=s.rank,
            world_size=s.world_size,
            attempt=s.restart,  # the wire's name of the trainer's restart count (informational)
            generation=s.generation,
        )
        self._channel = grpc.insecure_channel(s.target, options=channel_options(s.max_message_bytes))
        self._stub = pb_grpc.CheckpointerStub(self._channel)
        self._metadata = ((TOKEN_METADATA_KEY, s.token),) if s.token else ()
        self.server_info = self._handshake()
        self._stager = Stager()
        self._lease_stager = Stager()  # a DCP writer's stage(), on the training thread (see _lease)
        self._segments = self._shared_memory()
        #: the sidecar refused this process its checkpoint's files: restores ask for a copy
        self._files_refused = False
        self._buffers = self._new_buffers()
        #: index into _buffers of the snapshot the sidecar keeps (shared memory: never stage into it)
        self._held: int | None = None
        #: buffers a save is sending from, until it is committed or failed (by index), and buffers
        #: lent to a DCP writer's stage() whose save has not taken them yet; under _stage_lock
        self._busy: dict[int, HostBuffers] = {}
        self._leases: dict[int, Lease] = {}
        #: what the last lent save taught: the staged tensors it sent in place (laid out first
        #: next time) and the most bytes it needed in the arena
        self._lease_sent: set[str] = set()
        self._lease_extra = 0
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="strata-send")
        self._waiter = ThreadPoolExecutor(2, thread_name_prefix="strata-durable")
        self._lock = threading.Lock()
        self._inflight: Future[None] | None = None
        self._last: SaveHandle | None = None
        #: saves of DTensor / ShardedTensor state, through DCP (trainer_client.dcp._Saves)
        self._dcp_saves: Any = None
        self._tracker = RowTracker()
        self._overlap = Overlap(after_step=self._after_step)
        #: pre-faults staging buffers off the training thread; save() waits for it, never races it
        self._warmer = ThreadPoolExecutor(1, thread_name_prefix="strata-warm")
        self._warming: Future[None] | None = None
        self._stage_lock = threading.Lock()
        #: the state resume()/restore() saw, warmed again after the first optimizer step (which
        #: creates Adam's lazy state); dropped at the first save
        self._warm_state: MutableMapping[str, Any] | None = None
        self._skipped_unreported = 0
        #: newest step this client saw committed, and the peers of its attempt that are gone
        self._durable_step: int | None = None
        self._peers_gone: tuple[int, ...] = ()
        self._gone_reason = ""
        #: the generation an in-place gang restart runs next ("" while none was asked for)
        self._restart_generation = ""
        self._sigterm = SigtermWatch(self.settings.save_on_sigterm)
        beat = os.environ.get("STRATA_HEARTBEAT_FILE")
        self._heartbeat = Path(beat) if beat else None
        #: step, source ("memory"/"storage") and fallback reason of the newest restore
        self.last_restore: dict[str, Any] | None = None
        self.stats = {
            "saves": 0,
            "skipped": 0,
            "failed": 0,
            "first_save_stall_s": 0.0,
            "last_stall_s": 0.0,
            # replica-aware saves: the divergence check's share of the last stall, and the bytes of
            # replicated tensors other ranks saved for this one in the last save
            "last_replica_check_s": 0.0,
            "last_replica_bytes_skipped": 0,
            # bytes the last save copied into its staging buffers (a DCP async save: only what its
            # writer's stage() had not staged there, such as DCP's pickled values)
            "last_copied_bytes": 0,
            # seconds the last DCP stage() waited to hear that the previous save committed (a
            # rank other than DCP's coordinator hears it a moment after DCP's future resolves)
            "last_stage_wait_s": 0.0,
        }
        #: objects declared replicated (replicate()), with their group
        self._declared: list[tuple[Any, tuple[int, ...]]] = []
        for opt in optimizers:
            self.register_optimizer(opt)
        self.replicate(*replicated)
        # Held open while this client lives: the sidecar (and through it the other ranks' sidecars)
        # learns at once when this trainer is gone, instead of waiting for a commit timeout.
        self._closed = threading.Event()
        self._attach = self._stub.Attach(pb.AttachRequest(identity=self._identity), metadata=self._metadata)
        threading.Thread(target=self._hold_attach, name="strata-attach", daemon=True).start()
        if self.settings.save_on_sigterm is not None:
            self._sigterm.install()
        if self.settings.resume != "never":
            # Asynchronous discovery: the sidecar starts reading the newest step while the
            # trainer builds its model; resume() then finds it in memory.
            self._prefetch = self._stub.Prefetch.future(  # keep a reference: a dropped call is cancelled
                pb.PrefetchRequest(identity=self._identity, files_ok=self._segments is not None),
                timeout=30,
                metadata=self._metadata,
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
            if code == grpc.StatusCode.FAILED_PRECONDITION and LIMIT_SPENT_MARKER in (exc.details() or ""):
                log.error("%s", exc.details())
                raise RestartLimitSpent(exc.details()) from None
            raise SidecarUnavailable(f"sidecar refused the handshake: {exc.details()}") from None

    def _hold_attach(self) -> None:
        """Keep the Attach stream open; if it drops while this client lives, open it again
        (the sidecar then tells its peers this rank is back)."""
        while True:
            try:
                for event in self._attach:
                    log.debug("running as attempt %d", event.attempt)
                    if event.restart_generation:
                        self._restart_in_place(event.restart_generation)
                        return
                    gone = tuple(event.gone_ranks)
                    if gone != self._peers_gone:
                        self._gone_reason = event.gone_reason or f"rank(s) {list(gone)} are gone"
                        self._peers_gone = gone
                        if gone:
                            log.info("peers gone: %s", self._gone_reason)
            except grpc.RpcError as exc:
                log.debug("attach stream ended: %s", exc.code())
            except ValueError:  # the channel was closed under it
                return
            if self._closed.wait(0.5):
                return
            try:
                self._attach = self._stub.Attach(
                    pb.AttachRequest(identity=self._identity), metadata=self._metadata
                )
            except ValueError:
                return

    def _restart_in_place(self, generation: str) -> None:
        """The operator restarts the gang in place as ``generation``: this process ends with
        EXIT_RESTART_IN_PLACE (77), its container's restart rule restarts it, and the pod, the
        sidecar and the sidecar's memory stay; the new process handshakes as ``generation`` and
        restores from that memory.

        Why ``os._exit`` from this thread after a short grace, and not only an exception at the
        next ``save()``: the gang restarts because a rank crashed or hung, so the training thread
        is often blocked in a collective waiting for that rank (NCCL, gloo) and would never reach
        ``save()``; and an exception raised in the training thread may be caught by the script.
        During the grace a training thread that does call ``save()`` leaves through
        :class:`RestartInPlace` (a SystemExit with 77: its ``finally`` blocks run); then the
        process ends whatever the training thread does. Nothing is lost: this generation can
        commit nothing more (the sidecar serves the new one), and the committed snapshot stays
        in the sidecar. Logs are flushed first; atexit handlers do not run."""
        self._restart_generation = generation
        grace = float(os.environ.get("STRATA_RESTART_GRACE_S") or RESTART_GRACE_S)
        log.warning(
            "the gang restarts in place as generation %s: this trainer exits %d within %.1f s and "
            "its container restarts",
            generation,
            EXIT_RESTART_IN_PLACE,
            grace,
        )
        time.sleep(max(0.0, grace))
        log.warning("exiting %d for the in-place restart", EXIT_RESTART_IN_PLACE)
        for handler in logging.getLogger().handlers + log.handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(EXIT_RESTART_IN_PLACE)

    def _shared_memory(self) -> SegmentFactory | None:
        """Shared-memory saves when the policy allows and the sidecar offers them on this host."""
        s, info = self.settings, self.server_info
        if s.shm == "off":
            return None
        offered = info.shm_dir if "save.shm" in info.capabilities else ""
        reason = ""
        if s.address:
            reason = "the sidecar is reached over TCP"
        elif not offered:
            reason = "the sidecar does not offer them (its --shm-dir is empty)"
        elif not os.access(offered, os.W_OK | os.X_OK):
            reason = f"the sidecar's shm dir {offered} is not writable from here"
        if not reason:
            return SegmentFactory(offered, _handover_socket(info.capabilities))
        if s.shm == "on":
            raise SidecarUnavailable(f"shared-memory saves are required (STRATA_SHM=on), but {reason}")
        log.info("shared-memory saves off (%s); saves stream over gRPC", reason)
        return None

    def _new_buffers(self) -> list[HostBuffers]:
        # Streamed saves: the sidecar holds a copy of every byte, one private buffer does. Shared
        # memory: the sidecar keeps the committed snapshot in the segment it was staged in; with
        # two, the next save stages into the other, with one the sidecar gives the snapshot up
        # before the next save stages into it (see _reclaim).
        if self._segments is None:
            return [HostBuffers()]
        return [HostBuffers(self._segments) for _ in range(self._staging_count())]

    def _staging_count(self) -> int:
        """Shared staging segments: ``staging_buffers``, or under "auto" what the sidecar suggests
        (1; 2 where it pushes copies to peers), 2 for an older sidecar that reads segments in
        place and cannot give one back, 1 where it copies segment files at each save. A save
        never stages while the previous one is in flight (it waits or skips), so a second
        segment only keeps the newest committed snapshot in memory while the next save stages
        and uploads."""
        choice = self.settings.staging_buffers
        if choice != "auto":
            return int(choice)
        caps = self.server_info.capabilities
        for cap in caps:
            if cap.startswith(SHM_STAGING_CAPABILITY) and cap[len(SHM_STAGING_CAPABILITY) :] in ("1", "2"):
                return int(cap[len(SHM_STAGING_CAPABILITY) :])
        return 2 if _handover_socket(caps) else 1

    def _stop_shared_memory(self, why: str) -> None:
        if self.settings.shm == "on":
            raise SaveFailed(f"shared-memory save failed and STRATA_SHM=on forbids streaming: {why}")
        log.warning("shared-memory saves off (%s); saves stream over gRPC from now on", why)
        with self._stage_lock:
            for b in self._buffers:
                b.reset()
            if self._segments is not None:
                self._segments.close()
            self._segments, self._held = None, None
            self._buffers = self._new_buffers()
            self._busy.clear()
            self._leases.clear()

    def close(self, wait: bool = True) -> None:
        """Finish (or drop) outstanding saves and close the connection."""
        self._sigterm.uninstall()
        if wait and self._dcp_saves is not None:  # DCP's thread may not have reached the client yet
            self._dcp_saves.wait(self.settings.commit_timeout_s)
        if wait and self._last is not None:
            try:
                self._last.durable.result(self.settings.commit_timeout_s)
            except Exception as exc:
                log.warning("last save (step %d) did not become durable: %s", self._last.step, exc)
        self._overlap.close()
        self._warm_state = None
        self._warmer.shutdown(wait=True)
        self._tracker.close()
        self._sender.shutdown(wait=wait)
        self._waiter.shutdown(wait=wait)
        self._closed.set()
        self._attach.cancel()
        self._channel.close()
        with self._stage_lock:
            self._leases.clear()
            for b in self._buffers:
                b.reset()
        if self._segments is not None:
            self._segments.close()  # segments handed over and never saved from are dropped

    def __enter__(self) -> CheckpointClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- overlapped staging ---------------------------------------------------------------

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Stage this optimizer's parameters and state in the background; its
        ``step()`` waits until the copy is done. Only what can be proven untouched until the
        copy ends is deferred (see ``trainer_client._overlap``); the rest is copied in save()."""
        self._overlap.register(optimizer)

    def _adopt(self, state: MutableMapping[str, Any]) -> None:
        """The state is known: stage its optimizers in the background (``overlap="auto"``) and
        pre-fault the staging buffers for it, off the training thread. State holding DTensors
        or ShardedTensors is saved through DCP (``StrataWriter``), which stages its own way:
        nothing to adopt."""
        _loaders.track(state)  # before _warm reads the loaders' state_dict()
        if _state.through_dcp(state):
            return
        if self.settings.overlap == "auto":
            for optimizer in _state.optimizers(state):
                self.register_optimizer(optimizer)
        if self.stats["saves"] == 0:
            self._warm_state = state
        self._warm(state)

    def _after_step(self) -> None:
        # The first step creates lazy optimizer state (Adam's moments): the layout the first save
        # will need only exists now. Once: flattening walks the state on this thread.
        state, self._warm_state = self._warm_state, None
        if state is not None and self.stats["saves"] == 0:
            self._warm(state)

    def _flat(self, state: MutableMapping[str, Any], rng: bool = True) -> _tree.Flat:
        full = dict(state)
        if rng and self.settings.capture_rng:
            full[_RNG_KEY] = _rng.capture()
        return _tree.flatten(full)

    def _warm(self, state: MutableMapping[str, Any]) -> None:
        """Allocate and pre-fault the buffers the next saves of ``state`` stage into, in the warm
        thread (the layout is read here: only names, dtypes and shapes travel)."""
        flat = self._flat(state)
        plan = self._plan(state, flat)
        tensors = flat.tensors if plan is None else [flat.tensors[i] for i in plan.own]
        free = [i for i in range(len(self._buffers)) if i != self._held]

        def warm() -> None:
            for i in free:
                try:
                    with self._stage_lock:
                        # shared memory may have been turned off meanwhile; a save may be using it
                        if i < len(self._buffers) and i not in self._busy and i not in self._leases:
                            self._buffers[i].ensure(tensors)
                except OSError as exc:  # no room in the tmpfs: save() reports it, on its thread
                    log.debug("could not pre-fault staging buffer %d: %s", i, exc)
                    return

        with contextlib.suppress(RuntimeError):  # closed meanwhile
            self._warming = self._warmer.submit(warm)

    def _wait_warm(self) -> None:
        if self._warming is not None:
            self._warming.result()
            self._warming = None

    def track(self, *modules: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[str]:
        """Track which embedding rows are looked up (Check-N-Run), so the sidecar diffs only
        those instead of comparing whole tables: nn.Embedding / nn.EmbeddingBag (TorchRec's
        EmbeddingBagCollection included) and fbgemm's tables (FusedEmbeddingBagCollection,
        sharded TorchRec modules). ``optimizer`` updates the tables (torchrec's
        CombinedOptimizer / KeyedOptimizerWrapper are looked into; in-backward and fbgemm's own
        optimizers are found without it); tracking is used only where it leaves rows without
        gradient alone (plain SGD, SparseAdam, Adagrad without weight decay; fbgemm's SGD and
        Adagrad). Returns the names of the tables tracked; warns when there are none."""
        if _state.through_dcp(list(modules)):
            log.warning(
                "track(%s): sharded state is saved through torch.distributed.checkpoint, which "
                "sends no row bitmaps: its tables are diffed by value",
                ", ".join(type(m).__name__ for m in modules),
            )
        return self._tracker.track(modules, optimizer)

    # --- replica-aware saves ---------------------------------------------------------------

    def replicate(self, *objects: Any, group: Any = None) -> None:
        """Declare ``objects`` replicated across ``group`` (a ProcessGroup, a list of global ranks,
        or None: every rank): each of their tensors is then saved by one rank of the group, and a
        restore gives every rank all of them. ``objects``: DistributedDataParallel wrappers (their
        parameters, across their own process group unless ``group`` is given), modules (their
        parameters), or tensors. The optimizer state of replicated parameters is replicated too.

        DDP wrappers found in the saved state need no declaration. Declare the wrapper when the
        state holds its inner module (``state = {"model": ddp.module}``). Every rank of the group
        must declare the same objects: a mismatch fails the step's commit, naming the tensor.
        (DTensor state, and so an HSDP mesh's replicate dimension, cannot be saved yet.)
        """
        for obj in objects:
            ranks = _replicas.group_ranks(
                group if group is not None or not isinstance(obj, _DDP) else obj.process_group,
                self.settings.world_size,
            )
            if self.settings.rank not in ranks:
                raise ValueError(
                    f"replicate(): group {list(ranks)} does not include this rank {self.settings.rank}"
                )
            self._declared.append((obj, ranks))

    def _replica_groups(self, state: Any) -> dict[tuple[int, int], tuple[int, ...]]:
        """Tensor key -> the ranks it is replicated across."""
        groups: dict[tuple[int, int], tuple[int, ...]] = {}
        found = [
            (m, _replicas.group_ranks(m.process_group, self.settings.world_size))
            for m in _state.found(state, _DDP)
        ]
        for obj, ranks in [*found, *self._declared]:
            ignored: set[str] = set()
            if isinstance(obj, _DDP):
                # What DDP does not synchronise (model-parallel shards inside it) stays per rank.
                ignored = set(getattr(obj, "parameters_to_ignore", ()))
                obj = obj.module
            if isinstance(obj, torch.nn.Module):
                for name, p in obj.named_parameters():
                    if name not in ignored:
                        groups[_tensor_key(p)] = ranks
            elif isinstance(obj, torch.Tensor):
                groups[_tensor_key(obj)] = ranks
            else:
                raise TypeError(
                    f"replicate(): expected DDP wrappers, modules or tensors, got {type(obj).__name__}"
                )
        if groups:
            optimizers = {id(o): o for o in [*_state.optimizers(state), *self._overlap.optimizers]}
            for opt in optimizers.values():
                for group in opt.param_groups:
                    for p in group["params"]:
                        of_param = groups.get(_tensor_key(p))
                        if of_param is None:
                            continue
                        for v in opt.state.get(p, {}).values():
                            if isinstance(v, torch.Tensor) and v.numel():
                                groups[_tensor_key(v)] = of_param
        return groups

    def _plan(self, state: Any, flat: _tree.Flat) -> _replicas.Plan | None:
        """Which of ``flat``'s tensors this rank saves (None: all of them)."""
        if (
            self.settings.replicas == "off"
            or self.settings.world_size < 2
            or "save.replicas" not in self.server_info.capabilities
        ):
            return None
        groups = self._replica_groups(state)
        if not groups:
            return None
        found = _replicas.plan(flat.tensors, groups, self.settings.rank)
        return found if found.replicas else None

    # --- save -----------------------------------------------------------------------------

    @property
    def preempted(self) -> bool:
        """SIGTERM came (with ``save_on_sigterm`` set) to this rank or, under torch.distributed
        with several ranks, to any rank: the next ``save()`` is the last one.

        With several ranks it is a collective (one all-reduce of a flag over the default process
        group), so read it on every rank at the same steps, as the loop does with collectives:
        then every rank saves the same step. A SIGTERM reaches the pods of one node, not the
        gang; without the agreement each rank would save the step at which its own signal came,
        and no step would commit."""
        local = self._sigterm.fired
        if self.settings.save_on_sigterm is None:
            return False
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return local
        device = torch.device("cpu")
        if "nccl" in str(dist.get_backend()).lower():
            device = torch.device("cuda", torch.cuda.current_device())
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        except RuntimeError as exc:  # a peer is gone: the gang restarts anyway
            log.warning("could not agree on preemption with the other ranks (%s)", exc)
            return local
        anywhere = bool(flag.item())
        if anywhere and not local:
            log.warning("another rank got SIGTERM: saving this step with it, then exiting")
            self._sigterm.mark()
        return anywhere

    def save(self, step: int, state: MutableMapping[str, Any]) -> SaveHandle:
        """Snapshot ``state`` at ``step``; returns once the synchronous copy is done. After
        SIGTERM (``save_on_sigterm``) it saves, waits for durable and raises :class:`Preempted`.
        State holding DTensors or ShardedTensors (FSDP2, TorchRec DMP) is saved through
        torch.distributed.checkpoint (``trainer_client.dcp``): a collective every rank calls at
        the same steps, which waits for the previous save to be durable (``when_busy`` does not
        apply: one rank alone cannot skip a step)."""
        _check_step(step)
        if self._restart_generation:
            raise RestartInPlace(self._restart_generation)
        if self._sigterm.fired:
            self._save_on_sigterm(step, state)
        return self._save(step, state)

    def _save_on_sigterm(self, step: int, state: MutableMapping[str, Any]) -> NoReturn:
        assert self._sigterm.at is not None and self.settings.save_on_sigterm is not None
        self._sigterm.handled = True
        budget = self.settings.save_on_sigterm
        deadline = self._sigterm.at + budget
        log.warning(
            "SIGTERM %.2f s ago: saving step %d (budget %.1f s from the signal)",
            time.monotonic() - self._sigterm.at,
            step,
            budget,
        )
        saved, reason = False, ""
        previous = self._last
        if self._peers_gone:
            # No new step can commit; one already in flight still may (the gone rank's sidecar
            # may hold its MANIFEST), and the sidecars settle it quickly either way.
            if previous is not None:
                self._settled(previous.durable, deadline, give_up_when_gone=False)
            reason = f"save skipped: {self._gone_reason}, so no step can commit"
        else:
            # A save in flight when the signal came counts: wait for it first.
            if previous is not None and not self._settled(previous.durable, deadline):
                reason = f"step {previous.step} (in flight at SIGTERM) not durable within the budget"
            elif self._inflight is not None and not self._settled(self._inflight, deadline):
                reason = "the previous save was still streaming when the budget ran out"
            elif self._peers_gone:
                reason = f"save skipped: {self._gone_reason}, so no step can commit"
            elif time.monotonic() >= deadline:
                reason = f"no budget left for step {step}"
            elif previous is not None and previous.step == step and self._durable_step == step:
                saved = True
            else:
                handle = self._save(step, state)
                if not self._settled(handle.durable, deadline):
                    reason = (
                        f"save skipped: {self._gone_reason}, so no step can commit"
                        if self._peers_gone
                        else f"step {step} not durable within the budget"
                    )
                elif handle.durable.exception() is not None:
                    reason = f"step {step} failed: {handle.durable.exception()}"
                else:
                    saved = True
        took = time.monotonic() - self._sigterm.at
        if saved:
            log.warning("SIGTERM: step %d durable %.2f s after the signal; exiting", step, took)
        else:
            log.warning(
                "SIGTERM: %s; newest durable step %s; exiting %.2f s after the signal",
                reason,
                self._durable_step,
                took,
            )
        self.close(wait=False)  # cancels what still streams: the sidecar drops it, never half-commits
        raise Preempted(step if saved else self._durable_step, saved, reason)

    def _settled(self, future: Future[Any], deadline: float, give_up_when_gone: bool = True) -> bool:
        """Wait for ``future`` until ``deadline``; gives up early when a peer is gone."""
        while not future.done():
            left = deadline - time.monotonic()
            if left <= 0 or (give_up_when_gone and self._peers_gone):
                return False
            futures_wait([future], timeout=min(left, 0.05))
        return True

    def _save(self, step: int, state: MutableMapping[str, Any], plain: bool = False) -> SaveHandle:
        """``plain``: save ``state`` exactly as given (trainer_client.dcp's writer): no RNG states
        added, no replica plan (every tensor is this rank's own), no row tracking, and every tensor
        staged before this returns (no overlap with the next optimizer step): copied, or, where it
        lies in a buffer lent to the writer's ``stage()`` (``_lease``), sent from there."""
        _check_step(step)
        if not plain and _state.through_dcp(state):
            from trainer_client.dcp import save_state  # torch.distributed.checkpoint: loaded on use

            return save_state(self, step, state)
        t0 = time.perf_counter()
        with self._lock:
            # Busy while the previous snapshot streams or uploads: the sidecar holds one in
            # flight besides the committed one, so another would only be refused.
            previous = self._last
            busy = (self._inflight is not None and not self._inflight.done()) or (
                previous is not None and not previous.durable.done()
            )
            if busy and self.settings.when_busy == "skip" and not plain:
                return self._skip(step)
        if busy:
            if self._inflight is not None:
                self._inflight.result()  # _send never raises; it fails the handle instead
            if previous is not None:
                futures_wait([previous.durable])
        handle = SaveHandle(step)
        if self._heartbeat is not None:
            self._heartbeat.touch()  # progress, for the launcher's hang detection
        if self.stats["saves"] == 0 and not plain:
            _loaders.check(state)  # once: loader setups a resume cannot keep exact
            _loaders.track(state)  # their states record their epochs (when no resume() tracked them)
            if self.settings.overlap == "auto":
                for optimizer in _state.optimizers(state):
                    self.register_optimizer(optimizer)
            self._warm_state = None
        full = self._flat(state, rng=not plain)
        plan = None if plain else self._plan(state, full)
        replicas: list[pb.ReplicaRef] = []
        if plan is None:
            flat = full
        else:
            # Only the owner stages a replicated tensor; every rank digests a sample of its copy.
            t_check = time.perf_counter()
            entries = sorted(plan.replicas.values(), key=lambda r: r.index)
            samples = _replicas.sample_digests([full.tensors[r.index][1] for r in entries], step)
            replicas = [
                pb.ReplicaRef(
                    name=r.name,
                    index=r.index,
                    owner=r.owner,
                    dtype=dtype_name(r.dtype),
                    shape=list(r.shape),
                    nbytes=r.nbytes,
                    sample=sample,
                )
                for r, sample in zip(entries, samples, strict=True)
            ]
            self.stats["last_replica_check_s"] = time.perf_counter() - t_check
            self.stats["last_replica_bytes_skipped"] = sum(
                r.nbytes for r in entries if r.owner != self.settings.rank
            )
            flat = _tree.Flat(full.skeleton, [full.tensors[i] for i in plan.own])
        self._wait_warm()
        views: Sequence[torch.Tensor] | Mapping[int, torch.Tensor]
        taken = self._take_lease(flat) if plain and self._leases else None
        lent = taken[0] if taken is not None else None
        if taken is not None:
            # Staged by a DCP writer's stage() into this buffer: sent from there, not copied again.
            lease, placement = taken
            index, bufs, slots, copies = lease.index, lease.bufs, placement.slots, placement.copies
            views = {i: _view(bufs, slots[i]) for i in copies}
        else:
            index = 0 if self._held is None or len(self._buffers) == 1 else 1 - self._held
            try:
                with self._stage_lock:
                    self._revoke(index)
                    if self._held == index:
                        self._reclaim(index)
                    self._buffers[index].ensure(flat.tensors)
                    self._busy[index] = self._buffers[index]
            except OSError as exc:  # the shared tmpfs is full or gone
                self._stop_shared_memory(f"cannot allocate the staging segment there: {exc}")
                index = 0
                with self._stage_lock:
                    self._buffers[index].ensure(flat.tensors)
                    self._busy[index] = self._buffers[index]
            bufs = self._buffers[index]
            slots, views = bufs.slots, bufs.views
            copies = list(range(len(flat.tensors)))
        deferred = Deferral()
        # From here to the submit, a failure (a bad tensor, close() meanwhile, an interrupt) must
        # free the buffer marked busy above, or no later save or stage() could use it again.
        try:
            touched = {} if plain else self._tracker.cut(flat.tensors)
            if self._overlap.optimizers and not plain:
                deferred = self._overlap.plan(flat.tensors, _state.optimizers(state), _state.modules(state))
            later = set(deferred.indices)
            self._stager.copy(views, flat.tensors, [i for i in copies if i not in later])
            self.stats["last_copied_bytes"] = sum(slots[i].nbytes for i in copies)
            if deferred:
                self._overlap.gate.close()
            stall = time.perf_counter() - t0
            handle.stall_s = stall
            self.stats["saves"] += 1
            self.stats["last_stall_s"] = stall
            if self.stats["saves"] == 1:
                self.stats["first_save_stall_s"] = stall
            tree = _tree.encode_skeleton(flat.skeleton)
            roles = _state.roles(state, flat.tensors)
            with self._lock:
                skipped, self._skipped_unreported = self._skipped_unreported, 0
                self._inflight = self._sender.submit(
                    self._send,
                    handle,
                    index,
                    bufs,
                    slots,
                    lent,
                    flat,
                    deferred,
                    tree,
                    stall,
                    skipped,
                    roles,
                    touched,
                    replicas,
                )
                self._last = handle
        except BaseException:
            if deferred:
                self._overlap.gate.open()
            self._settle(index, bufs)
            raise
        if not deferred:
            # CPU copies are complete; GPU copies are ordered before later compute by the stream wait.
            # (A send that failed at once has set it already, in _send.)
            with contextlib.suppress(InvalidStateError):
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
        index: int,
        bufs: HostBuffers,
        slots: list[Slot],
        lent: Lease | None,
        flat: _tree.Flat,
        deferred: Deferral,
        tree: bytes,
        stall: float,
        skipped: int,
        roles: list[str],
        touched: dict[int, bytes],
        replicas: list[pb.ReplicaRef],
    ) -> None:
        try:
            if deferred:
                try:
                    self._stager.copy(bufs.views, flat.tensors, deferred.indices)
                    # Before the gate opens: no step of a gated optimizer has run since save().
                    self._overlap.verify(deferred, flat.tensors, handle.step)
                finally:
                    self._overlap.gate.open()
                handle.staged.set_result(None)
            self._stager.synchronize()
            save_id = uuid.uuid4().hex[:16]
            try:
                ack = self._save_rpc(
                    handle.step,
                    save_id,
                    bufs,
                    bufs.shared,
                    tree,
                    stall,
                    skipped,
                    roles,
                    touched,
                    replicas,
                    slots,
                )
            except grpc.RpcError as exc:
                if not (bufs.shared and exc.code() == grpc.StatusCode.FAILED_PRECONDITION):
                    raise
                # The sidecar cannot use the segment (restarted, or another mount of the tmpfs):
                # these bytes are intact, so stream them instead, and then sort out the segments.
                log.warning(
                    "step %d: shared-memory save refused (%s); streaming it", handle.step, exc.details()
                )
                ack = self._save_rpc(
                    handle.step, save_id, bufs, False, tree, stall, skipped, roles, touched, replicas, slots
                )
                if "cannot open" in (exc.details() or "") or "does not accept" in (exc.details() or ""):
                    self._stop_shared_memory(exc.details() or "refused")
                else:
                    self._forget_segments()
            if not bufs.shared:
                self._settle(index, bufs)  # streamed: the sidecar holds a copy of every byte
            if bufs.shared:
                # Warm the other segment now, off the training thread, so the next save's stall
                # is a copy and not an allocation (a DCP writer's next stage(): its layout).
                # Best effort: the sidecar has this save, a full tmpfs here must not fail it.
                try:
                    with self._stage_lock:
                        other = 1 - index
                        free = other not in self._busy and other not in self._leases
                        if other < len(self._buffers) and free:
                            if lent is None:
                                self._buffers[other].ensure(flat.tensors)
                            else:
                                layout, _ = self._lease_layout(lent.specs, lent.estimate)
                                self._buffers[other].ensure(layout, pin=lent.pin)
                except OSError as exc:
                    log.debug("could not warm the next staging segment: %s", exc)
        except Exception as exc:
            if bufs.shared:
                bufs.reset()  # the sidecar may still read it: never stage into it again
            self._settle(index, bufs)
            self._fail(handle, exc)
            self._waiter.submit(self._report_skip, handle.step, f"save failed: {exc}")
            return
        finally:
            if not handle.staged.done():
                handle.staged.set_result(None)
        fault_point("client.saved", handle.step)
        self._waiter.submit(self._await_durable, handle, index, bufs, ack.save_id)

    def _forget_segments(self) -> None:
        """The sidecar lost its mappings (it restarted): start over with new segments."""
        with self._stage_lock:
            for b in self._buffers:
                b.reset()  # a lent one too: its writer's save then copies from its views
            self._held = None

    def _settle(self, index: int, bufs: HostBuffers, held: bool = False) -> None:
        """The save staged in ``bufs`` is over (``held``: committed, the sidecar keeps it)."""
        with self._stage_lock:
            if self._busy.get(index) is bufs:
                del self._busy[index]
            if (
                held
                and bufs.segment is not None
                and index < len(self._buffers)
                and self._buffers[index] is bufs
            ):
                self._held = index  # the sidecar keeps this one in memory

    def _reclaim(self, index: int) -> None:
        """Stage into buffer ``index`` though the sidecar holds the committed snapshot in it (one
        staging segment; under _stage_lock): the sidecar gives that copy up first, so nothing
        reads it as a committed step while it is overwritten (storage has it); where it does not,
        the save stages into a new segment and the old one stays the sidecar's until the next
        commit."""
        bufs = self._buffers[index]
        self._held = None
        if bufs.segment is None or self._segments is None:
            return
        try:
            self._segments.drop(bufs.segment)
        except OSError as exc:
            log.info("staging into a new shared segment: %s", exc)
            bufs.reset()

    def _revoke(self, index: int) -> None:
        """Take back buffer ``index`` if it is lent (under _stage_lock): a stage() staged into it
        but its save has not taken it. That stage's views keep their memory; its save copies
        from them."""
        if self._leases.pop(index, None) is not None:
            self._buffers[index].reset()

    # --- staging for a DCP writer (trainer_client.dcp) -------------------------------------

    def _lease_layout(
        self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], estimate: int
    ) -> tuple[list[tuple[str, torch.Tensor]], list[int]]:
        # A power of two: a plan whose pickled values grow a little keeps its layout.
        arena = 1 << max(12, (max(estimate, self._lease_extra) - 1).bit_length())
        return lease_layout(specs, self._lease_sent, arena)

    def _lease(self, tensors: list[tuple[str, torch.Tensor]], estimate: int) -> Lease | None:
        """Stage ``tensors`` (named uniquely) into a free staging buffer of this client, lent to the
        caller (a DCP writer's ``stage()``): the save whose state holds the returned views sends
        them from where they lie, so their bytes are copied once, here (see ``_take_lease``).
        ``estimate``: bytes that save may send that are not staged here (DCP's pickled values),
        for the arena the buffer keeps for them. None when every buffer is held by the sidecar
        or in use by a save: the caller stages elsewhere, and its save copies."""
        self._wait_warm()
        specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors]
        layout, where = self._lease_layout(specs, estimate)
        pin = any(t.is_cuda for _, t in tensors)
        if not self._free_for_lease():
            # On a rank other than DCP's coordinator, the previous save's DCP future resolves once
            # the step is committed, but this client hears so a moment later (from its sidecar):
            # wait that moment for a save already sent rather than stage elsewhere.
            last, inflight = self._last, self._inflight
            if last is not None and inflight is not None and inflight.done():
                t0 = time.perf_counter()
                futures_wait([last.durable], timeout=LEASE_WAIT_S)
                self.stats["last_stage_wait_s"] = time.perf_counter() - t0
        with self._stage_lock:
            free = self._free_for_lease()
            if not free and len(self._buffers) == 1 and self._held == 0 and 0 not in self._busy:
                self._reclaim(0)
                free = self._free_for_lease()
            if not free:
                return None
            # One not lent, best one laid out for this already (the previous save warmed it);
            # else one lent to a stage() whose save never took it (a failed save).
            index = min(free, key=lambda i: (i in self._leases, not self._buffers[i].fits(layout)))
            self._revoke(index)
            bufs = self._buffers[index]
            try:
                allocated = bufs.ensure(layout, pin=pin)
            except OSError as exc:  # the tmpfs is full: the save copies, and reports it there
                log.debug("could not allocate a staging buffer for a DCP stage(): %s", exc)
                return None
            lease = Lease(index, bufs, where, specs, estimate, pin, allocated)
            self._leases[index] = lease
            # Under the lock: a reset meanwhile (close(), a save taking the buffer back) would
            # unregister page-locked memory a GPU copy is still writing into.
            self._lease_stager.copy(lease.views, tensors, list(range(len(tensors))))
            self._lease_stager.synchronize()  # stage() returns with the bytes on the host
        return lease

    def _return_lease(self, lease: Lease) -> None:
        """A lease whose save never came (its writer closed): the buffer is free again."""
        with self._stage_lock:
            if self._leases.get(lease.index) is lease:
                del self._leases[lease.index]

    def _free_for_lease(self) -> list[int]:
        return [i for i in range(len(self._buffers)) if i != self._held and i not in self._busy]

    def _take_lease(self, flat: _tree.Flat) -> tuple[Lease, Placement] | None:
        """The lent buffer ``flat``'s tensors lie in, and where each goes in it, or None (the
        save copies them as usual). A lease whose arena is too small for what was not staged is
        given back: the usual copy then lays the buffer out anew, in new memory (a reset never
        frees memory a view still holds), so the staged views stay intact while it copies them."""
        with self._stage_lock:
            for index, lease in list(self._leases.items()):
                if not any(lease.offset(t) is not None for _, t in flat.tensors):
                    continue
                del self._leases[index]
                if not lease.valid or self._buffers[index] is not lease.bufs:
                    return None
                placement = lease.place(flat.tensors)
                self._lease_extra = max(self._lease_extra, lease.needed)
                if placement is None:
                    log.info("a DCP save needs %d bytes beside its staged tensors: copying it", lease.needed)
                    lease.bufs.reset()
                    return None
                self._busy[index] = lease.bufs
                self._lease_sent = placement.sent
                return lease, placement
        return None

    def _save_rpc(
        self,
        step: int,
        save_id: str,
        bufs: HostBuffers,
        shared: bool,
        tree: bytes,
        stall: float,
        skipped: int,
        roles: list[str],
        touched: dict[int, bytes],
        replicas: list[pb.ReplicaRef],
        slots: list[Slot],
    ) -> pb.SaveAck:
        delay, deadline = 0.05, time.monotonic() + self.settings.rpc_timeout_s
        while True:
            try:
                return self._stub.Save(
                    self._requests(
                        bufs, shared, step, save_id, tree, stall, skipped, roles, touched, replicas, slots
                    ),
                    timeout=self.settings.rpc_timeout_s,
                    metadata=self._metadata,
                )
            except grpc.RpcError as exc:
                # The sidecar holds its limit of snapshots. Under "wait" the user chose to
                # block rather than lose a save: keep the buffers and retry with backoff.
                busy = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                if not (busy and self.settings.when_busy == "wait" and time.monotonic() < deadline):
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _requests(
        self,
        bufs: HostBuffers,
        shared: bool,
        step: int,
        save_id: str,
        tree: bytes,
        stall: float,
        skipped: int,
        roles: list[str],
        touched: dict[int, bytes],
        replicas: list[pb.ReplicaRef],
        slots: list[Slot],
    ) -> Iterator[pb.SaveRequest]:
        header = pb.SaveHeader(
            protocol_version=PROTOCOL_VERSION,
            identity=self._identity,
            step=step,
            save_id=save_id,
            tensors=[
                pb.TensorMeta(
                    name=s.name,
                    dtype=dtype_name(s.dtype),
                    shape=list(s.shape),
                    nbytes=s.nbytes,
                    offset=s.offset if shared else 0,
                    role=role,
                    touched_rows=touched.get(i, b""),
                )
                for i, (s, role) in enumerate(zip(slots, roles, strict=True))
            ],
            tree=tree,
            stall_seconds=stall,
            skipped_saves=skipped,
            replicas=replicas,
        )
        if shared:
            assert bufs.segment is not None
            header.shm.CopyFrom(pb.SharedSegment(name=bufs.segment.name, size=span_bytes(slots)))
        yield pb.SaveRequest(header=header)
        if shared:
            fault_point("client.stream.chunk", step)  # between header and footer, as chunks would be
        else:
            for chunk in bufs.chunks(self.settings.chunk_bytes, slots):
                fault_point("client.stream.chunk", step)
                yield pb.SaveRequest(chunk=chunk)
        # Every byte is sent, the footer is not: the sidecar must drop this stream. (A point after
        # the last yield would fire only if gRPC happened to resume the generator once more.)
        fault_point("client.stream.footer", step)
        total = span_bytes(slots) if shared else total_bytes(slots)
        yield pb.SaveRequest(footer=pb.SaveFooter(total_bytes=total))

    def _await_durable(self, handle: SaveHandle, index: int, bufs: HostBuffers, save_id: str) -> None:
        deadline = time.monotonic() + self.settings.commit_timeout_s
        req = pb.WaitCommittedRequest(identity=self._identity, step=handle.step, save_id=save_id)
        try:
            while True:
                req.timeout_seconds = max(0.0, min(30.0, deadline - time.monotonic()))
                try:
                    status = self._stub.WaitCommitted(
                        req, timeout=req.timeout_seconds + 30, metadata=self._metadata
                    )
                except grpc.RpcError as exc:
                    # The sidecar's blocking calls are capped (--max-blocking-rpcs): ask again.
                    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() >= deadline:
                        raise
                    time.sleep(0.2)
                    continue
                if status.state == pb.COMMIT_STATE_COMMITTED:
                    self._settle(index, bufs, held=True)  # before durable: the next stage() may reuse
                    self._tracker.committed()
                    self._durable_step = max(handle.step, self._durable_step or handle.step)
                    handle.durable.set_result(Committed(handle.step, status.commit_key))
                    return
                if status.state == pb.COMMIT_STATE_FAILED:
                    # The sidecar released the snapshot before reporting: its segment is free.
                    self._settle(index, bufs)
                    self._fail(handle, SaveFailed(status.message))
                    return
                if time.monotonic() >= deadline:
                    raise SaveFailed(
                        f"step {handle.step} not committed within {self.settings.commit_timeout_s} s"
                    )
        except Exception as exc:
            if bufs.shared:
                bufs.reset()  # unknown whether the sidecar still reads it
            self._settle(index, bufs)
            self._fail(handle, exc)

    def _fail(self, handle: SaveHandle, exc: BaseException) -> None:
        if isinstance(exc, grpc.RpcError):
            code = exc.code()
            exc = SaveFailed(f"step {handle.step}: {code.name}: {exc.details()}")
        elif not isinstance(exc, SaveFailed):
            exc = SaveFailed(f"step {handle.step}: {exc!r}")
        self.stats["failed"] += 1
        # A torn snapshot means the script changes its state behind the optimizer: say it loudly.
        (log.error if isinstance(exc, TornSnapshot) else log.warning)("%s", exc)
        if not handle.durable.done():
            handle.durable.set_exception(exc)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the newest save is durable (or failed); never raises its error."""
        if self._dcp_saves is not None:
            self._dcp_saves.wait(timeout)
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
            self._adopt(state)
            return None
        try:
            return self.restore(state)
        except RestoreError as exc:
            if policy == "require" or not isinstance(exc.__cause__, NothingToRestore):
                raise
            log.info(
                "no committed checkpoint for %s/%s; starting fresh",
                self.settings.namespace,
                self.settings.job,
            )
            self._adopt(state)
            return None

    def restore(self, state: MutableMapping[str, Any], step: int | None = None) -> int:
        """Load a committed step (newest by default) into ``state`` in place. A step another
        number of ranks saved loads when its state is replicated (DDP, ``replicate()``) and its
        plain values are the same on every rank; otherwise RestoreError names what cannot be
        resharded (docs/guides/dcp.md).

        State holding DTensors (FSDP2, tensor parallelism) or ShardedTensors (TorchRec's
        ``DistributedModelParallel``): a module, optimizer or state dict of them, is loaded with
        ``torch.distributed.checkpoint`` from a step saved through ``client.save`` or
        ``trainer_client.dcp.StrataWriter``, resharded by DCP's planner to this job's ranks:
        pass the same state that was saved (every rank takes part)."""
        if _state.through_dcp(state):
            from trainer_client.dcp import load_resume  # torch.distributed.checkpoint: loaded on use

            return load_resume(self, state, step)
        req = pb.RestoreRequest(protocol_version=PROTOCOL_VERSION, identity=self._identity)
        if step is not None:
            req.step = step
        refused = ""
        try:
            header, tensors = self._restore_stream(req, _receive.InPlace(state))
        except _receive.SavedThroughDcp as exc:  # plain state that dcp.save wrote: DCP's names
            from trainer_client.dcp import load_resume

            return load_resume(self, state, exc.step)
        except grpc.RpcError as exc:
            code = exc.code()
            msg = f"restore of {self.settings.namespace}/{self.settings.job}: {exc.details()}"
            if code == grpc.StatusCode.NOT_FOUND:
                raise RestoreError(msg) from NothingToRestore()
            if code == grpc.StatusCode.UNAVAILABLE:
                raise SidecarUnavailable(msg) from None
            if code == grpc.StatusCode.FAILED_PRECONDITION and LIMIT_SPENT_MARKER in (exc.details() or ""):
                log.error("%s", msg)
                raise RestartLimitSpent(msg) from None
            if not (code == grpc.StatusCode.FAILED_PRECONDITION and RESHARD_MARKER in (exc.details() or "")):
                raise RestoreError(f"{code.name}: {msg}") from None
            refused = msg
        saved_by = self.settings.world_size
        if refused:
            # Another number of ranks saved the step: rebuild it from their snapshots, if the
            # state is replicated (else refused, naming what cannot be resharded).
            header, tensors, replica_sources, saved_by, base = self._resharded(state, step, refused)
        else:
            if header.fallback_reason:
                log.error("restore fell back: %s", header.fallback_reason)
            tensors, replica_sources = self._with_replicas(header, tensors)
            base = self.settings.rank
        skeleton = _tree.decode_skeleton(header.tree)
        target = _receive.load_target(state, skeleton)
        try:
            _tree.load_into(target, skeleton, tensors)
        except (TypeError, ValueError) as exc:
            raise RestoreError(f"step {header.step} does not fit this state: {exc}") from exc
        for key in state:
            state[key] = target[key]
        self._tracker.disarm()  # the state changed outside training: the next save diffs by value
        rng_state = target.get(_RNG_KEY)
        if self.settings.capture_rng and rng_state:
            if base == self.settings.rank:
                _rng.restore(rng_state)
            else:  # a rank the old job did not have: no stream of its own to continue
                log.warning(
                    "step %d was saved by %d ranks: rank %d keeps its own random generators",
                    header.step,
                    saved_by,
                    self.settings.rank,
                )
        _loaders.after_restore(state)  # the loaders' next iter() must not redraw the epoch's seeds
        self._adopt(state)  # the restored layout (optimizer state included): pre-fault its buffers now
        self.last_restore = {
            "step": int(header.step),
            "source": header.source,
            # exact: every tensor as saved (lossy ones included); stored: lossily stored tensors
            # as storage holds them (the gang's attempt decided one class for every rank)
            "restore_class": header.restore_class or "stored",
            "fallback_reason": header.fallback_reason,
            "bytes": int(header.total_bytes),
            # read straight from the shared segment the sidecar holds the snapshot in (no gRPC)
            "shared_memory": header.HasField("shm"),
            # storage objects read straight from their files, lent by the sidecar (a full
            # checkpoint stored raw on file:// storage); 0: the bytes came through its memory
            "storage_files": len(header.shm_files),
            # replicated tensors other ranks saved: owner rank -> where they came from
            "replica_sources": replica_sources,
            # the number of ranks that saved the step (another one: a resharded restore)
            "saved_by": saved_by,
            # tensors copied without a digest to check (an older sidecar or MANIFEST, a lossy tensor)
            "unverified_tensors": _receive.unverified(header),
        }
        log.info("restored step %d from %s (%d bytes)", header.step, header.source, header.total_bytes)
        return int(header.step)

    def _with_replicas(
        self, header: pb.RestoreHeader, own: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], dict[int, str]]:
        """The state's whole flat tensor list: this rank's own tensors, and the replicated ones
        their owners saved, fetched through this rank's sidecar (its memory when it holds the
        owner's snapshot, else storage)."""
        foreign = list(header.replicas)
        if not foreign:
            return own, {}
        total = len(own) + len(foreign)
        taken = {r.index for r in foreign}
        if len(taken) != len(foreign) or max(taken) >= total:
            raise RestoreError(f"step {header.step}: the replicated tensors' positions are inconsistent")
        slots: list[torch.Tensor | None] = [None] * total
        mine = iter(own)
        for i in range(total):
            if i not in taken:
                slots[i] = next(mine)
        by_owner: dict[int, list[pb.ReplicaRef]] = {}
        for r in foreign:
            by_owner.setdefault(r.owner, []).append(r)
        sources: dict[int, str] = {}
        for owner, refs in sorted(by_owner.items()):
            req = pb.RestoreRequest(
                protocol_version=PROTOCOL_VERSION,
                identity=self._identity,
                step=header.step,
                of_rank=owner,
                attempt=header.attempt,
            )
            try:
                theirs_header, theirs = self._restore_stream(req)
            except grpc.RpcError as exc:
                raise RestoreError(
                    f"step {header.step}: the tensors rank {owner} saved for this rank: "
                    f"{exc.code().name}: {exc.details()}"
                ) from None
            by_name = {m.name: t for m, t in zip(theirs_header.tensors, theirs, strict=True)}
            for r in refs:
                t = by_name.get(r.name)
                if t is None or dtype_name(t.dtype) != r.dtype or list(t.shape) != list(r.shape):
                    raise RestoreError(
                        f"step {header.step}: rank {owner} did not save {r.name} as {r.dtype}{list(r.shape)}"
                    )
                slots[r.index] = t
            sources[owner] = theirs_header.source
        log.info(
            "step %d: %d replicated tensors from %d owner(s) (%s)",
            header.step,
            len(foreign),
            len(by_owner),
            ", ".join(f"rank {o}: {src}" for o, src in sources.items()),
        )
        return [t for t in slots if t is not None], sources

    def _resharded(
        self, state: MutableMapping[str, Any], step: int | None, refused: str
    ) -> tuple[pb.RestoreHeader, list[torch.Tensor], dict[int, str], int, int]:
        """The state a step saved by another number of ranks gives this rank: every tensor must be
        replicated across all the ranks that saved it (their manifests name its owner, as
        ``replicate()`` and DDP wrappers declare) and every plain value the same on each of them;
        then this rank gets the tree of the rank of the same number (rank 0's when the old job had
        no such rank; all are alike) and each tensor from the snapshot of the rank that saved it.
        The RNG states are the exception: a rank the old job had continues its own streams.
        Returns (header, flat tensors, where each owner's snapshot came from, the number of ranks
        that saved the step, the rank whose tree and RNG states were taken). Reading another
        world size's snapshots ends this rank's diff chain in the sidecar: the next save is full."""
        s = self.settings
        first, _ = self._read_rank(0, step, header_only=True)
        world, at, attempt = int(first.world_size), int(first.step), int(first.attempt)
        if world == s.world_size or world < 1:
            raise RestoreError(refused)
        what = f"step {at} of {s.namespace}/{s.job} was saved by {world} ranks; this job runs {s.world_size}"
        root = _tree.decode_skeleton(first.tree).get("root")
        if isinstance(root, dict) and DCP_METADATA_KEY in root:
            raise RestoreError(
                f"{what}. It was saved through torch.distributed.checkpoint: load it with "
                "dcp.load(state, storage_reader=trainer_client.dcp.StrataReader(client)), whose "
                "planner reshards it"
            )
        readers = list(_reshard.per_rank_readers(state, ()))
        if readers:  # their positions are per rank even when equal: the partition changes with the ranks
            raise RestoreError(_reshard.not_reshardable(what, world, [], [], readers))
        headers = {0: first}
        for r in range(1, world):
            headers[r] = self._read_rank(r, at, attempt, header_only=True)[0]
        base = s.rank if s.rank < world else 0
        skeletons = {r: _tree.decode_skeleton(h.tree) for r, h in headers.items()}
        # The flat tensor list of the base rank: its own tensors, with the replicated ones other
        # ranks saved at their positions.
        hb = headers[base]
        names: list[tuple[str, list[int]]] = [("", [])] * (len(hb.tensors) + len(hb.replicas))
        foreign = {r.index: (r.name, list(r.shape)) for r in hb.replicas}
        mine = iter(hb.tensors)
        for i in range(len(names)):
            if i in foreign:
                names[i] = foreign[i]
            else:
                m = next(mine, None)
                if m is None:
                    raise RestoreError(f"{what}: rank {base}'s replicated tensors' positions disagree")
                names[i] = (m.name, list(m.shape))
        paths = _tree.tensor_paths(skeletons[base])
        owned = {r: {m.name for m in h.tensors} for r, h in headers.items()}
        owner_of = {r: {ref.name: ref.owner for ref in h.replicas} for r, h in headers.items()}
        live_replicated = self._replicated_names(state) if world == 1 else set()

        def replicated(name: str) -> bool:
            if world == 1:  # one rank's state is whole: what this job declares replicated takes it
                return name in live_replicated
            owners = {owner_of[r].get(name, r if name in owned[r] else -1) for r in range(world)}
            return len(owners) == 1 and next(iter(owners)) in owned and name in owned[next(iter(owners))]

        per_rank = [
            paths[i]
            for i, (name, shape) in enumerate(names)
            if i in paths and paths[i][:1] != (_RNG_KEY,) and 0 not in shape and not replicated(name)
        ]
        plain = {r: _tree.plain_values(sk) for r, sk in skeletons.items()}
        for value in plain.values():
            value.pop(_RNG_KEY, None)  # each rank's own streams, handled above
        differ: list[tuple[Any, ...]] = []
        for r in range(world):
            for p in _tree.differences(plain[base], plain[r]):
                if p not in differ:
                    differ.append(p)
        if per_rank or differ:
            raise RestoreError(_reshard.not_reshardable(what, world, per_rank, differ, []))
        own_header, own = self._read_rank(base, at, attempt)
        tensors, sources = self._with_replicas(own_header, own)
        sources = {base: own_header.source, **sources}
        log.warning(
            "%s: restoring its replicated state on rank %d from the snapshots of rank(s) %s",
            what,
            s.rank,
            sorted(sources),
        )
        return own_header, tensors, sources, world, base

    def _replicated_names(self, state: MutableMapping[str, Any]) -> set[str]:
        """Names of the state's tensors this job replicates across all its ranks."""
        everyone = tuple(range(self.settings.world_size))
        groups = self._replica_groups(state)
        return {
            name for name, t in self._flat(state, rng=False).tensors if groups.get(_tensor_key(t)) == everyone
        }

    # --- reads of any rank (trainer_client.dcp) ------------------------------------------

    def _save_plain(self, step: int, state: MutableMapping[str, Any]) -> SaveHandle:
        """Save ``state`` as given (see ``_save``'s ``plain``), waiting for a save in flight
        instead of skipping."""
        if self._restart_generation:
            raise RestartInPlace(self._restart_generation)
        return self._save(step, state, plain=True)

    def _read_rank(
        self, rank: int, step: int | None = None, attempt: int | None = None, header_only: bool = False
    ) -> tuple[pb.RestoreHeader, list[torch.Tensor]]:
        """What ``rank`` saved at a commit (``step`` and ``attempt``; ``step`` alone: its newest valid
        commit; neither: the step this attempt restores), whatever number of ranks saved it; this
        rank's own restore state stays as it is. ``header_only``: the header, no tensors."""
        if "restore.any_rank" not in self.server_info.capabilities:
            raise RestoreError(
                f"the sidecar ({self.server_info.server_version}) cannot serve another rank's snapshot "
                "of any world size: upgrade it"
            )
        req = pb.RestoreRequest(
            protocol_version=PROTOCOL_VERSION, identity=self._identity, of_rank=rank, header_only=header_only
        )
        if step is not None:
            req.step = step
        if attempt is not None:
            req.attempt = attempt
        try:
            if not header_only:
                return self._restore_stream(req)
            # no local holds the call: see _untangle
            messages = list(
                self._stub.Restore(req, timeout=self.settings.rpc_timeout_s, metadata=self._metadata)
            )
        except grpc.RpcError as exc:
            _untangle(exc)
            what = f"step {step}" if step is not None else "the newest committed step"
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise SidecarUnavailable(f"{what} of rank {rank}: {exc.details()}") from None
            msg = f"{what} of rank {rank}: {exc.code().name}: {exc.details()}"
            if exc.code() == grpc.StatusCode.NOT_FOUND and step is None:
                raise RestoreError(msg) from NothingToRestore()
            raise RestoreError(msg) from None
        if len(messages) != 1 or messages[0].WhichOneof("msg") != "header":
            raise RestoreError(f"rank {rank}: a header-only read got more than one header")
        return messages[0].header, []

    def _restore_stream(
        self, req: pb.RestoreRequest, in_place: _receive.InPlace | None = None
    ) -> tuple[pb.RestoreHeader, list[torch.Tensor]]:
        """One Restore call, asked again while the sidecar refuses it for lack of a free slot
        (its blocking calls or memory are momentarily taken by other ranks)."""
        deadline, delay = time.monotonic() + self.settings.rpc_timeout_s, 0.1
        shm_dir = self._segments.directory if self._segments is not None else ""
        req.shm_ok = bool(shm_dir)
        req.files_ok = req.shm_ok and not self._files_refused
        while True:
            try:
                # no local holds the call: see _untangle
                return _receive.receive(
                    self._stub.Restore(req, timeout=self.settings.rpc_timeout_s, metadata=self._metadata),
                    shm_dir,
                    in_place,
                )
            except _receive.FilesUnusable as exc:  # the sidecar reads the objects itself instead
                (log.error if exc.changed else log.info)("%s; restoring through the sidecar's memory", exc)
                req.files_ok = False
                self._files_refused |= exc.refused  # the same answer would come again
            except _receive.SegmentChanged as exc:  # not the file the sidecar checked: its own copy instead
                log.error("%s; restoring over gRPC", exc)
                req.shm_ok = False
            except _receive.SegmentGone as exc:  # the sidecar forgot it meanwhile: the bytes come over gRPC
                log.info("%s; restoring over gRPC", exc)
                req.shm_ok = False
            except grpc.RpcError as exc:
                _untangle(exc)
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() + delay >= deadline:
                    raise
                log.info("restore refused for now (%s); retrying", exc.details())
                time.sleep(delay)
                delay = min(2 * delay, 2.0)


def _untangle(exc: grpc.RpcError) -> None:
    """Drop the traceback of a streaming call's error. grpc's call object is itself the error,
    and the frames of its traceback hold the call: a cycle that keeps those frames' callers (the
    training script's state, its DataLoaders' worker processes) alive until a garbage
    collection, whose finalizers stop a loader's queue threads before its workers are told to
    exit: each worker then takes 5 s to be given up on."""
    exc.__traceback__ = None


def _check_step(step: Any) -> None:
    """Steps are non-negative ints that storage keys spell in 12 digits: refused here, before
    anything is staged, rather than saved where no listing would find them."""
    try:
        value = operator.index(step)
    except TypeError:
        value = -1
    if isinstance(step, bool) or not 0 <= value <= MAX_STEP:
        raise ValueError(f"step must be an int from 0 to {MAX_STEP} (keys hold 12 digits), got {step!r}")


def _view(bufs: HostBuffers, s: Slot) -> torch.Tensor:
    assert bufs.flat is not None
    return bufs.flat[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)


def _handover_socket(capabilities: Sequence[str]) -> str:
    """The sidecar's socket (in its shm dir) that takes sealed memfd segments, or ""."""
    for cap in capabilities:
        name = cap.removeprefix(SHM_HANDOVER_CAPABILITY)
        if name != cap and re.fullmatch(SHM_HANDOVER_SOCKET, name):
            return name
    return ""


__all__ = ["CheckpointClient", "Committed", "SaveHandle"]
