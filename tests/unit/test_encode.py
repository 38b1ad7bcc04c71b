"""Check-N-Run encodings: changed rows found exactly (by bytes), every encoding round-trips
(bitwise when lossless, within the bound when lossy), sizes priced without encoding match
what encoding writes, and the intermittent rule behaves as derived."""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.pipeline import encode as enc
from sidecar.pipeline import quantize as qz
from sidecar.pipeline.policy import check_policy, start_new_full
from sidecar.pipeline.settings import Quantization, parse_table, quantization


def view(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a)).cast("B")


def rows_changed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    shape = list(a.shape)
    return enc.changed_rows(enc.as_rows(view(b), shape), enc.as_rows(view(a), shape))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.uint8])
def test_changed_rows_are_exactly_the_rows_whose_bytes_differ(dtype):
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((5000, 12)) * 50).astype(dtype)
    b = a.copy()
    picked = rng.choice(5000, 321, replace=False)
    b[picked, rng.integers(0, 12, 321)] += np.array(1, dtype=dtype)
    assert sorted(np.flatnonzero(rows_changed(a, b))) == sorted(picked)


def test_nan_and_negative_zero_compare_as_bytes():
    a = np.zeros((4, 8), np.float32)
    a[1, 0] = np.nan
    b = a.copy()
    b[2, 3] = -0.0  # == 0.0 as a float, different bytes
    c = b.copy()
    c[1, 0] = np.float32(np.nan)  # the same NaN bits: unchanged
    assert list(np.flatnonzero(rows_changed(a, b))) == [2]
    assert list(np.flatnonzero(rows_changed(b, c))) == []
    d = b.copy()
    d.view(np.uint32)[1, 0] ^= 1  # another NaN payload: changed
    assert list(np.flatnonzero(rows_changed(b, d))) == [1]


def roundtrip(base: np.ndarray, new: np.ndarray, mask, bits=0, cast="", dtype="float32"):
    shape = list(new.shape)
    e = enc.encode(view(new), dtype, shape, mask=mask, bits=bits, cast=cast)
    payload = b"".join(bytes(p) for p in e.pieces)
    assert (
        len(payload)
        == e.nbytes
        == enc.encoded_bytes(e.encoding, shape, new.itemsize, max(e.changed, 0), bits)
    )
    out = bytearray(base.tobytes())
    enc.decode_into(memoryview(out), payload, e.encoding, dtype, shape, e.cast)
    return e, np.frombuffer(out, new.dtype).reshape(new.shape)


def test_lossless_encodings_restore_bitwise():
    rng = np.random.default_rng(2)
    base = rng.standard_normal((3000, 16)).astype(np.float32)
    new = base.copy()
    new[::7] *= 3
    new[5, 5] = -0.0
    mask = rows_changed(base, new)
    e, out = roundtrip(base, new, None)
    assert e.encoding == "raw" and out.tobytes() == new.tobytes()
    e, out = roundtrip(base, new, mask)
    assert e.encoding == "rows-diff" and e.changed == int(mask.sum()) and out.tobytes() == new.tobytes()
    # An empty diff is a bitmap and nothing else.
    e, out = roundtrip(new, new, rows_changed(new, new))
    assert e.changed == 0 and e.nbytes == enc.bitmap_bytes(3000) and out.tobytes() == new.tobytes()


@pytest.mark.parametrize(("bits", "bound"), [(8, 0.01), (4, 0.1), (3, 0.2), (2, 0.45)])
def test_quantized_encodings_stay_within_their_error_bound(bits, bound):
    rng = np.random.default_rng(bits)
    base = rng.standard_normal((2000, 32)).astype(np.float32)
    new = base.copy()
    new[::3] += 1.0
    mask = rows_changed(base, new)
    e, out = roundtrip(base, new, None, bits=bits)
    assert e.encoding == "quantized" and e.bits == bits
    assert e.error == pytest.approx(qz.relative_l2_error(new, out), rel=1e-6) and e.error < bound
    e, out = roundtrip(base, new, mask, bits=bits)
    assert e.encoding == "rows-diff-quantized"
    # Unchanged rows are the base's, untouched; changed rows carry the quantization error.
    assert out[~mask].tobytes() == base[~mask].tobytes()
    assert e.error == pytest.approx(qz.relative_l2_error(new[mask], out[mask]), rel=1e-6) and e.error < bound


@pytest.mark.parametrize("cast", ["float16", "bfloat16"])
def test_downcasts_round_trip_within_the_dtype_precision(cast):
    rng = np.random.default_rng(3)
    new = rng.standard_normal((500, 8)).astype(np.float32)
    e, out = roundtrip(np.zeros_like(new), new, None, cast=cast)
    assert e.encoding == "cast" and e.cast == cast
    assert np.abs(out - new).max() <= np.abs(new).max() * (2**-8 if cast == "bfloat16" else 2**-11)
    mask = np.zeros(500, bool)
    mask[::5] = True
    e, out = roundtrip(np.zeros_like(new), new, mask, cast=cast)
    assert e.encoding == "rows-diff-cast" and (out[~mask] == 0).all()


