import math

import pytest
import torch
import torch.nn.functional as F

from pentatron.models.config import ModelConfig, RopeScaling
from pentatron.models.llama import Llama, build_model, rope_inv_freq
from pentatron.models.registry import get_model_config, model_names
from tests.reference_loop import EXACT_RTOL


@pytest.mark.parametrize("name", model_names())
def test_registry_shapes_build_on_meta_with_exact_param_count(name):
    cfg = get_model_config(name)
    with torch.device("meta"):
        model = Llama(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_published_parameter_counts():
    # Llama-3.1 model cards: 8.03B, 70.6B, 405.9B; SmolLM: 135M, 1.71B.
    expected = {"llama3.1-8b": 8.03e9, "llama3.1-70b": 70.55e9, "llama3.1-405b": 405.85e9,
                "smollm-135m": 134.5e6, "smollm-1.7b": 1.71e9, "debug": 1.115e6}
    for name, n in expected.items():
        assert get_model_config(name).num_params() == pytest.approx(n, rel=0.01), name


def test_unknown_model_lists_known_names():
    with pytest.raises(KeyError, match="known models: .*debug"):
        get_model_config("llama-9000")


def test_init_is_deterministic_and_seeded():
    cfg = get_model_config("debug")
    a, b, c = build_model(cfg, seed=1), build_model(cfg, seed=1), build_model(cfg, seed=2)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if pa.ndim > 1:
            assert not torch.equal(pa, pc), n


def test_tied_embeddings_share_storage_after_materialisation():
    model = build_model(get_model_config("debug"))
    assert model.lm_head.weight is model.embed.weight
    untied = build_model(get_model_config("debug-untied"))
    assert untied.lm_head.weight is not untied.embed.weight


def test_causal_future_tokens_do_not_change_the_past():
    model = build_model(get_model_config("debug"), seed=0)
    x = torch.randint(0, 4096, (2, 32))
    y = x.clone()
    y[:, 20:] = torch.randint(0, 4096, (2, 12))
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=0)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def _reference_forward(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """An independent, explicit implementation (repeated KV heads, masked softmax) to check the model."""
    cfg = model.cfg
    s = tokens.shape[1]
    # angles in float64, tables rounded to fp32 as the model documents its rotary buffers, then the model's dtype
    dtype = model.embed.weight.dtype
    inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # float64
    ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    cos, sin = ang.cos().float().to(dtype), ang.sin().float().to(dtype)

    def rope(t):  # t: [b, s, h, d]; rotate-half pairs (i, i + d/2)
        t1, t2 = t[..., : t.shape[-1] // 2], t[..., t.shape[-1] // 2:]
        c, si = cos[None, :, None], sin[None, :, None]
        return torch.cat([t1 * c - t2 * si, t2 * c + t1 * si], dim=-1)

    def rms(x, w):
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)

    x = model.embed.weight[tokens]
    mask = torch.full((s, s), float("-inf")).triu(1)
    for layer in model.layers:
        h = rms(x, layer.attn_norm.weight)
        q = (h @ layer.attn.q_proj.weight.T).view(*h.shape[:2], cfg.n_heads, cfg.head_dim)
        k = (h @ layer.attn.k_proj.weight.T).view(*h.shape[:2], cfg.n_kv_heads, cfg.head_dim)
        v = (h @ layer.attn.v_proj.weight.T).view(*h.shape[:2], cfg.n_kv_heads, cfg.head_dim)
        q, k = rope(q), rope(k)
        rep = cfg.n_heads // cfg.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(cfg.head_dim) + mask
        att = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(*h.shape[:2], -1)
        x = x + att @ layer.attn.o_proj.weight.T
        h = rms(x, layer.mlp_norm.weight)
        mlp = layer.mlp
        x = x + (F.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return rms(x, model.norm.weight) @ model.lm_head.weight.T


@pytest.mark.parametrize("scaling", [None, RopeScaling(factor=8.0, original_max_position=16)])
def test_model_matches_explicit_reference(scaling):
    cfg = ModelConfig(vocab_size=97, hidden_size=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden_size=96,
                      max_seq_len=64, rope_theta=500.0, rope_scaling=scaling)
    model = build_model(cfg, seed=3, dtype=torch.float64)  # float64: the comparison cannot depend on the CPU
    tokens = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), _reference_forward(model, tokens), rtol=EXACT_RTOL, atol=0)


def test_llama31_rope_scaling_keeps_high_and_slows_low_frequencies():
    plain = rope_inv_freq(128, 500000.0, None)
    scaled = rope_inv_freq(128, 500000.0, RopeScaling())
    wavelen = 2 * math.pi / plain
    assert torch.equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])
    torch.testing.assert_close(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)
    mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert mid.any() and bool(((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all())


def test_gelu_mlp_variant_and_bf16_forward():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, n_layers=1, n_heads=4, n_kv_heads=4,
                      ffn_hidden_size=64, max_seq_len=16, mlp="gelu")
    model = build_model(cfg, dtype=torch.bfloat16)
    assert model.rotary.cos.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    out = model(torch.randint(0, 64, (1, 16)))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_invalid_shape_is_rejected_with_field_names():
    bad = ModelConfig(vocab_size=64, hidden_size=30, n_layers=1, n_heads=4, n_kv_heads=3, ffn_hidden_size=8)
    with pytest.raises(ValueError, match="n_heads=4 does not divide model.hidden_size=30"):
        Llama(bad)
