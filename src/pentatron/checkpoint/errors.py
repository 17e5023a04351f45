"""The exceptions of checkpoints, each a one-line message: an unusable checkpoint (naming the file, exit
code 2) and a save that could not be written (naming the directory and the cause, exit code 1)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from pentatron.data.errors import DataError


class CheckpointError(DataError):
    """A checkpoint that cannot be resumed: damaged, incomplete, or written for another model. A DataError,
    so every entry point already reports it as a user-fixable problem (exit 2, no traceback)."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (disk full, permissions, quota): one line naming the directory
    and the cause; the run exits non-zero and the last published checkpoint stays `latest`."""


def write_failure(directory: Path, step: int, e: BaseException, rank_bytes: int) -> str:
    """One line for a failed save of `step` into `directory`: the root cause found in DCP's per-rank
    failures and exception chains, with the free space when the disk is (or looks) full."""
    cause = _root_cause(e)
    latest = directory.parent / "latest"
    try:
        stays = latest.read_text().strip() if latest.is_file() else "none"
    except (OSError, ValueError):
        stays = "unreadable"
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    except OSError:
        free = None
    err = getattr(cause, "errno", None)
    if err == errno.ENOSPC or err == errno.EDQUOT or (free is not None and free < rank_bytes):
        what = "quota exceeded" if err == errno.EDQUOT else "no space left"
        have = f"{free / 2**20:,.0f} MiB free" if free is not None else "free space unknown"
        why = f"{what}: {have}, this rank's part of the checkpoint needs ≈ {rank_bytes / 2**20:,.1f} MiB"
    elif err in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = f"{os.strerror(err).lower()} (fix the directory's permissions or choose another checkpoint.dir)"
    else:
        why = f"{type(cause).__name__}: {cause}".splitlines()[0]
    return f"checkpoint of step {step} not saved in {directory.parent} ({why}); latest stays {stays}"


def _root_cause(e: BaseException) -> BaseException:
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        e = sorted(failures.items())[0][1][0]
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        nxt = e.__cause__ or e.__context__
        if nxt is None:
            break
        e = nxt
    return e
