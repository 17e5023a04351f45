"""The shape of a Llama-family model: one frozen dataclass shared by the model, the trainer and the planner."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

MlpKind = Literal["swiglu", "gelu"]


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 frequency scaling of RoPE (long wavelengths slowed by `factor`, short ones kept)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_size: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    mlp: MlpKind = "swiglu"
    init_std: float = 0.02
    name: str = field(default="custom", compare=False)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def problems(self) -> list[str]:
        """Every inconsistency in this shape, as messages naming the field (empty when valid)."""
        out = []
        for f in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_size",
                  "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                out.append(f"model.{f} must be a positive integer, got {v!r}")
        if out:
            return out
        if self.hidden_size % self.n_heads:
            out.append(f"model.n_heads={self.n_heads} does not divide model.hidden_size={self.hidden_size}")
        elif self.head_dim % 2:
            out.append(f"model head_dim={self.head_dim} (hidden_size/n_heads) must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            out.append(f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads={self.n_heads}")
        if self.mlp not in ("swiglu", "gelu"):
            out.append(f"model.mlp must be 'swiglu' or 'gelu', got {self.mlp!r}")
        if self.rope_theta <= 0:
            out.append(f"model.rope_theta must be > 0, got {self.rope_theta}")
        if self.norm_eps <= 0:
            out.append(f"model.norm_eps must be > 0, got {self.norm_eps}")
        if self.init_std <= 0:
            out.append(f"model.init_std must be > 0, got {self.init_std}")
        return out

    # ---- parameter counts (exact for our architecture: no biases, RMSNorm weights only) ----
    def layer_params(self) -> int:
        h, kv, f = self.hidden_size, self.kv_dim, self.ffn_hidden_size
        attn = h * h + 2 * h * kv + h * h
        mlp = (3 if self.mlp == "swiglu" else 2) * h * f
        return attn + mlp + 2 * h

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        head = 0 if self.tie_embeddings else self.embedding_params()
        return self.embedding_params() + self.n_layers * self.layer_params() + self.hidden_size + head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        rs = d.get("rope_scaling")
        if isinstance(rs, dict):
            d["rope_scaling"] = RopeScaling(**rs)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model field(s): {', '.join(unknown)}")
        return cls(**d)
