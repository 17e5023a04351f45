"""MoE capacity over the whole micro-batch when context or sequence parallelism splits its sequences.

One process's MoE forward sees the micro-batch (b sequences × s tokens): each expert keeps its cap =
ceil(c·b·s·k/E) best assignments, by weight and then by earlier token (index b·s + position) —
`models/moe.py`. A cp rank holds s/cp tokens of each sequence (the zigzag × Ulysses slice of
`ContextShard`), a tp rank under sequence parallelism a contiguous 1/tp of those: `MicroBatchCapacity`,
an MoE layer's `capacity_scope`, makes the same choice over the ranks sharing the micro-batch:

    1. every rank takes, per expert, its own `cap` best assignments as (weight, micro-batch token index)
       pairs, padded with (−inf, +inf) — the expert's cap best of the micro-batch are among them;
    2. for each sharing dimension in turn ("tp", then "cp"): one all_gather of that [E, cap, 2] float64
       tensor (fp32 weights and token indices are exact in float64), on the run's device, and the cap
       best of the gathered candidates kept — the cap best of a union are among the unions' cap bests;
    3. the cap-th of the last round is the expert's threshold (the same on every sharing rank); a local
       assignment is kept iff it ranks at or above it.

The decision is a selection: no gradient flows through it (computed under no_grad on detached weights;
the kept assignments' weights keep their gradient in the layer). No host sync: the layer's only host read
stays its split sizes. Cost: per MoE layer per micro-batch, one all_gather of size·E·cap·16 bytes per
sharing dimension, in the comm ledger, only with a capacity factor (and again when full recompute reruns
the layer: every sharing rank reruns it in the same order).
"""

from __future__ import annotations

import torch

from pentatron.distributed.comm import Comm
from pentatron.models.moe import expert_counts, rank_in_expert

CP = "cp"


class MicroBatchCapacity:
    """An MoE layer's `capacity_scope` on one rank of the `dims` sharing the micro-batch (cp, tp under
    sp; together `parts` ranks holding disjoint equal slices of every sequence). `positions`
    [seq_len/parts]: the positions (0..seq_len−1) of the tokens this rank holds of every sequence, in its
    local order."""

    def __init__(self, comm: Comm, positions: torch.Tensor, seq_len: int, parts: int, n_experts: int,
                 dims: tuple[str, ...] = (CP,)) -> None:
        self.comm, self.positions, self.seq_len = comm, positions, seq_len
        self.parts, self.n_experts, self.dims = parts, n_experts, dims

    def tokens(self, local: int) -> int:
        return local * self.parts

    def token_index(self, local: int) -> torch.Tensor:
        """[local] each local token's index in the micro-batch (b·seq_len + position), on the device."""
        per_seq = self.positions.numel()
        if local % per_seq:
            raise ValueError(f"an MoE forward of {local} tokens: not whole slices of {per_seq} per sequence")
        seqs = torch.arange(local // per_seq, device=self.positions.device).unsqueeze(1)
        return (seqs * self.seq_len + self.positions).flatten()

    @torch.no_grad()
    def keep(self, experts: torch.Tensor, weights: torch.Tensor, cap: int) -> torch.Tensor:
        tokens, k = experts.shape
        n = self.n_experts
        flat_e = experts.flatten()
        w = weights.detach().flatten().double()
        at = self.token_index(tokens).to(w.device).repeat_interleave(k).double()
        # This rank's assignments by expert, then weight (descending), then micro-batch token (ascending).
        order = torch.argsort(at, stable=True)
        order = order[torch.argsort(-w[order], stable=True)]
        order = order[torch.argsort(flat_e[order], stable=True)]
        place = rank_in_expert(flat_e, order, expert_counts(flat_e, n)).clamp(max=cap)  # cap: not a candidate
        mine = torch.full((n * (cap + 1), 2), float("inf"), dtype=torch.float64, device=w.device)
        mine[:, 0] = -float("inf")
        mine[flat_e[order] * (cap + 1) + place] = torch.stack([w[order], at[order]], dim=1)
        best = mine.view(n, cap + 1, 2)[:, :cap].contiguous()
        for dim in self.dims:
            size = self.comm.ctx.size(dim)
            every = torch.empty((size * n, cap, 2), dtype=torch.float64, device=w.device)
            self.comm.all_gather(every, best, dim)
            cand = every.view(size, n, cap, 2).transpose(0, 1).reshape(n, size * cap, 2)
            cand = cand.take_along_dim(torch.argsort(cand[..., 1], dim=1, stable=True).unsqueeze(-1), dim=1)
            cand = cand.take_along_dim(torch.argsort(-cand[..., 0], dim=1, stable=True).unsqueeze(-1), dim=1)
            best = cand[:, :cap].contiguous()
        bar_w, bar_at = best[:, cap - 1, 0][flat_e], best[:, cap - 1, 1][flat_e]  # each expert's cap-th best
        return (w > bar_w) | ((w == bar_w) & (at <= bar_at))
