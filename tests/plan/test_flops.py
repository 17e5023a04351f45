from __future__ import annotations

import pytest

from pentatron.models.registry import MODELS, get_model_config
from pentatron.plan.flops import (
    MoESpec,
    executed_phase_flops,
    flop_breakdown,
    hardware_flops_per_token,
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
