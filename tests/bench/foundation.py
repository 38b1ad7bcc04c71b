"""Foundation section: what a save costs the training thread, and how fast bytes move.

One ~1 GiB fp32 state (4 embedding tables plus a small dense tower, SGD with sparse
gradients) is measured side by side: the memcpy floor, Strata's save() stall, torch.save,
DCP async_save, per-save overhead inside a calibrated training loop (Strata synchronous and
overlapped staging, DCP defaults and DCP's background stager), gRPC ingest against a raw
socket, time to durable on a real SeaweedFS, and the training slowdown at a realistic
save interval.

Method notes:
- Storage: the loop comparison and the gRPC ingest use a sidecar writing to local disk
  (file://), like DCP's FileSystemWriter beside it; durability, slowdown and the shortest
  sustainable interval use a sidecar uploading to SeaweedFS (S3). Sidecars run in their own
  (spawned) process, as in a pod; SeaweedFS shares this machine's cores, unlike real S3.
- Training loops run at ``Options.loop_threads`` torch threads (see there); memcpy, stalls and
  torch.save run at torch's default.
- Per-save overhead is charged to the steps each save's work overlaps (see
  ``attributed_overhead``), not taken from two long runs minutes apart: on a shared machine
  the drift between those exceeds the overhead. ``overhead_null_s`` runs the same estimator
  on a save that does nothing: its bias.
- Strata runs with its defaults: shared-memory staging and the intermittent policy, so after
  the first checkpoint it writes only the rows the training steps changed. Beside it:
  ``save_overhead_grpc_s`` (bytes streamed over gRPC instead) and ``save_overhead_full_s``
  (every checkpoint full, as DCP writes them); ``time_to_durable_first_s`` is the first,
  full checkpoint, first-save costs included.
- ``DenseTrainer`` (beside ``Trainer``, used by the ``peers_dense`` section) is the dense variant of
  the state: the same bytes as a stack of Linear layers trained by AdamW, so every parameter and
  both Adam moments change every step, as in an LLM.
- Time to durable against the storage floor: ``time_to_durable_full_s`` (a sidecar with policy
  full, every repeat the whole state) alternates ABBA with ``boto3_multipart_same_bytes_s``, a
  plain boto3 TransferManager upload of the same bytes to the same SeaweedFS with the S3 store's
  part size and the sidecar's upload concurrency; medians with 95% CIs over the repeats, and
  ``time_to_durable_vs_boto3_ratio`` their ratio (its CI from the paired ratios).
"""

from __future__ import annotations

import contextlib
import gc
import io
import itertools
import logging
import math
import os
import shutil
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from sidecar.api import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    channel_options,
    pb,
    pb_grpc,
)
from sidecar.local.seaweed import SeaweedServer
from tests.bench.common import GiB, Phases, Row, SidecarProcess, median, median_ci, timed
from tests.bench.common import Options as BaseOptions
from trainer_client import CheckpointClient
from trainer_client.errors import SaveSkipped

DIM = 64
TABLES = 4
HIDDEN = 1024
BATCH = 512
BAG = 8  # ids per sample per table: BATCH * BAG rows of every table change each step

# Every figure this section writes (the quick test checks each is a finite positive number).
KEYS = (
    "memcpy_s",
    "save_stall_s",
    "first_save_stall_s",
    "torch_save_s",
    "dcp_async_save_stall_s",
    "save_overhead_s",
    "save_overhead_sync_s",
    "save_overhead_grpc_s",
    "save_overhead_full_s",
    "overlapped_overhead_s",
    "dcp_overhead_s",
    "dcp_async_stager_overhead_s",
    "loop_saves",
    "grpc_ingest_gib_per_s",
    "socket_gib_per_s",
    "time_to_durable_s",
    "time_to_durable_full_s",
    "boto3_multipart_same_bytes_s",
    "time_to_durable_vs_boto3_ratio",
    "train_slowdown",
    "min_interval_no_skip_s",
    "save_stall_s_with_tracking",
)


class Options(BaseOptions):
    @property
    def repeats(self) -> int:
        return 3 if self.quick else 5

    @property
    def loop_saves(self) -> int:
        """Saves per loop variant; the median survives a few disturbed by other tenants."""
        return 3 if self.quick else 16

    @property
    def overlapped_saves(self) -> int:
        """Overlapped staging's target (a fraction of a memcpy) is an order of magnitude tighter
        than the others: three times the saves halve the width of its confidence interval."""
        return 3 if self.quick else 48


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --- the model and its training step -----------------------------------------------------------


class BenchModel(nn.Module):
    """Recsys-shaped: a few large embedding tables (almost all the bytes) and a small dense tower."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(rows, DIM, sparse=True) for _ in range(TABLES))
        self.proj = nn.Linear(DIM * TABLES, HIDDEN)
        self.tower = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, 1)


def rows_of(model: BenchModel) -> int:
    table = model.tables[0]
    assert isinstance(table, nn.Embedding)
    return int(table.num_embeddings)


class Trainer:
    """A synthetic training step: sparse lookups, ``reps`` passes through the tower (the knob that
    sets the step time), backward, and a real SGD step that mutates the touched rows of every
    table, so a snapshot that is not a consistent copy would be caught by construction."""

    def __init__(self, model: BenchModel, reps: int = 1) -> None:
        self.model = model
        self.reps = reps
        self.rows = rows_of(model)
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        self._gen = torch.Generator().manual_seed(0)

    def step(self) -> None:
        m = self.model
        ids = torch.randint(0, self.rows, (BATCH, TABLES, BAG), generator=self._gen)
        x = torch.cat([t(ids[:, i]).sum(1) for i, t in enumerate(m.tables)], dim=1)
        h = torch.tanh(m.proj(x))
        for _ in range(self.reps):
            h = torch.tanh(m.tower(h))
        loss = m.head(h).square().mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.opt}

    def plain_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


# --- the dense variant: every parameter and Adam moment changes every step ----------------------

DENSE_LAYERS = 4
DENSE_BATCH = 8  # samples per micro-batch; ``reps`` micro-batches are accumulated per optimizer step


class DenseModel(nn.Module):
    """LLM-shaped as a checkpoint sees it: a stack of square Linear layers, every parameter trained."""

    def __init__(self, width: int, layers: int = DENSE_LAYERS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))


def dense_width(size_bytes: float, layers: int = DENSE_LAYERS) -> int:
    """The width whose fp32 parameters are a third of ``size_bytes``: AdamW's two moments, as large
    again each, make up the rest, so the checkpointed state is ``size_bytes`` like the sparse one's."""
    params = size_bytes / 3 / 4 / layers  # per layer: width * width weights + width biases
    return max(16, int((math.sqrt(1 + 4 * params) - 1) / 2))


