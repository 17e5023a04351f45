"""Hugging Face interop: Llama (and Qwen3, Mixtral) `config.json` + safetensors checkpoints ↔ Pentatron's `Llama`.

Qwen3 (`Qwen3ForCausalLM`) is a Llama with `self_attn.q_norm`/`k_norm` (RMSNorm over head_dim, before
RoPE) and a head_dim that need not be hidden_size/heads: `qk_norm` and `attn_head_dim` in ModelConfig.

Import reads `model.safetensors` or a sharded `model.safetensors.index.json`, validates every tensor's
name and shape against the config from the safetensors headers (before reading any data), and loads
the tensors straight into a model built on the meta device, so no random-init copy is ever allocated.
Export writes a `LlamaForCausalLM`-compatible directory atomically (temporary directory, then rename).
Tied embeddings follow transformers: `tie_word_embeddings: true` and no `lm_head.weight` tensor.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pentatron.models import hf_moe
from pentatron.models.config import ModelConfig, RopeScaling
from pentatron.models.hf_tokenizer import write_hf_tokenizer
from pentatron.models.llama import Llama, reset_router_biases
from pentatron.numbers import number_problem
from pentatron.user_files import read_json
from pentatron.writes import WriteError, staged_dir

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Per-layer HF name → our name (relative to `model.layers.{i}.` / `layers.{i}.`).
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "lm_head.weight"}
# Tensors that some older checkpoints carry but that hold no learned state (recomputed from config).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq|model\.rotary_emb\.inv_freq")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Default `convert verify` tolerances: fp32 parity is ~1e-6 (summation order, fp64 vs fp32 RoPE
# tables); in half precision the two implementations round at different points, a few ulps apart.
_VERIFY_TOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------

def _float(d: dict[str, Any], key: str, default: float, problems: list[str], where: str = "") -> float:
    """`d[key]` (or `default` when absent or null) as a finite float; anything else (a string, a list, NaN) is a
    problem naming the key (was a TypeError traceback, or a bare "could not convert string to float")."""
    value = d.get(key)
    if value is None:
        return default
    if problem := number_problem(where or key, value):
        problems.append(problem)
        return default
    return float(value)


def _rope_from_hf(d: dict[str, Any], problems: list[str]) -> tuple[float, RopeScaling | None]:
    """rope_theta and Llama-3.1 scaling from either spelling: transformers 5.x `rope_parameters`
    (which also carries rope_theta) or 4.x top-level `rope_theta` + `rope_scaling`."""
    key = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    rp = d.get(key)
    theta = _float(d, "rope_theta", 10000.0, problems)
    if rp is None:
        return theta, None
    if not isinstance(rp, dict):
        problems.append(f"{key} must be an object or null, got {rp!r}")
        return 10000.0, None
    if rp and all(isinstance(v, dict) or v is None for v in rp.values()):
        problems.append(f"{key} is nested per layer type ({', '.join(rp)}); "
                        "only one global RoPE is supported")
        return 10000.0, None
    theta = _float(rp, "rope_theta", theta, problems, f"{key}.rope_theta")
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"{key}.partial_rotary_factor={rp['partial_rotary_factor']} is not supported "
                        "(only 1.0)")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        problems.append(f"{key}.rope_type={rope_type!r} is not supported (only 'default' and 'llama3')")
        return theta, None
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if rp.get(k) is None]
    if missing:
        problems.append(f"{key} (rope_type 'llama3') is missing {', '.join(missing)}")
        return theta, None
    # HF falls back to the top-level value, then to max_position_embeddings.
    orig = rp.get("original_max_position_embeddings",
                  d.get("original_max_position_embeddings", d.get("max_position_embeddings", 2048)))
    factors = {k: _float(rp, k, 1.0, problems, f"{key}.{k}") for k in ("factor", "low_freq_factor", "high_freq_factor")}
    return theta, RopeScaling(**factors, original_max_position=int(orig))


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """A `ModelConfig` from a Llama `config.json` dict. Raises one `ValueError` listing every
    unsupported or inconsistent key (each named) at once."""
    problems: list[str] = []
    qwen3 = d.get("model_type") in ("qwen3", "qwen3_moe")
    if d.get("model_type") not in ("llama", "mixtral", "qwen3", "qwen3_moe"):
        problems.append(f"model_type={d.get('model_type')!r} is not supported (only 'llama', 'mixtral', 'qwen3', "
                        "'qwen3_moe')")
    if qwen3 and (d.get("use_sliding_window") or any(t != "full_attention" for t in d.get("layer_types") or [])):
        problems.append("use_sliding_window/layer_types: sliding-window attention is not supported (only full)")
    moe = hf_moe.moe_from_mixtral(d, problems) if hf_moe.is_mixtral(d) else \
        hf_moe.moe_from_qwen3(d, problems) if hf_moe.is_qwen3_moe(d) else None
    for k in ("attention_bias", "mlp_bias"):
        if d.get(k):
            problems.append(f"{k}={d[k]!r} is not supported (Pentatron's Llama has no biases)")
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers maps both names to SiLU
        problems.append(f"hidden_act={act!r} is not supported (only 'silu')")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if d.get(k) is None]
    if missing:
        problems.append(f"config is missing {', '.join(missing)}")
    theta, scaling = _rope_from_hf(d, problems)
    if problems:
        raise ValueError("unsupported Hugging Face config: " + "; ".join(problems))

    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    head_dim = d.get("head_dim")
    if qwen3 and head_dim is None:
        head_dim = 128  # Qwen3Config's default
    if head_dim is not None and heads and head_dim * heads != hidden and not qwen3:
        problems.append(f"head_dim={head_dim} is not hidden_size/num_attention_heads={hidden}/{heads} "
                        "(decoupled head_dim is supported for model_type 'qwen3' only)")
    norm_eps = _float(d, "rms_norm_eps", 1e-6, problems)
    init_std = _float(d, "initializer_range", 0.02, problems)
    cfg = ModelConfig(
        vocab_size=d["vocab_size"], hidden_size=hidden, n_layers=d["num_hidden_layers"], n_heads=heads,
        n_kv_heads=d.get("num_key_value_heads") or heads, ffn_hidden_size=d["intermediate_size"],
        max_seq_len=d.get("max_position_embeddings", 2048), rope_theta=theta, rope_scaling=scaling,
        norm_eps=norm_eps, tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        mlp="swiglu", init_std=init_std, moe=moe, qk_norm=qwen3,
        attn_head_dim=head_dim if qwen3 else None,  # Qwen3 states it always (as the registry does)
    )
    problems += cfg.problems()
    if problems:
        raise ValueError("unsupported Hugging Face config: " + "; ".join(problems))
    return cfg


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A `LlamaConfig`-compatible config.json dict (4.x spelling, which transformers 5.x also reads)."""
    problems = cfg.problems()
    if cfg.mlp != "swiglu":
        problems.append(f"model.mlp={cfg.mlp!r} has no LlamaForCausalLM equivalent (only 'swiglu')")
    if cfg.moe is not None:
        problems += hf_moe.mixtral_problems(cfg)
        if cfg.rope_scaling is not None:
            problems.append("model.rope_scaling has no MixtralForCausalLM equivalent")
    if cfg.moe is None and not cfg.qk_norm and cfg.attn_head_dim is not None:
        problems.append("model.attn_head_dim without model.qk_norm has no Hugging Face equivalent (Qwen3 has both)")
    if problems:
        kind = {(True, True): "Qwen3-MoE", (True, False): "Mixtral", (False, True): "Qwen3"}.get(
            (cfg.moe is not None, cfg.qk_norm), "Llama")
        raise ValueError(f"cannot export to Hugging Face {kind}: " + "; ".join(problems))
    rs = cfg.rope_scaling
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if rs is None else {
            "rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position,
        },
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "initializer_range": cfg.init_std,
        "torch_dtype": _dtype_name(dtype),
        "attention_bias": False,
        "mlp_bias": False,
    }
    if cfg.qk_norm:  # Qwen3Config: Llama's keys (no mlp_bias), full attention everywhere
        if rs is not None:
            problems.append("model.rope_scaling (Llama-3.1) has no Qwen3ForCausalLM equivalent")
            raise ValueError("cannot export to Hugging Face Qwen3: " + "; ".join(problems))
        qwen3 = {k: v for k, v in llama.items() if k != "mlp_bias"}
        qwen3.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=False,
                     sliding_window=None, max_window_layers=cfg.n_layers)
        return hf_moe.qwen3_moe_config(cfg, qwen3) if cfg.moe is not None else qwen3
    return hf_moe.mixtral_config(cfg, llama) if cfg.moe is not None else llama


