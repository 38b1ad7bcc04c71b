"""Bench section ``peer``: REFT's tiers. Restore from a rank's own sidecar memory, from other
members' memory (a buddy's copy; a parity rebuild beside it) and from S3, side by side in one run
on the same state (``--size-gib`` per rank); step time with redundancy on vs off; and the
restart-to-resumed time of an in-place gang restart vs a pod-level one.

Storage is SeaweedFS behind a proxy that paces each simulated node to 200 MB/s per direction (a
node's realistic share of an object store); members talk over loopback gRPC, unthrottled for
restores; redundancy pushes are paced by the sidecar's own ``--redundancy-rate-mb-s``. Every
sidecar runs in its own process, as in a pod.

- ``restore_*_s``: from a new client (a restarted trainer) to its state restored, median of
  ``repeats`` gang restarts; for the peer and parity tiers the member was lost first (its sidecar
  replaced by an empty one, its redundancy directory wiped); for S3 every member was.
- ``restore_speedup_memory_vs_s3`` (target >= 12, REFT's figure), ``restore_speedup_peer_vs_s3``
  (>= 2, buddy), ``restore_speedup_parity_vs_s3`` (>= 2: the share comes down a chain of the
  group's survivors, each XORing its part in, so the rebuilt member receives one share's bytes).
- ``parity_rebuild_bytes_received``: the bytes the rebuilt member received (its sidecar's
  ``strata_peer_rebuild_received_bytes_total``, last repeat), beside ``parity_share_bytes``, the
  lost share's size as the survivors' parity headers give it.
- ``step_ratio_redundancy``: a training loop saving every few seconds, median step time with buddy
  redundancy over without (target <= 1.10); ``_ci_high`` is the ratio of the on-arm's upper to the
  off-arm's lower 95% bound of the median.
- ``peer_stream_gcm_s_per_gib`` (send, receive): the CPU seconds per GiB that one side spends
  protecting a peer stream, as sidecar.gang does it (AES-256-GCM, chunks framed by hand), beside
  ``peer_stream_gmac_s_per_gib``: the same over associated data only (the GMAC that only
  authenticated the bytes before they were encrypted); best of 5, one thread.
- ``restart_speedup_inplace_vs_pod``: ``strata launch`` of restart_trainer.py (each rank its own
  shard, half the state) on two simulated pods, a rank SIGKILLed mid-save; from the launcher
  stopping the ranks to every rank restored, with the sidecars kept (in place: restored from
  memory) over every sidecar recreated empty (pod-level: restored from S3, both nodes' shares of
  it, 400 MB/s). Target >= 2. Both runs stage into two segments (``STRATA_STAGING_BUFFERS=2``): with
  the default one, the committed step held in memory is given back as the next save starts staging,
  so a crash mid-save restores from peers or storage, in place or not. A real pod-level restart also
  waits for scheduling and image pulls, which this leaves out.
"""

from __future__ import annotations

import gc
import math
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from sidecar.redundancy import read_headers
from tests.bench.common import REPO_ROOT, Options, Phases, Row, SidecarProcess, median, median_ci
from tests.bench.recovery import resumed_after_failure
from tests.bench.throttle import ProxyProcess

