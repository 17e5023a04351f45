"""An exclusive lock on a checkpoint directory for a job's lifetime.

Rank 0 of a job (every launch path has one) takes an `fcntl.flock` on `<checkpoint.dir>/.lock` before
any rank trains and holds it until the process exits; the kernel releases it when the process dies in
any way (SIGKILL included), so a crashed job never leaves a stale lock. The file records the holder's
pid, host and start time, which a second job's error names. (flock is per host on some network file
systems; jobs sharing a directory across hosts then rely on the scheduler.)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType

LOCK_NAME = ".lock"


class CheckpointDirLocked(RuntimeError):
    """Another live job holds the directory (a user-fixable problem: exit 2)."""


class CheckpointDirLock:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise `CheckpointDirLocked` naming the holder; never waits."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointDirLocked(
                f"checkpoint.dir {str(self.root)!r} is in use by another job ({self.holder()}); wait for it "
                "to finish or stop it, or use another checkpoint.dir") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd

    def holder(self) -> str:
        try:
            info = json.loads(self.path.read_text())
            return f"pid {info['pid']} on host {info['host']}, since {info['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            return f"holder unknown: {self.path} is locked"

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> CheckpointDirLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def probe(root: Path) -> str | None:
    """The problem if `root` is locked by another job now (the launcher's early check; rank 0 takes the
    lock itself), else None."""
    if not (Path(root) / LOCK_NAME).is_file():
        return None
    lock = CheckpointDirLock(root)
    try:
        lock.acquire()
    except CheckpointDirLocked as e:
        return str(e)
    except OSError:
        return None  # unwritable: reported by the directory check
    lock.release()
    return None
