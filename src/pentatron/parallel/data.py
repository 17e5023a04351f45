"""Data parallelism: the interface every DP/ZeRO stage offers the trainer, and plain DDP (ZeRO-0).

The trainer drives any stage the same way:

    engine.zero_grad()
    for i, batch in enumerate(micro_batches):
        engine.micro_step(last=i == len(micro_batches) - 1)   # before that micro-batch's backward
        loss(batch).backward()
    engine.finish_grad_sync()            # wait for the reductions still in flight; average over dp
    norm = engine.clip_grads(max_norm)   # global norm of the full gradient, whatever is sharded
    engine.step(lr)

DDP keeps fp32 gradients in one flat buffer cut into buckets (`parallel.bucket_mb`), in reverse
registration order (≈ the order backward produces them). When the last gradient of a bucket arrives
on the last micro-step, that bucket's all-reduce is launched asynchronously, overlapping the rest of
backward; accumulation micro-steps communicate nothing. Gradients are summed over ranks, then divided
by dp once (the sum is what the 1-process run computes, up to the order of the additions).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pentatron.config import TrainConfig
from pentatron.distributed.comm import Work
from pentatron.distributed.context import ParallelContext
from pentatron.optim import AdamW, MixedPrecisionAdamW, clip_by_total_norm, grad_norm_squared
from pentatron.parallel.grad_buffer import Bucket, FlatLayout, GradBuffer
from pentatron.parallel.memory import MemoryReport
from pentatron.parallel.tensor import tp_checkpoint_key, tp_replicas
from pentatron.precision import PrecisionPolicy


class DataParallelBase:
    """Shared by every stage: parameters and names, micro-step bookkeeping, bucket readiness,
    global-norm clipping. Subclasses own the gradient storage and the optimizer."""

    stage: int = 0
    sharded_grads: bool = False  # True when each rank holds only its shard of the reduced gradient
    # Parameters whose gradient another pipeline rank also holds and counts in the global norm (the
    # last stage's copy of a tied embedding): left out here so that the norm counts them once.
    counted_elsewhere: frozenset[nn.Parameter] | set[nn.Parameter] = frozenset()

    def __init__(self, model: nn.Module, ctx: ParallelContext, train: TrainConfig, policy: PrecisionPolicy,
                 bucket_mb: float) -> None:
        self.model, self.ctx, self.comm, self.policy = model, ctx, ctx.comm, policy
        self.dp, self.dp_rank = ctx.dp_size, ctx.dp_rank
        # named_parameters() lists a tied weight once, under its first name (embed.weight).
        self.names: dict[nn.Parameter, str] = {p: n for n, p in model.named_parameters() if p.requires_grad}
        self.params = list(self.names)
        # Checkpoint keys: the name, plus the tp shard coordinates for a tensor-parallel shard (its
        # shards share the name). Pipeline ranks hold disjoint names (the last stage's copy of a tied
        # embedding is "lm_head.weight", the first stage's "embed.weight"), so no pp suffix is needed.
        tp, tp_rank = ctx.size("tp"), ctx.local_rank("tp")
        self.keys: dict[nn.Parameter, str] = {p: tp_checkpoint_key(n, p, tp, tp_rank) for p, n in self.names.items()}
        self.bucket_numel = max(1, int(bucket_mb * 2**20) // 4)  # buckets hold fp32 gradients
        self._last_micro = True
        self._remaining: dict[int, int] = {}
        self._launched: set[int] = set()
        self.optimizer: AdamW
        self._broadcast_params()

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        # Replicas are built identically (init from (seed, name)); broadcasting from dp rank 0 makes
        # that a guarantee, as torch's DDP does. Outside any step, so the ledger does not count it.
        for p in self.params:
            self.comm.broadcast(p.data, "dp", src=0)

    # ------------------------------------------------------------------ micro-steps and buckets
    def micro_step(self, last: bool) -> None:
        """Declare whether the coming backward is the last of this optimizer step."""
        self._last_micro = last

    def _reset_counts(self, layout: FlatLayout) -> None:
        self._remaining = {b.index: len(b.params) for b in layout.buckets}
        self._launched = set()

    def _count(self, layout: FlatLayout, p: nn.Parameter) -> Bucket | None:
        """Note that p's gradient is ready; return its bucket if that made the bucket complete."""
        b = layout.bucket_of[p]
        if b.index in self._launched:
            raise RuntimeError(f"gradient of {self.names[p]} arrived after its bucket was already reduced: "
                               "call micro_step(last=False) before every backward but the step's last")
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
        tp, pp = self.ctx.size("tp"), self.ctx.size("pp")
        if tp == 1 and not self.counted_elsewhere:
            sq = grad_norm_squared(self.owned_grads())
        else:
            # Tensor parallel: every element of the full model once — a tensor held identically by
            # k tp ranks (replicated norms, replicated kv heads) counts 1/k on each, then sum over tp.
            # Pipeline: a tied embedding held by the first and the last stage counts on the first.
            pairs = self.owned_param_grads()
            sq = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
            for p, g in pairs:
                if p not in self.counted_elsewhere:
                    sq += g.float().pow(2).sum() / tp_replicas(p, tp)
        if self.sharded_grads:
            self.comm.all_reduce(sq, "dp")
        if tp > 1:
            self.comm.all_reduce(sq, "tp")
        if pp > 1:
            self.comm.all_reduce(sq, "pp")  # each pipeline rank holds only its stages' parameters
        return sq.sqrt()

    def clip_grads(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm of the full gradient; returns the norm before clipping."""
        norm = self.grad_norm()
        clip_by_total_norm(self.owned_grads(), norm, max_norm)
        return norm

    def step(self, lr: float) -> None:
        self.optimizer.step(lr)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state keyed by `self.keys` (DCP dedups replicated tensors across ranks)."""
        return {"model": {self.keys[p]: p for p in self.params}, "optim": self.optimizer.named_state()}

    def after_load(self) -> None:
        """Finish a restore done in place into `state_dict()`'s tensors."""
        self.optimizer.load_named_state()

    def layout_meta(self) -> dict[str, Any]:
        """What a checkpoint's tensor keys depend on (resume requires the same)."""
        return {"zero": self.stage, "dp": self.dp}

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on every rank (a copy)."""
        return {self.names[p]: p.detach().clone() for p in self.params}

    def memory(self) -> MemoryReport:
        raise NotImplementedError

    def close(self) -> None:
        """Remove hooks (the model can then be wrapped again)."""


class DataParallel(DataParallelBase):
    """ZeRO-0: replicated parameters and optimizer, bucketed all-reduce of gradients."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, train: TrainConfig, policy: PrecisionPolicy,
                 bucket_mb: float) -> None:
        super().__init__(model, ctx, train, policy, bucket_mb)
        self.layout = FlatLayout.by_size(list(reversed(self.params)), self.bucket_numel)
        self.grads = GradBuffer(self.params, policy.grad_dtype, self._grad_ready, self.layout)
        self.optimizer = MixedPrecisionAdamW(self.params, train, policy.master_dtype,
                                             names=[self.keys[p] for p in self.params])
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
        self._works.append(self.comm.all_reduce(self.grads.bucket_data(b), "dp", async_op=True))

    def zero_grad(self) -> None:
        self.grads.zero()

    def finish_grad_sync(self) -> None:
        for b in self.layout.buckets:  # buckets with a parameter that got no gradient
            if b.index not in self._launched:
                self._launch(b)
        for w in self._works:
            w.wait()
        self._works.clear()
        if self.dp > 1:
            self.grads.data.div_(self.dp)
        self._reset_counts(self.layout)

    def owned_grads(self) -> list[torch.Tensor]:
        return [self.grads.data]

    def owned_param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(p, p.main_grad) for p in self.params]

    def memory(self) -> MemoryReport:
        params = sum(p.numel() * p.element_size() for p in self.params)
        master = sum(s.master.numel() * s.master.element_size() for s in self.optimizer.slots
                     if s.model is not None)
        return MemoryReport(params, self.grads.data.numel() * self.grads.data.element_size(),
                            self.optimizer.state_bytes(), master)

    def close(self) -> None:
        self.grads.remove_hooks()
