"""Per-row quantization of Check-N-Run (Eisenman et al., NSDI 2022), numpy only.

Every row (one embedding vector) gets its own asymmetric uniform grid with
``qmax = 2**bits - 1`` steps::

    bias  = f16(xmin)                           # offset, rounded to fp16 first
    scale = f16((xmax - bias) / qmax)           # 1.0 if the range or this is 0
    code  = clip(rint((x - bias) * (1 / scale)), 0, qmax)  # float32, half to even
    x'    = code * scale + bias                 # float32, with the stored fp16 values

Scale and bias are rounded to fp16 *before* the codes are computed, so the
restorer, which only has the stored fp16 values, reproduces exactly the values
the quantizer assumed. ``(xmin, xmax)`` is either the row's min/max or, with
``greedy=True``, a searched clipping range: by default :func:`fast_range`, the
paper's greedy walk with coarse moves then fine ones (~3.5x less work, an error
within a fraction of a percent of the torch search's, lower at 2 bits), or with
``method="torch"`` :func:`greedy_range`, the search exactly as
``torch.choose_qparams_optimized`` does it. Min/max and the torch search give the
codes, scale and bias of torch's ``quantized.embedding_bag_{2,4}bit_prepack``
(fbgemm's fused rowwise format) without and with its ``optimized_qparams``.

Rows that are not finite or exceed the fp16 range (|x| > 65504, where the fp16
bias or scale would overflow) are never quantized: :func:`quantize_rows`
raises ``ValueError`` naming the first such row, and the caller stores that
tensor raw (:func:`invalid_rows` lists them up front).

Bit width follows the expected number of restores (quantization error enters
training only on restore, and accumulates): :func:`bits_for_restores`, and
:func:`escalate` to 8 bits once restores exceed the plan.

bfloat16, which numpy lacks, travels as raw ``uint16`` bits:
:func:`bf16_to_f32` widens exactly, :func:`f32_to_bf16` rounds to nearest
even like torch.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
_T = TypeVar("_T")

SUPPORTED_BITS = (2, 3, 4, 8)
FP16_MAX = 65504.0
# Measured (tests/bench/quality.py, issue 17): 4 bits keep the held-out log loss within 0.01%
# after one restore, not after 3 (2 and 3 bits not even after one); 8 bits do after 20.
DEFAULT_RESTORE_TABLE: tuple[tuple[int, int], ...] = ((1, 4),)
# Elements per block of the vectorized search: two float32 buffers of this size stay in L2.
_BLOCK_ELEMS = 1 << 17


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int | np.integer) or int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; use one of {SUPPORTED_BITS}")
    return int(bits)


def _as_rows(rows: npt.ArrayLike) -> F32:
    arr = np.asarray(rows)
    if not np.issubdtype(arr.dtype, np.floating):
        raise TypeError(
            f"rows must be a floating array, got {arr.dtype}; widen raw bfloat16 bits with bf16_to_f32 first"
        )
    if arr.ndim != 2:
        raise ValueError(f"rows must be 2-D [n_rows, dim], got shape {arr.shape}")
    with np.errstate(over="ignore"):  # float64 beyond float32 becomes inf, which is then refused
        return np.ascontiguousarray(arr, dtype=np.float32)


def invalid_rows(rows: npt.ArrayLike) -> npt.NDArray[np.intp]:
    """Indices of rows that cannot be quantized: NaN, ±inf or |x| > 65504 (fp16 overflow)."""
    arr = _as_rows(rows)
    bad = np.zeros(arr.shape[0], np.bool_)
    block = _block_rows(arr.shape[1])  # block by block: no full-size temporaries
    with np.errstate(invalid="ignore"):
        for s in range(0, arr.shape[0], block):
            # NaN compares False, so it lands in `bad` too
            bad[s : s + block] = ~(np.abs(arr[s : s + block]) <= FP16_MAX).all(axis=1)
    return np.flatnonzero(bad)


def _require_quantizable(rows: F32) -> None:
    bad = invalid_rows(rows)
    if bad.size:
        raise ValueError(
            f"row {int(bad[0])} has NaN/inf or values beyond the fp16 range ±{FP16_MAX:g} "
            f"({bad.size} such rows); such rows are never quantized, store the tensor unquantized"
        )


def _f16(a: F32) -> F32:
    """``a.astype(np.float16).astype(np.float32)``, ~3x faster in float32 bit arithmetic (numpy's
    float16 casts are scalar loops). Round to nearest even: for fp16 normals, on the bits (10
    of float32's 23 fraction bits kept); below 2**-14, to multiples of 2**-24 by adding 0.5,
    whose float32 ulp that is. Exact for every float32 (tests check all 2**32); beyond the
    fp16 range and for NaN the casts decide."""
    mag = np.abs(a)
    if a.dtype != np.float32 or a.ndim != 1 or not (mag <= FP16_MAX).all():
        return a.astype(np.float16).astype(np.float32)
    bits = a.view(np.uint32)
    rounded = bits + ((bits >> np.uint32(13)) & np.uint32(1))
    rounded += np.uint32(0xFFF)
    rounded &= np.uint32(0xFFFFE000)
    out = rounded.view(np.float32)
    tiny = mag < np.float32(2.0**-14)
    if tiny.any():
        out[tiny] = np.copysign((mag[tiny] + np.float32(0.5)) - np.float32(0.5), a[tiny])
    return out


def _qparams(lo: F32, hi: F32, qmax: np.float32) -> tuple[F32, F32, F32]:
    """(bias, scale, 1/scale) as float32 holding fp16 values, exactly as torch's
    ``calculate_quant_loss``: scale 1 for an empty range, inverse 1 for a zero scale."""
    bias = _f16(lo)
    span = hi - bias
    scale = _f16(span / qmax)
    scale[span == 0] = 1.0
    inv = np.ones_like(scale)
    np.divide(np.float32(1.0), scale, out=inv, where=scale != 0)
    return bias, scale, inv


def _sequential_sum(buf: F32) -> F32:
    """Column sums of a C-contiguous [dim, k] array, adding the rows in order as
    torch's C loop does. numpy reduces a non-inner axis that way (an elementwise
    add per row); over the contiguous axis (k == 1) it would sum pairwise, so a
    single column takes the (slow but strictly sequential) accumulate. The torch
    oracle tests pin this down."""
    if buf.shape[1] >= 2 and buf.flags.c_contiguous:
        return np.add.reduce(buf, axis=0)
    return np.add.accumulate(buf, axis=0)[-1]


def _row_losses(xt: F32, lo: F32, hi: F32, qmax: np.float32, buf: F32) -> F32:
    """L2 error of quantizing each column of ``xt`` ([dim, k], one row per column)
    on the range [lo, hi], bit for bit as torch: the same float32 operations in
    the same order, the squares summed sequentially. ``buf``: C-contiguous scratch
    of ``xt``'s shape."""
    bias, scale, inv = _qparams(lo, hi, qmax)
    np.subtract(xt, bias, out=buf)
    np.multiply(buf, inv, out=buf)
    np.rint(buf, out=buf)  # nearbyint: round half to even
    np.clip(buf, np.float32(0.0), qmax, out=buf)
    np.multiply(buf, scale, out=buf)
    np.add(buf, bias, out=buf)
    np.subtract(xt, buf, out=buf)
    np.multiply(buf, buf, out=buf)
    return np.sqrt(_sequential_sum(buf))


