"""Where Strata's extra host memory goes during a save: PSS of the trainer process and of its
sidecar (a separate process, as in a pod), their peak together since the phase before (sampled
every 20 ms), and the shared segments either maps (staging memfds, tmpfs files: bytes of the
distinct files), at each phase of two saves of a state of embedding tables, the first full, the
second a diff of a few rows.

    python -m tests.bench.host_memory --size-gib 1 --buffers 1 2 --tmp /tmp/strata-mem

prints one table per staging mode (``STRATA_STAGING_BUFFERS``); every figure is the growth
over the value before the client was created, in MiB and as a fraction of the state.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import threading
from pathlib import Path

import torch

from tests.bench.common import SidecarProcess
from trainer_client import CheckpointClient

MiB = 1 << 20
DIM = 64
TABLES = 4


def pss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` (seconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def segments(*pids: int) -> int:
    """Bytes of the distinct shared segments (``/memfd:strata-*``, ``/dev/shm/*``) ``pids`` map."""
    ends: dict[str, int] = {}
    for pid in pids:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and ("/memfd:strata-" in parts[5] or parts[5].startswith("/dev/shm/")):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                inode = f"{parts[3]}:{parts[4]}"
                ends[inode] = max(ends.get(inode, 0), int(parts[2], 16) + end - start)
    return sum(ends.values())


class Peak:
    """The peak of two processes' PSS together, sampled in a thread, since the last ``take``."""

    def __init__(self, *pids: int) -> None:
        self.pids, self.peak = pids, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, sum(pss(p) for p in self.pids))

    def take(self) -> int:
        peak, self.peak = self.peak, sum(pss(p) for p in self.pids)
        return max(peak, self.peak)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def breakdown(size_gib: float, buffers: str, tmp: str) -> list[tuple[str, int, int, int, int, float]]:
    """(phase, trainer PSS, sidecar PSS, their peak since the phase before, shared segments)
    growth in bytes at each phase of two saves, and the sidecar's CPU seconds since the phase
    before; last, ("state bytes", n, 0, 0, 0, 0)."""
    rows = int(size_gib * (1 << 30)) // (TABLES * DIM * 4)
    state = {f"t{i}": torch.randn(rows, DIM) for i in range(TABLES)}
    state_bytes = sum(t.numel() * 4 for t in state.values())
    sock = os.path.join(tempfile.mkdtemp(prefix="m", dir="/tmp"), "s.sock")
    sidecar = SidecarProcess(f"file://{tmp}/store-{buffers}", sock).start()
    try:
        assert sidecar.pid is not None
        me, side = os.getpid(), sidecar.pid
        base = (pss(me), pss(side))
        out: list[tuple[str, int, int, int, int, float]] = []
        peak = Peak(me, side)
        cpu = [cpu_s(side)]

        def phase(name: str) -> None:
            top = peak.take() - base[0] - base[1]
            used, cpu[0] = cpu_s(side) - cpu[0], cpu_s(side)
            out.append((name, pss(me) - base[0], pss(side) - base[1], top, segments(me, side), used))

        client = CheckpointClient(
            job=f"mem-{buffers}", socket=sock, staging_buffers=buffers, capture_rng=False
        )
        try:
            phase("client created")
            first = client.save(1, state)
            phase("save 1 staged (full)")
            first.durable.result(600)
            phase("save 1 committed, held")
            for t in state.values():
                t[:: max(1, rows // 512)] += 1.0  # a few hundred rows of each table change
            second = client.save(2, state)
            phase("save 2 staged (diff)")
            second.durable.result(600)
            phase("save 2 committed, held")
        finally:
            client.close()
            peak.close()
        out.append(("state bytes", state_bytes, 0, 0, 0, 0.0))
        return out
    finally:
        sidecar.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--buffers", nargs="+", default=["1", "2"])
    parser.add_argument("--tmp", default="")
    args = parser.parse_args()
    tmp = args.tmp or tempfile.mkdtemp(prefix="strata-mem-")
    for buffers in args.buffers:
        table = breakdown(args.size_gib, buffers, tmp)
        state_bytes = table[-1][1]
        print(f"\nstaging buffers {buffers}, state {state_bytes / MiB:.0f} MiB")
        print("growth over before the client; peak: since the phase before; cpu s: the sidecar's, too")
        heads = ("trainer", "sidecar", "both", "ratio", "peak", "ratio", "segments", "cpu s")
        print(f"{'phase':26} " + " ".join(f"{h:>8}" if h != "ratio" else f"{h:>6}" for h in heads))
        for name, trainer, side, top, shm, used in table[:-1]:
            both = trainer + side
            print(
                f"{name:26} {trainer / MiB:8.0f} {side / MiB:8.0f} {both / MiB:8.0f} "
                f"{both / state_bytes:6.2f} {top / MiB:8.0f} {top / state_bytes:6.2f} {shm / MiB:8.0f} "
                f"{used:8.2f}"
            )
        with contextlib.suppress(OSError):
            for p in Path(tmp).glob(f"store-{buffers}/**/*"):
                if p.is_file():
                    p.unlink()


if __name__ == "__main__":
    main()
