"""Bench section ``peers_dense``: the ``peers`` section's children on the dense state (every
parameter and AdamW moment changing every step), Strata with every checkpoint full beside the
peers; see ``tests.bench.peers``."""

from tests.bench.peers import Options
from tests.bench.peers import rows_dense as _rows
from tests.bench.peers import run_dense as run

__all__ = ["Options", "_rows", "run"]
