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
  with a clone taken just before the call. Strata and DLRover are checked twice: their memory
  restore and their restore from storage or disk (``restore_storage_s`` below).

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
peers whose restore was exact (target <= 0.5; no ratio when that overhead is not above zero), and
``peak_host_memory_ratio`` = Strata's (defaults, ``file://``) peak extra host memory over the bytes
it checkpoints (target <= 1.3).

Two more figures per system, in both sections:

- ``restore_storage_s``: the restore from storage or disk, checked bit for bit like ``exact`` (a
  mismatch there makes ``exact`` 0 too): for Strata, its sidecar stopped once the check's save is
  durable and a fresh sidecar started on the same storage, so a new client's ``restore()`` reads
  storage (the client's ``last_restore["source"]`` must say so); for DLRover, ``torch.load`` of
  its persisted file into the live model (its memory restore stays ``restore_s``); the others
  restore from their files again. Before it, one more optimizer step that touches every element,
  so a restore that did nothing would not pass, then every file under the child's directory and
  SeaweedFS's volumes are written back and dropped from the page cache (``fdatasync``,
  ``POSIX_FADV_DONTNEED``; ``evicted_mib``): every system reads the disk, as a restore on a new or
  rebooted node does (Strata writes its objects past the page cache anyway, while a peer's file
  just written is still in it: that restore, ``restore_s``, is kept as ``restore_disk_warm_s`` for
  the systems whose ``restore_s`` reads their files, and ``restore_storage_vs_best_peer_warm``
  holds Strata's cold restore against the best of those). In the dense section each system
  restores so ``DENSE_RESTORE_REPEATS`` times, each from a fresh sidecar after its own step and
  eviction: the median is the figure (``restore_storage_s_min``/``_max`` beside it). Its CPU per GiB
  restored (no training meanwhile), read as ``cpu_s_per_gib`` below: ``restore_storage_cpu_s_per_gib``
  and the parts (``restore_storage_sidecar_cpu_s_per_gib``, ...).
- ``cpu_s_per_gib``: the CPU the saves of the overhead loop cost, per GiB checkpointed. The child
  reads the CPU (utime + stime from ``/proc/PID/stat``) of its process tree (itself, with its
  waited-for children, and the helpers alive when the loop starts: the sidecar, DLRover's saver)
  after every training step of the loop; the steps of the saves' spans cost that CPU less as
  many steps' worth of the mean quiet step's CPU (``foundation.saves_cpu_s``; the mean quiet
  step is ``step_cpu_s``), divided by ``saves`` x the checkpointed bytes (``state_bytes``: every
  tensor a save carries, whatever a system writes of it). The same per part:
  ``trainer_cpu_s_per_gib`` (the trainer process alone), ``sidecar_cpu_s_per_gib`` (Strata's
  sidecar process) and, for the systems on SeaweedFS, ``seaweed_cpu_s_per_gib`` (the SeaweedFS
  server, outside the tree, its PID passed to the child, read the same way).

Section ``peers_dense`` (``python -m tests.bench.run --sections peers_dense``) runs the same
children on the dense state (``foundation.DenseTrainer``: the same bytes as parameters and AdamW's
two moments, every one of them changing every step), keys ``peer_dense_<system>_<figure>``, with
Strata as ``strata_full`` (sidecar setting ``policy=full``: every checkpoint the whole state, as
the peers write it; ``file://``), ``strata_full_s3`` (the same to SeaweedFS) and ``strata``
(defaults: a diff of a dense state is the whole state). Its keys: ``save_overhead_full_vs_best_peer``
= ``strata_full``'s overhead over the smallest among the exact peers' on the dense state (target
<= 0.5; ``_s3``: ``strata_full_s3``'s), ``restore_storage_vs_best_peer`` = ``strata_full``'s
``restore_storage_s`` over the smallest exact peer's (target <= 1; ``_s3`` beside),
``sidecar_cpu_s_per_gib_full`` (``strata_full``'s sidecar, the peers' ``cpu_s_per_gib`` beside it
in the table), and for ``strata_full_s3`` ``restore_storage_gibps`` (object bytes of the restored
step over ``restore_storage_s``) against ``boto3_download_gibps`` (the same objects, listed under
the step's prefix, fetched with ``get_object().read()`` ``upload_concurrency`` at a time) and
``boto3_transfer_download_gibps`` (each with TransferManager's ``download_fileobj``: ranged parts in
parallel); SeaweedFS shares the cores, so its CPU per GiB on Strata's full checkpoints and restore
(``seaweed_cpu_s_per_gib_full_s3``, ``restore_storage_seaweed_cpu_s_per_gib_full_s3``) stands beside
its CPU per GiB on those plain GETs and on a plain ``upload_fileobj`` of the same bytes
(``boto3_download_seaweed_cpu_s_per_gib``, ``boto3_upload_seaweed_cpu_s_per_gib``).

Picking systems: ``BENCH_PEERS=strata_full,dlrover`` (comma-separated names) runs only those
in either section (the key ratios then use whichever peers ran); unset, all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
import statistics
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

from tests.bench.common import GiB, Phases, Row, median, process_tree
from tests.bench.common import Options as BaseOptions

SYSTEMS = ("strata", "strata_s3", "dlrover", "torchsnapshot", "torch_save", "dcp")
#: the ``peers_dense`` section's systems (the dense state)
#: cold restores from storage or disk per system in the dense section (the median is the figure)
DENSE_RESTORE_REPEATS = 3
DENSE_SYSTEMS = ("strata_full", "strata_full_s3", "strata", "dlrover", "torchsnapshot", "torch_save", "dcp")
#: Strata's own configurations; the rest are the peers it is held against
STRATA = ("strata", "strata_s3", "strata_full", "strata_full_s3")
#: runs only the systems it names (comma-separated), in either section
SELECT_ENV = "BENCH_PEERS"
#: the package each peer needs beyond the project's own (``requirements-bench-peers.txt``)
PACKAGES = {"dlrover": "dlrover", "torchsnapshot": "torchsnapshot"}
#: per-system figures a child reports (``peer_<system>_<name>``)
FIGURES = ("stall_s", "in_memory_s", "durable_s", "overhead_s", "restore_s", "exact", "step_s")
#: the prefix of a section's per-system keys
PREFIX = {"sparse": "peer_", "dense": "peer_dense_"}
MiB = 1 << 20


class Options(BaseOptions):
    """Counts sized so both sections stay within ~15 min at 1 GiB on 2 cores (``make bench`` runs
    every section in an hour): the per-save figures differ between systems by several times, far
    beyond what more repeats would narrow."""

    @property
    def repeats(self) -> int:
        return 2 if self.quick else 3

    @property
    def saves(self) -> int:
        return 2 if self.quick else 6


# --- the parent: one child per system, its memory sampled from here ---------------------------------


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
            pids = process_tree(self.pid)
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


def selected(systems: tuple[str, ...]) -> tuple[str, ...]:
    """``systems`` less those ``$BENCH_PEERS`` (when set) leaves out."""
    picked = os.environ.get(SELECT_ENV, "").strip()
    if not picked:
        return systems
    names = {n.strip() for n in picked.split(",") if n.strip()}
    return tuple(s for s in systems if s in names)


def _measure(opts: Options, figures: dict[str, Any], phases: Phases, state: str) -> None:
    """Every selected system of ``state``'s section in a child of its own, one after the other."""
    from sidecar.local.seaweed import SeaweedServer

    prefix = PREFIX[state]
    with phases("SeaweedFS"):
        weed = SeaweedServer(opts.tmp / "weed").start()
    try:
        bucket = f"peers-{uuid.uuid4().hex[:8]}"
        weed.create_bucket(bucket)
        for system in selected(DENSE_SYSTEMS if state == "dense" else SYSTEMS):
            why = missing(system)
            if why:
                print(f"     peers: {system} skipped: {why}", flush=True)
                continue
            with phases(system):
                found = _child(opts, system, state, weed.endpoint, bucket, weed.pid)
            if found is None:
                continue
            for name, value in found.items():
                if math.isfinite(value):
                    figures[f"{prefix}{system}_{name}"] = value
    finally:
        weed.stop()


def _best_exact(f: dict[str, Any], prefix: str, systems: tuple[str, ...], name: str) -> str | None:
    """The peer (not Strata) with the smallest ``name`` among those whose restores were exact."""
    exact = [
        s
        for s in systems
        if s not in STRATA and f.get(f"{prefix}{s}_exact") == 1 and f"{prefix}{s}_{name}" in f
    ]
    return min(exact, key=lambda s: f[f"{prefix}{s}_{name}"]) if exact else None


def _ratio(f: dict[str, Any], key: str, num: str, den: str) -> None:
    """``f[key] = f[num] / f[den]`` where both are there and the denominator is above zero (the
    overhead estimator can come out at or below zero on a noisy machine: no ratio then)."""
    if num in f and den in f and f[den] > 0:
        f[key] = f[num] / f[den]


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    figures["peers_size_gib"] = opts.size_gib
    _measure(opts, figures, phases, "sparse")
    best = _best_exact(figures, "peer_", SYSTEMS, "overhead_s")
    if best:
        figures["peers_best_exact_overhead_s"] = figures[f"peer_{best}_overhead_s"]
        print(f"     peers: the best exact peer is {best}", flush=True)
        for strata, key in (
            ("strata", "save_overhead_vs_best_peer"),
            ("strata_s3", "save_overhead_vs_best_peer_s3"),
        ):
            _ratio(figures, key, f"peer_{strata}_overhead_s", "peers_best_exact_overhead_s")
    if "peer_strata_peak_extra_mib" in figures and "peer_strata_state_bytes" in figures:
        figures["peak_host_memory_ratio"] = (
            figures["peer_strata_peak_extra_mib"] * MiB / figures["peer_strata_state_bytes"]
        )
    _print_side_by_side(figures, "peer_", selected(SYSTEMS), SPARSE_COLUMNS)
    if "strata" in selected(SYSTEMS) and "peer_strata_overhead_s" not in figures:
        raise RuntimeError("the Strata child measured nothing: see its output above")
    return _rows(figures)


def run_dense(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    """Section ``peers_dense``: the same children on the dense state (see the module's docstring)."""
    p = "peer_dense_"
    figures["peers_dense_size_gib"] = opts.size_gib
    _measure(opts, figures, phases, "dense")
    best = _best_exact(figures, p, DENSE_SYSTEMS, "overhead_s")
    if best:
        figures["peers_dense_best_exact_overhead_s"] = figures[f"{p}{best}_overhead_s"]
        print(f"     peers_dense: the best exact peer (overhead) is {best}", flush=True)
        for strata, key in (
            ("strata_full", "save_overhead_full_vs_best_peer"),
            ("strata_full_s3", "save_overhead_full_vs_best_peer_s3"),
            ("strata", "save_overhead_dense_defaults_vs_best_peer"),
        ):
            _ratio(figures, key, f"{p}{strata}_overhead_s", "peers_dense_best_exact_overhead_s")
    best = _best_exact(figures, p, DENSE_SYSTEMS, "restore_storage_s")
    if best:
        figures["peers_dense_best_exact_restore_s"] = figures[f"{p}{best}_restore_storage_s"]
        print(f"     peers_dense: the best exact peer (restore from disk) is {best}", flush=True)
        for strata, key in (
            ("strata_full", "restore_storage_vs_best_peer"),
            ("strata_full_s3", "restore_storage_vs_best_peer_s3"),
        ):
            _ratio(figures, key, f"{p}{strata}_restore_storage_s", "peers_dense_best_exact_restore_s")
    best = _best_exact(figures, p, DENSE_SYSTEMS, "restore_disk_warm_s")
    if best:  # the peers' files as the save left them, in the page cache: the flattering case for them
        figures["peers_dense_best_exact_restore_warm_s"] = figures[f"{p}{best}_restore_disk_warm_s"]
        _ratio(
            figures,
            "restore_storage_vs_best_peer_warm",
            f"{p}strata_full_restore_storage_s",
            "peers_dense_best_exact_restore_warm_s",
        )
    for key, source in (
        ("sidecar_cpu_s_per_gib_full", f"{p}strata_full_sidecar_cpu_s_per_gib"),
        ("sidecar_cpu_s_per_gib_full_s3", f"{p}strata_full_s3_sidecar_cpu_s_per_gib"),
        ("seaweed_cpu_s_per_gib_full_s3", f"{p}strata_full_s3_seaweed_cpu_s_per_gib"),
        ("restore_storage_gibps", f"{p}strata_full_s3_restore_storage_gibps"),
        ("boto3_download_gibps", f"{p}strata_full_s3_boto3_download_gibps"),
        ("boto3_transfer_download_gibps", f"{p}strata_full_s3_boto3_transfer_download_gibps"),
        ("boto3_upload_seaweed_cpu_s_per_gib", f"{p}strata_full_s3_boto3_upload_seaweed_cpu_s_per_gib"),
        ("boto3_download_seaweed_cpu_s_per_gib", f"{p}strata_full_s3_boto3_download_seaweed_cpu_s_per_gib"),
        (
            "restore_storage_seaweed_cpu_s_per_gib_full_s3",
            f"{p}strata_full_s3_restore_storage_seaweed_cpu_s_per_gib",
        ),
    ):
        if source in figures:
            figures[key] = figures[source]
    _ratio(figures, "restore_storage_vs_boto3_ratio", "boto3_download_gibps", "restore_storage_gibps")
    _print_side_by_side(figures, p, selected(DENSE_SYSTEMS), DENSE_COLUMNS)
    measured = any(f"{p}{s}_overhead_s" in figures for s in STRATA)
    if not measured and any(s in STRATA for s in selected(DENSE_SYSTEMS)):
        raise RuntimeError("no Strata child measured anything: see its output above")
    return rows_dense(figures)


def _child(
    opts: Options, system: str, state: str, endpoint: str, bucket: str, weed_pid: int
) -> dict[str, float] | None:
    """Run one system's child; its figures, or None (a skip line printed) if it failed."""
    out = opts.tmp / f"{state}-{system}.json"
    run_id = f"strata-peers-{uuid.uuid4().hex[:8]}"
    cmd = [
        sys.executable,
        "-m",
        "tests.bench.peers",
        f"--system={system}",
        f"--state={state}",
        f"--size-gib={opts.size_gib}",
        f"--tmp={opts.tmp / system}",
        f"--out={out}",
        f"--loop-threads={opts.loop_threads}",
        f"--s3-endpoint={endpoint}",
        f"--bucket={bucket}",
        f"--seaweed-pid={weed_pid}",
        f"--evict={opts.tmp / 'weed'}",
        *(["--quick"] if opts.quick else []),
        f"--restore-repeats={1 if opts.quick or state != 'dense' else DENSE_RESTORE_REPEATS}",
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

    #: ``restore`` reads memory: ``restore_storage`` is another path, measured and checked apart
    memory_restore = False

    def save(self, step: int) -> tuple[Future[Any], Future[Any]]:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def before_storage_restore(self) -> None:
        """What must happen before ``restore_storage`` and is not part of it (untimed)."""

    def restore_storage(self) -> None:
        """Restore the newest durable save from storage (or disk) into the live state."""
        self.restore()

    def helpers(self) -> dict[str, int]:
        """Processes of its own whose CPU is reported apart: name -> PID."""
        return {}

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
    memory_restore = True

    def __init__(self, trainer: Any, tmp: Path, storage: str, endpoint: str = "", policy: str = "") -> None:
        from tests.bench.foundation import make_client

        self.trainer = trainer
        self.storage, self.endpoint, self.socket = storage, endpoint, str(tmp / "s.sock")
        self.settings = {"policy": policy} if policy else {}
        self.sidecar = self._sidecar()
        self.job = f"peers-{uuid.uuid4().hex[:8]}"
        self.client = make_client(self.sidecar.socket, self.job)
        self.state = trainer.state()
        self.client.resume(self.state)  # as a training script starts: the client learns the state
        self.restored_step = -1

    def _sidecar(self) -> Any:
        from tests.bench.common import SidecarProcess

        return SidecarProcess(self.storage, self.socket, s3_endpoint=self.endpoint, **self.settings).start()

    def save(self, step: int) -> tuple[Future[Any], Future[Any]]:
        handle = self.client.save(step, self.state)
        return handle.staged, handle.durable

    def restore(self) -> None:
        self.client.restore(self.state)

    def before_storage_restore(self) -> None:
        """As a pod whose sidecar restarted: nothing in memory. Stopping the sidecar waits for its
        uploads; a fresh one on the same storage and a new client, the job's next attempt (the
        first attempt decided its restore step, none, when it began), are up before the
        restore's clock starts (the client does not resume: no prefetch either)."""
        from tests.bench.foundation import make_client

        run = self.client.settings.generation.rsplit("/", 1)[0]
        attempt = self.client.settings.restart + 1
        self.client.close()
        self.sidecar.stop()
        self.sidecar = self._sidecar()
        self.client = make_client(
            self.sidecar.socket, self.job, restart=attempt, generation=f"{run}/{attempt}"
        )

    def restore_storage(self) -> None:
        self.restored_step = self.client.restore(self.state)
        source = self.client.last_restore["source"]
        if source != "storage":
            raise RuntimeError(f"the restore with a fresh sidecar came from {source!r}, not storage")

    def helpers(self) -> dict[str, int]:
        return {"sidecar": self.sidecar.pid}

    def close(self) -> None:
        self.client.close()
        self.sidecar.stop()


class DLRover(System):
    memory_restore = True

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

    def restore_storage(self) -> None:
        """Its disk restore: the persisted file, as after a node's loss (no shared memory left)."""
        import torch

        state = torch.load(self.dir / str(self.last) / "rank_0.pt", map_location="cpu")
        self.trainer.model.load_state_dict(state["model"])
        self.trainer.opt.load_state_dict(state["optim"])

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


def _evict(root: Path) -> int:
    """Write back and drop from the page cache every regular file under ``root``; the bytes."""
    total = 0
    for path in root.rglob("*") if root.is_dir() else []:
        with contextlib.suppress(OSError):
            if not path.is_file() or path.is_symlink():
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


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


def _make_system(args: argparse.Namespace, trainer: Any) -> System:
    s3 = f"s3://{args.bucket}/{uuid.uuid4().hex[:8]}"
    if args.system == "strata":  # local disk, as the peers write and the foundation's loops run
        return Strata(trainer, args.tmp, f"file://{args.tmp}/store")
    if args.system == "strata_s3":
        return Strata(trainer, args.tmp, s3, args.s3_endpoint)
    if args.system == "strata_full":
        return Strata(trainer, args.tmp, f"file://{args.tmp}/store", policy="full")
    if args.system == "strata_full_s3":
        return Strata(trainer, args.tmp, s3, args.s3_endpoint, policy="full")
    if args.system == "dlrover":
        return DLRover(trainer, args.tmp)
    if args.system == "torchsnapshot":
        return TorchSnapshot(trainer, args.tmp)
    if args.system == "torch_save":
        return TorchSave(trainer, args.tmp)
    return DCP(trainer, args.tmp)


class Metered:
    """A trainer whose every step is followed by a reading of named CPU counters (cumulative
    CPU seconds), so each step's CPU, the save work between steps included, is known."""

    def __init__(self, trainer: Any, probes: dict[str, Callable[[], float]]) -> None:
        self.trainer = trainer
        self.probes = probes
        self.readings = [self._read()]

    def _read(self) -> dict[str, float]:
        return {name: probe() for name, probe in self.probes.items()}

    def step(self) -> None:
        self.trainer.step()
        self.readings.append(self._read())

    def per_step(self, name: str) -> list[float]:
        r = self.readings
        return [b[name] - a[name] for a, b in itertools.pairwise(r)]


def _probes(system: System, weed_pid: int) -> dict[str, Callable[[], float]]:
    """CPU counters of the child's process tree (as it stands when the loop starts), the trainer
    process, each of the system's own helpers and, for a system on SeaweedFS, the S3 server."""
    from tests.bench.foundation import proc_cpu_s

    me = os.getpid()
    others = [p for p in process_tree(me) if p != me]

    def tree() -> float:
        # This process's own CPU to the nanosecond (/proc counts 10 ms ticks); its children that
        # exited and were waited for move from their counters to its cutime: the sum stays whole.
        waited = os.times()
        children = waited.children_user + waited.children_system
        return time.process_time() + children + sum(proc_cpu_s(p) for p in others if _alive(p))

    probes: dict[str, Callable[[], float]] = {"cpu": tree, "trainer_cpu": time.process_time}
    for name, pid in system.helpers().items():
        probes[f"{name}_cpu"] = functools.partial(proc_cpu_s, pid)
    if weed_pid and isinstance(system, Strata) and system.storage.startswith("s3://"):
        probes["seaweed_cpu"] = functools.partial(proc_cpu_s, weed_pid)
    return probes


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _boto3_floor(endpoint: str, url: str, step: int, weed_pid: int) -> dict[str, float]:
    """The floor of a restore from S3: the restored step's objects (everything under its
    ``steps/<step>/`` prefix) fetched with plain boto3, ``get_object().read()`` with the sidecar's
    storage concurrency, then each with TransferManager's ``download_fileobj`` (ranged parts).
    Then the same bytes uploaded as one object with ``upload_fileobj`` (the store's part size):
    the SeaweedFS CPU per GiB of each, beside what it spends on Strata's uploads and restores."""
    import io
    from concurrent.futures import ThreadPoolExecutor

    from sidecar.config import SidecarSettings
    from tests.bench.foundation import proc_cpu_s, s3_client

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    concurrency = SidecarSettings().upload_concurrency
    client, transfer = s3_client(endpoint, concurrency)
    objects: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        for obj in page.get("Contents", []):
            if f"/steps/{step:012d}/" in obj["Key"]:
                objects[obj["Key"]] = int(obj["Size"])
    if not objects:
        raise RuntimeError(f"no objects of step {step} under {url}")
    nbytes = sum(objects.values())
    gib = nbytes / GiB
    out: dict[str, float] = {"restore_objects": len(objects), "restore_object_bytes": nbytes}
    bodies: list[bytes] = []

    def get(key: str) -> bytes:
        return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())

    weed0, t0 = proc_cpu_s(weed_pid), time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        bodies.extend(pool.map(get, objects))
    out["boto3_download_s"] = elapsed = time.perf_counter() - t0
    out["boto3_download_seaweed_cpu_s_per_gib"] = (proc_cpu_s(weed_pid) - weed0) / gib
    out["boto3_download_gibps"] = gib / elapsed
    if sum(map(len, bodies)) != nbytes:
        raise RuntimeError(f"boto3 read {sum(map(len, bodies))} bytes of {nbytes}")
    t0 = time.perf_counter()
    for key in objects:
        client.download_fileobj(bucket, key, io.BytesIO(), Config=transfer)
    out["boto3_transfer_download_s"] = elapsed = time.perf_counter() - t0
    out["boto3_transfer_download_gibps"] = gib / elapsed
    body = b"".join(bodies)
    del bodies
    key = f"{prefix}/boto3-floor"
    weed0, t0 = proc_cpu_s(weed_pid), time.perf_counter()
    client.upload_fileobj(io.BytesIO(body), bucket, key, Config=transfer)
    out["boto3_upload_s"] = time.perf_counter() - t0
    out["boto3_upload_seaweed_cpu_s_per_gib"] = (proc_cpu_s(weed_pid) - weed0) / gib
    client.delete_object(Bucket=bucket, Key=key)
    return out


def child(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from tests.bench import foundation as f

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    opts = Options(args.size_gib, args.quick, args.tmp, loop_threads=args.loop_threads)
    args.tmp.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    trainer = f.make_trainer(args.state, opts.size_gib)
    steps = itertools.count(1)
    torch.set_num_threads(opts.loop_threads)
    memcpy = f.measure_memcpy(trainer.model, 3)  # how loaded the machine is while this child runs
    out: dict[str, float] = {"memcpy_s": memcpy, "step_s": f.calibrate(trainer, max(4 * memcpy, 0.05), 3)}
    out["step_reps"] = trainer.reps
    nbytes = out["state_bytes"] = sum(t.numel() * t.element_size() for t in f.state_tensors(trainer))
    gc.collect()
    time.sleep(0.5)  # the baseline: memory samples before the system exists
    out["t_base"] = time.time()
    system = _make_system(args, trainer)
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
        metered = Metered(trainer, _probes(system, args.seaweed_pid))
        res = f.attributed_overhead(metered, opts.saves, lambda: system.save(next(steps))[1])
        if res.failed:
            raise RuntimeError(f"{res.failed} of {opts.saves} saves failed in the loop")
        out["overhead_s"] = res.overhead_s
        out["overhead_ci_low_s"], out["overhead_ci_high_s"] = res.ci
        gib = opts.saves * nbytes / GiB
        for name in metered.probes:
            added, per_step = f.saves_cpu_s(metered.per_step(name), res.spans)
            out[f"{name}_s_per_gib"] = added / gib
            if name == "cpu":
                out["step_cpu_s"] = per_step
        print(
            f"     {args.system}: overhead "
            + ", ".join(f"{o:+.3f}" for o in res.overheads)
            + " s per save; "
            + ", ".join(f"{k} {v:.3f}" for k, v in out.items() if k.endswith("cpu_s_per_gib"))
            + " cpu-s/GiB",
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
        if not system.memory_restore:  # its files, still in the page cache from the save
            out["restore_disk_warm_s"] = out["restore_s"]
        # From storage or disk, read cold, for every system:
        # Every element moved again first, so a no-op would fail; then the files of every
        # system (and SeaweedFS's volumes) leave the page cache, so each restore reads the disk
        # (Strata writes its objects past the page cache; a peer's file just written is still
        # in it, which ``restore_warm_s`` keeps).
        # Repeated (a cold read of one disk is noisy): the median, and the samples' range.
        samples: list[float] = []
        cpu: dict[str, float] = {}
        wrong = 0
        for _ in range(args.restore_repeats):
            _step_every_row(trainer, grads)
            system.before_storage_restore()
            out["evicted_mib"] = sum(_evict(d) for d in (args.tmp, *args.evict)) / MiB
            probes = _probes(system, args.seaweed_pid)  # the fresh sidecar's, for Strata
            cpu0 = {name: probe() for name, probe in probes.items()}
            t0 = time.perf_counter()
            system.restore_storage()
            samples.append(time.perf_counter() - t0)
            for name, probe in probes.items():  # no training meanwhile: all of it is the restore's
                cpu[name] = cpu.get(name, 0.0) + probe() - cpu0[name]
            wrong += _mismatches(reference, trainer.plain_state())
        out["restore_storage_s"] = statistics.median(samples)
        out["restore_storage_s_min"], out["restore_storage_s_max"] = min(samples), max(samples)
        out["restore_storage_repeats"] = len(samples)
        for name, seconds in cpu.items():
            out[f"restore_storage_{name}_s_per_gib"] = seconds / len(samples) / (nbytes / GiB)
        out["restore_storage_mismatched_tensors"] = wrong
        bad += wrong
        out["mismatched_tensors"] = bad
        out["exact"] = 0 if bad else 1
        if isinstance(system, DLRover):
            out["start_retries"] = system.retries
        if args.system == "strata_full_s3" and isinstance(system, Strata):
            floor = _boto3_floor(args.s3_endpoint, system.storage, system.restored_step, args.seaweed_pid)
            out.update(floor)
            out["restore_storage_gibps"] = floor["restore_object_bytes"] / out["restore_storage_s"] / GiB
    finally:
        system.close()
    return out


SPARSE_COLUMNS = (
    "stall_s",
    "in_memory_s",
    "durable_s",
    "overhead_s",
    "restore_s",
    "restore_storage_s",
    "restore_disk_warm_s",
    "peak_extra_mib",
    "cpu_s_per_gib",
    "exact",
    "memcpy_s",
)
DENSE_COLUMNS = (
    "overhead_s",
    "durable_s",
    "restore_s",
    "restore_storage_s",
    "restore_storage_s_min",
    "restore_storage_s_max",
    "restore_disk_warm_s",
    "peak_extra_mib",
    "cpu_s_per_gib",
    "trainer_cpu_s_per_gib",
    "sidecar_cpu_s_per_gib",
    "seaweed_cpu_s_per_gib",
    "step_cpu_s",
    "exact",
    "memcpy_s",
)


def _print_side_by_side(
    f: dict[str, Any], prefix: str, systems: tuple[str, ...], cols: tuple[str, ...]
) -> None:
    def cell(system: str, name: str) -> str:
        v = f.get(f"{prefix}{system}_{name}")
        if name == "exact":
            return str(v) if v is not None else "-"
        return f"{v:.3f}" if isinstance(v, int | float) and math.isfinite(v) else "-"

    header = ("system", *(c.removesuffix("_s").removesuffix("_s_per_gib") for c in cols))
    lines = [header] + [(s, *(cell(s, c) for c in cols)) for s in systems]
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    print()
    if any(c.endswith("_s_per_gib") for c in cols):
        print("  (cpu columns: CPU seconds per GiB checkpointed)")
    for line in lines:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


def _get(f: dict[str, Any], key: str) -> float | None:
    v = f.get(key)
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def _target(f: dict[str, Any], key: str, unit: str, limit: float) -> Row:
    value = _get(f, key)
    return Row(key, value, unit, target=f"<= {limit:g}", passed=None if value is None else value <= limit)


def _rows(f: dict[str, Any]) -> list[Row]:
    def get(key: str) -> float | None:
        return _get(f, key)

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
    rows.append(_target(f, "save_overhead_vs_best_peer", "x", 0.5))
    rows.append(Row("save_overhead_vs_best_peer_s3", get("save_overhead_vs_best_peer_s3"), "x"))
    rows.append(_target(f, "peak_host_memory_ratio", "x state", 1.3))
    return rows


def rows_dense(f: dict[str, Any]) -> list[Row]:
    """The ``peers_dense`` section's table."""

    def get(key: str) -> float | None:
        return _get(f, key)

    p = "peer_dense_"
    rows = [Row("peers_dense_size_gib", get("peers_dense_size_gib"), "GiB")]
    full = get(f"{p}strata_full_overhead_s")
    for s in DENSE_SYSTEMS:
        overhead = get(f"{p}{s}_overhead_s")
        exact = get(f"{p}{s}_exact")
        ratio = full / overhead if full is not None and overhead else None
        rows.append(Row(f"{p}{s}_overhead_s", overhead, "s", ratio, "strata_full/this" if ratio else ""))
        rows.append(Row(f"{p}{s}_restore_storage_s", get(f"{p}{s}_restore_storage_s"), "s"))
        rows.append(Row(f"{p}{s}_cpu_s_per_gib", get(f"{p}{s}_cpu_s_per_gib"), "cpu-s/GiB"))
        rows.append(
            Row(f"{p}{s}_exact", exact, "1/0", target="1", passed=None if exact is None else exact == 1)
        )
    rows.append(Row("peers_dense_best_exact_overhead_s", get("peers_dense_best_exact_overhead_s"), "s"))
    rows.append(_target(f, "save_overhead_full_vs_best_peer", "x", 0.5))
    rows.append(_target(f, "save_overhead_full_vs_best_peer_s3", "x", 0.5))
    key = "save_overhead_dense_defaults_vs_best_peer"
    rows.append(Row(key, get(key), "x"))
    rows.append(Row("peers_dense_best_exact_restore_s", get("peers_dense_best_exact_restore_s"), "s"))
    rows.append(_target(f, "restore_storage_vs_best_peer", "x", 1.0))
    rows.append(_target(f, "restore_storage_vs_best_peer_s3", "x", 1.0))
    key = "restore_storage_vs_best_peer_warm"  # the peers' files still in the page cache
    rows.append(Row(key, get(key), "x"))
    best_cpu = min(
        (v for s in DENSE_SYSTEMS if s not in STRATA if (v := get(f"{p}{s}_cpu_s_per_gib")) is not None),
        default=None,
    )
    sidecar = get("sidecar_cpu_s_per_gib_full")
    rows.append(
        Row(
            "sidecar_cpu_s_per_gib_full",
            sidecar,
            "cpu-s/GiB",
            sidecar / best_cpu if sidecar is not None and best_cpu else None,
            "the peers' least cpu_s_per_gib" if sidecar is not None and best_cpu else "",
            target="reported",
        )
    )
    for key, ref in (
        ("sidecar_cpu_s_per_gib_full_s3", ""),
        ("seaweed_cpu_s_per_gib_full_s3", "boto3_upload_seaweed_cpu_s_per_gib"),
        ("boto3_upload_seaweed_cpu_s_per_gib", ""),
        ("restore_storage_seaweed_cpu_s_per_gib_full_s3", "boto3_download_seaweed_cpu_s_per_gib"),
        ("boto3_download_seaweed_cpu_s_per_gib", ""),
    ):
        value, base = get(key), get(ref) if ref else None
        ratio = value / base if value is not None and base else None
        rows.append(Row(key, value, "cpu-s/GiB", ratio, ref.removesuffix("_cpu_s_per_gib") if ratio else ""))
    restore, boto3 = get("restore_storage_gibps"), get("boto3_download_gibps")
    rows.append(
        Row(
            "restore_storage_gibps",
            restore,
            "GiB/s",
            restore / boto3 if restore is not None and boto3 else None,
            "boto3_download" if restore is not None and boto3 else "",
        )
    )
    rows.append(Row("boto3_download_gibps", boto3, "GiB/s"))
    rows.append(Row("boto3_transfer_download_gibps", get("boto3_transfer_download_gibps"), "GiB/s"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.peers", description="one system's child")
    p.add_argument("--system", choices=tuple(dict.fromkeys(SYSTEMS + DENSE_SYSTEMS)), required=True)
    p.add_argument("--state", choices=tuple(PREFIX), default="sparse")
    p.add_argument("--seaweed-pid", type=int, default=0)
    p.add_argument(
        "--evict", type=Path, action="append", default=[], help="more files to drop from the page cache"
    )
    p.add_argument("--size-gib", type=float, required=True)
    p.add_argument("--tmp", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--loop-threads", type=int, default=1)
    p.add_argument("--s3-endpoint", default="")
    p.add_argument("--bucket", default="")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--restore-repeats", type=int, default=1, help="cold restores from storage (the median)")
    args = p.parse_args(argv)
    found = child(args)
    args.out.write_text(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
