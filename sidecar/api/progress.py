"""Progress bars for long operations (``strata verify``/``export``/``import``, a long restore in the
trainer): on stderr, and only when stderr is a terminal, so logs, pipes and CI stay clean."""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO


class _Off:
    """What a bar is where none is shown: every call does nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_description_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Off:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


#: The bar of an operation too short to show one.
OFF = _Off()


def shown(stream: TextIO | None = None, force: bool = False) -> bool:
    stream = sys.stderr if stream is None else stream
    if force:
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def _size() -> tuple[int, int]:
    """The terminal's columns and rows; 80 x 24 where it says 0 (a terminal never sized, on which
    tqdm hides every bar)."""
    try:
        columns, rows = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        columns = rows = 0
    return columns if columns > 0 else 80, rows if rows > 0 else 24


def bar(total: int, desc: str, *, force: bool = False, unit: str = "B") -> Any:
    """A byte-counting bar of ``total`` on stderr (``force``: even when stderr is not a terminal,
    for a child whose stderr a parent on a terminal passes through); one that does nothing
    otherwise. Use as a context manager, ``update(n)`` as bytes are done."""
    if not shown(force=force):
        return _Off()
    from tqdm import tqdm  # only where a bar is drawn

    columns, rows = _size()

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024,
        file=sys.stderr,
        leave=False,
        ncols=columns,
        nrows=rows,
        mininterval=0.2,
    )


def write(line: str) -> None:
    """Print ``line`` to stdout without tearing a bar being drawn on the same terminal."""
    if shown() and shown(sys.stdout):
        from tqdm import tqdm

        tqdm.write(line, file=sys.stdout)
    else:
        print(line)
