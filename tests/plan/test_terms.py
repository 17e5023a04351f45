"""Hand-computed cases for the planner's modelling terms (issue 10): attention kernel choice, the
unfused softmax, FP8 casts, tree all-reduce latency, NICs shared by a node, ZeRO-3 per-layer gathers
and their exposure, torchtitan's recompute modes, whole-layer full recompute, fused-norm memory, fp16
loss scaling and bf16 gradients."""

from __future__ import annotations

import dataclasses

import pytest

from pentatron.hardware.catalogue import get_gpu, hardware_from_dict
from pentatron.hardware.fp8_rowwise import rowwise_seconds
from pentatron.models.config import ModelConfig
from pentatron.models.registry import get_model_config
from pentatron.plan.comm import (
    Collective,
    Group,
    Traffic,
    bus_bandwidth,
    collective_time,
    dp_collectives,
    step_collectives,
)
from pentatron.plan.flops import flop_breakdown, recompute_flops_per_token
from pentatron.plan.layout import Layout, Workload
from pentatron.plan.memory import llama_layer_activation_bytes, memory_per_gpu
from pentatron.plan.recipes import Recipe
from pentatron.plan.timing import Phase, _linear, attention_times, gemm_time, layer_phase, step_time, zero3_exposed

H100, A100 = get_gpu("h100"), get_gpu("a100-80gb")
DEBUG = get_model_config("debug")  # h 128, 4 heads (2 kv) of 32, ffn 256
SMALL = ModelConfig(vocab_size=4096, hidden_size=512, n_layers=2, n_heads=8, n_kv_heads=8, ffn_hidden_size=2048,
                    max_seq_len=4096)


def test_attention_kernel_choice():
    w = Workload(SMALL, 1024, 8)
    flops = 4 * 8 * 64 * 1024 * 1025 / 2  # 4 h s (s+1)/2: QK^T and PV over the causal half
    f2, b2 = attention_times(w, Layout(attention="flash2"), H100)
    f3, b3 = attention_times(w, Layout(attention="flash3"), H100)
    # Hopper's FlashAttention-2 as measured on an H200 by sequence length, clamped below its first point (2048)
    assert f2 == pytest.approx(flops / (989.4e12 * 0.298)) and b2 == pytest.approx(2.5 * flops / (989.4e12 * 0.204))
    assert f3 == pytest.approx(flops / (989.4e12 * 0.75)) and b3 == pytest.approx(2.5 * flops / (989.4e12 * 0.60))
    # FlashAttention-3 needs Hopper: on an A100 the same request runs FlashAttention-2
    assert attention_times(w, Layout(attention="flash3"), A100) == attention_times(w, Layout(attention="flash2"), A100)
    # "sdpa" (ours, the default) is what torch SDPA runs: cuDNN on Hopper, FlashAttention-2 on an A100
    assert attention_times(w, Layout(), H100) == attention_times(w, Layout(attention="cudnn"), H100)
    assert attention_times(w, Layout(), A100) == attention_times(w, Layout(attention="flash2"), A100)


def test_measured_attention_is_read_by_sequence_length():
    assert H100.attention("flash2", 4096) == pytest.approx((0.313, 0.237))
    assert H100.attention("cudnn", 8192) == pytest.approx((0.616, 0.460))
    assert H100.attention("cudnn", 131072) == pytest.approx((0.616, 0.460))  # clamped above the last point
    mid = H100.attention("flash2", (2048 * 4096) ** 0.5)  # halfway on the log axis: the geometric mean
    assert mid == pytest.approx(((0.298 * 0.313) ** 0.5, (0.204 * 0.237) ** 0.5))
    assert A100.attention("flash2", 4096) == (0.73, 0.63)  # Dao 2023's figures: no curve measured there
    # a hardware file's own FlashAttention-2 fractions replace the measured curve
    own = hardware_from_dict({"name": "h100-own", "base": "h100-sxm", "attention_efficiency": [0.5, 0.4]})
    assert own.attention("flash2", 4096) == (0.5, 0.4) and own.attention("cudnn", 4096) == H100.attention("cudnn", 4096)


