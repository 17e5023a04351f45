"""Context parallelism: the sequence of every sample is split over the cp ranks, and attention — the one
operation that mixes tokens — is done together; everything else (embeddings, norms, MLP, loss) is
per token and runs on the local slice unchanged — but for MoE's choices over the whole sequences or
micro-batch: the balancing loss's counts and the capacity drops (`moe_tokens.py`).

Which tokens a rank holds (`cp_token_index`). A cp group is `ring × ulysses` ranks, Ulysses innermost.
The sequence is cut into 2·ring chunks and ring rank i takes chunks i and 2·ring−1−i (the zigzag that
balances the causal mask, see `ring_attention.py`); the Ulysses ranks of that ring rank then split
those tokens contiguously. Positions go with the tokens (RoPE), so every layer but attention is
oblivious.

How attention is shared (`ContextParallelAttention`, replacing each block's `AttentionCore`):

    ulysses   all-to-all q, k, v from [b, s/u, H] to [b, s, H/u] (kv heads replicated first when fewer
              than u), causal attention on whole sequences, all-to-all the output back: 4 per layer.
    ring      K/V blocks around the ring, partial outputs merged by log-sum-exp.
    hybrid    Ulysses inside (gathering the ring rank's two chunks), ring across.

Document masking: the cores get the micro-batch's `Documents` (of the whole sequences, the same on every
rank). Ulysses holds whole sequences, so it runs the one-process kernel (`document_attention`); the ring cuts
the documents at its blocks (`ring_attention.py`). RoPE positions restarting per document are sliced by the
step runner like the tokens.

Gradients of parameters are averaged over dp×cp (every cp rank holds every parameter and the loss is
the mean of the cp ranks' equal-sized shares); the step runner slices the batches and averages the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pentatron.distributed.comm import Comm
from pentatron.distributed.functional import heads_to_seq, seq_to_heads
from pentatron.layout import ParallelLayout
from pentatron.models.documents import Documents, document_attention
from pentatron.parallel.attention_kernels import BlockKernel, block_kernel
from pentatron.parallel.ring_attention import AttentionCount, ring_attention, zigzag_positions

RING, ULYSSES = "cp_ring", "cp_ulysses"  # the comm layer's names for the two sub-groups of cp


def cp_token_index(seq_len: int, ring: int, ulysses: int, ring_rank: int, ulysses_rank: int) -> torch.Tensor:
    """Positions (0..seq_len−1) of the tokens held by the cp rank at (ring_rank, ulysses_rank)."""
    local = torch.arange(seq_len) if ring == 1 else torch.from_numpy(zigzag_positions(seq_len, ring, ring_rank))
    piece = local.numel() // ulysses
    return local[ulysses_rank * piece: (ulysses_rank + 1) * piece]


class ContextShard:
    """This rank's share of every sequence: its token positions, and the slicing of a batch."""

    def __init__(self, comm: Comm, layout: ParallelLayout) -> None:
        ctx = comm.ctx
        self.positions = cp_token_index(layout.seq_len, layout.cp_ring_degree, layout.cp_ulysses_degree,
                                        ctx.local_rank(RING), ctx.local_rank(ULYSSES)).to(ctx.device)

    def take(self, batch: torch.Tensor) -> torch.Tensor:
        """[b, seq_len] → [b, seq_len / cp]: this rank's tokens (inputs or targets)."""
        return batch[:, self.positions.to(batch.device)]


class ContextParallelAttention(nn.Module):
    """Causal attention over the whole cp group's sequence for this rank's slice of queries.
    Inputs and output are [b, s_local, heads, head_dim], as `AttentionCore`'s."""

    def __init__(self, comm: Comm, layout: ParallelLayout, kernel: BlockKernel | None = None) -> None:
        super().__init__()
        self.comm = comm
        self.ulysses, self.ring = layout.cp_ulysses_degree, layout.cp_ring_degree
        self.kernel = kernel or block_kernel("fused")
        self.count = AttentionCount()  # what this rank's ring attention computed (tests, benchmarks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        u = self.ulysses
        if u > 1:
            if k.shape[2] < u:  # fewer kv heads than Ulysses ranks: each rank gets a copy of its group's
                k, v = (t.repeat_interleave(u // t.shape[2], dim=2) for t in (k, v))
            q, k, v = (seq_to_heads(t, self.comm, ULYSSES) for t in (q, k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.ring > 1:
            out = ring_attention(q, k, v, self.comm, RING, self.kernel, self.count, documents)
        elif documents is not None:
            out = document_attention(q, k, v, documents)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        out = out.transpose(1, 2)
        return heads_to_seq(out.contiguous(), self.comm, ULYSSES) if u > 1 else out

    def extra_repr(self) -> str:
        return f"ulysses={self.ulysses}, ring={self.ring}, kernel={self.kernel.name}"


def apply_context_parallel(model: nn.Module, comm: Comm, layout: ParallelLayout, kernel: str = "fused") -> None:
    """Replace every decoder block's attention core (a pipeline rank's stages keep their layers in a dict).
    MoE layers' choices over the whole micro-batch: `moe_tokens.py`."""
    if layout.cp == 1:
        return
    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in blocks:
        block.attn.core = ContextParallelAttention(comm, layout, block_kernel(kernel))
