"""`pentatron checkpoint export-hf CKPT OUT`: a training checkpoint of any layout as a Hugging Face Llama
directory (config.json + safetensors) that `transformers` loads; the export itself is
`models/hf.export_hf` (atomic, sharded above --max-shard-size). `pentatron checkpoint import-hf HF CKPT`:
the reverse, a step-0 checkpoint (`checkpoint/import_hf.py`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pentatron.checkpoint.errors import CheckpointError


def add_checkpoint_parser(subparsers: argparse._SubParsersAction) -> None:
    from pentatron.models.hf import _DTYPES

    p = subparsers.add_parser("checkpoint", help="training checkpoints to and from Hugging Face")
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
    im = sub.add_parser("import-hf", help="a Hugging Face Llama/Mixtral directory as a step-0 training checkpoint",
                        description="Write the weights of a Hugging Face directory (with fresh optimizer state) "
                                    "as a training checkpoint; `pentatron train` with checkpoint.dir=CKPT_DIR "
                                    "then starts from them in any layout (model settings must match).")
    im.add_argument("hf_dir", type=Path, metavar="HF_DIR")
    im.add_argument("ckpt_dir", type=Path, metavar="CKPT_DIR", help="a new (empty) checkpoint directory")
    im.set_defaults(func=run_import_hf)


def run_export_hf(args: argparse.Namespace) -> int:
    from pentatron.generate import CheckpointError as GenerateError
    from pentatron.generate import load_any_model
    from pentatron.models.hf import dtype_from_name, export_hf, parse_size

    try:
        model, _, step_dir = load_any_model(args.checkpoint)
        export_hf(model, args.out_dir, parse_size(args.max_shard_size),
                  dtype_from_name(args.dtype) if args.dtype else None, overwrite=args.overwrite)
    except (CheckpointError, GenerateError, ValueError, FileExistsError) as e:
        print(f"pentatron: error: {e}", file=sys.stderr)
        return 2
    print(f"pentatron: exported {step_dir} to {args.out_dir}")
    return 0


def run_import_hf(args: argparse.Namespace) -> int:
    from pentatron.checkpoint.import_hf import import_hf_checkpoint

    try:
        path = import_hf_checkpoint(args.hf_dir, args.ckpt_dir)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"pentatron: error: {e}", file=sys.stderr)
        return 2
    print(f"pentatron: imported {args.hf_dir} as {path} (step 0); train with checkpoint.dir={args.ckpt_dir}")
    return 0
