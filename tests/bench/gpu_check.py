"""GPU staging check (``make gpu-check``, ``python -m tests.bench.gpu_check [--size-gib 10]``).

What a save of GPU-resident state costs a training loop, through the trainer client's own staging
path (``trainer_client._staging``: the buffer laid out and page-locked once, then ``Stager.copy``
enqueuing every copy on a side stream), side by side in one run:

- ``gpu_save_stall_s``: the save call's stall (layout check plus enqueuing the copies), median;
- ``gpu_memcpy_same_bytes_s``: a plain synchronous ``cudaMemcpy`` of the same tensors into the
  same page-locked memory (``dst.copy_(src)``, then ``torch.cuda.synchronize()``), median;
- ``gpu_save_stall_ratio``: the two's ratio, target <= 1.5;
- ``gpu_overlapped_step_cost_s``: a loop of fixed-time steps (bf16 matmuls, then an in-place
  update of every state tensor, synchronized each step as ``loss.item()`` does) with one save
  overlapped against the same loop without, paired, median of the differences;
- ``gpu_staged_exact``: the staged bytes' checksums equal the state's at the save call, although
  every step after it updates that state in place.

The staging buffer is a shared-memory segment as the client's default (a file in /dev/shm,
``cudaHostRegister``-ed), else private pinned memory where /dev/shm has no room. A whole save()
through a sidecar is not measured here: the GPU image lacks the sidecar's dependencies, and the
stall is the staging. Without CUDA the check prints one skip line and exits 0, writing nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.bench.common import DEFAULT_RESULTS, GiB, MiB, Row, median, print_table, update_results

if TYPE_CHECKING:
    import torch

    from trainer_client._staging import HostBuffers, Stager

SKIP_NO_CUDA = "gpu-check: skipped: no CUDA device (torch.cuda.is_available() is False)"
#: the stall's target, as a multiple of the plain copy of the same bytes
STALL_TARGET = 1.5
#: GPU memory kept free beside the state: the loop's matrices, cuBLAS's workspace, the allocator
GPU_HEADROOM = 2 * GiB
BIG_TENSORS = 32  # fp32 tables: 95% of the bytes
SMALL_TENSORS = 256  # bf16 vectors: the per-tensor cost of a model's many small tensors
MATMUL_N = 4096
#: where the state and the loop live (the unit test runs the plumbing on "cpu", CUDA's calls stubbed)
DEVICE = "cuda"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.bench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument(
        "--size-gib", type=float, default=10.0, help="state on the GPU (default 10; less if it does not fit)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed repeats of each measurement (default 5)")
    p.add_argument("--steps", type=int, default=20, help="training steps per loop run (default 20)")
    p.add_argument(
        "--step-ms", type=float, default=50.0, help="the loop's step time to calibrate (default 50)"
    )
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="JSON results file to update")
    args = p.parse_args(argv)
    if args.size_gib <= 0 or args.repeats < 1 or args.steps < 2 or args.step_ms <= 0:
        p.error("--size-gib and --step-ms must be positive, --repeats >= 1, --steps >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print(f"gpu-check: skipped: no CUDA device (no torch in {sys.executable})", flush=True)
        return 0
    if not torch.cuda.is_available():
        print(SKIP_NO_CUDA, flush=True)
        return 0
    figures: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        rows = measure(args, figures)
    finally:
        if figures:
            figures["gpu_check_s"] = time.perf_counter() - t0
            update_results(args.results, figures, torch.get_num_threads())
    print()
    print_table(rows)
    print(f"\ngpu-check: {figures['gpu_check_s']:.1f} s; figures in {args.results}", flush=True)
    return 0


# --- sizing and the state -----------------------------------------------------------------------


def host_available() -> int:
    """MemAvailable from /proc/meminfo; unbounded where it cannot be read."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return sys.maxsize


