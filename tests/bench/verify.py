"""Bench section ``verify``: what checking a memory restore's bytes costs the client.

A memory restore copies the snapshot out of a shared segment (a file in /dev/shm, mapped and
populated) into the state's tensors, and checks every tensor against the digest in the restore
header while it copies (``trainer_client._verify``). Measured side by side, in rotating order
within each repetition, on the same source and destination bytes:

- ``memcpy``: one plain copy of the whole span (torch's copy, every intra-op thread);
- ``unverified``: the client's copy with no digests (what a header without digests gets);
- ``verified``: the client's checked copy.

``restore_memory_verify_overhead_ratio`` = (verified - unverified) / memcpy, the median over
repetitions of the per-repetition ratio, with a 95% confidence interval for that median (target
<= 0.1). The layout is a model's: a quarter of the bytes in one embedding table, the rest in 48
weight matrices, plus 96 small vectors (biases, norms).
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Any

from tests.bench.common import MiB, Options, Phases, Row, median, median_ci

TARGET = 0.1


def _layout(total: int) -> list[int]:
    big = total // 4
    small = [4096] * 96
    rest = total - big - sum(small)
    mats = [rest // 48 // 64 * 64] * 48
    return [big, *mats, *small]


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    import numpy as np
    import torch
    import xxhash

    from trainer_client import _verify

    total = max(64 * MiB, int(opts.size_gib * 2**30) // MiB * MiB)
    sizes = _layout(total)
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += n + (-n % 64)
    span = at
    path = f"/dev/shm/strata-bench-verify-{os.getpid()}"
    repeats = 5 if opts.quick else 15
    with phases("staging the segment"):
        with open(path, "wb") as f:
            f.truncate(span)
        fd = os.open(path, os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, span, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
            os.unlink(path)  # the mapping keeps it
        source = np.frombuffer(mapped, np.uint8)
        rng = np.random.default_rng(0)
        for at in range(0, span, 64 * MiB):
            piece = source[at : at + 64 * MiB]
            piece[:] = rng.integers(0, 256, piece.size, dtype=np.uint8)
        # The same destination for all three: the tensors are views of one buffer laid out as the
        # segment is, faulted in (as live tensors are).
        flat = np.ones(span, np.uint8)
        dst = [flat[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
        digests = [xxhash.xxh3_64_hexdigest(source[o : o + n]) for o, n in zip(offsets, sizes, strict=True)]
        checked = [
            _verify.Target(o, d, h, f"t{i}")
            for i, (o, d, h) in enumerate(zip(offsets, dst, digests, strict=True))
        ]
        unchecked = [
            _verify.Target(o, d, "", f"t{i}") for i, (o, d) in enumerate(zip(offsets, dst, strict=True))
        ]

    def memcpy() -> None:
        torch.from_numpy(flat).copy_(torch.from_numpy(source))

    def unverified() -> None:
        _verify.copy_checked(source, unchecked)

    def verified() -> None:
        if _verify.copy_checked(source, checked) is not None:
            raise AssertionError("the bench's own bytes failed their digest")

    runs = {"memcpy": memcpy, "unverified": unverified, "verified": verified}
    times: dict[str, list[float]] = {k: [] for k in runs}
    with phases(f"{repeats} repetitions of memcpy, unverified and verified copies of {span / MiB:.0f} MiB"):
        for fn in runs.values():  # warm up: threads, caches
            fn()
        order = list(runs)
        for r in range(repeats):
            for name in order[r % 3 :] + order[: r % 3]:
                t0 = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t0)
    # the mapping (its file already unlinked) goes with this frame
    ratios = [
        (v - u) / m for v, u, m in zip(times["verified"], times["unverified"], times["memcpy"], strict=True)
    ]
    lo, hi = median_ci(ratios)
    figures["restore_memory_verify_overhead_ratio"] = median(ratios)
    figures["restore_memory_verify_overhead_ratio_ci_low"] = lo
    figures["restore_memory_verify_overhead_ratio_ci_high"] = hi
    figures["restore_memory_verify_bytes"] = span
    figures["restore_memory_verify_threads"] = torch.get_num_threads()
    for name, values in times.items():
        low, high = median_ci(values)
        figures[f"restore_memory_{name}_s"] = median(values)
        print(
            f"  {name:>10}: median {median(values) * 1e3:.1f} ms (95% CI {low * 1e3:.1f}-{high * 1e3:.1f}), "
            f"{span / median(values) / 2**30:.1f} GiB/s",
            flush=True,
        )
    print(f"  overhead ratio: median {median(ratios):.3f} (95% CI {lo:.3f} to {hi:.3f}) over {repeats} runs")
    return _rows(figures)


def _rows(f: dict[str, Any]) -> list[Row]:
    ratio = f.get("restore_memory_verify_overhead_ratio")
    memcpy = f.get("restore_memory_memcpy_s")
    rows = [
        Row(
            "restore_memory_verify_overhead_ratio",
            ratio,
            "x memcpy",
            None,
            "",
            f"<= {TARGET}",
            None if ratio is None else ratio <= TARGET,
        ),
        Row(
            "restore_memory_verify_overhead_ratio_ci_low",
            f.get("restore_memory_verify_overhead_ratio_ci_low"),
            "",
        ),
        Row(
            "restore_memory_verify_overhead_ratio_ci_high",
            f.get("restore_memory_verify_overhead_ratio_ci_high"),
            "",
        ),
    ]
    for name in ("memcpy", "unverified", "verified"):
        value = f.get(f"restore_memory_{name}_s")
        rows.append(
            Row(
                f"restore_memory_{name}_s",
                value,
                "s",
                None if value is None or not memcpy else value / memcpy,
                "memcpy" if value is not None and memcpy else "",
            )
        )
    return rows
