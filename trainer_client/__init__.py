"""Strata trainer client: save and restore training state through the sidecar.

Public API::

    from trainer_client import CheckpointClient
    from trainer_client import checkpoint_blocks  # selective activation checkpointing
"""

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
