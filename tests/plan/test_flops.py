from __future__ import annotations

import dataclasses

import pytest

from pentatron.models.registry import MODELS, get_model_config
from pentatron.plan.flops import (
    MoESpec,
    executed_phase_flops,
    flop_breakdown,
    hardware_flops_per_token,
    loss_recompute_flops_per_token,
    loss_replayed_tokens,
    matmul_params,
    model_flops_per_token,
    recompute_flops_per_token,
    total_params,
)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_dense_params_match_config(name):
    cfg = get_model_config(name)
    assert total_params(cfg) == cfg.num_params()


@pytest.mark.parametrize("name", ["debug", "llama3-8b", "llama3-70b"])
@pytest.mark.parametrize("seq", [1024, 4096])
def test_palm_convention(name, seq):
    # 6 N + 12 L h s, N = matmul weights incl. the LM head (the embedding lookup is no matmul)
    cfg = get_model_config(name)
    n = matmul_params(cfg)
    assert n == cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_embeddings else 1) \
        - cfg.hidden_size * (2 * cfg.n_layers + 1)
    assert model_flops_per_token(cfg, seq) == pytest.approx(6 * n + 12 * cfg.n_layers * cfg.hidden_size * seq)


def test_forward_backward_split():
    cfg = get_model_config("llama3-8b")
    fb = flop_breakdown(cfg, 4096)
    assert fb.backward == pytest.approx(2 * fb.forward)
    assert fb.backward_input + fb.backward_weight == pytest.approx(fb.backward)
    assert fb.backward_weight == pytest.approx(fb.layers_matmul + fb.lm_head)  # attention has no weights
    causal = flop_breakdown(cfg, 4096, causal=True)
    assert causal.attention == pytest.approx(fb.attention * 4097 / 2 / 4096)


def test_recompute_overheads():
    cfg = get_model_config("llama3-8b")
    s = 4096
    fb = flop_breakdown(cfg, s)
    assert recompute_flops_per_token(cfg, s, "none") == 0
    assert recompute_flops_per_token(cfg, s, "selective") == pytest.approx(fb.attention)
    assert recompute_flops_per_token(cfg, s, "selective", attention="math") == pytest.approx(fb.attention / 2)
    down = 2 * cfg.hidden_size * cfg.ffn_hidden_size * cfg.n_layers
    early = recompute_flops_per_token(cfg, s, "full", early_stop=True)
    assert early == pytest.approx(fb.layers_matmul + fb.attention - down)
    assert recompute_flops_per_token(cfg, s, "full") == pytest.approx(fb.layers_matmul + fb.attention)
    m = model_flops_per_token(cfg, s)
    assert m < hardware_flops_per_token(cfg, s, "selective") < hardware_flops_per_token(cfg, s, "full")
    with pytest.raises(ValueError, match="recompute must be one of"):
        recompute_flops_per_token(cfg, s, "some")


def test_executed_flops_use_causal_half():
    cfg = get_model_config("llama3-8b")
    f, b, w = executed_phase_flops(cfg, 8192)
    assert f + b + w < model_flops_per_token(cfg, 8192)
    fb = flop_breakdown(cfg, 8192, causal=True)
    assert b == pytest.approx(fb.layers_matmul + 2.5 * fb.attention + fb.lm_head)


def test_moe_counts_active_experts():
    cfg = get_model_config("debug")
    moe = MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=cfg.ffn_hidden_size)
    dense_mlp = 3 * cfg.hidden_size * cfg.ffn_hidden_size
    # all experts are held, only top-k (plus the router) are multiplied through
    assert total_params(cfg, moe) - cfg.num_params() == cfg.n_layers * (7 * dense_mlp + 8 * cfg.hidden_size)
    assert matmul_params(cfg, moe) - matmul_params(cfg) == cfg.n_layers * (dense_mlp + 8 * cfg.hidden_size)
    assert MoESpec(4, 5, 8).problems()