def _greedy_block(
    xt: F32, qmax: np.float32, n_bins_f: np.float32, min_bins: np.float32, cap: int, keep_best_seen: bool
) -> tuple[F32, F32]:
    lo0, hi0 = xt.min(axis=0), xt.max(axis=0)
    step = (hi0 - lo0) / n_bins_f
    thr = min_bins * step
    cur_lo, cur_hi = lo0.copy(), hi0.copy()
    scratch = np.empty(xt.size, np.float32)
    n = xt.shape[1]
    cur = _row_losses(xt, lo0, hi0, qmax, scratch.reshape(xt.shape))
    best, best_lo, best_hi = cur.copy(), lo0.copy(), hi0.copy()
    for _ in range(cap):
        idx = np.flatnonzero(cur_lo + thr < cur_hi)
        if idx.size == 0:
            break
        sel: slice | npt.NDArray[np.intp]
        # np.take keeps the block C-contiguous (xt[:, idx] would be column-major).
        sel, xs = (
            (slice(None), xt) if idx.size == n else (idx, np.ascontiguousarray(np.take(xt, idx, axis=1)))
        )
        buf = scratch[: xs.size].reshape(xs.shape)
        lo, hi, st, c = cur_lo[sel], cur_hi[sel], step[sel], cur[sel]
        left_lo = lo + st
        right_hi = hi - st
        loss1 = _row_losses(xs, left_lo, hi, qmax, buf)
        loss2 = _row_losses(xs, lo, right_hi, qmax, buf)
        # Only a strict local optimum along the path is recorded (torch does the same).
        local = (c < loss1) & (c < loss2) & (c < best[sel])
        best[sel] = np.where(local, c, best[sel])
        best_lo[sel] = np.where(local, lo, best_lo[sel])
        best_hi[sel] = np.where(local, hi, best_hi[sel])
        left = loss1 < loss2
        cur_lo[sel] = np.where(left, left_lo, lo)
        cur_hi[sel] = np.where(left, hi, right_hi)
        cur[sel] = np.where(left, loss1, loss2)
        if keep_best_seen:
            seen = cur[sel] < best[sel]
            best[sel] = np.where(seen, cur[sel], best[sel])
            best_lo[sel] = np.where(seen, cur_lo[sel], best_lo[sel])
            best_hi[sel] = np.where(seen, cur_hi[sel], best_hi[sel])
    return best_lo, best_hi


def greedy_range(
    rows: npt.ArrayLike,
    bits: int,
    n_bins: int = 200,
    ratio: float = 0.16,
    *,
    keep_best_seen: bool = False,
    workers: int = 1,
) -> tuple[F32, F32]:
    """Per-row clipping range ``(xmin, xmax)`` of Check-N-Run's greedy search.

    Same result as ``torch.choose_qparams_optimized(row, numel, n_bins, ratio,
    bits)`` per row (which returns ``(xmax, xmin)``), vectorized across rows:

    * start at ``[min, max]``; ``step = (max - min) / n_bins``; ``loss(a, b)``
      is the L2 error of quantizing the row on ``[a, b]`` with fp16-rounded
      bias and scale (the module formula);
    * while the range is wider than ``n_bins * (1 - ratio)`` steps (so at
      most ``ratio`` of it is trimmed, ~32 moves by default), evaluate
      trimming one step at the left and at the right and move to the better
      (the right on a tie);
    * the answer is the no-trim range or, if lower, the best position that
      was a strict local optimum (lower than both of its trims). This is
      fbgemm's ``param_search_greedy`` as torch ships it: it never scores the
      last position, so when the error keeps falling past the trim budget
      (typical at 2 bits, whose best clipping lies beyond 16%) it keeps the
      untrimmed range. ``keep_best_seen=True`` instead keeps the lowest
      position the path reaches, the paper's "keep the best" (not torch's
      result; measured on standard normal rows of 64 at 2 bits: relative L2
      error 0.446 -> 0.361, no change at 4 bits), at no extra cost.

    Work is float32 in torch's operation order, so the comparisons, and hence
    the chosen path, agree bit for bit. One deliberate difference: where the
    step is below float32 resolution of the row's values (a range under
    ~1e-5 of its magnitude) a move can be a no-op and torch loops forever;
    here the moves stop after ``2 * ceil(n_bins * ratio) + 4``.
    Rows are processed in blocks of ~128k elements, transposed so that each
    operation runs over whole contiguous rows of the block; ``workers`` > 1
    runs blocks on that many threads (same result). Cost: ~65 evaluations of
    ~10 float32 passes over the data, ~8 CPU-seconds for 1M x 64 rows here.
    """
    bits = _check_bits(bits)
    arr = _as_rows(rows)
    _require_quantizable(arr)
    return _greedy(arr, bits, n_bins, ratio, keep_best_seen, workers)


def _greedy(
    arr: F32, bits: int, n_bins: int, ratio: float, keep_best_seen: bool, workers: int
) -> tuple[F32, F32]:
    return _search(arr, bits, n_bins, ratio, workers, keep_best_seen=keep_best_seen)


