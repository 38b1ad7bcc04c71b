"""Bench section ``dcp``: torch.distributed.checkpoint through Strata against DCP's own writer.

Sharded state: an MLP of ``WIDTH``-wide Linear layers under FSDP2 (``fully_shard`` over a CPU mesh)
on ``RANKS`` gloo processes, with Adam's state after one step; ``--size-gib / 4`` in all (parameters
plus both moments, 256 MiB at the default size). One sidecar in its own process serves the ranks,
writing to a local directory; DCP's writer writes to another one on the same disk.

Side by side in one run, alternating save by save (which one goes first alternates too):

- ``dcp.async_save(..., storage_writer=StrataWriter(client))``: the writer is the stager, staging
  once, into the client's shared-memory segments (reused across saves), which the save sends from;
- ``dcp.async_save(..., storage_writer=FileSystemWriter(dir))``: DCP's default stager.

The stall is the time ``async_save`` holds the training thread (until it returns), per rank and
save, after one warm-up save of each: ``dcp_via_strata_stall_s`` (median, with its 95% interval
``_ci_low_s`` / ``_ci_high_s``) against ``dcp_filesystem_stall_s`` (same). Target: Strata's upper
bound below DCP's median. Each save's background part (planning, the send to the sidecar, or
DCP's files) finishes before the next save begins.

Resharded restore: the newest step of each (saved by ``RANKS`` ranks) is loaded by one process as a
1-rank FSDP2 job (every shard of every tensor read and assembled by DCP's planner), alternating
StrataReader (from the sidecar's memory) and FileSystemReader (from the page cache, as just
written): ``reshard_restore_s`` against ``dcp_reshard_restore_s`` (medians of ``RESTORES``).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from tests.bench.common import Options, Phases, Row, SidecarProcess, median, median_ci

__all__ = ["Options", "run"]

GiB = 1 << 30
MiB = 1 << 20
WIDTH = 1024  # one Linear layer: 4 MiB of fp32 weights, 12 MiB with Adam's two moments
RANKS = 2
RESTORES = 3


def _model(size_bytes: int, world: int) -> tuple[Any, Any]:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = max(2, round(size_bytes / (3 * 4 * WIDTH * (WIDTH + 1))))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, WIDTH)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _client(socket: str, rank: int, world: int, generation: str) -> Any:
    from trainer_client import CheckpointClient

    return CheckpointClient(
        job="dcpbench",
        socket=socket,
        rank=rank,
        world_size=world,
        generation=generation,
        capture_rng=False,
        resume="auto",
        connect_timeout_s=60.0,
        commit_timeout_s=600.0,
    )


def _save_rank(rank: int, size_bytes: int, socket: str, fs_dir: str, init: str, saves: int, out: Any) -> None:
    """One saving rank (spawned): ``saves`` + 1 async saves of each kind, alternating."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainer_client.dcp import StrataWriter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
    client = _client(socket, rank, RANKS, "save/0")
    try:
        model, opt = _model(size_bytes, RANKS)
        group = dist.new_group(backend="gloo")  # DCP's background collectives beside training's
        writer = StrataWriter(client)
        stalls: dict[str, list[float]] = {"strata": [], "fs": []}
        stage_s: list[float] = []
        for i in range(saves + 1):
            order = ("strata", "fs") if i % 2 == 0 else ("fs", "strata")
            for kind in order:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.999)
                msd, osd = get_state_dict(model, opt)
                state = {"model": msd, "optim": osd}
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "strata":
                    future = dcp.async_save(
                        state, storage_writer=writer, checkpoint_id=i + 1, process_group=group
                    )
                else:
                    future = dcp.async_save(
                        state,
                        storage_writer=dcp.FileSystemWriter(f"{fs_dir}/{i}", overwrite=True),
                        process_group=group,
                    )
                stall = time.perf_counter() - t0
                future.result()
                if i:
                    stalls[kind].append(stall)
                    if kind == "strata":
                        stage_s.append(writer.last_stage_s)
        out.put(("save", rank, stalls, stage_s))
    finally:
        client.close()
        dist.destroy_process_group()


