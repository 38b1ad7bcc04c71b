"""Restart decisions, shared by `strata launch` and the Kubernetes operator.

One layer owns retries: this one. Training processes never retry themselves,
the launcher/operator never multiplies retries with another policy.
"""

from sidecar.coordinator.core import (
    OOM_EXIT_CODE,
    PERMANENT,
    Decision,
    Failure,
    FailureKind,
    RestartPolicy,
    RestartTracker,
    classify_exit,
)

__all__ = [
    "OOM_EXIT_CODE",
    "PERMANENT",
    "Decision",
    "Failure",
    "FailureKind",
    "RestartPolicy",
    "RestartTracker",
    "classify_exit",
]
