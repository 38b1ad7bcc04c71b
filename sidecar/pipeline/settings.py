"""Parsing and checking of the encoding settings (policy, quantization rules), so a wrong
value fails at sidecar start naming the setting."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from sidecar.pipeline import quantize as qz
from sidecar.pipeline.policy import check_policy

CASTS = ("float16", "bfloat16")
#: --restore-class values
RESTORE_CLASSES = ("auto", "stored")
#: the role the client gives embedding-table weights (TensorMeta.role)
EMBEDDING_ROLE = "embedding"


@dataclass(frozen=True)
class Quantization:
    """``mode``: off, auto, a bit width, or a cast dtype; ``patterns``: empty = embedding tables."""

    mode: str
    patterns: tuple[str, ...]
    expected_restores: int
    table: tuple[tuple[int, int], ...]
    #: --restore-class auto: restores served exactly (memory, peers) add no error, so ``auto``
    #: sizes bits for the restores expected from storage only.
    exact: bool = False
    expected_storage_restores: int = 1

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def matches(self, name: str, role: str) -> bool:
        if not self.enabled:
            return False
        if not self.patterns:
            return role == EMBEDDING_ROLE
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def bits(self, restores_so_far: int, storage_restores_so_far: int = 0) -> int:
        """Bit width for the next checkpoint (0 for a cast or off); escalates to 8 once the
        restores that gave lossy values (every restore under the stored class, storage's under
        the exact one) exceed the plan, since error accumulates per such restore."""
        if self.mode in ("off", *CASTS):
            return 0
        if self.mode == "auto":
            if self.exact:
                expected, seen = self.expected_storage_restores, storage_restores_so_far
            else:
                expected, seen = self.expected_restores, restores_so_far
            return qz.escalate(qz.bits_for_restores(expected, self.table), seen, expected)
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
    storage = getattr(settings, "expected_storage_restores", 1)
    if storage < 0:
        raise ValueError(f"--expected-storage-restores must be >= 0, got {storage}")
    restore_class = str(getattr(settings, "restore_class", "stored")).strip().lower()
    if restore_class not in RESTORE_CLASSES:
        raise ValueError(f"--restore-class {restore_class!r} is not one of {', '.join(RESTORE_CLASSES)}")
    patterns = tuple(filter(None, (p.strip() for p in str(settings.quantize_match).split(","))))
    return Quantization(
        mode,
        patterns,
        settings.expected_restores,
        parse_table(settings.restore_bits),
        exact=restore_class == "auto",
        expected_storage_restores=storage,
    )


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
