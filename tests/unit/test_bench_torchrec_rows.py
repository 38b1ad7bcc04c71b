"""The ``torchrec`` bench section's torn-snapshot row: a save refused as torn is a checkpoint lost
and one never compared, so it fails the row and is not counted as compared."""

from __future__ import annotations

from tests.bench import torchrec
from tests.bench.common import Row


def _torn_row(torn: int, refused: int, compared: int) -> Row:
    figures = {
        "torchrec_torn_snapshots": torn,
        "torchrec_failed_saves": refused,
        "torchrec_saves_compared": compared,
    }
    return next(r for r in torchrec._torn_rows(figures) if r.name == "torchrec_torn_snapshots")


def test_a_refused_save_fails_the_torn_row() -> None:
    row = _torn_row(torn=0, refused=2, compared=148)
    assert row.passed is False
    assert row.unit == "of 148 compared"  # what was compared, not what was planned


def test_no_torn_and_no_refused_save_passes() -> None:
    assert _torn_row(torn=0, refused=0, compared=150).passed is True
    assert _torn_row(torn=1, refused=0, compared=150).passed is False
