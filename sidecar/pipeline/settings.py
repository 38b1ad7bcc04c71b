"""Parsing and checking of the encoding settings (policy, quantization rules), so a wrong
value fails at sidecar start naming the setting."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from sidecar.pipeline import quantize as qz
from sidecar.pipeline.policy import check_policy

CASTS = ("float16", "bfloat16")
#: the role the client gives embedding-table weights (TensorMeta.role)
EMBEDDING_ROLE = "embedding"


@dataclass(frozen=True)
class Quantization:
    """``mode``: off, auto, a bit width, or a cast dtype; ``patterns``: empty = embedding tables."""

    mode: str
    patterns: tuple[str, ...]
    expected_restores: int
    table: tuple[tuple[int, int], ...]

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def matches(self, name: str, role: str) -> bool:
        if not self.enabled:
            return False
        if not self.patterns:
            return role == EMBEDDING_ROLE
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def bits(self, restores_so_far: int) -> int:
        """Bit width for the next checkpoint (0 for a cast or off); escalates to 8 once
        restores exceed the plan, since error accumulates per restore."""
        if self.mode in ("off", *CASTS):
            return 0
        if self.mode == "auto":
            planned = qz.bits_for_restores(self.expected_restores, self.table)
            return qz.escalate(planned, restores_so_far, self.expected_restores)
        return int(self.mode)

    @property
    def cast(self) -> str:
        return self.mode if self.mode in CASTS else ""


def parse_table(text: str) -> tuple[tuple[int, int], ...]:
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            limit, bits = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--restore-bits entry {part!r} must be RESTORES:BITS, e.g. 3:3") from None
        if limit < 0 or bits not in qz.SUPPORTED_BITS:
            raise ValueError(f"--restore-bits entry {part!r}: bits must be one of {qz.SUPPORTED_BITS}")
        pairs.append((limit, bits))
    return tuple(sorted(pairs))


def quantization(settings: Any) -> Quantization:
    mode = str(settings.quantize).strip().lower()
    allowed = ("off", "auto", *(str(b) for b in qz.SUPPORTED_BITS), *CASTS)
    if mode not in allowed:
        raise ValueError(f"--quantize {settings.quantize!r} is not one of {', '.join(allowed)}")
    if settings.expected_restores < 0:
        raise ValueError(f"--expected-restores must be >= 0, got {settings.expected_restores}")
    patterns = tuple(filter(None, (p.strip() for p in str(settings.quantize_match).split(","))))
    return Quantization(mode, patterns, settings.expected_restores, parse_table(settings.restore_bits))


def check_encoding_settings(settings: Any) -> None:
    """Raise ValueError naming the wrong setting."""
    try:
        check_policy(settings.policy)
    except ValueError as exc:
        raise ValueError(f"--policy: {exc}") from None
    if settings.max_diffs < 1:
        raise ValueError(f"--max-diffs must be >= 1, got {settings.max_diffs}")
    if settings.encode_workers < 1:
        raise ValueError(f"--encode-workers must be >= 1, got {settings.encode_workers}")
    quantization(settings)
