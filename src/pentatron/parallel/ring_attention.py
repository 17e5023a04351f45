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
K/V around the ring again, with each K/V's dK/dV accumulator (fp32) travelling one step behind it: at step
t a rank computes its block's dK/dV first, then waits for the accumulator its predecessor sent at step
t−1, adds, and sends it on, so that the exchange overlaps the block's kernels (as the forward's K/V
exchange does), in the same two fp32 buffers as a waited-at-once exchange (the one sent, the one
arriving); after r sends every accumulator is back home. Per rank and layer: forward (r−1) K/V
sends, backward (r−1) K/V plus r dK/dV sends. K/V travel with their own kv heads and reach the block
kernel so (GQA without a copy per step: attention_kernels.py).

Point-to-point under NCCL's rules (per rank, batches complete in issue order; a send may wait for its
receive): every transfer is one batch holding this rank's send to the next rank *and* its receive from
the previous one, so no send waits on a receive issued later. Every rank issues the same sequence of
batches (forward: K/V per step; backward: K/V of the next step, then the dK/dV of this one), so the k-th
batch of each rank pairs with its neighbours' k-th; each batch is waited before the block that needs
it. Strict comm mode waits every batch when it is issued (no overlap, same order), and the context
parity tests run in it.

Tensors are [b, heads, s, d]; the block attention itself is a `BlockKernel`.

Document masking (`Documents`, models/documents.py): a query sees the keys of its own document only. Every
block above is either the diagonal one (the same tokens as queries and keys) or one whose keys all precede
its queries, and a document's tokens are contiguous in a rank's zigzag pair (positions increase through it),
so each (sample, document) present on both sides of a block is one rectangle: causal on the diagonal, full
otherwise. The kernel runs on those rectangles only (`_pieces`): a block pair sharing no document is skipped
entirely (its K/V still travel on: other ranks need them), and the LSE merge is unchanged (a row no piece
covers keeps its running output; step 0 covers every row, each token seeing itself). With documents the
zigzag no longer balances exactly: a rank's work is the pairs of the pieces it meets (`AttentionCount`);
measured on 16 samples of 4,096 tokens with mean document seq/8, the busiest rank does 1.19× the mean at
ring 2 and 4, 1.25× at ring 8 (docs/architecture.md, "Document masking").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.autograd import Function

from pentatron.distributed.comm import P2P, Comm, Work
from pentatron.models.documents import Documents
from pentatron.parallel.attention_kernels import BlockKernel

# One rectangle of a block's attention: (samples, query rows, key rows) of the local q and the held K/V.
Piece = tuple[slice, slice, slice]


