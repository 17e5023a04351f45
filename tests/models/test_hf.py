"""Hugging Face interop: logits parity with transformers' LlamaForCausalLM, bit-exact export
round-trips, and clear errors for bad checkpoints. Reference models are built locally from a small
LlamaConfig (never downloaded). All fp32.

Logit error metric throughout: max|ours - HF| / max|HF logit| (max abs error relative to the logit
scale); weights are re-initialised so that logits are O(1), which keeps that metric meaningful.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pentatron.models import hf
from pentatron.models.config import ModelConfig
from pentatron.models.registry import MODELS
from pentatron.writes import WriteError

transformers = pytest.importorskip("transformers")

TOL = 1e-5
SEQ = 48  # > original_max_position_embeddings in the llama3 case, so the scaling matters

# name → (LlamaConfig overrides, save_pretrained max_shard_size)
CASES: dict[str, tuple[dict, str | None]] = {
    "untied": ({"num_key_value_heads": 4}, None),
    "tied": ({"num_key_value_heads": 4, "tie_word_embeddings": True}, None),
    "gqa": ({"num_key_value_heads": 2}, None),
    "llama3_rope": ({"num_key_value_heads": 2, "rope_theta": 10000.0, "max_position_embeddings": 128,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
                    None),
    "sharded": ({"num_key_value_heads": 2, "num_hidden_layers": 3}, "40KB"),
}


def _hf_config(**overrides: object) -> transformers.LlamaConfig:
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
              rope_theta=10000.0, tie_word_embeddings=False)
    kw.update(overrides)
    cfg = transformers.LlamaConfig(**kw)
    cfg._attn_implementation = "eager"  # the plain reference path (softmax in fp32)
    return cfg


@torch.no_grad()
def _randomise(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations and non-trivial norm gains, so that a swapped or mis-transposed tensor, or a
    wrong RoPE, shows in the logits well above TOL."""
    g = torch.Generator().manual_seed(seed)
    for _, p in sorted(model.named_parameters()):
        if p.ndim == 1:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def _save_hf(d: Path, overrides: dict, shard: str | None, seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_hf_config(**overrides)).eval()
    _randomise(model, seed)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(d, safe_serialization=True, **kw)
    return model


def _tokens(vocab: int = 256, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _hf_logits(model: transformers.LlamaForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens).logits


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, transformers.LlamaForCausalLM]]:
    out = {}
    for i, (name, (overrides, shard)) in enumerate(CASES.items()):
        d = tmp_path_factory.mktemp(name)
        out[name] = (d, _save_hf(d, overrides, shard, seed=i))
    return out


# ---------------------------------------------------------------------------------------------
# import parity
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_transformers(case: str, ckpts: dict) -> None:
    d, ref = ckpts[case]
    model = hf.import_hf(d).eval()
    tokens = _tokens()
    with torch.no_grad():
        ours = model(tokens)
    want = _hf_logits(ref, tokens)
    assert want.abs().max() > 0.5  # the metric below is relative to an O(1) logit scale
    err = _rel_err(ours, want)
    print(f"{case}: max|ours-HF|/max|HF| = {err:.2e} (max abs {(ours - want).abs().max():.2e})")
    assert err < TOL, f"{case}: relative logit error {err:.2e}"


def test_import_layout(ckpts: dict) -> None:
    sharded, _ = ckpts["sharded"]
    assert (sharded / hf.INDEX_FILE).is_file() and not (sharded / hf.SINGLE_FILE).exists()
    tied = hf.import_hf(ckpts["tied"][0])
    assert tied.lm_head.weight is tied.embed.weight  # one Parameter, as build_model ties it
    untied = hf.import_hf(ckpts["untied"][0])
    assert untied.lm_head.weight.data_ptr() != untied.embed.weight.data_ptr()
    assert not any(t.is_meta for t in (*untied.parameters(), *untied.buffers()))
    assert untied.rotary.cos.dtype == torch.float32


