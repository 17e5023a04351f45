"""Pipeline runs on real gloo ranks in strict comm mode with the hang watchdog attached (run through
lab.ranks.RankGroup, whose exit codes are the outcome): step 1 with the engine's own p2p plan, step 2
with the pre-issue-35 order (`legacy_plan`), which under NCCL's ordering deadlocks."""

from __future__ import annotations

from pathlib import Path

import torch

from pentatron.distributed.context import ParallelContext
from pentatron.layout import ParallelLayout
from pentatron.models.llama import build_model
from pentatron.observe.flight_recorder import note_step
from pentatron.observe.watchdog import attach_flight_recorder
from pentatron.parallel.pipeline.engine import PipelineEngine
from pentatron.parallel.pipeline.stages import build_stages, stage_layers
from pentatron.schedules import make_schedule
from tests.parallel.pipeline.harness import SEQ, Case, loss_fn, model_config
from tests.parallel.pipeline.legacy_plan import lazy_receive_plan


def new_then_legacy_order(rank: int, world: int, run_dir: str, timeout_s: float, schedule: str, m: int) -> None:
    ctx = ParallelContext.from_layout(ParallelLayout(pp=world), "cpu")
    ctx.comm.strict = True
    cfg = model_config(Case(schedule, n_layers=2))
    s = make_schedule(schedule, world, m)
    stages = build_stages(build_model(cfg, seed=0), world, rank, stage_layers(cfg, world, 1, SEQ))
    torch.manual_seed(0)
    mbs = [(torch.randint(0, cfg.vocab_size, (1, SEQ)), torch.randint(0, cfg.vocab_size, (1, SEQ)))
           for _ in range(m)]
    # attached once every rank is built (its barriers line them up), so a slow start is not a "hang"
    dog = attach_flight_recorder(ctx, Path(run_dir) / "flight", timeout_s, check=False)
    note_step(ctx.comm, 1)
    PipelineEngine(stages, s, ctx.comm, rank, loss_fn).step(mbs)
    print(f"rank {rank}: step 1 (p2p_plan) done", flush=True)
    note_step(ctx.comm, 2)
    PipelineEngine(stages, s, ctx.comm, rank, loss_fn, plan=lazy_receive_plan(s)).step(mbs)
    print(f"rank {rank}: step 2 (legacy order) done", flush=True)
    if dog is not None:
        dog.stop()