GiB = 1 << 30
NODE_RATE = 200e6  # bytes/s of object storage per simulated node
STRATA = str(Path(sys.executable).parent / "strata")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Members:
    """Sidecar processes, one per simulated pod, members of one job."""

    def __init__(self, tmp: Path, n: int, mode: str, storage: str, endpoints: list[str], **settings: Any):
        self.tmp, self.n, self.mode, self.storage, self.endpoints = tmp, n, mode, storage, endpoints
        self.settings = settings
        self.ports = [_free_port() for _ in range(n)]
        self.metrics_ports = [_free_port() for _ in range(n)]
        self.procs: list[SidecarProcess | None] = [None] * n
        for i in range(n):
            self.start(i)

    def red_dir(self, i: int) -> str:
        return f"/dev/shm/strata-bench-{os.getpid()}-{self.tmp.name}-{i}"

    def socket(self, i: int) -> str:
        return str(self.tmp / f"m{i}.sock")

    def start(self, i: int) -> None:
        red = {}
        if self.mode != "off":
            red = {
                "redundancy": self.mode,
                "members": ",".join(f"127.0.0.1:{p}" for p in self.ports),
                "member_index": i,
                "redundancy_dir": self.red_dir(i),
            }
        self.procs[i] = SidecarProcess(
            self.storage,
            self.socket(i),
            s3_endpoint=self.endpoints[i],
            shm_dir="/dev/shm",
            keep=2,
            peer_port=self.ports[i],
            metrics_port=self.metrics_ports[i],
            metrics_host="127.0.0.1",
            **red,
            **self.settings,
        ).start()

    def lose(self, i: int) -> None:
        """Member ``i``'s pod is gone (sidecar, memory, emptyDir); a new one takes its place."""
        proc = self.procs[i]
        if proc is not None:
            proc.stop(timeout=30)
        shutil.rmtree(self.red_dir(i), ignore_errors=True)
        self.start(i)

    def counter(self, i: int, name: str, job: str) -> float:
        """Member ``i``'s counter ``name`` of ``job``, from its metrics endpoint."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_ports[i]}/metrics", timeout=10) as r:
            text = r.read().decode()
        found = re.findall(rf'^{name}\{{[^}}]*training_job="{job}"[^}}]*\}} (\S+)$', text, re.M)
        return sum(float(v) for v in found)

    def close(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc is not None:
                proc.stop(timeout=30)
            shutil.rmtree(self.red_dir(i), ignore_errors=True)


def _state(nbytes: int, rank: int) -> dict[str, Any]:
    """``nbytes`` of fp32 in 16 tensors, different per rank."""
    import torch

    g = torch.Generator().manual_seed(rank)
    n = nbytes // 4 // 16
    return {f"t{k}": torch.rand(n, generator=g) for k in range(16)}


def _client(m: Members, i: int, job: str, generation: str) -> Any:
    from trainer_client import CheckpointClient

    return CheckpointClient(
        job=job,
        socket=m.socket(i),
        rank=i,
        world_size=m.n,
        generation=generation,
        capture_rng=False,
        resume="never",
        when_busy="wait",
        connect_timeout_s=60.0,
        commit_timeout_s=600.0,
    )


def _restore(m: Members, job: str, generation: str, states: list[dict[str, Any]]) -> list[tuple[float, str]]:
    """A gang restart: each rank's (seconds from a new client to its state restored, source).
    The ranks restore one after another, each with the machine's cores to itself, as each would
    have its own node's (at once, on 2 cores, every figure would halve alike)."""
    out: list[tuple[float, str]] = [(math.nan, "")] * m.n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            t0 = time.perf_counter()
            client = _client(m, i, job, generation)
            try:
                client.restore(states[i])
                out[i] = (time.perf_counter() - t0, str((client.last_restore or {}).get("source")))
            finally:
                client.close(wait=False)
        except BaseException as exc:
            errors.append(exc)

    for i in range(m.n):
        one(i)
        if errors:
            raise errors[0]
    return out


def _pushed(m: Members, job: str, states: list[dict[str, Any]], step: int, generation: str) -> None:
    """Every rank saves ``step``; returns once it is durable and (redundancy) protected."""
    clients = [_client(m, i, job, generation) for i in range(m.n)]
    try:
        for h in [c.save(step, s) for c, s in zip(clients, states, strict=True)]:
            h.durable.result(900)
    finally:
        for c in clients:
            c.close()
    # The push follows the commit: wait until every member holds what protects another.
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        held = [list(Path(m.red_dir(i)).glob(f"*/{job}/*-*/[0-9]*-{step}")) for i in range(m.n)]
        if all(held):
            return
        time.sleep(0.1)
    raise RuntimeError(f"step {step} of {job} was not protected within 600 s")


