"""The whole model of a checkpoint of any layout, assembled from the pieces each rank described
(`reshard.py`), so ZeRO and tensor parallelism together are fine. Used by `pentatron checkpoint
export-hf` (`checkpoint_cli.py`) and `pentatron generate`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pentatron.checkpoint.errors import CheckpointError
from pentatron.checkpoint.reshard import assembled, read_pieces, source_pieces
from pentatron.models.config import ModelConfig


def model_from_pieces(step_dir: Path) -> tuple[torch.nn.Module, ModelConfig]:
    """The trained model (fp32, CPU, eval mode) of a step directory whose ranks described their pieces."""
    from pentatron.checkpoint.store import CheckpointStore
    from pentatron.models.llama import build_model

    model_cfg = ModelConfig.from_dict(CheckpointStore.meta(step_dir)["model"])
    model = build_model(model_cfg, device="cpu", dtype=torch.float32, init=False)  # every tensor is loaded
    saved = read_pieces(step_dir)
    params = dict(model.named_parameters())
    sources = []
    for name in params:
        pieces = source_pieces(saved, name, "param")
        if pieces is None:
            raise CheckpointError(f"{step_dir}: holds no parameter {name}")
        sources.append(pieces)
    with torch.no_grad():
        for (name, p), full in zip(params.items(), assembled(step_dir, sources), strict=True):
            if full.shape != p.shape:
                raise CheckpointError(f"{step_dir}: {name} has shape {tuple(full.shape)}, the model {tuple(p.shape)}")
            p.copy_(full)
    return model.eval(), model_cfg
