"""A Llama-family decoder in plain single-device PyTorch.

RMSNorm, RoPE (rotate-half convention, as in Hugging Face weights; optional Llama-3.1 frequency
scaling), grouped-query attention through `scaled_dot_product_attention`, SwiGLU (or GELU) MLP,
optional tied embeddings. The model knows nothing about parallelism: local head counts are derived
from the projection widths at run time, so parallel code can shard the linears without touching it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pentatron.models.config import ModelConfig, RopeScaling
from pentatron.models.documents import Documents, document_attention
from pentatron.models.loss import DEFAULT_CHUNK_TOKENS, linear_cross_entropy
from pentatron.models.moe import MoE, Router
from pentatron.models.param_init import ParamInit, fill_slice, param_seed
from pentatron.precision import wide


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in (at least) fp32 for stability, as the reference implementation does, then cast back.
        xf = wide(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    # Llama-3.1: wavelengths longer than the original context are slowed by `factor`, shorter than
    # original/high_freq_factor are kept, and the band between is interpolated smoothly.
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """Cos/sin tables for RoPE, kept as non-persistent fp32 buffers (recomputed, never checkpointed)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta, self.scaling = head_dim, max_seq_len, theta, scaling
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)

    def reset_parameters(self) -> None:
        if self.cos.is_meta:
            return
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        t = torch.arange(self.max_seq_len, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, s, heads, head_dim]; cos/sin: [s, head_dim] or [b, s, head_dim]."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class AttentionCore(nn.Module):
    """softmax(QKᵀ/√d)V with a causal mask — within each document when `documents` are given
    (models/documents.py). Its own module so that selective recompute can wrap it and context parallelism
    can replace it. Inputs are [b, s, heads, head_dim]."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if documents is None:
            gqa = k.shape[1] != q.shape[1]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = document_attention(q, k, v, documents)
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # Qwen3: one gain over head_dim, shared by every q (k) head
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # Head counts come from the (possibly sharded) projection widths, not from the config.
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, k, cos, sin)
        out = self.core(q, k, v) if documents is None else self.core(q, k, v, documents)
        return self.o_proj(out.reshape(b, s, -1))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q and k: an elementwise region of its own, which `parallel/compile.py` can compile
        when the projections around it communicate (tensor parallelism)."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":
            self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.down_proj(self.activate(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.activate(None, self.up_proj(x)))

    def activate(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        """silu(gate)·up (SwiGLU) or gelu(up): the elementwise region between the projections (compiled on
        its own by `parallel/compile.py` when they communicate)."""
        if gate is not None:
            return F.silu(gate) * up
        return F.gelu(up, approximate="tanh")


class DecoderBlock(nn.Module):
    """Attention then the feed-forward: the dense MLP (`mlp`), or from layer moe.first_dense_layers on
    of an MoE model, the Mixture-of-Experts (`moe`, models/moe.py)."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if cfg.is_moe_layer(index):
            self.moe = MoE(cfg)
        else:
            self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        attn_in = self.attn_norm(x)
        x = x + (self.attn(attn_in, cos, sin) if documents is None else self.attn(attn_in, cos, sin, documents))
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return x + ffn(self.mlp_norm(x))


