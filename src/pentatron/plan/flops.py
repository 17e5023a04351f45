"""FLOPs per token for a Llama-family decoder (dense or MoE), forward/backward split, recompute overhead.

Convention (the one the trainer's MFU uses): **PaLM / Megatron / torchtitan**,

    model FLOPs per token = 6 * N_matmul + 12 * L * h_q * s

* `N_matmul` = parameters that take part in a matmul for one token: every linear weight of the decoder
  (attention q/k/v/o, MLP, for MoE only the top-k routed + shared experts and the router) plus the LM
  head projection (also when tied to the embedding: the matmul still happens). The embedding *lookup*
  and the RMSNorm gains do no matmul and are excluded. 2 FLOPs per multiply-add.
* `12 * L * h_q * s` is the attention score/value term (QK^T and PV: 2 matmuls of 2*s*h_q FLOPs each per
  token, times 3 for forward+backward) counted over the **full** s x s square, i.e. the causal mask is
  *not* halved. That is what PaLM (App. B), Megatron (Narayanan et al. 2021) and torchtitan count, so
  MFU figures stay comparable; `torch.utils.flop_counter` also counts SDPA this way.
* backward = 2 x forward: for every matmul y = x W one matmul for dx (backward-input, "B") and one for dW
  (backward-weight, "W"). Attention scores have no weights, so their whole backward is in B.

The work a fused causal kernel really executes (FlashAttention skips the masked half, and its backward
re-computes QK^T) is in `executed_phase_flops`; the time model uses that, MFU/HFU use the convention.

**Packed documents** (`data.document_mask`: attention causal within each document, nothing across). A sample
of s tokens holding documents of lengths L_1 … L_n (Σ L_i = s) has Σ L_i(L_i+1)/2 causal query·key pairs per
head and layer (a document cut by the sample's edge counts as a document of that sample). Per token that is
(E[L²]/E[L] + 1)/2 keys, E[L] and E[L²] the mean and mean square of the lengths (`DocumentLengths`); one
document per sample gives (s+1)/2, the plain causal count. The convention above applied per document counts
each document's full L×L square, E[L²]/E[L] keys per token instead of s (`MFU_CONVENTION`, the same words in
the planner, the run summary and the run report): under masking the MFU numerator follows the work done, so
short documents at a long sequence cannot push MFU past what the device did, and a sample that is one
document is the usual 12·L·h·s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pentatron.config import TrainConfig
from pentatron.models.config import ModelConfig

Recompute = Literal["none", "selective", "full", "selective-op", "full-alternate"]
# none / selective (Megatron: the attention core) / full (every block) are what `pentatron train` runs;
# selective-op (torchtitan's op-level SAC: the odd-numbered matmul outputs of each block and the attention
# output saved, the rest replayed) and full-alternate (torchtitan's layer SAC: full recompute of every 2nd block) are
# evaluated for published runs and advice, never recommended (training cannot run them).
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full", "selective-op", "full-alternate")
TRAINABLE_RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")


# What the MFU numerator counts for attention, in the words every report uses (planner, run summary, run report).
MFU_CONVENTION = ("MFU counts attention over each document's full square (Σ L² per sample: one document per "
                  "sample is the usual full seq×seq square of the PaLM/Megatron convention)")


@dataclass(frozen=True)
class DocumentLengths:
    """The lengths of the packed documents attention sees (`data.document_mask`), in tokens: their mean and
    mean square (None: every document `mean_tokens` long, E[L²] = E[L]²). A run measures both
    (`models/documents.documents_record`); `pentatron plan --mean-doc-tokens/--mean-sq-doc-tokens` takes them."""

    mean_tokens: float
    mean_sq_tokens: float | None = None

    def problems(self) -> list[str]:
        out = []
        if not (math.isfinite(self.mean_tokens) and self.mean_tokens >= 1):
            out.append(f"mean document length must be >= 1 token, got {self.mean_tokens}")
        elif self.mean_sq_tokens is not None and not (math.isfinite(self.mean_sq_tokens)
                                                      and self.mean_sq_tokens >= self.mean_tokens ** 2 * (1 - 1e-9)):
            out.append(f"the mean squared document length ({self.mean_sq_tokens:g}) must be >= the mean length "
                       f"squared ({self.mean_tokens ** 2:g}): a mean of squares is never below the square of the mean")
        return out

    def square_keys(self, seq_len: int) -> float:
        """Keys per query over each document's full square: E[L²]/E[L] (Σ L² / s), at most s."""
        sq = self.mean_tokens ** 2 if self.mean_sq_tokens is None else self.mean_sq_tokens
        return min(float(seq_len), sq / self.mean_tokens)

    def causal_keys(self, seq_len: int) -> float:
        """Keys per query that causal attention within the documents computes: Σ L(L+1)/2 / s."""
        return (self.square_keys(seq_len) + 1) / 2

    def pair_share(self, seq_len: int) -> float:
        """The causal pairs within the documents as a share of the sample's causal pairs s(s+1)/2."""
        return self.causal_keys(seq_len) / ((seq_len + 1) / 2)


