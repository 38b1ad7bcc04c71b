"""quantize_rows is idempotent on its own output (issue 17): a row restored from a quantized
checkpoint and not updated since is quantized again at the next full checkpoint, and must be
stored exactly, codes, fp16 scale and bias bit for bit, or every checkpoint would add error
to rows that never changed.

Before the fix, torch's rounding left some rows off a fixed point: constant rows, rows far
from 0 relative to their spread (the fp16 bias more than half a step below the minimum),
ranges whose fp16 scale is subnormal (the top code unused), and rows the range search
trimmed by float32 rounding alone. Each case below failed then.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from sidecar.pipeline import quantize as qz

F32 = np.float32
N, DIM = 600, 64


def _normal(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((N, DIM)) * 0.05


def _scaled(rng: np.random.Generator) -> np.ndarray:
    """Magnitudes from 1e-6 to 1e2, subnormal fp16 scales included."""
    return rng.standard_normal((N, DIM)) * 10.0 ** rng.uniform(-6, 2, (N, 1))


def _constant(rng: np.random.Generator) -> np.ndarray:
    return np.repeat(rng.standard_normal((N, 1)) * 10.0 ** rng.uniform(-6, 3, (N, 1)), DIM, axis=1)


def _offset(rng: np.random.Generator) -> np.ndarray:
    """Far from 0 relative to the spread: 1 +- 0.01 up to 3e4 +- 1."""
    centre = 10.0 ** rng.uniform(0, 4.5, (N, 1))
    return centre + rng.standard_normal((N, DIM)) * centre * 10.0 ** rng.uniform(-5, -2, (N, 1))


def _bf16(rng: np.random.Generator) -> np.ndarray:
    """bfloat16-exact values, as the sidecar widens a bf16 table before quantizing it."""
    return qz.bf16_to_f32(qz.f32_to_bf16((rng.standard_normal((N, DIM)) * 0.05).astype(F32)))


def _few_values(rng: np.random.Generator) -> np.ndarray:
    """Two or three distinct values per row, near each other."""
    base = rng.standard_normal((N, 1))
    picks = rng.integers(0, 3, (N, DIM))
    return base + picks * base * 1e-4


def _sparse(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((N, DIM)) * (rng.random((N, DIM)) < 0.1)


ROWS: dict[str, Callable[[np.random.Generator], np.ndarray]] = {
    "normal": _normal,
    "scaled": _scaled,
    "constant": _constant,
    "offset": _offset,
    "bf16": _bf16,
    "few-values": _few_values,
    "sparse": _sparse,
}
# greedy=True with both searches, and min/max
SEARCHES = [
    pytest.param({"method": "fast"}, id="fast"),
    pytest.param({"method": "torch"}, id="torch"),
    pytest.param({"greedy": False}, id="minmax"),
]


def _assert_same(a: qz.QuantizedRows, b: qz.QuantizedRows) -> None:
    assert a.bits == b.bits and a.shape == b.shape
    bad = np.flatnonzero((a.scale != b.scale) | (a.bias != b.bias))
    assert bad.size == 0, f"{bad.size} rows changed scale/bias, first {bad[0]}"
    np.testing.assert_array_equal(a.codes, b.codes)


@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("kind", list(ROWS))
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quantize_is_idempotent_on_its_own_output(bits: int, kind: str, search: dict[str, object]) -> None:
    rng = np.random.default_rng([bits, list(ROWS).index(kind)])
    rows = ROWS[kind](rng).astype(F32)
    q = qz.quantize_rows(rows, bits, **search)  # type: ignore[arg-type]
    restored = qz.dequantize_rows(q)
    again = qz.quantize_rows(restored, bits, **search)  # type: ignore[arg-type]
    _assert_same(q, again)
    np.testing.assert_array_equal(qz.dequantize_rows(again), restored)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_repeated_restores_add_no_error(bits: int) -> None:
    """Twenty quantize/restore round trips of unchanged rows: the values of the first."""
    rng = np.random.default_rng(bits)
    rows = np.concatenate([f(rng) for f in ROWS.values()]).astype(F32)
    first = qz.dequantize_rows(qz.quantize_rows(rows, bits))
    values = first
    for _ in range(20):
        values = qz.dequantize_rows(qz.quantize_rows(values, bits))
    np.testing.assert_array_equal(values, first)


@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_rows_on_a_grid_are_stored_exactly(bits: int, search: dict[str, object]) -> None:
    """A row whose values lie on a grid of that width, ``bias + code * scale`` exactly (fp16
    scale and bias, codes spanning 0..qmax), comes back exactly, whatever the search would
    trim: the error there is 0 and nothing beats it."""
    qmax = 2**bits - 1
    rng = np.random.default_rng(100 + bits)
    scale = (10.0 ** rng.uniform(-4, -1, N)).astype(np.float16).astype(np.float64)
    bias = (rng.standard_normal(N) * scale * qmax * 10.0 ** rng.uniform(-1, 1.5, N)).astype(np.float16)
    codes = rng.integers(0, qmax + 1, (N, DIM)).astype(np.float64)
    codes[:, 0], codes[:, 1] = 0, qmax
    exact = codes * scale[:, None] + bias.astype(np.float64)[:, None]
    rows = exact.astype(F32)
    on_grid = (rows == exact).all(axis=1)  # float32 holds them exactly: the values are on the grid
    assert on_grid.mean() > 0.5
    rows = rows[on_grid]
    q = qz.quantize_rows(rows, bits, **search)  # type: ignore[arg-type]
    np.testing.assert_array_equal(qz.dequantize_rows(q), rows)


def test_first_quantization_unchanged_for_ordinary_rows() -> None:
    """The fix does not touch rows that were already fixed points: trained-embedding-like rows
    get the encoding of the plain search (scale and bias from the searched range)."""
    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((N, DIM)) * 0.05).astype(F32)
    for bits in (2, 3, 4, 8):
        lo, hi = qz.fast_range(rows, bits)
        q = qz.quantize_rows(rows, bits)
        np.testing.assert_array_equal(q.bias, lo.astype(np.float16))
        expected_scale = ((hi - lo.astype(np.float16).astype(F32)) / F32(2**bits - 1)).astype(np.float16)
        np.testing.assert_array_equal(q.scale, expected_scale)
