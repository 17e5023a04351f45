"""Context parallelism's three modes in the planner (issue 11, item 5): hand-computed cases for each
term — degrees, ring overlap, ring and Ulysses volumes, the rules, memory — and CP recommended only
where it helps."""

from __future__ import annotations

import dataclasses

import pytest

from pentatron.hardware.catalogue import get_gpu
from pentatron.models.config import ModelConfig
from pentatron.models.registry import get_model_config
from pentatron.plan.comm import collective_time, cp_layer_cost, group_of, p2p_time, step_collectives
from pentatron.plan.context import cp_degrees, cp_mode_options, ring_exposure
from pentatron.plan.layout import Layout, Workload, problems
from pentatron.plan.memory import llama_layer_activation_bytes, memory_for_rank
from pentatron.plan.recipes import Recipe
from pentatron.plan.search import search
from pentatron.plan.timing import KERNEL_OVERHEAD, attention_times, layer_phase

H100 = get_gpu("h100")
# h=2048, 16 heads of 128, 4 kv heads
CFG = ModelConfig(vocab_size=32000, hidden_size=2048, n_layers=4, n_heads=16, n_kv_heads=4, ffn_hidden_size=8192)
W = Workload(CFG, 8192, 8)  # cp=4: 2048 tokens per rank


def test_degrees():
    assert cp_degrees(8, "ring", 1) == (1, 8)
    assert cp_degrees(8, "ulysses", 1) == (8, 1)
    assert cp_degrees(8, "hybrid", 2) == (2, 4)
    assert cp_degrees(1, "ulysses", 1) == (1, 1)
    # the search tries hybrid only when the cp group leaves the node, with Ulysses inside it
    assert cp_mode_options(4, 1, 8) == [("ring", 1), ("ulysses", 4)]
    assert cp_mode_options(16, 2, 8) == [("ring", 1), ("ulysses", 16), ("hybrid", 2), ("hybrid", 4)]


def test_ring_step_hides_behind_one_block():
    # r=4: 3 steps; block attention fwd 8/4 = 2, bwd 20/4 = 5; hop 3 (bwd sends K/V and dK/dV: 6 per
    # step) and the 4th accumulator pass home after the last block, exposed (3)
    assert ring_exposure(4, 3.0, 3.0, 8.0, 20.0) == (3 * 1.0, 3 * 1.0 + 3.0, 9.0 - 3.0, 18.0 + 3.0 - 6.0)
    assert ring_exposure(4, 1.0, 1.0, 8.0, 20.0) == (0.0, 1.0, 3.0, 6.0)  # hidden but the last pass
    assert ring_exposure(4, 1.0, 2.0, 8.0, 20.0) == (0.0, 2.0, 3.0, 9.0)  # fp32 dK/dV: twice bf16 K/V's bytes
    assert ring_exposure(1, 3.0, 3.0, 8.0, 20.0) == (0.0, 0.0, 0.0, 0.0)


def test_ring_volume_per_layer_and_time():
    lay = Layout(dp=1, cp=4, micro_batch=1)
    block = 2 * 2048 * 4 * 128 * 2  # K and V of 2048 tokens, 4 un-expanded kv heads of 128, bf16
    assert block == 4194304
    ring, dkv = [c for c in step_collectives(W, lay, H100, 1e8, 0, 4, 0, first=True, last=True) if c.dim == "cp"]
    # K/V: 8 micro-batches x 4 layers x 3 steps x (1 forward + 1 backward); the fp32 dK/dV accumulator:
    # 4 passes per layer (3 steps and the last one home), twice the bf16 block's bytes
    assert ring.op == "send" and ring.payload == block and ring.count == 8 * 4 * 3 * 2
    assert dkv.op == "send" and dkv.payload == 2 * block and dkv.count == 8 * 4 * 4
    hop, dkv_hop = p2p_time(H100, block, False), p2p_time(H100, 2 * block, False)
    assert hop == 2e-6 + block / (450e9 * 0.8)
    attn_f, attn_b = attention_times(W, lay, H100)
    cost = cp_layer_cost(W, lay, H100, attn_f, attn_b)
    assert cost.ring_hop == hop
    assert cost.fwd_exposed == 3 * max(0.0, hop - attn_f / 4)
    assert cost.bwd_exposed == 3 * max(0.0, hop + dkv_hop - attn_b / 4) + dkv_hop
    # full recompute replays the forward's 3 K/V sends too
    rc, _ = [c for c in step_collectives(W, dataclasses.replace(lay, recompute="full"), H100, 1e8, 0, 4, 0,
                                         first=True, last=True) if c.dim == "cp"]
    assert rc.count == 8 * 4 * 3 * 3


