"""`pentatron checkpoint convert SRC DST [CONFIG] --nproc N --to-layout tp=2,pp=2`: a checkpoint re-written
in another parallel layout by the ranks of that layout (`train/convert.py`). `pentatron checkpoint
export-hf CKPT OUT`: a training checkpoint of any layout as a Hugging Face Llama
directory (config.json + safetensors) that `transformers` loads; the export itself is
`models/hf.export_hf` (atomic, sharded above --max-shard-size). `pentatron checkpoint import-hf HF CKPT`:
the reverse, a step-0 checkpoint (`checkpoint/import_hf.py`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pentatron.checkpoint.errors import CheckpointError


def add_checkpoint_parser(subparsers: argparse._SubParsersAction) -> None:
    from pentatron.models.hf import _DTYPES

    p = subparsers.add_parser("checkpoint", help="training checkpoints: another layout, to and from Hugging Face")
    sub = p.add_subparsers(dest="action", required=True)
    cv = sub.add_parser("convert", help="re-write a checkpoint in another parallel layout (any number of processes)",
                        description="Load SRC (any layout) with the ranks of the target layout and save it into DST "
                                    "at the same step, data position and lineage; `pentatron train` in that layout "
                                    "with checkpoint.dir=DST then continues the run. Give the run's CONFIG (its "
                                    "model, batch and precision settings); the target layout is CONFIG's parallel "
                                    "section changed by --to-layout / --set.")
    cv.add_argument("src", type=Path, metavar="SRC", help="checkpoint.dir of a run (its latest) or one step_XXXXXXXX")
    cv.add_argument("dst", type=Path, metavar="DST", help="a new (empty) checkpoint directory")
    cv.add_argument("config", nargs="?", metavar="CONFIG", help="the run's TOML config (default: built-in defaults)")
    cv.add_argument("--to-layout", default="", metavar="K=V,...",
                    help="the target layout's parallel settings, e.g. dp=2,tp=2,pp=2,zero=1 (keys of [parallel])")
    cv.add_argument("--nproc", type=int, default=None,
                    help="local processes = the target layout's world size (default 1; not under torchrun/srun)")
    cv.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    cv.set_defaults(func=run_convert, dotted_overrides=True)
    ex = sub.add_parser("export-hf", help="write a checkpoint (any layout) as a Hugging Face Llama (Qwen3, Mixtral) "
                        "directory",
                        description="Assemble the full model from a training checkpoint written in any parallel "
                                    "layout and write config.json + safetensors that transformers loads.")
    ex.add_argument("checkpoint", type=Path, help="checkpoint.dir of a run (its latest) or one step_XXXXXXXX")
    ex.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    ex.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast on the way out (default fp32)")
    ex.add_argument("--max-shard-size", default="5GiB", help="shard above this size (default 5GiB)")
    ex.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    ex.add_argument("--tokenizer", type=Path, default=None,
                    help="dataset directory or tokenizer.json written beside the weights for AutoTokenizer "
                         "(default: the training run's dataset, named by run.json in the checkpoint directory)")
    ex.set_defaults(func=run_export_hf)
    im = sub.add_parser("import-hf", help="a Hugging Face Llama/Qwen3/Mixtral directory as a step-0 training "
                        "checkpoint",
                        description="Write the weights of a Hugging Face directory (with fresh optimizer state) "
                                    "as a training checkpoint; `pentatron train` with checkpoint.dir=CKPT_DIR "
                                    "then starts from them in any layout; model.hf_config=HF_DIR gives the run "
                                    "the same shape.")
    im.add_argument("hf_dir", type=Path, metavar="HF_DIR")
    im.add_argument("ckpt_dir", type=Path, metavar="CKPT_DIR", help="a new (empty) checkpoint directory")
    im.set_defaults(func=run_import_hf)


def run_convert(args: argparse.Namespace) -> int:
    from pentatron.config import ConfigError, load_config
    from pentatron.distributed.launch import launch_local_ranks, launched_world_size, rank_env_problem
    from pentatron.preflight import convert_problems
    from pentatron.runner import input_error, nproc_problem, problems_error, run_in_this_process, stop_all_ranks
    from pentatron.train.convert import convert_checkpoint

    layout = [kv.strip() for kv in args.to_layout.split(",") if kv.strip()]
    bad = [kv for kv in layout if "=" not in kv or "." in kv.split("=", 1)[0]]
    if bad:
        return input_error(f"--to-layout {args.to_layout!r}: expected KEY=VALUE pairs of [parallel] separated by "
                           f"commas (e.g. dp=2,tp=2,zero=1), got {', '.join(bad)}")
    overrides = [f"parallel.{kv}" for kv in layout] + list(args.overrides) + list(args.dotted)
    # DST is a new checkpoint directory of the converted run (never resumed into, never beside another run).
    overrides += [f"checkpoint.dir={json.dumps(str(args.dst))}", "checkpoint.resume=false",
                  "checkpoint.force_new=false"]
    if rank_env_problem():
        return input_error(rank_env_problem())
    outer = launched_world_size()
    problem = nproc_problem(args.nproc, outer)
    if problem:
        return input_error(problem)
    world = outer or args.nproc or 1
    try:
        cfg = load_config(args.config, overrides, world_size=world)
    except ConfigError as e:
        return stop_all_ranks([str(e)]) if outer is not None and outer > 1 else input_error(str(e))
    if outer is None and world > 1:
        problems = convert_problems(cfg, args.src, world, rank=0)
        if problems:
            return problems_error(problems)
        argv = ["checkpoint", "convert", str(args.src), str(args.dst), *([args.config] if args.config else []),
                *[f"--set={o}" for o in overrides]]
        return launch_local_ranks(world, argv)
    return run_in_this_process(cfg, lambda rank, w: convert_problems(cfg, args.src, w, rank),
                               lambda rank, verdict: convert_checkpoint(cfg, args.src), measure_peak=False)


def run_export_hf(args: argparse.Namespace) -> int:
    from pentatron.generate import CheckpointError as GenerateError
    from pentatron.generate import load_any_model
    from pentatron.models.hf import dtype_from_name, export_hf, parse_size
    from pentatron.writes import WriteError

    try:
        model, _, step_dir = load_any_model(args.checkpoint)
        tokenizer, eos, missing = _export_tokenizer(step_dir, args.tokenizer)
        export_hf(model, args.out_dir, parse_size(args.max_shard_size),
                  dtype_from_name(args.dtype) if args.dtype else None, overwrite=args.overwrite,
                  tokenizer=tokenizer, eos=eos)
    except (CheckpointError, GenerateError, ValueError, FileExistsError, WriteError) as e:
        print(f"pentatron: error: {e}", file=sys.stderr)
        return e.code if isinstance(e, WriteError) else 2
    if missing:
        print(f"pentatron: warning: no tokenizer written ({missing}); AutoTokenizer will not load {args.out_dir}",
              file=sys.stderr)
    with_tokenizer = f" with the tokenizer {tokenizer}" if tokenizer else ""
    print(f"pentatron: exported {step_dir} to {args.out_dir}{with_tokenizer}")
    return 0


def _export_tokenizer(step_dir: Path, override: Path | None) -> tuple[Path | None, tuple[str, int] | None, str]:
    """(tokenizer.json, its end-of-document (token, id), why there is none): the one the run trained with
    (`generate.tokenizer_source`). Only a tokenizer given with --tokenizer must exist: without it, a
    checkpoint whose dataset is not known is exported without one (with a warning)."""
    from pentatron.data.tokenize import KNOWN_EOS_TOKENS
    from pentatron.generate import CheckpointError as GenerateError
    from pentatron.generate import tokenizer_source
    from pentatron.models.hf_tokenizer import end_of_document

    try:
        path, eos_id = tokenizer_source(step_dir, override)
    except GenerateError as e:
        if override is not None:
            raise
        return None, None, str(e)
    try:
        token, found = end_of_document(path, eos_id, KNOWN_EOS_TOKENS)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own untyped exception
        raise GenerateError(f"tokenizer {path} is not a tokenizers tokenizer.json "
                            f"({str(e).splitlines()[0][:120]})") from None
    return path, (token, found) if token is not None and found is not None else None, ""


def run_import_hf(args: argparse.Namespace) -> int:
    from pentatron.checkpoint.errors import CheckpointWriteError
    from pentatron.checkpoint.import_hf import import_hf_checkpoint
    from pentatron.writes import WriteError

    try:
        path = import_hf_checkpoint(args.hf_dir, args.ckpt_dir)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"pentatron: error: {e}", file=sys.stderr)
        return 2
    except (WriteError, CheckpointWriteError) as e:  # the destination (2) or the disk (1)
        print(f"pentatron: error: {e}", file=sys.stderr)
        return getattr(e, "code", 1)
    # model.hf_config: the run reads the shape from the same config.json (no [model] fields to copy)
    print(f"pentatron: imported {args.hf_dir} as {path} (step 0); train from it with "
          f"--set checkpoint.dir={json.dumps(str(args.ckpt_dir))} --set model.hf_config={json.dumps(str(args.hf_dir))}")
    return 0
