"""The quality benchmark's failure mix: the counts the README states, drawn per seed in a fixed
order, and the bits ``auto`` picks for it equal to what the sidecar's defaults give under the
exact restore class (only storage restores are lossy)."""

from __future__ import annotations

from collections import Counter

from sidecar.config import SidecarSettings
from tests.bench.quality import (
    EXACT_SOURCES,
    FAILURE_MIX,
    FAILURES,
    auto_mix_plan,
    auto_plan,
    failure_sources,
)


def test_failure_mix_counts_and_sources() -> None:
    counts = dict(FAILURE_MIX)
    assert sum(counts.values()) == FAILURES == 20
    assert counts == {"memory": 4, "peer": 15, "storage": 1}
    assert set(EXACT_SOURCES) == {"memory", "peer"}
    for seed in range(6):
        sources = failure_sources(seed)
        assert Counter(sources) == counts
        assert sources == failure_sources(seed)  # paired: every run of a seed sees the same order
    # which failure reads storage is drawn per seed
    assert len({failure_sources(seed).index("storage") for seed in range(6)}) > 1


def test_auto_mix_bits_follow_the_sidecar_defaults() -> None:
    planned_storage, bits = auto_mix_plan()
    # the sidecar's documented default is the mix's storage restores per run
    assert planned_storage == SidecarSettings().expected_storage_restores == dict(FAILURE_MIX)["storage"]
    assert bits == 4  # --restore-bits 1:4
    _, stored_bits, _ = auto_plan()
    assert stored_bits == 8  # every one of 20 restores lossy: 8 bits
