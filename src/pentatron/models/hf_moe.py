"""Hugging Face interop for Mixtral-style MoE checkpoints (`MixtralForCausalLM`), used by `models/hf.py`.

A Mixtral checkpoint is a Llama one whose MLPs are `block_sparse_moe`: a router `gate.weight` [E, h] and
E experts `experts.{j}.w1` (gate) / `w3` (up) [f, h] and `w2` (down) [h, f] — the published on-disk
layout, which transformers 5.x also reads (it fuses the experts when loading). Our experts are stacked
[E, …] tensors, so import stacks the per-expert tensors and export splits them again.

Mixtral routing is exactly ours with softmax scores, renormalised top-k weights, no shared experts,
no bias, every layer MoE; any other MoE config is refused on export, naming the field.

Qwen3-MoE (`Qwen3MoeForCausalLM`, a `qk_norm` model with experts) stores the same tensors as `mlp.gate.weight`
and `mlp.experts.{j}.gate_proj|up_proj|down_proj.weight`; its routing is Mixtral's with `norm_topk_prob`
either way (the published models: true). Layers without experts (`mlp_only_layers`, `decoder_sparse_step`
> 1) are refused.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from pentatron.models.config import ModelConfig, MoEConfig

_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_W_TO_OURS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight")


def is_mixtral(d: dict[str, Any]) -> bool:
    return d.get("model_type") == "mixtral"


def is_qwen3_moe(d: dict[str, Any]) -> bool:
    return d.get("model_type") == "qwen3_moe"


def moe_from_qwen3(d: dict[str, Any], problems: list[str]) -> MoEConfig | None:
    """The MoE part of a Qwen3-MoE config.json (problems appended, each naming its key)."""
    if d.get("decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step={d['decoder_sparse_step']} is not supported (only 1: every layer MoE)")
    if d.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers={d['mlp_only_layers']} is not supported (every layer MoE)")
    # the published spelling; transformers 5.x writes num_local_experts
    n_experts = d.get("num_experts", d.get("num_local_experts"))
    missing = [k for k in ("num_experts_per_tok", "moe_intermediate_size") if d.get(k) is None]
    if missing or n_experts is None:
        problems.append(f"config is missing {', '.join(missing + (['num_experts'] if n_experts is None else []))}")
        return None
    return MoEConfig(n_experts=n_experts, top_k=d["num_experts_per_tok"],
                     expert_ffn_size=d["moe_intermediate_size"], norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                     aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0)))


def moe_from_mixtral(d: dict[str, Any], problems: list[str]) -> MoEConfig | None:
    """The MoE part of a Mixtral config.json (problems appended, each naming its key)."""
    if d.get("sliding_window") is not None:
        problems.append(f"sliding_window={d['sliding_window']} is not supported (only full attention)")
    if d.get("router_jitter_noise", 0.0):
        problems.append(f"router_jitter_noise={d['router_jitter_noise']} is not supported (only 0)")
    missing = [k for k in ("num_local_experts", "num_experts_per_tok", "intermediate_size") if d.get(k) is None]
    if missing:
        problems.append(f"config is missing {', '.join(missing)}")
        return None
    return MoEConfig(n_experts=d["num_local_experts"], top_k=d["num_experts_per_tok"],
                     expert_ffn_size=d["intermediate_size"], aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0)))


def mixtral_problems(cfg: ModelConfig) -> list[str]:
    """Why `cfg` has no MixtralForCausalLM equivalent (empty when it has one)."""
    m = cfg.moe
    assert m is not None
    out = []
    if m.n_shared_experts:
        out.append(f"moe.n_shared_experts={m.n_shared_experts} (Mixtral has none)")
    if m.first_dense_layers:
        out.append(f"moe.first_dense_layers={m.first_dense_layers} (every Mixtral layer is MoE)")
    if cfg.qk_norm:  # Qwen3-MoE: norm_topk_prob either way
        if m.score != "softmax" or m.route_scale != 1.0:
            out.append("model.moe routing must be score='softmax', route_scale=1 (Qwen3-MoE's)")
    elif m.score != "softmax" or not m.norm_topk_prob or m.route_scale != 1.0:
        out.append("model.moe routing must be score='softmax', norm_topk_prob=true, route_scale=1 (Mixtral's)")
    if m.capacity_factor is not None:
        out.append(f"moe.capacity_factor={m.capacity_factor} (Mixtral is dropless)")
    if m.bias_update_rate:
        out.append(f"moe.bias_update_rate={m.bias_update_rate} (Mixtral has no selection bias)")
    return out


def mixtral_config(cfg: ModelConfig, llama: dict[str, Any]) -> dict[str, Any]:
    """A `MixtralConfig` config.json from the Llama one `config_to_hf` wrote for the same shape."""
    m = cfg.moe
    assert m is not None
    out = {k: v for k, v in llama.items() if k not in ("mlp_bias", "rope_scaling")}
    out.update(architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=m.expert_ffn_size,
               num_local_experts=m.n_experts, num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_loss_coef,
               output_router_logits=False, sliding_window=None, router_jitter_noise=0.0)
    return out


def qwen3_moe_config(cfg: ModelConfig, qwen3: dict[str, Any]) -> dict[str, Any]:
    """A `Qwen3MoeConfig` config.json from the Qwen3 one `config_to_hf` wrote for the same shape."""
    m = cfg.moe
    assert m is not None
    out = dict(qwen3)
    out.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", moe_intermediate_size=m.expert_ffn_size,
               num_experts=m.n_experts, num_experts_per_tok=m.top_k, norm_topk_prob=m.norm_topk_prob,
               router_aux_loss_coef=m.aux_loss_coef, output_router_logits=False, decoder_sparse_step=1,
               mlp_only_layers=[])
    return out


def layer_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The feed-forward tensors of one Mixtral layer (HF names under `prefix` = "model.layers.{i}.")."""
    m = cfg.moe
    assert m is not None
    h, f = cfg.hidden_size, m.expert_ffn_size
    block, names = ("mlp", ("gate_proj", "down_proj", "up_proj")) if cfg.qk_norm else ("block_sparse_moe",
                                                                                     ("w1", "w2", "w3"))
    out: dict[str, tuple[int, ...]] = {f"{prefix}{block}.gate.weight": (m.n_experts, h)}
    for j in range(m.n_experts):
        e = f"{prefix}{block}.experts.{j}."
        out |= {e + names[0] + ".weight": (f, h), e + names[1] + ".weight": (h, f), e + names[2] + ".weight": (f, h)}
    return out