class DenseTrainer:
    """The dense counterpart of :class:`Trainer`: ``reps`` micro-batches through the whole stack
    (gradient accumulation: the knob that sets the step time), then an AdamW step with weight decay,
    so every parameter and both moments of every element change every step, and a diff is the
    whole state. Gradients stay allocated between steps (zeroed, not freed), as a caching
    allocator keeps them on a GPU: no page faults of a third of the state per step."""

    def __init__(self, model: DenseModel, reps: int = 1) -> None:
        self.model = model
        self.reps = reps
        first = model.layers[0]
        assert isinstance(first, nn.Linear)
        self.width = int(first.in_features)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        self._gen = torch.Generator().manual_seed(0)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        for _ in range(self.reps):
            h = torch.randn(DENSE_BATCH, self.width, generator=self._gen)
            for layer in self.model.layers:
                h = torch.tanh(layer(h))
            h.square().mean().backward()
        self.opt.step()

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.opt}

    def plain_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


class Stepper(Protocol):
    """All the overhead estimator needs: one training step per call."""

    def step(self) -> None: ...


class Steps(Stepper, Protocol):
    """What the measurements need of a trainer: :class:`Trainer` or :class:`DenseTrainer`."""

    reps: int

    @property
    def model(self) -> nn.Module: ...

    @property
    def opt(self) -> torch.optim.Optimizer: ...

    def state(self) -> dict[str, Any]: ...

    def plain_state(self) -> dict[str, Any]: ...


def make_trainer(state: str, size_gib: float) -> Trainer | DenseTrainer:
    """The foundation's state at ``size_gib``: ``sparse`` (tables, SGD) or ``dense`` (AdamW)."""
    if state == "dense":
        return DenseTrainer(DenseModel(dense_width(size_gib * GiB)))
    return Trainer(BenchModel(max(1024, int(size_gib * GiB / (TABLES * DIM * 4)))))


def state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def calibrate(trainer: Steps, target_s: float, repeats: int) -> float:
    """Pick ``trainer.reps`` so a step takes about ``target_s``; returns the measured median step."""

    def step_time(reps: int) -> float:
        trainer.reps = reps
        return median(timed(trainer.step, repeats, warmup=1))

    lo, hi = step_time(1), step_time(5)
    per_rep = max((hi - lo) / 4, 1e-4)
    trainer.reps = max(1, math.ceil((target_s - (lo - per_rep)) / per_rep))
    measured = step_time(trainer.reps)
    for _ in range(3):  # a noisy first fit can undershoot; the floor matters, not the exact value
        if measured >= target_s * 0.9:
            break
        trainer.reps = math.ceil(trainer.reps * target_s / measured) + 1
        measured = step_time(trainer.reps)
    return measured


# --- single measurements ---------------------------------------------------------------------


def measure_memcpy(model: nn.Module, repeats: int, tries: int = 3) -> float:
    """The floor: copy every state tensor into pre-faulted buffers at torch's default thread count.

    Median of ``repeats`` copies. Every ratio is taken against this figure, so a batch that a
    burst of other work on the shared machine visibly disturbed (slowest > 1.5x fastest) is
    measured again, up to ``tries`` times, keeping the batch with the lowest median.
    """
    src = list(model.state_dict().values())
    dst = [torch.empty_like(t) for t in src]
    for d in dst:
        d.zero_()  # fault the pages in now, so the copies measure bandwidth, not page faults

    def copy() -> None:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)

    best = math.inf
    for _ in range(tries):
        times = timed(copy, repeats, warmup=1)
        best = min(best, median(times))
        print("     memcpy: " + ", ".join(f"{t:.4f}" for t in times) + " s", flush=True)
        if max(times) <= 1.5 * min(times):
            break
    return best


def measure_torch_save(trainer: Trainer, directory: Path, repeats: int) -> float:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "state.pt"

    def save() -> None:
        torch.save(trainer.plain_state(), path)

    try:
        return median(timed(save, repeats, warmup=1))
    finally:
        path.unlink(missing_ok=True)


def dcp_save(trainer: Steps, directory: Path, stager: DefaultStager | None = None) -> Any:
    """DCP async_save of the state as a user would call it (Stateful objects, FileSystemWriter)."""
    writer = dcp.FileSystemWriter(str(directory), overwrite=True)
    return dcp.async_save(trainer.state(), storage_writer=writer, async_stager=stager, no_dist=True)


def upload_future(response: Any) -> Future[Any]:
    """async_save returns a plain Future, or an AsyncSaveResponse when the stager is asynchronous."""
    return response.upload_completion if hasattr(response, "upload_completion") else response


