"""The LM head and cross-entropy as one operation over chunks of tokens: the full logits never exist.

`linear_cross_entropy(hidden, weight, targets, chunk_tokens)` is `F.cross_entropy(F.linear(hidden,
weight).float(), targets, reduction="none")` computed `chunk_tokens` rows at a time. Forward keeps per
token only the log-sum-exp (and the target's logit); backward recomputes each chunk's logits, turns them
into the softmax in place, subtracts the target and feeds that chunk's gradient into dX and dW. So the
loss holds at most one chunk's fp32 logits (plus its cast to the weight's dtype under bf16) instead of
the whole [tokens, vocab] tensor and its softmax — at vocab 128k and 8k tokens, 4 GiB per copy. The
price is one more head matmul per chunk but the last: forward keeps the last chunk's exp(logit − max)
(computed last, it is the chunk alive when backward starts, which takes it first and in place, so the
peak stays one chunk) and backward recomputes only the others. With the tokens in one chunk nothing is
recomputed. A split backward (zero-bubble B then W) hands the kept chunk to its first half only.
On CUDA under bf16/fp16 the head's matmul writes the fp32 logits itself (`out_dtype`: no low-precision
logits and no copy; unrun on a GPU so far); elsewhere they are widened. Under mixed dtypes dW's
per-chunk product is added WGRAD_ROWS vocabulary rows at a time (a block's temporary, not [V, h]).

Vocabulary sharding (tensor parallelism) is not known here: a `VocabShards` object (the tp layer's)
says which slice of the vocabulary `weight` holds and all-reduces the per-token statistics: one max
and one sum of two numbers per token, after all chunks (the same collectives as a full-logits
vocab-parallel loss).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.autograd import Function

from pentatron.precision import wide, wide_dtype


class VocabShards(Protocol):
    """The vocabulary slice a rank's head holds, and reductions over the ranks holding the others."""

    vocab_start: int

    def all_reduce_max(self, t: torch.Tensor) -> None: ...

    def all_reduce_sum(self, t: torch.Tensor) -> None: ...


DEFAULT_CHUNK_TOKENS = 1024  # train.loss_chunk_tokens' default: at vocab 128k one chunk's fp32 logits are 0.5 GiB


# Vocabulary rows per dW product when dW (fp32) and the operands (bf16) differ in dtype: the product is a
# temporary beside the accumulator, [rows, h] instead of [V, h] (1 GiB in bf16 at vocab 128k, h 4096),
# at the end of forward, where activation memory peaks.
WGRAD_ROWS = 8192


def _chunks(n: int, size: int) -> range:
    return range(0, n, max(size, 1))


def _fp32_out(x: torch.Tensor) -> bool:
    """Whether the head's matmul writes fp32 itself (`torch.mm(..., out_dtype=float32)`, CUDA only in torch
    2.13): bf16/fp16 operands on CUDA. Elsewhere the logits come out in the operands' dtype and are widened
    (a second tensor, a copy)."""
    return x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16)


def _logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One chunk's logits in the wide dtype; forward and backward's recompute share it (same values)."""
    if _fp32_out(x):
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return wide(F.linear(x, weight))


def _add_wgrad(grad_w: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    """grad_w += gᵀ·x. Same dtype: in place (addmm). Else the product rounds to g's dtype and is added in
    blocks of `WGRAD_ROWS` vocabulary rows, so its temporary is one block's."""
    if g.dtype == grad_w.dtype:
        grad_w.addmm_(g.t(), x)
        return
    for lo in range(0, grad_w.shape[0], WGRAD_ROWS):
        grad_w[lo:lo + WGRAD_ROWS].add_(g[:, lo:lo + WGRAD_ROWS].t() @ x)


def _will_run(node: Any) -> bool:
    """Whether the running backward reaches `node`. A zero-bubble split backward asks for dX only (B) and
    then for dW only (W): each half then skips the other's matmuls."""
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf asked for by autograd.grad(inputs=…) is captured, not executed: needed
        return True


