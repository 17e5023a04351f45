"""Mixtral interop: a tiny random `MixtralForCausalLM` built locally (never downloaded) is imported with
logits parity (fp32, ≤ 1e-5 of the logit scale), exported back bit-exactly, and configs without a
Mixtral equivalent are refused by name."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pentatron.models import hf
from pentatron.models.registry import MODELS
from tests.models.test_hf import _hf_logits, _randomise, _rel_err, _tokens

transformers = pytest.importorskip("transformers")
TOL = 1e-5


def _mixtral(d: Path, seed: int = 0, **overrides: object) -> transformers.MixtralForCausalLM:
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
              num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=None,
              router_aux_loss_coef=0.02)
    kw.update(overrides)
    cfg = transformers.MixtralConfig(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg).eval()
    _randomise(model, seed)
    model.save_pretrained(d, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.MixtralForCausalLM]:
    d = tmp_path_factory.mktemp("mixtral")
    return d, _mixtral(d)


def test_import_matches_transformers(mixtral: tuple) -> None:
    d, ref = mixtral
    model = hf.import_hf(d).eval()
    assert model.cfg.moe is not None and model.cfg.moe.n_experts == 4 and model.cfg.moe.aux_loss_coef == 0.02
    assert model.layers[0].moe.experts.gate_proj.shape == (4, 48, 64)
    tokens = _tokens()
    with torch.no_grad():
        ours = model(tokens)
    want = _hf_logits(ref, tokens)
    assert want.abs().max() > 0.5
    err = _rel_err(ours, want)
    print(f"mixtral: max|ours-HF|/max|HF| = {err:.2e}")
    assert err < TOL


def test_routing_matters(mixtral: tuple) -> None:
    """Parity would be vacuous if the experts were interchangeable: swapping two experts' weights in
    every layer changes the logits."""
    d, ref = mixtral
    model = hf.import_hf(d).eval()
    with torch.no_grad():
        for layer in model.layers:
            for w in (layer.moe.experts.gate_proj, layer.moe.experts.up_proj, layer.moe.experts.down_proj):
                w.copy_(w[[1, 0, 2, 3]])
        assert _rel_err(model(_tokens()), _hf_logits(ref, _tokens())) > 1e-2


def test_export_roundtrip(mixtral: tuple, tmp_path: Path) -> None:
    d, ref = mixtral
    model = hf.import_hf(d)
    out = tmp_path / "export"
    hf.export_hf(model, out)
    cfg = json.loads((out / hf.CONFIG_NAME).read_text())
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 4
    again = hf.import_hf(out)
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    theirs = transformers.MixtralForCausalLM.from_pretrained(out, local_files_only=True,
                                                             attn_implementation="eager").eval()
    tokens = _tokens()
    assert torch.equal(_hf_logits(theirs, tokens), _hf_logits(ref, tokens))


def test_config_roundtrip_and_refusals() -> None:
    cfg = MODELS["mixtral-8x7b"]
    assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg
    t = transformers.MixtralConfig(**{k: v for k, v in hf.config_to_hf(cfg).items()
                                      if k not in ("architectures", "model_type")})
    assert (t.num_local_experts, t.num_experts_per_tok, t.intermediate_size) == (8, 2, 14336)
    with pytest.raises(ValueError, match="n_shared_experts=1.*first_dense_layers=1"):
        hf.config_to_hf(MODELS["debug-moe"])
    with pytest.raises(ValueError, match="score='softmax'"):
        hf.config_to_hf(replace(cfg, moe=replace(cfg.moe, score="sigmoid")))
    with pytest.raises(ValueError, match="sliding_window"):
        hf.config_from_hf(dict(hf.config_to_hf(cfg), sliding_window=4096))