def restores(opts: Options, figures: dict[str, Any], phases: Phases, storage: str, endpoint: str) -> None:
    size = int(opts.size_gib * GiB) if not opts.quick else 64 << 20
    repeats = 1 if opts.quick else 3
    figures["peer_state_bytes"] = size
    figures["peer_storage_rate_mb_s"] = NODE_RATE / 1e6
    proxies = [ProxyProcess(endpoint, NODE_RATE) for _ in range(3)]
    try:
        with phases("buddy: memory, peer and S3 restores"):
            m = Members(
                opts.tmp / "buddy",
                2,
                "buddy",
                storage,
                [p.endpoint for p in proxies[:2]],
                redundancy_rate_mb_s=0,
            )
            try:
                job = f"peer-{uuid.uuid4().hex[:6]}"
                states = [_state(size, r) for r in range(2)]
                _pushed(m, job, states, 1, "b/0")
                gen = iter(range(1, 100))
                memory, peer, s3 = [], [], []
                for _ in range(repeats):
                    got = _restore(m, job, f"b/{next(gen)}", states)
                    assert all(src == "memory" for _, src in got), got
                    memory += [t for t, _ in got]
                for _ in range(repeats):
                    m.lose(1)
                    got = _restore(m, job, f"b/{next(gen)}", states)
                    assert got[1][1] == "peer", got
                    peer.append(got[1][0])
                for _ in range(repeats):
                    m.lose(0)
                    m.lose(1)
                    got = _restore(m, job, f"b/{next(gen)}", states)
                    assert all(src == "storage" for _, src in got), got
                    s3 += [t for t, _ in got]
            finally:
                m.close()
            figures["restore_memory_s"] = median(memory)
            figures["restore_peer_s"] = median(peer)
            figures["restore_s3_s"] = median(s3)
            figures["restore_speedup_memory_vs_s3"] = median(s3) / median(memory)
            figures["restore_speedup_peer_vs_s3"] = median(s3) / median(peer)
            del states
            gc.collect()
        with phases("parity: rebuild of a lost member"):
            m = Members(
                opts.tmp / "parity",
                3,
                "parity",
                storage,
                [p.endpoint for p in proxies],
                redundancy_rate_mb_s=0,
            )
            try:
                job = f"parity-{uuid.uuid4().hex[:6]}"
                states = [_state(size, r) for r in range(3)]
                _pushed(m, job, states, 1, "p/0")
                parity = []
                (held,) = Path(m.red_dir(0)).glob(f"*/{job}/parity-*/[0-9]*-1/headers")
                (lost,) = [h for h in read_headers(held) if h.member == 1]
                for k in range(repeats):
                    m.lose(1)
                    got = _restore(m, job, f"p/{k + 1}", states)
                    assert got[1][1] == "peer", got
                    parity.append(got[1][0])
                    name = "strata_peer_rebuild_received_bytes_total"
                    figures["parity_rebuild_bytes_received"] = m.counter(1, name, job)
            finally:
                m.close()
            figures["parity_share_bytes"] = lost.share_bytes
            figures["restore_parity_s"] = median(parity)
            figures["restore_speedup_parity_vs_s3"] = figures["restore_s3_s"] / median(parity)
            del states
            gc.collect()
    finally:
        for p in proxies:
            p.close()


def steps(opts: Options, figures: dict[str, Any], phases: Phases, storage: str, endpoint: str) -> None:
    """Training with saves every few seconds, redundancy off vs buddy (paced at the default
    200 MB/s), alternating; one trainer on one thread, its sidecar and the buddy each in a process."""
    import torch

    size = int(opts.size_gib * GiB / 2) if not opts.quick else 32 << 20
    rate = 200.0
    figures["step_ratio_state_bytes"] = size
    figures["redundancy_rate_mb_s"] = rate
    proxy = ProxyProcess(endpoint, NODE_RATE)
    arms = {
        "off": Members(opts.tmp / "off", 2, "off", storage, [proxy.endpoint] * 2),
        "buddy": Members(
            opts.tmp / "on", 2, "buddy", storage, [proxy.endpoint] * 2, redundancy_rate_mb_s=rate
        ),
    }
    state = _state(size, 0)
    a = torch.randn(384, 384)
    # Saves as often as the upload (the node's 200 MB/s) and then the push (``rate``) keep up with.
    interval = max(2.0, 1.2 * (size / NODE_RATE + size / (rate * 1e6))) if not opts.quick else 1.0
    saves = 3 if not opts.quick else 2
    per_step: dict[str, list[float]] = {"off": [], "buddy": []}
    try:
        with phases("step time, redundancy off vs buddy"):
            torch.set_num_threads(opts.loop_threads)
            for rnd in range(3 if not opts.quick else 1):
                for name, m in arms.items():
                    from trainer_client import CheckpointClient

                    # a one-rank job on member 0; member 1 (no rank) holds its copy
                    client = CheckpointClient(
                        job=f"steps-{name}-{rnd}",
                        socket=m.socket(0),
                        rank=0,
                        world_size=1,
                        generation="s/0",
                        capture_rng=False,
                        resume="never",
                        when_busy="wait",
                    )
                    try:
                        client.save(0, state).durable.result(600)  # warm: segments, first full
                        time.sleep(interval)
                        handles = []
                        for s in range(1, saves + 1):
                            t0, n = time.perf_counter(), 0
                            while time.perf_counter() - t0 < interval:
                                for _ in range(4):
                                    a = torch.tanh(a @ a / 384)
                                n += 4
                            per_step[name].append((time.perf_counter() - t0) / n)
                            state["t0"][:1000].add_(1.0)
                            handles.append(client.save(s, state))
                        for h in handles:
                            h.durable.result(600)
                    finally:
                        client.close()
    finally:
        for m in arms.values():
            m.close()
        proxy.close()
    on, off = per_step["buddy"], per_step["off"]
    figures["step_s_redundancy_off"] = median(off)
    figures["step_s_redundancy_buddy"] = median(on)
    figures["step_ratio_redundancy"] = median(on) / median(off)
    figures["step_ratio_redundancy_ci_high"] = median_ci(on)[1] / median_ci(off)[0]


