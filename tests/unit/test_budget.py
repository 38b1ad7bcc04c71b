"""The sidecar's memory budget: reservations, refusals that say why, the cgroup limit."""

from __future__ import annotations

import gc
import math
from pathlib import Path

import numpy as np
import pytest

from sidecar.budget import MemoryBudget, cgroup_memory_limit
from sidecar.errors import ResourceExhausted
from sidecar.pipeline import quantize as qz


def test_reserve_release_and_refusal_names_what_is_held() -> None:
    seen: list[dict[str, int]] = []
    budget = MemoryBudget(1000, "--memory-budget", on_change=lambda b: seen.append(b.held()))
    a = budget.reserve("snapshot", 600, "save of step 1")
    assert budget.used == 600 and seen[-1]["snapshot"] == 600
    with pytest.raises(
        ResourceExhausted, match=r"save of step 2 needs 500 B.*600 B of its 1000 B budget.*snapshot 600 B"
    ):
        budget.reserve("snapshot", 500, "save of step 2")
    assert budget.refused == 1 and budget.used == 600  # a refusal holds nothing
    a.release()
    a.release()  # idempotent
    assert budget.used == 0
    b = budget.reserve("restore", 1000, "restore")
    assert budget.peak == 1000
    b.shrink(100)
    assert budget.used == 100
    del b
    gc.collect()
    assert budget.used == 0  # a dropped reservation gives its bytes back
    with pytest.raises(ValueError, match="unknown memory kind"):
        budget.reserve("cache", 1, "x")


def test_cgroup_limit_v2_nested_then_parent_then_v1(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    leaf = root / "kubepods" / "pod1" / "ctr"
    leaf.mkdir(parents=True)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    (leaf / "memory.max").write_text("max\n")
    (root / "kubepods" / "pod1" / "memory.max").write_text(f"{4 << 30}\n")
    assert cgroup_memory_limit(str(root), str(proc)) == 4 << 30  # the container is unlimited, its pod is not
    (leaf / "memory.max").write_text(f"{2 << 30}\n")
    assert cgroup_memory_limit(str(root), str(proc)) == 2 << 30
    for f in root.rglob("memory.max"):
        f.unlink()
    assert cgroup_memory_limit(str(root), str(proc)) is None
    (root / "memory").mkdir()
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{1 << 30}\n")
    assert cgroup_memory_limit(str(root), str(proc)) == 1 << 30
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "none"
    assert cgroup_memory_limit(str(root), str(proc)) is None


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 40_001])
def test_blockwise_error_matches_the_full_computation(bits: int, rows: int) -> None:
    values = np.random.default_rng(rows + bits).standard_normal((rows, 33), dtype=np.float32)
    q = qz.quantize_rows(values, bits)
    full = qz.dequantize_rows(q)
    want = float(np.linalg.norm((values.astype(np.float64) - full).ravel()) / np.linalg.norm(values.ravel()))
    assert qz.quantization_error(values, q) == pytest.approx(want, rel=1e-5)
    assert q.rel_error == pytest.approx(want, rel=1e-5)  # measured while encoding, no second pass
    assert math.isnan(qz.QuantizedRows.from_bytes(q.to_bytes()).rel_error)
    assert qz.relative_l2_error(values, full) == pytest.approx(want, rel=1e-5)
    assert np.array_equal(qz.dequantize_block(q, 8, 16) if rows > 8 else full[8:16], full[8:16])
