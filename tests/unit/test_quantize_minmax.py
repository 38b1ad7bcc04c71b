"""The min/max encoder (``greedy=False``, what ``auto`` stores at 8 bits) writes the bytes the
block-by-block path writes, codes, fp16 scale and bias bit for bit, so checkpoints written
before it decode as they did and re-encode to the same bytes. The block-by-block path is the
reference: its results per row are fixed by the stored format and by ``_settle``."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from sidecar.pipeline import quantize as qz

F32 = np.float32
RNG = np.random.default_rng(31)


def _same(rows: np.ndarray, bits: int) -> None:
    arr = np.ascontiguousarray(rows, F32)
    new = qz.quantize_parts(arr, bits, greedy=False)
    ref = qz._blockwise_part(arr, bits, greedy=False)
    assert new.q.to_bytes() == ref.q.to_bytes()
    # the reported error: the same decode, summed in another order
    assert new.norm_sq == pytest.approx(ref.norm_sq, rel=1e-6)
    assert new.diff_sq == pytest.approx(ref.diff_sq, rel=1e-6, abs=1e-30)


def _kinds(n: int, dim: int) -> dict[str, np.ndarray]:
    normal = RNG.standard_normal((n, dim))
    signed_zeros = np.where(RNG.random((n, dim)) < 0.5, 0.0, -0.0)
    return {
        "normal": normal * 0.05,
        "scaled": normal * 10.0 ** RNG.uniform(-6, 2, (n, 1)),  # subnormal fp16 scales
        "constant": np.repeat(RNG.standard_normal((n, 1)) * 10.0 ** RNG.uniform(-6, 3, (n, 1)), dim, axis=1),
        "offset": 1e3 + normal * 1e-2,  # far from 0 relative to the spread
        "few-values": 1.0 + RNG.integers(0, 3, (n, dim)) * 1e-4,
        "sparse": normal * (RNG.random((n, dim)) < 0.1),
        "signed-zeros": np.where(RNG.random((n, 1)) < 0.5, signed_zeros, np.abs(normal) + signed_zeros),
        "fp16-range": RNG.uniform(-65504, 65504, (n, dim)),
        "tiny": normal * 1e-30,
        "integers": RNG.integers(-5, 5, (n, dim)).astype(float),
    }


@pytest.mark.parametrize("dim", [1, 2, 3, 4, 5, 7, 12, 33, 64])
def test_same_bytes_as_the_blockwise_path(dim: int) -> None:
    for rows in _kinds(203, dim).values():  # 203: not a multiple of 8
        for bits in qz.SUPPORTED_BITS:
            _same(rows, bits)


def _unsettled_row(dim: int, bits: int) -> np.ndarray:
    """A row whose min/max encoding ``_settle`` changes (here: a subnormal fp16 scale)."""
    qmax = F32(2**bits - 1)
    rng = np.random.default_rng(0)
    for _ in range(5000):
        row = (rng.standard_normal((1, dim)) * 10.0 ** rng.uniform(-7, -2)).astype(F32)
        bias, scale, inv = qz._qparams(row.min(axis=1), row.max(axis=1), qmax)
        scale[scale == 0] = 1.0
        if not qz._keeps(qz._codes(row, bias, inv, qmax), scale, bias, qmax):
            return row[0]
    raise AssertionError("no such row")


@pytest.mark.parametrize("bits", [4, 8])
def test_same_bytes_across_blocks(bits: int) -> None:
    """_settle decides per block of the blockwise path: where a row of the block changes, every
    row takes the encoding of its decoded values, which turns a -0 bias into +0. Block 0 has
    such a row and -0 biases, block 1 -0 biases only, block 2 such rows only."""
    dim = 64
    block = qz._block_rows(dim)
    rows = RNG.standard_normal((2 * block + 1000, dim)).astype(F32)
    rows[RNG.choice(rows.shape[0], 50)] = 0.0
    negative_zero = np.concatenate(
        [RNG.choice(block, 20, replace=False), block + RNG.choice(block, 20, replace=False)]
    )
    rows[negative_zero] = np.abs(rows[negative_zero])
    rows[negative_zero, RNG.integers(0, dim, negative_zero.size)] = -0.0
    unsettled = _unsettled_row(dim, bits)
    rows[[5, 2 * block + 7, 2 * block + 999]] = unsettled
    _same(rows, bits)
    q = qz.quantize_rows(rows, bits, greedy=False)
    signs = np.signbit(q.bias[negative_zero])
    assert not signs[:20].any() and signs[20:].all()  # both cases happen


def test_bytes_unchanged_since_the_format_was_fixed() -> None:
    """Digests of what the encoder wrote before this encoder existed: the stored format and
    its choices (codes, fp16 rounding, settled rows) stay as they were."""
    rows = np.random.default_rng(0).standard_normal((1000, 24)).astype(F32)
    rows[::50] = 0.3  # constant rows, which _settle re-encodes
    rows[1::97] = np.abs(rows[1::97])
    rows[1::97, 3] = -0.0  # -0 biases
    want = {
        4: "e877c1ce92ae73fef30e888e63d032028bde493f2bd9f33cf537c25bf9364d76",
        8: "d82abdd408c02e0d0a51df4adf4c3b5bdbab40f93ed51e7751b8fca0891d0f3c",
    }
    for bits, digest in want.items():
        assert hashlib.sha256(qz.quantize_rows(rows, bits, greedy=False).to_bytes()).hexdigest() == digest


def test_decode_error_unchanged() -> None:
    rows = RNG.standard_normal((4000, 64)).astype(F32)
    new = qz.quantize_rows(rows, 8, greedy=False)
    ref = qz._blockwise_part(rows, 8, greedy=False).join()
    assert np.array_equal(qz.dequantize_rows(new), qz.dequantize_rows(ref))
    measured = qz.relative_l2_error(rows, qz.dequantize_rows(new))
    assert new.rel_error == pytest.approx(measured, rel=1e-6)
    assert new.rel_error == pytest.approx(ref.rel_error, rel=1e-6)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 70000.0, -65505.0])
def test_rows_that_cannot_be_quantized_raise_as_before(value: float) -> None:
    rows = RNG.standard_normal((40000, 7)).astype(F32)
    rows[39000, 2] = rows[39500, 0] = value  # past the first chunk
    with pytest.raises(ValueError, match=r"row 39000 .*\(2 such rows\)"):
        qz.quantize_rows(rows, 8, greedy=False)


def test_empty_and_unaligned_inputs() -> None:
    for shape in [(0, 8), (5, 0), (0, 0)]:
        _same(np.zeros(shape, F32), 8)
    buf = np.zeros(64 * 33 + 1, F32)[1:].reshape(64, 33)  # not 16-byte aligned
    buf[:] = RNG.standard_normal(buf.shape)
    _same(buf, 8)
    raw = np.zeros(64 * 64 * 4 + 4, np.uint8)
    raw[4:] = RNG.standard_normal((64, 64)).astype(F32).view(np.uint8).ravel()
    _same(np.frombuffer(raw, F32, 64 * 64, 4).reshape(64, 64), 8)  # 4 bytes past alignment
    _same(RNG.standard_normal((64, 64))[:, ::2], 8)  # float64, strided


def _f16_mismatches(bits: np.ndarray) -> int:
    a = bits.view(F32)
    a = a[np.abs(a) <= qz.FP16_MAX]  # beyond: the casts themselves decide
    want = a.astype(np.float16).astype(F32)
    return int((qz._f16(a).view(np.uint32) != want.view(np.uint32)).sum())


def test_f16_rounding_is_numpys_cast() -> None:
    """Every pattern of the 14 low fraction bits (the rounded ones and the kept lsb), for the
    float32 exponents where fp16 changes behaviour (float32 subnormals, fp16 subnormals and
    their edges, normals, the top of the range), with upper fraction bits 0, 1 and all ones
    (a carry into the exponent), both signs; and random patterns."""
    low = np.arange(1 << 14, dtype=np.uint32)
    exponents = [0, 1, 50, 101, 102, 103, 104, 111, 112, 113, 114, 120, 127, 135, 141, 142]
    parts = [
        (np.uint32(sign) | np.uint32(e << 23) | np.uint32(high << 14) | low)
        for sign in (0, 1 << 31)
        for e in exponents
        for high in (0, 1, 0x1FF)
    ]
    assert _f16_mismatches(np.concatenate(parts)) == 0
    assert _f16_mismatches(RNG.integers(0, 1 << 32, 1 << 20, dtype=np.uint32)) == 0
    odd = np.array([np.nan, np.inf, -np.inf, 65505.0, 65520.0, -1e10], F32)
    with np.errstate(over="ignore"):  # the cast's own warning
        np.testing.assert_array_equal(qz._f16(odd), odd.astype(np.float16).astype(F32))


@pytest.mark.slow
def test_f16_rounding_is_numpys_cast_for_every_float32() -> None:
    step = 1 << 24
    for start in range(0, 1 << 32, step):
        assert _f16_mismatches(np.arange(start, start + step, dtype=np.uint64).astype(np.uint32)) == 0


def test_to_f16_is_numpys_cast_for_every_fp16_value() -> None:
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = h[np.isfinite(h)]
    assert np.array_equal(qz._to_f16(h.astype(F32)).view(np.uint16), h.view(np.uint16))