def test_unfused_attention_pays_the_softmax_traffic():
    w = Workload(SMALL, 1024, 8)
    fwd, bwd = attention_times(w, Layout(attention="math"), H100)
    qk = 8 * gemm_time(H100, 1024, 1024, 64, 989.4e12, 2)
    pv = 8 * gemm_time(H100, 1024, 64, 1024, 989.4e12, 2)
    scores = 8 * 1024 * 1024  # heads x s x s, full square
    assert fwd - (qk + pv) == pytest.approx(scores * 2 * 2 / (3350e9 * 0.9))  # read scores, write probs
    assert bwd - 2 * (qk + pv) == pytest.approx(scores * 2 * 3 / (3350e9 * 0.9))


def test_fp8_linear_pays_its_casts():
    t, n = 4096, 4096
    bf16 = _linear(H100, t, n, n, 989.4e12, 2)
    fp8 = _linear(H100, t, n, n, 1978.9e12, 2, fp8="tensorwise")
    bw = 3350e9 * 0.9
    assert fp8.f == pytest.approx(gemm_time(H100, t, n, n, 1978.9e12, 1) + (t * n + n * n) * 6 / bw)
    assert fp8.b == pytest.approx(gemm_time(H100, t, n, n, 1978.9e12, 1) + t * n * 6 / bw)
    assert fp8.w == pytest.approx(gemm_time(H100, n, n, t, 1978.9e12, 1))
    assert bf16.total / fp8.total < 2  # twice the peak is not twice the speed


def test_rowwise_table_reads_the_published_points_and_interpolates_in_log_space():
    """torchao's H100 row-wise table (docs/static/fp8-rowwise-perf.png): grid points as printed, halfway
    (in log shape) between two points the geometric mean, and clamped beyond the grid."""
    g = H100.fp8_rowwise
    assert g.at(1024, 1024, 1024) == pytest.approx(0.42)
    assert g.at(8192, 4096, 8192) == pytest.approx(1.13)  # M 8192, K 4096, N 8192
    assert g.at(32768, 32768, 32768) == pytest.approx(1.52)
    assert g.at(8192, 4096, 8192 * 2 ** 0.5) == pytest.approx((1.13 * 1.17) ** 0.5)
    assert g.at(131072, 4096, 128) == pytest.approx(0.59)  # M beyond 32768 and N below 1024: the edges
    assert get_gpu("h200").fp8_rowwise is g and get_gpu("b200").fp8_rowwise is None


def test_rowwise_linear_takes_the_block_s_layernorm_and_sigmoid_back_out():
    """At M, K, N = 8192, 4096, 1024 the block ran 1/0.52 slower in fp8 than bf16: the linear's share is
    (t_bf16 + t_ln_sig) / 0.52 - t_ln_sig, the LayerNorm + Sigmoid at 10 bytes per element of [M, K] and
    [M, N]; each phase keeps the bf16 linear's proportions. Where the table promises more than the
    tensorwise model can do, the tensorwise model is the floor."""
    m, k, n = 8192, 4096, 1024
    bf16 = _linear(H100, m, n, k, 989.4e12, 2)
    row = _linear(H100, m, n, k, 1978.9e12, 2, fp8="rowwise")
    ln_sig = 10 * m * (k + n) / (3350e9 * 0.9)
    want = (bf16.total + ln_sig) / 0.52 - ln_sig
    assert row.total == pytest.approx(want)
    assert row.f / row.total == pytest.approx(bf16.f / bf16.total)
    assert row.total > bf16.total  # slower than bf16 at this shape, as measured
    # M 32768, K 16384, N 32768 printed 1.73: 1 s of bf16 would be 0.578 s, under a 0.6 s tensorwise floor
    assert rowwise_seconds(H100.fp8_rowwise, 32768, 16384, 32768, 1.0, 0.0, 0.6) == 0.6
    assert rowwise_seconds(H100.fp8_rowwise, 32768, 16384, 32768, 1.0, 0.0, 0.5) == pytest.approx(1 / 1.73)


