"""Strata trainer client: save and restore training state through the sidecar.

Public API::

    from trainer_client import CheckpointClient
"""

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
    "init_process_group",
]
