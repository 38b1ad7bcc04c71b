"""Strata sidecar: everything outside the training process. Never imports torch."""

__version__ = "0.1.0"
