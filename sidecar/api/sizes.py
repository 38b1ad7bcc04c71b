"""Sizes in bytes as people write them: ``4G``, ``4GiB``, ``4Gi``, ``512M``, ``512MiB``, ``64k`` or
plain bytes (``67108864``, ``0x4000000``). One parser for every size flag, ``STRATA_*`` variable and
annotation, sidecar and trainer client alike.

Every unit is a power of 1024, with or without ``i`` and ``B``: memory and shared-memory segments
are sized in binary units, and ``4G`` meaning 4 x 10^9 next to a 4 GiB limit would be a trap."""

from __future__ import annotations

import re

_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?:([kKmMgGtTpP])(i?)B?|B)?", re.ASCII)

#: What a size may look like, for error messages.
EXPECTED = "a size in bytes, e.g. 4G, 4GiB, 512MiB, 512M or 1048576"


def parse_size(text: str | int) -> int:
    """Bytes of ``text``; ValueError saying what a size looks like. Fractions of a unit are
    allowed (``1.5G``) and rounded down to whole bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    raw = str(text).strip()
    try:
        return int(raw, 0)  # plain bytes, in any base Python reads (0x..., 1_000)
    except ValueError:
        pass
    match = _SIZE.fullmatch(raw)
    if match is None:
        raise ValueError(f"expected {EXPECTED}")
    number, unit = match.group(1), (match.group(2) or "").upper()
    return int(float(number) * 1024 ** _POWERS[unit])


def format_size(n: int) -> str:
    """The shortest exact spelling of ``n`` bytes that :func:`parse_size` reads back (``64MiB``)."""
    for unit in ("P", "T", "G", "M", "K"):
        scale = 1024 ** _POWERS[unit]
        if n and n % scale == 0:
            return f"{n // scale}{unit}iB"
    return str(n)