def test_small_all_reduce_across_nodes_uses_the_tree():
    g = Group("dp", 16, 1, 16)  # one rank per node on 16 nodes
    t = collective_time(H100, "all_reduce", 1024, g)
    # tree: 2 ceil(log2 16) inter-node hops of 6 us (the ring would pay 2 x 15 of them)
    wire = 2 * 15 * 1024 // 16
    assert t == pytest.approx(2 * 4 * 6e-6 + wire / (50e9 * 0.8))


def test_ranks_of_a_node_share_its_nics():
    four_nics = dataclasses.replace(A100, nics_per_node=4, inter_node_bandwidth=6.25e9)  # 4 x 12.5 GB/s
    g = Group("dp", 16, 2, 8)  # 2 ranks per node: each can drive its own NIC
    assert bus_bandwidth(four_nics, "all_gather", 1e9, g) == pytest.approx(2 * 12.5e9 * 0.8)
    g8 = Group("dp", 64, 8, 8)  # 8 ranks share 4 NICs
    assert bus_bandwidth(four_nics, "all_gather", 1e9, g8) == pytest.approx(4 * 12.5e9 * 0.8)


def test_zero3_gathers_and_reduces_layer_by_layer():
    lay = Layout(dp=64, zero=3)
    colls = dp_collectives(lay, H100, 1e9, "dp", m=2, a=2, layers=10)
    rs, ag = colls
    assert (rs.op, rs.payload, rs.count) == ("reduce_scatter", 4e9 / 10, 2 * 10)
    assert (ag.op, ag.payload, ag.count) == ("all_gather", 2e9 / 10, 2 * 2 * 10)
    assert ag.time == pytest.approx(collective_time(H100, "all_gather", 2e8, Group("dp", 64, 8, 8)))


def _coll(op: str, t: float) -> Collective:
    kind = Traffic.ZERO3_PARAMETERS if op == "all_gather" else Traffic.ZERO3_GRADIENTS
    return Collective("dp_cp", op, 1.0, 1.0, t, kind, 1.0)


@pytest.mark.parametrize(("tg", "trs", "expected"), [
    (0.05, 0.10, 2 * (0.05 + 0.10)),  # hidden except the first gather and the last reduce-scatter
    (0.30, 0.10, 2 * ((10 * 0.2 + 0.3) + (10 * 0.2 + 0.1))),  # gathers longer than a layer: exposed
])
def test_zero3_exposure(tg, trs, expected):
    ph = Phase(1.0, 0.5, 1.5)  # 10 layers: 0.1 s forward and 0.2 s backward each
    assert zero3_exposed(Layout(dp=8, zero=3), [_coll("all_gather", tg), _coll("reduce_scatter", trs)], ph, 10,
                         2, 9) == pytest.approx(expected)


def test_deepspeeds_early_zero3_waits_for_every_gather_and_copies_per_rank():
    """zero3_fetch="per_param_sync" (DeepSpeed's ZeRO-3 of 2021): one collective per parameter tensor, 9 per
    Llama layer, so a layer's latency is paid 9 times; each micro-batch gathers every layer twice (forward, and backward
    with its recompute), exposed, and each collective copies one kernel per rank of the 1,536 (3 us each); the
    reduce-scatters and their copies hide behind the layer's backward but for the last layer's."""
    lay = Layout(dp=1536, zero=3)
    ds = lay.with_recipe(zero3_fetch="per_param_sync")
    w = Workload(get_model_config("llama3-8b"), 4096, 1536)
    by_layer, by_tensor = (dp_collectives(x, H100, 8e9, "dp", m=1, a=2, layers=32 * (9 if x is ds else 1))
                           for x in (lay, ds))
    for c, d in zip(by_layer, by_tensor, strict=True):  # the same bytes in 9x the calls
        assert d.count == 9 * c.count and d.payload * d.count == pytest.approx(c.payload * c.count)
    gathers = [c.count for c in step_collectives(w, ds, H100, 8e9, 0, 32, 0, True, True) if c.op == "all_gather"]
    assert gathers == [2 * 32 * 9]
    ph = Phase(1.0, 0.5, 1.5)  # 10 layers: 0.1 s forward and 0.2 s backward each
    colls = [_coll("all_gather", 0.005), _coll("reduce_scatter", 0.01)]  # one tensor's
    copies = 1536 * 3e-6  # per collective
    gather, rs = 9 * (0.005 + copies), 9 * (0.01 + copies)
    per_mb = 2 * 10 * gather + 10 * max(0.0, rs - 0.2) + rs
    assert zero3_exposed(ds, colls, ph, 10, 2, 9) == pytest.approx(2 * per_mb)


