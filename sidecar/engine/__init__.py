"""The sidecar's core: holds snapshots in memory, drives upload and commit,
serves restores. The gRPC servicer only translates messages into these calls.

Memory policy per rank (REFT's double buffering): the newest committed
snapshot stays in memory for fast restore, plus at most
``max_held_snapshots - 1`` in flight. A save beyond that is refused with
RESOURCE_EXHAUSTED rather than queued: memory stays bounded and the trainer
learns at once.

Commit protocol (sidecar.manifest): every rank of a generation runs as the
attempt its rank-0 sidecar allocated in storage (EPOCH record) and restores
the step that record names. Rank 0's sidecar writes the job-level COMMIT once
every rank's MANIFEST is durable; other sidecars tell it so with hints
(sidecar.gang), and storage is asked only when hints are late.

The package, one module per concern (each module's docstring says what it owns):

- types: Identity, TensorSpec, Snapshot, RestoreData (the data), buffer helpers
- state: Shared, what every component uses (settings, store, metrics, lock, budget, gangs)
- attempts: generations, the protocol check, attempts (EPOCH) and their restore decision
- admission: admitting a save, its stream, its end or abort
- held: snapshots and diff chains held in memory, and their memory accounting
- commit: persist, hints, fences, the job-level COMMIT, retention, skips and ranks gone
- restore: restores (prefetched, from memory, from storage) and the checkpoint queries
- reports: heartbeats and commit/delete reports to the operator
- facade: Engine, the one object the servicer calls
"""

from __future__ import annotations

from .attempts import check_protocol
from .facade import Engine
from .types import Identity, RestoreData, Snapshot, TensorSpec, restore_header

__all__ = ["Engine", "Identity", "RestoreData", "Snapshot", "TensorSpec", "check_protocol", "restore_header"]