def _search(
    arr: F32,
    bits: int,
    n_bins: int,
    ratio: float,
    workers: int,
    *,
    fast: bool = False,
    keep_best_seen: bool = False,
) -> tuple[F32, F32]:
    """:func:`greedy_range` (or with ``fast``, :func:`fast_range`) of validated rows."""
    if workers < 1:
        raise ValueError(f"workers={workers!r} must be >= 1")
    if n_bins < 1:
        raise ValueError(f"n_bins={n_bins!r} must be >= 1")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio={ratio!r} must be in [0, 1)")
    n_rows, dim = arr.shape
    if n_rows == 0 or dim == 0:
        return np.zeros(n_rows, np.float32), np.zeros(n_rows, np.float32)
    qmax = np.float32((1 << bits) - 1)
    n_bins_f = np.float32(n_bins)
    min_bins = np.float32(float(n_bins_f) * (1.0 - ratio))  # torch: float * double, stored as float
    cap = 2 * math.ceil(n_bins * ratio) + 4
    block = max(1, _BLOCK_ELEMS // dim)
    out_lo = np.empty(n_rows, np.float32)
    out_hi = np.empty(n_rows, np.float32)

    def run(start: int) -> None:
        xt = np.ascontiguousarray(arr[start : start + block].T)
        if fast:
            lo, hi = _fast_block(xt, qmax, n_bins_f, min_bins)
        else:
            lo, hi = _greedy_block(xt, qmax, n_bins_f, min_bins, cap, keep_best_seen)
        out_lo[start : start + block] = lo
        out_hi[start : start + block] = hi

    starts = range(0, n_rows, block)
    if workers == 1 or len(starts) == 1:
        for start in starts:
            run(start)
    else:  # numpy releases the GIL inside its loops, which are ~80% of the work
        with ThreadPoolExecutor(min(workers, len(starts))) as pool:
            list(pool.map(run, starts))
    return out_lo, out_hi


#: Trim steps per move of :func:`fast_range`'s coarse walk.
_STRIDE = 4
#: Rounds of single steps around the coarse walk's best position.
_FINE_ROUNDS = 1


def _losses(xt: F32, lo: F32, hi: F32, qmax: np.float32, y: F32, q: F32) -> F32:
    """Squared L2 error of quantizing each column of ``xt`` on [lo, hi] (fp16 bias and scale):
    seven float32 passes where :func:`_row_losses` takes nine to match torch's rounding order
    (``(x - bias) - code * scale``: the same error but for the last float32 rounding)."""
    bias, scale, inv = _qparams(lo, hi, qmax)
    np.subtract(xt, bias, out=y)
    np.multiply(y, inv, out=q)
    np.rint(q, out=q)
    np.clip(q, np.float32(0.0), qmax, out=q)
    np.multiply(q, scale, out=q)
    np.subtract(y, q, out=y)
    np.multiply(y, y, out=y)
    return np.add.reduce(y, axis=0)


def _fast_block(xt: F32, qmax: np.float32, n_bins_f: np.float32, min_bins: np.float32) -> tuple[F32, F32]:
    lo0, hi0 = xt.min(axis=0), xt.max(axis=0)
    step = (hi0 - lo0) / n_bins_f
    thr = min_bins * step
    coarse = step * np.float32(_STRIDE)
    y, q = np.empty_like(xt), np.empty_like(xt)
    cur_lo, cur_hi = lo0.copy(), hi0.copy()
    best = _losses(xt, lo0, hi0, qmax, y, q)
    best_lo, best_hi = lo0.copy(), hi0.copy()
    # Coarse: the greedy walk of torch's search, _STRIDE steps per move, within the same trim
    # budget, keeping the best position seen.
    for _ in range(int(n_bins_f - min_bins) // _STRIDE + 2):
        active = cur_lo + thr < cur_hi
        if not active.any():
            break
        left_lo, right_hi = cur_lo + coarse, cur_hi - coarse
        loss1 = _losses(xt, left_lo, cur_hi, qmax, y, q)
        loss2 = _losses(xt, cur_lo, right_hi, qmax, y, q)
        left = loss1 < loss2
        cur_lo = np.where(active & left, left_lo, cur_lo)
        cur_hi = np.where(active & ~left, right_hi, cur_hi)
        loss = np.where(left, loss1, loss2)
        better = active & (loss < best)
        best = np.where(better, loss, best)
        best_lo = np.where(better, cur_lo, best_lo)
        best_hi = np.where(better, cur_hi, best_hi)
    # Fine: single steps around the best coarse position (each bound in or out), while they
    # help, never wider than the row's own [min, max].
    for _ in range(_FINE_ROUNDS):
        improved = np.zeros(best.shape, np.bool_)
        for lo, hi in (
            (np.minimum(best_lo + step, best_hi), best_hi),
            (np.maximum(best_lo - step, lo0), best_hi),
            (best_lo, np.maximum(best_hi - step, best_lo)),
            (best_lo, np.minimum(best_hi + step, hi0)),
        ):
            loss = _losses(xt, lo, hi, qmax, y, q)
            better = loss < best
            best = np.where(better, loss, best)
            best_lo = np.where(better, lo, best_lo)
            best_hi = np.where(better, hi, best_hi)
            improved |= better
        if not improved.any():
            break
    return best_lo, best_hi


def fast_range(
    rows: npt.ArrayLike, bits: int, n_bins: int = 200, ratio: float = 0.16, *, workers: int = 1
) -> tuple[F32, F32]:
    """Per-row clipping range of a faster search than :func:`greedy_range`, what
    :func:`quantize_rows` uses by default.

    The same walk over the same trim budget, but ``_STRIDE`` (4) steps per move, keeping the
    lowest position seen, then single steps in and out of that position while they lower the
    error: 21 evaluations of 7 float32 passes where torch's search takes 65 of 9 (~3.5x faster).
    The error is never above the untrimmed range's, and on the rows measured (normal, uniform,
    heavy-tailed, trained embeddings) within a fraction of a percent of torch's search, lower
    where torch's misses the best position (2 bits); the bench's ``encoding`` section
    measures it against fbgemm's on every run.
    """
    bits = _check_bits(bits)
    arr = _as_rows(rows)
    _require_quantizable(arr)
    return _search(arr, bits, n_bins, ratio, workers, fast=True)


# --- packing -------------------------------------------------------------------------------------
#
# Codes form one little-endian bit stream over the row-major [n_rows, dim] array:
# code k occupies stream bits [k*bits, (k+1)*bits), stream bit i is bit (i % 8) of
# byte i // 8. So 2 and 4 bits hold 4 and 2 whole codes per byte (first code in the
# low bits), 8 bits is one code per byte, and 3 bits packs 8 codes into 3 bytes
# (codes straddle bytes). Size: ceil(n_rows * dim * bits / 8) bytes, no padding per row.


def _pack(codes: npt.NDArray[np.uint8], bits: int) -> npt.NDArray[np.uint8]:
    flat = codes.reshape(-1)
    n_bytes = (flat.size * bits + 7) // 8
    if bits == 8:
        return flat.copy()
    per = 8 if bits == 3 else 8 // bits  # codes per group; a group is `bits` bytes
    pad = -flat.size % per
    if pad:
        flat = np.concatenate([flat, np.zeros(pad, np.uint8)])
    groups = flat.reshape(-1, per)
    if bits == 3:
        word = np.zeros(groups.shape[0], np.uint32)
        for j in range(8):
            word |= groups[:, j].astype(np.uint32) << np.uint32(3 * j)
        packed = np.empty((groups.shape[0], 3), np.uint8)
        for k in range(3):
            packed[:, k] = (word >> np.uint32(8 * k)) & np.uint32(0xFF)
        return packed.reshape(-1)[:n_bytes]
    out = np.zeros(groups.shape[0], np.uint8)
    for j in range(per):
        out |= groups[:, j] << np.uint8(bits * j)
    return out[:n_bytes]


def _unpack(packed: npt.NDArray[np.uint8], bits: int, count: int) -> npt.NDArray[np.uint8]:
    if bits == 8:
        return packed[:count].copy()
    mask = np.uint8((1 << bits) - 1)
    if bits == 3:
        pad = -packed.size % 3
        data = np.concatenate([packed, np.zeros(pad, np.uint8)]) if pad else packed
        trip = data.reshape(-1, 3).astype(np.uint32)
        word = trip[:, 0] | (trip[:, 1] << np.uint32(8)) | (trip[:, 2] << np.uint32(16))
        shifts = np.arange(0, 24, 3, dtype=np.uint32)
        codes = ((word[:, None] >> shifts) & np.uint32(7)).astype(np.uint8)
    else:
        shifts8 = np.arange(0, 8, bits, dtype=np.uint8)
        codes = (packed[:, None] >> shifts8) & mask
    return codes.reshape(-1)[:count]


@dataclass(frozen=True, eq=False)
class QuantizedRows:
    """Quantized ``[n_rows, dim]`` float array: fp16 ``scale`` and ``bias`` per
    row and the bit-packed codes (see the packing note above).

    :meth:`to_bytes` layout, little-endian: a 24-byte header (``b"SQRW"``,
    version u8 = 1, bits u8, u16 0, n_rows u64, dim u64), then n_rows fp16
    scales, n_rows fp16 biases, then the codes.
    """

    bits: int
    shape: tuple[int, int]
    scale: npt.NDArray[np.float16]
    bias: npt.NDArray[np.float16]
    codes: npt.NDArray[np.uint8]
    #: relative L2 error of the restored rows against the quantized ones, measured while they
    #: were encoded (NaN when parsed from bytes); not serialized
    rel_error: float = math.nan

    # magic, version, bits, reserved, n_rows, dim (little-endian)
    _HEADER = struct.Struct("<4sBBHQQ")
    _MAGIC = b"SQRW"
    _VERSION = 1

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        n_rows, dim = self.shape
        if self.scale.shape != (n_rows,) or self.bias.shape != (n_rows,):
            raise ValueError(f"scale/bias need shape ({n_rows},), got {self.scale.shape}/{self.bias.shape}")
        if self.codes.shape != ((n_rows * dim * self.bits + 7) // 8,):
            raise ValueError(
                f"codes hold {self.codes.size} bytes, {self.shape} at {self.bits} bits needs more"
            )

    @property
    def nbytes(self) -> int:
        """Size of :meth:`to_bytes`: header + 4 bytes per row + ceil(n * dim * bits / 8)."""
        return self._HEADER.size + 4 * self.shape[0] + self.codes.size

    def to_bytes(self) -> bytes:
        header = self._HEADER.pack(self._MAGIC, self._VERSION, self.bits, 0, *self.shape)
        return b"".join(
            [
                header,
                self.scale.astype("<f2").tobytes(),
                self.bias.astype("<f2").tobytes(),
                self.codes.tobytes(),
            ]
        )

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> QuantizedRows:
        """Parse :meth:`to_bytes` output; the arrays are read-only views of ``data``."""
        buf = memoryview(data).cast("B")
        if len(buf) < cls._HEADER.size:
            raise ValueError(f"quantized blob of {len(buf)} bytes is shorter than its header")
        magic, version, bits, _, n_rows, dim = cls._HEADER.unpack_from(buf)
        if magic != cls._MAGIC or version != cls._VERSION:
            raise ValueError(f"not a quantized-rows blob (magic {magic!r}, version {version})")
        _check_bits(bits)
        n_codes = (n_rows * dim * bits + 7) // 8
        expected = cls._HEADER.size + 4 * n_rows + n_codes
        if len(buf) != expected:
            raise ValueError(f"quantized blob is {len(buf)} bytes, header says {expected}")
        off = cls._HEADER.size
        scale = np.frombuffer(buf, "<f2", n_rows, off)
        bias = np.frombuffer(buf, "<f2", n_rows, off + 2 * n_rows)
        codes = np.frombuffer(buf, np.uint8, n_codes, off + 4 * n_rows)
        return cls(
            bits,
            (n_rows, dim),
            scale.astype(np.float16, copy=False),
            bias.astype(np.float16, copy=False),
            codes,
        )


def quantize_rows(
    rows: npt.ArrayLike,
    bits: int,
    *,
    greedy: bool = True,
    method: Literal["fast", "torch"] = "fast",
    n_bins: int = 200,
    ratio: float = 0.16,
    keep_best_seen: bool = False,
    workers: int = 1,
) -> QuantizedRows:
    """Quantize each row of a float ``[n_rows, dim]`` array to ``bits`` (2, 3, 4 or 8).

    The range is searched (``greedy=True``, with ``n_bins``, ``ratio`` and ``workers``; the
    paper uses it at <= 4 bits, where it pays most): by :func:`fast_range` (``method="fast"``)
    or by torch's own search, :func:`greedy_range` (``method="torch"``, with
    ``keep_best_seen``: the codes of fbgemm's ``optimized_qparams`` prepack); or it is the
    row's min/max. Raises ``ValueError`` for another bit width and for rows with NaN/inf or
    beyond ±65504.

    Idempotent: ``quantize_rows(dequantize_rows(q), bits)`` (same arguments) is ``q`` bit
    for bit, so a restored row that has not changed since is stored again without new error.
    A row whose values lie on its min/max grid is stored exactly; the rare row whose encoding
    does not dequantize to such values (a constant row, a row far from 0 relative to its
    spread, a subnormal fp16 scale) is re-quantized from its dequantized values, which
    differ from fbgemm's there (see ``_settle``). Costs ~15-20% over the search alone.
    """
    return quantize_parts(
        rows,
        bits,
        greedy=greedy,
        method=method,
        n_bins=n_bins,
        ratio=ratio,
        keep_best_seen=keep_best_seen,
        workers=workers,
    ).join()


@dataclass(frozen=True)
class Part:
    """Consecutive rows quantized on their own, with their squared error and norm, so parts
    quantized apart (by worker processes) join into one :class:`QuantizedRows` with one error."""

    q: QuantizedRows
    diff_sq: float
    norm_sq: float

    def join(self) -> QuantizedRows:
        return join_parts([self])


def join_parts(parts: Sequence[Part]) -> QuantizedRows:
    """One :class:`QuantizedRows` of ``parts`` in order; every part but the last must hold a
    multiple of 8 rows, so its codes end on a byte boundary."""
    if not parts:
        raise ValueError("nothing to join")
    first = parts[0].q
    dim, bits = first.shape[1], first.bits
    for p in parts[:-1]:
        if p.q.shape[0] % 8 or p.q.shape[1] != dim or p.q.bits != bits:
            raise ValueError(f"cannot join a part of shape {p.q.shape} at {p.q.bits} bits")
    if parts[-1].q.shape[1] != dim or parts[-1].q.bits != bits:
        raise ValueError(f"cannot join a part of shape {parts[-1].q.shape} at {parts[-1].q.bits} bits")
    error = norm_ratio(sum(p.diff_sq for p in parts), sum(p.norm_sq for p in parts))
    if len(parts) == 1:
        return replace(first, rel_error=error)
    return QuantizedRows(
        bits,
        (sum(p.q.shape[0] for p in parts), dim),
        np.concatenate([p.q.scale for p in parts]),
        np.concatenate([p.q.bias for p in parts]),
        np.concatenate([p.q.codes for p in parts]),
        error,
    )


def quantize_parts(
    rows: npt.ArrayLike,
    bits: int,
    *,
    greedy: bool = True,
    method: Literal["fast", "torch"] = "fast",
    n_bins: int = 200,
    ratio: float = 0.16,
    keep_best_seen: bool = False,
    workers: int = 1,
) -> Part:
    """:func:`quantize_rows` as a :class:`Part` (what a worker process sends back)."""
    if method not in ("fast", "torch"):
        raise ValueError(f"method={method!r} is not 'fast' or 'torch'")
    bits = _check_bits(bits)
    arr = _as_rows(rows)
    if not greedy and arr.size:
        return _minmax_part(arr, bits)  # validates the rows as it goes
    return _blockwise_part(
        arr,
        bits,
        greedy=greedy,
        fast=method == "fast",
        n_bins=n_bins,
        ratio=ratio,
        keep_best_seen=keep_best_seen,
        workers=workers,
    )


def _blockwise_part(
    arr: F32,
    bits: int,
    *,
    greedy: bool,
    fast: bool = True,
    n_bins: int = 200,
    ratio: float = 0.16,
    keep_best_seen: bool = False,
    workers: int = 1,
) -> Part:
    """:func:`quantize_parts` of validated-shape float32 rows, block by block: every search, and
    the reference that :func:`_minmax_part` reproduces byte for byte."""
    _require_quantizable(arr)
    n_rows, dim = arr.shape
    qmax = np.float32((1 << bits) - 1)
    if greedy:
        lo, hi = _search(arr, bits, n_bins, ratio, workers, fast=fast, keep_best_seen=keep_best_seen)
    elif dim:
        lo, hi = arr.min(axis=1), arr.max(axis=1)
    else:
        lo = hi = np.zeros(n_rows, np.float32)
    bias, scale, inv = _qparams(lo, hi, qmax)
    scale[scale == 0] = 1.0  # a range below the smallest fp16 scale: store 1, as torch's prepack

    def search(rows: F32) -> tuple[F32, F32]:
        if greedy:
            return _search(rows, bits, n_bins, ratio, 1, fast=fast, keep_best_seen=keep_best_seen)
        return rows.min(axis=1), rows.max(axis=1)

    # Packed block by block, so the only full-size array is the packed codes themselves. A
    # block of a multiple of 8 rows packs to whole bytes (and whole 3-bit groups).
    packed = np.empty((n_rows * dim * bits + 7) // 8, np.uint8)
    block = _block_rows(dim)
    diff_sq = norm_sq = 0.0
    for s in range(0, n_rows, block):
        x = arr[s : s + block]
        t = _codes(x, bias[s : s + block], inv[s : s + block], qmax)
        if dim:
            t = _settle(arr[s : s + block], t, scale[s : s + block], bias[s : s + block], qmax, search)
            # The error while the block is in cache: no second pass over the table to measure it.
            diff_sq += squared_error(x, _decode(t, scale[s : s + block], bias[s : s + block]))
            norm_sq += squared_norm(x)
        lo = s * dim * bits // 8
        chunk = _pack(t.astype(np.uint8), bits)
        packed[lo : lo + chunk.size] = chunk
    q = QuantizedRows(bits, (n_rows, dim), scale.astype(np.float16), bias.astype(np.float16), packed)
    return Part(q, diff_sq, norm_sq)


#: Float32 elements per chunk of :func:`_minmax_part`'s elementwise work: the chunk and its
#: scratch stay in L2/L3, and its ~40 numpy calls cost little beside the work.
_CHUNK_ELEMS = 1 << 19
#: Float32 elements per transposed piece: the rows being read stay in L2 for all their groups.
_TRANSPOSE_ELEMS = 1 << 16
#: Floats moved together by :func:`_minmax_part`'s transposes, and the element types that carry
#: them (bit patterns copied as they are) for the values and for the codes.
_GROUP_TYPES: dict[int, tuple[type[np.generic], type[np.generic]]] = {
    4: (np.complex128, np.uint32),
    2: (np.uint64, np.uint16),
    1: (np.uint32, np.uint8),
}


def _minmax_part(arr: F32, bits: int) -> Part:
    """:func:`quantize_parts` with ``greedy=False``: the same bytes, ~7x faster (1M x 64 rows:
    1.2 s -> 0.17 s, ~3x fbgemm's rowwise 8-bit kernel on one core).

    numpy pays per call of its inner loops, and the blockwise path's per-row operations (a
    reduction over each row's ``dim`` values, ``x - bias[:, None]``) make one call per row.
    Here each chunk of rows is transposed, ``g`` floats at a time (``g`` = 4, 2 or 1 dividing
    ``dim``), to ``[dim / g, rows * g]``: the row min/max become elementwise minimum/maximum of
    long vectors (then of ``g`` neighbours), scale and bias long vectors (each repeated ``g``
    times), and the codes go back ``g`` at a time as one ``uint{8g}``. Each value comes from
    the same float32 operations as in :func:`_codes` and :func:`_decode`.

    :func:`_settle` keeps a row's encoding when re-encoding its decoded values gives it back.
    That is decided here per row without its elements: codes and decoded values are monotone
    in ``x``, so their extremes are those of the row's min and max, and where the float32
    rounding of ``code * scale + bias`` is at most a quarter step (``|y| * 2^-24 <= |scale| /
    4``) ``rint((y - bias) / scale)`` returns every code (:func:`_unsettled`). The other rows
    (constant rows, rows far from 0 relative to their spread, subnormal fp16 scales: rare) go
    through :func:`_settle` by the blockwise path's blocks, as there."""
    n_rows, dim = arr.shape
    qmax = np.float32((1 << bits) - 1)
    g = 4 if dim % 4 == 0 else 2 if dim % 2 == 0 else 1
    elem, code_elem = _GROUP_TYPES[g]
    block = _block_rows(dim)
    chunk = min(block, max(8, (_CHUNK_ELEMS // dim) // 8 * 8))
    step = max(1, _TRANSPOSE_ELEMS // dim)
    scale16, bias16 = np.empty(n_rows, np.float16), np.empty(n_rows, np.float16)
    packed = np.empty((n_rows * dim * bits + 7) // 8, np.uint8)
    # Scratch allocated once (fresh pages would cost a page fault per 4 KiB): per block, rows'
    # min, max, bias, scale and 1/scale; per chunk, the transposed chunk, its codes (float and
    # uint8), and bias, scale and 1/scale repeated g times.
    params = np.empty((5, min(block, n_rows)), np.float32)
    held = np.empty((dim // g, chunk), elem)
    scratch = np.empty(chunk * dim, np.float32)
    small = np.empty(chunk * dim, np.uint8)
    reps = np.empty((3, chunk * g), np.float32)
    diff_sq = norm_sq = 0.0
    for b0 in range(0, n_rows, block):
        b1 = min(n_rows, b0 + block)
        lo, hi, bias, scale, inv = params[:, : b1 - b0]
        codes = (
            packed[b0 * dim : b1 * dim].reshape(-1, dim) if bits == 8 else np.empty((b1 - b0, dim), np.uint8)
        )
        for c0 in range(0, b1 - b0, chunk):
            c1 = min(b1 - b0, c0 + chunk)
            k = c1 - c0
            x = arr[b0 + c0 : b0 + c1]
            # The chunk transposed, xf[j, r * g + i] == x[r, j * g + i], a few hundred KiB of
            # rows at a time: each cache line of x is then read from memory once (~2x faster).
            xt = held[:, :k]
            for r in range(0, k, step):
                np.copyto(xt[:, r : r + step], x[r : r + step].view(elem).T)
            xf = xt.view(np.float32)
            _fold(np.minimum.reduce(xf, axis=0), g, np.minimum, lo[c0:c1])
            _fold(np.maximum.reduce(xf, axis=0), g, np.maximum, hi[c0:c1])
            # NaN propagates through both: a row with NaN, inf or |x| > 65504 fails here.
            if not ((lo[c0:c1] >= -FP16_MAX) & (hi[c0:c1] <= FP16_MAX)).all():
                _require_quantizable(arr)  # raises, naming the table's first such row
            zero = np.flatnonzero(lo[c0:c1] == 0)
            if zero.size:  # a zero minimum's sign becomes the fp16 bias's: numpy's row min decides it
                lo[c0 + zero] = x[zero].min(axis=1)
            bias[c0:c1], scale[c0:c1], inv[c0:c1] = _qparams(lo[c0:c1], hi[c0:c1], qmax)
            scale[c0:c1][scale[c0:c1] == 0] = 1.0
            # Codes are monotone in x: those of the row's min and max are its extremes.
            ends = np.rint((params[:2, c0:c1] - bias[c0:c1]) * inv[c0:c1])
            clip = bool((ends < 0).any() or (ends > qmax).any())
            # bias, scale and 1/scale for each value of xf (g strided copies beat np.repeat)
            rep = reps[:, : k * g]
            for i in range(g):
                rep.reshape(3, k, g)[:, :, i] = params[2:, c0:c1]
            bg, sg, ig = rep
            t = scratch[: xf.size].reshape(xf.shape)
            np.subtract(xf, bg, out=t)
            np.multiply(t, ig, out=t)
            np.rint(t, out=t)
            if clip:
                np.clip(t, np.float32(0.0), qmax, out=t)
            u8 = small[: t.size].reshape(t.shape)
            np.copyto(u8, t, casting="unsafe")
            dst, src = codes[c0:c1].view(code_elem), u8.view(code_elem)
            for j in range(src.shape[0]):  # numpy would loop over each row's dim / g groups
                dst[:, j] = src[j]
            # The decode error while the chunk is in cache: x - (code * scale + bias).
            np.multiply(t, sg, out=t)
            np.add(t, bg, out=t)
            np.subtract(xf, t, out=t)
            diff_sq += _sum_squares(t)
            norm_sq += _sum_squares(xf)
        loose = _unsettled(lo, hi, bias, scale, inv, qmax)
        if loose.size:
            diff_sq += _settle_loose(arr[b0:b1], codes, scale, bias, inv, loose, qmax)
        scale16[b0:b1], bias16[b0:b1] = _to_f16(scale), _to_f16(bias)
        if bits < 8:
            out = _pack(codes, bits)
            packed[b0 * dim * bits // 8 :][: out.size] = out
    return Part(QuantizedRows(bits, (n_rows, dim), scale16, bias16, packed), diff_sq, norm_sq)


def _to_f16(a: F32) -> npt.NDArray[np.float16]:
    """float32 values that fp16 holds exactly, as float16, from their bits (numpy's cast is a
    scalar loop): scaled by 2**-112 (exact), fp16's exponent range lands on float32's lowest,
    normals and subnormals alike, and the fp16 bits are the float32 ones shifted by 13."""
    magnitude = (np.abs(a) * np.float32(2.0**-112)).view(np.uint32) >> np.uint32(13)
    sign = (a.view(np.uint32) >> np.uint32(16)) & np.uint32(0x8000)
    return (magnitude | sign).astype(np.uint16).view(np.float16)


def _unsettled(lo: F32, hi: F32, bias: F32, scale: F32, inv: F32, qmax: np.float32) -> npt.NDArray[np.intp]:
    """Rows whose min/max encoding :func:`_minmax_part` cannot show to be kept by :func:`_settle`.

    Codes and decoded values ``y`` are monotone in ``x``: ``y``'s extremes are the decoded codes
    of the row's min and max, which give the bias and scale of the re-encoding; and where the
    rounding of ``y = code * scale + bias`` (``|y| * 2**-24``) is below a quarter step,
    ``rint((y - bias) / scale)`` returns every code. Most rows pass at a few operations each:
    min at code 0 (``y`` = bias), max at code ``qmax`` with ``qmax * scale + bias - bias``
    exact (the same scale again), rounding below an eighth of a step."""
    ends = np.rint((np.stack([lo, hi]) - bias) * inv)
    top = qmax * scale  # exact: an fp16 value times an integer of 8 bits
    y_hi = top + bias
    magnitude = np.maximum(np.abs(bias), np.abs(y_hi))
    easy = (scale > 0) & (ends[0] <= 0) & (ends[1] >= qmax) & (y_hi - bias == top)
    easy &= magnitude * np.float32(2.0**-21) <= scale
    hard = np.flatnonzero(~easy)
    if not hard.size:
        return hard
    ends = np.clip(ends[:, hard], np.float32(0.0), qmax)
    y = ends * scale[hard] + bias[hard]
    y_lo, y_hi = y.min(axis=0), y.max(axis=0)
    b2, s2, _ = _qparams(y_lo, y_hi, qmax)
    s2[s2 == 0] = 1.0
    rounding = np.maximum(np.abs(y_lo), np.abs(y_hi)).astype(np.float64) * 2.0**-24 + 2.0**-149
    kept = (
        (b2 == bias[hard]) & (s2 == scale[hard]) & (rounding <= np.abs(scale[hard]).astype(np.float64) * 0.25)
    )
    return hard[~kept]


def _settle_loose(
    rows: F32,
    codes: npt.NDArray[np.uint8],
    scale: F32,
    bias: F32,
    inv: F32,
    loose: npt.NDArray[np.intp],
    qmax: np.float32,
) -> float:
    """What :func:`_settle` does to one block of the blockwise path, for the ``loose`` rows
    that :func:`_unsettled` names; updates ``codes``, ``scale`` and ``bias`` in place and
    returns the change in the block's squared decode error.

    _settle treats each row on its own but for one thing: when any row of the block changes,
    every row is stored with the min/max encoding of its decoded values, equal to its own but
    for a zero bias's sign (``-0`` becomes ``+0``). Those rows join the loose ones then."""
    xs = rows[loose]
    t = _codes(xs, bias[loose], inv[loose], qmax)
    before = squared_error(xs, _decode(t, scale[loose], bias[loose]))
    every = loose
    if not _keeps(t, scale[loose], bias[loose], qmax):
        every = np.union1d(loose, np.flatnonzero((bias == 0) & np.signbit(bias)))
        t = _codes(rows[every], bias[every], inv[every], qmax)
    s, b = scale[every], bias[every]
    t = _settle(rows[every], t, s, b, qmax, _minmax_range)
    codes[every], scale[every], bias[every] = t.astype(np.uint8), s, b
    mine = np.isin(every, loose)
    return squared_error(xs, _decode(t[mine], s[mine], b[mine])) - before


def _keeps(codes: F32, scale: F32, bias: F32, qmax: np.float32) -> bool:
    """:func:`_settle`'s test that rows keep their min/max encoding: that of their decoded values
    is the same, codes, scale and bias."""
    y = _decode(codes, scale, bias)
    b2, s2, inv2 = _qparams(y.min(axis=1), y.max(axis=1), qmax)
    s2[s2 == 0] = 1.0
    return bool(
        (b2 == bias).all() and (s2 == scale).all() and np.array_equal(_codes(y, b2, inv2, qmax), codes)
    )


def _fold(v: F32, g: int, op: np.ufunc, out: F32) -> None:
    """``out[r] = op`` over ``v[r * g : (r + 1) * g]``."""
    runs = v.reshape(-1, g)
    if g == 1:
        out[:] = runs[:, 0]
        return
    op(runs[:, 0], runs[:, 1], out=out)
    for i in range(2, g):
        op(out, runs[:, i], out=out)


def _sum_squares(a: F32) -> float:
    """Sum of the squares of ``a`` ([dim / g, rows * g], overwritten): float32 squares summed
    down the first axis, so each row's share is the same however the table was cut into
    chunks or parts (their errors join to the whole's), then summed in float64."""
    np.multiply(a, a, out=a)
    return float(np.add.reduce(a, axis=0).sum(dtype=np.float64))


def _minmax_range(rows: F32) -> tuple[F32, F32]:
    return rows.min(axis=1), rows.max(axis=1)


#: Rounds of :func:`_settle`; one re-quantization has always reached a fixed point in the
#: measurements (constant, offset, subnormal-scale rows), the rest is margin.
_SETTLE_ROUNDS = 4


def _codes(rows: F32, bias: F32, inv: F32, qmax: np.float32) -> F32:
    """``clip(rint((x - bias) * inv), 0, qmax)`` per row, as float32."""
    t = np.subtract(rows, bias[:, None])
    np.multiply(t, inv[:, None], out=t)
    np.rint(t, out=t)
    np.clip(t, np.float32(0.0), qmax, out=t)
    return t


def _decode(codes: F32, scale: F32, bias: F32) -> F32:
    """What :func:`dequantize_rows` computes: ``codes * scale`` then ``+ bias``, float32."""
    out = np.multiply(codes, scale[:, None])
    out += bias[:, None]
    return out


def _minmax_encode(rows: F32, qmax: np.float32) -> tuple[F32, F32, F32]:
    """(bias, scale, codes) of ``rows`` on their own [min, max] range, as :func:`quantize_rows`."""
    bias, scale, inv = _qparams(rows.min(axis=1), rows.max(axis=1), qmax)
    scale[scale == 0] = 1.0
    return bias, scale, _codes(rows, bias, inv, qmax)


def _settle(
    rows: F32,
    codes: F32,
    scale: F32,
    bias: F32,
    qmax: np.float32,
    search: Callable[[F32], tuple[F32, F32]],
) -> F32:
    """Make the encoding of a block of ``rows`` idempotent: ``quantize(dequantize(q)) == q``
    bit for bit (codes, scale, bias), so a row restored from a quantized checkpoint and not
    updated since is stored again exactly, without new error, at the next one.

    The rule: a row that min/max quantization reproduces exactly (its values lie on that
    grid) is stored with that encoding, exactly; every other row is stored so that its
    dequantized values are such a row. In steps:

    * The search may trim such a row's range where its error at [min, max], zero but for
      float32 rounding, ties or loses to a trim by rounding alone (a range of a few float32
      ulps per step, far from 0). The searched encoding then restores the row to within
      rounding: rows that come back that close but not equal are checked and, if exact,
      take the min/max encoding.
    * A row's dequantized values ``y`` lie on its grid; where the min/max encoding of ``y``
      reproduces ``y`` (almost always the encoding the row already has) the row takes it,
      which is what a re-quantization of ``y`` gives (the rule above).
    * Where it does not (the fp16 bias more than half a step below the row's minimum, or a
      subnormal fp16 scale that leaves the top code unused: constant rows, rows far from 0
      relative to their spread, ranges under ~0.015 at 8 bits), the row is re-quantized from
      ``y`` with the same range search, which lands it on such a grid (measured: one round;
      the values move by less than a step), and checked again.

    Updates ``scale`` and ``bias`` (views of the caller's arrays) in place; returns the codes."""
    y = _decode(codes, scale, bias)
    diff = np.subtract(y, rows)
    deviation = np.maximum(diff.max(axis=1), -diff.min(axis=1))
    del diff
    # Bound of the rounding-only deviation (per element ~1.5 float32 ulps of the row's
    # largest magnitude for the L2 error at [min, max], times sqrt(dim) for the search's
    # sum of squares), with margin; the magnitude is y's, within that bound of the row's.
    y_lo, y_hi = y.min(axis=1), y.max(axis=1)
    ulps = np.float32((2.0 * math.sqrt(rows.shape[1]) + 8.0) * 2.0**-23)
    tol = np.maximum(np.abs(y_lo), np.abs(y_hi)) * ulps + np.float32(np.finfo(np.float32).tiny)
    near = np.flatnonzero((deviation > 0) & (deviation <= tol))
    if near.size:
        xs = rows[near]
        b1, s1, c1 = _minmax_encode(xs, qmax)
        on_grid = (_decode(c1, s1, b1) == xs).all(axis=1)
        idx = near[on_grid]
        codes[idx], scale[idx], bias[idx], y[idx] = c1[on_grid], s1[on_grid], b1[on_grid], xs[on_grid]
        y_lo[idx], y_hi[idx] = xs[on_grid].min(axis=1), xs[on_grid].max(axis=1)
    # The common case first: the min/max encoding of y is the row's own (same scale, bias
    # and codes, hence the same values), for every row of the block.
    b2, s2, inv2 = _qparams(y_lo, y_hi, qmax)
    s2[s2 == 0] = 1.0
    c2 = _codes(y, b2, inv2, qmax)
    if (b2 == bias).all() and (s2 == scale).all() and np.array_equal(c2, codes):
        return codes
    todo = np.arange(codes.shape[0])
    for _ in range(_SETTLE_ROUNDS):
        b2, s2, c2 = _minmax_encode(y, qmax)
        exact = (_decode(c2, s2, b2) == y).all(axis=1)
        if todo.size == codes.shape[0] and exact.all():  # every row, no indexing
            scale[:], bias[:] = s2, b2
            return c2
        done = todo[exact]
        codes[done], scale[done], bias[done] = c2[exact], s2[exact], b2[exact]
        if exact.all():
            return codes
        todo, y = todo[~exact], np.ascontiguousarray(y[~exact])
        lo, hi = search(y)
        cur_bias, cur_scale, inv = _qparams(lo, hi, qmax)
        cur_scale[cur_scale == 0] = 1.0
        cur_codes = _codes(y, cur_bias, inv, qmax)
        codes[todo], scale[todo], bias[todo] = cur_codes, cur_scale, cur_bias
        y = _decode(cur_codes, cur_scale, cur_bias)
    return codes


def _block_rows(dim: int) -> int:
    """Rows per block of ~1M elements, a multiple of 8 (see :func:`quantize_rows`)."""
    return max(8, ((1 << 20) // max(dim, 1)) // 8 * 8)


def dequantize_block(q: QuantizedRows, start: int, stop: int) -> F32:
    """Rows ``[start, stop)`` of :func:`dequantize_rows`; ``start`` a multiple of 8."""
    if start % 8:
        raise ValueError(f"block start {start} is not a multiple of 8")
    n_rows, dim = q.shape
    stop = min(stop, n_rows)
    lo = start * dim * q.bits // 8
    hi = (stop * dim * q.bits + 7) // 8
    codes = _unpack(q.codes[lo:hi], q.bits, (stop - start) * dim).reshape(stop - start, dim)
    out = codes.astype(np.float32)
    out *= q.scale[start:stop].astype(np.float32)[:, None]
    out += q.bias[start:stop].astype(np.float32)[:, None]
    return out


def quantization_error(original: F32, q: QuantizedRows) -> float:
    """:func:`relative_l2_error` of ``original`` and ``dequantize_rows(q)``, block by block:
    scratch stays at ~1M elements whatever the table's size."""
    n_rows, dim = q.shape
    if original.shape != (n_rows, dim):
        raise ValueError(f"shapes differ: {original.shape} vs {q.shape}")
    block = _block_rows(dim)
    return norm_ratio(
        sum(
            squared_error(original[s : s + block], dequantize_block(q, s, s + block))
            for s in range(0, n_rows, block)
        ),
        squared_norm(original),
    )


def dequantize_rows(q: QuantizedRows) -> F32:
    """``code * scale + bias`` in float32 with the stored fp16 scale and bias."""
    n_rows, dim = q.shape
    codes = _unpack(q.codes, q.bits, n_rows * dim).reshape(n_rows, dim)
    out = codes.astype(np.float32)
    out *= q.scale.astype(np.float32)[:, None]
    out += q.bias.astype(np.float32)[:, None]
    return out


def relative_l2_error(original: npt.ArrayLike, restored: npt.ArrayLike) -> float:
    """``||a - b|| / ||a||``, computed in float32 blocks of ~1M elements with the sums of
    squares accumulated in float64 (no full-size temporaries). For an all-zero ``a`` it is 0
    when ``b`` is zero too and ``inf`` otherwise (an error on a zero tensor is not small)."""
    a = np.asarray(original)
    b = np.asarray(restored)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    a, b = a.reshape(-1), b.reshape(-1)
    step = 1 << 20
    return norm_ratio(
        sum(squared_error(a[s : s + step], b[s : s + step]) for s in range(0, a.size, step)), squared_norm(a)
    )


def squared_error(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> float:
    """Sum of squared differences: float32 arithmetic, summed in float64 (numpy casts the sum
    in small buffers, so the only temporary is one float32 block)."""
    d = np.subtract(a, b, dtype=np.float32)
    np.multiply(d, d, out=d)
    return float(d.sum(dtype=np.float64))


def squared_norm(a: npt.NDArray[Any]) -> float:
    flat = a.reshape(-1)
    step = 1 << 20
    total = 0.0
    for s in range(0, flat.size, step):
        x = np.square(flat[s : s + step], dtype=np.float32)
        total += float(x.sum(dtype=np.float64))
    return total


def norm_ratio(diff_sq: float, norm_sq: float) -> float:
    diff, norm = math.sqrt(diff_sq), math.sqrt(norm_sq)
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


# --- bfloat16 / float16 ------------------------------------------------------------------------


def bf16_to_f32(raw: npt.ArrayLike) -> F32:
    """Widen raw bfloat16 bits (``uint16``) to float32: the bits become the high half. Exact."""
    bits = np.asarray(raw)
    if bits.dtype not in (np.uint16, np.int16):
        raise TypeError(f"bfloat16 bits must be uint16 or int16, got {bits.dtype}")
    return (bits.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(values: npt.ArrayLike) -> npt.NDArray[np.uint16]:
    """Round float32 to bfloat16 bits, nearest even, as torch's ``.to(torch.bfloat16)``:
    add ``0x7fff + lsb`` to the float32 bits and keep the high half (finite values
    past the largest bf16 round to inf). Every NaN becomes ``0xffff``, as torch's
    vectorized CPU conversion writes it (its scalar path writes ``0x7fc0``)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    out[(u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)] = 0xFFFF
    return out


def downcast(
    rows: npt.ArrayLike, dtype: Literal["float16", "bfloat16"]
) -> npt.NDArray[np.float16 | np.uint16]:
    """The lossy-but-simple alternative to quantization: float16 values or raw
    bfloat16 bits (``uint16``; widen with :func:`bf16_to_f32`). NaN and inf are
    kept; a finite value beyond ±65504 raises ``ValueError`` for float16
    (it would silently become inf); bfloat16 covers the float32 range."""
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype={dtype!r} is not supported; use 'float16' or 'bfloat16'")
    src = np.asarray(rows)
    if dtype == "float16":
        with np.errstate(invalid="ignore"):
            big = np.isfinite(src) & (np.abs(src) > FP16_MAX)
        if big.any():
            where = np.unravel_index(int(np.argmax(big)), src.shape)
            raise ValueError(
                f"value at index {tuple(int(i) for i in where)} exceeds the float16 range ±{FP16_MAX:g}"
            )
        return src.astype(np.float16)
    with np.errstate(over="ignore"):  # float64 beyond float32 rounds to inf, as in torch
        return f32_to_bf16(src.astype(np.float32))


# --- bit width policy ----------------------------------------------------------------------------


def bits_for_restores(
    expected_restores: int, table: tuple[tuple[int, int], ...] = DEFAULT_RESTORE_TABLE
) -> int:
    """Bit width for a checkpoint expected to be restored ``expected_restores``
    times: the first ``(max_restores, bits)`` entry of ``table`` that covers it,
    8 bits beyond the table (default: 4 bits for up to 1 restore, 8 beyond; the paper's
    ``1:2,3:3,20:4`` moved the log loss of the bench's quality model by up to 0.17%)."""
    if expected_restores < 0:
        raise ValueError(f"expected_restores={expected_restores!r} must be >= 0")
    for limit, bits in sorted(table):
        if expected_restores <= limit:
            return _check_bits(bits)
    return 8


def escalate(bits_now: int, actual_restores: int, planned: int) -> int:
    """8 bits once restores exceed the plan (errors accumulate per restore), else ``bits_now``."""
    _check_bits(bits_now)
    return 8 if actual_restores > planned else bits_now


def benchmark(n_rows: int = 1 << 20, dim: int = 64, bits: int = 4, workers: int = 1) -> dict[str, float]:
    """Print and return wall and CPU seconds of the greedy range search, the whole
    quantization (search included) and dequantization of standard normal rows.
    ``python -m sidecar.pipeline.quantize [n_rows [dim [bits [workers]]]]``."""
    rows = np.random.default_rng(0).standard_normal((n_rows, dim), dtype=np.float32)
    result: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], _T]) -> _T:
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        result[f"{name}_s"] = time.perf_counter() - wall
        result[f"{name}_cpu_s"] = time.process_time() - cpu
        return out

    timed("greedy_range", lambda: greedy_range(rows, bits, workers=workers))
    q = timed("quantize", lambda: quantize_rows(rows, bits, workers=workers))
    restored = timed("dequantize", lambda: dequantize_rows(q))
    result["rel_l2_error"] = relative_l2_error(rows, restored)
    result["compression"] = rows.nbytes / q.nbytes
    print(f"{n_rows} x {dim} @ {bits} bits: " + ", ".join(f"{k}={v:.4g}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    import sys

    args = [int(a) for a in sys.argv[1:5]]
    benchmark(*args)


def to_f32(rows: npt.NDArray[np.uint8], dtype: str) -> F32:
    """Row bytes of a float tensor as float32 ``[rows, dim]`` (exact widening)."""
    if dtype == "float32":
        return rows.view(np.float32)
    if dtype == "float16":
        return rows.view(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_to_f32(rows.view(np.uint16))
    raise TypeError(f"{dtype} cannot be quantized")


def from_f32(values: F32, dtype: str) -> npt.NDArray[np.uint8]:
    """Float32 values back to the tensor's dtype, as row bytes."""
    out: npt.NDArray[np.float32 | np.float16 | np.uint16]
    if dtype == "float32":
        out = np.ascontiguousarray(values, np.float32)
    elif dtype == "float16":
        out = values.astype(np.float16)
    elif dtype == "bfloat16":
        out = f32_to_bf16(values)
    else:
        raise TypeError(f"{dtype} cannot be dequantized")
    return out.view(np.uint8).reshape(values.shape[0], values.shape[1] * out.itemsize)
