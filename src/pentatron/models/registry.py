"""Named model shapes: a ~1M-parameter debug model up to Llama-3.1 405B.

Shapes of public models are copied from their published config.json files (Hugging Face model cards).
"""

from __future__ import annotations

from dataclasses import replace

from pentatron.models.config import ModelConfig, MoEConfig, RopeScaling

_LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)

# The debug MoE: 8 experts, top-2, one shared expert, layer 0 dense; balanced by the aux loss (+ a small
# z-loss). Its variants differ only in the balancing, for the balancing study (BENCHMARKS.md).
_DEBUG_MOE = MoEConfig(n_experts=8, top_k=2, expert_ffn_size=64, n_shared_experts=1, aux_loss_coef=0.01,
                       z_loss_coef=0.001, first_dense_layers=1)
_DEBUG_MOE_SHAPE = dict(vocab_size=4096, hidden_size=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_size=256,
                        max_seq_len=512, tie_embeddings=True)

MODELS: dict[str, ModelConfig] = {
    # ~1.1M parameters: trains in seconds on a CPU; vocab matches the default corpus tokenizer (4096).
    "debug": ModelConfig(vocab_size=4096, hidden_size=128, n_layers=4, n_heads=4, n_kv_heads=2,
                         ffn_hidden_size=256, max_seq_len=512, tie_embeddings=True),
    # Same as debug but with a separate LM head, for code paths that treat it separately.
    "debug-untied": ModelConfig(vocab_size=4096, hidden_size=128, n_layers=4, n_heads=4, n_kv_heads=2,
                                ffn_hidden_size=256, max_seq_len=512, tie_embeddings=False),
    "smollm-135m": ModelConfig(vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3,
                               ffn_hidden_size=1536, max_seq_len=2048, rope_theta=10000.0,
                               tie_embeddings=True),
    "smollm-1.7b": ModelConfig(vocab_size=49152, hidden_size=2048, n_layers=24, n_heads=32, n_kv_heads=32,
                               ffn_hidden_size=8192, max_seq_len=2048, rope_theta=130000.0,
                               tie_embeddings=True),
    "llama3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             ffn_hidden_size=14336, max_seq_len=8192, rope_theta=500000.0),
    "llama3.1-8b": ModelConfig(vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                               ffn_hidden_size=14336, max_seq_len=131072, rope_theta=500000.0,
                               rope_scaling=_LLAMA31_ROPE),
    "llama3.1-70b": ModelConfig(vocab_size=128256, hidden_size=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                                ffn_hidden_size=28672, max_seq_len=131072, rope_theta=500000.0,
                                rope_scaling=_LLAMA31_ROPE),
    "llama3.1-405b": ModelConfig(vocab_size=128256, hidden_size=16384, n_layers=126, n_heads=128,
                                 n_kv_heads=8, ffn_hidden_size=53248, max_seq_len=131072,
                                 rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE),
    "debug-moe": ModelConfig(**_DEBUG_MOE_SHAPE, moe=_DEBUG_MOE),
    "debug-moe-nobalance": ModelConfig(**_DEBUG_MOE_SHAPE, moe=replace(_DEBUG_MOE, aux_loss_coef=0.0,
                                                                        z_loss_coef=0.0)),
    "debug-moe-auxfree": ModelConfig(**_DEBUG_MOE_SHAPE, moe=replace(_DEBUG_MOE, aux_loss_coef=0.0, z_loss_coef=0.0,
                                                                      bias_update_rate=1e-3)),
    # Qwen3 dense, from the Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B} config.json files (transformers'
    # Qwen3Config): vocab 151936, head_dim 128 (decoupled from hidden/heads at 0.6B, 4B and 32B), 8 kv
    # heads, q/k RMSNorm, rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960; tied
    # embeddings up to 4B. The debug shape is a tiny one of the same kind (qk_norm, decoupled heads).
    **{name: ModelConfig(vocab_size=151936, hidden_size=h, n_layers=n, n_heads=heads, n_kv_heads=8, ffn_hidden_size=f,
                         max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=tied, qk_norm=True,
                         attn_head_dim=128)
       for name, h, n, heads, f, tied in (("qwen3-0.6b", 1024, 28, 16, 3072, True),
                                          ("qwen3-1.7b", 2048, 28, 16, 6144, True),
                                          ("qwen3-4b", 2560, 36, 32, 9728, True),
                                          ("qwen3-8b", 4096, 36, 32, 12288, False),
                                          ("qwen3-14b", 5120, 40, 40, 17408, False),
                                          ("qwen3-32b", 5120, 64, 64, 25600, False))},
    "debug-qwen3": ModelConfig(vocab_size=4096, hidden_size=128, n_layers=4, n_heads=4, n_kv_heads=2,
                               ffn_hidden_size=256, max_seq_len=512, rope_theta=1e6, norm_eps=1e-6,
                               tie_embeddings=True, qk_norm=True, attn_head_dim=48),
    # A tiny Qwen3-MoE of debug-moe's size, with the conventions `models/hf_moe.py` imports (Qwen3MoeForCausalLM):
    # q/k norms with a decoupled head_dim, every layer MoE (no shared expert, no dense first layer), softmax top-k
    # renormalised (norm_topk_prob), the Switch aux loss (router_aux_loss_coef; no z-loss), untied embeddings.
    "debug-qwen3-moe": ModelConfig(vocab_size=4096, hidden_size=128, n_layers=4, n_heads=4, n_kv_heads=2,
                                   ffn_hidden_size=256, max_seq_len=512, rope_theta=1e6, norm_eps=1e-6,
                                   qk_norm=True, attn_head_dim=48,
                                   moe=MoEConfig(n_experts=8, top_k=2, expert_ffn_size=64, aux_loss_coef=0.01)),
    # mistralai/Mixtral-8x7B-v0.1 config.json: 46.7B parameters, 12.9B active.
    "mixtral-8x7b": ModelConfig(vocab_size=32000, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                ffn_hidden_size=14336, max_seq_len=32768, rope_theta=1e6,
                                moe=MoEConfig(n_experts=8, top_k=2, expert_ffn_size=14336, aux_loss_coef=0.02)),
    # Qwen/Qwen3-30B-A3B config.json: 32 q heads of 128 (> hidden 2048: decoupled head_dim), 4 kv heads,
    # q/k norms, 128 experts of 768, top-8 renormalised (norm_topk_prob), router_aux_loss_coef 0.001.
    "qwen3-moe-30b-a3b": ModelConfig(vocab_size=151936, hidden_size=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                                     ffn_hidden_size=6144, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6,
                                     qk_norm=True, attn_head_dim=128,
                                     moe=MoEConfig(n_experts=128, top_k=8, expert_ffn_size=768,
                                                   aux_loss_coef=0.001)),
    # deepseek-ai/DeepSeek-V3 config.json's MoE (256 routed + 1 shared expert of 2048, top-8, sigmoid
    # scores, routed_scaling_factor 2.5, 3 dense layers, aux-free bias γ=0.001, sequence aux α=1e-4);
    # its MLA attention is approximated by full multi-head attention, and the MTP module is left out.
    "deepseek-v3-shape": ModelConfig(vocab_size=129280, hidden_size=7168, n_layers=61, n_heads=128,
                                     n_kv_heads=128, ffn_hidden_size=18432, max_seq_len=4096, norm_eps=1e-6,
                                     moe=MoEConfig(n_experts=256, top_k=8, expert_ffn_size=2048, n_shared_experts=1,
                                                   score="sigmoid", route_scale=2.5, aux_loss_coef=1e-4,
                                                   bias_update_rate=1e-3, first_dense_layers=3)),
}
ALIASES = {"llama3-70b": "llama3.1-70b", "llama3-405b": "llama3.1-405b"}


def model_names() -> list[str]:
    return sorted(MODELS) + sorted(ALIASES)


def get_model_config(name: str) -> ModelConfig:
    """The named shape; raises KeyError with the list of known names."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(model_names())}")
    return replace(MODELS[key], name=key)
