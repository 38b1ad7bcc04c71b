"""Where a full checkpoint's CPU goes: ``python -m tests.bench.fullcpu [--size-gib 1] [--saves 3]``.

A sidecar in its own process with ``policy="full"`` saves a dense state (every byte rewritten
with fresh random values before each save, as Adam does to every parameter and moment; ``--changed
0.01 --set policy=intermittent``: a sparse update of 1% of the rows, saved as diffs) to
``file://`` and to a local SeaweedFS (S3). Per GiB of state, over ``--saves`` saves after a
warm-up one, it prints the CPU-seconds (user + system, from /proc) of the sidecar's process tree,
of the trainer process between the save call and durable (the random fill is outside the
window), of SeaweedFS, the fresh pages each touched (minor faults, the cost of new buffers) and
the storage requests the sidecar's store made. CPU-seconds and counts, not wall time: on a
shared machine they are what stays put. ``--profile DIR`` records the sidecar with py-spy.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.bench.common import GiB, MiB, _serve_sidecar, process_tree

PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")
TENSORS = 8
DIM = 256


@dataclass
class Usage:
    cpu_s: float = 0.0
    sys_s: float = 0.0  # of which in the kernel
    minflt: int = 0

    def __sub__(self, other: Usage) -> Usage:
        return Usage(self.cpu_s - other.cpu_s, self.sys_s - other.sys_s, self.minflt - other.minflt)

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.cpu_s + other.cpu_s, self.sys_s + other.sys_s, self.minflt + other.minflt)


def tree_usage(pid: int) -> Usage:
    """utime + stime and minor faults of ``pid`` and its live descendants."""
    total = Usage()
    for p in process_tree(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total.cpu_s += (int(fields[11]) + int(fields[12])) / TICK
            total.sys_s += int(fields[12]) / TICK
            total.minflt += int(fields[7])
    return total


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU-seconds of ``pid``'s tree by thread name (digits dropped, so pools add up)."""
    out: dict[str, float] = {}
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    head, _, tail = Path(f"/proc/{p}/task/{task}/stat").read_text().rpartition(")")
                    name = head.split("(", 1)[1].rstrip("0123456789_-")
                    fields = tail.split()
                    out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def self_usage() -> Usage:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return Usage(r.ru_utime + r.ru_stime, r.ru_stime, r.ru_minflt)


# --- the sidecar, in its own process, reporting its store's requests at stop ------------------


class Sidecar:
    def __init__(self, storage: str, socket: str, **settings: Any) -> None:
        ctx = mp.get_context("spawn")
        self.socket = socket
        self._ready, self._stop, self._report = ctx.Event(), ctx.Event(), ctx.Queue()
        options = {"storage": storage, "socket": socket, "metrics_port": 0, **settings}
        self.proc = ctx.Process(target=_serve_sidecar, args=(options, self._ready, self._stop, self._report))

    def start(self) -> Sidecar:
        self.proc.start()
        if not self._ready.wait(120):
            self.proc.kill()
            raise RuntimeError("sidecar did not start")
        return self

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def requests(self) -> dict[str, int]:
        """Stop the sidecar; its store's request counts since it started."""
        self._stop.set()
        counts: dict[str, int] = self._report.get(timeout=120)
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        with contextlib.suppress(OSError):
            os.unlink(self.socket)
        return counts


# --- one run -----------------------------------------------------------------------------------


