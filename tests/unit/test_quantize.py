"""Per-row quantization (sidecar/pipeline/quantize.py): the greedy range search
against a per-row reference, a brute force and torch; the codes against torch's
fused rowwise prepack; error bounds, packing, serialization, bf16/fp16 and the
bit width policy. torch is only an oracle here (the sidecar never imports it)."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest

from sidecar.pipeline import quantize as qz

F32 = np.float32
RNG_SEED = 20260512


def _rows(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    """A mix of shapes and magnitudes: normal, uniform, heavy-tailed, offset, few distinct values."""
    kind = rng.integers(0, 5, size=n)
    out = np.empty((n, dim), F32)
    for i, k in enumerate(kind):
        if k == 0:
            row = rng.standard_normal(dim)
        elif k == 1:
            row = rng.uniform(-1, 1, dim)
        elif k == 2:
            row = np.clip(rng.standard_t(2, dim), -50, 50)
        elif k == 3:
            row = 3.0 + 0.01 * rng.standard_normal(dim)
        else:
            row = rng.integers(-2, 3, dim).astype(float)
        out[i] = row * 10.0 ** rng.uniform(-3, 2)  # stays inside the fp16 range
    return out


# --- a straightforward per-row reference of the greedy search ------------------------------------


def _ref_loss(row: np.ndarray, lo: Any, hi: Any, bits: int) -> Any:
    """torch's calculate_quant_loss, one row, float32 scalars, sequential sum (cumsum)."""
    qmax = F32(2**bits - 1)
    m = F32(np.float16(lo))
    span = F32(hi - m)
    scale = F32(1.0) if span == 0 else F32(np.float16(span / qmax))
    inv = F32(1.0) if scale == 0 else F32(1.0) / scale
    q = np.clip(np.rint((row - m) * inv), 0, qmax)
    err = row - (q * scale + m)
    return np.sqrt(np.cumsum(err * err, dtype=F32)[-1])


def _ref_greedy(
    row: np.ndarray, bits: int, n_bins: int = 200, ratio: float = 0.16, keep_best_seen: bool = False
) -> tuple[Any, Any, int]:
    """Returns (xmin, xmax, number of moves made)."""
    xmin, xmax = row.min(), row.max()
    step = (xmax - xmin) / F32(n_bins)
    thr = F32(float(F32(n_bins)) * (1.0 - ratio)) * step
    lo, hi = xmin, xmax
    cur = best = _ref_loss(row, lo, hi, bits)
    moves = 0
    while lo + thr < hi:
        loss1 = _ref_loss(row, lo + step, hi, bits)
        loss2 = _ref_loss(row, lo, hi - step, bits)
        if cur < loss1 and cur < loss2 and cur < best:
            best, xmin, xmax = cur, lo, hi
        if loss1 < loss2:
            lo, cur = lo + step, loss1
        else:
            hi, cur = hi - step, loss2
        if keep_best_seen and cur < best:
            best, xmin, xmax = cur, lo, hi
        moves += 1
    return xmin, xmax, moves


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("keep_best_seen", [False, True])
def test_greedy_equals_per_row_reference(bits: int, keep_best_seen: bool) -> None:
    rng = np.random.default_rng(RNG_SEED + bits)
    for dim in (3, 16, 64):
        rows = _rows(rng, 12, dim)
        lo, hi = qz.greedy_range(rows, bits, keep_best_seen=keep_best_seen)
        for i, row in enumerate(rows):
            ref_lo, ref_hi, _ = _ref_greedy(row, bits, keep_best_seen=keep_best_seen)
            assert (lo[i], hi[i]) == (ref_lo, ref_hi), (dim, i)


def test_greedy_against_brute_force() -> None:
    """Never worse than no trim, never better than the best range reachable within
    the trim budget (same float positions), and close to it; keeping the best
    position seen is never worse than torch's choice."""
    rng = np.random.default_rng(RNG_SEED)
    ratios = []
    trimmed = 0
    for bits in (2, 3, 4):
        for row in rng.standard_normal((10, 24)).astype(F32):
            lo, hi = qz.greedy_range(row[None], bits)
            got = _ref_loss(row, lo[0], hi[0], bits)
            seen_lo, seen_hi = qz.greedy_range(row[None], bits, keep_best_seen=True)
            assert _ref_loss(row, seen_lo[0], seen_hi[0], bits) <= got
            _, _, moves = _ref_greedy(row, bits)
            step = (row.max() - row.min()) / F32(200)
            los, his = [row.min()], [row.max()]
            for _ in range(moves):
                los.append(los[-1] + step)
                his.append(his[-1] - step)
            brute = min(
                _ref_loss(row, los[i], his[j], bits) for i in range(moves + 1) for j in range(moves + 1 - i)
            )
            no_trim = _ref_loss(row, row.min(), row.max(), bits)
            assert brute <= got <= no_trim
            ratios.append(got / brute)
            trimmed += bool(lo[0] > row.min() or hi[0] < row.max())
    assert trimmed >= len(ratios) // 2  # the search does move for normal rows at <= 4 bits
    # Measured: 18 of 30 rows optimal, median 1.0, worst ~1.6 (2 bits, where the
    # error still falls at the end of the budget and the untrimmed range is kept).
    assert float(np.median(ratios)) < 1.01 and max(ratios) < 2.0