def read_hf_config(path: Path) -> ModelConfig:
    """`config_from_hf` of `path/config.json`, with a clear error when it is missing or not JSON."""
    f = Path(path) / CONFIG_NAME
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{path}: not a directory (expected a Hugging Face model directory)")
    if not f.is_file():
        raise FileNotFoundError(f"{f}: missing (a Hugging Face model directory needs config.json)")
    d = read_json(f, "Hugging Face config")  # unreadable, not UTF-8, not JSON: an UnreadableFile (ValueError)
    if not isinstance(d, dict):
        raise ValueError(f"{f}: expected a JSON object")
    return config_from_hf(d)


# ---------------------------------------------------------------------------------------------
# names and shapes
# ---------------------------------------------------------------------------------------------

def hf_to_pentatron_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise KeyError(f"no Pentatron parameter for Hugging Face tensor {name!r}")


def pentatron_to_hf_name(name: str) -> str:
    inverse = {v: k for k, v in _TOP_NAMES.items()}
    if name in inverse:
        return inverse[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    layer_inverse = {v: k for k, v in _LAYER_NAMES.items()}
    if m and m.group(2) in layer_inverse:
        return f"model.layers.{m.group(1)}.{layer_inverse[m.group(2)]}"
    raise KeyError(f"no Hugging Face tensor for Pentatron parameter {name!r}")


def hf_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint of this shape holds, in transformers' order (the tied LM head
    is absent, as transformers saves it)."""
    h, f, kv, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.kv_dim, cfg.vocab_size
    q = cfg.n_heads * cfg.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q)}
        if cfg.qk_norm:
            out |= {p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)}
        out[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.is_moe_layer(i):
            out |= hf_moe.layer_shapes(cfg, p)
        else:
            out |= {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f)}
    out["model.norm.weight"] = (h,)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------

def _weight_map(path: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it; checks that every referenced file exists."""
    single, index = path / SINGLE_FILE, path / INDEX_FILE
    if single.is_file():  # transformers also prefers the single file when both exist
        with _open(single) as f:
            return dict.fromkeys(f.keys(), single)
    if not index.is_file():
        other = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {', '.join(other)}: only safetensors checkpoints are supported)" if other else ""
        raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found{hint}")
    try:
        wm = read_json(index, "safetensors index")["weight_map"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a valid safetensors index ({e!r})") from None
    out: dict[str, Path] = {}
    for name, fname in wm.items():
        if not isinstance(fname, str) or Path(fname).name != fname:
            raise ValueError(f"{index}: shard name {fname!r} for tensor {name!r} is not a plain file name")
        out[name] = path / fname
    missing = sorted({p.name for p in out.values() if not p.is_file()})
    if missing:
        raise FileNotFoundError(f"{path}: missing shard file(s) listed in {INDEX_FILE}: {', '.join(missing)}")
    return out


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def safetensors_header(file: Path) -> tuple[dict[str, Any], int]:
    """(header, offset of the data section) of a safetensors file: 8 bytes of header length, the JSON."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n


def read_tensor(file: Path, name: str, rows: tuple[int, int] | None = None,
                header: tuple[dict[str, Any], int] | None = None) -> torch.Tensor:
    """Tensor `name` of a safetensors file — or only rows [a, b) of its dim 0, a contiguous byte range of the
    row-major data — read with plain reads into a fresh tensor. Unlike safe_open's memory map, nothing but
    the bytes asked for becomes resident (a mapped file's touched pages count as the process's memory)."""
    head, base = header or safetensors_header(file)
    info = head[name]
    shape, (start, end) = list(info["shape"]), info["data_offsets"]
    lo, hi = rows if rows is not None else (0, shape[0] if shape else 1)
    row_bytes = (end - start) // max(1, shape[0]) if shape else end - start
    out = torch.empty([hi - lo, *shape[1:]] if shape else [], dtype=_ST_DTYPES[info["dtype"]])
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
    with open(file, "rb") as f:
        f.seek(base + start + lo * row_bytes)
        done = 0
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise ValueError(f"{file}: tensor {name!r} is cut short")
            done += got
    return out


def _by_file(names: dict[str, Path]) -> dict[Path, list[str]]:
    groups: dict[Path, list[str]] = {}
    for name, file in names.items():
        groups.setdefault(file, []).append(name)
    return groups


def load_hf_state_dict(path: Path, cfg: ModelConfig | None = None, *, device: torch.device | str = "cpu",
                       dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face Llama checkpoint directory, under their HF names.

    Names and shapes are validated against `cfg` (default: the directory's config.json) from the
    safetensors headers before any tensor data is read. Tensors are read one at a time, by plain reads
    (`read_tensor`, no memory map), and moved/cast to `device`/`dtype` (default: stored dtype), so peak
    memory is the result plus one tensor."""
    path = Path(path)
    cfg = read_hf_config(path) if cfg is None else cfg
    expected = hf_param_shapes(cfg)
    where = _weight_map(path)
    if cfg.tie_embeddings:
        where.pop("lm_head.weight", None)  # transformers ignores a stored head when tied; so do we
    missing = [n for n in expected if n not in where]
    if missing:
        raise ValueError(f"{path}: checkpoint is missing tensor(s): {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    unexpected = sorted(n for n in where if n not in expected and not _IGNORED.fullmatch(n))
    if unexpected:
        raise ValueError(f"{path}: checkpoint has tensor(s) that Pentatron's Llama does not: "
                         f"{', '.join(unexpected[:8])}" + (f" and {len(unexpected) - 8} more"
                                                          if len(unexpected) > 8 else ""))
    wanted = {n: where[n] for n in expected}
    # Pass 1: headers only (cheap), so a bad shape deep in the last shard fails before any big read.
    for file, names in _by_file(wanted).items():
        with _open(file) as f:
            present = set(f.keys())
            for n in names:
                if n not in present:
                    raise ValueError(f"{file}: tensor {n!r} listed in {INDEX_FILE} is not in this shard")
                got = tuple(f.get_slice(n).get_shape())
                if got != expected[n]:
                    raise ValueError(f"{file}: tensor {n!r} has shape {list(got)}, expected "
                                     f"{list(expected[n])} from config.json")
    out: dict[str, torch.Tensor] = {}
    for file, names in _by_file(wanted).items():
        header = safetensors_header(file)
        for n in names:
            out[n] = read_tensor(file, n, header=header).to(device=device, dtype=dtype)
    return {n: out[n] for n in expected}  # transformers' canonical order


def import_hf(path: Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Llama:
    """A Pentatron `Llama` holding the weights of a Hugging Face Llama directory. Built on the meta
    device and filled by assignment, so the only weight memory is the loaded tensors themselves."""
    path = Path(path)
    cfg = read_hf_config(path)
    hf_sd = load_hf_state_dict(path, cfg, device=device, dtype=dtype)
    # MoE tensors (experts stacked per layer) are mapped by hf_moe; they come back under our names.
    sd = {n if n.startswith("layers.") else hf_to_pentatron_name(n): t
          for n, t in hf_moe.hf_to_ours(hf_sd).items()}
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["embed.weight"]  # state_dict() lists the tied head under both names
    with torch.device("meta"):
        model = Llama(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    model.tie_weights()  # assign=True made two Parameters on one tensor; restore a single shared one
    # RoPE tables are non-persistent fp32 buffers (as in build_model): materialise and compute them.
    model.rotary.to_empty(device=device)
    model.rotary.reset_parameters()
    for name, buf in list(model.named_buffers()):
        if name.endswith("router.expert_bias"):  # MoE selection biases start at zero, like the tables
            model.get_submodule(name.rpartition(".")[0]).expert_bias = torch.empty_like(buf, device=device)
    reset_router_biases(model)
    still_meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if still_meta:  # a guard against a future module whose state we don't map
        raise RuntimeError(f"import_hf left tensors on the meta device: {', '.join(still_meta)}")
    return model


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------

def _hf_tensors(model: Llama) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) in transformers' order; the tied head is left out, as transformers does."""
    sd = model.state_dict()
    moe = {hf: t for n, tensor in sd.items() for hf, t in (hf_moe.ours_to_hf(n, tensor, model.cfg.qk_norm) or [])}
    for name in hf_param_shapes(model.cfg):
        if name in moe:
            yield name, moe[name]
            continue
        ours = hf_to_pentatron_name(name)
        if ours not in sd:
            raise ValueError(f"model has no parameter {ours!r} (needed for {name!r})")
        yield name, sd[ours]


def _plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Greedy in order: a new shard starts when the next tensor would overflow this one (a tensor
    larger than max_bytes gets a shard of its own), as transformers' save_pretrained does."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, n in sizes:
        if shards[-1] and used + n > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards


def _occupied(out_dir: Path) -> bool:
    return out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir()))


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Move the finished temporary directory into place. rename() is atomic on one filesystem and
    also replaces an empty directory; a non-empty one is swapped out only with overwrite=True (refused
    before writing otherwise; one filled meanwhile fails the rename)."""
    if overwrite and _occupied(out_dir):
        old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
        return
    os.rename(tmp, out_dir)


def _umask_modes(directory: Path) -> None:
    """Every file of `directory` with the mode a plain open() gives (0644 under umask 022): safetensors
    writes its files 0600, which other users of a shared model directory cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    for f in directory.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~mask)