def measure(
    label: str,
    storage: str,
    endpoint: str,
    weed_pid: int | None,
    size_gib: float,
    saves: int,
    tmp: Path,
    profile: Path | None,
    settings: dict[str, Any],
    perf: bool = False,
    changed: float = 1.0,
) -> dict[str, float]:
    import torch

    from tests.bench.foundation import make_client

    rows = max(8, int(size_gib * GiB / (TENSORS * DIM * 4)))
    state: dict[str, Any] = {f"w{i}": torch.empty(rows, DIM) for i in range(TENSORS)}
    gen = torch.Generator().manual_seed(0)
    nbytes = sum(t.numel() * 4 for t in state.values())
    gib = nbytes / GiB
    settings = {"policy": "full", **settings}
    sidecar = Sidecar(storage, str(tmp / f"{label}.sock"), s3_endpoint=endpoint, **settings)
    sidecar.start()
    client = make_client(sidecar.socket, f"fullcpu-{uuid.uuid4().hex[:8]}")
    spy: subprocess.Popen[bytes] | None = None
    weed_spy: subprocess.Popen[bytes] | None = None
    try:
        for t in state.values():
            t.uniform_(generator=gen)
        client.resume(state)
        client.save(1, state).durable.result(600)  # first-save costs (segments, connections)
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
            out = profile / f"{label}.{'perf' if perf else 'txt'}"
            tool = ["perf", "record", "-g", "-o", str(out), "-p", str(sidecar.pid)]
            if not perf:  # py-spy: Python frames with the native ones below them
                spy_bin = str(Path(sys.executable).with_name("py-spy"))
                tool = [spy_bin, "record", "--pid", str(sidecar.pid), "--subprocesses", "--native"]
                tool += ["--rate", "200", "--format", "raw", "--output", str(out)]
            spy = subprocess.Popen(tool, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if perf and weed_pid:
                weed_out = str(profile / "seaweed.perf")
                weed_spy = subprocess.Popen(
                    ["perf", "record", "-g", "-o", weed_out, "-p", str(weed_pid)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            time.sleep(1.0)
        side = trainer = weed = Usage()
        by_thread = {k: -v for k, v in thread_cpu(sidecar.pid).items()}
        durable = 0.0
        for step in range(2, 2 + saves):
            for t in state.values():  # outside the measured window
                if changed >= 1:  # every byte changes
                    t.uniform_(generator=gen)
                else:  # a fraction of the rows (a sparse update; diffs under --set policy=...)
                    pick = torch.randperm(rows, generator=gen)[: max(1, int(changed * rows))]
                    t[pick] = torch.rand(len(pick), DIM, generator=gen)
            s0, t0, w0 = tree_usage(sidecar.pid), self_usage(), tree_usage(weed_pid) if weed_pid else Usage()
            c0 = time.perf_counter()
            client.save(step, state).durable.result(600)
            durable += time.perf_counter() - c0
            time.sleep(0.3)  # the sidecar's last frees and SeaweedFS's flushes land in the window
            side = side + (tree_usage(sidecar.pid) - s0)
            trainer = trainer + (self_usage() - t0)
            if weed_pid:
                weed = weed + (tree_usage(weed_pid) - w0)
        for k, v in thread_cpu(sidecar.pid).items():
            by_thread[k] = by_thread.get(k, 0.0) + v
        top = sorted(by_thread.items(), key=lambda kv: -kv[1])[:6]
        print(f"  {label}: sidecar CPU-s by thread: " + ", ".join(f"{k} {v:.2f}" for k, v in top), flush=True)
    finally:
        for tool in (spy, weed_spy):
            if tool is not None:
                tool.send_signal(2)
                tool.wait(60)
        client.close()
        requests = sidecar.requests()
    n = saves * gib
    return {
        "sidecar_cpu_s_per_gib": side.cpu_s / n,
        "  of which system": side.sys_s / n,
        "trainer_cpu_s_per_gib": trainer.cpu_s / n,
        "  of which system ": trainer.sys_s / n,
        "seaweed_cpu_s_per_gib": weed.cpu_s / n,
        "  of which system  ": weed.sys_s / n,
        "sidecar_fresh_mib_per_gib": side.minflt * PAGE / MiB / n,
        "trainer_fresh_mib_per_gib": trainer.minflt * PAGE / MiB / n,
        "requests_per_gib": sum(requests.values()) / (saves + 1) / gib,
        "put_requests_per_save": requests.get("put", 0) / (saves + 1),
        "durable_s": durable / saves,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--storage", choices=("file", "s3", "both"), default="both")
    p.add_argument("--profile", type=Path, default=None, help="py-spy raw profiles of the sidecar here")
    p.add_argument("--perf", action="store_true", help="profile with perf record -g (kernel time too)")
    p.add_argument("--changed", type=float, default=1.0, help="fraction of rows changed before each save")
    p.add_argument("--set", action="append", default=[], help="sidecar setting NAME=VALUE (int if it parses)")
    args = p.parse_args(argv)
    settings: dict[str, Any] = {}
    for item in args.set:
        name, _, value = item.partition("=")
        settings[name] = int(value) if value.lstrip("-").isdigit() else value
    tmp = Path(tempfile.mkdtemp(prefix="fullcpu-"))
    results: dict[str, dict[str, float]] = {}
    try:
        if args.storage in ("file", "both"):
            results["file://"] = measure(
                "file",
                f"file://{tmp}/store",
                "",
                None,
                args.size_gib,
                args.saves,
                tmp,
                args.profile,
                settings,
                args.perf,
                args.changed,
            )
            shutil.rmtree(tmp / "store", ignore_errors=True)
        if args.storage in ("s3", "both"):
            from sidecar.local.seaweed import SeaweedServer

            weed = SeaweedServer(tmp / "weed").start()
            try:
                weed.create_bucket("fullcpu")
                results["s3"] = measure(
                    "s3",
                    "s3://fullcpu/run",
                    weed.endpoint,
                    weed.pid,
                    args.size_gib,
                    args.saves,
                    tmp,
                    args.profile,
                    settings,
                    args.perf,
                    args.changed,
                )
            finally:
                weed.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    keys = list(next(iter(results.values())))
    policy = settings.get("policy", "full")
    print(
        f"policy {policy}, {args.changed:.0%} of the rows of a {args.size_gib:g} GiB state changed before "
        f"each save, {args.saves} saves each, per GiB of state"
    )
    print(f"{'figure':28}" + "".join(f"{k:>12}" for k in results))
    for k in keys:
        print(f"{k:28}" + "".join(f"{results[s][k]:>12.3f}" for s in results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
