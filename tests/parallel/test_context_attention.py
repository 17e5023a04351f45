"""Context-parallel attention equals full causal attention on the gathered sequence.

Each rank builds the same random q, k, v for the whole sequence, keeps its cp slice (`cp_token_index`),
runs `ContextParallelAttention` forward and backward, and the output and the input gradients of its
slice must equal those of `scaled_dot_product_attention` on the whole sequence (fp64, so that only
the algorithm can differ). Ring, Ulysses and hybrid; GQA and MHA; kv heads fewer than the Ulysses
ranks (replicated); sequence lengths that are not powers of two; the math and the fused block kernels.
The same runs check the balance of the zigzag split (query·key pairs per rank equal), the comm
ledger (ring sends and all-to-alls per layer = the formula) and the activation memory of a decoder
block per rank (saved-tensor meter: 1/cp of the single-process block's).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.multiprocess import run_ranks
from tests.strict_comm import strict_comm_fixture

strict_comm = strict_comm_fixture("module")  # NCCL's p2p ordering and device rules on gloo

B, D = 2, 8
# (mode, cp, ulysses, seq, heads, kv heads)
CASES: dict[int, list[tuple[str, int, int, int, int, int]]] = {
    2: [("ring", 2, 1, 12, 4, 2), ("ring", 2, 1, 20, 4, 4), ("ulysses", 2, 2, 6, 4, 2), ("ulysses", 2, 2, 10, 2, 1)],
    4: [("ring", 4, 1, 24, 4, 2), ("ulysses", 4, 4, 12, 4, 2), ("hybrid", 4, 2, 24, 4, 2), ("hybrid", 4, 2, 40, 2, 2)],
}


def _rank(rank: int, world: int, cases: list[tuple[str, int, int, int, int, int]]) -> list[dict[str, Any]]:
    from pentatron.distributed.context import ParallelContext
    from pentatron.layout import ParallelLayout
    from pentatron.parallel.attention_kernels import block_kernel
    from pentatron.parallel.context import ContextParallelAttention, ContextShard

    out = []
    for mode, cp, u, seq, heads, kv in cases:
        layout = ParallelLayout(cp=cp, cp_mode=mode, cp_ulysses=u if mode == "hybrid" else 1, seq_len=seq)
        ctx = ParallelContext.from_layout(layout, "cpu")
        g = torch.Generator().manual_seed(seq * 100 + heads)
        q, dout = (torch.randn(B, seq, heads, D, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(B, seq, kv, D, generator=g, dtype=torch.float64) for _ in range(2))
        # The reference: full causal attention on the whole sequence.
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qr, kr, vr)), is_causal=True,
                                             enable_gqa=kv != heads).transpose(1, 2)
        ref.backward(dout)
        idx = ContextShard(ctx.comm, layout).positions
        for kernel in ("math", "fused"):
            attn = ContextParallelAttention(ctx.comm, layout, block_kernel(kernel))
            ql, kl, vl = (t[:, idx].clone().requires_grad_() for t in (q, k, v))
            ctx.comm.ledger.begin_step()
            o = attn(ql, kl, vl)
            forward_events = list(ctx.comm.ledger.events)
            o.backward(dout[:, idx])
            all_events = ctx.comm.ledger.events
            err = max((o - ref[:, idx]).abs().max().item(),
                      *((a.grad - b.grad[:, idx]).abs().max().item() for a, b in ((ql, qr), (kl, kr), (vl, vr))))
            out.append({"case": (mode, cp, u, seq, heads, kv, kernel), "err": err, "pairs": attn.count.pairs,
                        "fwd": [(e.op, e.dim, e.bytes) for e in forward_events],
                        "all": [(e.op, e.dim, e.bytes) for e in all_events]})
    return {"cases": out, "memory": _block_memory(world)}


MEM_SEQ, MEM_MODES = 48, {2: [("ring", 1), ("ulysses", 1)], 4: [("ring", 1), ("hybrid", 2)]}


def _block_memory(world: int) -> dict[str, tuple[int, int]]:
    """Bytes one decoder block saves for backward: (this rank with cp = world, one process with it all)."""
    from pentatron.distributed.context import ParallelContext
    from pentatron.layout import ParallelLayout
    from pentatron.models.llama import DecoderBlock, Rotary
    from pentatron.models.registry import get_model_config
    from pentatron.parallel.activation_memory import SavedTensorMeter
    from pentatron.parallel.context import ContextParallelAttention, ContextShard

    cfg = get_model_config("debug")
    rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, None)
    rotary.reset_parameters()
    out = {}
    for mode, u in MEM_MODES[world]:
        layout = ParallelLayout(cp=world, cp_mode=mode, cp_ulysses=u, seq_len=MEM_SEQ)
        ctx = ParallelContext.from_layout(layout, "cpu")
        torch.manual_seed(0)
        block = DecoderBlock(cfg)
        x = torch.randn(B, MEM_SEQ, cfg.hidden_size, requires_grad=True)
        sizes = []
        for positions, core in ((torch.arange(MEM_SEQ), None),
                                (ContextShard(ctx.comm, layout).positions, ContextParallelAttention(ctx.comm, layout))):
            if core is not None:
                block.attn.core = core
            cos, sin = rotary(positions)
            xl = x[:, positions].detach().requires_grad_()
            with SavedTensorMeter(exclude=[*block.parameters(), xl]) as meter:
                y = block(xl, cos, sin)
            y.sum().backward()  # the collectives of the backward run on every rank
            sizes.append(meter.bytes)
        out[mode] = (sizes[1], sizes[0])
    return out


@pytest.mark.parametrize("world", sorted(CASES))
def test_context_parallel_attention_equals_full_attention(world: int) -> None:
    results = run_ranks(_rank, world, args=(CASES[world],))
    for r in results:
        for mode, (local, whole) in r["memory"].items():
            # Every activation of the block is per token (attention keeps q, k, v, out and its log-sum-exp
            # for the rank's tokens only): the rank keeps 1/cp of the whole block's. Ulysses (alone or in
            # hybrid) keeps one more output-sized tensor: attention saves its head-sharded output and the
            # output projection the all-to-all's sequence-sharded copy (one process: the same storage).
            extra = B * MEM_SEQ * 128 * 4 if mode != "ring" else 0  # debug model: 4 heads × 32 = 128 wide
            assert local * world == whole + extra, f"cp{world} {mode}: {local} B per rank vs {whole} B"
    for per_rank in zip(*(r["cases"] for r in results), strict=True):
        case = per_rank[0]["case"]
        for r in per_rank:
            assert r["err"] < 1e-12, f"{case} rank: max |Δ| {r['err']:.2e}"
        mode, cp, u, seq, heads, kv, _ = case
        ring = cp // u
        if ring > 1:
            # Zigzag: every rank computes the same number of query·key pairs.
            pairs = [r["pairs"] for r in per_rank]
            assert max(pairs) == min(pairs), f"{case}: unbalanced {pairs}"
            c = seq // (2 * ring)  # chunk length
            assert pairs[0] == B * heads // u * ((2 * c) * (2 * c + 1) // 2 + (ring - 1) * 2 * c * c)
        for r in per_rank:
            sends_fwd = [b for op, dim, b in r["fwd"] if op == "send"]
            sends_all = [b for op, dim, b in r["all"] if op == "send"]
            a2a_fwd = [1 for op, _, _ in r["fwd"] if op == "all_to_all"]
            a2a_all = [1 for op, _, _ in r["all"] if op == "all_to_all"]
            # The K/V block one ring rank holds: 2 tensors × b × kv heads (after Ulysses) × its tokens × d.
            kv_after = 1 if kv < u else kv // u
            block = 2 * B * kv_after * (seq // ring) * D * 8
            assert sum(sends_fwd) == (ring - 1) * block
            assert sum(sends_all) == (ring - 1) * block + (ring - 1) * block + (ring * block if ring > 1 else 0)
            assert len(a2a_fwd) == (4 if u > 1 else 0) and len(a2a_all) == (8 if u > 1 else 0)


def test_zigzag_token_index_covers_the_sequence_once() -> None:
    from pentatron.parallel.context import cp_token_index

    for seq, ring, u in ((24, 2, 2), (40, 4, 1), (12, 1, 4), (48, 3, 2)):
        held = [cp_token_index(seq, ring, u, i, j) for i in range(ring) for j in range(u)]
        assert sorted(torch.cat(held).tolist()) == list(range(seq))
        assert {h.numel() for h in held} == {seq // (ring * u)}
    # Ring of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cp_token_index(8, 2, 1, 0, 0).tolist() == [0, 1, 6, 7]
    assert cp_token_index(8, 2, 1, 1, 0).tolist() == [2, 3, 4, 5]


def test_masked_ring_computes_only_shared_documents():
    """Document masking's ring plan (`_pieces`, host-side): seq 16 over ring 2 (chunks of 4: rank 0 holds
    positions 0-3 and 12-15, rank 1 4-11), one sample of documents [0, 6), [6, 14), [14, 16). Rank 0's diagonal
    block is one causal piece per document; at step 1 its second chunk meets rank 1's K/V and shares only
    [6, 14): queries 12-13 on keys 6-11, one full piece. With documents [0, 4), [4, 12), [12, 16) rank 1's
    queries (4-11) share nothing with rank 0's first chunk (0-3): the block is skipped."""
    from pentatron.models.documents import Documents
    from pentatron.parallel.ring_attention import _pieces

    docs = Documents(((0, 6, 14),), 16)
    diagonal, causal = _pieces(docs, 0, 0, 2, 4)
    assert causal and [(p[1].start, p[1].stop) for p in diagonal] == [(0, 4), (4, 6), (6, 8)]
    (piece,), causal = _pieces(docs, 1, 0, 2, 4)
    assert not causal and (piece[1].start, piece[1].stop, piece[2].start, piece[2].stop) == (4, 6, 2, 8)
    assert _pieces(Documents(((0, 4, 12),), 16), 1, 1, 2, 4) == ([], False)
