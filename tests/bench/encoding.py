"""Bench section ``encoding``: Check-N-Run's per-row quantization on every core, with fbgemm's
kernels as the anchor, side by side in one run.

- One 1M x 64 fp32 table (``--quick``: 64k rows) of standard normal rows, 4 bits. fbgemm:
  ``torch.ops.quantized.embedding_bag_4bit_prepack`` with ``optimized_qparams`` (its greedy range
  search, the paper's) and without (min/max); Strata: the fast search as the sidecar runs it
  (``quantize_greedy_4bit_s``: its pool of ``THREADS`` worker processes mapping the table from a
  memfd, :mod:`sidecar.pipeline.workers`), the same in one process with 1 and ``THREADS``
  threads, the torch-equivalent search, and min/max. Thread counts are pinned on both sides:
  torch at ``THREADS`` intra-op threads, Strata at ``THREADS`` processes. Errors are relative L2
  of the restored table; Strata's comes with the quantization (``QuantizedRows.rel_error``,
  from the block being encoded, no second pass).
- ``quantize_greedy_4bit_s`` vs ``fbgemm_greedy_4bit_s``: target <= 0.25x, with
  ``quantize_rel_l2_vs_fbgemm`` (our error over fbgemm's) <= 1.01.
- Threads or processes: ``quantize_thread_scaling`` (1 -> ``THREADS`` threads) beside
  ``quantize_process_scaling`` (1 thread -> ``THREADS`` worker processes).
- 8 bits, what ``--quantize auto`` stores by default (min/max, no search): ``quantize_8bit_s``,
  Strata's encode of a 1M x 64 fp32 table (in ``--quick`` too) in one thread, beside
  ``fbgemm_8bit_rowwise_s``, fbgemm's ``FloatToFused8BitRowwiseQuantized`` on the same table in
  one torch thread (skipped, with a row saying so, without ``fbgemm_gpu``): medians with 95%
  confidence intervals, both max abs errors (fbgemm keeps fp32 scale and bias, Strata fp16), and
  ``quantize_8bit_vs_fbgemm_ratio`` <= 3.
- ``durable_quantized_*``: a full quantized checkpoint of 4 such tables (1 GiB) through a real
  sidecar process (``--quantize 4``, file storage on local disk), from ``save()`` to durable, with
  ``--encode-workers`` 1 and 2, and ``durable_quantized_8bit_2w_s`` with ``--quantize 8`` and 2
  workers. Meanwhile a second connection asks the sidecar for Handshakes in
  a loop: their latency during the encode vs idle says whether the gRPC server stays responsive.
  The sidecar's peak RSS (``VmHWM``) says whether its memory stays bounded while it encodes.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from sidecar import shm
from sidecar.pipeline import quantize as qz
from sidecar.pipeline.workers import EncodePool
from tests.bench.common import Options, Phases, Row, SidecarProcess, median, median_ci

THREADS = 2
DIM = 64
BITS = 4


def _table(rows: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((rows, DIM), dtype=np.float32)


def _best(fn: Any, repeats: int) -> tuple[float, Any]:
    """Median wall time of ``repeats`` calls, and the last result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return median(times), out


def _fbgemm(rows: np.ndarray, threads: int, optimized: bool, repeats: int) -> tuple[float, float]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = torch.from_numpy(rows)
        seconds, packed = _best(lambda: torch.ops.quantized.embedding_bag_4bit_prepack(w, optimized), repeats)
        restored = torch.ops.quantized.embedding_bag_4bit_unpack(packed).numpy()
    finally:
        torch.set_num_threads(before)
    return seconds, qz.relative_l2_error(rows, restored)


def _ours(rows: np.ndarray, workers: int, repeats: int, **kw: Any) -> tuple[float, float, float]:
    """(seconds, error reported with the quantization, error of the restored table)."""
    seconds, q = _best(lambda: qz.quantize_rows(rows, BITS, workers=workers, **kw), repeats)
    return seconds, float(q.rel_error), qz.relative_l2_error(rows, qz.dequantize_rows(q))


def _pooled(rows: np.ndarray, workers: int, repeats: int) -> tuple[float, float, float]:
    """:func:`_ours` through the sidecar's worker processes: the table in a memfd mapping (where a
    streamed save lands; a trainer's segment is mapped the same way), the workers started first."""
    m = shm.anonymous(rows.nbytes)
    np.frombuffer(m, np.float32).reshape(rows.shape)[:] = rows
    source = shm.source_of(memoryview(m))
    assert source is not None
    pool = EncodePool(workers)
    try:
        pool.warm()

        def once() -> qz.QuantizedRows:
            q = pool.quantize(source, "float32", rows.shape, BITS, greedy=True)
            assert q is not None, "the worker processes could not map the table"
            return q

        seconds, q = _best(once, repeats)
    finally:
        pool.close()
    return seconds, float(q.rel_error), qz.relative_l2_error(rows, qz.dequantize_rows(q))