def measure_dcp_stall(trainer: Trainer, directory: Path, repeats: int) -> tuple[float, float]:
    """(median time async_save() takes to return, median time until its future resolves)."""
    stalls, durable = [], []
    for i in range(repeats + 1):
        trainer.step()  # mutate between saves, as training would
        t0 = time.perf_counter()
        response = dcp_save(trainer, directory)
        t1 = time.perf_counter()
        upload_future(response).result()
        if i:  # the first one is warm-up
            stalls.append(t1 - t0)
            durable.append(time.perf_counter() - t0)
    return median(stalls), median(durable)


def measure_socket(total: int, chunk: int, repeats: int) -> float:
    """GiB/s of a unix-socket pair, sendall in this thread, recv_into a reused buffer in another."""
    payload = memoryview(os.urandom(chunk))
    count = max(1, total // chunk)
    total = count * chunk

    def once() -> None:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sink = memoryview(bytearray(chunk))

        def drain() -> None:
            got = 0
            while got < total:
                n = b.recv_into(sink)
                if not n:
                    break
                got += n

        reader = threading.Thread(target=drain, name="bench-socket-reader")
        reader.start()
        try:
            for _ in range(count):
                a.sendall(payload)
            reader.join()
        finally:
            a.close()
            b.close()

    return total / median(timed(once, repeats, warmup=1)) / GiB


def measure_ingest(
    socket_path: str, job: str, steps: Iterator[int], total: int, repeats: int
) -> tuple[float, float]:
    """(GiB/s of a Save stream from its first message to the ack, median seconds to COMMIT).

    Drives the stubs directly with pre-made DEFAULT_CHUNK_BYTES chunks, so the figure is the
    wire and the sidecar's receive path, not the client's staging.
    """
    channel = grpc.insecure_channel(f"unix:{socket_path}", options=channel_options(DEFAULT_MAX_MESSAGE_BYTES))
    stub = pb_grpc.CheckpointerStub(channel)
    identity = pb.Identity(
        namespace="default", job=job, rank=0, world_size=1, attempt=0, generation="bench/0"
    )
    chunks = [pb.SaveRequest(chunk=os.urandom(DEFAULT_CHUNK_BYTES)) for _ in range(4)]
    count = max(1, total // DEFAULT_CHUNK_BYTES)
    nbytes = count * DEFAULT_CHUNK_BYTES
    rates, durable = [], []
    try:
        for i in range(repeats + 1):
            step, save_id = next(steps), uuid.uuid4().hex[:16]
            header = pb.SaveRequest(
                header=pb.SaveHeader(
                    protocol_version=PROTOCOL_VERSION,
                    identity=identity,
                    step=step,
                    save_id=save_id,
                    tensors=[pb.TensorMeta(name="blob", dtype="uint8", shape=[nbytes], nbytes=nbytes)],
                )
            )
            footer = pb.SaveRequest(footer=pb.SaveFooter(total_bytes=nbytes))

            def requests(header: pb.SaveRequest = header, footer: pb.SaveRequest = footer) -> Iterator[Any]:
                yield header
                for j in range(count):
                    yield chunks[j % len(chunks)]
                yield footer

            t0 = time.perf_counter()
            stub.Save(requests(), timeout=600)
            t1 = time.perf_counter()
            _wait_committed(stub, identity, step, save_id)
            if i:
                rates.append(nbytes / (t1 - t0) / GiB)
                durable.append(time.perf_counter() - t0)
    finally:
        channel.close()
    return median(rates), median(durable)


def _wait_committed(stub: Any, identity: Any, step: int, save_id: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        req = pb.WaitCommittedRequest(identity=identity, step=step, save_id=save_id, timeout_seconds=30.0)
        status = stub.WaitCommitted(req, timeout=60)
        if status.state == pb.COMMIT_STATE_COMMITTED:
            return
        if status.state == pb.COMMIT_STATE_FAILED:
            raise RuntimeError(f"bench save of step {step} failed: {status.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench save of step {step} not committed within {timeout:.0f} s")


# --- training loops ------------------------------------------------------------------------------


@dataclass
class LoopRun:
    elapsed: float
    steps: int
    saves: int = 0
    skipped: int = 0
    failed: int = 0
    save_calls: list[float] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return self.elapsed / self.steps

    @property
    def interval_s(self) -> float:
        """Median time between consecutive save() calls."""
        gaps = [b - a for a, b in itertools.pairwise(self.save_calls)]
        return median(gaps) if gaps else math.nan


def run_loop(trainer: Trainer, steps: int, k: int = 0, save: Callable[[], None] | None = None) -> LoopRun:
    """``steps`` training steps; with ``save``, one save after the optimizer step of every k-th
    step starting with the first, so every save has k - 1 steps after it inside the timed loop."""
    calls: list[float] = []
    t0 = time.perf_counter()
    for i in range(steps):
        trainer.step()
        if save is not None and i % k == 0:
            calls.append(time.perf_counter())
            save()
    return LoopRun(time.perf_counter() - t0, steps, save_calls=calls)


def steps_until(trainer: Steps, fut: Future[Any], min_steps: int = 2, timeout: float = 600.0) -> None:
    """Keep training until ``fut`` resolves (a warm-up save finishing under load)."""
    deadline = time.monotonic() + timeout
    n = 0
    while (n < min_steps or not fut.done()) and time.monotonic() < deadline:
        trainer.step()
        n += 1


def _outcomes(handles: list[Any], run: LoopRun, timeout: float = 600.0) -> LoopRun:
    for h in handles:
        if h.skipped:
            run.skipped += 1
            continue
        run.saves += 1
        try:
            h.durable.result(timeout)
        except SaveSkipped:
            run.skipped += 1
        except Exception:
            run.failed += 1
    return run


@contextlib.contextmanager
def quiet_client() -> Iterator[None]:
    """Refused saves are the expected outcome while probing intervals, not news."""
    logger = logging.getLogger("strata.client")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def make_client(
    socket_path: str,
    job: str,
    optimizers: list[torch.optim.Optimizer] | None = None,
    shm: str = "auto",
    overlap: str = "auto",
    **settings: Any,
) -> Any:
    return CheckpointClient(
        job=job,
        socket=socket_path,
        optimizers=optimizers or [],
        shm=shm,
        overlap=overlap,
        resume="never",
        when_busy="skip",
        connect_timeout_s=60.0,
        **settings,
    )


@dataclass
class Attributed:
    """Per-save overheads, each the extra time of the training steps that a save's work overlapped."""

    overheads: list[float] = field(default_factory=list)
    spans: list[int] = field(default_factory=list)  # steps charged to each save
    failed: int = 0

    @property
    def overhead_s(self) -> float:
        return median(self.overheads)

    @property
    def span_steps(self) -> float:
        return median([float(s) for s in self.spans])

    @property
    def ci(self) -> tuple[float, float]:
        return median_ci(self.overheads)


QUIET_STEPS = 4  # steps without a save on each side of every save's span


def attributed_overhead(
    trainer: Stepper,
    n: int,
    save: Callable[[], Future[Any]],
    quiet: int = QUIET_STEPS,
    margin: int = 1,
) -> Attributed:
    """(loop time with a save - the same steps without one), per save, measured where it happens.

    The loop runs ``quiet`` steps, then a step followed by ``save()``, then steps until the save's
    durable future resolves plus ``margin`` more, then ``quiet`` steps again, ``n`` times. Every
    bit of a save's work (its stall, the optimizer pre-hook's wait, the background copy, the
    sidecar's or DCP's writing competing for cores and memory bandwidth) falls inside its span,
    so overhead = sum(span step times) - len(span) x median(quiet steps on both sides). Steps
    outside any span cost the same with or without saves, so leaving them out removes their
    noise instead of adding it: on this shared machine a whole window of 40 steps wanders by
    +-0.2 s, a single step by a few ms. The median baseline ignores a noisy neighbour's spike in
    the quiet steps but not in the span, which biases the figure up, never down
    (``overhead_null_s`` measures that bias).
    """
    res = Attributed()

    def step() -> float:
        t0 = time.perf_counter()
        trainer.step()
        return time.perf_counter() - t0

    before = [step() for _ in range(quiet)]
    for _ in range(n):
        t0 = time.perf_counter()
        trainer.step()
        fut = save()
        span = [time.perf_counter() - t0]
        while not fut.done():
            span.append(step())
        span += [step() for _ in range(margin)]
        try:
            fut.result(600)
        except Exception:
            res.failed += 1
        after = [step() for _ in range(quiet)]
        res.overheads.append(sum(span) - len(span) * median(before + after))
        res.spans.append(len(span))
        before = after
    return res


def saves_cpu_s(per_step: list[float], spans: list[int], quiet: int = QUIET_STEPS) -> tuple[float, float]:
    """(CPU the saves added, CPU of a step without a save) from the CPU of every step of one
    ``attributed_overhead`` loop, in order (``quiet`` steps, then per save its span and ``quiet``
    steps). The CPU of the spans' steps less as many times the mean of the quiet steps' CPU: what
    the same training steps would have cost without saves. The mean, not the median: /proc counts
    CPU in ticks of 10 ms, a good part of a short step, and the mean of many steps does not round."""
    quiet_cpu, span_cpu, span_steps, i = list(per_step[:quiet]), 0.0, 0, quiet
    for span in spans:
        span_cpu += sum(per_step[i : i + span])
        span_steps += span
        quiet_cpu += per_step[i + span : i + span + quiet]
        i += span + quiet
    if i != len(per_step) or not quiet_cpu:
        raise ValueError(f"{len(per_step)} steps do not match spans {spans} with {quiet} quiet steps")
    step_cpu = sum(quiet_cpu) / len(quiet_cpu)
    return span_cpu - span_steps * step_cpu, step_cpu


def null_save(delay: float) -> Callable[[], Future[Any]]:
    """A save that does no work and resolves after ``delay`` s: the estimator's own bias."""

    def save() -> Future[Any]:
        fut: Future[Any] = Future()
        threading.Timer(delay, fut.set_result, (None,)).start()
        return fut

    return save


def strata_overhead(
    trainer: Trainer,
    socket_path: str,
    job: str,
    steps: Iterator[int],
    overlap: bool,
    n: int,
    shm: str = "auto",
    policy: str = "auto",
) -> Attributed:
    """``overlap``: pass the optimizer explicitly; ``policy``: the client's overlap setting (its
    default, "auto", finds the optimizer in the state by itself)."""
    client = make_client(socket_path, job, [trainer.opt] if overlap else None, shm, policy)
    state = trainer.state()
    try:
        client.resume(state)  # as a training script starts: the client learns the state
        warm = client.save(next(steps), state)  # allocates the staging buffer outside the timing
        steps_until(trainer, warm.durable)
        warm.durable.result(600)
        return attributed_overhead(trainer, n, lambda: client.save(next(steps), state).durable)
    finally:
        client.close()


def dcp_overhead(trainer: Trainer, directory: Path, n: int, background: bool) -> Attributed:
    """DCP async_save; with ``background``, DCP's DefaultStager copies in a thread and the
    optimizer step waits for that copy (an optimizer pre-hook, as Strata's overlapped mode does)."""
    stager = (
        # Defaults, less the CUDA-only options (pinned memory, non-blocking copies).
        DefaultStager(StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False))
        if background
        else None
    )
    staging: list[Future[Any]] = []

    def wait_staged(*_: Any) -> None:
        if staging:
            staging.pop().result()

    def save() -> Future[Any]:
        response = dcp_save(trainer, directory, stager)
        if hasattr(response, "staging_completion"):
            staging.append(response.staging_completion)
        return upload_future(response)

    hook = trainer.opt.register_step_pre_hook(wait_staged)
    try:
        warm = save()  # DefaultStager allocates its cached copy here
        steps_until(trainer, warm)
        warm.result(600)
        return attributed_overhead(trainer, n, save)
    finally:
        hook.remove()
        if stager is not None:
            stager.close()


def proc_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) a process has used so far; NaN where /proc cannot tell."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return math.nan


def s3_client(endpoint: str, concurrency: int) -> tuple[Any, Any]:
    """A boto3 S3 client for SeaweedFS configured as Strata's S3 store configures its own (no CRC
    trailers, no payload signing where TLS allows, path-style), and a TransferConfig with the
    store's part size and threshold and ``concurrency`` parts in flight."""
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    from sidecar.store.s3 import DEFAULT_MULTIPART_THRESHOLD, DEFAULT_PART_BYTES

    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="strata",
        aws_secret_access_key="strata",
        config=Config(
            region_name="us-east-1",
            max_pool_connections=max(10, concurrency + 4),
            s3={"addressing_style": "path", "payload_signing_enabled": False},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )
    transfer = TransferConfig(
        multipart_threshold=DEFAULT_MULTIPART_THRESHOLD,
        multipart_chunksize=DEFAULT_PART_BYTES,
        max_concurrency=concurrency,
        use_threads=True,
        preferred_transfer_client="classic",
    )
    return client, transfer


def boto3_floor(endpoint: str, bucket: str) -> tuple[Callable[[str, bytes], float], dict[str, int]]:
    """A plain boto3 multipart upload (TransferManager's upload_fileobj) to ``endpoint``: the
    floor a full checkpoint's time to durable is held against. Its client is configured as
    Strata's S3 store configures its own (no CRC trailers, no payload signing where TLS allows,
    path-style), with the store's part size and threshold and the sidecar's upload concurrency, so
    the two differ in the pipeline only. Returns ``upload(key, body) -> seconds`` and the settings."""
    from sidecar.config import SidecarSettings
    from sidecar.store.s3 import DEFAULT_PART_BYTES

    concurrency = SidecarSettings().upload_concurrency
    client, transfer = s3_client(endpoint, concurrency)

    def upload(key: str, body: bytes) -> float:
        t0 = time.perf_counter()
        client.upload_fileobj(io.BytesIO(body), bucket, key, Config=transfer)  # shares body's bytes
        elapsed = time.perf_counter() - t0
        client.delete_object(Bucket=bucket, Key=key)  # SeaweedFS's disk holds as much as Strata's
        return elapsed

    return upload, {"part_bytes": DEFAULT_PART_BYTES, "concurrency": concurrency}


@dataclass
class Floor:
    """Full checkpoints' time to durable beside a plain boto3 upload of the same bytes: seconds per
    repeat of each, and CPU seconds each spent on this side of the wire (client and sidecar for
    Strata, the uploading process for boto3; SeaweedFS's own is left out of both)."""

    strata: list[float] = field(default_factory=list)
    boto3: list[float] = field(default_factory=list)
    strata_cpu_s: float = 0.0
    boto3_cpu_s: float = 0.0


def durable_vs_boto3(
    trainer: Trainer,
    sidecar: SidecarProcess,
    upload: Callable[[str, bytes], float],
    job: str,
    steps: Iterator[int],
    repeats: int,
) -> Floor:
    """Time to durable of full checkpoints (``sidecar`` runs policy full) and a plain boto3
    multipart upload of the same bytes, alternated ABBA so drift of the machine falls on both alike."""
    state = trainer.state()
    body = b"".join(memoryview(t.detach().contiguous().numpy()).cast("B") for t in state_tensors(trainer))
    assert len(body) == state_bytes(trainer.model)
    client = make_client(sidecar.socket, job)
    out = Floor()
    me = os.getpid()

    def cpu() -> float:
        return proc_cpu_s(me) + proc_cpu_s(sidecar.pid)

    def save() -> None:
        trainer.step()
        before = cpu()
        t0 = time.perf_counter()
        client.save(next(steps), state).durable.result(600)
        out.strata.append(time.perf_counter() - t0)
        out.strata_cpu_s += cpu() - before

    def floor() -> None:
        before = proc_cpu_s(me)
        out.boto3.append(upload(f"floor-{len(out.boto3)}", body))
        out.boto3_cpu_s += proc_cpu_s(me) - before

    try:
        client.resume(state)
        for _ in range(3):
            trainer.step()
        client.save(next(steps), state).durable.result(600)  # warm-up: first-save costs
        upload("warm-up", body)
        for i in range(repeats):
            for fn in (save, floor) if i % 2 == 0 else (floor, save):
                fn()
    finally:
        client.close()
    return out


def state_tensors(trainer: Steps) -> list[torch.Tensor]:
    """The tensors a save of ``trainer.state()`` carries: parameters and optimizer state."""
    tensors = list(trainer.model.state_dict().values())
    for per_param in trainer.opt.state_dict()["state"].values():
        tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return tensors


# --- the section -----------------------------------------------------------------------------------


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    # DCP's notes about running without a process group and overwriting its own directory.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    torch.manual_seed(0)
    rows = max(1024, int(opts.size_gib * GiB / (TABLES * DIM * 4)))
    with phases("build state"):
        trainer = Trainer(BenchModel(rows))
    total = state_bytes(trainer.model)
    figures["state_bytes"] = total
    steps = itertools.count()
    services: list[Callable[[], None]] = []
    try:
        _run(opts, figures, phases, trainer, total, steps, services)
    finally:
        for stop in reversed(services):
            stop()
    return _rows(figures)


def _run(
    opts: Options,
    figures: dict[str, Any],
    phases: Phases,
    trainer: Trainer,
    total: int,
    steps: Iterator[int],
    services: list[Callable[[], None]],
) -> None:
    reps = opts.repeats
    job = f"bench-{uuid.uuid4().hex[:8]}"

    with phases("memcpy floor"):
        memcpy = figures["memcpy_s"] = measure_memcpy(trainer.model, reps)
        gc.collect()

    with phases("torch.save / DCP async_save"):
        figures["torch_save_s"] = measure_torch_save(trainer, opts.tmp / "torch-save", 3)
        stall, dcp_durable = measure_dcp_stall(trainer, opts.tmp / "dcp", 3)
        figures["dcp_async_save_stall_s"] = stall
        figures["dcp_durable_s"] = dcp_durable
        shutil.rmtree(opts.tmp / "dcp", ignore_errors=True)
        gc.collect()

    with phases("socket vs gRPC ingest"):
        figures["socket_gib_per_s"] = measure_socket(total, DEFAULT_CHUNK_BYTES, reps)
        file_sidecar = SidecarProcess(f"file://{opts.tmp}/store", str(opts.tmp / "file.sock")).start()
        services.append(file_sidecar.stop)
        # The same with every checkpoint full (no diffs): what the default policy saves.
        full_sidecar = SidecarProcess(
            f"file://{opts.tmp}/store-full", str(opts.tmp / "full.sock"), policy="full"
        ).start()
        services.append(full_sidecar.stop)
        cpu0 = proc_cpu_s(file_sidecar.pid)
        rate, file_durable = measure_ingest(file_sidecar.socket, job, steps, total, 3)
        # CPU the sidecar burns per GiB received and written (4 saves: warm-up + 3): on a node it
        # comes out of the trainer's cores.
        figures["file_sidecar_cpu_s_per_gib"] = (proc_cpu_s(file_sidecar.pid) - cpu0) / (4 * total / GiB)
        figures["grpc_ingest_gib_per_s"] = rate
        figures["file_time_to_durable_s"] = file_durable

    figures["loop_threads"] = opts.loop_threads
    with phases("training loops (file://)"), torch_threads(opts.loop_threads):
        step_s = figures["step_s"] = calibrate(trainer, max(4 * memcpy, 0.05), 3)
        figures["step_reps"] = trainer.reps
        n = figures["loop_saves"] = opts.loop_saves
        sock = file_sidecar.socket
        for key, measure in (
            # The estimator on a save that does nothing for about as long as a diff takes.
            ("overhead_null", lambda: attributed_overhead(trainer, n, null_save(2 * step_s))),
            # Defaults: overlapped staging of the optimizer found in the state. The tightest
            # target (a fraction of a memcpy), so as many saves as the overlapped variant had.
            (
                "save_overhead",
                lambda: strata_overhead(trainer, sock, job, steps, False, opts.overlapped_saves),
            ),
            (
                "save_overhead_sync",
                lambda: strata_overhead(trainer, sock, job, steps, False, n, policy="off"),
            ),
            ("save_overhead_grpc", lambda: strata_overhead(trainer, sock, job, steps, False, n, "off")),
            (
                "save_overhead_full",
                lambda: strata_overhead(trainer, full_sidecar.socket, job, steps, False, n),
            ),
            (
                "overlapped_overhead",
                lambda: strata_overhead(trainer, sock, job, steps, True, n),
            ),
            ("dcp_overhead", lambda: dcp_overhead(trainer, opts.tmp / "dcp-loop", n, False)),
            ("dcp_async_stager_overhead", lambda: dcp_overhead(trainer, opts.tmp / "dcp-loop", n, True)),
        ):
            res = measure()
            low, high = res.ci
            figures[f"{key}_s"] = res.overhead_s
            figures[f"{key}_ci_low_s"], figures[f"{key}_ci_high_s"] = low, high
            figures[f"{key}_saves"] = len(res.overheads)
            figures[f"{key}_span_steps"] = res.span_steps
            figures[f"{key}_failed"] = res.failed
            print(
                f"     {key}: " + ", ".join(f"{o:+.3f}" for o in res.overheads) + " s per save; "
                f"median {res.overhead_s:+.4f} s, 95% CI [{low:+.4f}, {high:+.4f}]; "
                f"steps charged {res.span_steps:g} (median)",
                flush=True,
            )
            gc.collect()
        shutil.rmtree(opts.tmp / "dcp-loop", ignore_errors=True)
        for sidecar in (file_sidecar, full_sidecar):
            services.remove(sidecar.stop)
            sidecar.stop()

    with phases("SeaweedFS: full checkpoint against boto3"):
        weed = SeaweedServer(opts.tmp / "weed").start()
        services.append(weed.stop)
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        weed.create_bucket(bucket)
        # Every checkpoint full, so each repeat uploads the whole state, as the floor beside it does.
        full_s3 = SidecarProcess(
            f"s3://{bucket}/full", str(opts.tmp / "s3-full.sock"), s3_endpoint=weed.endpoint, policy="full"
        ).start()
        services.append(full_s3.stop)
        upload, floor_cfg = boto3_floor(weed.endpoint, bucket)
        res = durable_vs_boto3(trainer, full_s3, upload, f"{job}-full", steps, reps)
        services.remove(full_s3.stop)
        full_s3.stop()
        figures["boto3_part_bytes"] = floor_cfg["part_bytes"]
        figures["boto3_concurrency"] = floor_cfg["concurrency"]
        for key, values in (("time_to_durable_full", res.strata), ("boto3_multipart_same_bytes", res.boto3)):
            figures[f"{key}_s"] = median(values)
            figures[f"{key}_ci_low_s"], figures[f"{key}_ci_high_s"] = median_ci(values)
        ratio = figures["time_to_durable_vs_boto3_ratio"] = median(res.strata) / median(res.boto3)
        pairs = [a / b for a, b in zip(res.strata, res.boto3, strict=True)]
        (
            figures["time_to_durable_vs_boto3_ratio_ci_low"],
            figures["time_to_durable_vs_boto3_ratio_ci_high"],
        ) = median_ci(pairs)
        gib = reps * total / GiB
        figures["time_to_durable_full_cpu_s_per_gib"] = res.strata_cpu_s / gib
        figures["boto3_multipart_cpu_s_per_gib"] = res.boto3_cpu_s / gib
        print(
            "     full checkpoint "
            + ", ".join(f"{x:.2f}" for x in res.strata)
            + " s; boto3 "
            + ", ".join(f"{x:.2f}" for x in res.boto3)
            + f" s; ratio of medians {ratio:.3f}",
            flush=True,
        )

    with phases("SeaweedFS: stall and time to durable"):
        s3_sidecar = SidecarProcess(
            f"s3://{bucket}/ckpt", str(opts.tmp / "s3.sock"), s3_endpoint=weed.endpoint
        ).start()
        services.append(s3_sidecar.stop)
        client = make_client(s3_sidecar.socket, job)
        services.append(lambda: client.close(wait=False))
        state = trainer.state()
        # As a training script starts: resume() (nothing to restore here) lets the client pre-fault
        # its staging off the training thread, and a few steps run before the first save.
        client.resume(state)
        for _ in range(3):
            trainer.step()
        t0 = time.perf_counter()
        client.save(next(steps), state).durable.result(600)  # warm-up; its stall is the first-save stall
        figures["time_to_durable_first_s"] = time.perf_counter() - t0  # full, with first-save costs
        figures["first_save_stall_s"] = client.stats["first_save_stall_s"]
        stalls, durable = [], []
        pids = {"client": os.getpid(), "sidecar": s3_sidecar.pid, "seaweed": weed.pid}
        cpu: dict[str, float] = dict.fromkeys(pids, 0.0)
        for _ in range(reps - 1):
            trainer.step()
            before = {name: proc_cpu_s(pid) for name, pid in pids.items()}
            t0 = time.perf_counter()
            handle = client.save(next(steps), state)
            handle.durable.result(600)
            durable.append(time.perf_counter() - t0)
            stalls.append(handle.stall_s)
            for name, pid in pids.items():
                cpu[name] += proc_cpu_s(pid) - before[name]
        figures["save_stall_s"] = median(stalls)
        ttd = figures["time_to_durable_s"] = median(durable)
        # Where the CPU of a save goes (the trainer process idles in result() meanwhile, so its
        # share is the client's staging and streaming); SeaweedFS shares this machine's cores.
        for name in pids:
            figures[f"s3_{name}_cpu_s_per_gib"] = cpu[name] / (len(durable) * total / GiB)

    with phases("SeaweedFS: training slowdown"), torch_threads(opts.loop_threads):
        k = max(1, round(3 * ttd / step_s))
        # At least ~20 s loaded (5 s quick): a short interval with 2 saves would be a handful of
        # steps, whose time the machine's noise decides rather than the saves.
        n_saves = max(2, math.ceil((5 if opts.quick else 20) / (k * step_s)))
        figures["train_slowdown_saves"] = n_saves
        handles: list[Any] = []

        def save() -> None:
            handles.append(client.save(next(steps), state))

        # Baseline halves before and after the loaded run, so drift of the machine cancels.
        base = [run_loop(trainer, max(5, n_saves * k // 4))]
        loaded = _outcomes(handles, run_loop(trainer, n_saves * k, k, save))
        base.append(run_loop(trainer, max(5, n_saves * k // 4)))
        base_step = sum(b.elapsed for b in base) / sum(b.steps for b in base)
        figures["train_slowdown"] = loaded.step_s / base_step
        interval = figures["train_slowdown_interval_s"] = loaded.interval_s
        missed = figures["train_slowdown_skipped"] = loaded.skipped + loaded.failed

    with phases("SeaweedFS: shortest interval"), torch_threads(opts.loop_threads), quiet_client():
        best = _min_interval(trainer, client, state, steps, ttd, step_s, opts)
        # The slowdown run above is one more sustained interval (the longest one).
        if not missed and math.isfinite(interval):
            best = interval if best is None else min(best, interval)
        figures["min_interval_no_skip_s"] = best

    with phases("SeaweedFS: stall with tracking"):
        # Last: tracked tables send every looked-up row, also rows whose update rounded away,
        # so their diffs are larger than the by-value ones the figures above were taken with.
        client.wait()
        client.track(trainer.model.tables, optimizer=trainer.opt)
        tracked = []
        for _ in range(reps):
            trainer.step()
            handle = client.save(next(steps), state)
            handle.durable.result(600)
            tracked.append(handle.stall_s)
        # Check-N-Run's changed-row tracking: the stall now also cuts the bitmaps.
        figures["save_stall_s_with_tracking"] = median(tracked[1:])  # the first arms the tracker
        client.close()


def _min_interval(
    trainer: Trainer,
    client: Any,
    state: dict[str, Any],
    steps: Iterator[int],
    ttd: float,
    step_s: float,
    opts: Options,
) -> float | None:
    """Save intervals from 1.25x time-to-durable down; the smallest with no skipped or refused save.
    If even the first one skips (saves run slower under training than idle), longer ones first.

    Two saves per interval suffice: the sidecar holds one snapshot in flight, so a save that
    comes too soon is refused at once rather than queued behind the previous one.
    """
    factors = [1.0, 0.5] if opts.quick else [1.25, 1.0, 0.75]
    n_saves = 2
    best: float | None = None
    tried: set[int] = set()
    for factor in factors:
        k = max(1, round(factor * ttd / step_s))
        if k in tried:
            continue
        tried.add(k)
        handles: list[Any] = []

        def save(handles: list[Any] = handles) -> None:
            handles.append(client.save(next(steps), state))

        trial = _outcomes(handles, run_loop(trainer, n_saves * k, k, save))
        print(
            f"     interval {trial.interval_s:7.3f} s (k={k}): {trial.saves} saved, "
            f"{trial.skipped} skipped, {trial.failed} refused/failed",
            flush=True,
        )
        if trial.skipped or trial.failed:
            if best is None and factor < 32:
                factors.append(factor * 2)  # too short from the start: training slows the saves
                continue
            break
        # Training slows while saves upload, so the achieved interval is not monotonic in k.
        best = trial.interval_s if best is None else min(best, trial.interval_s)
        if k == 1:
            break
    return best


def _rows(f: dict[str, Any]) -> list[Row]:
    def get(key: str) -> float | None:
        v = f.get(key)
        return float(v) if isinstance(v, int | float) and math.isfinite(v) else None

    def row(
        name: str,
        unit: str,
        ref: str = "",
        target: str = "",
        ok: Callable[..., bool] | None = None,
        *needs: str,
    ) -> Row:
        """``ref``: the figure the ratio column divides by; ``ok`` gets the values of ``needs``."""
        value, base = get(name), get(ref) if ref else None
        r = value / base if value is not None and base else None
        vals = [get(n) for n in needs]
        passed = ok(*vals) if ok is not None and None not in vals else None
        label = {"socket_gib_per_s": "socket"}.get(ref, ref.removesuffix("_s"))
        return Row(name, value, unit, r, label, target, passed)

    m = "memcpy_s"
    return [
        Row("state", (get("state_bytes") or 0) / GiB, "GiB"),
        row(m, "s", m),
        row("save_stall_s", "s", m, "<= 1.5x memcpy", lambda s, c: s <= 1.5 * c, "save_stall_s", m),
        row(
            "first_save_stall_s",
            "s",
            m,
            "<= 1.5x memcpy",
            lambda s, c: s <= 1.5 * c,
            "first_save_stall_s",
            m,
        ),
        row("save_stall_s_with_tracking", "s", m),
        row("torch_save_s", "s", m),
        row("dcp_async_save_stall_s", "s", m),
        row("step_s", "s", m, ">= 3x memcpy", lambda s, c: s >= 3 * c, "step_s", m),
        row("loop_saves", "saves"),
        row("overhead_null_s", "s", m),
        row(
            "save_overhead_s",
            "s",
            m,
            "<= 0.25x memcpy, < dcp_stager",
            lambda o, c, d: o <= 0.25 * c and o < d,
            "save_overhead_s",
            m,
            "dcp_async_stager_overhead_s",
        ),
        row(
            "save_overhead_ci_high_s",
            "s",
            m,
            "<= 0.5x memcpy",
            lambda o, c: o <= 0.5 * c,
            "save_overhead_ci_high_s",
            m,
        ),
        row("save_overhead_sync_s", "s", "dcp_overhead_s"),
        row("overlapped_overhead_s", "s", m),
        row("save_overhead_grpc_s", "s", "dcp_overhead_s"),
        row("save_overhead_full_s", "s", "dcp_overhead_s"),
        row("dcp_overhead_s", "s", m),
        row("dcp_async_stager_overhead_s", "s", m),
        row("grpc_ingest_gib_per_s", "GiB/s", "socket_gib_per_s"),
        row("socket_gib_per_s", "GiB/s"),
        row("time_to_durable_s", "s", m),
        row("time_to_durable_first_s", "s", m),
        row("time_to_durable_full_s", "s", "boto3_multipart_same_bytes_s"),
        Row(
            "boto3_multipart_same_bytes_s",
            get("boto3_multipart_same_bytes_s"),
            "s",
            target=f"{(get('boto3_part_bytes') or 0) / (1 << 20):g} MiB parts, "
            f"{get('boto3_concurrency') or 0:g} in flight",
        ),
        row(
            "time_to_durable_vs_boto3_ratio",
            "x",
            "",
            "<= 1.2",
            lambda r: r <= 1.2,
            "time_to_durable_vs_boto3_ratio",
        ),
        row("time_to_durable_vs_boto3_ratio_ci_high", "x"),
        row("time_to_durable_full_cpu_s_per_gib", "cpu-s", "boto3_multipart_cpu_s_per_gib"),
        row("s3_sidecar_cpu_s_per_gib", "cpu-s"),
        row("s3_seaweed_cpu_s_per_gib", "cpu-s"),
        row(
            "train_slowdown",
            "x",
            "",
            "<= 1.08, no save skipped",
            lambda s, k: s <= 1.08 and k == 0,
            "train_slowdown",
            "train_slowdown_skipped",
        ),
        row("train_slowdown_skipped", "saves"),
        row("min_interval_no_skip_s", "s", "time_to_durable_s"),
    ]
