"""The one exception for an unusable checkpoint: a one-line message naming the file (exit code 2)."""

from __future__ import annotations

from pentatron.data.errors import DataError


class CheckpointError(DataError):
    """A checkpoint that cannot be resumed: damaged, incomplete, or written for another model. A DataError,
    so every entry point already reports it as a user-fixable problem (exit 2, no traceback)."""
