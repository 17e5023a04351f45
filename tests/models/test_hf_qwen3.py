"""Qwen3 (dense) Hugging Face interop: a tiny random `Qwen3ForCausalLM` built locally (never downloaded) with
what sets Qwen3 apart from a Llama — q/k RMSNorm over head_dim, head_dim decoupled from hidden/heads,
rope_theta 1e6, tied embeddings — imported, compared with transformers' logits in float64, exported and
loaded back by transformers, and taken through `checkpoint import-hf` / `export-hf`.

Tolerance: 1e-9 relative to the logit scale in float64 would hold for two fp64 implementations, but both
sides keep the RoPE cos/sin tables in fp32 (ours: computed in fp64, stored fp32; transformers: computed in
fp32) and transformers' Qwen3RMSNorm computes in fp32 even for fp64 inputs, so agreement is limited to
fp32 rounding (eps 1.2e-7) grown through the layers: TOL = 1e-5, as the Llama interop tests use. A dropped
or misplaced q/k norm (checked below) moves the logits by O(1).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pentatron.cli import main
from pentatron.models import hf

transformers = pytest.importorskip("transformers")

TOL = 1e-5


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A float64 Qwen3ForCausalLM: hidden 64, 4 heads of 24 (4·24 ≠ 64), 2 kv heads, tied, random gains."""
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                   max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e6,
                                   tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # O(1) logits, non-trivial norm gains (q/k norms included)
        for _, p in sorted(model.named_parameters()):
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype) if p.ndim == 1 else
                    torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(p.shape[1]))
    d = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(d, safe_serialization=True)
    return d, model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@torch.no_grad()
def test_qwen3_import_export_logits_match_transformers_in_float64(qwen3, tmp_path: Path) -> None:
    d, ref = qwen3
    model = hf.import_hf(d, dtype=torch.float64).eval()
    c = model.cfg
    assert (c.qk_norm, c.attn_head_dim, c.head_dim, c.rope_theta, c.norm_eps, c.tie_embeddings) == \
        (True, 24, 24, 1e6, 1e-6, True)
    assert model.lm_head.weight is model.embed.weight
    tokens = _tokens()
    want = ref(input_ids=tokens).logits
    assert want.dtype == torch.float64 and want.abs().max() > 0.5
    err = _rel_err(model(tokens), want)
    print(f"qwen3 import fp64: max|ours-HF|/max|HF| = {err:.2e}")
    assert err < TOL

    # the q/k norms are applied (with their own gains): without them the logits are far off
    for layer in model.layers:
        layer.attn.q_norm.weight.mul_(2)
    assert _rel_err(model(tokens), want) > 1e-2
    for layer in model.layers:
        layer.attn.q_norm.weight.div_(2)

    # export: bit-exact round trip, and transformers computes the original logits from it
    out = tmp_path / "export"
    hf.export_hf(model, out)
    written = json.loads((out / hf.CONFIG_NAME).read_text())
    assert written["model_type"] == "qwen3" and written["architectures"] == ["Qwen3ForCausalLM"]
    again = hf.import_hf(out, dtype=torch.float64)
    assert again.cfg == model.cfg
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(out, local_files_only=True,
                                                           attn_implementation="eager", dtype=torch.float64).eval()
    assert torch.equal(theirs(input_ids=tokens).logits, want)


def test_qwen3_through_a_training_checkpoint(qwen3, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`checkpoint import-hf` → step-0 checkpoint → `checkpoint export-hf` → transformers: the same model."""
    d, ref = qwen3
    assert main(["checkpoint", "import-hf", str(d), str(tmp_path / "ck")]) == 0
    assert main(["checkpoint", "export-hf", str(tmp_path / "ck"), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True,
                                                           attn_implementation="eager").eval()
    assert theirs.config.head_dim == 24 and theirs.config.tie_word_embeddings
    tokens = _tokens()
    with torch.no_grad():  # the checkpoint is fp32: the weights are the fp64 ones rounded once
        err = _rel_err(theirs(input_ids=tokens).logits.double(), ref(input_ids=tokens).logits)
    assert err < 1e-5


def test_qwen3_config_errors() -> None:
    base = dict(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24)
    assert hf.config_from_hf(base).attn_head_dim == 24
    with pytest.raises(ValueError, match="sliding-window"):
        hf.config_from_hf(base | {"use_sliding_window": True, "sliding_window": 16})
    with pytest.raises(ValueError, match="decoupled head_dim is supported for model_type 'qwen3' only"):
        hf.config_from_hf(base | {"model_type": "llama"})


@torch.no_grad()
def test_qwen3_moe_import_export_logits_match_transformers_in_float64(tmp_path: Path) -> None:
    """Qwen3-MoE: the q/k norms and decoupled heads above, with experts under `mlp.experts.{j}.*` and the router
    at `mlp.gate` (transformers' on-disk names), top-2 of 4 renormalised. transformers computes the router's
    softmax in fp32 even for fp64 weights: the same TOL."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                      max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e6,
                                      tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the per-expert loop: its default grouped GEMM refuses fp64 on CPU
    torch.manual_seed(1)
    ref = transformers.Qwen3MoeForCausalLM(cfg).double().eval()
    g = torch.Generator().manual_seed(1)
    for _, p in sorted(ref.named_parameters()):
        p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype) if p.ndim == 1 else
                torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(p.shape[-1]))
    src = tmp_path / "src"
    ref.save_pretrained(src, safe_serialization=True)
    model = hf.import_hf(src, dtype=torch.float64).eval()
    m = model.cfg.moe
    assert model.cfg.qk_norm and (m.n_experts, m.top_k, m.expert_ffn_size, m.norm_topk_prob) == (4, 2, 32, True)
    tokens = _tokens()
    want = ref(input_ids=tokens).logits
    err = _rel_err(model(tokens), want)
    print(f"qwen3-moe import fp64: max|ours-HF|/max|HF| = {err:.2e}")
    assert want.abs().max() > 0.5 and err < TOL

    out = tmp_path / "export"
    hf.export_hf(model, out)
    assert json.loads((out / hf.CONFIG_NAME).read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    again = hf.import_hf(out, dtype=torch.float64)
    assert again.cfg == model.cfg
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    theirs = transformers.Qwen3MoeForCausalLM.from_pretrained(
        out, local_files_only=True, attn_implementation="eager", experts_implementation="eager", dtype=torch.float64)
    theirs.eval()
    assert torch.equal(theirs(input_ids=tokens).logits, want)
