"""`pentatron plan --emit-config FILE`: the `pentatron train` configuration of a planned layout — a job to
run, not only a layout.

The file is checked with the training side's own loader (`pentatron.config.load_config` with the
layout's world size) before it is reported as written, so what the planner emits is what training
accepts. A layout training cannot run yet (`plan.layout.trainable_problems`) is refused with the reasons;
a recipe other than ours is refused with one message. The kernels the plan assumed are written as
`train.compile` (fused: true, eager: false). `--precision fp8` is written as bf16 weights with
`train.fp8` = the plan's `--fp8-scaling` (tensorwise or rowwise), compiled as the kernels say (its casts fuse).

Beside the layout: the schedule (train.steps from the tokens to train — `--train-tokens`, else 20 per
parameter — with a warmup and a starting LR), placeholders for what only the user knows (data.path,
checkpoint.dir: `config.PLACEHOLDER`, refused by the config loader until set), and the launch lines for
the layout's node count (one `pentatron train --nproc` on one node; torchrun per node and SLURM beyond).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from pentatron.models.config import ModelConfig
from pentatron.models.registry import get_model_config
from pentatron.plan.layout import Layout, Workload, trainable_problems
from pentatron.plan.recipes import compile_for_kernels, loss_chunk_tokens_of, not_ours, resolve_kernels

# ModelConfig fields a [model] section can override (pentatron.config.ModelSection)
_MODEL_FIELDS = ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_size",
                 "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings", "mlp", "init_std")


# Tokens per parameter when --train-tokens is not given: the compute-optimal ratio of Hoffmann et al. 2022
# (Chinchilla); a starting point the file says it is.
TOKENS_PER_PARAM = 20
# How much predicted training time a crash may cost: the emitted checkpoint.every.
CHECKPOINT_EVERY_S = 3600.0
# What only the user can fill in: (section, field, what to put there)
_PLACEHOLDERS = (("data", "path", "a directory written by `pentatron tokenize` (the dataset)"),
                 ("checkpoint", "dir", "a directory for the checkpoints, on storage every node sees"))


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


def schedule(w: Workload, train_tokens: float | None) -> tuple[dict[str, object], dict[str, str]]:
    """train.steps, lr, warmup (and the schedule's shape) for `w`, and a comment on each saying where it
    comes from. Steps: the tokens to train ÷ the tokens per step. Warmup: 1 % of the steps, at most 2000
    (Llama's). LR: 3e-4 at 7B parameters (Llama's) scaled by (7e9 / parameters)^(1/4), within [1e-4, 3e-3]:
    a starting point, not a tuned value."""
    from pentatron.config import TrainConfig

    per_step = w.global_batch * w.seq_len
    params = w.cfg.num_params()
    tokens = train_tokens if train_tokens else TOKENS_PER_PARAM * params
    steps = max(1, math.ceil(tokens / per_step))
    warmup = max(1, min(2000, steps // 100))
    lr = float(f"{min(3e-3, max(1e-4, 3e-4 * (7e9 / params) ** 0.25)):.2g}")
    why = "--train-tokens" if train_tokens else f"{TOKENS_PER_PARAM} per parameter (Chinchilla; --train-tokens sets it)"
    d = TrainConfig()
    values = {"steps": steps, "warmup": warmup, "lr": lr, "schedule": d.schedule, "min_lr_ratio": d.min_lr_ratio}
    comments = {"steps": f"{_count(tokens)} tokens ({why}) / {per_step:,} tokens per step",
                "warmup": "optimizer steps: 1% of the steps, at most 2000",
                "lr": f"peak; a starting point for {_count(params)} parameters (3e-4 at 7B, × (7B/N)^1/4): tune it",
                "min_lr_ratio": "the cosine ends at lr × this"}
    return values, comments


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def launch_lines(path: str | Path, world: int, gpus_per_node: int) -> list[str]:
    """How to start `world` ranks from `path`: one command on one node, else torchrun's per node (every
    node, its --node-rank) and a SLURM job script's lines."""
    if world <= gpus_per_node:
        return [f"pentatron train {path} --nproc {world}"]
    nodes = math.ceil(world / gpus_per_node)
    per_node = world // nodes
    if per_node * nodes != world:  # ranks cannot be spread evenly over whole nodes
        return [f"{world} ranks do not fill {nodes} nodes of {gpus_per_node} evenly: plan for a multiple of "
                f"{gpus_per_node} GPUs"]
    return [f"on each of the {nodes} nodes (NODE_RANK 0 … {nodes - 1}; NODE0: node 0's address):",
            f"  pentatron train {path} --nproc {per_node} --nnodes {nodes} --node-rank $NODE_RANK "
            "--rdzv-endpoint $NODE0:29400",
            f"or under SLURM (sbatch --nodes={nodes} --ntasks-per-node={per_node} --gpus-per-node={per_node}):",
            '  export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) MASTER_PORT=29400',
            f"  srun pentatron train {path}"]


