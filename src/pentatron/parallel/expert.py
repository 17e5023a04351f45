"""Expert parallelism: an MoE layer's experts sharded over the "ep" group, tokens sent to them by all-to-all.

Each ep rank keeps E/ep consecutive experts (a slice of dim 0 of the stacked expert weights) and sets
the layer's `expert_parallel` hook. Per MoE forward, with the tokens already grouped by global expert:

    1. counts: every rank tells every other how many tokens it sends to each of that rank's experts
       (an all-to-all of E integers) — the real, uneven per-expert counts, so no padding and no drops;
    2. dispatch: one all-to-all of the token rows with those uneven splits;
    3. the received rows, grouped by (source rank, local expert), are regrouped by local expert and
       each expert runs one matmul chain on its rows (`Experts.forward`);
    4. combine: the outputs go back in the reverse all-to-all, in the order the tokens left.

The backward of each all-to-all is the reverse all-to-all (`distributed/functional.all_to_all`), so a
layer moves 2·(sent + received)·h elements per forward+backward, all in the comm ledger with the bytes
each rank really sent. The ep group is carved from dp×cp (`ParallelContext`): ranks of one ep group
hold different experts and different tokens; ranks of one expert-data group ("edp") hold the same
experts, and expert gradients are reduced over it only (`GroupedDataParallel`). The routers, shared
experts and everything else stay replicated over dp×cp as before.
"""

from __future__ import annotations

import torch
from torch import nn

from pentatron.distributed.comm import Comm
from pentatron.distributed.context import ParallelContext
from pentatron.distributed.functional import all_to_all
from pentatron.layout import expert_parallel_problems
from pentatron.models.moe import Experts, moe_layers

EP = "ep"
EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


class AllToAllExperts:
    """An MoE layer's `expert_parallel` hook on one ep rank (holding experts [r·L, (r+1)·L))."""

    def __init__(self, comm: Comm, n_experts: int, ep: int) -> None:
        self.comm, self.ep, self.local = comm, ep, n_experts // ep

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        ep, local = self.ep, self.local
        send = counts.view(ep, local)  # [destination rank, its local expert]
        recv = torch.empty_like(send)  # [source rank, my local expert]
        self.comm.all_to_all(recv.view(-1), send.reshape(-1).contiguous(), EP)
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        rows = all_to_all(x, out_splits, in_splits, self.comm, EP)
        by_expert = _regroup(recv).to(x.device)
        out = experts(rows[by_expert], recv.sum(0).tolist())
        out = out[torch.argsort(by_expert)]  # back to (source rank, expert) order
        return all_to_all(out, in_splits, out_splits, self.comm, EP)


def _regroup(recv: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder rows grouped by (source, expert) — `recv[s, e]` rows each — into rows
    grouped by (expert, source)."""
    counts = recv.cpu()
    start = (torch.cumsum(counts.flatten(), 0) - counts.flatten()).view_as(counts)
    pieces = [torch.arange(int(start[s, e]), int(start[s, e] + counts[s, e]))
              for e in range(counts.shape[1]) for s in range(counts.shape[0])]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


@torch.no_grad()
def apply_expert_parallel(module: nn.Module, ctx: ParallelContext) -> dict[str, tuple[int, int]]:
    """Keep this ep rank's experts in every MoE layer of `module` and route tokens to the others by
    all-to-all. Returns {parameter name: (ep rank, ep size)} for the sharded expert weights (names
    unchanged), for their placements. On a meta model the slice stays meta (no storage) and is later
    materialised with exactly the unsharded model's values (`parallel/materialize.py`); a materialised
    model's slice is cut from it."""
    ep, rank = ctx.size(EP), ctx.local_rank(EP)
    shards: dict[str, tuple[int, int]] = {}
    if ep == 1:
        return shards
    problems = expert_parallel_problems(module.cfg, ep)  # the layout's rule
    if problems:
        raise ValueError("cannot apply expert parallelism: " + "; ".join(problems))
    for name, layer in moe_layers(module).items():
        n = layer.cfg.n_experts
        local = n // ep
        for w in EXPERT_WEIGHTS:
            full = getattr(layer.experts, w)
            setattr(layer.experts, w, nn.Parameter(full[rank * local: (rank + 1) * local].clone()))
            shards[f"{name}.experts.{w}"] = (rank, ep)
        layer.expert_parallel = AllToAllExperts(ctx.comm, n, ep)
    return shards


@torch.no_grad()
def gather_experts(local: torch.Tensor, expert: tuple[int, int] | None, comm: Comm) -> torch.Tensor:
    """The full [E, …] expert tensor from every ep rank's slice (a collective over ep); others as they are."""
    if expert is None:
        return local
    full = torch.empty((expert[1] * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    comm.all_gather(full, local.contiguous(), EP)
    return full
