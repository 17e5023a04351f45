"""Framework recipes the planner models for published runs (issue 10): Megatron's sequence parallelism
that keeps the sharded block inputs, flash-attn's fused cross-entropy, TP communication pipelined with
its GEMMs, nanotron's blocking ZeRO-1 (no DP overlap, gradients all-reduced) and the blocking pipeline
sends of DeepSpeed and nanotron, Megatron's / DeepSpeed's stage outputs sent as 1/tp slices, torch's
all-gather ring attention and torch's interleaved warm-up. Hand-computed cases."""

from __future__ import annotations

import dataclasses

from pentatron.hardware.catalogue import get_gpu
from pentatron.models.config import ModelConfig
from pentatron.plan.comm import (
    SP_REGATHER_WHERE,
    STEP_SCALARS_WHERE,
    collective_time,
    group_of,
    layer_comm,
    p2p_time,
    pp_hop_time,
    step_collectives,
)
from pentatron.plan.layout import Layout, Workload, problems, trainable_problems
from pentatron.plan.memory import llama_layer_activation_bytes, memory_for_rank, stage_extras
from pentatron.plan.recipes import Recipe
from pentatron.plan.timing import dense_linears, layer_phase, stage_phases, step_time, tp_overlap_split
from tests.plan.conftest import uncalibrated

H100 = H100_ = get_gpu("h100")
CFG = ModelConfig(vocab_size=32000, hidden_size=1024, n_layers=8, n_heads=16, n_kv_heads=8,
                  ffn_hidden_size=4096)


def test_megatron_sp_keeps_the_shard_of_both_block_inputs():
    kw = dict(precision="bf16", tp=4, sp=True)
    gathered = llama_layer_activation_bytes(CFG, 2048, 2048, **kw)
    sharded = llama_layer_activation_bytes(CFG, 2048, 2048, sp_inputs="sharded", **kw)
    # two block inputs (q/k/v's and gate/up's), 2 bytes x h = 1024 per token, 3/4 of each not kept
    assert gathered.saved - sharded.saved == 2048 * 2 * 2 * 1024 * 3 / 4 == 6291456
    # without SP (or tp=1) there is nothing to shard
    assert (llama_layer_activation_bytes(CFG, 2048, 2048, tp=4, sp=False, sp_inputs="sharded")
            == llama_layer_activation_bytes(CFG, 2048, 2048, tp=4, sp=False))


def test_megatron_sp_regathers_in_backward_under_the_input_gradient_gemms():
    w = Workload(CFG, 2048, 64)
    lay = Layout(dp=2, tp=4, sp=True, micro_batch=1)
    meg = lay.with_recipe(sp_inputs="sharded")
    act = 2048 * 1024 * 2
    lc = layer_comm(w, meg, H100, False)
    ag = collective_time(H100, "all_gather", act, group_of(meg, "tp", H100))
    assert lc.sp_regather == ag and layer_comm(w, lay, H100, False).sp_regather == 0.0
    lin = dense_linears(w, meg, H100)
    qkv, up = lin.qkv, lin.up
    exposed = max(0.0, ag - qkv.b) + max(0.0, ag - up.b)
    ours, theirs = layer_phase(w, lay, H100, 0), layer_phase(w, meg, H100, 0)
    assert theirs.f == ours.f and theirs.w == ours.w
    assert abs(theirs.b - ours.b - exposed) < 1e-15
    # two more all-gathers per layer and micro-batch in the ledger (32 micro-batches, 8 layers)
    colls = step_collectives(w, meg, H100, 1e8, 0.0, 8, 0, first=True, last=True)
    (re,) = [c for c in colls if c.where == SP_REGATHER_WHERE]
    assert re.op == "all_gather" and re.payload == act and re.count == 32 * 2 * 8


def test_fused_cross_entropy_keeps_logits_and_logsumexp():
    tokens, a, v, h = 4096, 2, 32000, 1024
    saved, transient = stage_extras(CFG, tokens, first=False, last=True, cross_entropy="fused")
    # final norm: fp32 copy 4h + rstd 4 + normalised and LM-head input 2*a*h; targets 8; logits a*v + lse 4
    assert saved == tokens * (4 * h + 4 + 2 * a * h + 8 + a * v + 4)
    assert transient == tokens * a * v  # the logits' gradient during backward
    eager_saved, eager_transient = stage_extras(CFG, tokens, first=False, last=True)
    assert eager_saved - saved == tokens * (4 * v - a * v - 4)
    assert eager_transient == tokens * 8 * v  # the backward's two fp32 gradients (more than the forward's a + 4)


