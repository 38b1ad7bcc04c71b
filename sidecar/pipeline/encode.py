"""Check-N-Run encodings of one snapshot: which rows changed, what to store, and back.

A tensor is stored in one of four encodings (the manifest's ``encoding``):

``raw``
    its bytes as they are.
``quantized``
    every row quantized (:mod:`sidecar.pipeline.quantize`, per-row fp16 scale and bias).
``rows-diff``
    a bitmap of the rows that differ from the base step (``ceil(rows / 8)`` bytes,
    little-endian bit order), then those rows' bytes. Restore applies it on top of
    the base step's restored tensor.
``rows-diff-quantized``
    the same bitmap, then the changed rows quantized.
``cast`` / ``rows-diff-cast``
    all rows, or bitmap and changed rows, downcast to ``cast`` (float16 or bfloat16).

Rows are the first dimension; a row is ``nbytes / rows`` bytes. Changed rows are
found by comparing bytes with the previous snapshot held in memory (so NaN, -0.0
and every other bit pattern compare exactly), in blocks so the temporaries stay
small, as 8-byte words where rows allow.

Only the persisted copy is encoded: the snapshot in memory stays exact.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sidecar.pipeline import quantize as qz
from sidecar.pipeline.workers import MIN_POOL_BYTES, EncodePool
from sidecar.shm import source_of

ENCODINGS = ("raw", "quantized", "rows-diff", "rows-diff-quantized", "cast", "rows-diff-cast")
#: dtypes quantization and downcasting understand (the rest is always stored exactly)
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
#: tensors smaller than this are always stored raw: a diff would save nothing worth its bitmap
MIN_DIFF_BYTES = 64 << 10
_BLOCK_BYTES = 8 << 20

Bool1D = npt.NDArray[np.bool_]
U8 = npt.NDArray[np.uint8]


def rows_of(shape: tuple[int, ...] | list[int]) -> int:
    """Rows of a tensor for diffs: its first dimension (1 for a scalar)."""
    return int(shape[0]) if len(shape) else 1


def diffable(shape: tuple[int, ...] | list[int], nbytes: int) -> bool:
    return nbytes >= MIN_DIFF_BYTES and len(shape) >= 1 and rows_of(shape) >= 2


def quantizable(dtype: str, shape: tuple[int, ...] | list[int]) -> bool:
    return dtype in FLOAT_DTYPES and len(shape) == 2 and shape[0] > 0 and shape[1] > 0


def as_rows(data: memoryview | bytes | bytearray, shape: tuple[int, ...] | list[int]) -> U8:
    """A ``[rows, row_bytes]`` uint8 view of a tensor's bytes (no copy)."""
    flat = np.frombuffer(data, np.uint8)
    rows = rows_of(shape)
    return flat.reshape(rows, flat.size // rows if rows else 0)


def changed_rows(current: U8, previous: U8) -> Bool1D:
    """Which rows differ in any byte, vectorized block by block."""
    if current.shape != previous.shape:
        raise ValueError(f"cannot compare rows of shapes {current.shape} and {previous.shape}")
    rows, width = current.shape
    out = np.zeros(rows, np.bool_)
    if not rows or not width:
        return out
    word = np.uint64 if width % 8 == 0 else np.uint32 if width % 4 == 0 else np.uint8
    block = max(1, _BLOCK_BYTES // width)
    for s in range(0, rows, block):
        a = current[s : s + block].view(word)
        b = previous[s : s + block].view(word)
        np.any(a != b, axis=1, out=out[s : s + block])
    return out


#: Per-group digests (:func:`row_digests`): two 32-bit hashes per group of rows
DIGEST_WIDTH = 2
#: A digest stands for a group of consecutive rows of at least this many bytes, so digests
#: cost at most 8 bytes per 256 of a tensor (1/32) however narrow its rows: a 1-D tensor
#: (ZeRO/FSDP flat parameters, optimizer partitions) has a row per element.
DIGEST_GROUP_BYTES = 256
#: Keys of this process's digests, by group width in limbs: random, so no data is more likely
#: than another to collide; digests live with a chain in this process only, never stored.
_DIGEST_KEYS: dict[int, tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]] = {}


def digest_group(row_bytes: int) -> int:
    """Rows a digest stands for: ``ceil(DIGEST_GROUP_BYTES / row_bytes)`` (a changed group marks
    all its rows changed, a superset of those that did)."""
    return max(1, -(-DIGEST_GROUP_BYTES // row_bytes)) if row_bytes > 0 else 1


def digest_groups(rows: int, row_bytes: int) -> int:
    """How many digests a tensor of ``rows`` rows of ``row_bytes`` has."""
    return -(-rows // digest_group(row_bytes))


def _hash(groups: U8) -> npt.NDArray[np.uint32]:
    """Both hashes of every row of ``groups`` (see :func:`row_digests`), block by block."""
    n, width = groups.shape
    out = np.zeros((n, DIGEST_WIDTH), np.uint32)
    if not n or not width:
        return out
    word = np.uint32 if width % 4 == 0 else np.uint16 if width % 2 == 0 else np.uint8
    limbs = width // np.dtype(word).itemsize
    keys = _DIGEST_KEYS.get(limbs)
    if keys is None:
        raw = np.frombuffer(os.urandom(8 * (limbs + 1) * DIGEST_WIDTH), np.uint64)
        fresh = (raw[DIGEST_WIDTH:].reshape(limbs, DIGEST_WIDTH).copy(), raw[:DIGEST_WIDTH].copy())
        keys = _DIGEST_KEYS.setdefault(limbs, fresh)
    mult, add = keys
    block = min(n, max(1, (4 << 20) // (8 * limbs)))
    shift = np.uint64(32)
    # One widened block reused: a fresh one per block would fault in new pages every time (the
    # kernel zeroing them cost as much CPU as the hashing).
    wide = np.empty((block, limbs), np.uint64)
    for s in range(0, n, block):
        part = np.ascontiguousarray(groups[s : s + block]).view(word)
        w = wide[: len(part)]
        np.copyto(w, part)
        out[s : s + block] = (w @ mult + add) >> shift  # unsigned: wraps mod 2**64
    return out


def row_digests(rows: U8) -> npt.NDArray[np.uint32]:
    """Two independent multilinear hashes (Lemire and Kaser, "Strongly universal string hashing
    is fast") of every group of :func:`digest_group` rows (the last group may be shorter): the
    group as 32-bit limbs x_i (16- or 8-bit where its width is not a multiple of 4),
    h = ((k_0 + sum k_i x_i) mod 2**64) >> 32 with random 64-bit keys k_i. Two different groups
    get the same 32-bit hash with probability at most about 2**-31 for each of the two independent
    key sets, 2**-62 for both, whatever the data (the keys are drawn at random in this process).
    8 bytes per group, about twice the CPU of comparing the bytes with a copy of them, for one
    read of them instead of two."""
    n, width = rows.shape
    g = digest_group(width)
    whole = n // g
    out = np.zeros((digest_groups(n, width), DIGEST_WIDTH), np.uint32)
    if not n or not width:
        return out
    out[:whole] = _hash(rows[: whole * g].reshape(whole, g * width))
    if whole * g < n:
        out[whole:] = _hash(np.ascontiguousarray(rows[whole * g :]).reshape(1, -1))
    return out


def group_digests(rows: U8, which: npt.NDArray[np.intp]) -> npt.NDArray[np.uint32]:
    """What :func:`row_digests` gives for the groups ``which`` (ascending) only, gathered block by
    block: the temporary copy stays small however many rows are looked up."""
    n, width = rows.shape
    g = digest_group(width)
    whole = n // g
    out = np.zeros((len(which), DIGEST_WIDTH), np.uint32)
    if not n or not width or not len(which):
        return out
    groups = rows[: whole * g].reshape(whole, g * width)
    block = max(1, _BLOCK_BYTES // (g * width))
    for s in range(0, len(which), block):
        idx = which[s : s + block]
        inside = idx < whole
        part = out[s : s + block]
        part[inside] = _hash(groups[idx[inside]])
        if not inside.all():  # the last, shorter group
            part[~inside] = _hash(np.ascontiguousarray(rows[whole * g :]).reshape(1, -1))
    return out


def rows_of_groups(changed: Bool1D, rows: int, row_bytes: int) -> Bool1D:
    """Per row: whether its digest group is marked in ``changed``."""
    return np.repeat(changed, digest_group(row_bytes))[:rows]


@dataclass
class Encoded:
    """One tensor's stored form: ``pieces`` back to back are its payload."""

    encoding: str
    pieces: list[memoryview | bytes]
    bits: int = 0
    #: relative L2 error of what was quantized (None when lossless)
    error: float | None = None
    changed: int = -1  # rows written by a diff
    cast: str = ""

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.pieces)


def bitmap_bytes(rows: int) -> int:
    return (rows + 7) // 8


def quantized_bytes(rows: int, dim: int, bits: int) -> int:
    """Size of ``QuantizedRows.to_bytes`` for ``rows`` x ``dim`` at ``bits`` (header included)."""
    return qz.QuantizedRows._HEADER.size + 4 * rows + (rows * dim * bits + 7) // 8


def encoded_bytes(
    encoding: str, shape: list[int] | tuple[int, ...], itemsize: int, changed: int, bits: int
) -> int:
    """What :func:`encode` writes, from sizes alone (benchmarks price encodings with it)."""
    rows = rows_of(shape)
    row_bytes = itemsize * (math.prod(shape) // rows if rows else 0)
    dim = int(shape[1]) if len(shape) == 2 else 0
    if encoding == "raw":
        return rows * row_bytes
    if encoding == "quantized":
        return quantized_bytes(rows, dim, bits)
    if encoding == "rows-diff":
        return bitmap_bytes(rows) + changed * row_bytes
    if encoding == "rows-diff-quantized":
        return bitmap_bytes(rows) + quantized_bytes(changed, dim, bits)
    if encoding == "cast":
        return rows * dim * 2
    if encoding == "rows-diff-cast":
        return bitmap_bytes(rows) + changed * dim * 2
    raise ValueError(f"unknown encoding {encoding!r}")


def _finite(error: float) -> float | None:
    return error if math.isfinite(error) else None


def _quantize(rows: U8, dtype: str, bits: int, workers: int) -> tuple[bytes, float | None]:
    values = qz.to_f32(rows, dtype)
    q = qz.quantize_rows(values, bits, greedy=_greedy(bits), workers=workers)
    return q.to_bytes(), _finite(q.rel_error if values.size else 0.0)


def _greedy(bits: int) -> bool:
    # The range search pays at <= 4 bits; at 8 it gains ~0.2% (the bench's ``encoding``
    # section measures it) for most of the encoding time, so 8 bits takes min/max.
    return bits < 8


def _pooled(
    pool: EncodePool | None,
    data: memoryview,
    dtype: str,
    shape: list[int] | tuple[int, ...],
    bits: int,
    pick: npt.NDArray[np.intp] | None = None,
) -> tuple[bytes, float | None] | None:
    """What :func:`_quantize` gives for the tensor's rows (all, or those in ``pick``), from the
    pool's worker processes; None without a pool, for a small tensor, or where the workers
    cannot map ``data`` (the caller quantizes in process)."""
    if pool is None:
        return None
    rows, dim = int(shape[0]), int(shape[1])
    count = rows if pick is None else len(pick)
    if count * dim * (data.nbytes // max(rows * dim, 1)) < MIN_POOL_BYTES:
        return None
    source = source_of(data)
    if source is None:
        return None
    q = pool.quantize(source, dtype, (rows, dim), bits, greedy=_greedy(bits), rows=pick)
    if q is None:
        return None
    return q.to_bytes(), _finite(q.rel_error if q.codes.size else 0.0)


def _widen(payload: memoryview | bytes, cast: str, dim: int) -> qz.F32:
    raw = np.frombuffer(payload, np.uint16 if cast == "bfloat16" else np.float16)
    values = qz.bf16_to_f32(raw) if cast == "bfloat16" else raw.astype(np.float32)
    return values.reshape(-1, dim)


def _cast(rows: U8, dtype: str, cast: str) -> tuple[bytes, float | None]:
    values = qz.to_f32(rows, dtype)
    low = qz.downcast(values, cast)  # type: ignore[arg-type]
    payload = low.tobytes()
    error = 0.0
    if values.size:  # block by block: no full-size widened copy
        dim = values.shape[1]
        step = max(1, (1 << 20) // dim)
        view = memoryview(payload)
        diff = sum(
            qz.squared_error(
                values[s : s + step], _widen(view[s * dim * 2 : (s + step) * dim * 2], cast, dim)
            )
            for s in range(0, values.shape[0], step)
        )
        error = qz.norm_ratio(diff, qz.squared_norm(values))
    return payload, _finite(error)


def encode(
    data: memoryview,
    dtype: str,
    shape: list[int] | tuple[int, ...],
    *,
    mask: Bool1D | None = None,
    bits: int = 0,
    cast: str = "",
    workers: int = 1,
    pool: EncodePool | None = None,
) -> Encoded:
    """Encode one tensor: rows in ``mask`` only (a diff) or all; quantized to ``bits`` or
    downcast to ``cast`` when given; by ``pool``'s processes where ``data`` lies in a shared
    mapping they can map (:func:`sidecar.shm.source_of`), else with ``workers`` threads.

    Quantization needs a float tensor with finite rows within ±65504 (float16 casts
    the same range); otherwise raises ``ValueError`` (the caller stores it exactly).
    """
    if (bits or cast) and not quantizable(dtype, shape):
        raise ValueError(f"{dtype}{list(shape)} cannot be quantized (2-D float32/16 or bfloat16 only)")
    if mask is None:
        if cast:
            payload, error = _cast(as_rows(data, shape), dtype, cast)
            return Encoded("cast", [payload], 0, error, cast=cast)
        if not bits:
            return Encoded("raw", [data])
        done = _pooled(pool, data, dtype, shape, bits)
        payload, error = done or _quantize(as_rows(data, shape), dtype, bits, workers)
        return Encoded("quantized", [payload], bits, error)
    rows = as_rows(data, shape)
    bitmap = np.packbits(mask, bitorder="little").tobytes()
    if bits and not cast and pool is not None:  # the workers gather the changed rows themselves
        pick = np.flatnonzero(mask)
        done = _pooled(pool, data, dtype, shape, bits, pick)
        if done is not None:
            return Encoded("rows-diff-quantized", [bitmap, done[0]], bits, done[1], changed=len(pick))
    picked = rows[mask]
    if cast:
        payload, error = _cast(picked, dtype, cast) if len(picked) else (b"", 0.0)
        return Encoded("rows-diff-cast", [bitmap, payload], 0, error, len(picked), cast)
    if not bits:
        return Encoded("rows-diff", [bitmap, picked.tobytes()], changed=len(picked))
    payload, error = _quantize(picked, dtype, bits, workers)
    return Encoded("rows-diff-quantized", [bitmap, payload], bits, error, changed=len(picked))


def decode_into(
    out: memoryview | bytearray,
    payload: memoryview | bytes,
    encoding: str,
    dtype: str,
    shape: list[int],
    cast: str = "",
) -> None:
    """Write a tensor's restored bytes into ``out``; for a diff, ``out`` already holds the base.

    Raises ``ValueError`` when the payload does not fit the tensor.
    """
    target = as_rows(out, shape)
    if encoding == "raw":
        if len(payload) != target.nbytes:
            raise ValueError(f"raw payload of {len(payload)} bytes for a {target.nbytes}-byte tensor")
        target[...] = np.frombuffer(payload, np.uint8).reshape(target.shape)
        return
    if encoding == "quantized":
        q = qz.QuantizedRows.from_bytes(payload)
        if q.shape != (target.shape[0], int(shape[1])):
            raise ValueError(f"quantized rows {q.shape} for a tensor of shape {list(shape)}")
        target[...] = qz.from_f32(qz.dequantize_rows(q), dtype)
        return
    if encoding == "cast":
        values = _widen(payload, cast, int(shape[1]))
        if values.shape[0] != target.shape[0]:
            raise ValueError(f"cast payload holds {values.shape[0]} rows for a tensor of shape {list(shape)}")
        target[...] = qz.from_f32(values, dtype)
        return
    if encoding not in ("rows-diff", "rows-diff-quantized", "rows-diff-cast"):
        raise ValueError(f"unknown encoding {encoding!r}")
    rows = target.shape[0]
    nmap = bitmap_bytes(rows)
    if len(payload) < nmap:
        raise ValueError(f"diff payload of {len(payload)} bytes is shorter than its {nmap}-byte bitmap")
    mask = np.unpackbits(np.frombuffer(payload, np.uint8, nmap), count=rows, bitorder="little").astype(bool)
    body = memoryview(payload)[nmap:]
    changed = int(mask.sum())
    if encoding == "rows-diff":
        if len(body) != changed * target.shape[1]:
            raise ValueError(f"diff carries {len(body)} bytes for {changed} rows of {target.shape[1]} bytes")
        target[mask] = np.frombuffer(body, np.uint8).reshape(changed, target.shape[1])
        return
    if encoding == "rows-diff-cast":
        values = _widen(body, cast, int(shape[1]))
        if values.shape[0] != changed:
            raise ValueError(f"cast diff carries {values.shape[0]} rows, its bitmap marks {changed}")
        target[mask] = qz.from_f32(values, dtype)
        return
    q = qz.QuantizedRows.from_bytes(body)
    if q.shape[0] != changed:
        raise ValueError(f"quantized diff carries {q.shape[0]} rows, its bitmap marks {changed}")
    target[mask] = qz.from_f32(qz.dequantize_rows(q), dtype)