@dataclass(frozen=True)
class MoESpec:
    """Mixture-of-experts shape, until ModelConfig grows these fields (then `moe_of` reads them there)."""

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    n_shared_experts: int = 0
    shared_ffn_hidden_size: int = 0  # 0 -> same as expert_ffn_hidden_size
    first_dense_layers: int = 0  # leading layers that keep the dense MLP (DeepSeek style)

    def problems(self) -> list[str]:
        out = []
        for f in ("num_experts", "top_k", "expert_ffn_hidden_size"):
            if getattr(self, f) <= 0:
                out.append(f"moe.{f} must be > 0, got {getattr(self, f)}")
        if self.top_k > self.num_experts:
            out.append(f"moe.top_k={self.top_k} exceeds moe.num_experts={self.num_experts}")
        if self.n_shared_experts < 0 or self.first_dense_layers < 0 or self.shared_ffn_hidden_size < 0:
            out.append("moe.n_shared_experts, shared_ffn_hidden_size and first_dense_layers must be >= 0")
        return out

    @property
    def shared_ffn(self) -> int:
        return self.shared_ffn_hidden_size or self.expert_ffn_hidden_size


def moe_of(cfg: ModelConfig, moe: MoESpec | None = None) -> MoESpec | None:
    """The MoE spec to use: the explicit one, else the model config's `moe` (shared experts are one
    SwiGLU of n_shared·expert_ffn_size, counted as n_shared experts of the routed width)."""
    if moe is not None:
        return moe
    m = cfg.moe
    if m is None:
        return None
    return MoESpec(num_experts=m.n_experts, top_k=m.top_k, expert_ffn_hidden_size=m.expert_ffn_size,
                   n_shared_experts=m.n_shared_experts, first_dense_layers=m.first_dense_layers)


def _mlp_mats(cfg: ModelConfig) -> int:
    return 3 if cfg.mlp == "swiglu" else 2


@dataclass(frozen=True)
class LayerParams:
    """Parameter counts of one decoder layer, by role (exact for our bias-free RMSNorm architecture)."""

    attn: int  # q, k, v, o
    mlp_active: int  # matmul weights one token passes through (dense MLP, or router + top-k + shared)
    mlp_total: int  # all MLP weights held (dense MLP, or router + all experts + shared)
    expert_total: int  # routed-expert weights only (sharded by EP); 0 for dense layers
    norms: int  # the two RMSNorm gains (and Qwen3's q/k norm gains, head_dim each)


def layer_tensors(cfg: ModelConfig) -> int:
    """Parameter tensors of one decoder layer as our architecture holds them (no biases): q, k, v, o, the
    MLP's 3 (SwiGLU) or 2 matrices, 2 norms and Qwen3's 2 q/k norms."""
    return 4 + (3 if cfg.mlp == "swiglu" else 2) + 2 + (2 if cfg.qk_norm else 0)


