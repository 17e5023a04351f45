"""Atomic checkpoints with torch.distributed.checkpoint (DCP).

Layout: `<dir>/step_00000100/` (DCP files + meta.json) and `<dir>/latest` naming the newest complete one.
A checkpoint is written into `step_XXXXXXXX.tmp/` and renamed only after every rank has finished, and
`latest` is replaced atomically afterwards: a crash at any moment leaves the previous good checkpoint
intact and pointed to. Tensors are keyed by parameter name, so later layouts can re-shard them.
Retention is per run lineage (`lineage.py`): the store's `run_id` is written into every meta.json and
only that lineage's older checkpoints are pruned, never the one `latest` names.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pentatron.checkpoint import manifest
from pentatron.checkpoint.errors import CheckpointError, CheckpointWriteError, dcp_failure_types
from pentatron.checkpoint.lineage import continued_run_id, new_run_id, prune, remove_stale_partials
from pentatron.checkpoint.reshard import write_pieces
from pentatron.checkpoint.space import state_bytes, write_failure


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextmanager
def _dcp_mode() -> Iterator[bool]:
    """Yields DCP's `no_dist` flag. A 1-process save/load is intended (we pass no_dist), yet DCP says "assuming
    the intent is to save in a single process" on every one. It is muted by a filter for the process, not a
    `catch_warnings` block around the call: under `checkpoint.async_save` DCP saves (and warns) later, from a
    writer thread of its own, which a block on the calling thread does not cover — that was the UserWarning
    of every 1-process async run. The filter is (re)inserted here, each time, since pytest and other callers
    reset the filters; it matches only that notice, from DCP only."""
    single = not dist.is_initialized()
    if single:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning, module=r"torch\.distributed\.checkpoint")
    yield single


def _unwatched(op: str) -> AbstractContextManager[None]:
    return nullcontext()


class CheckpointStore:
    """`barrier` waits for every rank (the trainer passes the comm layer's; a 1-process run needs none).
    `watch(op)` brackets a save's collective work for the hang watchdog (the trainer passes `Comm.outside`:
    DCP's own collectives are invisible to it otherwise, and a rank stopped mid-save went unnamed).
    `run_id`/`parent`: the lineage this store's saves belong to (a new one unless the trainer continues
    a resumed lineage)."""

    def __init__(self, root: Path, keep: int = 2, barrier: Callable[[], None] = lambda: None,
                 watch: Callable[[str], AbstractContextManager[None]] = _unwatched) -> None:
        self.root = root
        self.keep = keep
        self._barrier = barrier
        self.watch = watch
        self.run_id = new_run_id()
        self.parent: str | None = None

    def clean_stale(self) -> None:
        """Rank 0 at start (under the directory's lock): remove partial saves of a job that died."""
        if _rank() == 0 and self.root.is_dir():
            remove_stale_partials(self.root)

    def continue_lineage(self, resumed: Path, meta: dict[str, Any]) -> None:
        """Saves after resuming `resumed` continue its lineage, or branch off it on a rollback."""
        self.run_id, self.parent = continued_run_id(self.root, resumed, meta)

    def _dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def tmp_dir(self, step: int) -> Path:
        """Where a save of `step` is written until it is published."""
        return self._dir(step).with_suffix(".tmp")

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        if not (path / "meta.json").is_file():
            raise RuntimeError(f"{pointer} names {path}, which is not a complete checkpoint; "
                               "remove the pointer to start fresh")
        return path

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any],
             pieces: dict[str, Any] | None = None, file_per_tensor: bool = False) -> Path:
        """Write `state` (DCP, every rank its part), each rank's `pieces` (where its tensors sit in the full
        ones, for re-sharding: `reshard.py`) and `meta`, then publish it; returns the directory as named on
        rank 0, which alone renames and prunes. `file_per_tensor`: one file per tensor instead of one per
        rank — DCP's writer keeps every tensor of a file (and the copy it makes of a view) until the file
        is complete, so a whole model written by one process would be held twice."""
        with self.watch("checkpoint_save"):
            return self._save(step, state, meta, pieces, file_per_tensor)

    def _save(self, step: int, state: dict[str, Any], meta: dict[str, Any], pieces: dict[str, Any] | None,
              file_per_tensor: bool) -> Path:
        import torch.distributed.checkpoint as dcp  # here: a rank that never saves skips its ~1 s import

        tmp = self.tmp_dir(step)
        try:  # from the `.tmp` directory's creation on: any failure is the one line, the `.tmp` removed
            self.prepare(step, pieces)
            writer = dcp.FileSystemWriter(tmp, single_file_per_rank=False) if file_per_tensor else None
            with _dcp_mode() as single:
                dcp.save(state, checkpoint_id=tmp, storage_writer=writer, no_dist=single)
            # DCP's save returns once every rank's files and its metadata are written: the ranks checksum
            # them together, rank 0 merges the shares into the manifest
            manifest.write_share(tmp, _rank(), dist.get_world_size() if dist.is_initialized() else 1)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            raise self._failed(step, tmp, e, state) from None
        self._barrier()
        failure = None
        try:
            final = self.publish(step, tmp, meta) if _rank() == 0 else self._dir(step)
        except OSError as e:  # rank 0 alone: the others pass the barrier and the launcher stops them
            failure = self._failed(step, tmp, e, state)
        self._barrier()
        if failure is not None:
            raise failure
        return final

    def _failed(self, step: int, tmp: Path, e: BaseException, state: dict[str, Any]) -> BaseException:
        """The one-line error of a save that could not be written (its `.tmp` removed; `latest` untouched)."""
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            return e
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointWriteError(write_failure(tmp, step, e, state_bytes(state)))

    def prepare(self, step: int, pieces: dict[str, Any] | None) -> Path:
        """Every rank: the empty `.tmp` directory of a save (rank 0 creates it), with this rank's pieces. When
        rank 0 could not create it every rank raises (rank 0 the cause), after the barrier they all meet at."""
        tmp = self.tmp_dir(step)
        failure = None
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True)
            except OSError as e:
                failure = e
        self._barrier()
        if failure is not None:
            raise failure
        if not tmp.is_dir():
            raise FileNotFoundError(errno.ENOENT, "rank 0 could not create it", str(tmp))
        if pieces is not None:
            write_pieces(tmp, _rank(), pieces)
        return tmp

    def publish(self, step: int, tmp: Path, meta: dict[str, Any]) -> Path:
        """Rank 0, once every rank's files are in `tmp`: meta.json, the manifest (last), the rename, `latest`,
        retention."""
        meta = {**meta, "run_id": self.run_id, "parent": self.parent, "manifest": True}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        manifest.write(tmp)  # last: a published checkpoint always has one
        final = self._fresh_name(self._dir(step))
        os.replace(tmp, final)
        pointer_tmp = self.root / "latest.tmp"
        pointer_tmp.write_text(final.name)
        os.replace(pointer_tmp, self.root / "latest")
        prune(self.root, self.run_id, self.keep)
        return final

    @staticmethod
    def _fresh_name(final: Path) -> Path:
        """A step saved again (e.g. a rerun from an older checkpoint) goes to `step_X-rN`: the copy that
        `latest` may point to is never removed before the new one is complete and pointed to."""
        candidate, n = final, 0
        while candidate.exists():
            n += 1
            candidate = final.with_name(f"{final.name}-r{n}")
        return candidate

    def load(self, path: Path, state: dict[str, Any]) -> dict[str, Any]:
        """Load tensors in place into `state` (same keys as saved); return the saved metadata."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from pentatron.checkpoint.safe_metadata import SafeReader

        reader = SafeReader(path)  # a refused index is its own one-line error
        with _dcp_mode() as single:
            try:
                dcp.load(state, storage_reader=reader, no_dist=single)
            except (CheckpointException, OSError, RuntimeError, ValueError) as e:
                raise CheckpointError(f"{path}: cannot be loaded ({_first_failure(e)})") from None
        return self.meta(path)

    @staticmethod
    def meta(path: Path) -> dict[str, Any]:
        try:
            return json.loads((path / "meta.json").read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path / 'meta.json'}: unreadable ({type(e).__name__}: {e})") from None




def _first_failure(e: BaseException) -> str:
    """One line for a DCP failure: the first failing rank's exception (DCP's own message is a multi-rank
    traceback, and its CheckpointException is a BaseException that bypasses `except Exception`)."""
    if isinstance(e, dcp_failure_types()) and e.failures:
        rank, (inner, _) = sorted(e.failures.items())[0]
        text = f"{type(inner).__name__}: {inner}".splitlines()[0]
        return f"rank {rank}: {text}"
    return f"{type(e).__name__}: {e}".splitlines()[0]