def test_the_chunked_loss_replays_the_head_gemm_as_hardware_flops():
    """Our chunked loss (models/loss.py) recomputes the logits of every chunk but the last (which forward
    keeps) in backward: one more LM-head forward GEMM, 2·h·V per recomputed row, counted like recompute
    (hardware FLOPs, charged to B), never as model FLOPs (MFU). Zero bubble's W recomputes every chunk once
    more. The other losses keep the logits and replay nothing."""
    cfg = get_model_config("llama3-8b")
    s, head = 4096, 2 * cfg.hidden_size * cfg.vocab_size
    assert loss_replayed_tokens(4096, 1024) == 3072 and loss_replayed_tokens(1000, 1024) == 0
    assert loss_replayed_tokens(2500, 1024) == 2048 and loss_replayed_tokens(4096, 1024, True) == 3072 + 4096
    assert loss_recompute_flops_per_token(cfg, "chunked", tokens=s) == head * 3 / 4
    assert loss_recompute_flops_per_token(cfg, "chunked", tokens=512) == 0  # one chunk: nothing replays
    for other in ("eager", "fused", "loss_parallel", "nanotron"):
        assert loss_recompute_flops_per_token(cfg, other, tokens=s) == 0
    for rc in ("none", "selective", "full"):
        assert hardware_flops_per_token(cfg, s, rc, cross_entropy="chunked", loss_tokens=s) == pytest.approx(
            hardware_flops_per_token(cfg, s, rc) + head * 3 / 4)
    f0, b0, w0 = executed_phase_flops(cfg, s)
    f, b, w = executed_phase_flops(cfg, s, cross_entropy="chunked", loss_tokens=s)
    assert (f, w) == (f0, w0) and b == pytest.approx(b0 + head * 3 / 4)