def test_greedy_matches_torch_choose_qparams_optimized() -> None:
    """Bit-exact (xmin, xmax) against torch, which returns (xmax, xmin)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(RNG_SEED + 1)
    cases = [(bits, dim, 200, 0.16) for bits in (2, 3, 4, 8) for dim in (1, 5, 32, 64, 100)]
    cases += [(4, 32, 100, 0.5), (2, 16, 50, 0.0), (3, 64, 256, 0.25)]
    for bits, dim, n_bins, ratio in cases:
        rows = _rows(rng, 40, dim)
        rows[0] = 0.25  # constant row: inactive from the start, the block runs on a subset
        lo, hi = qz.greedy_range(rows, bits, n_bins, ratio)
        for i, row in enumerate(rows):
            t_max, t_min = torch.choose_qparams_optimized(torch.from_numpy(row), dim, n_bins, ratio, bits)
            assert (lo[i], hi[i]) == (t_min.item(), t_max.item()), (bits, dim, n_bins, ratio, i)


def test_greedy_across_blocks_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    rows = _rows(np.random.default_rng(RNG_SEED + 2), 2 * (qz._BLOCK_ELEMS // 64) + 17, 64)
    lo, hi = qz.greedy_range(rows, 4)
    lo2, hi2 = qz.greedy_range(rows, 4, workers=3)  # blocks on threads: same answer
    np.testing.assert_array_equal(lo2, lo)
    np.testing.assert_array_equal(hi2, hi)
    for i in range(0, len(rows), 7):
        t_max, t_min = torch.choose_qparams_optimized(torch.from_numpy(rows[i]), 64, 200, 0.16, 4)
        assert (lo[i], hi[i]) == (t_min.item(), t_max.item()), i


def test_greedy_stops_where_steps_vanish() -> None:
    """Range below float32 resolution: every move is a no-op (torch would loop forever)."""
    row = (F32(1000.0) + np.arange(4, dtype=F32) * np.spacing(F32(1000.0))).astype(F32)
    lo, hi = qz.greedy_range(row[None], 4)
    assert (lo[0], hi[0]) == (row.min(), row.max())


@pytest.mark.parametrize(
    ("bits", "prepack"), [(2, "embedding_bag_2bit_prepack"), (4, "embedding_bag_4bit_prepack")]
)
@pytest.mark.parametrize("greedy", [True, False])
def test_codes_match_torch_prepack(bits: int, prepack: str, greedy: bool) -> None:
    """Same codes, fp16 scale and bias as torch's fused rowwise N-bit prepack (fbgemm layout:
    per row ceil(dim*bits/8) code bytes, low bits first, then fp16 scale and bias), and
    the same restored values as its unpack."""
    torch = pytest.importorskip("torch")
    dim = 20
    rows = _rows(np.random.default_rng(RNG_SEED + bits), 64, dim)
    rows[1] = 1e-4  # empty range: scale 1
    rows[2] = 1e-4
    rows[2, 0] = 1.00001e-4  # range too small for an fp16 scale: stored as 1
    packed = getattr(torch.ops.quantized, prepack)(torch.from_numpy(rows), greedy).numpy()
    per_byte = 8 // bits
    n_code_bytes = -(-dim // per_byte)
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    t_codes = ((packed[:, :n_code_bytes, None] >> shifts) & (2**bits - 1)).reshape(len(rows), -1)[:, :dim]
    t_scale_bias = np.ascontiguousarray(packed[:, n_code_bytes : n_code_bytes + 4]).view(np.float16)

    q = qz.quantize_rows(rows, bits, greedy=greedy, method="torch")
    codes = qz._unpack(q.codes, bits, rows.size).reshape(rows.shape)
    np.testing.assert_array_equal(codes, t_codes)
    np.testing.assert_array_equal(q.scale, t_scale_bias[:, 0])
    np.testing.assert_array_equal(q.bias, t_scale_bias[:, 1])
    unpack = getattr(torch.ops.quantized, prepack.replace("prepack", "unpack"))
    np.testing.assert_array_equal(qz.dequantize_rows(q), unpack(torch.from_numpy(packed)).numpy())


# --- error bounds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_min_max_error_within_half_step(bits: int) -> None:
    """Without clipping every element is within scale/2 of its grid point, plus the fp16
    rounding of bias (<= 2^-11 |xmin|) and of scale (<= 2^-11 per step, qmax steps)."""
    rng = np.random.default_rng(RNG_SEED + bits)
    rows = (rng.uniform(-1, 1, (300, 33)) * 10.0 ** rng.uniform(-2, 2, (300, 1))).astype(F32)
    q = qz.quantize_rows(rows, bits, greedy=False)
    err = np.abs(qz.dequantize_rows(q) - rows)
    scale = q.scale.astype(F32)[:, None]
    qmax = 2**bits - 1
    slack = 2.0**-11 * (np.abs(rows.min(axis=1, keepdims=True)) + qmax * scale) + 1e-6 * np.abs(rows)
    assert (err <= scale / 2 + slack).all()


def test_error_decreases_with_bits_and_greedy_never_hurts() -> None:
    rows = np.random.default_rng(RNG_SEED).standard_normal((500, 64)).astype(F32)
    errors = []
    gains = []
    for bits in (2, 3, 4, 8):
        plain = qz.dequantize_rows(qz.quantize_rows(rows, bits, greedy=False))
        greedy = qz.dequantize_rows(qz.quantize_rows(rows, bits))
        row_plain = np.linalg.norm((plain - rows).astype(np.float64), axis=1)
        row_greedy = np.linalg.norm((greedy - rows).astype(np.float64), axis=1)
        assert (row_greedy <= row_plain * (1 + 1e-6)).all()
        errors.append(qz.relative_l2_error(rows, greedy))
        gains.append(qz.relative_l2_error(rows, plain) / errors[-1])
    # Measured gains of the search 1.002, 1.147, 1.101, 1.002: it pays at 3 and 4 bits.
    assert gains[1] > 1.05 and gains[2] > 1.05
    # Measured 0.447, 0.167, 0.082, 0.0053 for standard normal rows of 64.
    assert errors == sorted(errors, reverse=True)
    assert errors[0] < 0.5 and errors[1] < 0.2 and errors[2] < 0.1 and errors[3] < 0.01
    # At 2 bits torch's rule keeps the untrimmed range; keeping the best position seen pays,
    # and the fast search (the default) keeps it too.
    torch_rule = qz.dequantize_rows(qz.quantize_rows(rows, 2, method="torch"))
    seen = qz.dequantize_rows(qz.quantize_rows(rows, 2, method="torch", keep_best_seen=True))
    assert qz.relative_l2_error(rows, seen) < 0.9 * qz.relative_l2_error(rows, torch_rule)
    assert errors[0] < 0.9 * qz.relative_l2_error(rows, torch_rule)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_the_fast_search_is_never_worse_than_min_max_and_close_to_torchs(bits: int) -> None:
    """Measured on normal, heavy-tailed and skewed rows: within 0.06% of torch's search at 3
    and 4 bits (lower on average), ~20% lower at 2 bits, equal at 8."""
    rng = np.random.default_rng(RNG_SEED + bits)
    for rows in (
        rng.standard_normal((2000, 64)).astype(F32),
        rng.standard_t(3, (2000, 64)).astype(F32),
        rng.lognormal(0, 1, (2000, 48)).astype(F32),
    ):
        fast = qz.dequantize_rows(qz.quantize_rows(rows, bits))
        torch_search = qz.dequantize_rows(qz.quantize_rows(rows, bits, method="torch"))
        plain = qz.dequantize_rows(qz.quantize_rows(rows, bits, greedy=False))
        per_row = np.linalg.norm((fast - rows).astype(np.float64), axis=1)
        assert (per_row <= np.linalg.norm((plain - rows).astype(np.float64), axis=1) * (1 + 1e-6)).all()
        assert qz.relative_l2_error(rows, fast) <= 1.005 * qz.relative_l2_error(rows, torch_search)
    with pytest.raises(ValueError, match="method='exact'"):
        qz.quantize_rows(rows, bits, method="exact")  # type: ignore[arg-type]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_integer_rows_restore_exactly(bits: int) -> None:
    """Rows spanning 0..qmax get scale 1 and bias 0: every code survives pack/unpack."""
    qmax = 2**bits - 1
    rng = np.random.default_rng(RNG_SEED + bits)
    rows = rng.integers(0, qmax + 1, (9, 13)).astype(F32)
    rows[:, 0], rows[:, 1] = 0, qmax
    for greedy in (True, False):
        np.testing.assert_array_equal(qz.dequantize_rows(qz.quantize_rows(rows, bits, greedy=greedy)), rows)


# --- packing and serialization ----------------------------------------------------------------


def _bitstream(codes: np.ndarray, bits: int) -> bytes:
    """Reference packer: code k at stream bits [k*bits, (k+1)*bits), LSB first."""
    stream = [(int(c) >> b) & 1 for c in codes.ravel() for b in range(bits)]
    stream += [0] * (-len(stream) % 8)
    return bytes(sum(stream[i + b] << b for b in range(8)) for i in range(0, len(stream), 8))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize(("n_rows", "dim"), [(7, 5), (3, 8), (1, 1), (0, 4), (2, 0)])
def test_packing_and_bytes_round_trip(bits: int, n_rows: int, dim: int) -> None:
    rows = np.random.default_rng(RNG_SEED).standard_normal((n_rows, dim)).astype(F32)
    q = qz.quantize_rows(rows, bits)
    n_codes = math.ceil(n_rows * dim * bits / 8)
    assert q.codes.shape == (n_codes,)
    blob = q.to_bytes()
    assert len(blob) == q.nbytes == 24 + 4 * n_rows + n_codes
    codes = qz._unpack(q.codes, bits, n_rows * dim)
    assert q.codes.tobytes() == _bitstream(codes, bits)

    back = qz.QuantizedRows.from_bytes(blob)
    assert (back.bits, back.shape) == (bits, (n_rows, dim))
    for name in ("scale", "bias", "codes"):
        assert getattr(back, name).tobytes() == getattr(q, name).tobytes()
    assert back.to_bytes() == blob
    np.testing.assert_array_equal(qz.dequantize_rows(back), qz.dequantize_rows(q))


def test_from_bytes_rejects_bad_blobs() -> None:
    blob = qz.quantize_rows(np.ones((2, 3), F32), 4).to_bytes()
    for bad, match in [
        (b"XXXX" + blob[4:], "magic"),
        (blob[:-1], "bytes"),
        (blob + b"\0", "bytes"),
        (blob[:10], "header"),
        (blob[:5] + bytes([5]) + blob[6:], "bits=5"),
    ]:
        with pytest.raises(ValueError, match=match):
            qz.QuantizedRows.from_bytes(bad)


# --- invalid settings and rows ------------------------------------------------------------------


@pytest.mark.parametrize("bits", [0, 1, 5, 7, 16, True, 4.0])
def test_invalid_bits_named(bits: Any) -> None:
    rows = np.ones((2, 4), F32)
    with pytest.raises(ValueError, match=re.escape(f"bits={bits!r}")):
        qz.quantize_rows(rows, bits)
    with pytest.raises(ValueError, match=re.escape(f"bits={bits!r}")):
        qz.greedy_range(rows, bits)


def test_invalid_arguments() -> None:
    with pytest.raises(TypeError, match="bf16_to_f32"):
        qz.quantize_rows(np.ones((2, 4), np.uint16), 4)
    with pytest.raises(ValueError, match="2-D"):
        qz.quantize_rows(np.ones(4, F32), 4)
    with pytest.raises(ValueError, match="n_bins=0"):
        qz.greedy_range(np.ones((2, 4), F32), 4, n_bins=0)
    with pytest.raises(ValueError, match=r"ratio=1\.0"):
        qz.greedy_range(np.ones((2, 4), F32), 4, ratio=1.0)
    with pytest.raises(ValueError, match="workers=0"):
        qz.quantize_rows(np.ones((2, 4), F32), 4, workers=0)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 70000.0])
def test_rows_that_cannot_be_quantized_raise(value: float) -> None:
    rows = np.random.default_rng(RNG_SEED).standard_normal((6, 5)).astype(F32)
    rows[3, 2] = rows[5, 0] = value
    np.testing.assert_array_equal(qz.invalid_rows(rows), [3, 5])
    for call in (lambda: qz.quantize_rows(rows, 4), lambda: qz.quantize_rows(rows, 8, greedy=False)):
        with pytest.raises(ValueError, match=r"row 3 .*\(2 such rows\)"):
            call()
    with pytest.raises(ValueError, match="row 3"):
        qz.greedy_range(rows, 4)
    assert qz.invalid_rows(np.full((2, 2), 65504.0, F32)).size == 0
    np.testing.assert_array_equal(qz.invalid_rows(np.array([[0.0, 1.0], [1e300, 0.0]])), [1])


def test_relative_l2_error() -> None:
    assert qz.relative_l2_error([3.0, 4.0], [3.0, 4.0]) == 0.0
    assert qz.relative_l2_error([3.0, 4.0], [0.0, 4.0]) == pytest.approx(0.6)
    assert qz.relative_l2_error(np.zeros((2, 2)), np.zeros((2, 2))) == 0.0
    assert qz.relative_l2_error([0.0], [1.0]) == math.inf
    with pytest.raises(ValueError, match="shapes"):
        qz.relative_l2_error([1.0], [1.0, 2.0])


# --- bfloat16 / float16 ----------------------------------------------------------------------------


def _torch_bf16_bits(torch: Any, x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_f32_to_bf16_bit_exact_with_torch() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(RNG_SEED)
    random_bits = rng.integers(0, 2**32, 20000, dtype=np.uint32)  # includes NaN payloads, inf, subnormals
    high = rng.integers(0, 2**16, 64, dtype=np.uint32) << 16
    ties = np.concatenate([high | 0x8000, high | 0x7FFF, high | 0x8001, (high | 0x10000) | 0x8000])
    special = np.array([0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000,
                        0xFFC00001, 0x7F800001, 0x00008000, 0x00018000], np.uint32)  # fmt: skip
    x = np.concatenate([random_bits, ties, special]).view(F32)
    ours, theirs = qz.f32_to_bf16(x), _torch_bf16_bits(torch, x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert (ours[nan] == 0xFFFF).all()  # torch's vectorized conversion writes 0xffff for NaN ...
    assert ((theirs[nan] & 0x7FFF) > 0x7F80).all()  # ... a plain build 0x7fc0; NaN either way
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        np.testing.assert_array_equal(ours, theirs)


def test_bf16_to_f32_exact_for_all_patterns() -> None:
    torch = pytest.importorskip("torch")
    raw = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    ours = qz.bf16_to_f32(raw)
    theirs = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    np.testing.assert_array_equal(qz.bf16_to_f32(raw.view(np.int16)), ours)
    finite = np.isfinite(ours)
    np.testing.assert_array_equal(
        qz.f32_to_bf16(ours[finite]), raw[finite]
    )  # widening then rounding is exact


def test_downcast() -> None:
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(RNG_SEED).standard_normal((50, 8)).astype(F32) * 1000
    x[0, :3] = [np.nan, np.inf, -np.inf]
    half = qz.downcast(x, "float16")
    assert half.dtype == np.float16
    np.testing.assert_array_equal(
        half.view(np.uint16)[1:], torch.from_numpy(x[1:]).half().numpy().view(np.uint16)
    )
    assert np.isnan(half[0, 0]) and half[0, 1] == np.inf and half[0, 2] == -np.inf
    np.testing.assert_array_equal(qz.downcast(x, "bfloat16"), qz.f32_to_bf16(x))
    x[4, 1] = 70000.0
    with pytest.raises(ValueError, match=r"index \(4, 1\)"):
        qz.downcast(x, "float16")
    with pytest.raises(ValueError, match="float8"):
        qz.downcast(x, "float8")  # type: ignore[arg-type]


# --- bit width policy -------------------------------------------------------------------------------


def test_bits_for_restores_and_escalation() -> None:
    assert [qz.bits_for_restores(n) for n in (0, 1, 2, 3, 4, 20, 21, 10**6)] == [4, 4, 8, 8, 8, 8, 8, 8]
    paper = ((1, 2), (3, 3), (20, 4))
    assert [qz.bits_for_restores(n, paper) for n in (0, 1, 2, 3, 4, 20, 21)] == [2, 2, 3, 3, 4, 4, 8]
    assert qz.bits_for_restores(5, table=((10, 3),)) == 3
    assert qz.bits_for_restores(11, table=((10, 3),)) == 8
    with pytest.raises(ValueError, match="expected_restores=-1"):
        qz.bits_for_restores(-1)
    with pytest.raises(ValueError, match="bits=5"):
        qz.bits_for_restores(1, table=((2, 5),))
    assert qz.escalate(2, actual_restores=2, planned=1) == 8
    assert qz.escalate(3, actual_restores=3, planned=3) == 3
    assert qz.escalate(8, actual_restores=9, planned=1) == 8
