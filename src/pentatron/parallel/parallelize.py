"""The one function that turns a plain model into a parallel one, in a fixed and visible order.

    split into pipeline stages → tensor/sequence parallel → FP8 GEMMs → context parallel → expert parallel
    → MoE layers on a share of the micro-batch (cp, sp) → activation checkpointing
    → materialise this rank's pieces → data parallel / ZeRO → step runner

On a meta model (torchtitan's order: meta → parallelize → materialise local → init) nothing before the
materialisation allocates parameter storage, and ZeRO engines initialise their shards directly.

`ParallelLayout.problems` refuses what cannot run before any process group starts, and
again here. Each step records what it did to every parameter in that parameter's `Placement` (by
name), which the later steps and the step runner read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pentatron.config import Config
from pentatron.distributed.context import ParallelContext
from pentatron.layout import ParallelLayout
from pentatron.models.llama import LMHead, init_names, materialize_buffers
from pentatron.parallel.compile import apply_compile
from pentatron.parallel.context import apply_context_parallel
from pentatron.parallel.data import DataParallel, DataParallelBase
from pentatron.parallel.expert import apply_expert_parallel
from pentatron.parallel.grouped import GroupedDataParallel
from pentatron.parallel.materialize import LocalInit, materialize_params, meta_parameters
from pentatron.parallel.moe_tokens import apply_moe_token_shards
from pentatron.parallel.pipeline.stages import PipelineStage, build_stages, stage_layers, tied_parameter
from pentatron.parallel.placement import Placement, TPShard
from pentatron.parallel.recompute import apply_recompute
from pentatron.parallel.step_runner import StepRunner
from pentatron.parallel.tensor import (
    VocabParallelHead,
    apply_tensor_parallel,
    register_grad_hooks,
    vocab_parallel_cross_entropy,
)
from pentatron.parallel.zero import FullyShardedDataParallel, ZeroDataParallel
from pentatron.precision import PrecisionPolicy, wide
from pentatron.schedules import make_schedule


class LocalStages(nn.Module):
    """This pipeline rank's stages (one, or v chunks when interleaving) as one module whose parameter
    names are the full model's: every chunk's layers under one `layers` dict keyed by global index,
    plus the embedding / final norm / LM head when this rank holds the first / last stage. It is what
    the data-parallel engine wraps (an nn.ModuleList of stages would prefix the names); the step
    runner runs the stages themselves. Not callable."""

    def __init__(self, stages: Sequence[PipelineStage]) -> None:
        super().__init__()
        self.cfg = stages[0].cfg
        # Registered in forward order (embedding, layers, final norm, head): ZeRO-3 prefetches by it.
        for st in stages:
            if hasattr(st, "embed"):
                self.embed = st.embed
        self.layers = nn.ModuleDict({k: m for st in stages for k, m in st.layers.items()})
        for st in stages:
            for name in ("norm", "lm_head"):
                if hasattr(st, name):
                    self.add_module(name, getattr(st, name))
        # the stages themselves, for hooks on each chunk's forward (the profiler): a tuple is not
        # registered as submodules, so parameter names stay the full model's
        self.stages = tuple(stages)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a pipeline-parallel model runs through its StepRunner, not forward()")


def split_pipeline(model: nn.Module, ctx: ParallelContext, layout: ParallelLayout) -> list[PipelineStage] | None:
    """This rank's pipeline stages, in chunk order (None when pp = 1)."""
    if layout.pp == 1:
        return None
    ranges = stage_layers(model.cfg, layout.pp, layout.virtual, layout.seq_len, layers=layout.pp_layers)
    return build_stages(model, layout.pp, ctx.local_rank("pp"), ranges)


def _placements(module: nn.Module, stages: list[PipelineStage] | None, tp_shards: dict[str, TPShard],
                layout: ParallelLayout) -> dict[str, Placement]:
    """One placement per parameter of this rank, from what the pipeline split and TP did."""
    stage_of = {}
    for st in stages or []:
        for n, _ in st.named_parameters():
            stage_of.setdefault(n, st.index)
    out = {n: Placement(n, tuple(p.shape), tp_shards.get(n, TPShard(None)), stage_of.get(n),
                        grad_dims=layout.grad_reduce_dims)
           for n, p in module.named_parameters()}
    tied = tied_parameter(stages) if stages else None
    if tied is not None:
        # The tied embedding held by the first and the last stage's ranks: same gradient on both,
        # counted in the norm on the first (pp rank 0).
        first = any(st.is_first for st in stages)
        name = next(n for n, p in module.named_parameters() if p is tied)
        out[name].tied_peer = layout.pp - 1 if first else 0
        out[name].counted = first
    return out