def test_bfloat16_tensors_quantize_and_come_back_as_bfloat16_bits():
    rng = np.random.default_rng(4)
    values = rng.standard_normal((256, 16)).astype(np.float32)
    bits16 = qz.f32_to_bf16(values)
    e, out = roundtrip(np.zeros_like(bits16), bits16, None, bits=8, dtype="bfloat16")
    assert e.encoding == "quantized"
    restored = qz.bf16_to_f32(out)
    assert out.dtype == np.uint16 and qz.relative_l2_error(qz.bf16_to_f32(bits16), restored) < 0.01


def test_what_cannot_be_quantized_is_refused_naming_it():
    with pytest.raises(ValueError, match="cannot be quantized"):
        enc.encode(view(np.zeros((4, 4), np.int32)), "int32", [4, 4], bits=4)
    bad = np.ones((4, 4), np.float32)
    bad[2, 1] = np.inf
    with pytest.raises(ValueError, match="row 2"):
        enc.encode(view(bad), "float32", [4, 4], bits=4)


def test_a_payload_that_does_not_fit_is_refused():
    out = bytearray(64 * 4)
    with pytest.raises(ValueError, match="bitmap marks"):
        q = qz.quantize_rows(np.ones((3, 4), np.float32), 4).to_bytes()
        bitmap = np.packbits(np.array([1, 1] + [0] * 14, bool), bitorder="little").tobytes()
        enc.decode_into(memoryview(out), bitmap + q, "rows-diff-quantized", "float32", [16, 4])
    with pytest.raises(ValueError, match="raw payload"):
        enc.decode_into(memoryview(out), b"x" * 10, "raw", "float32", [16, 4])


# --- policy ---------------------------------------------------------------------------------------


def test_intermittent_rule_on_synthetic_histories():
    # Diffs far below the average cost of the cycle: keep going.
    assert not start_new_full([0.1])
    assert not start_new_full([0.1, 0.2, 0.3])
    # i * S_i >= 1 + sum(S_<i): with S = .25, .44, .58: 3 * .58 = 1.74 >= 1.69 -> new full.
    assert not start_new_full([0.25, 0.44])
    assert start_new_full([0.25, 0.44, 0.58])
    # A diff as large as the full checkpoint is never worth it.
    assert start_new_full([1.0])
    assert not start_new_full([])


def test_the_rule_minimises_the_average_cost_per_interval():
    """Brute force: for growing one-shot diffs, the rule's first trigger is where the cycle's
    average cost stops falling."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        sizes = np.cumsum(rng.uniform(0.0, 0.3, 30)).clip(max=1.0)
        averages = [(1 + sizes[:i].sum()) / (i + 1) for i in range(len(sizes) + 1)]
        best = int(np.argmin(averages))  # diffs in the cheapest cycle
        trigger = next(
            (i for i in range(1, len(sizes) + 1) if start_new_full(list(sizes[:i]))), len(sizes) + 1
        )
        assert trigger - 1 == best or np.isclose(averages[trigger - 1], averages[best])


def test_bad_settings_name_the_setting():
    with pytest.raises(ValueError, match="'sometimes' is not one of"):
        check_policy("sometimes")
    with pytest.raises(ValueError, match="--restore-bits entry '3:5'"):
        parse_table("1:2,3:5")

    class S:
        quantize, quantize_match, expected_restores, restore_bits = "5", "", 3, "1:2"

    with pytest.raises(ValueError, match="--quantize '5' is not one of"):
        quantization(S())


def test_bit_width_follows_expected_restores_and_escalates():
    table = parse_table("1:2,3:3,20:4")
    q = Quantization("auto", (), 3, table)
    assert q.bits(0) == 3 and q.bits(3) == 3 and q.bits(4) == 8
    assert Quantization("auto", (), 1, table).bits(0) == 2
    assert Quantization("auto", (), 50, table).bits(0) == 8
    assert Quantization("4", (), 0, table).bits(100) == 4
    assert Quantization("bfloat16", (), 0, table).cast == "bfloat16"
    default = Quantization("auto", (), 3, table)
    assert default.matches("model.tables.0.weight", "embedding") and not default.matches(
        "model.fc.weight", ""
    )
    globbed = Quantization("4", ("model.tables.*",), 3, table)
    assert globbed.matches("model.tables.1.weight", "") and not globbed.matches("optim.state", "embedding")
