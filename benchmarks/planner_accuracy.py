"""How close is `pentatron plan` to published training runs? Evaluates every row of
`benchmarks/published_runs.toml` with its exact layout and prints predicted vs published tokens/s/GPU
per row, then the median, p90 and signed median error overall, per split and per source (and memory
where published).

    python benchmarks/planner_accuracy.py [--file benchmarks/published_runs.toml] [--json] [--source mpt]
    python benchmarks/planner_accuracy.py --split heldout   # the figures `pentatron plan` quotes

Every source is "tuning" or "heldout" (the file's `[split]`, fixed 2026-12-03): the planner may be
tuned on tuning rows only, so the held-out figures are the honest ones; `heldout_accuracy()` is the line
`pentatron plan` prints (plan/report.py MEASURED_ACCURACY, pinned to it by tests/plan/test_heldout.py).

Published TFLOP/s and MFU are converted to tokens/s/GPU with the source's own FLOP convention, iteration
times with the row's global batch (see the file's header). For reference it also prints the error of a
constant-MFU guess (`--baseline-mfu`, default 40 %).
Nothing is fitted here: the planner's constants come from kernel and collective measurements.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import tomllib

from pentatron.hardware.catalogue import GiB, GPUSpec, get_gpu, hardware_from_dict
from pentatron.models.config import ModelConfig
from pentatron.models.registry import get_model_config
from pentatron.plan.cli import fixed_knobs, plan_parser, requested_layout
from pentatron.plan.flops import model_flops_per_token
from pentatron.plan.layout import Layout, Workload, compute_dtype, problems
from pentatron.plan.memory import MemoryBreakdown, memory_for_rank
from pentatron.plan.recipes import RECIPE_FIELDS, get_recipe, resolve_kernels
from pentatron.plan.search import Prediction, predict

DEFAULT_FILE = Path(__file__).with_name("published_runs.toml")
# a row's keys that are `pentatron plan` layout flags (the value's flag: --name-with-dashes)
LAYOUT_FLAGS = ("dp", "tp", "pp", "cp", "ep", "zero", "pp_schedule", "pp_virtual", "micro_batch", "cp_mode",
                "cp_ulysses", "precision", "fp8_scaling", "attention")
# what a row leaves out (the file's header): given to the CLI explicitly, which would search it otherwise
ROW_DEFAULTS = {"tp": 1, "pp": 1, "cp": 1, "zero": 0, "pp_schedule": "1f1b", "cp_mode": "ring", "micro_batch": 1,
                "precision": "bf16"}


@dataclass(frozen=True)
class Row:
    id: str
    source: str
    split: str  # "tuning" or "heldout": the source's, fixed in the file's [split]
    confirmed: bool
    workload: Workload
    gpu: GPUSpec
    published_tps: float  # tokens/s/GPU
    published_memory: float | None  # bytes per GPU
    inferred: tuple[str, ...]
    # the `pentatron plan` arguments of the row's layout and recipe (without --recompute when "auto")
    args: tuple[str, ...]
    recompute_auto: bool = False  # recompute not published: the lightest of none/selective/full that fits
    # which GPU's peak the source publishes: None, the fullest (torchtitan: the maximum over all GPUs), or
    # that pipeline rank's (nanotron logs world rank 0, which holds pipeline stage 0)
    memory_rank: int | None = None

    def plan(self, recompute: str | None = None) -> tuple[Layout, str]:
        """(layout, kernels) as `pentatron plan` builds them from `args` (and `--recompute`)."""
        extra = ("--recompute", recompute) if recompute else ()
        args = plan_parser().parse_args([*self.args, *extra])
        fixed = fixed_knobs(args)
        return requested_layout(fixed, args.gpus), resolve_kernels(fixed["recipe"], args.kernels)

    @property
    def layout(self) -> Layout:
        """The row's layout (recompute "auto": without recompute)."""
        return self.plan("none" if self.recompute_auto else None)[0]

    @property
    def kernels(self) -> str:
        return self.plan("none" if self.recompute_auto else None)[1]

    @property
    def norm(self) -> str | None:
        return self.layout.recipe.norm