def test_llama3_rope_scaling_matters(ckpts: dict) -> None:
    """The llama3 case would pass vacuously if the scaling had no effect at SEQ positions."""
    d, ref = ckpts["llama3_rope"]
    model = hf.import_hf(d).eval()
    assert model.cfg.rope_scaling is not None and model.cfg.rope_scaling.original_max_position == 16
    model.rotary.scaling = None
    model.rotary.reset_parameters()
    tokens = _tokens()
    with torch.no_grad():
        unscaled = model(tokens)
    assert _rel_err(unscaled, _hf_logits(ref, tokens)) > 1e-2


def test_import_dtype_cast(ckpts: dict) -> None:
    model = hf.import_hf(ckpts["gqa"][0], dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos.dtype == torch.float32  # RoPE tables stay fp32, as in build_model


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,max_shard_bytes", [("untied", 5 * 2**30), ("tied", 5 * 2**30),
                                                  ("llama3_rope", 30_000)])
def test_export_roundtrip_bit_exact(case: str, max_shard_bytes: int, ckpts: dict, tmp_path: Path) -> None:
    src, ref = ckpts[case]
    model = hf.import_hf(src)
    out = tmp_path / "export"
    hf.export_hf(model, out, max_shard_bytes=max_shard_bytes)

    again = hf.import_hf(out)
    assert again.cfg == model.cfg
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

    sharded = max_shard_bytes < 5 * 2**30
    assert (out / hf.INDEX_FILE).is_file() == sharded
    assert (out / hf.SINGLE_FILE).is_file() != sharded
    if sharded:
        index = json.loads((out / hf.INDEX_FILE).read_text())
        files = sorted(set(index["weight_map"].values()))
        n = len(files)
        assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        shards = [load_file(out / f) for f in files]
        sizes = [sum(t.numel() * t.element_size() for t in sd.values()) for sd in shards]
        # Each shard fits, unless it is a single tensor larger than the limit (the embedding here).
        assert all(s <= max_shard_bytes or len(sd) == 1 for s, sd in zip(sizes, shards, strict=True))
        assert any(len(sd) > 1 for sd in shards)
        assert index["metadata"]["total_size"] == sum(sizes)
    else:
        names = load_file(out / hf.SINGLE_FILE).keys()
        assert ("lm_head.weight" in names) == (case != "tied")  # transformers' tied layout
    assert not list(tmp_path.glob(".export*"))  # no temporary directory left behind

    # transformers loads our export and computes bit-identical logits to the original.
    theirs = transformers.LlamaForCausalLM.from_pretrained(out, local_files_only=True,
                                                           attn_implementation="eager").eval()
    assert theirs.config.tie_word_embeddings == model.cfg.tie_embeddings
    tokens = _tokens()
    assert torch.equal(_hf_logits(theirs, tokens), _hf_logits(ref, tokens))