def test_ulysses_four_all_to_alls_each_way():
    lay = Layout(dp=1, cp=4, cp_mode="ulysses", micro_batch=1)
    colls = [c for c in step_collectives(W, lay, H100, 1e8, 0, 4, 0, first=True, last=True) if c.dim == "cp"]
    q = 2048 * 16 * 128 * 2  # this rank's q (or output) over all 16 heads
    kv = 2048 * 4 * 128 * 2  # k (or v): 4 kv heads, u=4 divides them
    assert sorted((c.op, c.payload, c.count) for c in colls) == sorted(
        [("all_to_all", q, 8 * 4 * 4), ("all_to_all", kv, 8 * 4 * 4)])  # per layer: 2+2 fwd, 2+2 bwd
    assert all(c.wire == c.payload * 3 / 4 for c in colls)
    g = group_of(lay, "cp_ulysses", H100)
    tq, tkv = collective_time(H100, "all_to_all", q, g), collective_time(H100, "all_to_all", kv, g)
    cost = cp_layer_cost(W, lay, H100, *attention_times(W, lay, H100))
    assert cost.fwd_exposed == cost.bwd_exposed == 2 * tq + 2 * tkv and cost.fwd_hidden == 0.0
    # on the critical path of the layer: Ulysses' forward differs from ring's by the all-to-alls against
    # ring's exposed transfers and its extra kernel launches (2 per ring step instead of one call)
    rlay = dataclasses.replace(lay, cp_mode="ring")
    ring, uly = layer_phase(W, rlay, H100, 0), layer_phase(W, lay, H100, 0)
    ring_cost = cp_layer_cost(W, rlay, H100, *attention_times(W, rlay, H100))
    launches = attention_times(W, rlay, H100)[0] - attention_times(W, lay, H100)[0]
    assert launches == pytest.approx((2 * 4 - 1) * KERNEL_OVERHEAD)
    assert abs((uly.f - ring.f) - (2 * tq + 2 * tkv - ring_cost.fwd_exposed - launches)) < 1e-12
    # u = 8 > 4 kv heads: kv replicated, one head per rank, so each rank sends 8 heads' worth
    lay8 = Layout(dp=1, cp=8, cp_mode="ulysses", micro_batch=1)
    kv8 = [c for c in step_collectives(W, lay8, H100, 1e8, 0, 4, 0, first=True, last=True)
           if c.where == "Ulysses k, v in"]
    assert kv8[0].payload == 1024 * 8 * 128 * 2


def test_hybrid_is_ulysses_in_the_node_and_ring_across():
    lay = Layout(dp=1, tp=4, cp=4, cp_mode="hybrid", cp_ulysses=2, micro_batch=1)  # 16 GPUs, 2 nodes
    u, r = group_of(lay, "cp_ulysses", H100), group_of(lay, "cp_ring", H100)
    assert (u.size, u.crosses_nodes) == (2, False) and (r.size, r.crosses_nodes) == (2, True)
    cost = cp_layer_cost(W, lay, H100, 1.0, 1.0)
    # ring block after Ulysses: 2048 tokens x max(2, 1 kv head per tp rank) heads, across nodes
    assert cost.ring_hop == p2p_time(H100, 2 * 2048 * 2 * 128 * 2, True)


@pytest.mark.parametrize("mode,u,tp,msg", [
    ("ulysses", 1, 1, None),  # cp=4 divides 16 heads and 4 kv heads
    ("hybrid", 2, 1, None),  # Ulysses 2 x ring 2
    ("ulysses", 1, 8, "heads"),  # 2 heads per tp rank cannot split 4 ways
    ("hybrid", 3, 1, "cp_ulysses"),
    ("spiral", 1, 1, "cp_mode"),
])
def test_rules_are_training_s(mode, u, tp, msg):
    """The planner refuses exactly what training refuses: ParallelLayout's context-parallel rules."""
    found = problems(W, Layout(dp=1, tp=tp, cp=4, cp_mode=mode, cp_ulysses=u), H100)
    assert (not found) if msg is None else any(msg in x for x in found), found


def test_kv_heads_that_do_not_divide_nor_multiply():
    cfg = dataclasses.replace(CFG, n_heads=12, n_kv_heads=6, hidden_size=1536)
    found = problems(Workload(cfg, 8192, 8), Layout(dp=1, cp=4, cp_mode="ulysses"), H100)
    assert any("kv heads" in x for x in found), found


def test_activations_fall_as_one_over_cp():
    base = Layout(dp=1, micro_batch=1)
    one = memory_for_rank(W, base, H100, 0).activations
    for cp in (2, 4):
        for mode in ("ring", "ulysses"):
            assert memory_for_rank(W, base.with_(cp=cp, cp_mode=mode), H100, 0).activations == one / cp
    # Ulysses u=8 over 4 kv heads keeps a replicated kv head: +2 x tokens x (8 - 4) x 128 x 2 bytes
    plain = llama_layer_activation_bytes(CFG, 1024, 1024)
    rep = llama_layer_activation_bytes(CFG, 1024, 1024, cp_ulysses_degree=8)
    assert rep.saved - plain.saved == 2 * 1024 * 4 * 128 * 2


def test_cp_recommended_only_where_it_helps():
    """Among the layouts that fit, short sequences are best without CP; at long sequences on 8 GPUs the
    best layout uses CP. With the full-logits loss (12 bytes per token and vocabulary entry) that is 128k
    tokens, where only tp8 with full recompute fits without it; training's chunked loss holds one chunk's
    logits, so 128k fits without CP and the turn comes at 256k (tp4+ with full recompute fit without it)."""
    cfg = get_model_config("llama3-8b")
    short = [s for s in search(Workload(cfg, 2048, 64), H100, 8, top=1).pool if s.fits]
    assert max(short, key=lambda s: s.est_tokens_per_s).layout.cp == 1
    full_logits = {"recipe": Recipe(cross_entropy="eager")}
    long = [s for s in search(Workload(cfg, 131072, 8), H100, 8, top=1, fixed=full_logits).pool if s.fits]
    assert long and max(long, key=lambda s: s.est_tokens_per_s).layout.cp > 1
    assert [s.layout.short() for s in long if s.layout.cp == 1] in ([], ["dp1 tp8+sp pp1 cp1 z0 mb1 rc:full"])
    longer = [s for s in search(Workload(cfg, 262144, 4), H100, 8, top=1).pool if s.fits]
    assert longer and max(longer, key=lambda s: s.est_tokens_per_s).layout.cp > 1
    assert all(s.layout.tp >= 4 and s.layout.recompute == "full" for s in longer if s.layout.cp == 1)
