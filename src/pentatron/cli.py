"""`pentatron train | plan | bench | tokenize | convert | schedule | generate | demo | lab | report |
checkpoint` — the user-facing entry point.

Exit codes: 0 done; 2 configuration or input error (one message on stderr naming the field, no
traceback); 1 any other failure, with a message naming the rank.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable


def _add_train_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help="train a model from a TOML config",
        description="Train from CONFIG. Override any field with --set section.key=value or "
                    "--section.key=value (e.g. --set train.steps=50 --parallel.zero=1).")
    p.add_argument("config", nargs="?", help="TOML config file (default: built-in defaults)")
    p.add_argument("--nproc", type=int, default=None,
                   help="local processes to launch through torchrun (default 1; not needed under an "
                        "outer torchrun/srun)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--force-new", action="store_true",
                   help="start a new run in a checkpoint.dir that holds another run's checkpoints (kept)")
    p.add_argument("--resume-from", metavar="STEP", default=None,
                   help="resume this step directory of checkpoint.dir (step_00000100 or 100) instead of `latest`")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense TFLOP/s per device for MFU (default: hardware table / measured)")
    multi = p.add_argument_group("several machines (run the same command on each, with its --node-rank)")
    multi.add_argument("--nnodes", type=int, default=1, help="machines in the job (default 1)")
    multi.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 … nnodes-1")
    multi.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="node 0's address and a free port, where the ranks meet")
    # Set by the launcher for its ranks: the checks it already made and the run directory it chose.
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--preflight-done", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from pentatron.config import ConfigError, load_config
    from pentatron.distributed.launch import launched_world_size, rank_env_problem
    from pentatron.runner import launch, nproc_problem, stop_all_ranks, train_in_this_process

    overrides = list(args.overrides) + list(args.dotted)
    if args.force_new:
        overrides += ["checkpoint.resume=false", "checkpoint.force_new=true"]
    if args.resume_from is not None:
        overrides.append(f"checkpoint.resume_from={json.dumps(args.resume_from)}")
    if args.peak_tflops is not None:
        overrides.append(f"train.peak_tflops={args.peak_tflops}")
    if rank_env_problem():
        return _input_error(rank_env_problem())
    outer = launched_world_size()
    problem = nproc_problem(args.nproc, outer, args.nnodes)
    if problem:
        return _input_error(problem)
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        return _input_error(f"--node-rank must be within 0 … --nnodes-1, got --nnodes {args.nnodes} "
                            f"--node-rank {args.node_rank}")
    if args.nnodes > 1 and not (args.rdzv_endpoint and ":" in args.rdzv_endpoint):
        return _input_error("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address and a free port)")
    world = outer or (args.nproc or 1) * args.nnodes
    try:
        cfg = load_config(args.config, overrides, world_size=world)
    except ConfigError as e:
        if outer is not None and outer > 1:
            return stop_all_ranks([str(e)])  # printed once, by rank 0
        return _input_error(str(e))

    if outer is None and world > 1:
        argv = ["train"] + ([args.config] if args.config else []) + [f"--set={o}" for o in overrides]
        return launch(cfg, argv, nproc=args.nproc or 1, nnodes=args.nnodes, node_rank=args.node_rank,
                      rdzv_endpoint=args.rdzv_endpoint)
    return train_in_this_process(cfg, run_dir=args.run_dir, preflight_done=args.preflight_done)


def _input_error(message: str) -> int:
    print(f"pentatron: error: {message}", file=sys.stderr)
    return 2


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pentatron", description="Train language models with 5D parallelism (data + ZeRO, tensor + sequence, "
                                      "pipeline, context, expert) and plan the layout before spending GPU hours.")
    sub = parser.add_subparsers(dest="command", required=True)
    if command == "train":  # what every rank parses: the other commands' modules are not its to import
        _add_train_parser(sub)
        return parser
    from pentatron.calibrate.cli import add_bench_parser
    from pentatron.plan.cli import add_plan_parser

    if command in ("plan", "bench"):  # the other registrars import torch; a plan must not pay for it
        add_plan_parser(sub)
        add_bench_parser(sub)
        return parser
    from pentatron.checkpoint_cli import add_checkpoint_parser
    from pentatron.data.tokenize import add_tokenize_parser
    from pentatron.demo import add_demo_parser
    from pentatron.generate import add_generate_parser
    from pentatron.lab.cli import add_lab_parser
    from pentatron.models.hf import add_convert_parser
    from pentatron.observe.report import add_report_parser
    from pentatron.parallel.pipeline.cli import add_schedule_parser

    registrars: list[Callable[[argparse._SubParsersAction], None]] = [
        _add_train_parser, add_plan_parser, add_bench_parser, add_tokenize_parser, add_convert_parser,
        add_schedule_parser, add_generate_parser, add_demo_parser, add_lab_parser, add_report_parser,
        add_checkpoint_parser]
    for register in registrars:
        register(sub)
    return parser


def _split_dotted(argv: list[str]) -> tuple[list[str], list[str]]:
    """Pull `--section.key=value` / `--section.key value` flags out of argv as config overrides."""
    rest, dotted, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        name = a[2:].split("=", 1)[0] if a.startswith("--") else ""
        if "." in name and not name.startswith("."):
            if "=" in a:
                dotted.append(a[2:])
            elif i + 1 < len(argv):
                dotted.append(f"{name}={argv[i + 1]}")
                i += 1
            else:
                dotted.append(name)  # parse_override reports the missing value
        else:
            rest.append(a)
        i += 1
    return rest, dotted


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, dotted = _split_dotted(argv)
    args = build_parser(rest[0] if rest else None).parse_args(rest)
    args.dotted = dotted
    if dotted and not getattr(args, "dotted_overrides", args.command == "train"):
        return _input_error(f"{' '.join('--' + d for d in dotted)}: dotted config flags apply to `train` and "
                            "`checkpoint convert` only")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
