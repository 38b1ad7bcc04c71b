"""Bench section ``peers``: Strata beside the checkpointers a user could pick instead, on one state.

One child process per system (``python -m tests.bench.peers --system NAME``), one after the other in the
same run, each building the foundation's state (``foundation.BenchModel`` at ``--size-gib``, its
``Trainer`` calibrated the same way) and measuring, for its system:

- ``stall``: how long the save call holds the training thread (median of ``repeats``, idle between);
- ``in_memory`` / ``durable``: from the call until the snapshot is a copy in memory, and until it is
  on storage (the same saves);
- ``overhead``: the foundation's per-save estimator (``foundation.attributed_overhead``) over
  ``saves`` saves inside the calibrated training loop: the extra time of the steps each save overlaps;
- ``peak_extra_mib``: the peak of the child's process tree's PSS (the trainer and what the system
  starts beside it: Strata's sidecar, DLRover's saver process) over its value before the system was
  created, sampled by this (parent) process every 0.2 s from ``/proc/PID/smaps_rollup`` (reading it
  walks the page tables: more often would take a tenth of a core from the child it measures);
- ``restore``: the system's own restore path back into the live model (Strata and DLRover from the
  memory they hold, the others from their files in the page cache);
- ``exact``: one more save; right after the call returns, an optimizer step whose gradient touches
  every element, then training steps until the save is durable; then a restore compared bit for bit
  with a clone taken just before the call. DLRover is checked twice: its memory restore and its
  persisted file.

The systems and their configurations:

- ``strata``: a local sidecar in its own process writing to local disk (``file://``), as the peers
  write and the foundation's training loops run; client defaults (shared-memory staging, overlap
  auto, the intermittent policy: after the first checkpoint only the changed rows are written).
- ``strata_s3``: the same, the sidecar uploading to SeaweedFS (S3), as the foundation's durability
  figures run (``save_overhead_vs_best_peer_s3``).
- ``dlrover``: DLRover 0.6.1's flash checkpoint, ``DdpCheckpointer(dir).save_checkpoint(step, sd,
  storage_type=StorageType.DISK)`` in its standalone mode (no ``dlrover-run`` agent or master: the
  engine forks its own saver process, which persists the shared-memory copy with ``torch.save`` to
  ``{dir}/{step}/rank_0.pt`` and writes the tracker file that marks it durable); the bench removes
  older steps once a newer one is durable. Every save writes the whole state.
- ``torchsnapshot``: torchsnapshot 0.1.0's ``Snapshot.async_take(path, {"model", "optim"})``, its
  defaults, to a local directory. Tensors under its slab threshold (128 MiB) are batched into slabs,
  which copies them; larger ones are written from the live tensor after the call returns, so at the
  full size (256 MiB tables) the snapshot tears: reported as ``exact`` 0, not worked around.
- ``torch_save``: ``torch.save`` of the state dicts to a local file, synchronous.
- ``dcp``: ``dcp.async_save`` with ``FileSystemWriter`` and its defaults (staging on the calling thread).

Peers missing from the environment (``make bench-peers-deps`` installs them) are reported with a skip
line and write no key. Keys: ``peer_<system>_overhead_s``, ``peer_<system>_exact`` and the rest per
system, ``save_overhead_vs_best_peer`` = Strata's overhead over the smallest overhead among the
peers whose restore was exact (target <= 0.5; no ratio when that overhead is not above zero).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tests.bench.common import GiB, Phases, Row, median
from tests.bench.common import Options as BaseOptions

SYSTEMS = ("strata", "strata_s3", "dlrover", "torchsnapshot", "torch_save", "dcp")
#: Strata's own configurations; the rest are the peers it is held against
STRATA = ("strata", "strata_s3")
#: the package each peer needs beyond the project's own (``requirements-bench-peers.txt``)
PACKAGES = {"dlrover": "dlrover", "torchsnapshot": "torchsnapshot"}
#: per-system figures a child reports (``peer_<system>_<name>``)
FIGURES = ("stall_s", "in_memory_s", "durable_s", "overhead_s", "restore_s", "exact", "step_s")
MiB = 1 << 20


class Options(BaseOptions):
    @property
    def repeats(self) -> int:
        return 2 if self.quick else 5

    @property
    def saves(self) -> int:
        return 2 if self.quick else 8


# --- the parent: one child per system, its memory sampled from here ---------------------------------


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc's children lists."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    todo.extend(int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split())
    return out


def _pss_bytes(pids: list[int]) -> int:
    """Proportional set size of ``pids`` together: shared pages (the shared-memory copies a trainer
    and its helper both map) count once in the sum."""
    total = 0
    for p in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
    return total


class TreeSampler:
    """Samples a process tree's PSS every ``interval`` s in a thread: (wall time, bytes) pairs, and
    every PID seen (so helpers left behind by a crashed child can be ended by their own PIDs)."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-pss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            pids = _tree(self.pid)
            self.seen.update(pids)
            self.samples.append((time.time(), _pss_bytes(pids)))

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def peak_extra(self, start: float, end: float) -> float:
        """Peak over ``[start, end]`` less the last sample before ``start`` (the baseline)."""
        before = [b for t, b in self.samples if t < start]
        window = [b for t, b in self.samples if start <= t <= end]
        return float(max(window) - before[-1]) if before and window else math.nan