TRAINER = Path(__file__).with_name("restart_trainer.py")


def _restart_once(opts: Options, mode: str, storage: str, endpoint: str) -> float:
    mib = str(int(opts.size_gib * 512)) if not opts.quick else "16"  # per rank: the state over 2
    env = dict(
        os.environ,
        STRATA_FAULTS="client.stream.chunk@29#1=kill",
        STRATA_FAULTS_RANK="1",
        STRATA_TEST_FAULTS="1",
        STRATA_STAGING_BUFFERS="2",  # the step held in memory survives the save the kill interrupts
    )
    run = subprocess.run(
        [
            *(STRATA, "launch", "--nproc", "2", "--sidecars", "2", "--restart", mode),
            *("--job", f"restart-{mode}-{uuid.uuid4().hex[:6]}", "--backoff-s", "0"),
            *("--storage", storage, "--s3-endpoint", endpoint, "--workdir", str(opts.tmp / f"launch-{mode}")),
            *("--", sys.executable, str(TRAINER), "--steps", "40", "--save-every", "10", "--mib", mib),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO_ROOT,
    )
    if run.returncode != 0:
        raise RuntimeError(f"{mode} restart run failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    sources = re.findall(r"RESUMED rank=\d+ restart=1 step=\S+ source=(\S+)", run.stdout)
    want = "memory" if mode == "inplace" else "storage"
    if sources != [want, want]:
        raise RuntimeError(f"{mode} restart restored from {sources}, expected {want}")
    return resumed_after_failure(run)


def restarts(opts: Options, figures: dict[str, Any], phases: Phases, storage: str, endpoint: str) -> None:
    # Two simulated nodes: their shares of the object store, together.
    proxy = ProxyProcess(endpoint, 2 * NODE_RATE)
    try:
        with phases("in-place vs pod-level gang restart"):
            inplace = _restart_once(opts, "inplace", storage, proxy.endpoint)
            pod = _restart_once(opts, "pod", storage, proxy.endpoint)
    finally:
        proxy.close()
    figures["restart_inplace_s"] = inplace
    figures["restart_pod_s"] = pod
    figures["restart_speedup_inplace_vs_pod"] = pod / inplace


def stream_cipher(opts: Options, figures: dict[str, Any], phases: Phases) -> None:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from sidecar.budget import tune_allocator
    from sidecar.gang import StreamCipher, chunk_frame, stream_mac

    tune_allocator()  # as in a sidecar: a chunk's buffers come from the malloc arena, reused
    chunk = os.urandom((1 << 20) - (64 << 10))  # the peer port's chunk (sidecar.server.app)
    n = (256 << 20) // len(chunk)
    gib = n * len(chunk) / GiB
    key, mac = os.urandom(32), "ab" * 32

    def best(fn: Any) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) / gib

    frame = chunk_frame(chunk)[0]

    def gcm_send() -> None:
        sender = stream_mac(key, mac, b"salt")
        for _ in range(n):
            chunk_frame(sender.apply(memoryview(chunk)))
        sender.hexdigest()

    def gcm_receive() -> None:
        opener = StreamCipher(key, mac, b"salt", encrypt=False)
        for _ in range(n):
            opener.apply(memoryview(frame)[4:])

    def gmac(send: bool) -> None:
        ctx = Cipher(algorithms.AES(key), modes.GCM(b"\0" * 12)).encryptor()
        for _ in range(n):
            ctx.authenticate_additional_data(chunk_frame(chunk)[1] if send else memoryview(frame)[4:])
        ctx.finalize()

    with phases("peer stream protection, per GiB"):
        figures["peer_stream_gcm_send_s_per_gib"] = best(gcm_send)
        figures["peer_stream_gcm_receive_s_per_gib"] = best(gcm_receive)
        figures["peer_stream_gmac_send_s_per_gib"] = best(lambda: gmac(True))
        figures["peer_stream_gmac_receive_s_per_gib"] = best(lambda: gmac(False))


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    from sidecar.local.seaweed import SeaweedServer

    stream_cipher(opts, figures, phases)
    weed = SeaweedServer(opts.tmp / "weed").start()
    try:
        bucket = f"peer-{uuid.uuid4().hex[:8]}"
        weed.create_bucket(bucket)
        storage = f"s3://{bucket}/ckpt"
        restores(opts, figures, phases, storage, weed.endpoint)
        steps(opts, figures, phases, storage, weed.endpoint)
        restarts(opts, figures, phases, storage, weed.endpoint)
    finally:
        weed.stop()
    return _rows(figures)


def _rows(f: dict[str, Any]) -> list[Row]:
    def get(key: str) -> float | None:
        v = f.get(key)
        return float(v) if isinstance(v, int | float) and math.isfinite(v) else None

    def target(key: str, text: str, ok: Any) -> Row:
        v = get(key)
        return Row(key, v, "x", target=text, passed=None if v is None else bool(ok(v)))

    s3 = get("restore_s3_s")
    return [
        Row("state per rank", (get("peer_state_bytes") or 0) / GiB, "GiB"),
        Row("storage per node (throttled)", get("peer_storage_rate_mb_s"), "MB/s"),
        Row("restore_memory_s", get("restore_memory_s"), "s"),
        Row("restore_peer_s (buddy copy)", get("restore_peer_s"), "s"),
        Row("restore_parity_s (rebuild)", get("restore_parity_s"), "s"),
        Row("restore_s3_s", s3, "s"),
        target("restore_speedup_memory_vs_s3", ">= 12", lambda v: v >= 12),
        target("restore_speedup_peer_vs_s3", ">= 2", lambda v: v >= 2),
        target("restore_speedup_parity_vs_s3", ">= 2", lambda v: v >= 2),
        Row("parity_rebuild_bytes_received", (get("parity_rebuild_bytes_received") or 0) / GiB, "GiB"),
        Row("parity_share_bytes (the lost share)", (get("parity_share_bytes") or 0) / GiB, "GiB"),
        Row("step_s_redundancy_off", get("step_s_redundancy_off"), "s"),
        Row("step_s_redundancy_buddy", get("step_s_redundancy_buddy"), "s"),
        target("step_ratio_redundancy", "<= 1.10", lambda v: v <= 1.10),
        Row("step_ratio_redundancy_ci_high", get("step_ratio_redundancy_ci_high"), "x"),
        Row("peer_stream_gcm_send_s_per_gib", get("peer_stream_gcm_send_s_per_gib"), "s"),
        Row("peer_stream_gcm_receive_s_per_gib", get("peer_stream_gcm_receive_s_per_gib"), "s"),
        Row("peer_stream_gmac_send_s_per_gib", get("peer_stream_gmac_send_s_per_gib"), "s"),
        Row("peer_stream_gmac_receive_s_per_gib", get("peer_stream_gmac_receive_s_per_gib"), "s"),
        Row("restart_inplace_s", get("restart_inplace_s"), "s"),
        Row("restart_pod_s", get("restart_pod_s"), "s"),
        target("restart_speedup_inplace_vs_pod", ">= 2", lambda v: v >= 2),
    ]