def hf_to_ours(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors (any names) → ours for the MoE ones: experts stacked per layer and weight, router
    renamed. Other names are left as they are, for the Llama mapping."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in sd.items():
        m = _EXPERT.fullmatch(name)
        if m:
            experts.setdefault((m.group(1), _W_TO_OURS.get(m.group(3), m.group(3))), {})[int(m.group(2))] = t
            continue
        g = _ROUTER.fullmatch(name)
        out[f"layers.{g.group(1)}.moe.router.weight" if g else name] = t
    for (layer, w), by_index in experts.items():
        out[f"layers.{layer}.moe.experts.{w}"] = torch.stack([by_index[j] for j in sorted(by_index)])
    return out


def ours_to_hf(name: str, t: torch.Tensor, qwen3: bool = False) -> list[tuple[str, torch.Tensor]] | None:
    """(HF name, tensor) pairs for one of our MoE tensors (Mixtral's names, or Qwen3-MoE's); None for a
    non-MoE name."""
    m = re.fullmatch(r"layers\.(\d+)\.moe\.(router\.weight|experts\.(gate_proj|up_proj|down_proj))", name)
    if m is None:
        return None
    p = f"model.layers.{m.group(1)}.{'mlp' if qwen3 else 'block_sparse_moe'}."
    if m.group(3) is None:
        return [(p + "gate.weight", t)]
    w = m.group(3) if qwen3 else {v: k for k, v in _W_TO_OURS.items()}[m.group(3)]
    return [(f"{p}experts.{j}.{w}.weight", t[j]) for j in range(t.shape[0])]
