"""Resuming an interrupted `pentatron tokenize` (Ctrl-C, SIGTERM, kill -9, a full disk): the dataset is built in
a hidden sibling named by its fingerprint, `.<out>.partial-<fingerprint>`, which a rerun of the same command (same
inputs and settings: same fingerprint) finds and continues; a different one never mixes with it.

Shards are fixed-size cuts of one token stream, so the state to continue from is small: how many input documents
are already in it (`documents`), the finished shards, and the tokens after the last shard (`tail_<n>.bin`, with
`n` the shard count, so each checkpoint's tail is a new file). It is saved after every batch that completed a
shard — the shard fsynced first, then the tail, then `progress.json` replaced atomically — so a crash at any
point leaves the last complete checkpoint; shard files newer than it are rewritten. The continued job skips the
documents already in and produces the same bytes as a job never interrupted. Bad input (a DataError) removes the
directory: fixing the input changes the fingerprint anyway.

Two processes building the same dataset at once (ranks and the launcher on the built-in corpus) do not share
it: the second finds it locked and builds in a private directory, as before resuming existed.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from pentatron.data.index import ShardInfo

PROGRESS_FILE = "progress.json"
_LOCK_FILE = "lock"


def partial_dir(out_dir: Path, fingerprint: str) -> Path:
    return out_dir.with_name(f".{out_dir.name}.partial-{fingerprint}")


def lock(work: Path) -> IO[bytes] | None:
    """An exclusive lock on `work` for this process (held while the file stays open), or None if another
    process holds it."""
    f = (work / _LOCK_FILE).open("ab")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


@dataclass
class Progress:
    documents: int = 0
    """Input documents whose tokens are all in `shards` + the tail."""
    shards: list[ShardInfo] = field(default_factory=list)
    max_id: int = -1
    tail: str = ""
    """The file with the tokens after the last shard ("" when there are none)."""

    @classmethod
    def load(cls, work: Path, dtype: np.dtype) -> tuple[Progress, np.ndarray] | None:
        """The last checkpoint in `work` and its tail tokens; None when there is none (a fresh job)."""
        try:
            data = json.loads((work / PROGRESS_FILE).read_text())
        except (OSError, ValueError):
            return None
        p = cls(data["documents"], [ShardInfo(s["file"], s["tokens"]) for s in data["shards"]], data["max_id"],
                data["tail"])
        tail = np.fromfile(work / p.tail, dtype=dtype) if p.tail else np.empty(0, dtype=dtype)
        keep = {s.file for s in p.shards} | {p.tail, PROGRESS_FILE, _LOCK_FILE, "tokenizer.json"}
        for f in work.iterdir():  # shards and tails written after the checkpoint: they are redone
            if f.name not in keep:
                f.unlink()
        return p, tail

    def save(self, work: Path, tail: np.ndarray) -> None:
        old = self.tail
        self.tail = f"tail_{len(self.shards):05d}.bin" if tail.size else ""
        if self.tail and self.tail != old:
            _write_synced(work / self.tail, tail.tobytes())
        state = {"documents": self.documents, "shards": [{"file": s.file, "tokens": s.tokens} for s in self.shards],
                 "max_id": self.max_id, "tail": self.tail}
        _write_synced(work / (PROGRESS_FILE + ".tmp"), json.dumps(state).encode())
        os.replace(work / (PROGRESS_FILE + ".tmp"), work / PROGRESS_FILE)
        if old and old != self.tail:
            (work / old).unlink(missing_ok=True)

    @staticmethod
    def clear(work: Path) -> None:
        """Leave only the dataset's own files (before its index is written)."""
        for f in work.iterdir():
            if f.name == PROGRESS_FILE or f.name == _LOCK_FILE or f.name.startswith("tail_"):
                f.unlink()


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
