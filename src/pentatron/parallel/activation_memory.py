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
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING

from pentatron.models.config import ModelConfig

if TYPE_CHECKING:  # the formula is pure arithmetic: the planner imports it without torch
    import torch


def layer_activation_bytes(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int = 1, sp: bool = False,
                           act_bytes: int = 4) -> int:
    """Bytes one decoder layer keeps for backward on one tp rank (the derived formula above)."""
    s, b, h, e = seq_len, micro_batch, cfg.hidden_size, act_bytes
    t_sp = tp if sp else 1
    k = 4 if cfg.mlp == "swiglu" else 2
    kv_local = cfg.kv_dim // min(tp, cfg.n_kv_heads)
    norms = 2 * ((4 + e) * s * b * h + 4 * s * b) // t_sp
    block_inputs = 2 * e * s * b * h
    hq = cfg.n_heads * cfg.head_dim  # q and the attention output (= h unless head_dim is decoupled)
    sharded = e * s * b * ((2 * hq + k * cfg.ffn_hidden_size) // tp + 2 * kv_local)
    lse = 4 * s * b * cfg.n_heads // tp
    # RoPE casts the shared fp32 cos/sin tables to the activation dtype: a fresh [s, d] pair for q and
    # one for k in every layer, kept by the multiplies (in fp32 they are the shared tables themselves).
    rope = 0 if e == 4 else 4 * s * cfg.head_dim * e
    qk_norms = 0
    if cfg.qk_norm:  # inside the attention region: split by heads like q and k, never by SP
        heads_local = cfg.n_heads // tp + cfg.n_kv_heads // min(tp, cfg.n_kv_heads)
        qk_norms = s * b * heads_local * ((4 + e) * cfg.head_dim + 4)
    return norms + block_inputs + sharded + lse + rope + qk_norms


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
