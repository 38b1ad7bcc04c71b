"""Canonical dtype names on the wire and their element sizes.

Names follow torch's (``torch.float32`` -> ``"float32"``). The sidecar treats
tensors as bytes, so dtypes numpy lacks (bfloat16, float8) need no special
case here; the client maps names back to torch dtypes.
"""

ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}


def expected_nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes a dense tensor of this dtype and shape occupies.

    Raises ValueError naming the problem for an unknown dtype or a negative dim.
    """
    try:
        size = ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(ITEMSIZE))}") from None
    for dim in shape:
        if dim < 0:
            raise ValueError(f"negative dimension in shape {list(shape)}")
        size *= dim
    return size
