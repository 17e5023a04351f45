"""`pentatron train | plan | bench | tokenize | convert | schedule | lab | report` — the user-facing entry point.

Exit codes: 0 done; 2 configuration or input error (one message on stderr naming the field, no
traceback); 1 any other failure, with a message naming the rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
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
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense TFLOP/s per device for MFU (default: hardware table / measured)")
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from pentatron.config import ConfigError, load_config
    from pentatron.data.errors import DataError
    from pentatron.distributed.launch import launched_world_size, run_under_torchrun

    overrides = list(args.overrides) + list(args.dotted)
    if args.peak_tflops is not None:
        overrides.append(f"train.peak_tflops={args.peak_tflops}")
    outer = launched_world_size()
    if outer is not None and args.nproc not in (None, outer):
        return _input_error(f"--nproc {args.nproc} conflicts with the outer launcher's WORLD_SIZE={outer}; "
                            "drop --nproc under torchrun/srun")
    if args.nproc is not None and args.nproc < 1:
        return _input_error(f"--nproc must be ≥ 1, got {args.nproc}")
    world = outer or args.nproc or 1
    try:
        cfg = load_config(args.config, overrides, world_size=world)
    except ConfigError as e:
        return _input_error(str(e))

    if outer is None and world > 1:
        # Validated above, so no process group ever starts on a bad config. Pre-build the default
        # dataset once here, so that the ranks find it cached.
        try:
            _prepare_data(cfg)
        except DataError as e:
            return _input_error(str(e))
        argv = ["train"] + ([args.config] if args.config else []) + [f"--set={o}" for o in overrides]
        return run_under_torchrun(world, argv)
    return _train_in_this_process(cfg)


def _prepare_data(cfg) -> None:  # noqa: ANN001 - Config, imported lazily
    from pentatron.train.trainer import resolve_dataset

    resolve_dataset(cfg, cfg.model_config().vocab_size)


def _train_in_this_process(cfg) -> int:  # noqa: ANN001
    from pentatron.data.errors import DataError
    from pentatron.distributed.launch import init_distributed, local_device
    from pentatron.train.trainer import Trainer

    rank = int(os.environ.get("RANK", "0"))
    try:
        from pentatron.observe.watchdog import process_group_timeout

        init_distributed(local_device(cfg.train.device), process_group_timeout(cfg.distributed.timeout_s))
        Trainer(cfg).fit()
    except DataError as e:
        return _input_error(f"rank {rank}: {e}")
    except KeyboardInterrupt:
        print(f"pentatron: rank {rank} interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - report which rank failed, with the traceback for debugging
        traceback.print_exc()
        print(f"pentatron: rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _input_error(message: str) -> int:
    print(f"pentatron: error: {message}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    from pentatron.data.tokenize import add_tokenize_parser
    from pentatron.lab.cli import add_lab_parser
    from pentatron.models.hf import add_convert_parser
    from pentatron.observe.report import add_report_parser
    from pentatron.parallel.pipeline.cli import add_schedule_parser
    from pentatron.plan.cli import add_bench_parser, add_plan_parser

    parser = argparse.ArgumentParser(prog="pentatron", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    registrars: list[Callable[[argparse._SubParsersAction], None]] = [
        _add_train_parser, add_plan_parser, add_bench_parser, add_tokenize_parser, add_convert_parser,
        add_schedule_parser, add_lab_parser, add_report_parser]
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
    args = build_parser().parse_args(rest)
    args.dotted = dotted
    if dotted and args.command != "train":
        return _input_error(f"{' '.join('--' + d for d in dotted)}: dotted config flags apply to `train` only")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