def test_recipes_are_evaluated_but_not_trainable():
    w = Workload(CFG, 2048, 64)
    meg = Layout(dp=2, tp=4, sp=True, recipe=Recipe(sp_inputs="sharded", cross_entropy="fused"))
    assert not problems(w, meg, H100, 8)
    why = trainable_problems(w, meg, 8)
    assert any("sp_inputs='sharded'" in x for x in why) and any("cross_entropy='fused'" in x for x in why)
    assert any("sp_inputs must be" in x for x in problems(w, meg.with_recipe(sp_inputs="x"), H100, 8))


def test_deepspeed_bf16_optimizer_keeps_both_gradients():
    from pentatron.plan.memory import PLAYBOOK_20, state_precision

    ds = state_precision(Layout(recipe=Recipe(grad_precision="bf16+fp32")))
    assert (ds.param, ds.grad, ds.master, ds.optimizer) == (2, 6, 4, 8)
    assert ds.total == PLAYBOOK_20.total == 20  # the playbook's bf16 + fp32-gradient recipe
    # it reduces the fp32 accumulation: the same bytes as ours
    from pentatron.plan.comm import dp_collectives
    assert (dp_collectives(Layout(dp=8, recipe=Recipe(grad_precision="bf16+fp32")), H100, 1e9, "dp", 1, 2)[0].payload
            == dp_collectives(Layout(dp=8), H100, 1e9, "dp", 1, 2)[0].payload == 4e9)


def test_pipeline_engine_holds_inputs_and_outputs_of_micro_batches_in_flight():
    from pentatron.plan.memory import pipeline_boundary_bytes

    w = Workload(CFG, 2048, 64)
    one = 2048 * 1024 * 2  # [1 x 2048 tokens x h=1024] bf16
    lay = Layout(dp=1, pp=4, micro_batch=1)
    assert pipeline_boundary_bytes(w, lay, 1, 3) == 6 * one  # received input + output, 3 in flight
    assert pipeline_boundary_bytes(w, lay, 0, 4) == 4 * one  # stage 0's inputs are token ids
    assert pipeline_boundary_bytes(w, lay, 3, 1) == 1 * one  # the last stage's output is the loss
    assert pipeline_boundary_bytes(w, lay.with_(recompute="full"), 1, 3) == 3 * one  # input = checkpoint's
    assert pipeline_boundary_bytes(w, lay.with_recipe(pp_outputs="freed"), 1, 3) == 3 * one  # Megatron
    # a fused norm saves its input, which is the received tensor itself: counted once, with the layer
    assert pipeline_boundary_bytes(w, lay, 1, 3, norm="fused") == 3 * one
    assert pipeline_boundary_bytes(w, Layout(dp=1, tp=2, sp=True, pp=4), 1, 3) == 6 * one / 2
    assert pipeline_boundary_bytes(w, Layout(dp=4), 0, 1) == 0.0


def test_torch_pipelining_keeps_a_receive_buffer_per_micro_batch():
    """torch.distributed.pipelining allocates an activation buffer per micro-batch on every non-first
    stage and a gradient buffer per micro-batch on every non-last stage, and keeps them
    (research/torch_pp_memory.py measures it); ours holds the next activation and gradient only."""
    from pentatron.plan.memory import pipeline_receive_bytes

    w = Workload(CFG, 2048, 64)
    one = 2048 * 1024 * 2  # [1 x 2048 tokens x h=1024] bf16
    ours = Layout(dp=1, pp=4, micro_batch=1)
    torch_pp = ours.with_recipe(pp_buffers="per_microbatch")
    assert pipeline_receive_bytes(w, ours, 2, 2, 4) == 2 * one
    # 1F1B, m=4: stage 0 receives no activations, 4 gradient buffers
    assert pipeline_receive_bytes(w, torch_pp, 0, 4, 4) == 4 * one
    # stage 2: 4 activation buffers, 2 of them the in-flight inputs counted with the layers; 4 gradient
    assert pipeline_receive_bytes(w, torch_pp, 2, 2, 4) == (4 - 2 + 4) * one
    # the last stage: activations only
    assert pipeline_receive_bytes(w, torch_pp, 3, 1, 4) == (4 - 1) * one
    # interleaved v=2: rank 0 holds stages 0 and 4 (4 receives activations; both send gradients back),
    # 8 chunk-micro-batches in flight, half of them on stage 4
    inter = torch_pp.with_(pp_schedule="interleaved", pp_virtual=2)
    assert pipeline_receive_bytes(w, inter, 0, 8, 4) == (4 - 8 / 2 + 2 * 4) * one
    # rank 3 holds stages 3 and 7 (both receive; 7 is the last): 5 in flight
    assert pipeline_receive_bytes(w, inter, 3, 5, 4) == (2 * 4 - 5 + 4) * one
    # sequence-parallel boundaries are 1/tp of the hidden state; no pipeline, no buffers
    assert pipeline_receive_bytes(w, torch_pp.with_(tp=2, sp=True), 3, 1, 4) == (4 - 1) * one / 2
    assert pipeline_receive_bytes(w, Layout(dp=4, recipe=Recipe(pp_buffers="per_microbatch")), 0, 1, 1) == 0.0
    # the planner evaluates it; training cannot run it
    assert problems(w, torch_pp, H100, 4) == []
    assert any("pp_buffers" in x for x in problems(w, ours.with_recipe(pp_buffers="per_stage"), H100, 4))
    assert any("pp_buffers='per_microbatch'" in x for x in trainable_problems(w, torch_pp, 4))
    w4 = Workload(CFG, 2048, 4)  # 4 micro-batches: stage 2 of 1F1B holds 2 in flight
    assert (memory_for_rank(w4, torch_pp, H100, 2).comm_buffers
            - memory_for_rank(w4, ours, H100, 2).comm_buffers == (6 - 2) * one)


