"""The errors the training-side library raises (no torch)."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint operation that cannot proceed (the message says what to fix)."""


class ModelMismatchError(RuntimeError):
    """The job id's checkpoint holds a different model (other FQNs or shapes)."""
