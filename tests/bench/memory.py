"""Bench section ``memory``: the sidecar's own peak memory during a full quantized save.

``sidecar_peak_memory_ratio``: the sidecar process's peak private memory (RssAnon + RssFile of
``/proc/<pid>/status``, sampled every 5 ms; the trainer's shared-memory pages it maps are
RssShmem and not its own) during the second full quantized save, over the raw bytes of one
snapshot as received. The interpreter, gRPC, boto3 and numpy are in it; the ``_over_idle``
figure subtracts what the sidecar held before the first save. The streamed variant (no shared
memory: the sidecar holds the committed snapshot and receives the next one) is printed for
comparison, without a target.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from tests.bench.common import Options, Phases, Row, SidecarProcess

TARGET = 1.5


def _private_bytes(pid: int) -> int:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return sum(fields.values())


class _Peak:
    """Samples a process's private memory in a thread; ``peak`` since the last ``reset``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            try:
                self.peak = max(self.peak, _private_bytes(self.pid))
            except OSError:
                return

    def reset(self) -> int:
        now = _private_bytes(self.pid)
        self.peak = now
        return now

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _measure(opts: Options, s3: Any, shm: str, size_bytes: int, figures: dict[str, Any], key: str) -> None:
    import torch

    from trainer_client import CheckpointClient

    bucket = f"mem-{shm}"
    s3.create_bucket(bucket)
    socket = str(opts.tmp / f"mem-{shm}.sock")
    sidecar = SidecarProcess(
        f"s3://{bucket}/ckpt",
        socket,
        s3.endpoint,
        shm_dir=str(Path("/dev/shm")),
        policy="full",
        quantize="4",
        keep=1,
    ).start()
    assert sidecar.pid is not None
    peak = _Peak(sidecar.pid)
    dim = 64
    rows = max(8, size_bytes // (4 * dim))
    torch.manual_seed(0)
    table = torch.nn.Embedding(rows, dim)
    dense = torch.nn.Linear(dim, dim)
    state = {"emb": table, "dense": dense}
    raw = sum(p.numel() * p.element_size() for m in state.values() for p in m.state_dict().values())
    client = CheckpointClient(job=f"mem-{shm}", socket=socket, shm=shm, resume="never", commit_timeout_s=600)
    try:
        idle = peak.reset()
        client.save(1, state).durable.result(600)
        with torch.no_grad():
            table.weight.add_(0.01)  # every row changes: the second full checkpoint re-quantizes all
        peak.reset()
        t0 = time.perf_counter()
        client.save(2, state).durable.result(600)
        figures[f"{key}_save_s"] = time.perf_counter() - t0
        time.sleep(0.05)
        figures[key] = peak.peak / raw
        figures[f"{key}_over_idle"] = (peak.peak - idle) / raw
        figures[f"{key}_snapshot_bytes"] = raw
        print(
            f"  {shm:>3}: snapshot {raw / 2**20:.0f} MiB, sidecar idle {idle / 2**20:.0f} MiB, "
            f"peak {peak.peak / 2**20:.0f} MiB during the second full quantized save",
            flush=True,
        )
    finally:
        peak.close()
        client.close()
        sidecar.stop()


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    from sidecar.local.seaweed import SeaweedServer

    size = int(opts.size_gib * 2**30)
    with SeaweedServer(opts.tmp / "s3") as s3:
        with phases("shared-memory saves (the default)"):
            _measure(opts, s3, "on", size, figures, "sidecar_peak_memory_ratio")
        with phases("streamed saves"):
            _measure(opts, s3, "off", size, figures, "sidecar_peak_memory_ratio_streamed")
    return _rows(figures)


def _rows(f: dict[str, Any]) -> list[Row]:
    ratio = f.get("sidecar_peak_memory_ratio")
    return [
        Row(
            "sidecar_peak_memory_ratio",
            ratio,
            "x snapshot",
            None,
            "",
            f"<= {TARGET}",
            None if ratio is None else ratio <= TARGET,
        ),
        Row(
            "sidecar_peak_memory_ratio_over_idle", f.get("sidecar_peak_memory_ratio_over_idle"), "x snapshot"
        ),
        Row("sidecar_peak_memory_ratio_streamed", f.get("sidecar_peak_memory_ratio_streamed"), "x snapshot"),
        Row(
            "sidecar_peak_memory_ratio_streamed_over_idle",
            f.get("sidecar_peak_memory_ratio_streamed_over_idle"),
            "x snapshot",
        ),
    ]