def test_tp_overlap_hides_each_sp_collective_behind_its_gemm_but_one_chunk():
    w = Workload(CFG, 2048, 64)
    lay = Layout(dp=2, tp=4, sp=True, micro_batch=1)
    ov = lay.with_recipe(tp_overlap=True)
    lc = layer_comm(w, lay, H100, False)
    g = group_of(lay, "tp", H100)
    act = 2048 * 1024 * 2
    ag, rs = collective_time(H100, "all_gather", act, g), collective_time(H100, "reduce_scatter", act, g)
    assert (lc.sp_all_gather, lc.sp_reduce_scatter) == (ag, rs) and lc.tp_fwd == 2 * (ag + rs)
    lin = dense_linears(w, lay, H100)
    qkv, proj, up, down = lin.qkv, lin.o, lin.up, lin.down
    fwd = max(ag / 4, ag - qkv.f) + max(rs / 4, rs - proj.f) + max(ag / 4, ag - up.f) + max(rs / 4, rs - down.f)
    bwd = (max(ag / 4, ag - proj.b - proj.w) + max(rs / 4, rs - qkv.b - qkv.w)
           + max(ag / 4, ag - down.b - down.w) + max(rs / 4, rs - up.b - up.w))
    (ef, eb), (hf, hb) = tp_overlap_split(lc, 4, qkv, proj, up, down)
    assert (ef, eb) == (fwd, bwd) and hf == 2 * (ag + rs) - fwd and hb == 2 * (ag + rs) - bwd
    plain, over = layer_phase(w, lay, H100, 0), layer_phase(w, ov, H100, 0)
    assert abs((plain.f - over.f) - (lc.tp_fwd - fwd)) < 1e-15 and abs((plain.b - over.b) - (lc.tp_bwd - bwd)) < 1e-15
    # the step reports the dense layers' hidden share as contention, not as exposed tp
    st0, st1 = step_time(w, lay, H100), step_time(w, ov, H100)
    m, layers = 32, 8
    assert abs((st0.exposed_by_dim["tp"] - st1.exposed_by_dim["tp"]) - m * layers * (hf + hb)) < 1e-9
    assert st1.contention > st0.contention
    assert any("needs tp > 1 with sp" in x for x in problems(w, dataclasses.replace(ov, sp=False), H100, 8))
    assert any("tp_overlap" in x for x in trainable_problems(w, ov, 8))


