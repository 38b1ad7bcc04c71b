"""Errors the trainer client raises. A failed save never raises in the
training thread: it surfaces through the handle's ``durable`` future."""

from sidecar.api import EXIT_LIMIT_SPENT, EXIT_RESTART_IN_PLACE


class CheckpointError(RuntimeError):
    """Base of every Strata client error."""


class SidecarUnavailable(CheckpointError):
    """The sidecar could not be reached (not started, wrong socket, died)."""


class SaveSkipped(CheckpointError):
    """The save was skipped because the previous one was still in flight (streaming or uploading)."""


class SaveFailed(CheckpointError):
    """The sidecar refused the save or could not make it durable."""


class TornSnapshot(SaveFailed):
    """A tensor that overlapped staging copied after ``save()`` returned changed in place before
    that copy ended (outside its optimizer's ``step()``): the save was not committed."""


class RestoreError(CheckpointError):
    """Nothing restorable was found, or the checkpoint does not fit the state."""


class Preempted(SystemExit):
    """Raised by ``save()`` after SIGTERM once the save on SIGTERM is settled (or skipped): the
    process exits with status 143 (128 + SIGTERM), like one that SIGTERM killed, without a
    traceback. ``step`` is the newest step this client knows durable (None: none), ``saved``
    whether the save made after the signal became durable within the budget, ``reason`` why not."""

    def __init__(self, step: int | None, saved: bool, reason: str = "") -> None:
        super().__init__(143)
        self.step, self.saved, self.reason = step, saved, reason

    def __str__(self) -> str:
        what = f"step {self.step} durable" if self.step is not None else "no step durable"
        return f"preempted (SIGTERM): {what}" + ("" if self.saved else f"; {self.reason}")


class RestartLimitSpent(SystemExit):
    """Raised when the client connects (or restores) and the operator has stopped the job because
    its restart limit is spent: the process exits with status 76, which the Job's podFailurePolicy
    turns into FailJob."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_LIMIT_SPENT)
        self.message = message

    def __str__(self) -> str:
        return self.message


class RestartInPlace(SystemExit):
    """Raised by ``save()`` once the operator restarts the gang in place (the sidecar's Attach
    stream names the new generation): the process exits with status 77, which the trainer
    container's restart rule turns into a container restart; the pod, its sidecar and the sidecar's
    memory stay, and the restarted trainer restores from that memory. The client also ends the
    process itself shortly after (see ``CheckpointClient._restart_in_place``): a training thread
    blocked in a collective with a dead rank never reaches ``save()``."""

    def __init__(self, generation: str) -> None:
        super().__init__(EXIT_RESTART_IN_PLACE)
        self.generation = generation

    def __str__(self) -> str:
        return f"the gang restarts in place as generation {self.generation}: exiting {EXIT_RESTART_IN_PLACE}"


class NothingToRestore(Exception):
    """The cause of a RestoreError when the job has no committed checkpoint (``resume()`` then
    starts fresh). Internal: raised and caught inside the client."""
