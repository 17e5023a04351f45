"""`pentatron plan --emit-config FILE`: the `pentatron train` configuration of a planned layout.

The file is checked with the training side's own loader (`pentatron.config.load_config` with the
layout's world size) before it is reported as written, so what the planner emits is what training
accepts. A layout training cannot run yet (`plan.layout.trainable_problems`) is refused with the reasons;
a recipe other than ours is refused with one message. The kernels the plan assumed are written as
`train.compile` (fused: true, eager: false).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pentatron.models.config import ModelConfig
from pentatron.models.registry import get_model_config
from pentatron.plan.layout import Layout, Workload, trainable_problems
from pentatron.plan.recipes import compile_for_kernels, loss_chunk_tokens_of, not_ours, resolve_kernels

# ModelConfig fields a [model] section can override (pentatron.config.ModelSection)
_MODEL_FIELDS = ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_size",
                 "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings", "mlp", "init_std")


class EmitError(ValueError):
    """The layout cannot be written as a training config (the message says why)."""


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def _model_section(cfg: ModelConfig, seq_len: int) -> dict[str, object]:
    try:
        base = get_model_config(cfg.name)
    except KeyError:
        base = get_model_config("debug")
    if cfg.rope_scaling != base.rope_scaling:
        raise EmitError(f"model {cfg.name!r}: RoPE scaling differs from registry model {base.name!r}; "
                        "a [model] section cannot set it")
    out: dict[str, object] = {"name": base.name}
    for f in _MODEL_FIELDS:
        if getattr(cfg, f) != getattr(base, f):
            out[f] = getattr(cfg, f)
    if seq_len > cfg.max_seq_len:
        out["max_seq_len"] = seq_len
    return out


def training_config_text(w: Workload, lay: Layout, header: str = "", kernels: str | None = None) -> str:
    """TOML for `pentatron train` running `lay` on `w` with `kernels` (train.compile; None: the training
    default), EmitError if training cannot run it. Only the pentatron recipe is emitted
    (`recipes.not_ours`): another recipe's layout is a prediction of that framework's run."""
    why = not_ours(lay.recipe)
    if why:
        raise EmitError(why)
    why = trainable_problems(w, lay, lay.world)
    if why:
        raise EmitError("cannot emit a training config for " + lay.short() + ": " + "; ".join(why))
    sections: dict[str, dict[str, object]] = {
        "model": _model_section(w.cfg, w.seq_len),
        "parallel": {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "zero": lay.zero,
                     "sp": lay.sp, "pp_schedule": lay.pp_schedule, "pp_virtual": lay.pp_virtual},
        "train": {"seq_len": w.seq_len, "micro_batch": lay.micro_batch, "global_batch": w.global_batch,
                  "precision": lay.precision, "recompute": lay.recompute,
                  "compile": compile_for_kernels(resolve_kernels(lay.recipe, kernels)),
                  "loss_chunk_tokens": loss_chunk_tokens_of(lay.recipe)},
    }
    if lay.zero == 3 and lay.pp > 1:
        sections["parallel"]["zero3_gather"] = lay.zero3_gather
    if lay.pp_layers is not None:
        sections["parallel"]["pp_layers"] = list(lay.pp_layers)
    if lay.cp > 1:  # training's names (parallel.cp_mode, parallel.cp_ulysses)
        sections["parallel"]["cp_mode"] = lay.cp_mode
        if lay.cp_mode == "hybrid":
            sections["parallel"]["cp_ulysses"] = lay.cp_ulysses
    lines = [f"# {line}" for line in header.splitlines()]
    for name, kv in sections.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in kv.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


def write_training_config(path: str | Path, w: Workload, lay: Layout, header: str = "",
                          kernels: str | None = None) -> Path:
    """Write the config and load it back through the trainer's validation (world size = the layout's)."""
    from pentatron.config import ConfigError, load_config

    p = Path(path)
    text = training_config_text(w, lay, header, kernels)
    p.write_text(text)
    try:
        cfg = load_config(p, world_size=lay.world)
    except ConfigError as e:  # a disagreement between planner and trainer: say so, keep the file to inspect
        raise EmitError(f"{p}: the training config validation refused the emitted layout: {e}") from None
    if dataclasses.astuple(cfg.layout(lay.world))[:5] != (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep):
        raise EmitError(f"{p}: the training config resolves to a different layout than {lay.short()}")
    return p
