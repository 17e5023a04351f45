"""Ring attention with the load-balanced (zigzag) split of a causal sequence.

The sequence is cut into 2r chunks for r ring ranks; rank i holds chunks i and 2r−1−i (its queries,
keys and values, in that order). K/V blocks travel around the ring — rank i receives from i−1 and
sends to i+1 — and the next transfer is issued before the current block's attention runs, so it
overlaps. At ring step t rank i holds the K/V of rank j = (i − t) mod r, and the causal mask leaves
exactly half of the full block to compute, whatever (i, j):

    t = 0    (j = i)  local causal attention over the two chunks (their positions increase)
    j < i             every query on chunk j's keys only (chunk 2r−1−j lies in the future)
    j > i             the second chunk's queries on both of j's chunks (the first chunk sees neither)

so every rank does the same work (a contiguous split would give the last rank r× the first's). Each
block's output is merged into the running output through the log-sum-exp. The backward pass sends the
K/V around the ring again, with each block's dK/dV accumulator (fp32) travelling beside it; after r
steps every accumulator is back home. Per rank and layer: forward (r−1) K/V sends, backward (r−1) K/V
plus r dK/dV sends. K/V travel with their own (un-expanded) kv heads; GQA is expanded only locally.

Point-to-point under NCCL's rules (per rank, batches complete in issue order; a send may wait for its
receive): every transfer is one batch holding this rank's send to the next rank *and* its receive from
the previous one, so no send waits on a receive issued later. Every rank issues the same sequence of
batches (forward: K/V per step; backward: K/V of the next step, then the dK/dV of this one), so the k-th
batch of each rank pairs with its neighbours' k-th; each batch is waited before the block that needs
it. Strict comm mode waits every batch when it is issued (no overlap, same order), and the context
parity tests run in it.

Tensors are [b, heads, s, d]; the block attention itself is a `BlockKernel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd import Function

from pentatron.distributed.comm import P2P, Comm, Work
from pentatron.parallel.attention_kernels import BlockKernel


@dataclass
class AttentionCount:
    """Query·key pairs this rank's attention computed (forward), for the load-balance check."""

    pairs: int = 0
    blocks: list[tuple[int, int, bool]] = field(default_factory=list)  # (queries, keys, causal)

    def add(self, sq: int, sk: int, causal: bool, batch_heads: int) -> None:
        self.pairs += batch_heads * (sq * (sq + 1) // 2 if causal else sq * sk)
        self.blocks.append((sq, sk, causal))


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(g: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_expand`: sum over each kv head's query group."""
    if groups == 1:
        return g
    b, h, s, d = g.shape
    return g.view(b, h // groups, groups, s, d).sum(2)


def _block(t: int, i: int, r: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of ring step t on rank i, with chunks of c tokens."""
    j = (i - t) % r
    if t == 0:
        return slice(None), slice(None), True
    if j < i:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


class _RingExchange:
    """The ring neighbours of one rank: send to the next, receive from the previous (batched, async)."""

    def __init__(self, comm: Comm, dim: str) -> None:
        self.comm, self.dim = comm, dim
        n, me = comm.ctx.size(dim), comm.ctx.local_rank(dim)
        self.next, self.prev = (me + 1) % n, (me - 1) % n

    def start(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Work]:
        """The buffer receiving the previous rank's tensor, and the exchange's handle (wait before reading)."""
        incoming = torch.empty_like(tensor)
        work = self.comm.batch_p2p([P2P("send", tensor, self.next), P2P("recv", incoming, self.prev)], self.dim)
        return incoming, work


def _geometry(q: torch.Tensor, k: torch.Tensor, comm: Comm, dim: str
              ) -> tuple[int, int, _RingExchange, int, int, float, torch.dtype]:
    """(ring size, rank, exchange, query heads per kv head, chunk length, softmax scale, accumulator dtype)."""
    return (comm.ctx.size(dim), comm.ctx.local_rank(dim), _RingExchange(comm, dim), q.shape[1] // k.shape[1],
            q.shape[2] // 2, q.shape[3] ** -0.5, torch.float64 if q.dtype == torch.float64 else torch.float32)


class _RingAttention(Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, dim: str,
                kernel: BlockKernel, count: AttentionCount | None) -> torch.Tensor:
        r, i, ring, groups, c, scale, acc_dtype = _geometry(q, k, comm, dim)
        b, h = q.shape[:2]
        out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc_dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()  # one message per step
        for t in range(r):
            pending = ring.start(kv) if t < r - 1 else None  # the next block is on its way while we compute
            rows, cols, causal = _block(t, i, r, c)
            qb = q[:, :, rows]
            kb, vb = (_expand(x[:, :, cols], groups) for x in kv)
            o_b, lse_b = kernel.forward(qb, kb, vb, causal, scale)
            if count is not None:
                count.add(qb.shape[2], kb.shape[2], causal, b * h)
            # Merge through the log-sum-exp: out = Σ_b exp(lse_b − lse)·out_b.
            new = torch.logaddexp(lse[:, :, rows], lse_b)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - new).unsqueeze(-1)
                               + o_b.to(acc_dtype) * torch.exp(lse_b - new).unsqueeze(-1))
            lse[:, :, rows] = new
            if pending is not None:
                kv, work = pending
                work.wait()
        # Stored as [b, s, h, d] (like the fused kernels' output): the caller's transpose back is then
        # contiguous and the output projection saves this same storage instead of a copy.
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.dim, ctx.kernel = comm, dim, kernel
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        comm, dim, kernel = ctx.comm, ctx.dim, ctx.kernel
        r, i, ring, groups, c, scale, acc_dtype = _geometry(q, k, comm, dim)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=q.device)  # travels with the K/V it belongs to
        for t in range(r):
            pending = ring.start(kv) if t < r - 1 else None
            rows, cols, causal = _block(t, i, r, c)
            kb, vb = (_expand(x[:, :, cols], groups) for x in kv)
            dq_b, dk_b, dv_b = kernel.backward(dout[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows],
                                               lse[:, :, rows], causal, scale)
            dq[:, :, rows] += dq_b.to(acc_dtype)
            dkv[0][:, :, cols] += _fold(dk_b.to(acc_dtype), groups)
            dkv[1][:, :, cols] += _fold(dv_b.to(acc_dtype), groups)
            if r > 1:  # pass the accumulator on; after the last step it arrives at its owner
                dkv, work = ring.start(dkv)
                work.wait()
            if pending is not None:
                kv, work = pending
                work.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, dim: str, kernel: BlockKernel,
                   count: AttentionCount | None = None) -> torch.Tensor:
    """Causal attention of this rank's zigzag pair of chunks against the whole ring's sequence.
    q: [b, h, s, d], k/v: [b, h_kv, s, d] (s = 2 chunks) → [b, h, s, d]."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention holds two equal chunks per rank; got {q.shape[2]} tokens")
    return _RingAttention.apply(q, k, v, comm, dim, kernel, count)
