"""MoE layers on a share of the micro-batch's tokens: context parallelism and sequence parallelism.

One process's MoE layer routes the whole micro-batch. A cp rank holds a slice of every sequence (the
zigzag × Ulysses positions of `ContextShard`) and, under sequence parallelism, a tp rank a contiguous
1/tp of that slice (the residual stream's sequence shard: the MoE layer runs outside the tp regions).
So a layer's tokens are a share of the micro-batch, 1/(cp·tp_sp) of it, and three things must still
mean what they mean on one process:

- the balancing loss's assignment counts fᵢ are the micro-batch's: `Router.count_sequences` sums the
  local counts over the sharing dims (one all-reduce of E numbers per dim per forward, on the device);
- capacity is over the micro-batch: `MicroBatchCapacity` over the same dims (`moe_capacity.py`);
- gradients. Under cp every parameter's gradient is averaged over dp×cp and the cp ranks' losses are
  means of equal shares: nothing more to do. Under sp the MoE layer's parameters (router, experts, shared
  experts) are replicated over tp — each tp rank runs its own tokens through the same (or, under ep,
  the same slice of) experts, no compute repeated — so each rank's gradient covers its tokens only and
  the full one is their sum over tp. They are marked `Placement.tp_partial`, as the sequence-parallel
  norms are, and the step runner sums them over tp once per step, after the data-parallel reduction:
  this rank's owned pieces (its ZeRO pieces under ZeRO, the expert engine's over edp under ep) of all of
  them in ONE all-reduce with the norms' (per 25 MiB concatenated: `tensor.sum_partial_grads`). A
  gradient hook per parameter did it after every micro-batch's backward: the whole tensors, m times per
  step. The routing losses' own gradient is summed too, so each tp rank's router carries 1/tp of it
  (`Router.loss_share`).

Why replicate rather than shard the experts over tp: an expert's rows are few and uneven, so splitting
its ffn over tp would add an all-reduce of every routed token per layer and leave each rank a thin GEMM;
with experts whole, tp under sp acts for the MoE layer like data parallelism over tokens (Megatron-Core's
expert tensor parallelism of 1). Its cost is the replicated memory (expert parallelism divides it) and
the once-per-step tp sum of the owned pieces of the layer's gradients.

The layer's load statistics (`finish_step`) are summed over tp too under sp (the step runner's reduce),
so the aux-free biases and the metrics are the micro-batch's on every rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from pentatron.distributed.comm import Comm
from pentatron.layout import ParallelLayout
from pentatron.models.moe import moe_layers
from pentatron.parallel.context import ContextShard
from pentatron.parallel.moe_capacity import MicroBatchCapacity

TP, CP = "tp", "cp"


def sharing_dims(layout: ParallelLayout) -> tuple[str, ...]:
    """The dimensions whose ranks hold disjoint shares of one micro-batch's tokens at an MoE layer."""
    return ((TP,) if layout.sp and layout.tp > 1 else ()) + ((CP,) if layout.cp > 1 else ())


def token_positions(comm: Comm, layout: ParallelLayout) -> torch.Tensor:
    """Positions (0..seq_len−1) of the tokens of every sequence this rank's MoE layers see, in order."""
    ctx = comm.ctx
    held = ContextShard(comm, layout).positions if layout.cp > 1 else torch.arange(layout.seq_len, device=ctx.device)
    if not (layout.sp and layout.tp > 1):
        return held
    piece = held.numel() // layout.tp  # the sequence shard's contiguous chunk (scatter_sequence)
    r = ctx.local_rank(TP)
    return held[r * piece: (r + 1) * piece]


def apply_moe_token_shards(model: nn.Module, comm: Comm, layout: ParallelLayout) -> frozenset[str]:
    """Set the hooks above on every MoE layer of `model` (a whole model or a pipeline stage). Call after
    expert parallelism (its expert weights are new parameters). Returns the names of the parameters whose
    gradient is partial over tp (every MoE parameter under sp; none otherwise), for their placements'
    `tp_partial`; a tensor-parallel model's plan lists them too (`tensor.sum_partial_param_grads`)."""
    dims = sharing_dims(layout)
    layers = moe_layers(model)
    if not dims or not layers:
        return frozenset()
    positions = None
    partial: list[nn.Parameter] = []
    for layer in layers.values():
        layer.router.count_sequences = _sum_over(dims, comm)
        if layer.cfg.capacity_factor is not None:
            positions = token_positions(comm, layout) if positions is None else positions
            parts = layout.seq_len // positions.numel()
            layer.capacity_scope = MicroBatchCapacity(comm, positions, layout.seq_len, parts,
                                                      layer.cfg.n_experts, dims)
        if TP in dims:
            layer.router.loss_share = 1.0 / layout.tp
            partial += layer.parameters()
    ids = {id(p) for p in partial}
    names = frozenset(n for n, p in model.named_parameters() if id(p) in ids)
    plan = getattr(model, "tensor_parallel", None)
    if plan is not None:
        model.tensor_parallel = replace(plan, partial=plan.partial | names)
    return names


def _sum_over(dims: tuple[str, ...], comm: Comm) -> Any:
    def total(counts: torch.Tensor) -> torch.Tensor:
        out = counts.detach().clone()
        for dim in dims:
            comm.all_reduce(out, dim)
        return out

    return total

