"""The one function that turns a plain model into a parallel one, in a fixed and visible order.

    split into pipeline stages → tensor/sequence parallel → context parallel → expert parallel
    → activation checkpointing → compile → data parallel / ZeRO

Only the steps that exist so far are applied; the others are rejected by config validation (cp,
ep > 1) before any process group starts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pentatron.config import Config
from pentatron.distributed.context import ParallelContext
from pentatron.parallel.data import DataParallel, DataParallelBase
from pentatron.parallel.pipeline.stages import PipelineStage, build_stages, stage_layers, tied_parameter
from pentatron.parallel.recompute import apply_recompute
from pentatron.parallel.tensor import apply_tensor_parallel
from pentatron.parallel.zero import FullyShardedDataParallel, ZeroDataParallel
from pentatron.precision import PrecisionPolicy


class LocalStages(nn.Module):
    """This pipeline rank's stages (one, or v chunks when interleaving) as one module whose parameter
    names are the full model's: every chunk's layers under one `layers` dict keyed by global index,
    plus the embedding / final norm / LM head when this rank holds the first / last stage. It is what
    the data-parallel engine wraps (an nn.ModuleList of stages would prefix the names); the pipeline
    engine runs `stages`. Not callable: a pipeline step runs through `PipelineEngine`."""

    def __init__(self, stages: Sequence[PipelineStage]) -> None:
        super().__init__()
        self.cfg = stages[0].cfg
        self.layers = nn.ModuleDict({k: m for st in stages for k, m in st.layers.items()})
        for st in stages:
            for name in ("embed", "norm", "lm_head"):
                if hasattr(st, name):
                    self.add_module(name, getattr(st, name))
        self.__dict__["stages"] = list(stages)  # not registered: the names above are the only ones

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a pipeline-parallel model runs through PipelineEngine.step, not forward()")


def split_pipeline(model: nn.Module, ctx: ParallelContext, cfg: Config) -> nn.Module:
    """Keep only this rank's pipeline stages (the model itself when pp = 1)."""
    pp = ctx.size("pp")
    if pp == 1:
        return model
    par = cfg.parallel
    v = par.pp_virtual if par.pp_schedule == "interleaved" else 1
    ranges = stage_layers(model.cfg, pp, v, cfg.train.seq_len)
    return LocalStages(build_stages(model, pp, ctx.local_rank("pp"), ranges))


def parallelize(model: nn.Module, ctx: ParallelContext, cfg: Config, policy: PrecisionPolicy) -> DataParallelBase:
    """Apply every parallelism the config asks for to `model` and return the data-parallel engine that
    owns gradient synchronisation and the optimizer. With pp > 1 the engine's `model` is this rank's
    `LocalStages` (the rest of the model is dropped); otherwise it is `model`, changed in place."""
    model = split_pipeline(model, ctx, cfg)
    stages = model.stages if isinstance(model, LocalStages) else None
    tp = ctx.size("tp")
    if tp > 1:
        if stages is None:
            apply_tensor_parallel(model, ctx, ctx.comm, sp=cfg.parallel.sp)
        else:
            for st in stages:
                apply_tensor_parallel(st, ctx, ctx.comm, sp=cfg.parallel.sp)
                st.sequence_shards = tp if cfg.parallel.sp else 1
            model = LocalStages(stages)  # re-collect: TP replaced the embedding and LM head modules
    apply_recompute(model, cfg.train.recompute)
    engine = data_parallel(model, ctx, cfg, policy)
    if stages is not None:
        tied = tied_parameter(stages)
        if tied is not None and not any(st.is_first for st in stages):
            # The last stage's copy of a tied embedding: its gradient norm is counted on the first stage.
            engine.counted_elsewhere = {tied}
    return engine


def data_parallel(model: nn.Module, ctx: ParallelContext, cfg: Config, policy: PrecisionPolicy) -> DataParallelBase:
    par, train = cfg.parallel, cfg.train
    if par.zero == 0:
        return DataParallel(model, ctx, train, policy, par.bucket_mb)
    if par.zero in (1, 2):
        return ZeroDataParallel(model, ctx, train, policy, par.bucket_mb, stage=par.zero)
    if par.zero == 3:
        return FullyShardedDataParallel(model, ctx, train, policy, par.bucket_mb)
    raise ValueError(f"parallel.zero must be 0, 1, 2 or 3, got {par.zero}")
