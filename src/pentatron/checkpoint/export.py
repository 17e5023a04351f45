"""`pentatron checkpoint export-hf CKPT OUT`: a training checkpoint of any layout as a Hugging Face
Llama directory (config.json + safetensors) that `transformers` loads.

The full parameters are assembled from the pieces each rank described (`reshard.py`), so ZeRO and
tensor parallelism together are fine; a checkpoint written before pieces were described goes through
`generate.load_model`'s key-based reader. The export itself is `models/hf.export_hf` (atomic, sharded
above --max-shard-size).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pentatron.checkpoint.errors import CheckpointError
from pentatron.checkpoint.reshard import _assemble, _source, has_pieces, read_pieces
from pentatron.models.config import ModelConfig


def load_full_model(path: Path) -> tuple[torch.nn.Module, ModelConfig, Path]:
    """The trained model (fp32, CPU, eval mode) from a checkpoint dir or step dir, any layout."""
    from pentatron.checkpoint.store import CheckpointStore
    from pentatron.generate import CheckpointError as GenerateError
    from pentatron.generate import checkpoint_step_dir, load_model
    from pentatron.models.llama import build_model

    try:
        step_dir = checkpoint_step_dir(path)
        if not has_pieces(step_dir):
            return load_model(path)
    except GenerateError as e:
        raise CheckpointError(str(e)) from None
    model_cfg = ModelConfig.from_dict(CheckpointStore.meta(step_dir)["model"])
    model = build_model(model_cfg, device="cpu", dtype=torch.float32)
    saved = read_pieces(step_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            pieces = _source(saved, name, "param")
            if pieces is None:
                raise CheckpointError(f"{step_dir}: holds no parameter {name}")
            full = _assemble(step_dir, pieces)
            if full.shape != p.shape:
                raise CheckpointError(f"{step_dir}: {name} has shape {tuple(full.shape)}, the model {tuple(p.shape)}")
            p.copy_(full)
    return model.eval(), model_cfg, step_dir


def add_checkpoint_parser(subparsers: argparse._SubParsersAction) -> None:
    from pentatron.models.hf import _DTYPES

    p = subparsers.add_parser("checkpoint", help="work with training checkpoints (export to Hugging Face)")
    sub = p.add_subparsers(dest="action", required=True)
    ex = sub.add_parser("export-hf", help="write a checkpoint (any layout) as a Hugging Face Llama directory",
                        description="Assemble the full model from a training checkpoint written in any parallel "
                                    "layout and write config.json + safetensors that transformers loads.")
    ex.add_argument("checkpoint", type=Path, help="checkpoint.dir of a run (its latest) or one step_XXXXXXXX")
    ex.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    ex.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast on the way out (default fp32)")
    ex.add_argument("--max-shard-size", default="5GiB", help="shard above this size (default 5GiB)")
    ex.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    ex.set_defaults(func=run_export_hf)


def run_export_hf(args: argparse.Namespace) -> int:
    from pentatron.models.hf import dtype_from_name, export_hf, parse_size

    try:
        model, _, step_dir = load_full_model(args.checkpoint)
        export_hf(model, args.out_dir, parse_size(args.max_shard_size),
                  dtype_from_name(args.dtype) if args.dtype else None, overwrite=args.overwrite)
    except (CheckpointError, ValueError, FileExistsError) as e:
        print(f"pentatron: error: {e}", file=sys.stderr)
        return 2
    print(f"pentatron: exported {step_dir} to {args.out_dir}")
    return 0