def plan_bytes(requested: int, gpu_free: int, host_free: int) -> int:
    """The state's bytes: as asked, or less to fit. On the GPU the state and ``GPU_HEADROOM``; on
    the host one staging buffer of the state, with as much again left to everything else. Whole
    MiB."""
    fit = min(requested, gpu_free - GPU_HEADROOM, host_free // 2)
    return max(0, fit) // MiB * MiB


def state_layout(nbytes: int) -> list[tuple[str, str, int]]:
    """(name, dtype, elements) of a state of about ``nbytes``: BIG_TENSORS fp32 tables holding
    95% of it, SMALL_TENSORS bf16 vectors the rest."""
    small = max(1, nbytes // 20 // SMALL_TENSORS // 2)
    big = max(1, (nbytes - SMALL_TENSORS * small * 2) // BIG_TENSORS // 4)
    return [(f"table{i}", "float32", big) for i in range(BIG_TENSORS)] + [
        (f"vector{i}", "bfloat16", small) for i in range(SMALL_TENSORS)
    ]


def build_state(nbytes: int, device: str) -> list[tuple[str, torch.Tensor]]:
    import torch

    out = []
    for name, dtype, numel in state_layout(nbytes):
        t = torch.empty(numel, dtype=getattr(torch, dtype), device=device)
        if t.device.type != "meta":
            t.uniform_(-1, 1)
        out.append((name, t))
    return out


# --- measurement --------------------------------------------------------------------------------


def measure(args: argparse.Namespace, figures: dict[str, Any]) -> list[Row]:
    import torch

    try:
        from trainer_client._staging import HostBuffers, SegmentFactory, Stager
    except Exception as exc:  # grpcio or protobuf older than the generated code (a GPU image's own)
        raise SystemExit(
            f"gpu-check: cannot import the trainer client under {sys.executable}: {exc!r}. Where its "
            "grpcio or protobuf is older than the project's, run `make gpu-wheels` where a registry is "
            "reachable and bring .whl along: make gpu-check installs them first (README, Performance)"
        ) from exc

    device = torch.cuda.get_device_name()
    figures["gpu_device"] = device
    free, total = torch.cuda.mem_get_info()
    asked = int(args.size_gib * GiB) // MiB * MiB
    nbytes = plan_bytes(asked, free, host_available())
    if nbytes < min(asked, 64 * MiB) or not nbytes:
        raise SystemExit(f"gpu-check: too little memory for a state: {free / GiB:.1f} GiB free on {device}")
    sized = "" if nbytes == asked else f" (asked {asked / GiB:.2f}: sized to fit)"
    print(
        f"gpu-check: {device} ({total / GiB:.0f} GiB, {free / GiB:.1f} free), torch {torch.__version__}; "
        f"state {nbytes / GiB:.2f} GiB{sized}",
        flush=True,
    )
    state = build_state(nbytes, DEVICE)
    figures["gpu_state_gib"] = nbytes / GiB

    shm = Path("/dev/shm")
    segdir = tempfile.mkdtemp(prefix="strata-gpu-check-", dir=shm if shm.is_dir() else None)
    factory = SegmentFactory(segdir)
    bufs = HostBuffers(factory)
    stager = Stager()
    try:
        t_alloc = time.perf_counter()
        where = f"a shared-memory segment in {segdir} (the client's default), cudaHostRegister-ed"
        try:
            bufs.ensure(state)
        except OSError as exc:  # /dev/shm too small
            print(f"gpu-check: no shared segment ({exc}); private pinned memory instead", flush=True)
            where = ""
        if where and bufs.flat is not None and not bufs.flat.is_pinned():
            print("gpu-check: cudaHostRegister refused the shared segment; private pinned memory instead")
            bufs.reset()
            where = ""
        if not where:  # as the client stages without a sidecar's shared memory
            bufs = HostBuffers()
            bufs.ensure(state)
            where = "private pinned memory (torch.empty(pin_memory=True))"
        figures["gpu_staging_shared"] = int(bufs.shared)
        assert bufs.flat is not None
        pinned = bufs.flat.is_pinned()
        figures["gpu_staging_pinned"] = int(pinned)
        locked = "yes" if pinned else "NO (the copies are synchronous)"
        print(
            f"gpu-check: staging into {where}; page-locked: {locked}; "
            f"allocated in {time.perf_counter() - t_alloc:.1f} s",
            flush=True,
        )
        stall_rows = _stall(args, figures, state, bufs, stager)
        loop_rows = _loop(args, figures, state, bufs, stager)
    finally:
        stager.synchronize()
        bufs.reset()
        factory.close()
        shutil.rmtree(segdir, ignore_errors=True)
    return stall_rows + loop_rows


def _stall(
    args: argparse.Namespace,
    figures: dict[str, Any],
    state: list[tuple[str, torch.Tensor]],
    bufs: HostBuffers,
    stager: Stager,
) -> list[Row]:
    """The save call's stall and the time until its bytes are on the host, alternated with the
    plain copy of the same tensors into the same memory."""
    import torch

    indices = list(range(len(state)))

    def memcpy() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for view, (_, t) in zip(bufs.views, state, strict=True):
            view.copy_(t)  # non_blocking=False: cudaMemcpy, the host waits for each
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def save() -> tuple[float, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        bufs.ensure(state)  # laid out already: what every save after the first does
        stager.copy(bufs.views, state, indices)
        stall = time.perf_counter() - t0
        stager.synchronize()  # the client's sender thread waits here, not the training thread
        return stall, time.perf_counter() - t0

    memcpy()
    save()  # warm-up: the side stream is created, the copy engines warm
    copies: list[float] = []
    stalls: list[float] = []
    landed: list[float] = []
    for r in range(args.repeats):
        order: list[Callable[[], None]] = [
            lambda: copies.append(memcpy()),
            lambda: _put(save(), stalls, landed),
        ]
        for fn in order if r % 2 == 0 else order[::-1]:
            fn()
    nbytes = bufs.total_bytes
    figures["gpu_memcpy_same_bytes_s"] = memcpy_s = median(copies)
    figures["gpu_save_stall_s"] = stall_s = median(stalls)
    figures["gpu_save_staged_s"] = staged_s = median(landed)
    figures["gpu_save_stall_ratio"] = ratio = stall_s / memcpy_s
    figures["gpu_memcpy_gib_per_s"] = nbytes / GiB / memcpy_s
    figures["gpu_staged_gib_per_s"] = nbytes / GiB / staged_s
    return [
        Row("gpu_memcpy_same_bytes_s (cudaMemcpy into pinned memory)", memcpy_s, "s", 1.0, "memcpy"),
        Row("gpu_save_stall_s (the save call: copies enqueued)", stall_s, "s", ratio, "memcpy"),
        Row(
            "gpu_save_stall_ratio",
            ratio,
            "x memcpy",
            target=f"<= {STALL_TARGET}",
            passed=ratio <= STALL_TARGET,
        ),
        Row(
            "gpu_save_staged_s (save call to bytes on the host)", staged_s, "s", staged_s / memcpy_s, "memcpy"
        ),
        Row("gpu_memcpy_gib_per_s (device to host)", figures["gpu_memcpy_gib_per_s"], "GiB/s"),
        Row("gpu_staged_gib_per_s (the side stream's copies)", figures["gpu_staged_gib_per_s"], "GiB/s"),
    ]


def _put(pair: tuple[float, float], stalls: list[float], landed: list[float]) -> None:
    stalls.append(pair[0])
    landed.append(pair[1])


def _loop(
    args: argparse.Namespace,
    figures: dict[str, Any],
    state: list[tuple[str, torch.Tensor]],
    bufs: HostBuffers,
    stager: Stager,
) -> list[Row]:
    """A training loop of fixed-time steps, with and without one overlapped save, paired."""
    import torch

    tensors = [t for _, t in state]
    indices = list(range(len(state)))
    a = torch.randn(MATMUL_N, MATMUL_N, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    c = torch.empty_like(a)
    stream = torch.cuda.current_stream()

    def step(k: int) -> None:
        for _ in range(k):
            torch.matmul(a, b, out=c)
        torch._foreach_add_(tensors, 1.0)  # the optimizer's in-place update of the whole state
        stream.synchronize()  # as loss.item() each step does

    # Calibrate the matmuls per step so that a step takes about --step-ms.
    step(3)
    t0 = time.perf_counter()
    step(20)
    with_20 = time.perf_counter() - t0
    t0 = time.perf_counter()
    step(0)
    update_s = time.perf_counter() - t0
    per_matmul = max((with_20 - update_s) / 20, 1e-6)
    k = max(1, round((args.step_ms / 1000 - update_s) / per_matmul))

    save_at = args.steps // 2

    def run(save: bool, check: list[int] | None = None) -> float:
        """Wall time of ``--steps`` steps, a save before step ``save_at`` when ``save``. With
        ``check``, untimed: appends 1 when the staged bytes' checksums are the state's at the save."""
        sums: list[torch.Tensor] = []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(args.steps):
            if save and s == save_at:
                if check is not None:
                    sums = [_words(t).sum(dtype=torch.int64) for t in tensors]
                bufs.ensure(state)
                stager.copy(bufs.views, state, indices)
            step(k)
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        stager.synchronize()
        if check is not None:
            staged = [int(_words(v).sum(dtype=torch.int64)) for v in bufs.views]
            check.append(int(staged == [int(x) for x in sums]))
        return took

    run(False)
    run(True)  # warm-up
    quiet: list[float] = []
    costs: list[float] = []
    for r in range(args.repeats):
        if r % 2 == 0:
            base, loaded = run(False), run(True)
        else:
            loaded, base = run(True), run(False)
        quiet.append(base)
        costs.append(loaded - base)
    check: list[int] = []
    run(True, check)
    figures["gpu_step_s"] = step_s = median(quiet) / args.steps
    figures["gpu_overlapped_step_cost_s"] = cost = median(costs)
    figures["gpu_staged_exact"] = exact = check[0]
    memcpy_s = figures["gpu_memcpy_same_bytes_s"]
    return [
        Row(
            f"gpu_step_s ({k} bf16 {MATMUL_N}^3 matmuls + the state's update)",
            step_s,
            "s",
            step_s / memcpy_s,
            "memcpy",
        ),
        Row(
            f"gpu_overlapped_step_cost_s (one save in {args.steps} steps)",
            cost,
            "s",
            cost / memcpy_s,
            "memcpy",
        ),
        Row(
            "gpu_staged_exact (staged bytes = the state at the save call)",
            exact,
            "1/0",
            target="= 1",
            passed=exact == 1,
        ),
    ]


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers (a sum of them is a checksum of the exact bytes)."""
    import torch

    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


if __name__ == "__main__":
    sys.exit(main())
