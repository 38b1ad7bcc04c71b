"""Restore from storage against the storage's own speed.

A checkpoint of ``--gib`` GiB is committed through a real sidecar process (a full one, and a
full followed by ``--diffs`` diffs), the sidecar is stopped, and a fresh one on the same storage
(its memory empty) serves ``client.restore``: the restore comes from storage. Printed beside it:
a plain boto3 download of the same objects (``get_object().read()`` one after another, and
ranged GETs from a thread pool read into one preallocated buffer) and, for file://, a plain read
of the object files. For each: wall seconds, GiB/s, CPU seconds per GiB of the sidecar and of
the trainer (this process) and, for the sidecar, fresh MiB touched (minor page faults x 4 KiB: a
copy into a new buffer shows here) and GET requests (counted by reading the same snapshot in
this process through the sidecar's own reader).

    python -m tests.bench.restorecpu [--gib 1] [--diffs 3] [--storage file,s3]

The machine may be shared: wall time is noisy, CPU seconds and counts are not.
"""

from __future__ import annotations

import argparse
import inspect
import os
import resource
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

GiB = 1 << 30
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")
#: The S3 server's process (its CPU is reported beside each read from it), 0: none.
SERVER_PID = 0


def _proc_cpu(pid: int) -> tuple[float, int]:
    """(CPU seconds, minor faults) of process ``pid``, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK, int(fields[7])


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@contextmanager
def _measured(out: dict[str, float], pid: int | None = None) -> Iterator[None]:
    s0 = _proc_cpu(pid) if pid else (0.0, 0)
    w0 = _proc_cpu(SERVER_PID)[0] if SERVER_PID else 0.0
    c0, t0 = _self_cpu(), time.perf_counter()
    yield
    out["wall_s"] = time.perf_counter() - t0
    out["trainer_cpu_s"] = _self_cpu() - c0
    if pid:
        s1 = _proc_cpu(pid)
        out["sidecar_cpu_s"] = s1[0] - s0[0]
        out["sidecar_faulted_mib"] = (s1[1] - s0[1]) * PAGE / (1 << 20)
    if SERVER_PID:
        out["server_cpu_s"] = _proc_cpu(SERVER_PID)[0] - w0


@contextmanager
def _profiled(pid: int, name: str) -> Iterator[None]:
    """With RESTORECPU_PYSPY=DIR: a py-spy profile of the sidecar's restore, DIR/<name>.txt."""
    where = os.environ.get("RESTORECPU_PYSPY")
    if not where:
        yield
        return
    spy = Path(os.environ.get("PY_SPY", "py-spy"))
    out = Path(where) / f"{name}.txt"
    proc = subprocess.Popen(
        [str(spy), "record", "-p", str(pid), "-r", "250", "-f", "raw", "-o", str(out), "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # attached
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def _state(gib: float) -> dict[str, torch.Tensor]:
    """Four float32 tables of ``gib`` GiB in all, 64 columns each (a row is 256 bytes)."""
    rows = int(gib * GiB) // (4 * 64 * 4)
    g = torch.Generator().manual_seed(0)
    return {f"table{i}": torch.rand((rows, 64), generator=g) for i in range(4)}


def _save_chain(
    storage: str, endpoint: str, tmp: Path, job: str, state: dict[str, torch.Tensor], diffs: int
) -> None:
    from tests.bench.common import SidecarProcess
    from tests.bench.foundation import make_client

    policy = "consecutive" if diffs else "full"
    sidecar = SidecarProcess(storage, str(tmp / f"save-{job}.sock"), s3_endpoint=endpoint, policy=policy)
    sidecar.start()
    try:
        client = make_client(sidecar.socket, job)
        try:
            client.resume(state)
            g = torch.Generator().manual_seed(1)
            for step in range(1, diffs + 2):
                if step > 1:  # a diff: a few thousand rows of every table change
                    for t in state.values():
                        rows = torch.randint(0, t.shape[0], (4096,), generator=g)
                        t[rows] += 1.0
                client.save(step, state).durable.result(600)
        finally:
            client.close()
    finally:
        sidecar.stop()


def _strata_restore(
    storage: str, endpoint: str, tmp: Path, job: str, expect: dict[str, torch.Tensor]
) -> dict[str, float]:
    from tests.bench.common import SidecarProcess
    from tests.bench.foundation import make_client

    sidecar = SidecarProcess(storage, str(tmp / f"restore-{job}.sock"), s3_endpoint=endpoint).start()
    out: dict[str, float] = {}
    try:
        client = make_client(sidecar.socket, job)
        try:
            state = {k: torch.zeros_like(v) for k, v in expect.items()}
            assert sidecar.pid is not None
            with _profiled(sidecar.pid, job), _measured(out, sidecar.pid):
                client.restore(state)
            assert client.last_restore["source"] == "storage", client.last_restore
            bad = [k for k in expect if not torch.equal(state[k], expect[k])]
            if bad:
                raise AssertionError(f"restored tensors differ: {bad}")
        finally:
            client.close()
    finally:
        sidecar.stop()
    return out


def _open(storage: str, endpoint: str) -> Any:
    from sidecar.store import open_store

    if storage.startswith("s3://"):
        return open_store(storage, endpoint_url=endpoint)
    return open_store(storage)


def _chain_objects(store: Any, job: str) -> tuple[Any, list[Any]]:
    """The newest commit's manifest (rank 0) and the objects of its whole chain."""
    from sidecar import manifest as mf

    attempt, step = mf.valid_commits(store, "default", job)[-1]
    commit = mf.read_commit(store, "default", job, step, attempt)
    manifest = mf.load_manifest(store, commit, 0)
    objects = list(manifest.objects)
    refs = {r.step: r for r in manifest.required_commits}
    m = manifest
    while m.base_step is not None:
        m = mf.load_manifest(store, mf.load_ref(store, refs[m.base_step]), 0)
        objects += m.objects
    return manifest, objects


def _reader_counts(storage: str, endpoint: str, job: str) -> dict[str, float]:
    """The sidecar's storage reader run here on a fresh store, into a memfd as the sidecar
    reads (where it lends restores): its GETs, wall and CPU."""
    from sidecar import manifest as mf
    from sidecar.pipeline.plan import read_snapshot

    try:
        from sidecar.shm import RestoreBuffer
    except ImportError:  # an older sidecar
        RestoreBuffer = None  # type: ignore[assignment,misc]

    store = _open(storage, endpoint)
    try:
        manifest, _ = _chain_objects(store, job)
        refs = {r.step: r for r in manifest.required_commits}
        before = store.requests["get"]
        out: dict[str, float] = {}
        lent = "dest" in inspect.signature(read_snapshot).parameters  # (an older reader: no)
        with ThreadPoolExecutor(4) as pool, _measured(out):
            dest = RestoreBuffer(manifest.total_bytes) if lent and hasattr(os, "memfd_create") else None
            kwargs = {"dest": dest} if dest is not None else {}
            read_snapshot(
                store,
                manifest,
                lambda s: mf.load_manifest(store, mf.load_ref(store, refs[s]), 0),
                pool,
                **kwargs,
            )
        out["gets"] = store.requests["get"] - before
        if dest is not None:
            dest.close()
        return out
    finally:
        store.close()


def _boto3_floor(endpoint: str, bucket: str, keys: list[tuple[str, int]]) -> dict[str, dict[str, float]]:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="strata",
        aws_secret_access_key="strata",
        region_name="us-east-1",
        config=Config(max_pool_connections=16, s3={"addressing_style": "path"}),
    )
    total = sum(size for _, size in keys)
    found: dict[str, dict[str, float]] = {}

    seq: dict[str, float] = {}
    with _measured(seq):
        got = 0
        for key, _ in keys:
            got += len(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert got == total
    found["boto3 get().read(), sequential"] = seq

    buf = bytearray(total)
    view = memoryview(buf)
    ranges: list[tuple[str, int, int, int]] = []  # key, object offset, length, buffer offset
    at = 0
    for key, size in keys:
        for lo in range(0, size, 16 << 20):
            ranges.append((key, lo, min(16 << 20, size - lo), at + lo))
        at += size

    def fetch(r: tuple[str, int, int, int]) -> None:
        key, lo, n, dst = r
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={lo}-{lo + n - 1}")["Body"]
        raw, pos = body._raw_stream, 0
        while pos < n:
            k = raw.readinto(view[dst + pos : dst + n])
            if not k:
                raise OSError("short read")
            pos += k
        body.close()

    par: dict[str, float] = {}
    with ThreadPoolExecutor(8) as pool, _measured(par):
        list(pool.map(fetch, ranges))
    found["boto3 ranged GETs x8 readinto"] = par
    return found


def _file_floor(root: Path, keys: list[tuple[str, int]]) -> dict[str, float]:
    buf = bytearray(sum(size for _, size in keys))
    view = memoryview(buf)
    out: dict[str, float] = {}
    with _measured(out):
        at = 0
        for key, size in keys:
            with open(root / key, "rb", buffering=0) as f:
                f.readinto(view[at : at + size])
            at += size
    return out


def _row(name: str, m: dict[str, float], nbytes: int) -> str:
    gib = nbytes / GiB
    cells = [
        f"{m['wall_s']:7.2f} s",
        f"{gib / m['wall_s']:6.2f} GiB/s",
        f"trainer {m['trainer_cpu_s'] / gib:5.2f}",
        f"sidecar {m['sidecar_cpu_s'] / gib:5.2f}" if "sidecar_cpu_s" in m else " " * 13,
        f"server {m['server_cpu_s'] / gib:5.2f}" if "server_cpu_s" in m else "",
        f"{m['sidecar_faulted_mib']:6.0f} MiB faulted" if "sidecar_faulted_mib" in m else " " * 18,
        f"{int(m['gets']):4d} GETs" if "gets" in m else "",
    ]
    return f"  {name:<38} " + "  ".join(cells)


def run_one(
    storage: str, endpoint: str, tmp: Path, gib: float, diffs: int, floor: Callable[..., Any]
) -> None:
    job = f"rc-{uuid.uuid4().hex[:8]}"
    state = _state(gib)
    _save_chain(storage, endpoint, tmp, job, state, diffs)
    nbytes = sum(t.nbytes for t in state.values())
    strata = _strata_restore(storage, endpoint, tmp, job, state)
    reader = _reader_counts(storage, endpoint, job)
    store = _open(storage, endpoint)
    try:
        _, objects = _chain_objects(store, job)
        prefix = getattr(store, "_root", "")  # an S3 store's key prefix; files: relative paths
        keys = [(prefix + o.key, o.size) for o in objects]
    finally:
        store.close()
    stored = sum(size for _, size in keys)
    what = "full" if not diffs else f"full + {diffs} diffs"
    scheme = storage.split(":")[0]
    print(f"{scheme}, {what}: {nbytes / GiB:.2f} GiB state, {stored / GiB:.3f} GiB in {len(keys)} objects")
    print("  (CPU columns: CPU seconds per GiB restored; faulted: the sidecar's minor page faults x 4 KiB)")
    print(_row("Strata restore from storage", strata, nbytes))
    print(_row("  its storage reader alone (in process)", reader, nbytes))
    for name, m in floor(keys).items():
        print(_row(name, m, stored))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--diffs", type=int, default=3)
    ap.add_argument("--storage", default="file,s3")
    args = ap.parse_args(argv)
    kinds = args.storage.split(",")
    with tempfile.TemporaryDirectory(prefix="restorecpu-") as name:
        tmp = Path(name)
        if "file" in kinds:
            root = tmp / "store"
            root.mkdir()
            for diffs in sorted({0, args.diffs}):
                run_one(
                    f"file://{root}",
                    "",
                    tmp,
                    args.gib,
                    diffs,
                    lambda keys: {"plain file read": _file_floor(root, keys)},
                )
        if "s3" in kinds:
            from sidecar.local.seaweed import SeaweedServer

            global SERVER_PID
            weed = SeaweedServer(tmp / "weed").start()
            SERVER_PID = weed.pid
            try:
                bucket = f"rc-{uuid.uuid4().hex[:8]}"
                weed.create_bucket(bucket)
                for diffs in sorted({0, args.diffs}):
                    run_one(
                        f"s3://{bucket}",
                        weed.endpoint,
                        tmp,
                        args.gib,
                        diffs,
                        lambda keys, b=bucket: _boto3_floor(weed.endpoint, b, keys),
                    )
            finally:
                weed.stop()


if __name__ == "__main__":
    main()