def layer_params(cfg: ModelConfig, index: int = 0, moe: MoESpec | None = None) -> LayerParams:
    """Parameters of layer `index` (MoE layers differ from the first `first_dense_layers`)."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    attn = 2 * h * cfg.n_heads * cfg.head_dim + 2 * h * cfg.kv_dim
    k = _mlp_mats(cfg)
    moe = moe_of(cfg, moe)
    norms = 2 * h + (2 * cfg.head_dim if cfg.qk_norm else 0)
    if moe is None or index < moe.first_dense_layers:
        return LayerParams(attn, k * h * f, k * h * f, 0, norms)
    expert = k * h * moe.expert_ffn_hidden_size
    shared = moe.n_shared_experts * k * h * moe.shared_ffn
    router = h * moe.num_experts
    return LayerParams(attn, router + moe.top_k * expert + shared, router + moe.num_experts * expert + shared,
                       moe.num_experts * expert, norms)


def total_params(cfg: ModelConfig, moe: MoESpec | None = None) -> int:
    """All parameters held by the model (equals `cfg.num_params()` for dense models)."""
    layers = sum(lp.attn + lp.mlp_total + lp.norms for lp in (layer_params(cfg, i, moe)
                                                              for i in range(cfg.n_layers)))
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.vocab_size * cfg.hidden_size + layers + cfg.hidden_size + head


def matmul_params(cfg: ModelConfig, moe: MoESpec | None = None) -> int:
    """N_matmul: weights one token multiplies through (active experts only), LM head included."""
    layers = sum(lp.attn + lp.mlp_active for lp in (layer_params(cfg, i, moe) for i in range(cfg.n_layers)))
    return layers + cfg.vocab_size * cfg.hidden_size


@dataclass(frozen=True)
class FlopBreakdown:
    """Forward FLOPs per token by component; backward and totals derived from the B/W split."""

    layers_matmul: float  # decoder linear layers (attention projections + MLP/experts)
    attention: float  # QK^T and PV
    lm_head: float

    @property
    def forward(self) -> float:
        return self.layers_matmul + self.attention + self.lm_head

    @property
    def backward_input(self) -> float:
        """"B" pass: gradients w.r.t. activations (every matmul once, attention scores twice)."""
        return self.layers_matmul + 2 * self.attention + self.lm_head

    @property
    def backward_weight(self) -> float:
        """"W" pass: gradients w.r.t. weights (only weighted matmuls)."""
        return self.layers_matmul + self.lm_head

    @property
    def backward(self) -> float:
        return self.backward_input + self.backward_weight

    @property
    def training(self) -> float:
        return self.forward + self.backward


def flop_breakdown(cfg: ModelConfig, seq_len: int, *, causal: bool = False,
                   moe: MoESpec | None = None, documents: DocumentLengths | None = None) -> FlopBreakdown:
    """Forward FLOPs per token. `causal=True` counts only the unmasked half of the score square
    (the mean key count over positions 1..s is (s+1)/2), i.e. what a block-skipping kernel does.
    `documents`: attention within packed documents (the module docstring): E[L²]/E[L] keys per token,
    (E[L²]/E[L] + 1)/2 causal."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")
    moe = moe_of(cfg, moe)
    layers = sum(lp.attn + lp.mlp_active for lp in (layer_params(cfg, i, moe) for i in range(cfg.n_layers)))
    if documents is None:
        keys = (seq_len + 1) / 2 if causal else seq_len
    else:
        keys = documents.causal_keys(seq_len) if causal else documents.square_keys(seq_len)
    hq = cfg.n_heads * cfg.head_dim
    return FlopBreakdown(layers_matmul=2.0 * layers, attention=4.0 * cfg.n_layers * hq * keys,
                         lm_head=2.0 * cfg.hidden_size * cfg.vocab_size)


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, *, moe: MoESpec | None = None,
                            documents: DocumentLengths | None = None) -> float:
    return flop_breakdown(cfg, seq_len, moe=moe, documents=documents).forward


def backward_flops_per_token(cfg: ModelConfig, seq_len: int, *, moe: MoESpec | None = None,
                             documents: DocumentLengths | None = None) -> float:
    return flop_breakdown(cfg, seq_len, moe=moe, documents=documents).backward