EIGHT_BIT_ROWS = 1 << 20


def _timed(fn: Any, repeats: int) -> tuple[list[float], Any]:
    """Wall times of ``repeats`` calls after one untimed, and the last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def _fbgemm_8bit(rows: np.ndarray, repeats: int) -> tuple[list[float], np.ndarray] | None:
    """fbgemm's CPU rowwise 8-bit kernel in one torch thread: times and the restored table, or
    None without fbgemm_gpu."""
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # fbgemm-gpu-cpu warns on import of GPU-only lookups it lacks
            warnings.simplefilter("ignore", DeprecationWarning)
            import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
        quantize = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized
        restore = torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat
    except (ImportError, AttributeError, RuntimeError):
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = torch.from_numpy(rows)
        times, fused = _timed(lambda: quantize(w), repeats)
        return times, restore(fused).numpy()
    finally:
        torch.set_num_threads(before)


def eight_bit(opts: Options, figures: dict[str, Any], phases: Phases) -> None:
    """Strata's 8-bit min/max encode against fbgemm's rowwise kernel, one thread each, same table."""
    rows = np.random.default_rng(1).standard_normal((EIGHT_BIT_ROWS, DIM), dtype=np.float32)
    repeats = 5 if opts.quick else 11
    f = figures
    f["quantize_8bit_table_shape"] = list(rows.shape)
    with phases("8 bits: strata min/max, one thread"):
        times, q = _timed(lambda: qz.quantize_rows(rows, 8, greedy=False), repeats)
        f["quantize_8bit_s"] = median(times)
        f["quantize_8bit_ci_low_s"], f["quantize_8bit_ci_high_s"] = median_ci(times)
        restored = qz.dequantize_rows(q)
        f["quantize_8bit_max_abs_err"] = float(np.abs(restored - rows).max())
        f["quantize_8bit_rel_l2"] = qz.relative_l2_error(rows, restored)
    with phases("8 bits: fbgemm FloatToFused8BitRowwiseQuantized, one thread"):
        got = _fbgemm_8bit(rows, repeats)
        if got is None:
            f["fbgemm_8bit_rowwise_skipped"] = 1
            return
        times, restored = got
        f["fbgemm_8bit_rowwise_s"] = median(times)
        f["fbgemm_8bit_rowwise_ci_low_s"], f["fbgemm_8bit_rowwise_ci_high_s"] = median_ci(times)
        f["fbgemm_8bit_rowwise_max_abs_err"] = float(np.abs(restored - rows).max())
        f["fbgemm_8bit_rowwise_rel_l2"] = qz.relative_l2_error(rows, restored)
    f["quantize_8bit_vs_fbgemm_ratio"] = f["quantize_8bit_s"] / f["fbgemm_8bit_rowwise_s"]
    f["quantize_8bit_max_abs_err_vs_fbgemm"] = (
        f["quantize_8bit_max_abs_err"] / f["fbgemm_8bit_rowwise_max_abs_err"]
    )


def kernels(opts: Options, figures: dict[str, Any], phases: Phases) -> None:
    rows = _table(1 << 16 if opts.quick else 1 << 20)
    repeats = 1 if opts.quick else 3
    figures["encoding_table_shape"] = list(rows.shape)
    with phases("fbgemm prepack (anchor)"):
        t, err = _fbgemm(rows, THREADS, True, 1)  # ~19 s a call here: once
        figures["fbgemm_greedy_4bit_s"], figures["fbgemm_greedy_4bit_rel_l2"] = t, err
        t, err = _fbgemm(rows, THREADS, False, repeats)
        figures["fbgemm_minmax_4bit_s"], figures["fbgemm_minmax_4bit_rel_l2"] = t, err
        figures["fbgemm_threads"] = THREADS
    with phases("strata: the sidecar's worker processes"):
        t, reported, err = _pooled(rows, THREADS, repeats)
        figures["quantize_greedy_4bit_s"], figures["quantize_greedy_4bit_rel_l2"] = t, err
        figures["quantize_rel_l2_reported_vs_measured"] = reported / err
    with phases("strata quantize_rows in one process"):
        t, _, _ = _ours(rows, THREADS, repeats)
        figures["quantize_greedy_4bit_threads_s"] = t
        t, _, _ = _ours(rows, 1, repeats)
        figures["quantize_greedy_4bit_1thread_s"] = t
        t, _, err = _ours(rows, THREADS, 1, method="torch")
        figures["quantize_torch_search_4bit_s"], figures["quantize_torch_search_4bit_rel_l2"] = t, err
        t, _, err = _ours(rows, THREADS, repeats, greedy=False)
        figures["quantize_minmax_4bit_s"], figures["quantize_minmax_4bit_rel_l2"] = t, err
        figures["quantize_workers"] = THREADS
    with phases("8 bits: what the search gains"):
        t8, q8 = _best(lambda: qz.quantize_rows(rows, 8, workers=THREADS, greedy=False), 1)
        g8, g8q = _best(lambda: qz.quantize_rows(rows, 8, workers=THREADS, greedy=True), 1)
        figures["quantize_8bit_minmax_s"], figures["quantize_8bit_greedy_s"] = t8, g8
        figures["quantize_8bit_greedy_gain"] = float(q8.rel_error) / float(g8q.rel_error)
    f = figures
    f["quantize_vs_fbgemm_ratio"] = f["quantize_greedy_4bit_s"] / f["fbgemm_greedy_4bit_s"]
    f["quantize_rel_l2_vs_fbgemm"] = f["quantize_greedy_4bit_rel_l2"] / f["fbgemm_greedy_4bit_rel_l2"]
    f["quantize_thread_scaling"] = f["quantize_greedy_4bit_1thread_s"] / f["quantize_greedy_4bit_threads_s"]
    f["quantize_process_scaling"] = f["quantize_greedy_4bit_1thread_s"] / f["quantize_greedy_4bit_s"]


# --- through a sidecar ---------------------------------------------------------------------------


def _vm_hwm_mib(pid: int | None) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


class _Prober:
    """Handshakes to the sidecar in a loop on their own connection; latencies in ms."""

    def __init__(self, socket: str) -> None:
        import grpc

        from sidecar.api import PROTOCOL_VERSION, pb, pb_grpc

        self._stub = pb_grpc.CheckpointerStub(grpc.insecure_channel(f"unix:{socket}"))
        self._req = pb.HandshakeRequest(
            protocol_version=PROTOCOL_VERSION,
            client_version="bench",
            capabilities=["save.stream"],
            identity=pb.Identity(namespace="default", job="probe", rank=0, world_size=1, generation="p/0"),
        )
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def once(self) -> float:
        t0 = time.perf_counter()
        self._stub.Handshake(self._req, timeout=60)
        return (time.perf_counter() - t0) * 1e3

    def start(self) -> None:
        self.latencies = []
        self._stop.clear()

        def loop() -> None:
            while not self._stop.is_set():
                self.latencies.append(self.once())
                self._stop.wait(0.02)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> list[float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.latencies


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def durable(opts: Options, figures: dict[str, Any], phases: Phases) -> None:
    import torch

    from trainer_client import CheckpointClient

    n_rows = 1 << 14 if opts.quick else 1 << 20
    g = torch.Generator().manual_seed(0)
    state = {f"table{i}": torch.randn(n_rows, DIM, generator=g) for i in range(4)}
    figures["durable_state_bytes"] = sum(t.numel() * 4 for t in state.values())
    for bits, workers in ((BITS, 1), (BITS, THREADS), (8, THREADS)):
        key = f"{workers}w" if bits == BITS else f"{bits}bit_{workers}w"
        with phases(f"full quantized checkpoint, --quantize {bits} --encode-workers {workers}"):
            sock = str(opts.tmp / f"enc{key}.sock")
            side = SidecarProcess(
                f"file://{opts.tmp}/store{key}",
                sock,
                quantize=str(bits),
                quantize_match="table*",
                encode_workers=workers,
                shm_dir="/dev/shm",
            ).start()
            try:
                probe = _Prober(sock)
                idle = [probe.once() for _ in range(20)]
                times, during = [], []
                for trial in range(1 if opts.quick else 2):
                    client = CheckpointClient(
                        job=f"enc-{key}-{trial}-{uuid.uuid4().hex[:6]}",
                        socket=sock,
                        capture_rng=False,
                        resume="never",
                    )
                    try:
                        client.save(0, state).durable.result(600)  # warm: buffers, segments
                        # every row changed: a new full checkpoint, every table quantized
                        changed = {k: v * 1.5 for k, v in state.items()}
                        probe.start()
                        t0 = time.perf_counter()
                        client.save(1, changed).durable.result(600)
                        times.append(time.perf_counter() - t0)
                        during += probe.stop()
                    finally:
                        client.close()
                figures[f"durable_quantized_{key}_s"] = median(times)
                figures[f"durable_sidecar_peak_rss_{key}_mib"] = _vm_hwm_mib(side.pid)
                if bits == BITS and workers == THREADS:
                    figures["handshake_idle_ms_p50"] = statistics.median(idle)
                    figures["handshake_during_encode_ms_p50"] = _pct(during, 0.5)
                    figures["handshake_during_encode_ms_p99"] = _pct(during, 0.99)
                    figures["handshake_during_encode_ms_max"] = max(during, default=math.nan)
                    figures["handshake_during_encode_count"] = len(during)
            finally:
                side.stop()
    figures["durable_scaling_2w_vs_1w"] = (
        figures["durable_quantized_1w_s"] / figures[f"durable_quantized_{THREADS}w_s"]
    )


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    eight_bit(opts, figures, phases)
    kernels(opts, figures, phases)
    durable(opts, figures, phases)
    return _rows(figures)


def _rows(f: dict[str, Any]) -> list[Row]:
    def get(key: str) -> float | None:
        v = f.get(key)
        return float(v) if isinstance(v, int | float) and math.isfinite(v) else None

    def target(key: str, unit: str, text: str, ok: Any) -> Row:
        v = get(key)
        return Row(key, v, unit, target=text, passed=None if v is None else bool(ok(v)))

    fbgemm_8bit = (
        "fbgemm_8bit_rowwise_s (skipped: fbgemm_gpu is not installed)"
        if f.get("fbgemm_8bit_rowwise_skipped")
        else "fbgemm_8bit_rowwise_s (FloatToFused8BitRowwiseQuantized, 1 thread)"
    )
    return [
        Row("quantize_8bit_s (1M x 64 fp32, min/max, 1 thread)", get("quantize_8bit_s"), "s"),
        Row(fbgemm_8bit, get("fbgemm_8bit_rowwise_s"), "s"),
        target("quantize_8bit_vs_fbgemm_ratio", "x", "<= 3 (per core)", lambda v: v <= 3),
        Row("quantize_8bit_max_abs_err (fp16 scale/bias)", get("quantize_8bit_max_abs_err"), ""),
        Row("fbgemm_8bit_rowwise_max_abs_err (fp32 scale/bias)", get("fbgemm_8bit_rowwise_max_abs_err"), ""),
        Row("fbgemm_greedy_4bit_s (optimized_qparams, 2 threads)", get("fbgemm_greedy_4bit_s"), "s"),
        Row("quantize_greedy_4bit_s (fast search, 2 worker processes)", get("quantize_greedy_4bit_s"), "s"),
        target("quantize_vs_fbgemm_ratio", "x", "<= 0.25", lambda v: v <= 0.25),
        target("quantize_rel_l2_vs_fbgemm", "x", "<= 1.01", lambda v: v <= 1.01),
        Row("quantize_greedy_4bit_rel_l2", get("quantize_greedy_4bit_rel_l2"), ""),
        Row("fbgemm_greedy_4bit_rel_l2", get("fbgemm_greedy_4bit_rel_l2"), ""),
        Row("quantize_torch_search_4bit_s (torch's search)", get("quantize_torch_search_4bit_s"), "s"),
        Row("quantize_minmax_4bit_s / fbgemm_minmax_4bit_s", get("quantize_minmax_4bit_s"), "s"),
        Row("fbgemm_minmax_4bit_s", get("fbgemm_minmax_4bit_s"), "s"),
        Row("quantize_greedy_4bit_1thread_s", get("quantize_greedy_4bit_1thread_s"), "s"),
        Row(
            "quantize_greedy_4bit_threads_s (2 threads, one process)",
            get("quantize_greedy_4bit_threads_s"),
            "s",
        ),
        Row("quantize_thread_scaling (1 -> 2 threads)", get("quantize_thread_scaling"), "x"),
        Row("quantize_process_scaling (1 -> 2 processes)", get("quantize_process_scaling"), "x"),
        Row("quantize_8bit_greedy_gain (why 8 bits skips the search)", get("quantize_8bit_greedy_gain"), "x"),
        Row("durable_quantized_1w_s (1 GiB, --encode-workers 1)", get("durable_quantized_1w_s"), "s"),
        Row("durable_quantized_2w_s (--encode-workers 2)", get("durable_quantized_2w_s"), "s"),
        Row(
            "durable_quantized_8bit_2w_s (--quantize 8, --encode-workers 2)",
            get("durable_quantized_8bit_2w_s"),
            "s",
        ),
        target("durable_scaling_2w_vs_1w", "x", ">= 1.6 (scales with cores)", lambda v: v >= 1.6),
        Row("durable_sidecar_peak_rss_2w_mib", get("durable_sidecar_peak_rss_2w_mib"), "MiB"),
        Row("handshake_idle_ms_p50", get("handshake_idle_ms_p50"), "ms"),
        Row("handshake_during_encode_ms_p50", get("handshake_during_encode_ms_p50"), "ms"),
        Row("handshake_during_encode_ms_p99", get("handshake_during_encode_ms_p99"), "ms"),
    ]
