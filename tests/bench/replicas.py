"""Bench section ``replicas``: replica-aware saves, 4 data-parallel ranks against 1.

The same state (a dense model with Adam, ``--size-gib`` in all: parameters plus both moments) is
saved by one rank alone, then by 4 data-parallel ranks that each hold an identical replica (as DDP
leaves them) and declare it replicated; one sidecar in its own process serves them all, writing
to a local directory. Figures:

- ``bytes_written_ratio_4dp_vs_1dp``: bytes of the committed step's objects, 4 ranks over 1 (a
  full checkpoint each). Target <= 1.1: the job writes the state once, not once per rank.
- ``stall_ratio_4dp_vs_1dp``: the median per-rank ``save()`` stall with synchronous staging
  (``overlap="off"``: the copy is inside ``save()``, where replication shows), 4 ranks over 1.
  Target <= 0.5: each rank copies about a quarter. ``replica_check_s``, the sampled-digest check
  every rank runs inside ``save()``, is part of that stall and printed beside it.

DCP ``async_save`` runs beside it on the same state: 4 gloo processes with the identical state
(its planner deduplicates replicated tensors across ranks), bytes on disk and the per-rank time
``async_save()`` takes to return, 4 ranks over 1.

The ranks run in one process and save one after another, so each stall is its own copy, as
on separate GPUs; the 4-rank phase holds 4 copies of the state in memory.
"""

from __future__ import annotations

import copy
import math
import os
import time
from pathlib import Path
from typing import Any

from tests.bench.common import Options, Phases, Row, SidecarProcess, median, median_ci

GiB = 1 << 30
WIDTH = 1024  # one Linear layer: 4 MiB of fp32 weights, 12 MiB with Adam's two moments
RANKS = 4


def _state(size_bytes: int, seed: int = 0) -> dict[str, Any]:
    """A model with Adam state after one step, ``size_bytes`` in all (parameters + 2 moments)."""
    import torch
    from torch import nn

    layers = max(2, round(size_bytes / (3 * 4 * WIDTH * (WIDTH + 1))))
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, WIDTH)).square().mean().backward()
    opt.step()
    return {"model": model, "opt": opt}


def _bump(state: dict[str, Any]) -> None:
    """Change every parameter a little, identically on every replica (a training step's effect)."""
    import torch

    with torch.no_grad():
        for p in state["model"].parameters():
            p.mul_(0.999)


def _written(storage_dir: Path, job: str, step: int) -> int:
    from sidecar import manifest as mf
    from sidecar.store import open_store

    store = open_store(f"file://{storage_dir}")
    commit = mf.read_commit(store, "default", job, step)
    return sum(o.size for r in range(commit.world_size) for o in mf.load_manifest(store, commit, r).objects)


def _strata(opts: Options, size_bytes: int, saves: int, figures: dict[str, Any]) -> None:
    from trainer_client import CheckpointClient

    storage = opts.tmp / "store"
    socket = str(opts.tmp / "replicas.sock")
    sidecar = SidecarProcess(
        f"file://{storage}", socket, shm_dir="/dev/shm", policy="full", keep=2, max_held_snapshots=2
    ).start()
    try:
        for world in (1, RANKS):
            job = f"dp{world}"
            base = _state(size_bytes)
            states = [base] + [copy.deepcopy(base) for _ in range(world - 1)]
            clients = [
                CheckpointClient(
                    job=job,
                    socket=socket,
                    rank=r,
                    world_size=world,
                    generation=f"{job}/0",
                    overlap="off",
                    resume="never",
                    when_busy="wait",
                    capture_rng=False,
                    connect_timeout_s=60.0,
                )
                for r in range(world)
            ]
            try:
                for client, state in zip(clients, states, strict=True):
                    if world > 1:
                        client.replicate(state["model"], group=list(range(world)))
                    client.resume(state)  # learns the state: staging pre-faulted off the clock
                stalls: list[float] = []
                checks: list[float] = []
                for step in range(saves + 1):
                    for state in states:
                        _bump(state)
                    handles = [c.save(step, s) for c, s in zip(clients, states, strict=True)]
                    for h in handles:
                        h.durable.result(600)
                    if step:  # the first one is warm-up
                        stalls += [h.stall_s for h in handles]
                        checks += [c.stats["last_replica_check_s"] for c in clients]
                figures[f"bytes_written_{world}dp"] = _written(storage, job, saves)
                figures[f"save_stall_{world}dp_s"] = median(stalls)
                lo, hi = median_ci(stalls)
                figures[f"save_stall_{world}dp_ci_low_s"], figures[f"save_stall_{world}dp_ci_high_s"] = lo, hi
                if world > 1:
                    figures["replica_check_s"] = median(checks)
            finally:
                for c in clients:
                    c.close()
    finally:
        sidecar.stop()
    figures["bytes_written_ratio_4dp_vs_1dp"] = figures["bytes_written_4dp"] / figures["bytes_written_1dp"]
    figures["stall_ratio_4dp_vs_1dp"] = figures["save_stall_4dp_s"] / figures["save_stall_1dp_s"]
    # the interval of the ratio, from the two medians' intervals (conservative)
    figures["stall_ratio_4dp_vs_1dp_ci_high"] = (
        figures["save_stall_4dp_ci_high_s"] / figures["save_stall_1dp_ci_low_s"]
    )


