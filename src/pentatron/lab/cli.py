"""`pentatron lab [NAME|GROUP] [--quick] [--out DIR]`: run the failure lab's experiments and print verdicts."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pentatron.lab.common import Verdict


def experiments() -> dict[str, tuple[str, Callable[[Path, bool], Verdict]]]:
    from pentatron.lab.collective import collective_mismatch
    from pentatron.lab.divergence import lr_spike
    from pentatron.lab.fp8 import fp8_edges, fp8_outlier
    from pentatron.lab.precision import grad_accumulation, loss_scaling, master_weights
    from pentatron.lab.scaling import grad_scale

    return {
        "master-weights": ("(a) bf16 weights without fp32 master weights", master_weights),
        "grad-accumulation": ("(b) bf16 vs fp32 gradient accumulation", grad_accumulation),
        "loss-scaling": ("(c) fp16 without / with dynamic loss scaling", loss_scaling),
        "grad-scale": ("(d) loss not ÷ micro-batches, dp grads summed not averaged", grad_scale),
        "lr-spike": ("(e) too-high LR without warmup: spike and divergence", lr_spike),
        "collective": ("(f) a skipped all-reduce: check mode and the hang watchdog", collective_mismatch),
        "fp8-outlier": ("(g) FP8 tensorwise scaling with one activation outlier vs rowwise", fp8_outlier),
        "fp8-edges": ("(h) FP8 in the first/last decoder layers vs keeping them high precision", fp8_edges),
    }


# Named sets of experiments: `pentatron lab fp8` runs every FP8 trap.
GROUPS = {"fp8": ("fp8-outlier", "fp8-edges")}
# Left out of a bare `pentatron lab` (all the others) because a full run costs over 20 s; run by name or group.
NOT_DEFAULT = frozenset({"fp8-edges"})


def selected(name: str | None, table: dict) -> list[str] | None:
    """The experiments `pentatron lab [name]` runs, in order; None for an unknown name."""
    if name is None:
        return [n for n in table if n not in NOT_DEFAULT]
    if name in GROUPS:
        return [n for n in GROUPS[name] if n in table]
    return [name] if name in table else None


def add_lab_parser(subparsers: argparse._SubParsersAction) -> None:
    names = ", ".join(experiments())
    groups = "; ".join(f"{g}: {', '.join(members)}" for g, members in GROUPS.items())
    p = subparsers.add_parser("lab", help="reproduce training failures on the debug model (CPU)",
                              description=f"Run one failure-lab experiment, a group, or the defaults: {names}. "
                                          f"Groups: {groups}. Not run by default: {', '.join(sorted(NOT_DEFAULT))}. "
                                          "Each prints a verdict from measured numbers and saves a PNG.")
    p.add_argument("name", nargs="?", default=None,
                   help=f"experiment or group (default: all but {', '.join(sorted(NOT_DEFAULT))})")
    p.add_argument("--quick", action="store_true", help="smaller sizes (what the tests run)")
    p.add_argument("--out", default="runs/lab", help="directory for the PNGs and logs (default runs/lab)")
    p.set_defaults(func=run_lab)


def run_lab(args: argparse.Namespace) -> int:
    import torch

    table = experiments()
    names = selected(args.name, table)
    if names is None:
        print(f"pentatron: error: unknown lab experiment {args.name!r}; choose one of {', '.join(table)} "
              f"or a group ({', '.join(GROUPS)})", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and the lab shares the machine
    out = Path(args.out)
    failed = []
    for name in names:
        title, fn = table[name]
        print(f"pentatron lab: {title} …", flush=True)
        start = time.perf_counter()
        try:
            verdict = fn(out, args.quick)
        except Exception as e:  # noqa: BLE001 - one experiment's failure is one line; the others still run
            print(f"[{name}] FAILED: {type(e).__name__}: {' '.join(str(e).split())} "
                  f"({time.perf_counter() - start:.1f} s)\n", flush=True)
            failed.append(name)
            continue
        print(verdict.report() + f"\n  ({time.perf_counter() - start:.1f} s)\n", flush=True)
        if not verdict.reproduced:
            failed.append(name)
    if failed:
        print(f"pentatron lab: failed or not reproduced: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
