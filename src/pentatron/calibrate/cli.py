"""`pentatron bench` sub-command (registered by the top-level `pentatron.cli`): measure this machine and
write a hardware profile (`pentatron.hardware.profile`) for `pentatron plan --hardware-profile`.

Exit codes: 0 the profile was written; 1 a measurement failed; 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

from pentatron.plan.cli import InputError, _fail, parse_count


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="measure this machine (matmul, memory, collectives) into a hardware profile",
        description="Measure matmul FLOP/s, memory-copy bandwidth and all-reduce / all-gather / "
                    "reduce-scatter bus bandwidth by message size over N local processes (gloo on CPU, "
                    "NCCL on GPU), and write a profile for `pentatron plan --hardware-profile`.")
    p.add_argument("--nproc", type=int, default=None, help="local processes (default: 2 on CPU, all GPUs)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--out", default="hardware-profile.toml", help="profile to write (.toml or .json)")
    p.add_argument("--max-bytes", default=None, help="largest collective message (default 1M CPU, 256M GPU)")
    p.add_argument("--seconds", type=float, default=0.1, help="time budget per measurement (default 0.1)")
    p.add_argument("--json", action="store_true", help="also print the measurements as JSON")
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from pentatron.calibrate.bench import BenchError, run_benchmarks, write_profile

    try:
        max_bytes = parse_count(args.max_bytes, "--max-bytes") if args.max_bytes else None
        if args.nproc is not None and args.nproc < 1:
            raise InputError(f"--nproc must be >= 1, got {args.nproc}")
        if args.seconds <= 0:
            raise InputError(f"--seconds must be > 0, got {args.seconds}")
        if not str(args.out).endswith((".toml", ".json")):
            raise InputError(f"--out {args.out!r} must end in .toml or .json")
    except InputError as e:
        return _fail("bench", str(e))
    try:
        result = run_benchmarks(device=args.device, nproc=args.nproc, max_bytes=max_bytes, seconds=args.seconds)
    except BenchError as e:
        return _fail("bench", str(e))
    except RuntimeError as e:  # a worker died: a failure, not an input error
        print(f"pentatron bench: failed: {e}", file=sys.stderr)
        return 1
    path = write_profile(result, args.out)
    print(result.summary())
    print(f"profile written to {path} (use: pentatron plan --hardware-profile {path})")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    return 0