def _dcp_rank(
    rank: int, world: int, size_bytes: int, directory: str, init: str, saves: int, out: Any
) -> None:
    """One DCP rank (spawned): the same state on every rank, async_save timed ``saves`` times."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        state = _state(size_bytes)
        stalls = []
        for i in range(saves + 1):
            _bump(state)
            sd = {"model": state["model"].state_dict(), "opt": state["opt"].state_dict()}
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(f"{directory}/{i}", overwrite=True))
            t1 = time.perf_counter()
            fut.result()
            if i:
                stalls.append(t1 - t0)
        out.put((rank, stalls))
    finally:
        dist.destroy_process_group()


def _dcp(opts: Options, size_bytes: int, saves: int, figures: dict[str, Any]) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    for world in (1, RANKS):
        directory = opts.tmp / f"dcp{world}"
        directory.mkdir()
        queue = ctx.Queue()
        init = f"file://{opts.tmp}/dcp{world}.init"
        procs = [
            ctx.Process(target=_dcp_rank, args=(r, world, size_bytes, str(directory), init, saves, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        stalls: list[float] = []
        for _ in procs:
            stalls += queue.get(timeout=1800)[1]
        for p in procs:
            p.join(60)
        last = directory / str(saves)
        figures[f"dcp_bytes_written_{world}dp"] = sum(
            f.stat().st_size for f in last.rglob("*") if f.is_file()
        )
        figures[f"dcp_async_save_stall_{world}dp_s"] = median(stalls)
    figures["dcp_bytes_written_ratio_4dp_vs_1dp"] = (
        figures["dcp_bytes_written_4dp"] / figures["dcp_bytes_written_1dp"]
    )
    figures["dcp_stall_ratio_4dp_vs_1dp"] = (
        figures["dcp_async_save_stall_4dp_s"] / figures["dcp_async_save_stall_1dp_s"]
    )


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    size_bytes = int(opts.size_gib * GiB)
    saves = 3 if opts.quick else 12
    figures["replicas_state_bytes"] = size_bytes
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with phases("strata 1 vs 4 ranks"):
        _strata(opts, size_bytes, saves, figures)
    with phases("dcp 1 vs 4 ranks"):
        _dcp(opts, size_bytes, max(2, saves // 4), figures)
    return _rows(figures)


def _rows(f: dict[str, Any]) -> list[Row]:
    def get(key: str) -> float | None:
        v = f.get(key)
        return float(v) if isinstance(v, int | float) and math.isfinite(v) else None

    bytes_ratio, stall_ratio = get("bytes_written_ratio_4dp_vs_1dp"), get("stall_ratio_4dp_vs_1dp")
    return [
        Row("state (per rank)", (get("replicas_state_bytes") or 0) / GiB, "GiB"),
        Row("bytes_written_1dp", (get("bytes_written_1dp") or 0) / GiB, "GiB"),
        Row("bytes_written_4dp", (get("bytes_written_4dp") or 0) / GiB, "GiB"),
        Row(
            "bytes_written_ratio_4dp_vs_1dp",
            bytes_ratio,
            "x",
            target="<= 1.1",
            passed=None if bytes_ratio is None else bytes_ratio <= 1.1,
        ),
        Row("save_stall_1dp_s (overlap off)", get("save_stall_1dp_s"), "s"),
        Row("save_stall_4dp_s (per rank)", get("save_stall_4dp_s"), "s"),
        Row("replica_check_s (inside the 4dp stall)", get("replica_check_s"), "s"),
        Row(
            "stall_ratio_4dp_vs_1dp",
            stall_ratio,
            "x",
            target="<= 0.5",
            passed=None if stall_ratio is None else stall_ratio <= 0.5,
        ),
        Row("stall_ratio_4dp_vs_1dp_ci_high", get("stall_ratio_4dp_vs_1dp_ci_high"), "x"),
        Row("dcp_bytes_written_ratio_4dp_vs_1dp", get("dcp_bytes_written_ratio_4dp_vs_1dp"), "x"),
        Row("dcp_async_save_stall_1dp_s", get("dcp_async_save_stall_1dp_s"), "s"),
        Row("dcp_async_save_stall_4dp_s", get("dcp_async_save_stall_4dp_s"), "s"),
        Row("dcp_stall_ratio_4dp_vs_1dp", get("dcp_stall_ratio_4dp_vs_1dp"), "x"),
    ]