def export_hf(model: Llama, out_dir: Path, max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None,
              *, overwrite: bool = False, tokenizer: Path | None = None, eos: tuple[str, int] | None = None) -> None:
    """Write `model` as a transformers `LlamaForCausalLM` directory: config.json and model.safetensors,
    or `model-0000i-of-0000N.safetensors` shards + model.safetensors.index.json when the weights exceed
    `max_shard_bytes`. `dtype` casts on the way out (default: each parameter's own dtype). `tokenizer`:
    a tokenizers tokenizer.json written beside them for AutoTokenizer (`hf_tokenizer.py`), `eos` its
    end-of-document (token, id), also config.json's eos_token_id. Atomic: written to a sibling
    temporary directory that is renamed into place only when complete; files get the umask's mode."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out_dir = Path(out_dir)
    if not overwrite and _occupied(out_dir):  # before writing anything
        raise FileExistsError(f"{out_dir}: exists and is not an empty directory (pass overwrite=True, or --overwrite)")
    hf_config = config_to_hf(model.cfg, dtype or model.embed.weight.dtype)
    tensors = dict(_hf_tensors(model))
    nbytes = {n: t.numel() * (dtype or t.dtype).itemsize for n, t in tensors.items()}
    shards = _plan_shards(list(nbytes.items()), max_shard_bytes)

    # written into a sibling renamed into place when complete; a failed write is one line, nothing left
    with staged_dir(out_dir, "the Hugging Face export") as tmp:
        files = [SINGLE_FILE] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for fname, names in zip(files, shards, strict=True):
            # One shard's worth of CPU copies at a time bounds the extra memory to max_shard_bytes.
            part = {n: tensors[n].detach().to(device="cpu", dtype=dtype).contiguous() for n in names}
            save_file(part, str(tmp / fname), metadata={"format": "pt"})  # transformers checks "format"
            del part
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(nbytes.values()),
                                  "total_parameters": sum(t.numel() for t in tensors.values())},
                     "weight_map": {n: f for f, names in zip(files, shards, strict=True) for n in names}}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if eos is not None:
            hf_config["eos_token_id"] = eos[1]
        (tmp / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2) + "\n")
        if tokenizer is not None:
            write_hf_tokenizer(tmp, tokenizer, eos[0] if eos else None, model.cfg.max_seq_len)
        _umask_modes(tmp)
        _publish(tmp, out_dir, overwrite)


def parse_size(s: str) -> int:
    """'5GB', '500MB', '64KiB', '1234' → bytes (decimal units for kB/MB/GB, binary for KiB/MiB/GiB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", s)
    if not m:
        raise ValueError(f"not a size: {s!r} (e.g. 5GB, 500MB, 2GiB)")
    unit = (m.group(2) or "").lower()
    power = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}[unit[:1]]
    base = 1024 if unit.endswith("i") else 1000
    return int(math.floor(float(m.group(1)) * base**power))


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (choose from {', '.join(_DTYPES)})")
    return _DTYPES[name]


