"""Asynchronous checkpoints (`checkpoint.async_save = true`): training blocks only while the state is
copied to CPU; the files are written in the background.

- At most one save in flight: a new save (and the end of the run) first waits for the previous one.
- DCP's `async_save` stages the state to CPU memory on the calling thread, then writes in a thread of
  its own; its cross-rank coordination runs on a dedicated gloo group, so it never interleaves with the
  training's collectives on the main group.
- Rank 0 publishes from a background thread of its own once DCP's write has finished on every rank:
  meta.json, the manifest, the rename, `latest`, retention — exactly as a synchronous save. A write that
  fails (on any rank) is reported and its `.tmp` directory removed: it never becomes `latest`; the next
  save (or the end of the run) raises its `CheckpointWriteError`, so the run stops at the first lost save,
  as a synchronous one does, instead of training on through failed saves.
- The time each save blocked training (the wait for the previous one + staging) is returned and logged.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pentatron.checkpoint.errors import CheckpointWriteError
from pentatron.checkpoint.space import state_bytes, write_failure
from pentatron.checkpoint.store import CheckpointStore, _dcp_mode, _rank


class _CpuCopy:
    """DCP's `AsyncStager` protocol: a copy of every tensor in CPU memory (on a CPU run too — the live
    tensors keep training while the copy is written)."""

    should_synchronize_after_execute = False

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        return {part: {k: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t
                       for k, t in tensors.items()} for part, tensors in state.items()}

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class _InFlight:
    step: int
    tmp: Path
    future: Future
    nbytes: int  # this rank's bytes of the state (for the message of a failed write)
    publisher: threading.Thread | None = None
    outcome: list[str] = field(default_factory=list)  # what happened, written by the publisher thread


class AsyncCheckpointer:
    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        # DCP's background coordination gets a group of its own (created collectively, on every rank).
        multi = dist.is_initialized() and dist.get_world_size() > 1
        self._group = dist.new_group(backend="gloo") if multi else None
        self._pending: _InFlight | None = None
        self.published: list[Path] = []
        self.failed: list[str] = []
        self.last_failed = False  # the newest save that finished did not become a checkpoint

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], pieces: dict[str, Any] | None) -> float:
        """Start saving `state` (every rank); returns the seconds training was blocked."""
        start = time.perf_counter()
        with self.store.watch("checkpoint_save"):  # the wait for the previous save and the `.tmp`'s barrier
            return self._save(start, step, state, meta, pieces)

    def _save(self, start: float, step: int, state: dict[str, Any], meta: dict[str, Any],
              pieces: dict[str, Any] | None) -> float:
        import torch.distributed.checkpoint as dcp  # here: a run that never saves skips the import

        self._wait(quiet=True)
        if self.last_failed:  # the previous save was lost: stop here, as a synchronous save stops at its failure
            raise CheckpointWriteError(self.failed[-1])
        try:
            tmp = self.store.prepare(step, pieces)
        except OSError as e:  # the `.tmp` directory or this rank's pieces could not be written
            tmp = self.store.tmp_dir(step)
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(write_failure(tmp, step, e, state_bytes(state))) from None
        with _dcp_mode() as single:
            future = dcp.async_save(state, checkpoint_id=tmp, process_group=self._group, no_dist=single,
                                    async_stager=_CpuCopy())
        pending = _InFlight(step, tmp, future, state_bytes(state))
        if _rank() == 0:
            pending.publisher = threading.Thread(target=self._publish, args=(pending, meta), daemon=True,
                                                 name=f"pentatron-publish-step{step}")
            pending.publisher.start()
        self._pending = pending
        return time.perf_counter() - start

    def _publish(self, pending: _InFlight, meta: dict[str, Any]) -> None:
        """Rank 0's background thread: wait for the write, then publish — or discard a failed one."""
        try:
            pending.future.result()
            final = self.store.publish(pending.step, pending.tmp, meta)
            pending.outcome.append(f"ok:{final}")
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            shutil.rmtree(pending.tmp, ignore_errors=True)
            pending.outcome.append(f"failed:{write_failure(pending.tmp, pending.step, e, pending.nbytes)}")

    def wait(self, quiet: bool = False) -> None:
        """Finish the save in flight (every rank; rank 0 publishes); a failed one is recorded in `failed` and,
        unless `quiet` (the caller raises it), said on rank 0."""
        with self.store.watch("checkpoint_wait"):  # blocked on the write's collectives, on its own group
            self._wait(quiet)

    def _wait(self, quiet: bool) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.publisher is None:  # ranks > 0: their part of the write
            self.last_failed = False
            try:
                pending.future.result()
            except BaseException as e:  # noqa: BLE001
                self.failed.append(write_failure(pending.tmp, pending.step, e, pending.nbytes))
                self.last_failed = True
            return
        pending.publisher.join()
        kind, _, text = (pending.outcome or ["failed:publisher thread ended without an outcome"])[0].partition(":")
        self.last_failed = kind != "ok"
        if kind == "ok":
            self.published.append(Path(text))
            return
        self.failed.append(text)
        if not quiet:
            print(f"pentatron: background save failed: {text}", file=sys.stderr, flush=True)
