"""Everything the trainer reports besides its own metrics, behind a handful of hook calls:
the flight recorder and hang watchdog, numerics and loss spikes, the profiler, and the run report.

    obs = RunObserver(cfg, ctx, model, engine, loader)     # after the model is parallelized
    obs.begin_step(step)          # before the step's first op (step counts from 1); the first resets
                                  # the peak-memory counters (set-up excluded)
    obs.micro(i)                  # before each micro-batch (non-pipeline runs)
    obs.after_backward()          # gradients synchronised, before clipping
    obs.after_optimizer()         # after the optimizer step
    record.update(obs.peak_memory())      # peak_mem_bytes, peak_mem_reserved_bytes since training began
    record.update(obs.end_step(record))   # the step's record, before it is logged
    obs.close(records)            # end of fit (also on failure)

The flight recorder is attached earlier (`start_flight_recorder`, right after the ParallelContext),
so that the collectives of parallelize() are recorded too; its watchdog thread starts with the first
step: set-up (rank 0 tokenizing the corpus while the others wait in a barrier, loading a checkpoint)
may legitimately take longer than `distributed.timeout_s`, and stays under the process group's own
timeout.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pentatron.observe.flight_recorder import note_micro, note_step
from pentatron.observe.memory import PeakMemory
from pentatron.observe.numerics import LayerNumerics, SpikeDetector
from pentatron.observe.profiler import StepProfiler
from pentatron.observe.report import write_report, write_run_info
from pentatron.observe.watchdog import Watchdog, attach_flight_recorder

if TYPE_CHECKING:
    from pentatron.config import Config
    from pentatron.distributed.context import ParallelContext


def start_flight_recorder(cfg: Config, ctx: ParallelContext) -> Watchdog | None:
    """The flight recorder on `ctx.comm` (+ check mode) and, on several processes, the hang watchdog
    (not started yet: `RunObserver.begin_step` starts it)."""
    d = cfg.distributed
    return attach_flight_recorder(ctx, Path(cfg.log.dir) / "flight", d.timeout_s, d.check_collectives, start=False)


class RunObserver:
    def __init__(self, cfg: Config, ctx: ParallelContext, model: nn.Module, engine: Any, loader: Any,
                 watchdog: Watchdog | None = None, model_state: Callable[[], int] | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.engine = engine
        self.loader = loader
        self.watchdog = watchdog
        self.every = cfg.log.numerics_every
        self.numerics = LayerNumerics(model) if self.every > 0 else None
        self.spikes = SpikeDetector()
        self.profiler = None
        if cfg.log.profile:
            from pentatron.config import profile_steps

            steps = profile_steps(cfg.log.profile)
            assert steps is not None  # validated with the config
            self.profiler = StepProfiler(steps, Path(cfg.log.dir) / "profile", ctx.rank, ctx.device,
                                         ctx.comm.recorder, model, model_state)
        self.memory: PeakMemory | None = None  # created by the first step: training begins
        self._setup_reported = False
        self.step = 0
        self._consumed = 0
        self._extra: dict[str, Any] = {}
        if ctx.rank == 0:
            cuda = ctx.device.type == "cuda"
            name = torch.cuda.get_device_name(ctx.device) if cuda else (platform.processor() or "cpu")
            write_run_info(Path(cfg.log.dir), cfg.to_dict(), ctx.world_size, ctx.device.type, name)

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == 1 or step == self.cfg.train.steps)

    # ------------------------------------------------------------------ hooks
    def begin_step(self, step: int) -> None:
        self.step = step
        if self.memory is None:  # model built, checkpoint loaded, data ready: from here on it is training
            self.memory = PeakMemory(self.ctx.device)
        self._consumed = self.loader.consumed_samples
        self._extra = {}
        note_step(self.ctx.comm, step)
        if self.watchdog is not None:
            self.watchdog.start()  # a no-op after the first step
        if self.numerics is not None:
            self.numerics.begin(self.due(step))
        if self.profiler is not None:
            self.profiler.begin_step(step)

    def micro(self, i: int) -> None:
        note_micro(self.ctx.comm, i)

    def after_backward(self) -> None:
        note_micro(self.ctx.comm, None)
        if self.profiler is not None:
            self.profiler.after_backward()
        if self.numerics is not None and self.numerics.active:
            self._extra.update(self.numerics.gradients(self.engine.owned_param_grads()))

    def after_optimizer(self) -> None:
        if self.profiler is not None:
            self.profiler.after_optimizer()
        if self.numerics is not None and self.numerics.active:
            self._extra.update(self.numerics.updates())

    def peak_memory(self) -> dict[str, int | None]:
        """This rank's peak memory since training began (see observe/memory.py), for the step record;
        the first record also carries the set-up's peak (`setup_peak_mem_bytes`: launch to training)."""
        if self.memory is None:
            self.memory = PeakMemory(self.ctx.device)
        out = self.memory.read()
        if not self._setup_reported:
            self._setup_reported = True
            out["setup_peak_mem_bytes"] = self.memory.setup_peak_bytes
        return out

    def end_step(self, record: dict[str, Any]) -> dict[str, Any]:
        """Fields to add to the step's record: `numerics` on due steps, `loss_spike` when one happened."""
        out: dict[str, Any] = {}
        if self.profiler is not None:
            self.profiler.end_step(record["step"])
        if self._extra:
            out["numerics"] = self._extra
        samples = self.loader.sample_ids(self._consumed, self.cfg.train.global_batch).tolist()
        spike = self.spikes.update(record["step"], float(record["loss"]), samples)
        if spike is not None:
            out["loss_spike"] = spike.to_dict()
            if self.ctx.rank == 0:
                print(f"pentatron: warning: {spike.describe()}", file=sys.stderr, flush=True)
        return out

    def close(self, records: list[dict[str, Any]]) -> None:
        if self.profiler is not None:
            self.profiler.finish()
        if self.numerics is not None:
            self.numerics.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.ctx.rank == 0 and records:
            try:
                path = write_report(Path(self.cfg.log.dir))
                print(f"pentatron: run report in {path}", flush=True)
            except Exception as e:  # noqa: BLE001 - a report problem must not fail a finished run
                print(f"pentatron: warning: no run report: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