class _LinearCrossEntropy(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                shards: VocabShards | None, ignore_index: int) -> torch.Tensor:
        # x: [N, h]; weight: [V_local, h]; targets: [N] global ids. Returns the loss per token, [N].
        n, v_local = x.shape[0], weight.shape[0]
        local_t = targets - (shards.vocab_start if shards is not None else 0)
        mine = (local_t >= 0) & (local_t < v_local)
        local_t = local_t.masked_fill(~mine, 0)
        row_max = torch.empty(n, dtype=wide_dtype(x.dtype), device=x.device)
        sum_exp = torch.empty_like(row_max)
        target_logit = torch.empty_like(row_max)
        kept: tuple[int, torch.Tensor, torch.Tensor] | None = None  # the last chunk: (lo, exp(logit − max), max)
        for lo in _chunks(n, chunk):
            hi = min(lo + chunk, n)
            logits = _logits(x[lo:hi], weight)
            m = logits.amax(dim=-1)
            row_max[lo:hi] = m
            target_logit[lo:hi] = logits.gather(-1, local_t[lo:hi].unsqueeze(-1)).squeeze(-1)
            sum_exp[lo:hi] = logits.sub_(m.unsqueeze(-1)).exp_().sum(dim=-1)
            if hi == n and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
                kept = (lo, logits, m)
            del logits
        target_logit.masked_fill_(~mine, 0.0)
        if shards is not None:
            # Σ_ranks e^{m_r}·s_r over the global max M: any shift is exact, M avoids overflow.
            global_max = row_max.clone()
            shards.all_reduce_max(global_max)
            both = torch.stack([sum_exp * (row_max - global_max).exp(), target_logit])
            shards.all_reduce_sum(both)
            sum_exp, target_logit, row_max = both[0], both[1], global_max
        lse = sum_exp.log() + row_max
        valid = targets != ignore_index
        ctx.save_for_backward(x, weight, local_t, mine & valid, valid, lse)
        # not a saved tensor: the first backward takes it (and drops it, as a split backward's W must not wait
        # holding it); the local max is this rank's, lse is over all ranks
        ctx.chunk, ctx.kept = chunk, kept
        return (lse - target_logit).masked_fill(~valid, 0.0)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, local_t, hit, valid, lse = ctx.saved_tensors
        chunk, n = ctx.chunk, x.shape[0]
        (x_node, _), (w_node, _) = ctx.next_functions[0], ctx.next_functions[1]
        need_x = ctx.needs_input_grad[0] and _will_run(x_node)
        need_w = ctx.needs_input_grad[1] and _will_run(w_node)
        scale = wide(grad_loss) * valid.to(wide_dtype(grad_loss.dtype))
        grad_x = torch.empty_like(x) if need_x else None
        # dW accumulates over chunks in fp32 (a bf16 running sum would round at every chunk).
        grad_w = torch.zeros(weight.shape, dtype=wide_dtype(weight.dtype), device=weight.device) if need_w else None
        kept, ctx.kept = ctx.kept, None
        order = list(_chunks(n, chunk))
        if kept is not None:  # the kept (last) chunk first: its memory is free before any other is built
            order = order[-1:] + order[:-1]
        for lo in order:
            hi = min(lo + chunk, n)
            # d loss_i / d logit_ij = (softmax_ij − [j is the target]) · grad_i, built in place.
            if kept is not None and kept[0] == lo:
                g, m = kept[1], kept[2]
                kept = None
                g.mul_((m - lse[lo:hi]).exp_().unsqueeze(-1))  # exp(logit − max) · exp(max − lse)
            else:
                g = _logits(x[lo:hi], weight)
                g.sub_(lse[lo:hi].unsqueeze(-1)).exp_()
            rows = torch.arange(hi - lo, device=g.device)
            g[rows, local_t[lo:hi]] -= hit[lo:hi].to(g.dtype)
            g.mul_(scale[lo:hi].unsqueeze(-1))
            g = g.to(x.dtype)
            if grad_x is not None:
                torch.mm(g, weight, out=grad_x[lo:hi])
            if grad_w is not None:
                _add_wgrad(grad_w, g, x[lo:hi])
            del g
        return (grad_x, grad_w.to(weight.dtype) if grad_w is not None else None, None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                         shards: VocabShards | None = None, ignore_index: int = -100) -> torch.Tensor:
    """The mean cross-entropy of `F.linear(hidden, weight)` (fp32 logits) against `targets`, over the
    tokens whose target is not `ignore_index`, computed `chunk_tokens` tokens at a time (see the module
    docstring). hidden: [..., h]; targets: [...]; weight: [V, h], or this rank's vocabulary slice with
    `shards`."""
    loss = _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                     chunk_tokens, shards, ignore_index)
    return loss.sum() / (targets != ignore_index).sum().clamp(min=1)
