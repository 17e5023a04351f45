"""Partition a Llama into pipeline stages, and keep tied embeddings tied across the first and last stage.

A *stage* (a "chunk" when a rank holds several, for interleaving) is a contiguous range of decoder
layers; stage 0 also owns the embedding and the last stage the final norm, the LM head (and so the
loss). Stages are placed Megatron-style, as `schedules.Schedule` defines: rank r holds stages
r, r + p, r + 2p, ... (chunk c of rank r is stage c·p + r).

Layers are assigned either from an explicit per-stage list, or balanced by a cost estimate in which
the embedding and the LM head + loss count like layers do (for a small model the LM head alone costs
several layers' FLOPs, so an even split would leave the last stage the bottleneck). Interleaved
schedules use equal chunks (their bubble formula assumes it), so there the layers must divide evenly.

Every rank builds the full model on the meta device (no storage) and keeps only its own stages, which
alone are then materialised (`parallel/materialize.py`; each parameter's init depends only on (seed,
name)); parameter names are the full model's ("layers.5.mlp.up_proj.weight"), so checkpoints and parity
tests line up with the 1-process model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pentatron.distributed.comm import P2P, Comm
from pentatron.models.config import ModelConfig
from pentatron.models.documents import Documents
from pentatron.models.llama import Llama, decoder_forward
from pentatron.parallel.pipeline.partition import PartitionError, StageCosts, partition

__all__ = ["PartitionError", "PipelineStage", "StageCosts", "build_stages", "partition", "stage_layers",
           "sync_tied_grads", "tied_parameter"]


def stage_layers(cfg: ModelConfig, pp: int, virtual: int, seq_len: int,
                 layers: Sequence[int] | None = None) -> list[range]:
    """The partition the runtime uses: explicit if given; equal chunks for interleaving; else balanced."""
    n_stages = pp * virtual
    if layers is not None:
        return partition(cfg.n_layers, n_stages, layers=layers)
    if virtual > 1:
        return partition(cfg.n_layers, n_stages, uniform=True)
    return partition(cfg.n_layers, n_stages, costs=StageCosts.of(cfg, seq_len))


# ---------------------------------------------------------------- the stage module
class PipelineStage(nn.Module):
    """One stage of a Llama: [embedding] → layers[lo:hi] → [final norm → LM head].

    Holds the full model's submodules (not copies) under the full model's attribute names, so its
    `named_parameters()` are a subset of the model's. Input: token ids on stage 0, else the hidden
    state [b, s, h]; output: the hidden state, or logits on the last stage.
    """

    def __init__(self, model: Llama, index: int, n_stages: int, layers: range) -> None:
        super().__init__()
        self.index, self.n_stages = index, n_stages
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.cfg = model.cfg
        self.rotary = model.rotary  # RoPE tables are non-persistent buffers, needed by every stage
        if self.is_first:
            self.embed = model.embed
        # A dict keyed by the global layer index keeps the names "layers.<i>.…" of the full model.
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        if self.is_last:
            self.norm = model.norm
            self.lm_head = model.lm_head

    @property
    def layer_ids(self) -> list[int]:
        return [int(k) for k in self.layers]

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, documents: Documents | None = None) -> torch.Tensor:
        """`positions`: of the whole sequence (a received hidden state may be a sequence-parallel slice);
        `targets` (last stage): return the head's chunked loss instead of the logits; `documents`: the
        micro-batch's (document masking: every stage's attention needs them)."""
        return decoder_forward(x, positions, self.rotary, self.layers.values(), getattr(self, "embed", None),
                               getattr(self, "norm", None), getattr(self, "lm_head", None), targets, documents)


def build_stages(model: Llama, pp: int, pp_rank: int, ranges: Sequence[range]) -> list[PipelineStage]:
    """This rank's stages, in chunk order (chunk c = stage c·pp + pp_rank). The rest of `model` is
    no longer referenced by them and can be dropped by the caller."""
    n_stages = len(ranges)
    if n_stages % pp:
        raise PartitionError(f"{n_stages} stages cannot be spread evenly over pp={pp} ranks")
    return [PipelineStage(model, s, n_stages, ranges[s]) for s in range(pp_rank, n_stages, pp)]


def tied_parameter(stages: Sequence[PipelineStage]) -> nn.Parameter | None:
    """The tied embedding/LM-head weight this rank holds, when it must be kept in sync with another
    rank: the model ties them and the first and last stage live on different ranks."""
    if not stages or not stages[0].cfg.tie_embeddings:
        return None
    first = next((s for s in stages if s.is_first), None)
    last = next((s for s in stages if s.is_last), None)
    if first is not None and last is not None:
        return None  # both on this rank: one Parameter object, autograd already sums its gradients
    if first is not None:
        return first.embed.weight
    if last is not None:
        return last.lm_head.weight
    return None


def sync_tied_grads(stages: Sequence[PipelineStage], comm: Comm, pp_rank: int, pp: int, dim: str = "pp") -> None:
    """Sum the tied weight's gradient between the first stage's rank and the last stage's rank.

    Both ranks exchange their gradients and add: a + b and b + a are the same float, so both copies get
    bitwise-identical gradients and (with identical optimizer state) stay identical forever. Only the
    two ranks involved move data; middle stages do nothing."""
    param = tied_parameter(stages)
    if param is None:
        return
    peer = pp - 1 if pp_rank == 0 else 0
    # A data-parallel engine keeps the accumulated gradient in its flat buffer (`main_grad`).
    grad = getattr(param, "main_grad", None)
    if grad is None:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
    theirs = torch.empty_like(grad)
    comm.batch_p2p([P2P("send", grad, peer), P2P("recv", theirs, peer)], dim).wait()
    grad.add_(theirs)
