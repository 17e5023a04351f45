"""The one function that turns a plain model into a parallel one, in a fixed and visible order.

    split into pipeline stages → tensor/sequence parallel → context parallel → expert parallel
    → activation checkpointing → compile → data parallel / ZeRO

Only the steps that exist so far are applied; the others are rejected by config validation (pp, cp,
ep > 1) before any process group starts.
"""

from __future__ import annotations

from torch import nn

from pentatron.config import Config
from pentatron.distributed.context import ParallelContext
from pentatron.parallel.data import DataParallel, DataParallelBase
from pentatron.parallel.tensor import apply_tensor_parallel
from pentatron.parallel.zero import FullyShardedDataParallel, ZeroDataParallel
from pentatron.train.precision import PrecisionPolicy
from pentatron.train.recompute import apply_recompute


def parallelize(model: nn.Module, ctx: ParallelContext, cfg: Config, policy: PrecisionPolicy) -> DataParallelBase:
    """Apply every parallelism the config asks for to `model` (in place) and return the data-parallel
    engine that owns gradient synchronisation and the optimizer."""
    if ctx.size("tp") > 1:
        apply_tensor_parallel(model, ctx, ctx.comm, sp=cfg.parallel.sp)
    apply_recompute(model, cfg.train.recompute)
    return data_parallel(model, ctx, cfg, policy)


def data_parallel(model: nn.Module, ctx: ParallelContext, cfg: Config, policy: PrecisionPolicy) -> DataParallelBase:
    par, train = cfg.parallel, cfg.train
    if par.zero == 0:
        return DataParallel(model, ctx, train, policy, par.bucket_mb)
    if par.zero in (1, 2):
        return ZeroDataParallel(model, ctx, train, policy, par.bucket_mb, stage=par.zero)
    if par.zero == 3:
        return FullyShardedDataParallel(model, ctx, train, policy, par.bucket_mb)
    raise ValueError(f"parallel.zero must be 0, 1, 2 or 3, got {par.zero}")