def parallelize(model: nn.Module, ctx: ParallelContext, cfg: Config, policy: PrecisionPolicy,
                layout: ParallelLayout | None = None) -> StepRunner:
    """Apply every parallelism of `layout` (default: the config's for this world) to `model` and return
    the step runner, which owns the forward/backward of a step (plain loop or pipeline), the loss, gradient
    synchronisation and the optimizer. With pp > 1 only this rank's stages are kept; otherwise `model` is
    changed in place.

    `model` may be on the meta device (`build_meta_model`, the runtime's way): every step then acts on
    meta parameters and only this rank's pieces are materialised on ctx.device, initialised from
    (train.seed, name) to the 1-process model's values (`parallel/materialize.py`) — the local tensors
    here, or under ZeRO the engine's own (ZeRO-3: sharded) storage. A materialised model is cut up as is."""
    layout = layout or cfg.layout(ctx.world_size)
    problems = layout.problems(model.cfg, ctx.world_size)
    if problems:
        raise ValueError("cannot parallelize: " + "; ".join(problems))
    init = LocalInit(model.cfg, cfg.train.seed, init_names(model), policy.param_dtype, ctx.device)
    stages = split_pipeline(model, ctx, layout)
    tp_shards: dict[str, TPShard] = {}
    tp_partial: set[str] = set()  # replicated over tp, gradient partial per rank: summed once per step
    if layout.tp > 1:
        for part in stages or [model]:
            apply_tensor_parallel(part, ctx, ctx.comm, sp=layout.sp)
            tp_shards.update(part.tensor_parallel.shards)
            tp_partial.update(part.tensor_parallel.partial)
    for part in stages or [model]:  # after TP: a sharded linear's FP8 casts reduce their amax over its split
        if cfg.train.fp8 != "off":
            from pentatron.parallel.fp8 import apply_fp8  # torchao: imported by FP8 runs only (seconds)

            apply_fp8(part, cfg.train.fp8, ctx.comm, layout.cp, cfg.train.fp8_skip, ctx.device)
        apply_context_parallel(part, ctx.comm, layout)
    module = LocalStages(stages) if stages else model  # collected after TP replaced embedding and head
    ep_shards = apply_expert_parallel(module, ctx)
    for part in stages or [model]:  # MoE layers on a share of the micro-batch (cp, sp): after ep's new weights
        tp_partial.update(apply_moe_token_shards(part, ctx.comm, layout))  # under sp, every MoE parameter
    placements = _placements(module, stages, tp_shards, layout)
    for name in tp_partial:
        placements[name].tp_partial = True
    for name, shard in ep_shards.items():  # expert weights: a slice of the experts, reduced over edp
        placements[name].expert, placements[name].grad_dims = shard, ("edp",)
    # compiled regions between the collectives, before checkpointing wraps them (parallel/compile.py)
    compiled = apply_compile(module, cfg.train.compile, ctx.device, cfg.train.compile_backend,
                             split_backward=layout.pp > 1 and make_schedule(layout.pp_schedule, layout.pp,
                                                                            layout.microbatches, layout.virtual
                                                                            ).split_backward,
                             eager_attention=cfg.data.document_mask)
    apply_recompute(module, cfg.train.recompute)
    for part in stages or [model]:
        materialize_buffers(part, ctx.device)
    if layout.zero == 0:  # ZeRO engines initialise their own flat (ZeRO-3: sharded) storage instead
        materialize_params(module, placements, init)
    engine = data_parallel(module, ctx, cfg, policy, placements, stages, init)
    left = meta_parameters(module)
    if left:
        raise RuntimeError(f"parallelize: parameters left on the meta device: {left[:5]}")
    for part in stages or [model]:
        register_grad_hooks(part)
    set_loss_chunk_tokens(module, cfg.train.loss_chunk_tokens)
    runner = StepRunner(module, engine, ctx, layout, _loss_fn(ctx), stages, model.cfg.hidden_size, cfg.train,
                        cfg.data)
    runner.compiled = compiled
    return runner


def set_loss_chunk_tokens(module: nn.Module, tokens: int) -> None:
    """How many tokens each LM head (plain or vocab-parallel) turns into logits at a time in its loss."""
    for m in module.modules():
        if isinstance(m, (LMHead, VocabParallelHead)):
            m.chunk_tokens = tokens


def _loss_fn(ctx: ParallelContext):  # noqa: ANN202 - returns the loss function
    comm = ctx.comm
    if ctx.size("tp") > 1:
        # The model returns this rank's vocabulary slice of the logits; never gather them.
        return lambda logits, targets: vocab_parallel_cross_entropy(wide(logits), targets, comm)
    return lambda logits, targets: F.cross_entropy(wide(logits).flatten(0, 1), targets.flatten())


def data_parallel(model: nn.Module, ctx: ParallelContext, cfg: Config, policy: PrecisionPolicy,
                  placements: dict[str, Placement] | None = None, stages: list[PipelineStage] | None = None,
                  init: LocalInit | None = None) -> DataParallelBase | GroupedDataParallel:
    """The configured ZeRO stage's engine; one per gradient group (`GroupedDataParallel`) when parameters
    reduce over different groups (expert parallelism)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, pl in (placements or {}).items():
        groups.setdefault(pl.grad_dims, []).append(name)
    if len(groups) <= 1:
        return _engine(model, ctx, cfg, policy, placements, stages, None, init)
    return GroupedDataParallel([_engine(model, ctx, cfg, policy, placements, stages, names, init)
                                for _, names in sorted(groups.items(), key=lambda g: g[0] == ("edp",))])


def _engine(model: nn.Module, ctx: ParallelContext, cfg: Config, policy: PrecisionPolicy,
            placements: dict[str, Placement] | None, stages: list[PipelineStage] | None,
            only: list[str] | None, init: LocalInit | None = None) -> DataParallelBase:
    par = cfg.parallel
    if par.zero == 0:
        return DataParallel(model, ctx, policy, par.bucket_mb, placements, only=only)
    if par.zero in (1, 2):
        return ZeroDataParallel(model, ctx, policy, par.bucket_mb, stage=par.zero, placements=placements, only=only,
                                 init=init, overlap_param_gather=par.overlap_param_gather)
    if par.zero == 3:
        return FullyShardedDataParallel(model, ctx, policy, par.bucket_mb, placements,
                                        chunks=list(stages) if stages else None, gather=par.zero3_gather,
                                        only=only, init=init)
    raise ValueError(f"parallel.zero must be 0, 1, 2 or 3, got {par.zero}")