def missing(system: str) -> str | None:
    """Why ``system`` cannot run here, or None."""
    package = PACKAGES.get(system)
    if package and importlib.util.find_spec(package) is None:
        return f"{package} is not installed (make bench-peers-deps)"
    return None


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    from sidecar.local.seaweed import SeaweedServer

    figures["peers_size_gib"] = opts.size_gib
    with phases("SeaweedFS"):
        weed = SeaweedServer(opts.tmp / "weed").start()
    try:
        bucket = f"peers-{uuid.uuid4().hex[:8]}"
        weed.create_bucket(bucket)
        for system in SYSTEMS:
            why = missing(system)
            if why:
                print(f"     peers: {system} skipped: {why}", flush=True)
                continue
            with phases(system):
                found = _child(opts, system, weed.endpoint, bucket)
            if found is None:
                continue
            for name, value in found.items():
                figures[f"peer_{system}_{name}"] = value
    finally:
        weed.stop()
    exact = {
        s: figures[f"peer_{s}_overhead_s"]
        for s in SYSTEMS
        if s not in STRATA and figures.get(f"peer_{s}_exact") == 1 and f"peer_{s}_overhead_s" in figures
    }
    if exact:
        best = min(exact, key=exact.__getitem__)
        figures["peers_best_exact_overhead_s"] = exact[best]
        print(f"     peers: the best exact peer is {best}", flush=True)
        # The estimator can come out at or below zero on a noisy machine: no ratio then.
        for strata, key in (
            ("strata", "save_overhead_vs_best_peer"),
            ("strata_s3", "save_overhead_vs_best_peer_s3"),
        ):
            if exact[best] > 0 and f"peer_{strata}_overhead_s" in figures:
                figures[key] = figures[f"peer_{strata}_overhead_s"] / exact[best]
    _print_side_by_side(figures)
    if "peer_strata_overhead_s" not in figures:
        raise RuntimeError("the Strata child measured nothing: see its output above")
    return _rows(figures)