def test_torchtitan_recompute_modes():
    # debug, bf16, one sequence of 64 tokens; the runtime formula gives 329,216 bytes for the plain layer
    full = llama_layer_activation_bytes(DEBUG, 64, 64).saved
    assert full == 329_216
    # op-level SAC: block input 2*128, the odd-numbered matmul outputs q, v, w1 (gate), w2 (down):
    # 2*(128+64+256+128), the attention output 2*128 and the logsumexp 4*4, per token
    assert llama_layer_activation_bytes(DEBUG, 64, 64, recompute="selective-op").saved == 64 * (256 + 1152 + 256 + 16)
    assert llama_layer_activation_bytes(DEBUG, 64, 64, recompute="full-alternate").saved == (329_216 + 64 * 256) / 2
    cfg, s = get_model_config("llama3-8b"), 4096
    fb = flop_breakdown(cfg, s)
    # k (4096 x 1024), o (4096 x 4096) and w3 (4096 x 14336) replay in each of the 32 layers: 36.5 % of the
    # layers' matmul forward, not half
    replay = 32 * 2 * 4096 * (1024 + 4096 + 14336)
    assert recompute_flops_per_token(cfg, s, "selective-op") == pytest.approx(replay)
    assert replay / fb.layers_matmul == pytest.approx(0.365, abs=1e-3)
    assert recompute_flops_per_token(cfg, s, "full-alternate") == pytest.approx((fb.layers_matmul + fb.attention) / 2)


def test_full_recompute_replays_the_whole_layer():
    w = Workload(get_model_config("llama3-8b"), 4096, 64)
    none = layer_phase(w, Layout(dp=8, tp=2, sp=True), H100, 0)
    full = layer_phase(w, Layout(dp=8, tp=2, sp=True, recompute="full"), H100, 0)
    assert full.b - none.b == pytest.approx(none.f)  # GEMMs, attention, elementwise and the TP collectives
    assert (full.f, full.w) == (none.f, none.w)


def test_fused_norms_keep_no_fp32_copy():
    eager = llama_layer_activation_bytes(DEBUG, 64, 64).saved
    fused = llama_layer_activation_bytes(DEBUG, 64, 64, norm="fused").saved
    assert eager - fused == 64 * 2 * 4 * 128 == 65_536


def test_fused_swiglu_keeps_gate_and_up_only():
    """Megatron-Core's SwiGLUFunction saves its input (gate, up) and recomputes silu(gate) in backward:
    one ffn-wide bf16 tensor per token less than eager SwiGLU's gate, up, silu(gate) and product."""
    eager = llama_layer_activation_bytes(DEBUG, 64, 64).saved
    fused = llama_layer_activation_bytes(DEBUG, 64, 64, swiglu="fused").saved
    assert eager - fused == 64 * 2 * 256 == 32_768
    tp2 = llama_layer_activation_bytes(DEBUG, 64, 64, tp=2).saved
    assert tp2 - llama_layer_activation_bytes(DEBUG, 64, 64, tp=2, swiglu="fused").saved == 64 * 2 * 128
    gelu = dataclasses.replace(DEBUG, mlp="gelu")
    assert (llama_layer_activation_bytes(gelu, 64, 64, swiglu="fused").saved
            == llama_layer_activation_bytes(gelu, 64, 64).saved)