def _restore_rank(size_bytes: int, socket: str, fs_dir: str, step: int, init: str, out: Any) -> None:
    """One process, a 1-rank job: load the newest step of each, alternating, ``RESTORES`` times."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainer_client.dcp import StrataReader

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    client = _client(socket, 0, 1, "load/0")
    try:
        model, opt = _model(size_bytes, 1)
        times: dict[str, list[float]] = {"strata": [], "fs": []}
        for i in range(RESTORES):
            for kind in ("strata", "fs") if i % 2 == 0 else ("fs", "strata"):
                msd, osd = get_state_dict(model, opt)
                state = {"model": msd, "optim": osd}
                t0 = time.perf_counter()
                if kind == "strata":
                    dcp.load(state, storage_reader=StrataReader(client, step=step))
                else:
                    dcp.load(state, storage_reader=dcp.FileSystemReader(fs_dir))
                times[kind].append(time.perf_counter() - t0)
        out.put(("restore", 0, times, []))
    finally:
        client.close()
        dist.destroy_process_group()


def _spawn(ctx: Any, targets: list[tuple[Any, tuple[Any, ...]]], queue: Any) -> list[tuple[Any, ...]]:
    procs = [ctx.Process(target=t, args=a) for t, a in targets]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=900) for _ in procs]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return results


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    import multiprocessing as mp

    size_bytes = int(min(opts.size_gib, 4.0) * GiB / 4)
    saves = 3 if opts.quick else 10
    figures["dcp_state_bytes"] = size_bytes
    figures["dcp_ranks"] = RANKS
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    socket = str(opts.tmp / "dcp.sock")
    fs_dir = opts.tmp / "fs"
    fs_dir.mkdir()
    sidecar = SidecarProcess(
        f"file://{opts.tmp / 'store'}", socket, shm_dir="/dev/shm", keep=2, max_held_snapshots=2
    ).start()
    try:
        with phases(f"async_save on {RANKS} ranks, strata vs filesystem"):
            queue = ctx.Queue()
            results = _spawn(
                ctx,
                [
                    (
                        _save_rank,
                        (r, size_bytes, socket, str(fs_dir), f"file://{opts.tmp}/save.init", saves, queue),
                    )
                    for r in range(RANKS)
                ],
                queue,
            )
        stalls: dict[str, list[float]] = {"strata": [], "fs": []}
        stage: list[float] = []
        for _, _, per_kind, stage_s in results:
            for kind, values in per_kind.items():
                stalls[kind] += values
            stage += stage_s
        for kind, key in (("strata", "dcp_via_strata_stall"), ("fs", "dcp_filesystem_stall")):
            figures[f"{key}_s"] = median(stalls[kind])
            figures[f"{key}_ci_low_s"], figures[f"{key}_ci_high_s"] = median_ci(stalls[kind])
            figures[f"{key}_n"] = len(stalls[kind])
        figures["dcp_via_strata_stage_s"] = median(stage)
        with phases(f"restore on 1 rank of {RANKS}"):
            queue = ctx.Queue()
            [(_, _, times, _)] = _spawn(
                ctx,
                [
                    (
                        _restore_rank,
                        (
                            size_bytes,
                            socket,
                            str(fs_dir / str(saves)),
                            saves + 1,
                            f"file://{opts.tmp}/load.init",
                            queue,
                        ),
                    )
                ],
                queue,
            )
        figures["reshard_restore_s"] = median(times["strata"])
        figures["dcp_reshard_restore_s"] = median(times["fs"])
    finally:
        sidecar.stop()
    return _rows(figures)


def _rows(f: dict[str, Any]) -> list[Row]:
    def get(key: str) -> float | None:
        v = f.get(key)
        return float(v) if isinstance(v, int | float) and math.isfinite(v) else None

    strata, strata_hi, fs = (
        get("dcp_via_strata_stall_s"),
        get("dcp_via_strata_stall_ci_high_s"),
        get("dcp_filesystem_stall_s"),
    )
    restore, fs_restore = get("reshard_restore_s"), get("dcp_reshard_restore_s")
    return [
        Row(
            f"state ({int(f.get('dcp_ranks') or RANKS)} FSDP2 ranks, in all)",
            (get("dcp_state_bytes") or 0) / MiB,
            "MiB",
        ),
        Row(
            "dcp_via_strata_stall_s (async_save, StrataWriter)",
            strata,
            "s",
            ratio=None if strata is None or not fs else strata / fs,
            ratio_of="filesystem",
        ),
        Row("dcp_via_strata_stall_ci_low_s", get("dcp_via_strata_stall_ci_low_s"), "s"),
        Row(
            "dcp_via_strata_stall_ci_high_s",
            strata_hi,
            "s",
            target="< dcp_filesystem_stall_s",
            passed=None if strata_hi is None or fs is None else strata_hi < fs,
        ),
        Row("dcp_via_strata_stage_s (stage() alone)", get("dcp_via_strata_stage_s"), "s"),
        Row("dcp_filesystem_stall_s (async_save, FileSystemWriter)", fs, "s"),
        Row("dcp_filesystem_stall_ci_low_s", get("dcp_filesystem_stall_ci_low_s"), "s"),
        Row("dcp_filesystem_stall_ci_high_s", get("dcp_filesystem_stall_ci_high_s"), "s"),
        Row(
            f"reshard_restore_s ({RANKS} -> 1 ranks, StrataReader)",
            restore,
            "s",
            ratio=None if restore is None or not fs_restore else restore / fs_restore,
            ratio_of="filesystem",
        ),
        Row(f"dcp_reshard_restore_s ({RANKS} -> 1 ranks, FileSystemReader)", fs_restore, "s"),
    ]