class LMHead(nn.Linear):
    """The output projection. Called with targets it returns the mean cross-entropy instead of the
    logits, computed `chunk_tokens` tokens at a time (models/loss.py: the full logits never exist);
    the runtime sets `chunk_tokens` from train.loss_chunk_tokens."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__(hidden, vocab, bias=False)
        self.chunk_tokens = DEFAULT_CHUNK_TOKENS

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return F.linear(x, self.weight)
        return linear_cross_entropy(x, self.weight, targets, self.chunk_tokens)


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        problems = cfg.problems()
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))
        self.cfg = cfg
        # storage given, so nn.Embedding skips its own N(0, 1) init (values come from `param_init`; on the
        # meta device that normal_ runs a Python reference that imports torch._dynamo: ~1.4 s of CPU per rank)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, documents: Documents | None = None) -> torch.Tensor:
        """tokens: [b, s] int64 → logits [b, s, vocab], or with `targets` [b, s] the mean cross-entropy
        (the head's chunked loss). `positions` ([s] or per sample [b, s]) defaults to 0..s-1 (context
        parallelism passes the global positions of its sequence shard; document masking each token's
        position in its document); `documents`: attention stays within each (models/documents.py)."""
        return decoder_forward(tokens, positions, self.rotary, self.layers, self.embed, self.norm, self.lm_head,
                               targets, documents)


def decoder_forward(x: torch.Tensor, positions: torch.Tensor | None, rotary: Rotary, layers: Iterable[nn.Module],
                    embed: nn.Module | None, norm: nn.Module | None, lm_head: nn.Module | None,
                    targets: torch.Tensor | None = None, documents: Documents | None = None) -> torch.Tensor:
    """The decoder, written once for the whole model and for any contiguous part of it (a pipeline
    stage): [embed] → layers → [norm → lm_head]. `x` is token ids when `embed` is given, else the hidden
    state; `positions` default to 0..s-1 of `x`; with `targets` the head returns the loss, not logits;
    `documents` (of the whole sequences) reach every attention core. Without documents the layers are
    called exactly as before (a compiled block sees no new argument)."""
    if positions is None:
        positions = torch.arange(x.shape[1], device=x.device)
    cos, sin = rotary(positions)
    if embed is not None:
        x = embed(x)
    for layer in layers:
        x = layer(x, cos, sin) if documents is None else layer(x, cos, sin, documents)
    if lm_head is not None:
        x = lm_head(norm(x)) if targets is None else lm_head(norm(x), targets)
    return x


def param_init(cfg: ModelConfig, seed: int, name: str, ndim: int) -> ParamInit:
    """How parameter `name` (its init name, see `init_names`) starts. Linear/embedding weights ~ N(0, std);
    output projections scaled by 1/sqrt(2·layers) (GPT-2 style) so the residual stream stays O(1)."""
    if ndim == 1:
        return ParamInit(ones=True)  # RMSNorm gains
    std = cfg.init_std / math.sqrt(2 * cfg.n_layers) \
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")) else cfg.init_std
    return ParamInit(ones=False, std=std, seed=param_seed(seed, name))


def init_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name of the full model → the name its init is drawn from: itself, or for a tied
    weight the first name it is registered under (a last pipeline stage's "lm_head.weight" starts as
    "embed.weight" does)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


@torch.no_grad()
def materialize_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Give the meta buffers (RoPE tables, MoE selection biases; all non-persistent) storage on `device`
    and compute them."""
    for m in model.modules():
        for name, b in list(m.named_buffers(recurse=False)):
            if b is not None and b.is_meta:
                setattr(m, name, torch.empty(b.shape, dtype=b.dtype, device=device))
        if isinstance(m, Rotary):
            m.reset_parameters()
    reset_router_biases(model)


@torch.no_grad()
def init_weights(model: Llama, seed: int) -> None:
    """Deterministic init of a materialised model (`param_init`), each parameter drawn tile by tile."""
    for name, p in model.named_parameters():
        fill_slice(p.data, param_init(model.cfg, seed, name, p.ndim), p.shape)
    model.rotary.reset_parameters()
    reset_router_biases(model)


@torch.no_grad()
def reset_router_biases(model: nn.Module) -> None:
    """MoE selection biases start at zero (non-persistent buffers: materialised, not loaded)."""
    for m in model.modules():
        if isinstance(m, Router):
            m.expert_bias.zero_()


def build_meta_model(cfg: ModelConfig) -> Llama:
    """The model on the meta device: shapes and structure, no storage. The parallel runtime cuts it into
    this rank's pieces and materialises only those (`parallel/materialize.py`)."""
    with torch.device("meta"):
        return Llama(cfg)


def build_model(cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, init: bool = True) -> Llama:
    """The whole model on `device`: built on meta, then each parameter given storage in `dtype` and
    initialised (`init=False`: left uninitialised, to be loaded). The RoPE tables stay fp32."""
    model = build_meta_model(cfg)
    new: dict[int, nn.Parameter] = {}  # meta parameter → its storage (a tied weight gets one)
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = new.setdefault(id(p), nn.Parameter(
                    torch.empty(p.shape, dtype=dtype, device=device), requires_grad=p.requires_grad))
    if init:
        for name, p in model.named_parameters():
            fill_slice(p.data, param_init(cfg, seed, name, p.ndim), p.shape)
    materialize_buffers(model, device)
    return model