def _child(opts: Options, system: str, endpoint: str, bucket: str) -> dict[str, float] | None:
    """Run one system's child; its figures, or None (a skip line printed) if it failed."""
    out = opts.tmp / f"{system}.json"
    run_id = f"strata-peers-{uuid.uuid4().hex[:8]}"
    cmd = [
        sys.executable,
        "-m",
        "tests.bench.peers",
        f"--system={system}",
        f"--size-gib={opts.size_gib}",
        f"--tmp={opts.tmp / system}",
        f"--out={out}",
        f"--loop-threads={opts.loop_threads}",
        f"--s3-endpoint={endpoint}",
        f"--bucket={bucket}",
        *(["--quick"] if opts.quick else []),
    ]
    # DLRover names its sockets and shared memory after the run id; INFO logs every save.
    env = {**os.environ, "TORCHELASTIC_RUN_ID": run_id, "DLROVER_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(cmd, env=env, cwd=Path(__file__).resolve().parents[2])
    sampler = TreeSampler(proc.pid)
    try:
        with sampler:
            rc = proc.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    finally:
        _end_leftovers(sampler.seen - {proc.pid}, run_id)
        shutil.rmtree(opts.tmp / system, ignore_errors=True)
    if rc != 0 or not out.exists():
        print(f"     peers: {system} skipped: its child exited with {rc} (output above)", flush=True)
        return None
    found: dict[str, float] = json.loads(out.read_text())
    found["peak_extra_mib"] = sampler.peak_extra(found.pop("t_base"), found.pop("t_end")) / MiB
    return found


def _end_leftovers(pids: set[int], run_id: str) -> None:
    """A child that crashed can leave its helpers (DLRover's saver, a sidecar) and DLRover's shared
    memory and sockets behind: end those by PID and name, never anything else."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for shm in Path("/dev/shm").glob(f"{run_id}*_ckpt_shm_*"):  # a retry's names extend the run id
        shm.unlink(missing_ok=True)
    for sockets in Path("/tmp/ckpt_sock").glob(f"{run_id}*"):
        shutil.rmtree(sockets, ignore_errors=True)


# --- the child: one system on the foundation state ---------------------------------------------------


class System:
    """One checkpointer. ``save`` returns (in-memory future, durable future) once the call returns."""

    def save(self, step: int) -> tuple[Future[Any], Future[Any]]:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def restored_states(self) -> Iterator[dict[str, Any]]:
        """Extra restored copies to compare besides the live model (DLRover's persisted file)."""
        return iter(())

    def close(self) -> None:
        pass


def _done(value: Any = None) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def _watch(check: Callable[[], bool], poll: float = 0.005) -> Future[None]:
    """A future that resolves once ``check()`` holds (a thread polls it)."""
    fut: Future[None] = Future()

    def loop() -> None:
        try:
            while not check():
                time.sleep(poll)
            fut.set_result(None)
        except Exception as exc:
            fut.set_exception(exc)

    threading.Thread(target=loop, name="bench-watch", daemon=True).start()
    return fut


class Strata(System):
    def __init__(self, trainer: Any, tmp: Path, storage: str, endpoint: str = "") -> None:
        from tests.bench.common import SidecarProcess
        from tests.bench.foundation import make_client

        self.trainer = trainer
        self.sidecar = SidecarProcess(storage, str(tmp / "s.sock"), s3_endpoint=endpoint).start()
        self.client = make_client(self.sidecar.socket, f"peers-{uuid.uuid4().hex[:8]}")
        self.state = trainer.state()
        self.client.resume(self.state)  # as a training script starts: the client learns the state

    def save(self, step: int) -> tuple[Future[Any], Future[Any]]:
        handle = self.client.save(step, self.state)
        return handle.staged, handle.durable

    def restore(self) -> None:
        self.client.restore(self.state)

    def close(self) -> None:
        self.client.close()
        self.sidecar.stop()


class DLRover(System):
    def __init__(self, trainer: Any, tmp: Path) -> None:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

        self.trainer = trainer
        self.dir = tmp / "dlrover"
        self.tracker = self.dir / "dlrover_latest.txt"
        self.retries = 0
        while True:
            try:
                # Defaults. (A deletion strategy never reaches the standalone saver process: its
                # engine then waits for a saver that failed to start.)
                self.ckpt = DdpCheckpointer(str(self.dir))
                break
            except TimeoutError:
                # Its forked saver process did not answer within DLRover's 60 s; seen once on a
                # loaded machine. Counted (``start_retries``), then tried again under new names.
                if self.retries:
                    raise
                self.retries += 1
                os.environ["TORCHELASTIC_RUN_ID"] += "-retry"
        self.last = -1

    def save(self, step: int) -> tuple[Future[Any], Future[Any]]:
        from dlrover.trainer.torch.flash_checkpoint.ddp import StorageType

        self.ckpt.save_checkpoint(step, self.trainer.plain_state(), storage_type=StorageType.DISK)
        if self.ckpt._engine.latest_step != step:  # the saver was still persisting: DLRover skips
            raise RuntimeError(f"DLRover skipped the save of step {step}")
        self.last = step

        def durable() -> bool:
            with contextlib.suppress(OSError, ValueError):
                if int(self.tracker.read_text().strip()) == step:
                    for old in self.dir.glob("[0-9]*"):  # the disk holds the latest step only
                        if old.name != str(step):
                            shutil.rmtree(old, ignore_errors=True)
                    return True
            return False

        return _done(), _watch(durable)  # the shared-memory copy is done when the call returns

    def restore(self) -> None:
        state = self.ckpt.load_checkpoint()  # from the shared memory while the saver holds it
        self.trainer.model.load_state_dict(state["model"])
        self.trainer.opt.load_state_dict(state["optim"])

    def restored_states(self) -> Iterator[dict[str, Any]]:
        import torch

        yield torch.load(self.dir / str(self.last) / "rank_0.pt", map_location="cpu")

    def close(self) -> None:
        self.ckpt._engine.close()


class TorchSnapshot(System):
    def __init__(self, trainer: Any, tmp: Path) -> None:
        self.trainer = trainer
        self.tmp = tmp
        self.app = {"model": trainer.model, "optim": trainer.opt}
        self.path = ""

    def save(self, step: int) -> tuple[Future[Any], Future[Any]]:
        from torchsnapshot import Snapshot

        self.path = str(self.tmp / f"snap-{step % 2}")  # two directories, reused in turn
        pending = Snapshot.async_take(self.path, self.app)
        durable: Future[Any] = Future()

        def wait() -> None:
            try:
                durable.set_result(pending.wait())
            except Exception as exc:
                durable.set_exception(exc)

        threading.Thread(target=wait, name="bench-snapshot", daemon=True).start()
        return _done(), durable  # what it copies, it copied before returning

    def restore(self) -> None:
        from torchsnapshot import Snapshot

        Snapshot(self.path).restore(self.app)


class TorchSave(System):
    def __init__(self, trainer: Any, tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.trainer = trainer
        self.path = tmp / "state.pt"

    def save(self, step: int) -> tuple[Future[Any], Future[Any]]:
        import torch

        torch.save(self.trainer.plain_state(), self.path)
        return _done(), _done()

    def restore(self) -> None:
        import torch

        state = torch.load(self.path, map_location="cpu")
        self.trainer.model.load_state_dict(state["model"])
        self.trainer.opt.load_state_dict(state["optim"])


class DCP(System):
    def __init__(self, trainer: Any, tmp: Path) -> None:
        self.trainer = trainer
        self.dir = tmp / "dcp"

    def save(self, step: int) -> tuple[Future[Any], Future[Any]]:
        from tests.bench.foundation import dcp_save, upload_future

        return _done(), upload_future(dcp_save(self.trainer, self.dir))  # staged before it returns

    def restore(self) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.trainer.state(), storage_reader=dcp.FileSystemReader(str(self.dir)), no_dist=True)


def _tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    import torch

    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            yield from _tensors(v, f"{prefix}/{i}")


def _mismatches(reference: dict[str, Any], state: Any) -> int:
    """Tensors of ``reference`` (name -> tensor, as ``_tensors`` names them) missing from ``state``
    or different in any bit."""
    got = dict(_tensors(state))
    return sum(not _same_bits(got.get(name), ref) for name, ref in reference.items())


def _same_bits(t: Any, ref: Any) -> bool:
    """Equal in every bit (NaNs and signed zeros included), by the integers of the dtype's width."""
    import torch

    if t is None or t.shape != ref.shape or t.dtype != ref.dtype:
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return bool((t.contiguous().view(-1).view(bits) == ref.contiguous().view(-1).view(bits)).all())


def _step_every_row(trainer: Any, grads: list[Any]) -> None:
    """An optimizer step whose gradient touches every element of every parameter, right after the
    save call returns: what the next training steps do to a snapshot taken lazily, made certain
    (a training step touches a few thousand random rows, which a lazy writer may have passed)."""
    for p, g in zip(trainer.model.parameters(), grads, strict=True):
        p.grad = g
    trainer.opt.step()  # through the optimizer, as training mutates its state (and Strata's hook sees)
    trainer.opt.zero_grad(set_to_none=True)


def child(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from tests.bench import foundation as f

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    opts = Options(args.size_gib, args.quick, args.tmp, loop_threads=args.loop_threads)
    args.tmp.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rows = max(1024, int(opts.size_gib * GiB / (f.TABLES * f.DIM * 4)))
    trainer = f.Trainer(f.BenchModel(rows))
    steps = itertools.count(1)
    torch.set_num_threads(opts.loop_threads)
    memcpy = f.measure_memcpy(trainer.model, 3)  # how loaded the machine is while this child runs
    out: dict[str, float] = {"memcpy_s": memcpy, "step_s": f.calibrate(trainer, max(4 * memcpy, 0.05), 3)}
    gc.collect()
    time.sleep(0.5)  # the baseline: memory samples before the system exists
    out["t_base"] = time.time()
    system: System
    if args.system == "strata":  # local disk, as the peers write and the foundation's loops run
        system = Strata(trainer, args.tmp, f"file://{args.tmp}/store")
    elif args.system == "strata_s3":
        system = Strata(trainer, args.tmp, f"s3://{args.bucket}/{uuid.uuid4().hex[:8]}", args.s3_endpoint)
    elif args.system == "dlrover":
        system = DLRover(trainer, args.tmp)
    elif args.system == "torchsnapshot":
        system = TorchSnapshot(trainer, args.tmp)
    elif args.system == "torch_save":
        system = TorchSave(trainer, args.tmp)
    else:
        system = DCP(trainer, args.tmp)
    try:
        _, warm = system.save(next(steps))  # first-save costs (allocations, a full checkpoint)
        f.steps_until(trainer, warm)
        warm.result(600)
        stalls, in_memory, durable = [], [], []
        for _ in range(opts.repeats):
            trainer.step()
            t0 = time.perf_counter()
            staged, done = system.save(next(steps))
            stalls.append(time.perf_counter() - t0)
            staged.result(600)
            in_memory.append(time.perf_counter() - t0)
            done.result(600)
            durable.append(time.perf_counter() - t0)
        out["stall_s"], out["in_memory_s"], out["durable_s"] = (
            median(stalls),
            median(in_memory),
            median(durable),
        )
        res = f.attributed_overhead(trainer, opts.saves, lambda: system.save(next(steps))[1])
        if res.failed:
            raise RuntimeError(f"{res.failed} of {opts.saves} saves failed in the loop")
        out["overhead_s"] = res.overhead_s
        out["overhead_ci_low_s"], out["overhead_ci_high_s"] = res.ci
        print(
            f"     {args.system}: overhead " + ", ".join(f"{o:+.3f}" for o in res.overheads) + " s per save",
            flush=True,
        )
        out["t_end"] = time.time()
        # Exactness: the state at the call, then training goes on while the save completes.
        trainer.step()
        reference = {k: v.clone() for k, v in _tensors(trainer.plain_state())}
        grads = [torch.ones_like(p) for p in trainer.model.parameters()]  # ready before the call
        _, done = system.save(next(steps))
        _step_every_row(trainer, grads)
        f.steps_until(trainer, done)
        done.result(600)
        t0 = time.perf_counter()
        system.restore()
        out["restore_s"] = time.perf_counter() - t0
        bad = _mismatches(reference, trainer.plain_state())
        for extra in system.restored_states():
            bad += _mismatches(reference, extra)
        out["mismatched_tensors"] = bad
        out["exact"] = 0 if bad else 1
        if isinstance(system, DLRover):
            out["start_retries"] = system.retries
    finally:
        system.close()
    return out


def _print_side_by_side(f: dict[str, Any]) -> None:
    def cell(system: str, name: str, scale: float = 1.0) -> str:
        v = f.get(f"peer_{system}_{name}")
        return f"{v * scale:.3f}" if isinstance(v, int | float) and math.isfinite(v) else "-"

    cols = (
        "stall_s",
        "in_memory_s",
        "durable_s",
        "overhead_s",
        "restore_s",
        "peak_extra_mib",
        "exact",
        "memcpy_s",
    )
    header = ("system", *cols)
    lines = [header] + [
        (s, *(cell(s, c) if c != "exact" else str(f.get(f"peer_{s}_exact", "-")) for c in cols))
        for s in SYSTEMS
    ]
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    print()
    for line in lines:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


def _rows(f: dict[str, Any]) -> list[Row]:
    def get(key: str) -> float | None:
        v = f.get(key)
        return float(v) if isinstance(v, int | float) and math.isfinite(v) else None

    rows = [Row("peers_size_gib", get("peers_size_gib"), "GiB")]
    strata = get("peer_strata_overhead_s")
    for s in SYSTEMS:
        overhead = get(f"peer_{s}_overhead_s")
        exact = get(f"peer_{s}_exact")
        ratio = strata / overhead if strata is not None and overhead else None
        rows.append(Row(f"peer_{s}_overhead_s", overhead, "s", ratio, "strata/this" if ratio else ""))
        rows.append(
            Row(f"peer_{s}_exact", exact, "1/0", target="1", passed=None if exact is None else exact == 1)
        )
    rows.append(Row("peers_best_exact_overhead_s", get("peers_best_exact_overhead_s"), "s"))
    ratio = get("save_overhead_vs_best_peer")
    rows.append(
        Row(
            "save_overhead_vs_best_peer",
            ratio,
            "x",
            target="<= 0.5",
            passed=None if ratio is None else ratio <= 0.5,
        )
    )
    rows.append(Row("save_overhead_vs_best_peer_s3", get("save_overhead_vs_best_peer_s3"), "x"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.peers", description="one system's child")
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--size-gib", type=float, required=True)
    p.add_argument("--tmp", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--loop-threads", type=int, default=1)
    p.add_argument("--s3-endpoint", default="")
    p.add_argument("--bucket", default="")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    found = child(args)
    args.out.write_text(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