def model_flops_per_token(cfg: ModelConfig, seq_len: int, *, moe: MoESpec | None = None,
                          documents: DocumentLengths | None = None) -> float:
    """Training FLOPs per token (fwd + bwd = 3x fwd) = 6*N_matmul + 12*L*h*s (packed documents: s becomes
    E[L²]/E[L], `MFU_CONVENTION`). The MFU numerator."""
    return flop_breakdown(cfg, seq_len, moe=moe, documents=documents).training


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: Recompute, *,
                              causal: bool = False, moe: MoESpec | None = None,
                              attention: str = "flash", early_stop: bool = False,
                              documents: DocumentLengths | None = None) -> float:
    """Extra forward work replayed in backward.
    selective (checkpointed `attn.core`): with a fused kernel (`attention="flash"`, GPU) the whole
    attention forward reruns; with the math path (meta/CPU) only QK^T does (PV's output is not saved).
    full: the whole block forward is replayed (Megatron's and DeepSpeed's checkpoint functions, and
    torchtitan, replay every op). With `early_stop=True` (torch's non-reentrant checkpoint as our
    trainer uses it, traced by `--verify`) the replay stops once every saved tensor is rebuilt, so the
    MLP down projection, whose output only feeds the residual add, is skipped (dense layers; MoE layers
    are charged in full: the combine needs the expert outputs).
    selective-op (torchtitan op-level SAC, parallelize_llama.py at 9dec370: of a block's aten.mm calls in
    forward order only the odd-numbered outputs are saved, q(1) v(3) w1(5) w2(7)): k, o and the up
    projection w3 replay (for a 2-matmul MLP: k, o and down), the attention kernel's output is saved
    (not replayed); MoE layers: half of their matmul FLOPs. With Float8 linears nothing is saved
    (`aten._scaled_mm` is not in the save list): see `sac_op_replayed_matmuls`.
    full-alternate: full recompute of every second block, i.e. half of `full`."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
    if attention not in ("flash", "math"):
        raise ValueError(f"attention must be 'flash' or 'math', got {attention!r}")
    fb = flop_breakdown(cfg, seq_len, causal=causal, moe=moe, documents=documents)
    if recompute == "none":
        return 0.0
    if recompute == "selective":
        return fb.attention if attention == "flash" else fb.attention / 2
    if recompute == "selective-op":
        return sac_op_replayed_matmul_flops(cfg, moe)
    full = fb.layers_matmul + fb.attention
    if early_stop:
        moe = moe_of(cfg, moe)
        dense_layers = cfg.n_layers if moe is None else min(cfg.n_layers, moe.first_dense_layers)
        full -= 2.0 * cfg.hidden_size * cfg.ffn_hidden_size * dense_layers
    return full / 2 if recompute == "full-alternate" else full


def block_matmuls(mlp: str) -> tuple[str, ...]:
    """A dense block's linears in forward order: q, k, v, o, then w1, w3, w2 for SwiGLU (gate, up, down)
    or up, down for a 2-matmul MLP."""
    return ("q", "k", "v", "o") + (("gate", "up", "down") if mlp == "swiglu" else ("up", "down"))


def sac_op_replayed_matmuls(mlp: str) -> tuple[str, ...]:
    """Which of a dense block's linears torchtitan's op-level SAC replays: the even-numbered aten.mm calls
    in forward order (`block_matmuls`)."""
    return block_matmuls(mlp)[1::2]


def sac_op_replayed_matmul_flops(cfg: ModelConfig, moe: MoESpec | None = None) -> float:
    """Forward FLOPs per token of the matmuls selective-op replays (dense layers exactly, MoE layers half)."""
    moe = moe_of(cfg, moe)
    h = cfg.hidden_size
    width = {"k": cfg.kv_dim, "o": cfg.n_heads * cfg.head_dim, "up": cfg.ffn_hidden_size, "down": cfg.ffn_hidden_size}
    dense = sum(2 * h * width[name] for name in sac_op_replayed_matmuls(cfg.mlp))
    total = 0.0
    for i in range(cfg.n_layers):
        lp = layer_params(cfg, i, moe)
        total += (lp.attn + lp.mlp_active) if lp.expert_total else dense  # 2 FLOPs x params, halved
    return total


LOSS_CHUNK_TOKENS = TrainConfig.loss_chunk_tokens  # training's default chunk of the loss


def loss_replayed_tokens(tokens: float, chunk_tokens: int, split_backward: bool = False) -> float:
    """Of one micro-batch's `tokens` (as the loss sees them: mb·seq/cp), how many rows our chunked loss
    (models/loss.py) recomputes the head for in backward: every chunk but the last, which forward keeps.
    A split backward (zero bubble) gives the kept chunk to B; W recomputes every chunk."""
    n = max(tokens, 0.0)
    chunk = max(chunk_tokens, 1)
    before_last = (math.ceil(n / chunk) - 1) * chunk if n > 0 else 0.0
    return before_last + (n if split_backward else 0.0)


def loss_recompute_flops_per_token(cfg: ModelConfig, cross_entropy: str = "eager", split_backward: bool = False,
                                   *, tokens: float = 0.0, chunk_tokens: int = LOSS_CHUNK_TOKENS) -> float:
    """Extra LM-head work of the loss, per token: our chunked loss (cross_entropy="chunked") recomputes
    the head's forward GEMM (2·h·V per row) for the rows of `loss_replayed_tokens` out of the `tokens` of
    a micro-batch. Recompute like the layers' (hardware FLOPs, charged to B), never model FLOPs: MFU is
    unchanged. The other losses keep (or fuse away) the logits: nothing replays."""
    if cross_entropy != "chunked" or tokens <= 0:
        return 0.0
    share = loss_replayed_tokens(tokens, chunk_tokens, split_backward) / tokens
    return 2.0 * cfg.hidden_size * cfg.vocab_size * share


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: Recompute = "none", *,
                             moe: MoESpec | None = None, attention: str = "flash", early_stop: bool = False,
                             cross_entropy: str = "eager", split_backward: bool = False,
                             loss_tokens: float = 0.0, chunk_tokens: int = LOSS_CHUNK_TOKENS,
                             documents: DocumentLengths | None = None) -> float:
    """Model FLOPs plus recomputation (the layers' and the chunked loss's head, for micro-batches of
    `loss_tokens` rows), same counting convention: the HFU numerator."""
    return (model_flops_per_token(cfg, seq_len, moe=moe, documents=documents)
            + recompute_flops_per_token(cfg, seq_len, recompute, moe=moe, attention=attention, early_stop=early_stop,
                                        documents=documents)
            + loss_recompute_flops_per_token(cfg, cross_entropy, split_backward, tokens=loss_tokens,
                                             chunk_tokens=chunk_tokens))


def executed_phase_flops(cfg: ModelConfig, seq_len: int, recompute: Recompute = "none", *,
                         moe: MoESpec | None = None, cross_entropy: str = "eager", loss_tokens: float = 0.0,
                         chunk_tokens: int = LOSS_CHUNK_TOKENS,
                         documents: DocumentLengths | None = None) -> tuple[float, float, float]:
    """(F, B, W) FLOPs per token that a FlashAttention-style causal kernel really executes: half the
    score square; its backward does 5 score-sized matmuls (dQ, dK, dV, dP and a re-computed QK^T) against
    2 in forward. Recomputation (the layers' and the chunked loss's head GEMM) is charged to B, where it
    runs. The time model uses these."""
    fb = flop_breakdown(cfg, seq_len, causal=True, moe=moe, documents=documents)
    f = fb.forward
    b = fb.layers_matmul + 2.5 * fb.attention + fb.lm_head
    b += recompute_flops_per_token(cfg, seq_len, recompute, causal=True, moe=moe, documents=documents)
    b += loss_recompute_flops_per_token(cfg, cross_entropy, tokens=loss_tokens, chunk_tokens=chunk_tokens)
    return f, b, fb.backward_weight


def model_flops_per_step(cfg: ModelConfig, seq_len: int, tokens: int, *, moe: MoESpec | None = None,
                         documents: DocumentLengths | None = None) -> float:
    return model_flops_per_token(cfg, seq_len, moe=moe, documents=documents) * tokens