def test_export_dtype_and_atomicity(ckpts: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = hf.import_hf(ckpts["gqa"][0])
    out = tmp_path / "bf16"
    hf.export_hf(model, out, dtype=torch.bfloat16)
    assert json.loads((out / hf.CONFIG_NAME).read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(out / hf.SINGLE_FILE).values()} == {torch.bfloat16}
    assert model.embed.weight.dtype == torch.float32  # the model itself is untouched

    with pytest.raises(FileExistsError, match="not an empty directory"):
        hf.export_hf(model, out)
    hf.export_hf(model, out, overwrite=True)
    assert json.loads((out / hf.CONFIG_NAME).read_text())["torch_dtype"] == "float32"

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(hf, "save_file", boom)
    with pytest.raises(WriteError, match="cannot write the Hugging Face export .*failed': disk full"):
        hf.export_hf(model, tmp_path / "failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16"]  # neither output nor temp dir


def _small_tokenizer(path: Path) -> Path:
    """A byte-level BPE with an end-of-document token, as `pentatron tokenize` trains one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def hello(x):\n    return x + 1\n"] * 20, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(path))
    return path


def test_export_writes_a_tokenizer_autotokenizer_loads_and_readable_files(ckpts: dict, tmp_path: Path) -> None:
    """Issue 52: the export had no tokenizer (AutoTokenizer.from_pretrained failed) and its safetensors
    file was mode 0600 (safetensors' own), unreadable to the other users of a shared directory."""
    from pentatron.models.hf_tokenizer import end_of_document

    model = hf.import_hf(ckpts["gqa"][0])
    tok_file = _small_tokenizer(tmp_path / "tokenizer.json")
    eos = end_of_document(tok_file, None, ("<|endoftext|>",))
    out = tmp_path / "out"
    hf.export_hf(model, out, tokenizer=tok_file, eos=eos)
    mask = os.umask(0)
    os.umask(mask)
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == {
        f.name: 0o666 & ~mask for f in out.iterdir()} and (out / hf.SINGLE_FILE).exists()
    theirs = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "def hello(x):\n    return x"
    from tokenizers import Tokenizer

    assert theirs(text)["input_ids"] == Tokenizer.from_file(str(tok_file)).encode(text).ids
    assert theirs.eos_token == "<|endoftext|>" and theirs.eos_token_id == eos[1] == 0
    assert json.loads((out / hf.CONFIG_NAME).read_text())["eos_token_id"] == 0
    assert transformers.LlamaForCausalLM.from_pretrained(out, local_files_only=True) is not None


def test_export_rejects_gelu_mlp() -> None:
    cfg = ModelConfig(vocab_size=32, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden_size=32,
                      mlp="gelu")
    with pytest.raises(ValueError, match="model.mlp='gelu'"):
        hf.config_to_hf(cfg)


# ---------------------------------------------------------------------------------------------
# config mapping
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(n for n, c in MODELS.items() if c.moe is None))  # MoE: test_hf_moe.py
def test_config_roundtrip_registry(name: str) -> None:
    cfg = MODELS[name]
    d = hf.config_to_hf(cfg)
    assert hf.config_from_hf(d) == cfg
    # transformers reads the same shape and RoPE from it.
    cls = transformers.Qwen3Config if cfg.qk_norm else transformers.LlamaConfig
    t = cls(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert (t.head_dim, t.num_key_value_heads, t.tie_word_embeddings) == (cfg.head_dim, cfg.n_kv_heads,
                                                                            cfg.tie_embeddings)


def test_config_accepts_both_rope_spellings() -> None:
    base = hf.config_to_hf(MODELS["llama3.1-8b"])
    v4 = hf.config_from_hf(base)
    v5 = dict(base)
    v5["rope_parameters"] = {**v5.pop("rope_scaling"), "rope_theta": v5.pop("rope_theta")}
    assert hf.config_from_hf(v5) == v4
    old = dict(base, rope_scaling={**base["rope_scaling"]})
    old["rope_scaling"]["type"] = old["rope_scaling"].pop("rope_type")  # pre-4.45 key
    assert hf.config_from_hf(old) == v4
    plain = dict(base, rope_scaling=None)
    assert hf.config_from_hf(plain).rope_scaling is None
    v5_plain = dict(base, rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": 7.0})
    assert hf.config_from_hf(v5_plain).rope_theta == 7.0


@pytest.mark.parametrize("change,key", [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"model_type": "mistral"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 8}, "head_dim"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": None, "rope_parameters": {"full_attention": {"rope_type": "default"}}},
     "rope_parameters"),
    ({"num_key_value_heads": 3}, "n_kv_heads"),
    # numbers that are not (a TypeError traceback for a list or null-like value, an unnamed float() error)
    ({"initializer_range": "abc"}, "initializer_range must be a number, got 'abc'"),
    ({"initializer_range": [0.02]}, r"initializer_range must be a number, got \[0.02\]"),
    ({"initializer_range": float("nan")}, "initializer_range must be a finite number, got nan"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number"),
    ({"rope_theta": {"x": 1}}, "rope_theta must be a number"),
])
def test_config_rejects_unsupported(change: dict, key: str) -> None:
    d = dict(hf.config_to_hf(MODELS["debug"]), **change)
    with pytest.raises(ValueError, match=key):
        hf.config_from_hf(d)


def test_config_lists_every_problem() -> None:
    d = dict(hf.config_to_hf(MODELS["debug"]), attention_bias=True, mlp_bias=True, hidden_act="relu")
    with pytest.raises(ValueError) as e:
        hf.config_from_hf(d)
    assert all(k in str(e.value) for k in ("attention_bias", "mlp_bias", "hidden_act"))


# ---------------------------------------------------------------------------------------------
# checkpoint errors
# ---------------------------------------------------------------------------------------------

def _copy_single(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    dst.mkdir()
    (dst / hf.CONFIG_NAME).write_text((src / hf.CONFIG_NAME).read_text())
    return load_file(src / hf.SINGLE_FILE)


def test_missing_shard(ckpts: dict, tmp_path: Path) -> None:
    src, _ = ckpts["sharded"]
    index = json.loads((src / hf.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in [hf.CONFIG_NAME, hf.INDEX_FILE, *files[:-1]]:
        (d / f).write_bytes((src / f).read_bytes())
    with pytest.raises(FileNotFoundError, match=files[-1]):
        hf.import_hf(d)


def test_wrong_shape(ckpts: dict, tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    sd = _copy_single(ckpts["gqa"][0], d)
    name = "model.layers.1.self_attn.k_proj.weight"
    sd[name] = torch.zeros(16, 64)
    save_file(sd, d / hf.SINGLE_FILE, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"'{name}' has shape \[16, 64\], expected \[32, 64\]"):
        hf.import_hf(d)


def test_missing_and_unexpected_tensors(ckpts: dict, tmp_path: Path) -> None:
    d = tmp_path / "missing"
    sd = _copy_single(ckpts["untied"][0], d)
    del sd["lm_head.weight"]  # untied: the head is required
    save_file(sd, d / hf.SINGLE_FILE, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensor.*lm_head.weight"):
        hf.import_hf(d)

    d = tmp_path / "bias"
    sd = _copy_single(ckpts["untied"][0], d)
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(sd, d / hf.SINGLE_FILE, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        hf.import_hf(d)


def test_tolerated_extra_tensors(ckpts: dict, tmp_path: Path) -> None:
    """Tied checkpoints that still store lm_head.weight, and old ones with rotary inv_freq buffers,
    load as transformers loads them (both ignored)."""
    src, ref = ckpts["tied"]
    d = tmp_path / "ckpt"
    sd = _copy_single(src, d)
    sd["lm_head.weight"] = torch.zeros_like(sd["model.embed_tokens.weight"])
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    save_file(sd, d / hf.SINGLE_FILE, metadata={"format": "pt"})
    model = hf.import_hf(d).eval()
    assert model.lm_head.weight is model.embed.weight
    tokens = _tokens()
    with torch.no_grad():
        assert _rel_err(model(tokens), _hf_logits(ref, tokens)) < TOL


def test_unsupported_checkpoint_config(ckpts: dict, tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    _copy_single(ckpts["gqa"][0], d)
    (d / hf.SINGLE_FILE).write_bytes((ckpts["gqa"][0] / hf.SINGLE_FILE).read_bytes())
    cfg = json.loads((d / hf.CONFIG_NAME).read_text())
    (d / hf.CONFIG_NAME).write_text(json.dumps(dict(cfg, attention_bias=True)))
    with pytest.raises(ValueError, match="attention_bias"):
        hf.import_hf(d)
    (d / hf.CONFIG_NAME).write_text(json.dumps(dict(cfg, model_type="gpt2")))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        hf.import_hf(d)


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a directory"):
        hf.import_hf(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.import_hf(tmp_path)
    (tmp_path / hf.CONFIG_NAME).write_text(json.dumps(hf.config_to_hf(MODELS["debug"])))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        hf.import_hf(tmp_path)


def test_parse_size() -> None:
    assert hf.parse_size("5GiB") == 5 * 2**30
    assert hf.parse_size("40KB") == 40_000
    assert hf.parse_size("1234") == 1234
    with pytest.raises(ValueError, match="not a size"):
        hf.parse_size("lots")


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pentatron")
    hf.add_convert_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["convert", *argv])
    return args.func(args)


def test_cli_verify_and_roundtrip(ckpts: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src, _ = ckpts["llama3_rope"]
    assert _cli("verify", str(src), "--seq-len", "40") == 0
    out = capsys.readouterr().out
    assert "max abs error" in out and "max rel error" in out
    assert "PASS: max rel error" in out and "≤ tolerance 0.0001 (float32" in out

    dst = tmp_path / "out"
    assert _cli("hf-roundtrip", str(src), str(dst), "--max-shard-size", "30KB") == 0
    assert (dst / hf.INDEX_FILE).is_file()
    assert _cli("verify", str(dst)) == 0


def test_cli_verify_of_non_finite_weights_says_so(ckpts: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """NaN weights made NaN logits on both sides, reported as a tolerance failure ("--tol to change")."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "nan"
    shutil.copytree(ckpts["gqa"][0], src)
    f = next(src.glob("*.safetensors"))
    tensors = load_file(f)
    name = next(n for n in tensors if n.endswith("up_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, f, metadata={"format": "pt"})
    assert _cli("verify", str(src)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pentatron: error: convert verify: {src}: ") and "up_proj" in err, err
    assert "NaN or infinite values; the weights themselves are broken" in err and "--tol" not in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("argv", [["verify", "{tmp}/missing"], ["hf-roundtrip", "{tmp}", "{tmp}/out"],
                                  ["hf-roundtrip", "{src}", "{tmp}/o", "--max-shard-size", "big"]])
def test_cli_bad_input(argv: list[str], ckpts: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = [a.format(tmp=tmp_path, src=ckpts["gqa"][0]) for a in argv]
    assert _cli(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pentatron: error: convert ") and err.count("\n") == 1
    assert "Traceback" not in err


def test_roundtrip_preserves_config_fields(ckpts: dict, tmp_path: Path) -> None:
    src, _ = ckpts["llama3_rope"]
    model = hf.import_hf(src)
    hf.export_hf(model, tmp_path / "o")
    d = json.loads((tmp_path / "o" / hf.CONFIG_NAME).read_text())
    assert d["rope_scaling"]["original_max_position_embeddings"] == 16
    assert d["max_position_embeddings"] == 128 and d["num_key_value_heads"] == 2
    assert hf.config_from_hf(d) == replace(model.cfg)


def test_read_tensor_reads_whole_tensors_and_row_ranges_without_a_memory_map(tmp_path):
    """`read_tensor` (plain reads: only the bytes asked for become resident) equals safetensors' own reader,
    for every dtype the Llama uses, a 0-d tensor, and any range of rows."""
    from safetensors.torch import save_file

    from pentatron.models.hf import read_tensor

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, 5, generator=g), "b": torch.randn(3, 4, generator=g).to(torch.bfloat16),
               "c": torch.tensor(3.5), "d": torch.arange(10)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    for name, t in tensors.items():
        assert torch.equal(read_tensor(tmp_path / "x.safetensors", name), t), name
    assert torch.equal(read_tensor(tmp_path / "x.safetensors", "a", rows=(2, 5)), tensors["a"][2:5])
    assert torch.equal(read_tensor(tmp_path / "x.safetensors", "b", rows=(1, 3)), tensors["b"][1:3])