# ---------------------------------------------------------------------------------------------
# `pentatron convert`
# ---------------------------------------------------------------------------------------------

def add_convert_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `pentatron convert {hf-roundtrip, verify}` (sets `func=run_convert`)."""
    p = subparsers.add_parser(
        "convert", help="check a Hugging Face directory against transformers (verify, hf-roundtrip); "
                        "training checkpoints to and from Hugging Face: pentatron checkpoint",
        description="Check the Hugging Face Llama / Qwen3 / Mixtral interop on a directory: `verify` compares "
                    "logits with "
                    "transformers, `hf-roundtrip` imports and exports it again. Training checkpoints to and from "
                    "Hugging Face: `pentatron checkpoint export-hf | import-hf`; another layout: "
                    "`pentatron checkpoint convert`.")
    sub = p.add_subparsers(dest="convert_command", required=True)
    rt = sub.add_parser("hf-roundtrip", help="import a HF Llama (Qwen3, Mixtral) directory and export it again",
                        description="Import IN_DIR into Pentatron and export it to OUT_DIR (validates the "
                                    "checkpoint; can also re-shard or cast it).")
    rt.add_argument("in_dir", type=Path, metavar="IN_DIR")
    rt.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    rt.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                    help="cast weights on export (default: keep the stored dtype)")
    rt.add_argument("--max-shard-size", default="5GiB", help="shard above this size (default 5GiB)")
    rt.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    ver = sub.add_parser("verify", help="import a HF Llama (Qwen3, Mixtral) directory and compare logits with "
                         "transformers",
                         description="Import IN_DIR, run a forward on a fixed random batch and, if "
                                     "transformers is installed, compare the logits with "
                                     "LlamaForCausalLM (Qwen3ForCausalLM, MixtralForCausalLM).from_pretrained(IN_DIR) "
                                     "(local files only).")
    ver.add_argument("in_dir", type=Path, metavar="IN_DIR")
    ver.add_argument("--dtype", choices=sorted(_DTYPES), default="float32",
                     help="compute dtype for both models (default float32)")
    ver.add_argument("--batch", type=int, default=2)
    ver.add_argument("--seq-len", type=int, default=64, help="capped at max_position_embeddings")
    ver.add_argument("--tol", type=float, default=None,
                     help="fail (exit 1) if max|ours-HF| / max|HF logit| exceeds this (default: "
                          + ", ".join(f"{k} {v:g}" for k, v in _VERIFY_TOL.items()) + ")")
    p.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    """Exit code: 0 ok; 2 bad input (one line on stderr, no traceback); 1 logits disagree."""
    try:
        if args.convert_command == "hf-roundtrip":
            return _roundtrip(args)
        return _verify(args)
    except (ValueError, OSError, WriteError) as e:  # our validation errors, unreadable files, a failed export
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"pentatron: error: convert {args.convert_command}: {msg}", file=sys.stderr)
        return e.code if isinstance(e, WriteError) else 2


def _roundtrip(args: argparse.Namespace) -> int:
    max_bytes = parse_size(args.max_shard_size)
    dtype = None if args.dtype is None else dtype_from_name(args.dtype)
    model = import_hf(args.in_dir)
    export_hf(model, args.out_dir, max_shard_bytes=max_bytes, dtype=dtype, overwrite=args.overwrite)
    n = sum(p.numel() for p in model.parameters())
    print(f"exported {n:,} parameters from {args.in_dir} to {args.out_dir}")
    return 0


@torch.no_grad()
def _verify(args: argparse.Namespace) -> int:
    if args.batch < 1 or args.seq_len < 1:
        raise ValueError(f"--batch and --seq-len must be ≥ 1, got {args.batch} and {args.seq_len}")
    dtype = dtype_from_name(args.dtype)
    from pentatron.checkpoint.verified import refuse_nonfinite

    model = import_hf(args.in_dir, dtype=dtype).eval()
    # NaN weights give NaN logits on both sides, which read as a tolerance failure ("--tol to change")
    refuse_nonfinite(args.in_dir, model.named_parameters(), "the weights themselves are broken: nothing to compare")
    cfg = model.cfg
    seq = min(args.seq_len, cfg.max_seq_len)
    g = torch.Generator().manual_seed(0)  # a fixed batch, so runs are comparable
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, seq), generator=g)
    ours = model(tokens).float()
    n = sum(p.numel() for p in model.parameters())
    print(f"imported {n:,} parameters; logits {list(ours.shape)}, finite: {bool(ours.isfinite().all())}")
    try:
        import transformers
    except ImportError:
        print("NOT CHECKED: transformers is not installed, so the logits were not compared with "
              "LlamaForCausalLM (pip install transformers)")
        return 0
    # Only the local directory (validated by import_hf above), never the hub; eager attention is the
    # plain reference implementation. 5.x renamed torch_dtype to dtype.
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    cls = {(True, True): transformers.Qwen3MoeForCausalLM, (True, False): transformers.MixtralForCausalLM,
           (False, True): transformers.Qwen3ForCausalLM}.get((cfg.moe is not None, cfg.qk_norm),
                                                             transformers.LlamaForCausalLM)
    hf = cls.from_pretrained(
        str(args.in_dir), local_files_only=True, attn_implementation="eager", **{key: dtype}).eval()
    ref = hf(tokens).logits.float()
    err = (ours - ref).abs().max().item()
    rel = err / max(ref.abs().max().item(), 1e-30)
    print(f"max abs error {err:.3e}; max rel error {rel:.3e} (max abs error / max |HF logit|)")
    tol = _VERIFY_TOL[args.dtype] if args.tol is None else args.tol
    if not rel <= tol:  # also catches NaN
        print(f"FAIL: max rel error {rel:.3e} > tolerance {tol:g} ({args.dtype}; --tol to change)")
        print(f"pentatron: error: convert verify: relative error {rel:.3e} exceeds --tol {tol:g}",
              file=sys.stderr)
        return 1
    print(f"PASS: max rel error {rel:.3e} ≤ tolerance {tol:g} ({args.dtype}; --tol to change)")
    return 0