@dataclass
class AttentionCount:
    """Query·key pairs this rank's attention computed (forward), for the load-balance check."""

    pairs: int = 0
    blocks: list[tuple[int, int, bool]] = field(default_factory=list)  # (queries, keys, causal)

    def add(self, sq: int, sk: int, causal: bool, batch_heads: int) -> None:
        self.pairs += batch_heads * (sq * (sq + 1) // 2 if causal else sq * sk)
        self.blocks.append((sq, sk, causal))


def _block(t: int, i: int, r: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of ring step t on rank i, with chunks of c tokens."""
    j = (i - t) % r
    if t == 0:
        return slice(None), slice(None), True
    if j < i:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def zigzag_positions(seq_len: int, r: int, i: int) -> np.ndarray:
    """Positions (0..seq_len−1) of ring rank i's two chunks, in its local order."""
    c = seq_len // (2 * r)
    return np.concatenate([np.arange(i * c, (i + 1) * c), np.arange((2 * r - 1 - i) * c, (2 * r - i) * c)])


def _pieces(documents: Documents | None, t: int, i: int, r: int, c: int) -> tuple[list[Piece], bool]:
    """The rectangles ring step t on rank i computes, and whether they are causal: the whole block
    without documents, else one per (sample, document) on both sides of it (none: the step is skipped)."""
    rows, cols, causal = _block(t, i, r, c)
    if documents is None:
        return [(slice(None), rows, cols)], causal
    ids = documents.ids
    q_ids = ids[:, zigzag_positions(documents.seq_len, r, i)][:, rows]
    k_ids = ids[:, zigzag_positions(documents.seq_len, r, (i - t) % r)][:, cols]
    q0, k0 = rows.start or 0, cols.start or 0
    out = []
    for n in range(ids.shape[0]):
        for d in np.intersect1d(q_ids[n], k_ids[n]):  # ids are non-decreasing along each side
            qs, qe = np.searchsorted(q_ids[n], d, "left"), np.searchsorted(q_ids[n], d, "right")
            ks, ke = np.searchsorted(k_ids[n], d, "left"), np.searchsorted(k_ids[n], d, "right")
            out.append((slice(n, n + 1), slice(q0 + int(qs), q0 + int(qe)), slice(k0 + int(ks), k0 + int(ke))))
    return out, causal


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


def _geometry(q: torch.Tensor, comm: Comm, dim: str) -> tuple[int, int, _RingExchange, int, float, torch.dtype]:
    """(ring size, rank, exchange, chunk length, softmax scale, accumulator dtype)."""
    return (comm.ctx.size(dim), comm.ctx.local_rank(dim), _RingExchange(comm, dim), q.shape[2] // 2,
            q.shape[3] ** -0.5, torch.float64 if q.dtype == torch.float64 else torch.float32)


class _RingAttention(Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, dim: str,
                kernel: BlockKernel, count: AttentionCount | None, documents: Documents | None) -> torch.Tensor:
        r, i, ring, c, scale, acc_dtype = _geometry(q, comm, dim)
        h = q.shape[1]
        plan = [_pieces(documents, t, i, r, c) for t in range(r)]
        out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc_dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()  # one message per step
        for t in range(r):
            pending = ring.start(kv) if t < r - 1 else None  # the next block is on its way while we compute
            pieces, causal = plan[t]
            for n, rows, cols in pieces:
                qb = q[n, :, rows]
                kb, vb = kv[0][n, :, cols], kv[1][n, :, cols]
                o_b, lse_b = kernel.forward(qb, kb, vb, causal, scale)
                if count is not None:
                    count.add(qb.shape[2], kb.shape[2], causal, qb.shape[0] * h)
                # Merge through the log-sum-exp: out = Σ_b exp(lse_b − lse)·out_b.
                new = torch.logaddexp(lse[n, :, rows], lse_b)
                out[n, :, rows] = (out[n, :, rows] * torch.exp(lse[n, :, rows] - new).unsqueeze(-1)
                                   + o_b.to(acc_dtype) * torch.exp(lse_b - new).unsqueeze(-1))
                lse[n, :, rows] = new
            if pending is not None:
                kv, work = pending
                work.wait()
        # Stored as [b, s, h, d] (like the fused kernels' output): the caller's transpose back is then
        # contiguous and the output projection saves this same storage instead of a copy.
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.dim, ctx.kernel, ctx.plan = comm, dim, kernel, plan
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        comm, dim, kernel, plan = ctx.comm, ctx.dim, ctx.kernel, ctx.plan
        r, i, ring, c, scale, acc_dtype = _geometry(q, comm, dim)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        arriving = None  # the held K/V's dK/dV accumulator, on its way from the previous rank
        for t in range(r):
            pending = ring.start(kv) if t < r - 1 else None
            pieces, causal = plan[t]
            grads = []  # this block's dK/dV, added once the accumulator is here
            for n, rows, cols in pieces:
                dq_b, dk_b, dv_b = kernel.backward(dout[n, :, rows], q[n, :, rows], kv[0][n, :, cols],
                                                   kv[1][n, :, cols], out[n, :, rows], lse[n, :, rows], causal, scale)
                dq[n, :, rows] += dq_b.to(acc_dtype)
                grads.append((n, cols, dk_b, dv_b))
            if arriving is None:
                dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=q.device)
            else:  # waited only now: it travelled while this block's kernels ran
                dkv, work, _ = arriving
                work.wait()
            for n, cols, dk_b, dv_b in grads:
                dkv[0][n, :, cols] += dk_b
                dkv[1][n, :, cols] += dv_b
            if r > 1:  # on to the next rank; after the last step it arrives at its owner
                arriving = (*ring.start(dkv), dkv)  # the sent buffer kept until its batch is waited
            if pending is not None:
                kv, work = pending
                work.wait()
        if arriving is not None:
            dkv, work, _ = arriving
            work.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, dim: str, kernel: BlockKernel,
                   count: AttentionCount | None = None, documents: Documents | None = None) -> torch.Tensor:
    """Causal attention of this rank's zigzag pair of chunks against the whole ring's sequence (within each
    document when `documents`, of the whole sequences, are given).
    q: [b, h, s, d], k/v: [b, h_kv, s, d] (s = 2 chunks) → [b, h, s, d]."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention holds two equal chunks per rank; got {q.shape[2]} tokens")
    return _RingAttention.apply(q, k, v, comm, dim, kernel, count, documents)
