"""Strata trainer client: save and restore training state through the sidecar.

Public API::

    from trainer_client import CheckpointClient
    from trainer_client import checkpoint_blocks  # selective activation checkpointing
"""

import os as _os

# gRPC's fork handlers (on by default) run at every fork of a process that uses gRPC, as a DataLoader
# with workers forks its trainer; while the client's Attach stream waits inside gRPC they are
# skipped with a "fork_posix.cc ... skipping fork() handlers" line per fork. Forked workers never
# use the client's channel, so the handlers are not needed: off, unless asked for. Read once, when
# grpc is first imported: hence here, before the client imports it.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from trainer_client.activation import Checkpointed, checkpoint_blocks
from trainer_client.client import CheckpointClient, Committed, SaveHandle
from trainer_client.config import ClientSettings
from trainer_client.dist import init_process_group
from trainer_client.errors import (
    CheckpointError,
    Preempted,
    RestartInPlace,
    RestartLimitSpent,
    RestoreError,
    SaveFailed,
    SaveSkipped,
    SidecarUnavailable,
    TornSnapshot,
)

__all__ = [
    "CheckpointClient",
    "CheckpointError",
    "Checkpointed",
    "ClientSettings",
    "Committed",
    "Preempted",
    "RestartInPlace",
    "RestartLimitSpent",
    "RestoreError",
    "SaveFailed",
    "SaveHandle",
    "SaveSkipped",
    "SidecarUnavailable",
    "TornSnapshot",
    "checkpoint_blocks",
    "init_process_group",
]
