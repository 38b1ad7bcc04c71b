"""Errors the trainer client raises. A failed save never raises in the
training thread: it surfaces through the handle's ``durable`` future."""


class CheckpointError(RuntimeError):
    """Base of every Strata client error."""


class SidecarUnavailable(CheckpointError):
    """The sidecar could not be reached (not started, wrong socket, died)."""


class SaveSkipped(CheckpointError):
    """The save was skipped because the previous one was still in flight (streaming or uploading)."""


class SaveFailed(CheckpointError):
    """The sidecar refused the save or could not make it durable."""


class RestoreError(CheckpointError):
    """Nothing restorable was found, or the checkpoint does not fit the state."""
