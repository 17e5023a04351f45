"""`pentatron checkpoint import-hf HF_DIR CKPT_DIR`: a Hugging Face Llama (or Qwen3, Mixtral) directory as a
step-0 training checkpoint — the weights, fresh AdamW state, and each tensor's piece description — so
that `pentatron train` with `checkpoint.dir = CKPT_DIR` starts from those weights in any layout (the
resume re-shards it like any other checkpoint). It records no data position: the run starts at the
first sample of its own dataset.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pentatron.checkpoint.errors import CheckpointError
from pentatron.checkpoint.layout import layout_record
from pentatron.checkpoint.reshard import describe_state
from pentatron.checkpoint.store import CheckpointStore
from pentatron.checkpoint.verified import refuse_nonfinite
from pentatron.writes import created_dirs


def import_hf_checkpoint(hf_dir: Path, ckpt_dir: Path) -> Path:
    """Write the step-0 checkpoint; returns its directory.

    Memory: the model once (read tensor by tensor from the safetensors files, `models/hf.import_hf`) plus
    one tensor (written one file per tensor: DCP holds a file's tensors until the file is done). The state
    is what a 1-process ZeRO-0 fp32 runner saves (`StepRunner.state_dict`: the
    parameters by name, AdamW's step and zero moments per parameter, the MoE selection biases), but without
    building that runner, whose gradient buffer and fresh moments would be three more copies of the model:
    the zero moments are views of one zero tensor of the largest parameter's size (DCP copies a view
    before writing it)."""
    import torch

    from pentatron.config import Config
    from pentatron.models.hf import import_hf

    if ckpt_dir.exists() and not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir} is a file, not a directory: import into a new checkpoint directory")
    if ckpt_dir.exists() and any(ckpt_dir.iterdir()):
        raise CheckpointError(f"{ckpt_dir} is not empty: import into a new checkpoint directory")
    model = import_hf(hf_dir, dtype=torch.float32)
    refuse_nonfinite(hf_dir, model.named_parameters(), "nothing was imported (a checkpoint never holds them)")
    cfg = Config()  # one process, ZeRO-0, fp32: the simplest layout; a resume re-shards it
    cfg.train.precision, cfg.train.seq_len = "fp32", min(cfg.train.seq_len, model.cfg.max_seq_len)
    layout = cfg.layout(1)
    state, placements = step0_state(model)
    meta = {"step": 0, "loader": None, "model": model.cfg.to_dict(), "imported_from": str(hf_dir),
            "layout": layout_record(layout, {"zero": 0, "dp": 1}, cfg.parallel.bucket_mb),
            "parallel_layout": dataclasses.asdict(layout)}
    # a failed write (a path under a file, no permission, no space) leaves no directory it created behind
    with created_dirs(ckpt_dir, "the imported checkpoint"):
        return CheckpointStore(ckpt_dir).save(0, state, meta, describe_state(state, placements),
                                              file_per_tensor=True)


def step0_state(model: Any) -> tuple[dict[str, dict[str, Any]], list[Any]]:
    """(state, placements) of `model` (fp32, one process) as a ZeRO-0 runner would save them before its
    first step, holding no tensor beyond the model's but one zero tensor of the largest parameter's size."""
    import torch

    from pentatron.models.moe import moe_layers
    from pentatron.parallel.placement import Placement

    params = dict(model.named_parameters())  # a tied weight once, under its first name
    zeros = torch.zeros(max(p.numel() for p in params.values()))
    optim: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        moment = zeros[: p.numel()].view(p.shape)
        optim.update({f"{name}.step": torch.tensor(0.0), f"{name}.exp_avg": moment, f"{name}.exp_avg_sq": moment})
    state: dict[str, dict[str, torch.Tensor]] = {"model": {n: p.detach() for n, p in params.items()},
                                                 "optim": optim}
    moe = moe_layers(model)
    if moe:
        state["moe_bias"] = {f"{n}.router.expert_bias": m.router.expert_bias for n, m in moe.items()}
    return state, [Placement(n, tuple(p.shape)) for n, p in params.items()]
