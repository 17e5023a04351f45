"""Activation memory of one decoder layer under tensor (and sequence) parallelism: the derived formula
for *our* layer, and a meter that measures what autograd really keeps.

Derivation (docs/tensor_parallel.md has it in full): with s·b tokens per rank before SP, hidden h,
FFN width f, a query heads, kv width h_kv = n_kv·d, t tensor-parallel ranks, activations of e bytes,
no recompute, and SDPA's fused kernel (it keeps q, k, v, the output and a fp32 log-sum-exp per head
and token, never the s×s scores), autograd keeps per layer:

    2 RMSNorms      the fp32 input (x.float(): 4 bytes), the normalised output (e), 1/rms (fp32 per token)
    2 block inputs  the normalised input of q/k/v and of gate/up (e each; shared by the three / two linears)
    attention       q and the output (h/t each), k and v (h_kv/min(t, n_kv) each: one head when kv heads
                    are replicated), log-sum-exp (a/t per token, fp32); RoPE keeps only its cos/sin tables
    SwiGLU          gate and up outputs, silu(gate), the product (4 f/t); GELU: up and gelu(up) (2 f/t)
    RoPE            nothing in fp32; with e < 4, the cos/sin tables cast to e bytes for q and for k (4·s·d·e)
    q/k RMSNorms    (Qwen3, qk_norm) per local q and k head as the block norms over d: the fp32 input (4d),
                    the normalised output (e·d), 1/rms (4); the query width a·d may differ from h

    M = 2·[(4+e)·sbh + 4·sb]/t_sp + 2e·sbh + e·sb·[(2h + k·f)/t + 2·h_kv/min(t, n_kv)] + 4·sb·a/t
        (+ 4·s·d·e when e < 4)   [h in (2h + k·f) is the query width a·d; + the q/k norms with qk_norm]

with t_sp = t under sequence parallelism, 1 otherwise, and k = 4 (SwiGLU) or 2 (GELU). The two block
inputs stay full-size even under SP: our column-parallel layers let autograd save the all-gathered
input, which keeps SP's communication equal to TP's (Megatron instead saves the local shard and
all-gathers it again in the backward pass, one extra all-gather per region).

An MoE layer (models/moe.py) keeps, in place of the MLP's k·f/t, `moe_activation_bytes`: MoE layers are
replicated over tp, so each tp rank runs the whole layer on its T = sb tokens (T = sb/t under SP, whose
MoE input is then the sequence shard: its block input e·sbh/t). R = T·k routed rows (with a capacity at
most min(T·k, E·cap): a bound, the rows kept depend on the routing; cap taken on the rank's T, which a
rank's uneven share can exceed under cp/sp, where cap is the micro-batch's), E experts of width f_e, a
shared SwiGLU of width f_s. The block input e·T·h is kept by the shared experts' linears or, when e >= 4,
by the router's (`wide` copies nothing); otherwise by nothing.

    router   fp32 copy of the input and of the router weight when e < 4 (4·T·h, 4·E·h: `wide`), the
             softmax/sigmoid scores 4·T·E, the top-k ids 8·T·k, with norm_topk_prob the gathered weights
             and their sum 4·T·(k + 1); aux loss: the assignment shares 4·E (sigmoid: + the scores' sum
             4·T); z-loss: the logits and their logsumexp 4·T·(E + 1); either loss: its 0-dim value 4
    dispatch the flat order 8·T·k (whole even when cut by a capacity), token ids 8·R, the gathered rows
             e·R·h, the grouped GEMMs' int32 offsets 4·E
    experts  gate, up, silu(gate) and their product e·R·4·f_e (the grouped GEMMs' inputs and the SwiGLU's)
    combine  the outputs e·R·h, the combine weights cast to e (e·R), the weighted outputs e·R·h
             (`index_add_` keeps its source for the shape of its gradient)
    shared   its SwiGLU, 4·e·T·f_s

Under expert parallelism (ep > 1) the local experts run on the rows received (taken as R: balanced
routing) regrouped by expert, and the regrouping and its inverse keep 8 bytes per row each (+16·R); the
gathered rows e·R·h are then the regrouped received ones (traced at ep 2 with each rank's received rows).
The experts' terms are `torch._grouped_mm`'s (CPU; CUDA bf16 on sm90+); where it is unsupported (fp32 on
CUDA, fp64) the padded batched matmul keeps other tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING

from pentatron.models.config import ModelConfig

if TYPE_CHECKING:  # the formula is pure arithmetic: the planner imports it without torch
    import torch


def moe_activation_bytes(cfg: ModelConfig, tokens: int, act_bytes: int = 4, ep: int = 1) -> int:
    """Bytes one MoE feed-forward (models/moe.py) keeps for backward beyond its input, for `tokens` tokens
    seen by this rank's MoE (the derivation above; dropless: a capacity bounds the same count from above)."""
    m = cfg.moe
    if m is None:
        raise ValueError("moe_activation_bytes needs a model config with an MoE section")
    t, h, e, n, k = tokens, cfg.hidden_size, act_bytes, m.n_experts, m.top_k
    rows = t * k
    if m.capacity_factor is not None:  # at most cap per expert (the rows kept depend on the routing)
        rows = min(rows, n * math.ceil(m.capacity_factor * t * k / n))
    router = 4 * t * n + 8 * t * k + (4 * t * (k + 1) if m.norm_topk_prob else 0)
    if e < 4:  # `wide`: the router runs in fp32 on copies of its input and weight
        router += 4 * t * h + 4 * n * h
    if m.aux_loss_coef > 0:
        router += 4 * n + (4 * t if m.score == "sigmoid" else 0)
    if m.z_loss_coef > 0:
        router += 4 * t * (n + 1)
    if m.aux_loss_coef > 0 or m.z_loss_coef > 0:
        router += 4  # AuxLossAutoScaler's 0-dim loss
    dispatch = 8 * t * k + 8 * rows + e * rows * h + 4 * (n // ep)
    experts = e * rows * 4 * m.expert_ffn_size + (16 * rows if ep > 1 else 0)
    combine = e * rows * (2 * h + 1)
    shared = 4 * e * t * m.n_shared_experts * m.expert_ffn_size
    return router + dispatch + experts + combine + shared


def layer_activation_bytes(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int = 1, sp: bool = False,
                           act_bytes: int = 4, layer: int = 0, ep: int = 1) -> int:
    """Bytes layer `layer` keeps for backward on one tp rank (the derived formula above; an MoE layer's
    feed-forward is `moe_activation_bytes`)."""
    s, b, h, e = seq_len, micro_batch, cfg.hidden_size, act_bytes
    t_sp = tp if sp else 1
    k = 4 if cfg.mlp == "swiglu" else 2
    kv_local = cfg.kv_dim // min(tp, cfg.n_kv_heads)
    norms = 2 * ((4 + e) * s * b * h + 4 * s * b) // t_sp
    moe = cfg.is_moe_layer(layer)
    # the MLP's input is all-gathered for its column-parallel linears; an MoE keeps its (SP) shard, and only
    # for the shared experts or as the router's own input (e >= 4: `wide` copies nothing)
    mlp_input = e * s * b * h
    if moe and cfg.moe is not None:
        mlp_input = mlp_input // t_sp if cfg.moe.n_shared_experts or e >= 4 else 0
    block_inputs = e * s * b * h + mlp_input
    hq = cfg.n_heads * cfg.head_dim  # q and the attention output (= h unless head_dim is decoupled)
    ffn = moe_activation_bytes(cfg, s * b // t_sp, e, ep) if moe else 0
    sharded = e * s * b * ((2 * hq + (0 if moe else k * cfg.ffn_hidden_size)) // tp + 2 * kv_local)
    lse = 4 * s * b * cfg.n_heads // tp
    # RoPE casts the shared fp32 cos/sin tables to the activation dtype: a fresh [s, d] pair for q and
    # one for k in every layer, kept by the multiplies (in fp32 they are the shared tables themselves).
    rope = 0 if e == 4 else 4 * s * cfg.head_dim * e
    qk_norms = 0
    if cfg.qk_norm:  # inside the attention region: split by heads like q and k, never by SP
        heads_local = cfg.n_heads // tp + cfg.n_kv_heads // min(tp, cfg.n_kv_heads)
        qk_norms = s * b * heads_local * ((4 + e) * cfg.head_dim + 4)
    return norms + block_inputs + sharded + lse + rope + qk_norms + ffn


class SavedTensorMeter:
    """Counts the bytes autograd saves for backward inside the `with` block, each storage once (q/k/v
    share their input; views share their base), leaving out `exclude` (parameters, shared RoPE
    tables: they are not this layer's activations).

        with SavedTensorMeter(exclude=model.parameters()) as meter:
            y = layer(x)
        meter.bytes
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        import torch

        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        self._sizes: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._skip:
            self._sizes[ptr] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values())

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._hooks.__exit__(exc_type, exc, tb)
