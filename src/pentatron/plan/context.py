"""Context parallelism in the planner: what each of the three modes costs per decoder layer.

`parallel.cp_mode` (training's names): "ring" (K/V blocks travel around the cp ranks, each transfer
overlapped with the attention of the block in hand; load-balanced zigzag split), "ulysses" (all-to-all
from sequence-sharded to head-sharded q/k/v before attention and back after), "hybrid" (Ulysses over
`cp_ulysses` ranks inside a node, ring over the cp // cp_ulysses groups across). In every mode each
rank holds seq/cp tokens of every activation outside attention and does 1/cp of the causal attention
work, so memory and FLOPs are the same; the communication differs:

* ring, degree r: per layer forward r−1 sends of one K/V block (the un-expanded kv heads),
  2·tokens·kv·head_dim·bytes; backward r−1 steps each sending a K/V block and a dK/dV block. Step i's
  transfer runs while block i's attention computes (1/r of the layer's attention): what exceeds it is
  exposed, the rest is hidden (and slows compute by the SMs NCCL occupies).
* ring with `cp_rotate="allgather"` (torch's context_parallel, torch 2.6: the default rotate method):
  each attention call all-gathers the whole K/V first, overlapped with the first (diagonal) block only;
  backward gathers again and passes the fp32 dK/dV accumulator around the ring, each pass overlapped
  with the next block's backward and the last one exposed. `cp_kv_heads="q"`: K/V are expanded to the
  query heads before the exchange (torchtitan's repeat_kv before SDPA), n_heads/n_kv times the bytes.
* Ulysses, degree u: per layer forward 4 all-to-alls over u ranks (q, k, v in; the output back), the
  same 4 in backward (gradients), on the critical path. Heads per tp rank must divide by u; when the kv
  heads per tp rank are fewer than u they are replicated (each rank receives one kv head).
"""

from __future__ import annotations

from dataclasses import dataclass

CP_MODES: tuple[str, ...] = ("ring", "ulysses", "hybrid")  # which modes and degrees are valid: ParallelLayout


