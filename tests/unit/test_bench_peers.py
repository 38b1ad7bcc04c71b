"""The peers section's verdicts: its bit-for-bit check catches one flipped bit (and tells NaNs and
signed zeros apart by their bits), a missing tensor counts, a missing package is a reason to skip,
and the memory figure is a peak over the baseline inside its window only."""

from __future__ import annotations

import torch

from tests.bench import peers


def test_one_flipped_bit_is_a_mismatch() -> None:
    state = {"model": {"w": torch.randn(64, 8), "b": torch.zeros(3)}, "optim": {"state": {}}}
    reference = {k: v.clone() for k, v in peers._tensors(state)}
    assert peers._mismatches(reference, state) == 0
    state["model"]["w"].view(-1).view(torch.int32)[17] ^= 1  # the last bit of one float
    assert peers._mismatches(reference, state) == 1
    del state["model"]["b"]
    assert peers._mismatches(reference, state) == 2


def test_bits_not_values_are_compared() -> None:
    nan = torch.tensor([float("nan"), 0.0])
    assert peers._same_bits(nan, nan.clone())  # NaN == NaN by bits
    assert not peers._same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal values, other bits
    assert not peers._same_bits(torch.zeros(2), torch.zeros(2, dtype=torch.float64))


def test_a_missing_peer_is_a_skip_reason() -> None:
    peers.PACKAGES["nonexistent_peer"] = "strata_no_such_package_xyz"
    try:
        assert "make bench-peers-deps" in (peers.missing("nonexistent_peer") or "")
    finally:
        del peers.PACKAGES["nonexistent_peer"]
    assert peers.missing("torch_save") is None  # no package of its own


def test_peak_extra_is_taken_inside_the_window() -> None:
    sampler = peers.TreeSampler(pid=0)
    sampler.samples = [(0.0, 900), (1.0, 100), (2.0, 400), (3.0, 250), (4.0, 5000)]
    assert sampler.peak_extra(1.5, 3.0) == 300  # the baseline is the last sample before the window
    assert sampler.peak_extra(10.0, 11.0) != sampler.peak_extra(10.0, 11.0)  # no samples: NaN