def build_model(name: str, spec: dict[str, Any]) -> ModelConfig:
    """GPT-style shapes become our block with a GELU 4h MLP and MHA; Llama ones are taken as given."""
    spec = dict(spec)
    if "registry" in spec:
        return get_model_config(spec["registry"])
    arch = spec.pop("arch", "gpt")
    h = spec["hidden_size"]
    base = {"n_kv_heads": spec["n_heads"], "ffn_hidden_size": 4 * h, "max_seq_len": 131072}
    if arch == "gpt":
        base.update(mlp="gelu", tie_embeddings=True)
    return ModelConfig(name=name, **{**base, **spec})


def megatron2021_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """Narayanan et al. 2021 eq. (3) per token: 96 l h^2 (1 + s/6h + V/(16 l h)); counts the
    recomputed forward (4 passes of 24 l h^2), the attention square and the LM head."""
    l, h, v = cfg.n_layers, cfg.hidden_size, cfg.vocab_size
    return 96 * l * h * h * (1 + seq / (6 * h) + v / (16 * l * h))


SPLITS = ("tuning", "heldout")


def check_split(data: dict[str, Any]) -> None:
    """Every source names its split, and `[split] heldout_sources` lists exactly the held-out ones."""
    sources = data["sources"]
    bad = {k: v.get("split") for k, v in sources.items() if v.get("split") not in SPLITS}
    if bad:
        raise ValueError(f"sources without split = 'tuning' | 'heldout': {bad}")
    held = {k for k, v in sources.items() if v["split"] == "heldout"}
    listed = set(data.get("split", {}).get("heldout_sources", ()))
    if held != listed:
        raise ValueError(f"[split] heldout_sources {sorted(listed)} != sources marked heldout {sorted(held)}")


def load_rows(path: Path = DEFAULT_FILE) -> list[Row]:
    data = tomllib.loads(path.read_text())
    check_split(data)
    models = {k: build_model(k, v) for k, v in data["models"].items()}
    return [row_from_dict(r, models, data["sources"]) for r in data["run"]]


