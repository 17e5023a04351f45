"""The shape of a Llama-family model: one frozen dataclass shared by the model, the trainer and the planner."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from pentatron.kept_hash import compared_fields, kept_hash, state_without_kept_hash
from pentatron.numbers import number_problem

MlpKind = Literal["swiglu", "gelu"]
RouterScore = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-Experts feed-forward layers (`models/moe.py`): a token-choice top-k router over
    `n_experts` SwiGLU experts of width `expert_ffn_size`, plus `n_shared_experts` always-on experts
    (one SwiGLU of width n_shared·expert_ffn_size, as DeepSeek implements them).

    Routing: `score` softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3) of the router logits; the
    top-k weights renormalised to sum to 1 when `norm_topk_prob`, then multiplied by `route_scale`.
    Balancing: the Switch/GShard auxiliary loss (`aux_loss_coef`, 1.0 at a uniform load), the router
    z-loss (`z_loss_coef`), and DeepSeek-V3's auxiliary-loss-free bias (`bias_update_rate` γ: after each
    optimizer step an expert's selection bias moves by γ towards the mean load; 0 = off).
    `capacity_factor`: each expert takes at most ceil(factor·tokens·top_k/n_experts) assignments of a
    micro-batch (tokens: all of it, b × the full sequence, whatever the layout), the lowest-weighted ones
    beyond it are dropped (None: dropless). The first
    `first_dense_layers` layers keep the dense MLP (DeepSeek-V3: 3)."""

    n_experts: int
    top_k: int
    expert_ffn_size: int
    n_shared_experts: int = 0
    score: RouterScore = "softmax"
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    capacity_factor: float | None = None
    first_dense_layers: int = 0

    def problems(self, n_layers: int | None = None) -> list[str]:
        out = []
        for f in ("n_experts", "top_k", "expert_ffn_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                out.append(f"moe.{f} must be a positive integer, got {v!r}")
        for f in ("n_shared_experts", "first_dense_layers"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                out.append(f"moe.{f} must be an integer ≥ 0, got {v!r}")
        if out:
            return out
        if self.top_k > self.n_experts:
            out.append(f"moe.top_k={self.top_k} is larger than moe.n_experts={self.n_experts}")
        if self.score not in ("softmax", "sigmoid"):
            out.append(f"moe.score must be 'softmax' or 'sigmoid', got {self.score!r}")
        # number_problem: NaN fails these checks too (a model file or override can hold nan)
        out += [p for f in ("aux_loss_coef", "z_loss_coef", "bias_update_rate")
                if (p := number_problem(f"moe.{f}", getattr(self, f), ge=0))]
        if p := number_problem("moe.route_scale", self.route_scale, gt=0):
            out.append(p)
        if self.capacity_factor is not None and (p := number_problem("moe.capacity_factor", self.capacity_factor,
                                                                     gt=0)):
            out.append(f"{p} (or unset it for dropless)")
        if n_layers is not None and self.first_dense_layers >= n_layers:
            out.append(f"moe.first_dense_layers={self.first_dense_layers} leaves no MoE layer of "
                       f"model.n_layers={n_layers}")
        return out


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
    moe: MoEConfig | None = None  # None: every layer has the dense MLP
    # Qwen3: RMSNorm (eps norm_eps) over head_dim of each q and k head, after the projections, before RoPE.
    qk_norm: bool = False
    # The attention head width when it is not hidden_size/n_heads (Qwen3 0.6B/4B/32B: 128); None: derived.
    attn_head_dim: int | None = None
    name: str = field(default="custom", compare=False)

    def __hash__(self) -> int:  # the compared fields' hash, kept (pentatron/kept_hash.py)
        return kept_hash(self, compared_fields)

    __getstate__ = state_without_kept_hash

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim if self.attn_head_dim is not None else self.hidden_size // self.n_heads

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
        if self.attn_head_dim is not None:
            if not isinstance(self.attn_head_dim, int) or isinstance(self.attn_head_dim, bool) \
                    or self.attn_head_dim <= 0 or self.attn_head_dim % 2:
                out.append(f"model.attn_head_dim must be a positive even integer (RoPE), got {self.attn_head_dim!r}")
        elif self.hidden_size % self.n_heads:
            out.append(f"model.n_heads={self.n_heads} does not divide model.hidden_size={self.hidden_size}")
        elif self.head_dim % 2:
            out.append(f"model head_dim={self.head_dim} (hidden_size/n_heads) must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            out.append(f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads={self.n_heads}")
        if self.mlp not in ("swiglu", "gelu"):
            out.append(f"model.mlp must be 'swiglu' or 'gelu', got {self.mlp!r}")
        # number_problem: NaN fails these checks too (a model file can hold nan, a --set too)
        out += [p for f in ("rope_theta", "norm_eps", "init_std") if (p := number_problem(f"model.{f}",
                                                                                          getattr(self, f), gt=0))]
        if self.moe is not None:
            if self.mlp != "swiglu":
                out.append(f"model.mlp={self.mlp!r}: MoE experts are SwiGLU, so model.mlp must be 'swiglu'")
            out += self.moe.problems(self.n_layers)
        return out

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i >= self.moe.first_dense_layers

    # ---- parameter counts (exact for our architecture: no biases, RMSNorm weights only) ----
    def layer_params(self, i: int | None = None, active: bool = False) -> int:
        """Parameters of layer `i` (None: a dense layer); `active`: those one token uses (top-k of the
        routed experts instead of all of them)."""
        h, kv, f = self.hidden_size, self.kv_dim, self.ffn_hidden_size
        attn = 2 * h * self.n_heads * self.head_dim + 2 * h * kv + (2 * self.head_dim if self.qk_norm else 0)
        if i is not None and self.is_moe_layer(i):
            m = self.moe
            experts = m.top_k if active else m.n_experts
            mlp = h * m.n_experts + 3 * h * m.expert_ffn_size * (experts + m.n_shared_experts)
        else:
            mlp = (3 if self.mlp == "swiglu" else 2) * h * f
        return attn + mlp + 2 * h

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_params(self, active: bool = False) -> int:
        """Every parameter (`active`: only those one token uses, for MoE models; the same otherwise)."""
        head = 0 if self.tie_embeddings else self.embedding_params()
        layers = sum(self.layer_params(i, active) for i in range(self.n_layers))
        return self.embedding_params() + layers + self.hidden_size + head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        rs = d.get("rope_scaling")
        if isinstance(rs, dict):
            d["rope_scaling"] = RopeScaling(**rs)
        if isinstance(d.get("moe"), dict):
            d["moe"] = MoEConfig(**d["moe"])
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model field(s): {', '.join(unknown)}")
        return cls(**d)
