"""How a Llama splits over tensor-parallel ranks: a table from module path patterns (the model's own
attribute names, `*` for any layer index) to a sharding style. The styles are generic and implemented
once in `parallel/tensor.py`; this table is the only Llama-specific part (as in torchtitan, where each
model ships its own plan beside its code).

Styles:
- "region": the module's input enters the tensor-parallel region once (f, or the sequence all-gather
  under sequence parallelism) — one collective for q/k/v, one for gate/up;
- "colwise": output features split over tp (inside a region);
- "colwise_heads": output features split by attention heads of `head_dim` (the parent's attribute),
  heads replicated over tp/n ranks when tp exceeds their number n (GQA's kv heads);
- "rowwise": input features split; the partial outputs are all-reduced (or reduce-scattered under SP);
- "sequence_norm": replicated; under SP each rank sees a slice of the sequence, so its gradient is summed;
- "head_norm": replicated gain over head_dim applied to every local head (Qwen3's q/k norms): each rank's
  gradient covers its own heads, so it is summed over tp with or without SP (a replicated kv head's
  k_norm gradient is partial too: each replica saw only its own query heads, so the sum is again right);
- "vocab_embedding": rows (vocabulary) split; partial lookups summed (or reduce-scattered under SP);
- "vocab_head": output vocabulary split (sharing the embedding's shard when tied); logits stay split.
"""

from __future__ import annotations

LLAMA_TP_PLAN: dict[str, str] = {
    "embed": "vocab_embedding",
    "layers.*.attn_norm": "sequence_norm",
    "layers.*.attn": "region",
    "layers.*.attn.q_proj": "colwise_heads",
    "layers.*.attn.k_proj": "colwise_heads",
    "layers.*.attn.v_proj": "colwise_heads",
    "layers.*.attn.o_proj": "rowwise",
    "layers.*.attn.q_norm": "head_norm",  # Qwen3 (ModelConfig.qk_norm); absent modules match nothing
    "layers.*.attn.k_norm": "head_norm",
    "layers.*.mlp_norm": "sequence_norm",
    "layers.*.mlp": "region",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "norm": "sequence_norm",
    "lm_head": "vocab_head",
}