def training_config_text(w: Workload, lay: Layout, header: str = "", kernels: str | None = None,
                         train_tokens: float | None = None, step_s: float | None = None) -> str:
    """TOML for `pentatron train` running `lay` on `w` with `kernels` (train.compile; None: the training
    default), EmitError if training cannot run it. Only the pentatron recipe is emitted
    (`recipes.not_ours`): another recipe's layout is a prediction of that framework's run. The schedule
    comes from `train_tokens` (`schedule`); data and checkpoint are placeholders; with the predicted step
    time `step_s`, a checkpoint about every hour (CHECKPOINT_EVERY_S)."""
    from pentatron.config import PLACEHOLDER

    why = not_ours(lay.recipe)
    if why:
        raise EmitError(why)
    why = trainable_problems(w, lay, lay.world)
    if why:
        raise EmitError("cannot emit a training config for " + lay.short() + ": " + "; ".join(why))
    steps, comments = schedule(w, train_tokens)
    sections: dict[str, dict[str, object]] = {
        "model": _model_section(w.cfg, w.seq_len),
        "parallel": {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "zero": lay.zero,
                     "sp": lay.sp, "pp_schedule": lay.pp_schedule, "pp_virtual": lay.pp_virtual},
        "train": {**steps, "seq_len": w.seq_len, "micro_batch": lay.micro_batch, "global_batch": w.global_batch,
                  "precision": "bf16" if lay.precision == "fp8" else lay.precision, "recompute": lay.recompute,
                  "compile": compile_for_kernels(resolve_kernels(lay.recipe, kernels)),
                  "loss_chunk_tokens": loss_chunk_tokens_of(lay.recipe)},
    }
    if lay.precision == "fp8":  # bf16 weights, fp32 masters, FP8 GEMMs in the decoder's linears (parallel/fp8.py)
        sections["train"]["fp8"] = lay.fp8_scaling
    for section, name, what in _PLACEHOLDERS:
        sections.setdefault(section, {})[name] = PLACEHOLDER + what
    if w.documents is not None:  # planned with packed documents masked: train them so
        sections["data"]["document_mask"] = True
    if step_s:
        every = max(1, min(int(steps["steps"]), round(CHECKPOINT_EVERY_S / step_s)))
        sections["checkpoint"]["every"] = every
        comments["every"] = f"steps: about {CHECKPOINT_EVERY_S / 3600:g} h at the predicted {step_s:.3g} s per step"
    if lay.zero == 3 and lay.pp > 1:
        sections["parallel"]["zero3_gather"] = lay.zero3_gather
    if lay.par.hsdp:
        sections["parallel"]["dp_shard"] = lay.dp_shard
    if lay.pp_layers is not None:
        sections["parallel"]["pp_layers"] = list(lay.pp_layers)
    if lay.cp > 1:  # training's names (parallel.cp_mode, parallel.cp_ulysses)
        sections["parallel"]["cp_mode"] = lay.cp_mode
        if lay.cp_mode == "hybrid":
            sections["parallel"]["cp_ulysses"] = lay.cp_ulysses
    lines = [f"# {line}" for line in header.splitlines()]
    for name, kv in sections.items():
        lines += ["", f"[{name}]"]
        for k, v in kv.items():
            note = comments.get(k) if name in ("train", "checkpoint") else None
            lines.append(f"{k} = {_toml_value(v)}" + (f"  # {note}" if note else ""))
    return "\n".join(lines).lstrip("\n") + "\n"


def write_training_config(path: str | Path, w: Workload, lay: Layout, header: str = "",
                          kernels: str | None = None, train_tokens: float | None = None,
                          step_s: float | None = None) -> Path:
    """Write the config and load it back through the trainer's validation (world size = the layout's;
    the placeholders, which refuse a run until set, checked as unset)."""
    from pentatron.config import ConfigError, load_config

    p = Path(path)
    text = training_config_text(w, lay, header, kernels, train_tokens, step_s)
    p.write_text(text)
    unset = [f'{section}.{name}=""' for section, name, _ in _PLACEHOLDERS]
    try:
        cfg = load_config(p, unset, world_size=lay.world)
    except ConfigError as e:  # a disagreement between planner and trainer: say so, keep the file to inspect
        raise EmitError(f"{p}: the training config validation refused the emitted layout: {e}") from None
    if dataclasses.astuple(cfg.layout(lay.world))[:5] != (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep):
        raise EmitError(f"{p}: the training config resolves to a different layout than {lay.short()}")
    return p
