"""Terms a `pentatron bench` CPU profile adds, measured as a training step runs its kernels (issue 10,
item 5): attention by (sequence, head dim), the LM head's GEMMs, the in-step elementwise curve, eager
gradient accumulation and the dense embedding gradient, the optimizer per parameter element, pipeline
p2p by ping-pong.
Each against a hand-computed case on the debug model (4 layers, h 128, 4 heads / 2 kv of 32, ffn 256,
vocab 4096, tied: 1,115,264 parameters)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pentatron.hardware.catalogue import get_gpu, load_hardware_toml, with_profile
from pentatron.hardware.kernel_tables import AttentionGrid, attention_rate
from pentatron.models.registry import get_model_config
from pentatron.plan.comm import p2p_time
from pentatron.plan.layout import Layout, Workload
from pentatron.plan.recipes import Recipe
from pentatron.plan.timing import (
    attention_times,
    embed_phase,
    grad_accumulation,
    layer_local_params,
    layer_phase,
    step_time,
)

H100 = get_gpu("h100")
W = Workload(get_model_config("debug"), 64, 8)
FP32 = Layout(dp=1, micro_batch=4, precision="fp32")
# seq (64, 256) x head dim (32, 128), seq-major
GRID = AttentionGrid(seq=(64.0, 256.0), head_dim=(32.0, 128.0), fwd=(10e9, 40e9, 20e9, 80e9),
                     bwd=(5e9, 20e9, 10e9, 40e9))


def test_attention_rate_is_log_linear_between_points_and_clamped_outside():
    assert attention_rate(GRID, 64, 32) == pytest.approx((10e9, 5e9))
    assert attention_rate(GRID, 256, 128) == pytest.approx((80e9, 40e9))
    f, b = attention_rate(GRID, 128, 32)  # halfway in log(seq): the geometric mean
    assert f == pytest.approx(math.sqrt(10e9 * 20e9)) and b == pytest.approx(math.sqrt(5e9 * 10e9))
    f, _ = attention_rate(GRID, 128, 64)  # halfway on both axes: the four corners' geometric mean
    assert f == pytest.approx((10e9 * 40e9 * 20e9 * 80e9) ** 0.25)
    assert attention_rate(GRID, 16, 8) == pytest.approx((10e9, 5e9))
    assert attention_rate(GRID, 4096, 512) == pytest.approx((80e9, 40e9))


def test_attention_time_reads_the_measured_grid_in_fp32():
    cpu = with_profile(H100, attention_fp32=GRID)
    flops = 4 * 4 * 32 * 4 * 64 * 65 / 2  # 4 heads x head dim 32 x micro-batch 4 x 64·65/2 causal pairs
    f, b = attention_times(W, FP32, cpu)
    assert f == pytest.approx(flops / 10e9) and b == pytest.approx(flops / 5e9)
    f2, b2 = attention_times(W, dataclasses.replace(FP32, tp=2), cpu)  # half the heads per rank
    assert f2 == pytest.approx(flops / 2 / 10e9) and b2 == pytest.approx(flops / 2 / 5e9)
    bf16 = Layout(dp=1, micro_batch=4)  # not the kernel bench measured: the GPU efficiency path
    assert attention_times(W, bf16, cpu) == attention_times(W, bf16, H100)


def test_eager_elementwise_ops_run_at_the_in_step_rate():
    # eager fp32 bytes per token of one layer's forward: 2 RMSNorms 2·(28 + 16)·128, RoPE on q and k
    # 10·4·(128 + 64), 2 residual adds 2·3·4·128, SwiGLU 5·4·256 = 27,136; x 256 tokens
    elem = 256 * 27136
    slow = with_profile(H100, stream_bw=((1.0, 10e9),))
    fast = with_profile(H100, stream_bw=((1.0, 20e9),))
    a, b = layer_phase(W, FP32, slow, 0, "eager"), layer_phase(W, FP32, fast, 0, "eager")
    assert a.f - b.f == pytest.approx(elem / 10e9 - elem / 20e9)
    assert a.b - b.b == pytest.approx(2 * (elem / 10e9 - elem / 20e9))  # backward: twice the traffic


def test_eager_gradient_accumulation_into_the_fp32_buffer():
    cpu = with_profile(H100, stream_bw=((1.0, 10e9),))
    # q, o 128x128; k, v 64x128; gate, up, down 128x256; two norms of 128
    assert layer_local_params(W, FP32, 0) == 2 * 16384 + 2 * 8192 + 3 * 32768 + 256 == 147712
    assert layer_local_params(W, dataclasses.replace(FP32, tp=2), 0) == 147456 / 2 + 256
    # read the fresh fp32 gradient (4), read and write main_grad (8), per micro-batch
    assert grad_accumulation(cpu, FP32, 147712, "eager") == pytest.approx(147712 * 12 / 10e9)
    assert grad_accumulation(cpu, Layout(dp=1, micro_batch=4), 147712, "eager") == pytest.approx(147712 * 10 / 10e9)
    # fused kernels everywhere (Megatron's wgrad accumulation fusion) take it away; ours compiles the blocks only,
    # and the accumulation (a gradient hook, outside them) stays
    every = FP32.with_recipe(fused_scope="everywhere")
    assert grad_accumulation(cpu, every, 147712, "fused") == 0.0
    assert grad_accumulation(cpu, FP32, 147712, "fused") == grad_accumulation(cpu, FP32, 147712, "eager")
    eager, fused = layer_phase(W, every, cpu, 0, "eager"), layer_phase(W, every, cpu, 0, "fused")
    assert eager.w - fused.w == pytest.approx(147712 * 12 / 10e9)
    assert layer_phase(W, FP32, cpu, 0, "fused").w == eager.w


def test_eager_dense_embedding_gradient():
    cpu = with_profile(H100, stream_bw=((1.0, 10e9),))
    table = 4096 * 128
    every = FP32.with_recipe(fused_scope="everywhere")  # fused embedding kernels (ours: eager, outside the blocks)
    assert embed_phase(W, FP32, cpu, "fused") == embed_phase(W, FP32, cpu, "eager")
    extra = embed_phase(W, every, cpu, "eager").w - embed_phase(W, every, cpu, "fused").w
    # zero-filled [4096, 128] fp32 gradient (4 B), the tied head's gradient summed in (read 2, write 1:
    # 12 B), then accumulated into main_grad (12 B)
    assert extra == pytest.approx(table * (4 + 12 + 12) / 10e9)
    pp2 = dataclasses.replace(every, pp=2, micro_batch=1)  # the head's copy lives on the other stage
    extra = embed_phase(W, pp2, cpu, "eager").w - embed_phase(W, pp2, cpu, "fused").w
    assert extra == pytest.approx(table * (4 + 12) / 10e9)


def test_optimizer_per_parameter_element_when_measured():
    cpu = with_profile(H100, optimizer_per_element_s=4e-9, host_optimizer_per_tensor_s=1e-4)
    # every parameter of the debug model on one rank, and 9 tensors per layer + embedding + final norm
    assert step_time(W, FP32, cpu).optimizer == pytest.approx(1_115_264 * 4e-9 + 38 * 1e-4)


def test_pipeline_p2p_reads_the_measured_ping_pong():
    cpu = with_profile(H100, busbw={"p2p": ((1024.0, 1e8), (1048576.0, 1e9))})
    assert p2p_time(cpu, 1024, False) == pytest.approx(1024 / 1e8)
    assert p2p_time(cpu, 32768, False) == pytest.approx(32768 / 0.55e9)  # halfway in log(size)
    assert p2p_time(cpu, 1024, True) == p2p_time(H100, 1024, True)  # across nodes: the link model


def test_cpu_step_terms_round_trip_through_a_profile(tmp_path):
    head = ('[gpu]\nname = "c"\npeak_tflops = { fp32 = 0.1 }\nhbm_gib = 8\nhbm_bandwidth_gb_s = 3\n'
            'intra_node_bandwidth_gb_s = 1\ninter_node_bandwidth_gb_s = 1\noptimizer_ns_per_element = 4.5\n'
            'stream_bw = { bytes = [131072, 16384], gb_s = [15, 5] }\n')
    p = tmp_path / "cpu.toml"
    p.write_text(head + '[gpu.attention_fp32]\nseq = [64, 256]\nhead_dim = [32, 128]\n'
                 'fwd_gflop_s = [10, 40, 20, 80]\nbwd_gflop_s = [5, 20, 10, 40]\n')
    prof = load_hardware_toml(p)
    assert prof.profile.optimizer_per_element_s == pytest.approx(4.5e-9)
    assert prof.profile.stream_bw == ((16384.0, 5e9), (131072.0, 15e9))
    assert prof.profile.attention_fp32 == GRID
    p.write_text(head + '[gpu.attention_fp32]\nseq = [64, 256]\nhead_dim = [32, 128]\n'
                 'fwd_gflop_s = [10, 40, 20]\nbwd_gflop_s = [5, 20, 10, 40]\n')
    with pytest.raises(ValueError, match="attention_fp32 needs 4 positive rates"):
        load_hardware_toml(p)


# an LM head's GEMMs (forward, dX, dW FLOP/s) at 2^24 and 2^28 FLOPs per call, against a flat square curve
HEAD = ((2.0**24, 3e10, 4e10, 3.5e10), (2.0**28, 6e10, 8e10, 7e10))
SQUARE = ((1e3, 1e11), (1e12, 1e11))


def test_the_lm_head_gemms_read_their_own_measured_curve():
    from pentatron.hardware.catalogue import hardware_from_dict
    from pentatron.plan.timing import head_phase

    cpu = with_profile(H100, matmul_fp32=SQUARE)
    lm = with_profile(cpu, head_fp32=HEAD)
    lay = Layout(dp=1, micro_batch=1, precision="fp32")
    # 64 tokens x 4096 x 128 x 2 = 2^26 FLOPs, half way (in log) from 2^24 to 2^28: the rates' midpoints;
    # the rest of the phase (norm, loss, host) is unchanged
    f = 2.0**26
    base, got = head_phase(W, lay, cpu, "eager"), head_phase(W, lay, lm, "eager")
    assert got.f - base.f == pytest.approx(f / 4.5e10 - f / 1e11)
    # backward: dX (our chunked loss keeps the 64 tokens' one chunk: no forward GEMM replays)
    assert got.b - base.b == pytest.approx(f / 6e10 - f / 1e11)
    assert got.w - base.w == pytest.approx(f / 5.25e10 - f / 1e11)
    # tp 2: each rank's 2048-entry slice, 2^25 FLOPs, a quarter of the way: 3e10 + 3e10 / 4
    tp2 = Layout(dp=1, tp=2, micro_batch=1, precision="fp32")
    assert head_phase(W, tp2, lm, "eager").f - head_phase(W, tp2, cpu, "eager").f == pytest.approx(
        2**25 / 3.75e10 - 2**25 / 1e11)
    # 16-bit runs (GPU profiles) have no such curve: the linear model as before
    bf16 = Layout(dp=1, micro_batch=1)
    assert head_phase(W, bf16, lm, "eager") == head_phase(W, bf16, cpu, "eager")
    # the profile's table, in GFLOP/s, sorted by FLOPs; a bad one is named
    g = hardware_from_dict({"name": "x", "base": "h100", "lm_head_fp32": {
        "flops": [2**28, 2**24], "fwd_gflop_s": [60, 30], "dx_gflop_s": [80, 40], "dw_gflop_s": [70, 35]}})
    assert [row == pytest.approx(want) for row, want in zip(g.profile.head_fp32, HEAD, strict=True)] == [True, True]
    with pytest.raises(ValueError, match="lm_head_fp32 needs"):
        hardware_from_dict({"name": "x", "base": "h100", "lm_head_fp32": {
            "flops": [2**24], "fwd_gflop_s": [30], "dx_gflop_s": [40], "dw_gflop_s": [0]}})


def test_ranks_sharing_a_cpu_node_compute_slower_by_the_measured_factor():
    cpu = with_profile(dataclasses.replace(H100, gpus_per_node=4), matmul_fp32=((1e6, 1e10),),
                       stream_bw=((1.0, 12e9),), attention_fp32=GRID, head_fp32=HEAD,
                       host_layer_s=(1e-3, 2e-3), optimizer_per_element_s=1e-9,
                       node_slowdown={"matmul": 4.0, "stream": 7.0, "host": 2.5})
    assert cpu.sharing(1) is cpu and H100.sharing(8) is H100  # alone, or no measurement: unchanged
    full = cpu.sharing(4)  # every process of the node busy: the measured factors
    assert full.profile.matmul_fp32 == ((1e6, 1e10 / 4),) and full.peak_flops["bf16"] == H100.peak_flops["bf16"] / 4
    assert full.profile.stream_bw == ((1.0, 12e9 / 7),) and full.profile.optimizer_per_element_s == pytest.approx(7e-9)
    assert full.profile.attention_fp32.fwd[0] == pytest.approx(10e9 / 4)
    assert full.profile.head_fp32[0] == pytest.approx((2.0**24, 3e10 / 4, 4e10 / 4, 3.5e10 / 4))
    assert full.profile.host_layer_s == pytest.approx((2.5e-3, 5e-3)) and full.profile.node_slowdown == {}
    half = cpu.sharing(2)  # 1 of the 3 other processes busy: a third of each excess
    assert half.profile.matmul_fp32 == ((1e6, 1e10 / 2),) and half.profile.stream_bw == ((1.0, 12e9 / 3),)
    assert half.profile.host_layer_s == pytest.approx((1.5e-3, 3e-3))
    lay = Layout(dp=2, micro_batch=4, precision="fp32")  # step_time applies it for the layout's ranks
    assert step_time(W, lay, cpu).optimizer == pytest.approx(step_time(W, lay, half).optimizer)


def test_vocab_parallel_loss_pays_its_two_small_all_reduces_in_forward():
    from pentatron.plan.comm import LOSS_WHERE, loss_all_reduces, step_collectives
    from pentatron.plan.timing import head_phase
    lay = Layout(dp=1, tp=2, micro_batch=4, precision="fp32")
    assert loss_all_reduces(256) == (1024, 2048)  # per token: the fp32 max, then two fp32 sums
    # measured curves at a constant bus bandwidth B: a 2-rank all-reduce of p bytes takes p / B
    slow, fast = (with_profile(H100, busbw={"all_reduce": ((1.0, b),)}) for b in (1e8, 1e9))
    # the head's forward communicates nothing else (its f operator all-reduces in backward only)
    fwd = [head_phase(W, lay, g, "eager").f for g in (slow, fast)]
    assert fwd[0] - fwd[1] == pytest.approx(3072 / 1e8 - 3072 / 1e9)
    colls = step_collectives(W, lay, slow, 0, 0, 4, 0, first=True, last=True)
    (loss,) = [c for c in colls if c.where == LOSS_WHERE]
    assert loss.count == 2 * 2 and loss.payload == 1536  # 2 micro-batches x 2 calls, mean payload


def test_torch_loss_parallel_pays_three_all_reduces_and_its_passes_over_the_fp32_logits():
    """torch's loss_parallel reduces the max, the sum of exponentials and the target's log-probability
    apart (4 bytes per token each), and moves a + 36 bytes per logit each way (timing.LOSS_PARALLEL_BYTES:
    .float() 4, amax 4, shift 8, exp 8, sum 4, log-softmax 8; backward zeros 4, exp 8, add 12, scale 8,
    cast 4)."""
    from pentatron.plan.comm import loss_all_reduces
    from pentatron.plan.timing import LOSS_PARALLEL_BYTES, head_phase
    assert loss_all_reduces(256, "loss_parallel") == (1024, 1024, 1024)
    assert LOSS_PARALLEL_BYTES == 4 + 4 + 8 + 8 + 4 + 8 == 4 + 8 + 12 + 8 + 4
    # no communication at all (busbw infinite in effect) isolates the loss's memory-bound passes
    gpu = with_profile(H100, busbw={"all_reduce": ((1.0, 1e30),)}, stream_bw=((1.0, 1e9),))
    eager, par = (Layout(dp=1, tp=2, micro_batch=4, precision="fp32", recipe=Recipe(cross_entropy=ce))
                  for ce in ("eager", "loss_parallel"))
    he, hp = head_phase(W, eager, gpu, "eager"), head_phase(W, par, gpu, "eager")
    entries = 4 * 64 * W.cfg.vocab_size / 2  # tokens x local vocabulary
    assert hp.f - he.f == pytest.approx(entries * ((4 + 36) - (4 + 4 + 4 + 4)) / 1e9, rel=1e-6)
    assert hp.b - he.b == pytest.approx(entries * ((4 + 36) - 1.5 * (4 + 4 + 4 + 4)) / 1e9, rel=1e-6)