def plan_args(r: dict[str, Any], recipe_name: str) -> list[str]:
    """The `pentatron plan` flags for a row's layout and recipe: its layout flags, `--recipe` and a
    `--recipe-set` for each recipe field whose value differs from the preset (`--kernels` likewise)."""
    out = ["--gpus", str(r["gpus"]), "--recipe", recipe_name]
    given = {**ROW_DEFAULTS, **r}  # every layout flag pinned: the CLI searches none of them
    for k in LAYOUT_FLAGS:
        if k in given:
            out += [f"--{k.replace('_', '-')}", str(given[k])]
    if "sp" in r:
        out.append("--sp" if r["sp"] else "--no-sp")
    if "pp_layers" in r:
        out += ["--pp-layers", ",".join(map(str, r["pp_layers"]))]
    if r.get("recompute", "none") != "auto":
        out += ["--recompute", r.get("recompute", "none")]
    preset = get_recipe(recipe_name)
    for k in RECIPE_FIELDS:
        if k != "kernels" and k in r and r[k] != getattr(preset, k):
            v = r[k]
            out += ["--recipe-set", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
    if resolve_kernels(preset, r.get("kernels", "fused")) != resolve_kernels(preset):
        out += ["--kernels", r.get("kernels", "fused")]
    return out


def row_from_dict(r: dict[str, Any], models: dict[str, ModelConfig], sources: dict[str, Any]) -> Row:
    """One [[run]] table (its source's defaults under it) as a Row."""
    src = sources[r["source"]]
    r = {**src.get("defaults", {}), **r}
    cfg = models[r["model"]]
    w = Workload(cfg, r["seq"], r["global_batch"])
    gpu = get_gpu(r["gpu"])
    if "hw" in r:
        gpu = hardware_from_dict({"base": gpu.name, **r["hw"]}, where=r["id"])
    row = Row(r["id"], r["source"], src["split"], r.get("confirmed", True), w, gpu, 0.0, None,
              tuple(r.get("inferred", ())), tuple(plan_args(r, r.get("recipe", src.get("recipe", "pentatron")))),
              r.get("recompute") == "auto", r.get("memory_rank"))
    lay = row.layout
    if lay.world != r["gpus"]:
        raise ValueError(f"{r['id']}: dp*tp*pp*cp = {lay.world} != gpus {r['gpus']}")
    if r["metric"] == "tokens_per_s_per_gpu":
        tps = float(r["value"])
    elif r["metric"] == "iteration_s":  # seconds per step of the whole global batch
        tps = r["global_batch"] * r["seq"] / (r["value"] * r["gpus"])
    elif r["metric"] in ("tflops_per_gpu", "mfu"):
        fpt = (megatron2021_flops_per_token(cfg, r["seq"]) if r["flops"] == "megatron2021"
               else model_flops_per_token(cfg, r["seq"]))
        flops = (r["value"] * 1e12 if r["metric"] == "tflops_per_gpu"
                 else r["value"] / 100 * gpu.flops(compute_dtype(lay.precision)))
        tps = flops / fpt
    else:
        raise ValueError(f"{r['id']}: unknown metric {r['metric']!r}")
    mem = r.get("memory_gib")
    return replace(row, published_tps=tps, published_memory=mem * GiB if mem is not None else None)


@dataclass(frozen=True)
class Result:
    row: Row
    pred: Prediction
    refused: tuple[str, ...]  # what `problems` says (the row is evaluated anyway)
    baseline_tps: float
    memory: MemoryBreakdown  # the predicted peak of the GPU the source measured

    @property
    def error(self) -> float:
        return self.pred.rate.tokens_per_s_per_gpu / self.row.published_tps - 1

    @property
    def baseline_error(self) -> float:
        return self.baseline_tps / self.row.published_tps - 1

    @property
    def memory_error(self) -> float | None:
        if self.row.published_memory is None:
            return None
        return self.memory.total / self.row.published_memory - 1


def _predict(row: Row) -> Prediction:
    """The row's layout as the CLI builds it; recompute "auto" (not published) takes the lightest mode
    that fits, as the planner's search does."""
    for mode in ("none", "selective", "full") if row.recompute_auto else (None,):
        lay, kernels = row.plan(mode)
        pred = predict(row.workload, lay, row.gpu, kernels=kernels)
        if pred.fits:
            break
    return pred


def evaluate(rows: list[Row], baseline_mfu: float = 0.40) -> list[Result]:
    out = []
    for row in rows:
        lay, kernels = row.plan("none" if row.recompute_auto else None)
        probs = problems(row.workload, lay, row.gpu, lay.world)
        pred = _predict(row)
        peak = row.gpu.flops(compute_dtype(lay.precision))
        base = baseline_mfu * peak / model_flops_per_token(row.workload.cfg, row.workload.seq_len)
        mem = pred.memory if row.memory_rank is None else memory_for_rank(
            row.workload, pred.layout, row.gpu, row.memory_rank, kernels)
        out.append(Result(row, pred, tuple(probs), base, mem))
    return out


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of the values."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, round(q * len(s) + 0.5) - 1))]


def summary(results: list[Result]) -> dict[str, dict[str, float]]:
    """Per group ("all", each split that has rows, each source): tokens/s and memory errors."""
    groups: dict[str, list[Result]] = {"all": results}
    for split in SPLITS:
        if any(r.row.split == split for r in results):
            groups[split] = [r for r in results if r.row.split == split]
    for r in results:
        groups.setdefault(r.row.source, []).append(r)
    out = {}
    for name, rs in groups.items():
        e = [abs(r.error) for r in rs]
        b = [abs(r.baseline_error) for r in rs]
        out[name] = {"n": len(rs), "median_abs_error": statistics.median(e), "p90_abs_error": percentile(e, 0.9),
                     "signed_median_error": statistics.median(r.error for r in rs),
                     "baseline_median_abs_error": statistics.median(b), "baseline_p90_abs_error": percentile(b, 0.9),
                     "predicted_not_fit": sum(1 for r in rs if not r.pred.fits),
                     "predicted_tight": sum(1 for r in rs if r.pred.tight),
                     "refused": sum(1 for r in rs if r.refused)}
        signed = [r.memory_error for r in rs if r.memory_error is not None]
        m = [abs(x) for x in signed]
        if m:
            out[name] |= {"memory_rows": len(m), "memory_median_abs_error": statistics.median(m),
                          "memory_p90_abs_error": percentile(m, 0.9),
                          "memory_signed_median_error": statistics.median(signed),
                          "memory_worst_abs_error": max(m), "memory_within_10pct": sum(1 for x in m if x <= 0.10)}
    return out


def heldout_accuracy(results: list[Result]) -> str:
    """The held-out figures as `pentatron plan` prints them (plan/report.py MEASURED_ACCURACY)."""
    held = [r for r in results if r.row.split == "heldout"]
    h = summary(held)["all"]
    n_sources = len({r.row.source for r in held})
    return (f"held-out published runs (split 2026-12-03, {h['n']} runs from {n_sources} sources): tokens/s "
            f"median error {100 * h['median_abs_error']:.1f} %, p90 {100 * h['p90_abs_error']:.1f} %, "
            f"signed median {100 * h['signed_median_error']:+.1f} %; peak memory ({h['memory_rows']} runs) median "
            f"{100 * h['memory_median_abs_error']:.1f} %, p90 {100 * h['memory_p90_abs_error']:.1f} %, "
            f"signed median {100 * h['memory_signed_median_error']:+.1f} %")


def format_table(results: list[Result]) -> str:
    lines = [f"{'run':<34} {'layout':<46} {'published':>9} {'predicted':>9} {'error':>7}  fits  mem",
             "-" * 122]
    for r in results:
        mem = ""
        if r.memory_error is not None:
            mem = (f"{r.memory.total / GiB:.1f}/{r.row.published_memory / GiB:.0f} GiB "
                   f"({100 * r.memory_error:+.0f}%)")
        flag = "" if r.row.confirmed else " *"
        lines.append(f"{r.row.id + flag:<34} {r.pred.layout.short()[:46]:<46} {r.row.published_tps:>9.0f} "
                     f"{r.pred.rate.tokens_per_s_per_gpu:>9.0f} {100 * r.error:>+6.0f}%  "
                     f"{('tight' if r.pred.tight else 'yes') if r.pred.fits else 'NO':<5} {mem}")
        for p in r.refused:
            lines.append(f"{'':<36}planner would refuse: {p}")
    if any(not r.row.confirmed for r in results):
        lines.append("(* figures recalled from the paper, not re-read in this session)")
    lines.append("(tokens/s per GPU)")
    return "\n".join(lines)


def format_summary(s: dict[str, dict[str, float]], baseline_mfu: float) -> str:
    lines = [f"{'source':<14} {'rows':>4} {'median|err|':>11} {'p90|err|':>9} {'signed med':>10} "
             f"{'no-fit':>6} {'tight':>5}   {f'{100 * baseline_mfu:.0f}%-MFU guess: median / p90':>30}"]
    for name, v in s.items():
        lines.append(f"{name:<14} {v['n']:>4} {100 * v['median_abs_error']:>10.1f}% {100 * v['p90_abs_error']:>8.1f}% "
                     f"{100 * v['signed_median_error']:>+9.1f}% {v['predicted_not_fit']:>6} "
                     f"{v['predicted_tight']:>5}   "
                     f"{100 * v['baseline_median_abs_error']:>15.1f}% / {100 * v['baseline_p90_abs_error']:.1f}%")
    lines.append("")
    lines.append("memory (peak per GPU, where published):")
    for name, v in s.items():
        if "memory_rows" in v:
            lines.append(f"{name:<14} {v['memory_rows']:>4} rows: median |err| "
                         f"{100 * v['memory_median_abs_error']:.1f}%, p90 {100 * v['memory_p90_abs_error']:.1f}%, "
                         f"signed median {100 * v['memory_signed_median_error']:+.1f}%, "
                         f"worst {100 * v['memory_worst_abs_error']:.0f}%, within 10 %: {v['memory_within_10pct']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=DEFAULT_FILE)
    ap.add_argument("--source", help="only rows of this source")
    ap.add_argument("--baseline-mfu", type=float, default=0.40)
    ap.add_argument("--split", choices=SPLITS, help="only the rows of this split (heldout: the quoted figures)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = load_rows(args.file)
    if args.source:
        rows = [r for r in rows if r.source == args.source]
    if args.split:
        rows = [r for r in rows if r.split == args.split]
    results = evaluate(rows, args.baseline_mfu)
    s = summary(results)
    if args.json:
        print(json.dumps({"rows": [{"id": r.row.id, "source": r.row.source, "split": r.row.split,
                                    "published": r.row.published_tps,
                                    "plan_args": " ".join(r.row.args),
                                    "predicted": r.pred.rate.tokens_per_s_per_gpu, "error": r.error,
                                    "fits": r.pred.fits, "memory_error": r.memory_error,
                                    "refused": list(r.refused)} for r in results],
                          "summary": s}, indent=2))
    else:
        print(format_table(results))
        print()
        print(format_summary(s, args.baseline_mfu))
        if any(r.row.split == "heldout" for r in results):
            print()
            print(heldout_accuracy(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())