def test_nanotron_zero1_reduces_all_gradients_after_the_backward_and_gathers_blocking():
    w = Workload(CFG, 2048, 64)
    ours = Layout(dp=8, zero=1)
    nano = ours.with_recipe(dp_overlap=False, zero1_reduce="all_reduce")
    colls = {c.where: c for c in step_collectives(w, nano, H100, 1e8, 0.0, 8, 0, first=True, last=True)}
    grads, params = colls["gradients"], colls["updated parameters"]
    assert grads.op == "all_reduce" and grads.payload == 4e8 and params.op == "all_gather" and params.payload == 2e8
    g = group_of(nano, "dp", H100)
    assert grads.time == collective_time(H100, "all_reduce", 4e8, g)
    st_ours, st_nano = step_time(w, ours, H100), step_time(w, nano, H100)
    # ours hides the reduce-scatter behind the last backward and the gather behind the next forward;
    # nanotron's ZeRO-1 waits for both, the all-reduce twice the reduce-scatter's bytes
    dp = [c for c in st_nano.collectives if c.dim == "dp_cp" and c.where != STEP_SCALARS_WHERE]
    assert {c.op for c in dp} == {"all_reduce", "all_gather"}
    assert st_nano.dp_exposed == sum(c.time_per_step for c in dp)
    assert st_nano.dp_exposed > st_ours.dp_exposed
    assert any("dp_overlap" in x for x in trainable_problems(w, nano, 8))
    assert any("zero1_reduce='all_reduce'" in x for x in trainable_problems(w, nano, 8))
    copies = nano.with_recipe(zero1_gather="copies")  # memory only: the same collectives
    assert step_time(w, copies, H100).step == st_nano.step
    assert not problems(w, copies, H100, 8)
    assert any("zero1_gather='copies'" in x for x in trainable_problems(w, copies, 8))
    assert any("zero1_gather must be" in x for x in problems(w, nano.with_recipe(zero1_gather="x"), H100, 8))
    assert any("dp_overlap=false is modelled for ZeRO 0-2" in x and "zero3_fetch='per_param_sync'" in x
               for x in problems(w, dataclasses.replace(nano, zero=3), H100, 8))
    # DeepSpeed 0.3-0.5's ZeRO-3 overlaps nothing either: priced by zero3_fetch, so the pair is accepted
    assert not problems(w, dataclasses.replace(nano, zero=3).with_recipe(zero3_fetch="per_param_sync"), H100, 8)


def test_blocking_pipeline_sends_hold_the_sender():
    w = Workload(CFG, 2048, 64)
    lay = Layout(dp=2, pp=4, micro_batch=1)
    ds = lay.with_recipe(pp_p2p="blocking")
    H100 = uncalibrated(H100_)  # our step's measured calibration scales ours, not theirs
    hop = pp_hop_time(w, lay, H100)
    assert hop > 0
    ours, theirs = stage_phases(w, lay, H100), stage_phases(w, ds, H100)
    for s, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        # each stage but the last sends its activations forward, each but the first its gradients back
        assert b.f == a.f + (hop if s < 3 else 0.0) and b.b == a.b + (hop if s > 0 else 0.0) and b.w == a.w
    assert step_time(w, ds, H100).step > step_time(w, lay, H100).step
    assert any("pp_p2p='blocking'" in x for x in trainable_problems(w, ds, 8))
    assert any("pp_p2p must be" in x for x in problems(w, ds.with_recipe(pp_p2p="x"), H100, 8))


def test_scatter_gather_sends_a_tp_slice_and_regathers_it_inside_the_node():
    w = Workload(CFG, 2048, 64)
    lay = Layout(dp=2, tp=4, sp=False, pp=2, micro_batch=1)  # 16 ranks: pp neighbours on different nodes
    meg = lay.with_recipe(pp_scatter_gather=True)
    act = 2048 * 1024 * 2
    assert group_of(lay, "pp", H100).crosses_nodes
    assert pp_hop_time(w, lay, H100) == p2p_time(H100, act, True)
    regather = collective_time(H100, "all_gather", act, group_of(lay, "tp", H100))
    assert pp_hop_time(w, meg, H100) == p2p_time(H100, act / 4, True) + regather
    assert pp_hop_time(w, meg, H100) < pp_hop_time(w, lay, H100)
    # under SP the stage output is already a sequence shard: nothing changes
    sp = dataclasses.replace(lay, sp=True)
    assert pp_hop_time(w, sp.with_recipe(pp_scatter_gather=True), H100) == pp_hop_time(w, sp, H100)
    assert any("pp_scatter_gather" in x for x in trainable_problems(w, meg, 16))