def test_fp16_loss_scaling_and_bf16_gradients():
    w = Workload(get_model_config("llama3-8b"), 4096, 64)
    bf16 = step_time(w, Layout(dp=8), H100)
    fp16 = step_time(w, Layout(dp=8, precision="fp16"), H100)
    assert fp16.optimizer / bf16.optimizer == pytest.approx((34 + 4) / 34)
    m32 = memory_per_gpu(w, Layout(dp=8), H100)
    m16 = memory_per_gpu(w, Layout(dp=8, recipe=Recipe(grad_precision="bf16")), H100)
    assert m16.gradients == pytest.approx(m32.gradients / 2)
    g32 = dp_collectives(Layout(dp=8), H100, 1e9, "dp", 1, 2)[0]
    g16 = dp_collectives(Layout(dp=8, recipe=Recipe(grad_precision="bf16")), H100, 1e9, "dp", 1, 2)[0]
    assert (g32.payload, g16.payload) == (4e9, 2e9)
    # Megatron-LM --fp16 without --accumulate-allreduce-grads-in-fp32 reduces the fp16 .grad: the same 2 bytes
    fp16_grads = Layout(dp=8, precision="fp16", recipe=Recipe(grad_precision="fp16"))
    assert memory_per_gpu(w, fp16_grads, H100).gradients == pytest.approx(m16.gradients)
    assert dp_collectives(fp16_grads, H100, 1e9, "dp", 1, 2)[0].payload == 2e9


def test_zero3_with_pp_gathers_per_micro_batch_or_once_per_step():
    w = Workload(get_model_config("llama3-8b"), 4096, 64)
    per_mb = Layout(dp=8, pp=2, zero=3)
    per_step = per_mb.with_(zero3_gather="step")
    m, layers = per_mb.microbatches(w), 16  # 32 layers over 2 stages
    a = dp_collectives(per_mb, H100, 1e9, "dp", m, 2, layers)
    b = dp_collectives(per_step, H100, 1e9, "dp", m, 2, layers)
    assert [c.count for c in a] == [m * layers, 2 * m * layers] and [c.count for c in b] == [layers, layers]
    # keeping the stage gathered costs its full parameters (less this rank's shard) in memory
    extra = memory_per_gpu(w, per_step, H100).comm_buffers - memory_per_gpu(w, per_mb, H100).comm_buffers
    assert extra > 1e9
    assert step_time(w, per_step, H100).dp_exposed < step_time(w, per_mb, H100).dp_exposed


def test_an_moe_layers_expert_gemms_follow_where_the_experts_live(monkeypatch):
    """Ours (moe_tp="replicated", parallel/moe_tokens.py): every tp rank runs whole experts on its own tokens, the
    SP shard or, without SP, all of them (tp× one shard's expert work); Megatron-style sharded experts: every
    token on 1/tp of each expert's width."""
    from pentatron.plan import timing
    from pentatron.plan.recipes import MEGATRON

    w = Workload(get_model_config("debug-moe"), 64, 8)
    moe = w.moe_spec
    tokens, full = 4 * 64, moe.expert_ffn_hidden_size
    seen: list[tuple[float, float, float]] = []

    def spy(gpu, m, n_out, n_in, *rest):
        seen.append((m, n_out, n_in))
        return _linear(gpu, m, n_out, n_in, *rest)

    monkeypatch.setattr(timing, "_linear", spy)

    def expert_gemms(**kw) -> set[tuple[float, float]]:
        """(rows, width) of one MoE layer's routed-expert GEMMs (fewer rows than half the tokens: not the shared
        expert's, nor attention's)."""
        seen.clear()
        layer_phase(w, Layout(dp=1, tp=2, micro_batch=4, precision="bf16", **kw), H100, 1)
        h = w.cfg.hidden_size  # the other side of every expert GEMM
        return {(m, n if k == h else k) for m, n, k in seen if {n, k} & {full, full / 2} and m < tokens / 2}

    per_expert = tokens * moe.top_k / moe.num_experts
    assert expert_gemms(sp=False) == {(per_expert, full)}  # all tokens, whole experts
    assert expert_gemms(sp=True) == {(per_expert / 2, full)}  # the SP shard's tokens
    assert expert_gemms(sp=True, recipe=MEGATRON) == {(per_expert, full / 2)}  # sharded over tp
