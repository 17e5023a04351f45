"""One rank's model in its parallel layout — built, parallelized into a step runner — and its checkpoint
state: what a save writes (the tensors, where each sits in the full tensor, the metadata) and how a
checkpoint written in any layout is loaded into it. The trainer trains it; `pentatron checkpoint convert`
only loads and saves it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pentatron.checkpoint.errors import CheckpointError
from pentatron.checkpoint.layout import check_resumable, layout_differences, layout_record
from pentatron.checkpoint.reshard import describe_state, has_pieces, load_resharded
from pentatron.checkpoint.store import CheckpointStore
from pentatron.config import Config
from pentatron.distributed.context import ParallelContext
from pentatron.distributed.launch import local_device
from pentatron.models.llama import build_meta_model
from pentatron.observe.run_observer import start_flight_recorder
from pentatron.observe.watchdog import Watchdog
from pentatron.parallel.parallelize import parallelize
from pentatron.precision import apply_matmul_precision, resolve_precision
from pentatron.train.nonfinite import NonFiniteStop, local_nonfinite_count


class ModelState:
    """`flight_recorder`: record this rank's collectives (and, on several processes, arm the hang watchdog)
    from the first one on, dumping to log.dir/flight."""

    def __init__(self, cfg: Config, flight_recorder: bool = True) -> None:
        self.cfg = cfg
        tr = cfg.train
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.device = local_device(tr.device)
        # The one holder of the degrees: the context is built from it and it is handed down to parallelize.
        self.layout = cfg.layout(world_size)
        self.ctx = ParallelContext.from_layout(self.layout, self.device)
        self.watchdog: Watchdog | None = None
        with self.closed_on_error():
            self.watchdog = start_flight_recorder(cfg, self.ctx) if flight_recorder else None
            self.policy = resolve_precision(tr.precision, self.device)
            apply_matmul_precision(self.policy, self.device)  # fp32 on CUDA: TF32, as MFU and the planner assume
            torch.manual_seed(tr.seed)
            self.model_cfg = cfg.model_config()
            # Built on meta: no rank ever holds more than its own pieces (parallelize materialises them,
            # initialised to the 1-process model's values).
            model = build_meta_model(self.model_cfg)
            self.n_params = sum(p.numel() for p in model.parameters())
            # Pipeline stages, TP, recompute, then data parallel / ZeRO: the step runner owns a step's
            # forward/backward, the loss, gradient sync and the optimizer. With pp > 1 only this rank's
            # stages remain (`runner.model` is a LocalStages).
            self.runner = parallelize(model, self.ctx, cfg, self.policy, self.layout)
            self.engine = self.runner.engine

    def close(self) -> None:
        """The end of this rank's use of the model: the hang watchdog stopped and the process groups let go
        (`ParallelContext.release`), so that their threads end before the interpreter does. Idempotent."""
        if self.watchdog is not None:
            self.watchdog.stop()
        self.ctx.release()

    @contextmanager
    def closed_on_error(self) -> Iterator[None]:
        """`close()` if the block raises (what builds on this state fails before its owner holds it)."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    @property
    def rank(self) -> int:
        return self.ctx.rank

    def state_dict(self) -> dict[str, Any]:
        """Tensors keyed by parameter name: whole tensors when replicated (DCP writes one copy),
        "<name>|tp<i>/<n>" for tensor-parallel shard i of n, and "<key>[lo:hi]" ranges of the flattened
        local parameter for ZeRO shards (each rank writes its own). Pipeline ranks hold disjoint names."""
        return self.runner.state_dict()

    def layout_meta(self) -> dict[str, Any]:
        return layout_record(self.runner.layout, self.engine.layout_meta(), self.cfg.parallel.bucket_mb)

    def checkpoint(self, step: int, loader_state: dict[str, Any] | None
                   ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """(tensors, meta, pieces) of a save at `step`, after checking the state is finite on every rank.
        `loader_state`: the data position (None: no data read yet, as after `checkpoint import-hf`)."""
        state = self.state_dict()
        self._check_finite(state, step)
        meta = {"step": step, "loader": loader_state, "model": self.model_cfg.to_dict(),
                "layout": self.layout_meta(), "parallel_layout": dataclasses.asdict(self.runner.layout)}
        return state, meta, describe_state(state, list(self.engine.place.values()))

    def _check_finite(self, state: dict[str, Any], step: int) -> None:
        """Never save a non-finite state: every rank counts its non-finite tensors, summed over the world."""
        bad = self._nonfinite(state)
        if bad:
            raise NonFiniteStop(f"the state at step {step} holds {bad} non-finite tensor(s); "
                                "it was not saved and the last checkpoint is the last clean state")

    def _nonfinite(self, state: dict[str, Any]) -> int:
        """The non-finite tensors of `state` on all ranks together (one all-reduce)."""
        tensors = [t for part in state.values() for t in part.values()]
        bad = torch.tensor([float(local_nonfinite_count(tensors))], device=self.device)
        self.ctx.comm.all_reduce(bad, "world")
        return int(bad.item())

    def load(self, path: Path, store: CheckpointStore) -> dict[str, Any]:
        """Load the checkpoint at `path` (verified by `resume.resume_target`) into this rank's state — as
        saved when the layouts agree, re-sharded from its pieces when they differ — and return its meta."""
        meta = store.meta(path)
        saved = meta.get("layout", {"zero": 0})
        state = self.state_dict()
        if layout_differences(saved, self.layout_meta()) and has_pieces(path):
            load_resharded(path, state, list(self.engine.place.values()))  # another layout: re-shard
            if self.rank == 0:
                print(f"pentatron: re-sharded {path} from layout {saved} to {self.layout_meta()}", flush=True)
        else:
            check_resumable(path, saved, self.layout_meta())  # the same layout, or an old checkpoint
            meta = store.load(path, state)
        bad = self._nonfinite(state)  # a checkpoint whose manifest was rewritten around NaN weights
        if bad:
            raise CheckpointError(f"{path}: {bad} of its tensors hold NaN or infinite values; it cannot be resumed "
                                  "(set checkpoint.fallback=true for an older one, or --resume-from STEP)")
        self.runner.after_load()
        return meta