def test_torch_allgather_ring_attention():
    from pentatron.plan.comm import cp_layer_cost
    from pentatron.plan.context import comm_buffer_bytes
    from pentatron.plan.timing import attention_times

    cfg = ModelConfig(vocab_size=32000, hidden_size=1024, n_layers=8, n_heads=16, n_kv_heads=4,
                      ffn_hidden_size=4096, max_seq_len=65536)
    w = Workload(cfg, 65536, 8)
    lay = Layout(dp=2, cp=4, micro_batch=1)
    tt = lay.with_recipe(cp_rotate="allgather", cp_kv_heads="q")
    g = group_of(tt, "cp_ring", H100)
    local = 2 * 16384 * 16 * 64  # K and V of the rank's 16384 tokens, expanded to the 16 query heads
    gather = collective_time(H100, "all_gather", local * 4 * 2, g)
    dkv = p2p_time(H100, local * 4, g.crosses_nodes)  # the fp32 dK/dV accumulator
    attn_f, attn_b = attention_times(w, tt, H100)
    c = cp_layer_cost(w, tt, H100, attn_f, attn_b)
    assert c.fwd_exposed == max(0.0, gather - attn_f / 4)
    assert c.bwd_exposed == max(0.0, gather - attn_b / 4) + 3 * max(0.0, dkv - attn_b / 4) + dkv
    assert c.fwd_hidden + c.fwd_exposed == gather and c.bwd_hidden + c.bwd_exposed == gather + 4 * dkv
    # the p2p ring sends the 4 kv heads block by block instead
    assert cp_layer_cost(w, lay, H100, attn_f, attn_b).bwd_exposed < c.bwd_exposed
    # transient buffers: the gathered K/V of the 4 ranks and the fp32 dK/dV sent and received
    assert comm_buffer_bytes(16384, 16 * 64, 4, 64, 4, "ring", 1, 2, "allgather", "q") == 4 * local * 2 + 2 * local * 4
    assert any("cp_rotate='allgather'" in x for x in trainable_problems(w, tt, 8))
    bad = dataclasses.replace(tt, cp_mode="ulysses")
    assert any("needs cp_mode='ring'" in x for x in problems(w, bad, H100, 8))


def test_torch_interleaved_warmup_keeps_one_loss_on_the_last_rank():
    """pp4, v2, 4 micro-batches (m == pp): Megatron runs all 8 forwards first on every rank, so the last
    rank keeps 4 losses; torch's ScheduleInterleaved1F1B warms the last rank up with (v-1)pp = 4
    forwards and keeps one loss, with 5 chunks in flight."""
    w = Workload(CFG, 2048, 4)
    lay = Layout(dp=1, pp=4, pp_schedule="interleaved", pp_virtual=2, micro_batch=1)
    counted = lay.with_recipe(pp_all_warmup=False)
    mega, torch_ = memory_for_rank(w, lay, H100, 3), memory_for_rank(w, counted, H100, 3)
    assert (mega.in_flight, torch_.in_flight) == (8, 5)
    saved, _ = stage_extras(CFG, 2048, first=False, last=True, cross_entropy=lay.recipe.cross_entropy)
    assert mega.logits_loss - torch_.logits_loss == 3 * saved
    assert memory_for_rank(w, counted, H100, 0).in_flight == 8  # rank 0: min(4 + 6 + 1, 8)
    assert any("pp_all_warmup" in x for x in trainable_problems(w, counted, 4))
    assert problems(w, counted, H100, 4) == []


def test_fsdp2_keeps_only_the_fp32_parameter_shard():
    """ZeRO-3 as FSDP2 stores it with a bf16 param_dtype: the fp32 shard is the parameter and the bf16
    copy exists only while gathered, 2 bytes per parameter and rank fewer than ours (bf16 shard + fp32
    master). Without ZeRO-3 the bf16 parameters are whole and needed; in fp32 there is no second copy."""
    from pentatron.plan.memory import rank_params

    w = Workload(CFG, 2048, 64)
    ours = Layout(dp=8, zero=3, micro_batch=8)
    fsdp2 = ours.with_recipe(param_shard="fp32")
    a, b = memory_for_rank(w, ours, H100, 0), memory_for_rank(w, fsdp2, H100, 0)
    assert a.parameters == rank_params(w, ours, 0).dense * 2 / 8 and b.parameters == 0.0
    assert (a.gradients, a.master_weights, a.optimizer) == (b.gradients, b.master_weights, b.optimizer)
    assert any("param_shard" in x for x in trainable_problems(w, fsdp2, 8)) and problems(w, fsdp2, H100, 8) == []
    for other in (dataclasses.replace(ours, zero=1), dataclasses.replace(ours, precision="fp32")):
        assert (memory_for_rank(w, other.with_recipe(param_shard="fp32"), H100, 0).parameters
                == memory_for_rank(w, other, H100, 0).parameters)
    assert any("param_shard must be" in x for x in problems(w, ours.with_recipe(param_shard="bf16"), H100, 8))