def cp_degrees(cp: int, mode: str, cp_ulysses: int) -> tuple[int, int]:
    """(Ulysses degree, ring degree) of a cp group: their product is cp."""
    if cp <= 1:
        return 1, 1
    if mode == "ulysses":
        return cp, 1
    if mode == "hybrid":
        u = max(1, cp_ulysses)
        return u, max(1, cp // u)
    return 1, cp


def cp_mode_options(cp: int, tp: int, gpus_per_node: int) -> list[tuple[str, int]]:
    """(cp_mode, cp_ulysses) pairs the search tries for a cp degree: ring, Ulysses, and — when the cp
    group spans nodes — hybrid with each power-of-two Ulysses degree that stays inside a node."""
    if cp <= 1:
        return [("ring", 1)]
    out = [("ring", 1), ("ulysses", cp)]
    if tp * cp > gpus_per_node:
        u = 2
        while u < cp and tp * u <= gpus_per_node:
            if cp % u == 0:
                out.append(("hybrid", u))
            u *= 2
    return out


def kv_heads_after_ulysses(kv_local: int, u: int) -> int:
    """kv heads × ranks-worth of K (or V) one rank sends per token in the Ulysses all-to-all and keeps
    afterwards for its sequence chunk: its own kv heads, or u when they must be replicated (kv < u)."""
    return max(u, kv_local)


@dataclass(frozen=True)
class CpLayerCost:
    """Seconds per decoder layer and micro-batch on one GPU."""

    fwd_exposed: float  # on the critical path of the forward
    bwd_exposed: float
    fwd_hidden: float  # overlapped with attention (ring): costs SMs, not time
    bwd_hidden: float
    ring_hop: float  # one K/V block transfer (for the report and tests)
    a2a: tuple[float, float]  # one Ulysses all-to-all of q (or out), of k (or v)


def kv_block_bytes(tokens: int | float, kv_local: int, head_dim: int, u: int, a: int) -> float:
    """K and V of one ring step: the rank's tokens (u× more, for u× fewer heads, after Ulysses)."""
    return 2 * tokens * kv_heads_after_ulysses(kv_local, u) * head_dim * a


def ring_exposure(r: int, hop: float, dkv_hop: float, attn_f: float, attn_b: float
                  ) -> tuple[float, float, float, float]:
    """(fwd exposed, bwd exposed, fwd hidden, bwd hidden) of r−1 ring steps, each transfer behind one
    block's attention (1/r of the layer's). Backward sends K/V (`hop`) and the dK/dV accumulator
    (`dkv_hop`: fp32) per step, and the accumulator once more after the last block, home to its owner:
    r accumulator passes, the last with nothing left to hide behind (parallel/ring_attention.py)."""
    if r <= 1:
        return 0.0, 0.0, 0.0, 0.0
    steps = r - 1
    blk_f, blk_b = attn_f / r, attn_b / r
    fe = steps * max(0.0, hop - blk_f)
    be = steps * max(0.0, hop + dkv_hop - blk_b) + dkv_hop
    return fe, be, steps * hop - fe, steps * (hop + dkv_hop) + dkv_hop - be


def exchanged_heads(q_local: float, kv_local: int, cp_kv_heads: str) -> float:
    """Heads of K (and of V) each rank sends in ring attention: its kv heads, or its query heads when K/V
    are expanded before the exchange (`cp_kv_heads="q"`)."""
    return q_local if cp_kv_heads == "q" else kv_local


def allgather_kv_elements(tokens: float, q_local: float, kv_local: int, head_dim: int, cp_kv_heads: str) -> float:
    """Elements of one rank's K and V as torch's all-gather ring attention exchanges them."""
    return 2 * tokens * exchanged_heads(q_local, kv_local, cp_kv_heads) * head_dim


def allgather_exposure(r: int, gather: float, dkv_pass: float, attn_f: float, attn_b: float
                       ) -> tuple[float, float, float, float]:
    """(fwd exposed, bwd exposed, fwd hidden, bwd hidden) of torch's all-gather ring attention over r ranks:
    one K/V all-gather per call behind the first block (1/r of the attention), backward another plus r
    passes of the fp32 dK/dV accumulator, each behind the next block's backward but the last."""
    if r <= 1:
        return 0.0, 0.0, 0.0, 0.0
    blk_f, blk_b = attn_f / r, attn_b / r
    fe = max(0.0, gather - blk_f)
    be = max(0.0, gather - blk_b) + (r - 1) * max(0.0, dkv_pass - blk_b) + dkv_pass
    return fe, be, gather - fe, gather + r * dkv_pass - be


def comm_buffer_bytes(tokens: float, hq_local: float, kv_local: int, head_dim: int, cp: int, mode: str,
                      cp_ulysses: int, a: int, rotate: str = "p2p", cp_kv_heads: str = "kv") -> float:
    """Transient communication buffers of one layer's attention: ring, the K/V block in hand and the one
    arriving (and in backward the fp32 dK/dV accumulator sent and the one arriving); all-gather ring, the
    gathered K/V of all r ranks and the fp32 dK/dV accumulator sent and received; Ulysses, the received
    q, k, v."""
    u, r = cp_degrees(cp, mode, cp_ulysses)
    out = 0.0
    if r > 1 and rotate == "allgather":
        local = allgather_kv_elements(tokens, hq_local / head_dim, kv_local, head_dim, cp_kv_heads)
        out += r * local * a + 2 * local * 4
    elif r > 1:
        out += 2 * (kv_block_bytes(tokens, kv_local, head_dim, u, a) + kv_block_bytes(tokens, kv_local, head_dim, u, 4))
    if u > 1:
        out += tokens * (hq_local + 2 * kv_heads_after_ulysses(kv_local, u) * head_dim) * a
    return out


def ulysses_kv_replication_bytes(tokens: float, kv_local: int, head_dim: int, u: int, a: int) -> float:
    """Extra saved K and V when u > kv heads per tp rank: each rank keeps one replicated kv head for its
    u× longer chunk instead of kv/u heads (flash attention saves k and v)."""
    return 2 * tokens * (kv_heads_after_ulysses(kv_local, u) - kv_local) * head_dim * a


def layer_cost(u: int, r: int, hop: float, dkv_hop: float, a2a_q: float, a2a_kv: float, attn_f: float,
               attn_b: float) -> CpLayerCost:
    """The per-layer cost from the degrees (u Ulysses × r ring), one ring hop's seconds (K/V, and the
    fp32 dK/dV accumulator) and one Ulysses all-to-all's seconds for a q-sized and a k-sized buffer
    (collective model in plan/comm.py)."""
    fe, be, fh, bh = ring_exposure(r, hop, dkv_hop, attn_f, attn_b)
    a2a = 2 * a2a_q + 2 * a2a_kv if u > 1 else 0.0  # q, k, v in and the output back (backward: gradients)
    return CpLayerCost(fe + a2a, be + a2a, fh, bh, hop if r > 1 else 0.0, (a2a_q, a2a_kv) if u > 1 else (0.0, 0.0))
