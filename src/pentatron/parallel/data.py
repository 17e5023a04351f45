"""Data parallelism: the interface every DP/ZeRO stage offers the step runner, and plain DDP (ZeRO-0).

The step runner (`parallel/step_runner.py`) drives any stage the same way:

    engine.zero_grad()
    for each backward of the step (a micro-batch; under pp, a pipeline action on one chunk):
        engine.before_backward(chunk, last)   # last: no more weight gradients for this chunk this step
        loss(batch).backward()
        engine.after_backward(chunk)
    engine.finish_grad_sync()            # wait for the reductions still in flight; average over dp
    engine.sync_tied_grads()             # a tied weight held by two pipeline ranks: sum the two copies
    (runner.sum_partial_grads())         # the owned pieces of tp-partial gradients (SP norms and MoE
                                         # layers, q/k norms): one all-reduce over tp (tensor.sum_partial_grads)
    norm = engine.clip_grads(max_norm)   # global norm of the full gradient, whatever is sharded
    optimizer.step(lr)                   # an AdamW over `engine.slots`: the elements this rank owns
    engine.after_optimizer_step()        # ZeRO-1/2: all-gather the updated parameter shards

How each parameter is laid out (tp shard, pipeline stage, tied peer, ZeRO pieces, reduction dims) is
read from and written to its `Placement` (`parallel/placement.py`), keyed by the parameter's name.

DDP keeps fp32 gradients in one flat buffer cut into buckets (`parallel.bucket_mb`), in reverse
registration order (≈ the order backward produces them). When the last gradient of a bucket arrives
on the last micro-step, that bucket's all-reduce is launched asynchronously, overlapping the rest of
backward; accumulation micro-steps communicate nothing. Gradients are summed over ranks, then divided
by dp once (the sum is what the 1-process run computes, up to the order of the additions).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from pentatron.distributed.comm import P2P, Work
from pentatron.distributed.context import ParallelContext
from pentatron.optim import AdamW, Slot, clip_by_total_norm, grad_norm_squared, param_slots
from pentatron.parallel.grad_buffer import Bucket, FlatLayout, GradBuffer
from pentatron.parallel.memory import MemoryReport
from pentatron.parallel.placement import Placement
from pentatron.precision import PrecisionPolicy, wide_dtype


class DataParallelBase:
    """Shared by every stage: parameters and names, micro-step bookkeeping, bucket readiness,
    global-norm clipping. Subclasses own the gradient storage and define `slots`, what this rank's
    optimizer updates (the step runner builds the optimizer over them)."""

    stage: int = 0
    sharded_grads: bool = False  # True when each rank holds only its shard of the reduced gradient

    def __init__(self, model: nn.Module, ctx: ParallelContext, policy: PrecisionPolicy,
                 bucket_mb: float, placements: dict[str, Placement] | None = None,
                 only: Collection[str] | None = None) -> None:
        self.model, self.ctx, self.comm, self.policy = model, ctx, ctx.comm, policy
        self.norm_dtype = wide_dtype(policy.grad_dtype)  # the squared norm's dtype, in every collective
        # named_parameters() lists a tied weight once, under its first name (embed.weight). `only`: the
        # names this engine handles (one engine per gradient group, see parallel/grouped.py).
        self.names: dict[nn.Parameter, str] = {p: n for n, p in model.named_parameters()
                                               if p.requires_grad and (only is None or n in only)}
        self.params = list(self.names)
        placements = placements if placements is not None else {}
        for p, n in self.names.items():
            placements.setdefault(n, Placement(n, tuple(p.shape)))
        self.placements = placements
        self.place: dict[nn.Parameter, Placement] = {p: placements[n] for p, n in self.names.items()}
        # The group gradients are averaged over (and ZeRO shards over) comes from the placements: "dp",
        # or the flattened "dp_cp" group when context parallelism shares the reduction.
        groups = {pl.grad_dims for pl in self.place.values()} or {("dp",)}
        if len(groups) > 1:
            raise NotImplementedError(f"one data-parallel engine reduces over one group; got {sorted(groups)}")
        self.reduce_dim = "_".join(groups.pop())
        self.dp, self.dp_rank = ctx.size(self.reduce_dim), ctx.local_rank(self.reduce_dim)
        self.shard_dim = self.reduce_dim  # the group a sharded engine shards over (HSDP: a part of it)
        # Reduced gradients are sums over the group, divided by the replicas of the batch (dp×cp): for
        # expert weights ("edp") the ep ranks' tokens already met in the experts, so still dp×cp.
        self.grad_divisor = ctx.size("dp_cp") if self.reduce_dim == "edp" else self.dp
        # Checkpoint keys: the name, plus the tp shard coordinates for a tensor-parallel shard (its
        # shards share the name). Pipeline ranks hold disjoint names (the last stage's copy of a tied
        # embedding is "lm_head.weight", the first stage's "embed.weight"), so no pp suffix is needed.
        self.keys: dict[nn.Parameter, str] = {p: pl.checkpoint_key() for p, pl in self.place.items()}
        # A tied weight held by two pipeline ranks gets a bucket of its own on both, so that both
        # ranks' ZeRO shards of it cover the same elements and can be summed shard by shard.
        self.isolated = {p for p, pl in self.place.items() if pl.tied_peer is not None}
        # Each parameter's share of the global gradient norm (1/replicas over tp, 0 for a tied copy the
        # peer counts); all 1 when every element lives on exactly one rank of the norm's groups.
        self.norm_weights = {p: pl.norm_weight(ctx.size("tp")) for p, pl in self.place.items()}
        self.bucket_numel = max(1, int(bucket_mb * 2**20) // 4)  # buckets hold fp32 gradients
        self._last_micro = True
        self._remaining: dict[int, int] = {}
        self._launched: set[int] = set()
        self.slots: list[Slot]
        self._broadcast_params()

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        # Replicas are built identically (init from (seed, name)); broadcasting from dp rank 0 makes
        # that a guarantee, as torch's DDP does. Outside any step, so the ledger does not count it.
        for p in self.params:
            if not p.is_meta:  # a meta parameter is initialised (and broadcast) by its ZeRO engine
                self.comm.broadcast(p.data, self.reduce_dim, src=0)

    # ------------------------------------------------------------------ micro-steps and buckets
    def before_backward(self, chunk: int, last: bool, weights_only: bool = False) -> None:
        """A backward on pipeline chunk `chunk` (0 without pp) is coming; `last`: it is the step's last one
        producing weight gradients for that chunk (its gradients can be reduced as they complete);
        `weights_only`: it computes weight gradients only (the W half of a split backward)."""
        self._last_micro = last

    def after_backward(self, chunk: int) -> None:
        """That backward is done."""

    def _reset_counts(self, layout: FlatLayout) -> None:
        self._remaining = {b.index: len(b.params) for b in layout.buckets}
        self._launched = set()

    def _count(self, layout: FlatLayout, p: nn.Parameter) -> Bucket | None:
        """Note that p's gradient is ready; return its bucket if that made the bucket complete."""
        b = layout.bucket_of[p]
        if b.index in self._launched:
            raise RuntimeError(f"gradient of {self.names[p]} arrived after its bucket was already reduced: "
                               "call before_backward(chunk, last=False) before every backward but the chunk's last")
        self._remaining[b.index] -= 1
        return b if self._remaining[b.index] == 0 else None

    # ------------------------------------------------------------------ the step
    def zero_grad(self) -> None:
        raise NotImplementedError

    def finish_grad_sync(self) -> None:
        raise NotImplementedError

    def owned_grads(self) -> list[torch.Tensor]:
        """The reduced gradient elements this rank is responsible for (each element on exactly one
        rank when sharded, on every rank when replicated)."""
        raise NotImplementedError

    def owned_param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """`owned_grads()` split by parameter: (parameter, its owned gradient elements)."""
        raise NotImplementedError

    def grad_norm(self) -> torch.Tensor:
        return self.finish_norm(self.group_norm_squared())

    def finish_norm(self, sq: torch.Tensor) -> torch.Tensor:
        """The global norm from a squared norm already summed over the data-parallel groups."""
        if self.ctx.size("tp") > 1:
            self.comm.all_reduce(sq, "tp")
        if self.ctx.size("pp") > 1:
            self.comm.all_reduce(sq, "pp")  # each pipeline rank holds only its stages' parameters
        return sq.sqrt()

    def group_norm_squared(self) -> torch.Tensor:
        """This engine's parameters' squared gradient norm, summed over its reduce group (not yet over tp
        and pp)."""
        weights = self.norm_weights
        if all(w == 1.0 for w in weights.values()):
            sq = grad_norm_squared(self.owned_grads(), self.ctx.device, self.norm_dtype)
        else:
            # Every element of the full model once: a tensor held identically by k tp ranks (replicated
            # norms, replicated kv heads) counts 1/k on each, then sum over tp; a tied embedding held by
            # the first and the last stage counts on the first only.
            by_weight: dict[float, list[torch.Tensor]] = {}
            for p, g in self.owned_param_grads():
                if weights[p]:
                    by_weight.setdefault(weights[p], []).append(g)
            sq = torch.zeros((), dtype=self.norm_dtype, device=self.ctx.device)
            for w, grads in by_weight.items():
                sq += grad_norm_squared(grads, self.ctx.device, self.norm_dtype) * w
        if self.sharded_grads:
            self.comm.all_reduce(sq, self.shard_dim)  # HSDP: each replica holds the whole gradient
        return sq

    def sync_tied_grads(self) -> None:
        """Sum a tied weight's reduced gradient between the two pipeline ranks holding a copy (the first
        and the last stage), piece by piece: both hold it in a bucket of its own, so their owned pieces
        cover the same elements. a + b and b + a are the same float, so both copies get bitwise-identical
        gradients and, with identical optimizer state, stay identical."""
        grads_of: dict[nn.Parameter, list[torch.Tensor]] = {}
        for p, g in self.owned_param_grads():
            if p in self.isolated:
                grads_of.setdefault(p, []).append(g)
        for p, grads in grads_of.items():
            peer = self.place[p].tied_peer
            mine = torch.cat([g.reshape(-1) for g in grads])
            theirs = torch.empty_like(mine)
            self.comm.batch_p2p([P2P("send", mine, peer), P2P("recv", theirs, peer)], "pp").wait()
            offset = 0
            for g in grads:
                g.add_(theirs[offset: offset + g.numel()].view_as(g))
                offset += g.numel()

    def clip_grads(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm of the full gradient; returns the norm before clipping."""
        norm = self.grad_norm()
        clip_by_total_norm(self.owned_grads(), norm, max_norm)
        return norm

    def after_optimizer_step(self) -> None:
        """Make the parameters current after the optimizer stepped `slots` (nothing when it stepped them
        in place)."""

    def wait_param_gather(self) -> None:
        """Wait the parameter all-gathers still in flight (ZeRO-1/2 overlapped gather): before reading the
        weights outside a forward; nothing to do for the other engines."""

    def release_gathered(self) -> None:
        """After a forward-only pass (validation): free whatever its forwards gathered (ZeRO-3), as the end of
        a step would; nothing to do for engines that hold their parameters."""

    # ------------------------------------------------------------------ state
    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's checkpoint tensors keyed by `self.keys` (DCP dedups replicated ones across ranks)."""
        return {self.keys[p]: p for p in self.params}

    def layout_meta(self) -> dict[str, Any]:
        """What a checkpoint's tensor keys depend on (resume requires the same)."""
        return {"zero": self.stage, "dp": self.dp}

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on every rank (a copy)."""
        return {self.names[p]: p.detach().clone() for p in self.params}

    def memory(self, optimizer: AdamW) -> MemoryReport:
        raise NotImplementedError

    def close(self) -> None:
        """Remove hooks (the model can then be wrapped again)."""


class DataParallel(DataParallelBase):
    """ZeRO-0: replicated parameters and optimizer, bucketed all-reduce of gradients."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, policy: PrecisionPolicy,
                 bucket_mb: float, placements: dict[str, Placement] | None = None,
                 only: Collection[str] | None = None) -> None:
        super().__init__(model, ctx, policy, bucket_mb, placements, only)
        self.layout = FlatLayout.by_size(list(reversed(self.params)), self.bucket_numel, isolate=self.isolated)
        self.grads = GradBuffer(self.params, policy.grad_dtype, self._grad_ready, self.layout)
        self.slots = param_slots(self.params, [self.keys[p] for p in self.params], policy.master_dtype)
        self._works: list[Work] = []
        self._reset_counts(self.layout)

    def _grad_ready(self, p: nn.Parameter) -> None:
        if not self._last_micro:
            return  # accumulation micro-step: gradients stay local
        b = self._count(self.layout, p)
        if b is not None:
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        self._launched.add(b.index)
        data = self.grads.bucket_data(b)
        if self.grad_divisor > 1:
            # Averaged before the sum, bucket by bucket as backward readies them (Megatron scales its
            # buckets so too), not the whole buffer in one pass after the last wait, on the step's tail.
            data.div_(self.grad_divisor)
        self._works.append(self.comm.all_reduce(data, self.reduce_dim, async_op=True))

    def zero_grad(self) -> None:
        self.grads.zero()

    def finish_grad_sync(self) -> None:
        for b in self.layout.buckets:  # buckets with a parameter that got no gradient
            if b.index not in self._launched:
                self._launch(b)
        for w in self._works:
            w.wait()
        self._works.clear()
        self._reset_counts(self.layout)

    def owned_grads(self) -> list[torch.Tensor]:
        return [self.grads.data]

    def owned_param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(p, p.main_grad) for p in self.params]

    def memory(self, optimizer: AdamW) -> MemoryReport:
        params = sum(p.numel() * p.element_size() for p in self.params)
        return MemoryReport(params, self.grads.data.numel() * self.grads.data.element_size(),
                            optimizer.state_bytes(), optimizer.master_bytes())

    def close(self) -> None:
        self.grads.remove_hooks()