def test_the_time_model_runs_the_chunked_losss_head_gemm_once_more():
    """The last stage's head phase: under our recipe (chunked loss) its backward holds the head's forward
    GEMM once more for 3 of its 4 chunks; forward and weight-gradient times, and every other recipe's loss,
    are unchanged. The step's MFU counts model FLOPs (the same), its HFU the replay."""
    import dataclasses

    from pentatron.hardware.catalogue import get_gpu
    from pentatron.plan.layout import Layout, Workload, compute_dtype
    from pentatron.plan.recipes import PENTATRON, RECIPES
    from pentatron.plan.timing import _head_linear, head_phase, step_time, throughput

    gpu = get_gpu("h100-sxm")
    w = Workload(get_model_config("llama3-8b"), 4096, 64)
    assert PENTATRON.cross_entropy == "chunked"  # what `pentatron train` runs by default
    for tp in (1, 2):
        lay = Layout(dp=64 // tp, tp=tp, sp=tp > 1)
        eager = lay.with_recipe(cross_entropy="eager")
        chunked, full = head_phase(w, lay, gpu), head_phase(w, eager, gpu)
        gemm = _head_linear(gpu, w.seq_len, w.cfg.vocab_size / tp, w.cfg.hidden_size,
                            gpu.flops(compute_dtype(lay.precision)), 2)
        assert gemm.f > 0 and (chunked.f, chunked.w) == (full.f, full.w)
        assert chunked.b == pytest.approx(full.b + gemm.f * 3 / 4)  # 4 chunks of 1024: 3 recomputed
        r, r_eager = (throughput(w, x, gpu, step_time(w, x, gpu)) for x in (lay, eager))
        assert r.model_flops_per_token == r_eager.model_flops_per_token
        assert r.hardware_flops_per_token == pytest.approx(r.model_flops_per_token + 2 * 4096 * 128256 * 3 / 4)
        assert r.tokens_per_s < r_eager.tokens_per_s
    for name, recipe in RECIPES.items():  # other frameworks keep their own loss
        assert (recipe.cross_entropy == "chunked") == (name == "pentatron"), name
    other = Layout(dp=8, recipe=dataclasses.replace(RECIPES["torchtitan"]))
    assert throughput(w, other, gpu, step_time(w, other, gpu)).hfu == pytest.approx(
        throughput(w, other, gpu, step_time(w, other, gpu)).mfu)


def test_a_split_backward_replays_the_chunked_head_twice():
    """Zero bubble splits the last stage's backward into B and W; W re-enters the chunked loss, which
    recomputes the logits again (the flop counter on a real last stage: B + W = unsplit + one head GEMM).
    The planner counts it in the hardware FLOPs (HFU)."""
    import dataclasses

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from pentatron.hardware.catalogue import get_gpu
    from pentatron.models.llama import build_model
    from pentatron.parallel.parallelize import set_loss_chunk_tokens
    from pentatron.parallel.pipeline.split_backward import SplitBackward
    from pentatron.parallel.pipeline.stages import PipelineStage
    from pentatron.plan.layout import Layout, Workload
    from pentatron.plan.timing import step_time, throughput
    from pentatron.plan.verify import _addmm_flops

    cfg = dataclasses.replace(get_model_config("debug"), hidden_size=64, n_heads=2, n_kv_heads=1,
                              ffn_hidden_size=128, n_layers=3)
    stage = PipelineStage(build_model(cfg, seed=1), 2, 3, range(2, 3))
    set_loss_chunk_tokens(stage, 8)
    targets = torch.randint(0, cfg.vocab_size, (2, 16))
    counted = {torch.ops.aten.addmm_: _addmm_flops}

    def backward_flops(split: bool) -> int:
        stage.zero_grad(set_to_none=True)
        x = torch.randn(2, 16, cfg.hidden_size, requires_grad=True)
        out = stage(x, targets=targets)
        if not split:
            with FlopCounterMode(display=False, custom_mapping=counted) as fc:
                out.backward()
            return fc.get_total_flops()
        sb = SplitBackward([out], [None], [x])
        with FlopCounterMode(display=False, custom_mapping=counted) as fb:
            sb.backward_input()
        with FlopCounterMode(display=False, custom_mapping=counted) as fw:
            sb.backward_weight()
        assert sb.split
        return fb.get_total_flops() + fw.get_total_flops()

    head = 2 * 32 * cfg.hidden_size * cfg.vocab_size  # 32 rows in 4 chunks of 8: unsplit replays 3 chunks
    assert backward_flops(True) - backward_flops(False) == head  # W replays all 4 once more
    assert loss_recompute_flops_per_token(cfg, "chunked", split_backward=True, tokens=32, chunk_tokens=8) == (
        head / 32 * (24 + 32) / 32)

    gpu = get_gpu("h100-sxm")
    w = Workload(get_model_config("llama3-8b"), 4096, 64)
    big = 2 * w.cfg.hidden_size * w.cfg.vocab_size
    for schedule, replays in (("zb", 1.75), ("1f1b", 0.75)):  # 4096 tokens: 3 of 4 chunks, zb's W all 4 more
        lay = Layout(dp=16, pp=4, pp_schedule=schedule)
        r = throughput(w, lay, gpu, step_time(w, lay, gpu))
        assert r.hardware_flops_per_token - r.model_flops_per_token == pytest.approx(replays * big), schedule


def test_the_runs_chunk_size_and_zero_bubbles_w_replay_are_timed():
    """`recipe.loss_chunk_tokens` (train.loss_chunk_tokens: the run report's, `--recipe-set`) sets how many
    chunks replay in B; zero bubble's W re-enters the chunked loss and replays the head GEMM of every chunk,
    on the last stage only. Either chunk size, and the full-logits loss, are what `pentatron train` runs."""
    from pentatron.hardware.catalogue import get_gpu
    from pentatron.plan.layout import Layout, Workload
    from pentatron.plan.recipes import loss_chunk_tokens_of, not_ours, training_recipe
    from pentatron.plan.timing import head_gemm, head_phase, stage_phases
    from tests.plan.conftest import uncalibrated

    gpu = uncalibrated(get_gpu("h100-sxm"))
    w = Workload(get_model_config("llama3-8b"), 4096, 64)
    lay = Layout(dp=8, pp=2, micro_batch=1)
    gemm = head_gemm(w, lay, gpu).f
    small = lay.with_recipe(loss_chunk_tokens=512)  # 8 chunks: 7 replay, not 3 of 4
    assert head_phase(w, small, gpu).b == pytest.approx(head_phase(w, lay, gpu).b + gemm * (7 / 8 - 3 / 4))
    ofb, zb = stage_phases(w, lay, gpu), stage_phases(w, dataclasses.replace(lay, pp_schedule="zb"), gpu)
    assert ofb[0] == zb[0] and (ofb[1].f, ofb[1].b) == (zb[1].f, zb[1].b)
    assert zb[1].w == pytest.approx(ofb[1].w + gemm)
    eager = lay.with_recipe(cross_entropy="eager")
    assert stage_phases(w, dataclasses.replace(eager, pp_schedule="zb"), gpu)[1].w == stage_phases(w, eager, gpu)[1].w
    for n in (0, 512, 1024):
        assert not_ours(training_recipe(n)) is None and loss_chunk_tokens_of(training_recipe(n)) == n
    assert lay.with_recipe(loss_chunk_tokens=0).recipe.problems()
