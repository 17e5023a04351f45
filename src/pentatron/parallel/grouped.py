"""One data-parallel engine per gradient group, behind the one engine interface the step runner drives.

Under expert parallelism a model's parameters reduce their gradients over two different groups: the
dense ones (attention, norms, routers, shared experts, embeddings) over dp×cp, the sharded expert
weights over the expert-data group "edp" (the ranks holding the same experts). Each group gets its own
engine of the configured stage (DDP, ZeRO-1/2/3) over only its parameters — its own buckets, shards,
hooks and collectives, exactly the code of the single-group case — and `GroupedDataParallel` forwards
every call to each of them and joins the results. The global gradient norm is the one thing that is
not a plain join: an expert engine's squared norm covers its experts only, so it is also summed over
"ep" (whose ranks hold different experts) before the tp/pp reductions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pentatron.optim import AdamW, clip_by_total_norm
from pentatron.parallel.data import DataParallelBase
from pentatron.parallel.memory import MemoryReport


class GroupedDataParallel:
    def __init__(self, engines: list[DataParallelBase]) -> None:
        self.engines = engines
        first = engines[0]
        self.model, self.ctx, self.comm, self.policy = first.model, first.ctx, first.comm, first.policy
        self.norm_dtype = first.norm_dtype
        self.stage, self.sharded_grads = first.stage, first.sharded_grads
        self.placements = first.placements  # one dict, shared by all engines
        self.params = [p for e in engines for p in e.params]
        self.names = {p: n for e in engines for p, n in e.names.items()}
        self.place = {p: pl for e in engines for p, pl in e.place.items()}
        self.keys = {p: k for e in engines for p, k in e.keys.items()}
        self.slots = [s for e in engines for s in e.slots]
        self.reduce_dim = first.reduce_dim  # the dense group (the loss average, the MoE loads)
        self.dp, self.dp_rank = first.dp, first.dp_rank

    # ------------------------------------------------------------------ forwarded to every engine
    def before_backward(self, chunk: int, last: bool, weights_only: bool = False) -> None:
        for e in self.engines:
            e.before_backward(chunk, last, weights_only)

    def after_backward(self, chunk: int) -> None:
        for e in self.engines:
            e.after_backward(chunk)

    def zero_grad(self) -> None:
        for e in self.engines:
            e.zero_grad()

    def finish_grad_sync(self) -> None:
        for e in self.engines:
            e.finish_grad_sync()

    def sync_tied_grads(self) -> None:
        for e in self.engines:
            e.sync_tied_grads()

    def after_optimizer_step(self) -> None:
        for e in self.engines:
            e.after_optimizer_step()

    def wait_param_gather(self) -> None:
        for e in self.engines:
            e.wait_param_gather()

    def release_gathered(self) -> None:
        for e in self.engines:
            e.release_gathered()

    def close(self) -> None:
        for e in self.engines:
            e.close()

    # ------------------------------------------------------------------ joined
    def owned_grads(self) -> list[torch.Tensor]:
        return [g for e in self.engines for g in e.owned_grads()]

    def owned_param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [pg for e in self.engines for pg in e.owned_param_grads()]

    def grad_norm(self) -> torch.Tensor:
        total = torch.zeros((), dtype=self.norm_dtype, device=self.ctx.device)
        for e in self.engines:
            sq = e.group_norm_squared()
            if e.reduce_dim == "edp":
                self.comm.all_reduce(sq, "ep")  # the other ep ranks hold the other experts
            total += sq
        return self.engines[0].finish_norm(total)

    def clip_grads(self, max_norm: float) -> torch.Tensor:
        norm = self.grad_norm()
        clip_by_total_norm(self.owned_grads(), norm, max_norm)
        return norm

    def model_state(self) -> dict[str, torch.Tensor]:
        return {k: t for e in self.engines for k, t in e.model_state().items()}

    def layout_meta(self) -> dict[str, Any]:
        meta = dict(self.engines[0].layout_meta())  # the dense group's, then the others' prefixed by group
        for e in self.engines[1:]:
            meta.update({f"{e.reduce_dim}_{k}": v for k, v in e.layout_meta().items() if k != "zero"})
        return meta

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: t for e in self.engines for n, t in e.full_parameters().items()}

    def memory(self, optimizer: AdamW) -> MemoryReport:
        r = [e.memory(optimizer) for e in self.engines]
        # Optimizer state is one object over every engine's slots; ZeRO keeps a master shard per engine.
        master = sum(x.master for x in r) if self.sharded_grads else r[0].master
        return MemoryReport(sum(x.params for x in r), sum(x.grads for x in r), r[0].optimizer, master,
                            sum(x.transient_peak for x in r))
