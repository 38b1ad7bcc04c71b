"""Shared benchmark plumbing: timing, the results file, the table, and a sidecar in its own process.

Deliberately torch-free: the sidecar child process imports this module (spawn), and the
sidecar must never load torch.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RESULTS = REPO_ROOT / "bench-results.json"


@dataclass
class Options:
    """What ``tests.bench.run`` hands every section."""

    size_gib: float
    quick: bool
    tmp: Path
    #: torch threads of the training loops. One on this 2-core box: with two, any other runnable
    #: thread (a sidecar, a writer, another tenant) stalls every OpenMP barrier and per-save
    #: figures drown in noise; one leaves a core to checkpointing, as a GPU trainer leaves host cores.
    loop_threads: int = 1


# --- timing -------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median: the order statistics
    x(k) and x(n+1-k), with k the largest rank whose binomial tail P(X < k) <= (1-c)/2.
    Too few values for that confidence give (min, max)."""
    xs = sorted(values)
    n = len(xs)
    if not n:
        return math.nan, math.nan
    tail = (1 - confidence) / 2

    def cdf(r: int) -> float:  # P(X <= r), X ~ Binomial(n, 1/2)
        return sum(math.comb(n, i) for i in range(r + 1)) / 2**n

    k = 1
    while k < (n + 1) // 2 and cdf(k) <= tail:
        k += 1
    return xs[k - 1], xs[n - k]


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Wall times of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


class Phases:
    """Wall time per named phase, printed after the table."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        print(f"  .. {name}", flush=True)
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


# --- results file -------------------------------------------------------------------------


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip()


def update_results(path: Path, figures: dict[str, Any], threads: int) -> dict[str, Any]:
    """Merge ``figures`` into the flat JSON object at ``path`` (other sections' keys stay)."""
    data: dict[str, Any] = {}
    if path.exists():
        try:
            loaded = json.loads(path.read_text())
        except ValueError:
            loaded = None
        if isinstance(loaded, dict):
            data = loaded
    data.update(figures)
    data["_meta_git_sha"] = git_sha()
    data["_meta_threads"] = threads
    data["_meta_date"] = datetime.now(UTC).isoformat(timespec="seconds")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")
    tmp.replace(path)
    return data


# --- table ----------------------------------------------------------------------------------


@dataclass
class Row:
    """One printed figure. ``ratio`` is value / reference, named by ``ratio_of``."""

    name: str
    value: float | None
    unit: str
    ratio: float | None = None
    ratio_of: str = ""
    target: str = ""
    passed: bool | None = None


def _fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.1f}"
    if abs(v) >= 1:
        return f"{v:.3f}"
    return f"{v:.4f}"


def print_table(rows: list[Row]) -> None:
    header = ("name", "value", "unit", "ratio", "target", "result")
    lines = [
        (
            r.name,
            _fmt(r.value),
            r.unit,
            f"{_fmt(r.ratio)}x {r.ratio_of}" if r.ratio is not None else "",
            r.target,
            "" if r.passed is None else ("PASS" if r.passed else "FAIL"),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    sep = "  "
    print(sep.join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print(sep.join("-" * w for w in widths))
    for line in lines:
        print(sep.join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


# --- a sidecar in its own process --------------------------------------------------------------


def _serve_sidecar(options: dict[str, Any], ready: Any, stop: Any, report: Any = None) -> None:
    """Child process body (spawn): run a sidecar until ``stop`` is set; its store's request
    counts go to the ``report`` queue, if one is given, as it stops."""
    import logging

    from sidecar.budget import tune_allocator
    from sidecar.config import SidecarSettings
    from sidecar.server import SidecarServer
    from sidecar.server.app import yield_cpu

    logging.basicConfig(level=logging.WARNING, format="sidecar: %(levelname)s %(name)s: %(message)s")
    settings = SidecarSettings(**options)
    yield_cpu(settings)  # as `strata sidecar` does
    tune_allocator()
    server = SidecarServer(settings).start()
    ready.set()
    try:
        stop.wait()
    finally:
        if report is not None:
            report.put(dict(server.store.requests))
        server.stop(grace=30)


class SidecarProcess:
    """A sidecar in a separate (spawned) process, as in a pod: its CPU work does not hold
    the trainer's GIL, only its cores."""

    def __init__(self, storage: str, socket: str, s3_endpoint: str = "", **settings: Any) -> None:
        self.socket = socket
        self._options = {
            "storage": storage,
            "socket": socket,
            "metrics_port": 0,
            "s3_endpoint": s3_endpoint,
            **settings,
        }
        ctx = mp.get_context("spawn")
        self._ready = ctx.Event()
        self._stop = ctx.Event()
        self._proc = ctx.Process(
            target=_serve_sidecar, args=(self._options, self._ready, self._stop), name="bench-sidecar"
        )

    def start(self, timeout: float = 60.0) -> SidecarProcess:
        self._proc.start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"bench sidecar did not start (exit code {self._proc.exitcode})")
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful stop (uploads finish), then SIGTERM, then SIGKILL, by this process's PID only."""
        if self._proc.pid is None:
            return
        self._stop.set()
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        with contextlib.suppress(OSError):
            os.unlink(self.socket)


def finite_positive(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def process_tree(pid: int) -> list[int]:
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
