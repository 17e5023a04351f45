"""Named model shapes: a ~1M-parameter debug model up to Llama-3.1 405B.

Shapes of public models are copied from their published config.json files (Hugging Face model cards).
"""

from __future__ import annotations

from dataclasses import replace

from pentatron.models.config import ModelConfig, RopeScaling

_LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)

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
