"""Expert parallelism: an MoE layer's experts sharded over the "ep" group, tokens sent to them by all-to-all.

Each ep rank keeps E/ep consecutive experts (a slice of dim 0 of the stacked expert weights) and sets
the layer's `expert_parallel` hook. Per MoE forward, with the tokens already grouped by global expert:

    1. counts (`plan`): every rank tells every other how many tokens it sends to each of that rank's
       experts (an all-to-all of E integers, on the device) — the real, uneven per-expert counts, so no
       padding and no drops; then the counts sent and received are read on the host in ONE transfer
       (the layer's only host sync: the uneven all-to-all needs its split sizes there);
    2. dispatch: one all-to-all of the token rows with those uneven splits;
    3. the received rows, grouped by (source rank, local expert), are regrouped by local expert (indices
       computed on the device) and each expert runs one matmul chain on its rows (`Experts.forward`,
       whose split sizes come from the same host copy);
    4. combine: the outputs go back in the reverse all-to-all, in the order the tokens left.

The backward of each all-to-all is the reverse all-to-all (`distributed/functional.all_to_all`), so a
layer moves 2·(sent + received)·h elements per forward+backward, all in the comm ledger with the bytes
each rank really sent. The ep group is carved from dp×cp (`ParallelContext`): ranks of one ep group
hold different experts and different tokens; ranks of one expert-data group ("edp") hold the same
experts, and expert gradients are reduced over it only (`GroupedDataParallel`). The routers, shared
experts and everything else stay replicated over dp×cp as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pentatron.distributed.comm import Comm
from pentatron.distributed.context import ParallelContext
from pentatron.distributed.functional import all_to_all
from pentatron.layout import expert_parallel_problems
from pentatron.models.moe import Experts, moe_layers

EP = "ep"
EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class Splits:
    """One forward's split sizes on the host, from one device→host copy: `send[d][e]` rows to rank d's
    local expert e, `recv[s][e]` rows from rank s for my local expert e; `recv_counts` the same [ep, L]
    counts on the device (for the regrouping indices)."""

    send: list[list[int]]
    recv: list[list[int]]
    recv_counts: torch.Tensor

    @property
    def rows(self) -> int:
        """Rows this rank sends (its kept assignments)."""
        return sum(map(sum, self.send))

    @property
    def in_splits(self) -> list[int]:
        return [sum(r) for r in self.send]

    @property
    def out_splits(self) -> list[int]:
        return [sum(r) for r in self.recv]

    @property
    def per_local_expert(self) -> list[int]:
        return [sum(col) for col in zip(*self.recv, strict=True)]


class AllToAllExperts:
    """An MoE layer's `expert_parallel` hook on one ep rank (holding experts [r·L, (r+1)·L))."""

    def __init__(self, comm: Comm, n_experts: int, ep: int) -> None:
        self.comm, self.ep, self.local = comm, ep, n_experts // ep

    def plan(self, counts: torch.Tensor) -> Splits:
        ep, local = self.ep, self.local
        send = counts.view(ep, local)  # [destination rank, its local expert]
        recv = torch.empty_like(send)  # [source rank, my local expert]
        self.comm.all_to_all(recv.view(-1), send.reshape(-1).contiguous(), EP)
        both = torch.stack([send, recv]).tolist()  # the layer's one device→host transfer
        return Splits(both[0], both[1], recv)

    def __call__(self, x: torch.Tensor, s: Splits, experts: Experts) -> torch.Tensor:
        in_splits, out_splits = s.in_splits, s.out_splits
        rows = all_to_all(x, out_splits, in_splits, self.comm, EP)
        by_expert = _regroup(s.recv_counts, sum(out_splits))
        out = experts(rows[by_expert], s.per_local_expert, s.recv_counts.sum(0).cumsum(0))
        out = out[torch.argsort(by_expert)]  # back to (source rank, expert) order
        return all_to_all(out, in_splits, out_splits, self.comm, EP)


def _regroup(recv: torch.Tensor, total: int) -> torch.Tensor:
    """Row indices that reorder `total` rows grouped by (source, expert) — `recv[s, e]` rows each — into
    rows grouped by (expert, source), keeping each group's order; on the device, without a host sync."""
    ep, local = recv.shape
    ends = torch.cumsum(recv.reshape(-1), 0)
    group = torch.searchsorted(ends, torch.arange(total, device=recv.device), right=True)  # s·L + e per row
    return torch.argsort(group % local * ep + group // local, stable=True)


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
