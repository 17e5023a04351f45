"""FP8 vs bf16 loss curves through `pentatron train` (1 process, CPU): the debug model and a ~25M-parameter
Llama, each trained in bf16, with FP8 GEMMs tensorwise and rowwise (train.fp8), on the same data, seed and
initialisation; and a second bf16 run whose only difference is the micro-batch split (the same global batch in
twice as many micro-batches: the same samples in the same order, only fp32 sums in another order). That run
is the yardstick: a recipe is "within" when its curve departs from bf16 by at most FACTOR times as much as bf16
departs from itself under that split, for both the mean and the max |loss gap| over the curve. For scale, a
looser one: a bf16 run with train.seed + 1 (another initialisation and data order: a re-run's spread).

    python benchmarks/fp8_loss.py                      # both models (~20 min on 2 busy cores)
    python benchmarks/fp8_loss.py --models debug --steps 100
    python benchmarks/fp8_loss.py --models debug --seed 2 --runs "fp8 tensorwise" "fp8 rowwise"

The max of a per-step gap is a noisy statistic: --seed repeats the whole comparison (every run, baselines
included) with another init and data order.

--emulate: the FP8 GEMMs as torchao's emulation (the same fp8 operands and scales, dequantised, an fp32 GEMM,
the output rounded to bf16) instead of torch._scaled_mm, for CPUs where oneDNN has no fp8 kernel and runs its
reference one (~40 s a step of the debug model, e.g. Xeons without AMX-FP16: ONEDNN_VERBOSE=1 prints
`ref:any`). It differs from _scaled_mm (fp32 accumulation on CPU) only in fp32 rounding order, the split run's
kind of difference, ~1e-7 against e4m3's 2⁻⁴ steps: research/fp8_rowwise_ablation.py --check-emulation.

Prints a markdown table (for BENCHMARKS.md). final = mean loss of the last 20 steps; gaps are per step, against
the bf16 run, over the whole curve.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FACTOR = 2.0  # a single split pair is one sample of bf16's self-spread: twice it leaves room for its scatter
LAST = 20

# ~25M parameters: 8 layers of h 512 (8 heads, 4 kv heads of 64), SwiGLU 1408 (= 2.75 h, divisible by 16 as
# FP8 GEMMs need), the default corpus's 4096-token vocabulary, tied embeddings: 25.7M.
LLAMA_25M = {"model.hidden_size": 512, "model.n_layers": 8, "model.n_heads": 8, "model.n_kv_heads": 4,
             "model.ffn_hidden_size": 1408}
MODELS = {  # name: (model overrides, seq_len, global batch, lr, warmup, steps)
    "debug": ({}, 64, 8, 1e-3, 20, 300),
    "llama-25m": (LLAMA_25M, 64, 2, 1e-3, 20, 200),
}
RUNS = ("bf16", "bf16 split", "bf16 seed+1", "fp8 tensorwise", "fp8 rowwise")
BASE = ("bf16", "bf16 split")  # every table needs the reference and the yardstick


def emulated_child(argv: list[str]) -> int:
    """`pentatron train` with every FP8 GEMM emulated (torchao's Float8LinearConfig.emulate)."""
    import pentatron.parallel.fp8 as fp8
    from pentatron.cli import main as cli

    recipe_config = fp8.recipe_config
    fp8.recipe_config = lambda recipe: dataclasses.replace(recipe_config(recipe), emulate=True)
    return cli(argv)


EMULATED = (str(Path(__file__).resolve()), "--emulated-child")  # train()'s launcher for --emulate


def train(model: str, run: str, steps: int, out: Path, seed: int,
          launcher: tuple[str, ...] = ("-m", "pentatron.cli")) -> tuple[list[float], float]:
    """One `pentatron train` run; its per-step losses (metrics.jsonl) and wall seconds. `launcher`: what the
    interpreter runs with `train ...` (research/fp8_rowwise_ablation.py swaps in other torchao configs)."""
    shape, seq, batch, lr, warmup, _ = MODELS[model]
    micro = batch // 2 if run == "bf16 split" else batch
    fp8 = run.split()[1] if run.startswith("fp8") else "off"
    sets = {"model.name": "debug", **shape, "train.steps": steps, "train.seq_len": seq, "train.global_batch": batch,
            "train.micro_batch": micro, "train.lr": lr, "train.warmup": min(warmup, steps // 10),
            "train.precision": "bf16", "train.compile": "false", "train.fp8": json.dumps(fp8),
            "train.seed": seed + 1 if run == "bf16 seed+1" else seed, "log.every": 1,
            "log.dir": json.dumps(str(out)), "log.tensorboard": "false", "log.progress": "false"}
    argv = [sys.executable, *launcher, "train", "--force-new",
            *(f"--set={k}={v}" for k, v in sets.items())]
    # one thread: the same GEMM blocking in every run, and no spinning threads on a shared machine
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{model} / {run} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    (metrics,) = out.glob("2*/metrics.jsonl")
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    if len(losses) != steps:
        raise SystemExit(f"{model} / {run}: {len(losses)} steps logged, {steps} asked")
    return losses, time.perf_counter() - t0


def gaps(a: list[float], b: list[float]) -> tuple[float, float]:
    d = [abs(x - y) for x, y in zip(a, b)]
    return max(d), statistics.fmean(d)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--steps", type=int, help="steps of every run (default: debug 300, llama-25m 200)")
    p.add_argument("--seed", type=int, default=0, help="train.seed of every run (init and data order; the "
                   "'seed+1' run: this + 1): repeat with several to see the gaps' spread")
    p.add_argument("--runs", nargs="+", choices=RUNS[2:], default=list(RUNS[2:]),
                   help="runs besides bf16 and bf16 split (default: all)")
    p.add_argument("--emulate", action="store_true", help="emulated FP8 GEMMs (CPUs without an fp8 kernel)")
    p.add_argument("--json", type=Path, help="also write every curve here (rewritten after each run)")
    args = p.parse_args()
    launcher = EMULATED if args.emulate else ("-m", "pentatron.cli")
    runs = [*BASE, *(r for r in RUNS if r in args.runs)]
    curves: dict[str, dict[str, list[float]]] = {}
    rows = ["| model | run | final loss (last 20) | max \\|gap\\| | mean \\|gap\\| | bound max / mean (split) "
            "| verdict | vs seed+1 | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            curves[model] = {}
            walls = {}
            for run in runs:
                out = Path(tmp) / model / run.replace(" ", "_").replace("+", "p")
                curves[model][run], walls[run] = train(model, run, args.steps or MODELS[model][5], out, args.seed,
                                                         launcher)
                print(f"{model} / {run}: {walls[run]:.0f} s", file=sys.stderr, flush=True)
                if args.json:
                    args.json.write_text(json.dumps(curves))
            ref = curves[model]["bf16"]
            split_max, split_mean = gaps(curves[model]["bf16 split"], ref)
            bound = (FACTOR * split_max, FACTOR * split_mean)
            other = curves[model].get("bf16 seed+1")
            seed_max, seed_mean = gaps(other, ref) if other else (None, None)
            for run in runs:
                c = curves[model][run]
                final = statistics.fmean(c[-LAST:])
                if run == "bf16":
                    rows.append(f"| {model} | {run} | {final:.4f} | — | — | — | reference | — | {walls[run]:.0f} |")
                    continue
                mx, mn = gaps(c, ref)
                bf16 = run.startswith("bf16")
                verdict = "yardstick" if bf16 else "within" if mx <= bound[0] and mn <= bound[1] else "outside"
                seed = ("—" if bf16 or other is None else
                        "within" if mx <= seed_max and mn <= seed_mean else "outside")
                rows.append(f"| {model} | {run} | {final:.4f} | {mx:.4f} | {mn:.4f} | {bound[0]:.4f} / {bound[1]:.4f} "
                            f"| {verdict} | {seed} | {walls[run]:.0f} |")
    print(", ".join(f"{m}: {args.steps or MODELS[m][5]} steps of {MODELS[m][2]}×{MODELS[m][1]} tokens"
                    for m in args.models) + f"; train.seed {args.seed}; "
          f"bound = {FACTOR:g} × the bf16 split run's gap; 'vs seed+1': max and mean gap <= the "
          f"seed-{args.seed + 1} bf16 run's (factor 1)" + ("; FP8 GEMMs emulated" if args.emulate else ""))
    print("\n".join(rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--emulated-child"]:
        sys.exit(emulated_child(sys.argv[2:]))
    main()
