"""The exceptions of checkpoints, each a one-line message: an unusable checkpoint (naming the file, exit
code 2) and a save that could not be written (naming the directory and the cause, exit code 1)."""

from __future__ import annotations

import sys

from pentatron.data.errors import DataError


class CheckpointError(DataError):
    """A checkpoint that cannot be resumed: damaged, incomplete, or written for another model. A DataError,
    so every entry point already reports it as a user-fixable problem (exit 2, no traceback)."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (disk full, permissions, quota): one line naming the directory
    and the cause; the run exits non-zero and the last published checkpoint stays `latest`."""


def dcp_failure_types() -> tuple[type[BaseException], ...]:
    """DCP's CheckpointException (a BaseException) as an `except` tuple, without importing DCP: ~1 s of a rank's
    start-up that a run which neither saves nor loads never pays, and a process that has not imported it cannot
    have raised one. An `except (..., *dcp_failure_types())` clause is evaluated only when an exception reaches it."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return (api.CheckpointException,) if api is not None else ()
