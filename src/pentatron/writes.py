"""Writing what a command makes (an exported model, a tokenized dataset, an imported checkpoint): whole or
not at all, and a write that fails — no space left, no permission, a path under a regular file — is one
line naming the destination and the cause (`WriteError`), never a traceback and never half a destination.

Why one wrapper: each writer created its directories and its temporary sibling before its own error
handling began, so the first `mkdir` that failed escaped as a traceback, and directories it had created
stayed behind. Torch-free: `pentatron tokenize` uses it too.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# The destination is the user's to change (exit 2); anything else (a full disk, an I/O error) is a failure
# of the machine, not of the input (exit 1), as a checkpoint that could not be saved.
_PATH_ERRORS = (errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                errno.ENAMETOOLONG)


class WriteError(RuntimeError):
    """A destination that could not be written: one line; `code` is the exit code (2: change the path or its
    permissions, 1: the disk or device failed)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def write_error(e: OSError, dest: Path, what: str) -> WriteError:
    """The one line for `e`, raised while writing `what` at `dest`."""
    err = e.errno
    head = f"cannot write {what} {str(dest)!r}"
    blocker = _file_above(dest)
    if blocker is not None and err in (errno.ENOTDIR, errno.EEXIST):
        return WriteError(f"{head}: {str(blocker)!r} is a file, not a directory; choose another path", 2)
    if err in (errno.EACCES, errno.EPERM, errno.EROFS):
        # the directory that refused (not our temporary sibling's name, which would mean nothing to the user)
        where = _existing(Path(e.filename) if e.filename else dest)
        why = "read-only file system" if err == errno.EROFS else "permission denied"
        return WriteError(f"{head}: {why} in {where}; fix its permissions or choose another path", 2)
    if err in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{shutil.disk_usage(_existing(dest)).free / 2**20:,.0f} MiB free"
        except OSError:
            free = "free space unknown"
        what_ran_out = "quota exceeded" if err == errno.EDQUOT else "no space left on the device"
        return WriteError(f"{head}: {what_ran_out} ({free}); free some space or choose another path", 1)
    reason = e.strerror or str(e)
    return WriteError(f"{head}: {reason}" + (f" ({e.filename})" if e.filename else ""),
                      2 if err in _PATH_ERRORS else 1)


@contextmanager
def staged_dir(dest: Path, what: str) -> Iterator[Path]:
    """A directory written whole or not at all: yields a fresh hidden sibling of `dest` to write into, which
    the caller renames to `dest` inside the block once complete. On any failure the sibling, and every parent
    directory this call created, are removed; an `OSError` becomes a `WriteError`."""
    dest = Path(dest)
    # A uniquely named sibling: the same file system (the rename is atomic) and the umask's mode, unlike
    # tempfile.mkdtemp's 0700, which would survive the rename.
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with created_dirs(dest.parent, what, report_as=dest):
        try:
            tmp.mkdir()
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


@contextmanager
def created_dirs(path: Path, what: str, report_as: Path | None = None) -> Iterator[Path]:
    """`path` made a directory (with its missing parents) for the block to write into; when the block fails,
    whatever this call created is removed (so a failed command leaves no destination behind) and an
    `OSError` becomes a `WriteError` naming `report_as` (default `path`)."""
    path = Path(path)
    dest = report_as or path
    top = _existing(path)
    missing = [d for d in [path.absolute(), *path.absolute().parents] if d not in (top, *top.parents)]
    made: list[Path] = []
    try:
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
        if not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
        yield path
    except BaseException as e:
        for d in reversed(made):
            shutil.rmtree(d, ignore_errors=True)  # created by this call: nothing of anyone else's is in it
        if isinstance(e, OSError):
            raise write_error(e, dest, what) from None
        raise


def _file_above(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` (or `path` itself) when it is not a directory."""
    probe = _existing(path)
    return None if probe.is_dir() else probe


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (a path under a regular file does not exist)."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe
