"""The peers section's verdicts: its bit-for-bit check catches one flipped bit (and tells NaNs and
signed zeros apart by their bits), a missing tensor counts, a missing package is a reason to skip,
and the memory figure is a peak over the baseline inside its window only."""

from __future__ import annotations

import pytest
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


def test_saves_cpu_charges_the_spans_less_the_quiet_steps_mean() -> None:
    from tests.bench.foundation import saves_cpu_s

    # 2 quiet, then save 1's span (3 steps), 2 quiet, save 2's span (2 steps), 2 quiet
    per_step = [1.0, 1.2, 2.0, 3.0, 1.5, 0.9, 1.1, 4.0, 1.0, 0.8, 1.0]
    added, step = saves_cpu_s(per_step, [3, 2], quiet=2)
    assert step == pytest.approx(6.0 / 6)  # the mean of the six quiet steps
    assert added == pytest.approx((2.0 + 3.0 + 1.5 + 4.0 + 1.0) - 5 * 1.0)
    with pytest.raises(ValueError):
        saves_cpu_s(per_step[:-1], [3, 2], quiet=2)  # a step missing: the layout does not fit


def test_dense_state_has_the_sparse_states_bytes() -> None:
    from tests.bench import foundation as f

    size = f.GiB // 64
    trainer = f.make_trainer("dense", size / f.GiB)
    trainer.step()  # AdamW's moments exist from the first step
    total = sum(t.numel() * t.element_size() for t in f.state_tensors(trainer))
    assert abs(total - size) / size < 0.01
    before = [p.detach().clone() for p in trainer.model.parameters()]
    moments = [s["exp_avg_sq"].clone() for s in trainer.opt.state.values()]
    trainer.step()
    # every parameter and second moment changes every step (a few elements may round to the same)
    params = trainer.model.parameters()
    assert all((a != p).float().mean() > 0.99 for a, p in zip(before, params, strict=True))
    assert all(
        (a != s["exp_avg_sq"]).float().mean() > 0.99
        for a, s in zip(moments, trainer.opt.state.values(), strict=True)
    )
