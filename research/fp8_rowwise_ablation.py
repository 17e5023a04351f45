"""Does FP8 rowwise depart further from bf16 than tensorwise, and why (issue 50)? The debug model trained with
torchao configs that change one thing at a time, each curve's per-step |loss − bf16| against the same seed's bf16
split yardstick (benchmarks/fp8_loss.py, whose --json curves this reads: bf16, bf16 split and the two recipes).

A linear layer has three GEMMs and six casts (parallel/fp8.py): output = X·Wᵀ (input, weight), grad_input =
dY·W (grad_output, weight_for_grad_input), grad_weight = dYᵀ·X (grad_output_for_grad_weight,
input_for_grad_weight). The variants:

- "<recipe> <gemm> only": that GEMM's two casts as the recipe has them, the other two GEMMs in bf16 (torchao's
  ScalingType.DISABLED): which GEMM carries a recipe's loss gap, rowwise against tensorwise GEMM by GEMM.
- "rowwise_with_gw_hp": torchao's recipe (torchtitan's "rowwise_with_gw_hp"): grad_weight in bf16, grad_input's
  weight tensorwise.
- knobs on a whole recipe: rowwise without power-of-two scales, rowwise with dY in e5m2 (tensorwise's dtype),
  tensorwise with power-of-two scales, rowwise with grad_weight's operands scaled tensorwise (rowwise scales
  them along the token axis: one scale per feature column).

    python benchmarks/fp8_loss.py --models debug --seed 1 --json /tmp/seed1.json
    python research/fp8_rowwise_ablation.py --baseline /tmp/seed1.json --seed 1 [--variants NAME ...]

A variant runs `pentatron train` (train.fp8 = "rowwise" only to pass the config's check) through this file's
--child mode, which swaps parallel/fp8.py's recipe_config for the variant's torchao config: the trainer, the
data and the casts' code are the product's. "rowwise" and "tensorwise" rebuilt here must reproduce the
benchmark's curves exactly (the harness's own check: --variants rowwise tensorwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import fp8_loss  # noqa: E402

ROLES = ("input", "weight", "grad_output", "weight_for_grad_input", "grad_output_for_grad_weight",
         "input_for_grad_weight")
GEMMS = {"output": ("input", "weight"), "grad_input": ("grad_output", "weight_for_grad_input"),
         "grad_weight": ("grad_output_for_grad_weight", "input_for_grad_weight")}


def _config(casts: dict, pow2: bool):  # -> Float8LinearConfig (torchao imported in the function: a slow import)
    """A Float8LinearConfig with these six casts. Set after construction: torchao's check that an operand has
    one dtype in both its GEMMs is a rule of its Float8Linear (one cast per operand), not of parallel/fp8.py,
    which casts each role on its own; its other rule (a GEMM's two operands both fp8 or both high precision,
    which _mm relies on) is checked here."""
    from torchao.float8.config import Float8LinearConfig, ScalingType

    cfg = Float8LinearConfig(round_scales_to_power_of_2=pow2)
    for role in ROLES:
        object.__setattr__(cfg, f"cast_config_{role}", casts[role])
    for gemm, (a, b) in GEMMS.items():
        if (casts[a].scaling_type is ScalingType.DISABLED) != (casts[b].scaling_type is ScalingType.DISABLED):
            raise ValueError(f"{gemm}: one operand in fp8, the other not")
    return cfg


def _casts(recipe: str) -> dict:
    """The six casts of torchao's tensorwise or rowwise recipe, dtypes explicit."""
    from torchao.float8.config import CastConfig, ScalingGranularity, e4m3_dtype, e5m2_dtype

    if recipe == "rowwise":  # every cast per row (axiswise), e4m3
        return {r: CastConfig(scaling_granularity=ScalingGranularity.AXISWISE, target_dtype=e4m3_dtype)
                for r in ROLES}
    return {r: CastConfig(target_dtype=e5m2_dtype if r.startswith("grad_output") else e4m3_dtype) for r in ROLES}


def _hp():
    from torchao.float8.config import CastConfig, ScalingType, e4m3_dtype

    return CastConfig(scaling_type=ScalingType.DISABLED, target_dtype=e4m3_dtype)


def _only(recipe: str, gemm: str):
    casts = {r: c if r in GEMMS[gemm] else _hp() for r, c in _casts(recipe).items()}
    return _config(casts, pow2=recipe == "rowwise")


def _swap(recipe: str, change: Callable[[dict], dict], pow2: bool):
    return _config(change(_casts(recipe)), pow2)


def _e5m2_dy(casts: dict) -> dict:
    from torchao.float8.config import CastConfig, e5m2_dtype

    return {r: CastConfig(scaling_granularity=c.scaling_granularity, target_dtype=e5m2_dtype)
            if r.startswith("grad_output") else c for r, c in casts.items()}


def _gw_tensorwise_e4m3() -> dict:
    """grad_weight's two operands scaled per tensor in e4m3 (rowwise's dtype): only the granularity changes."""
    from torchao.float8.config import CastConfig, e4m3_dtype

    return {r: CastConfig(target_dtype=e4m3_dtype) for r in GEMMS["grad_weight"]}


def _torchao(name: str):
    from torchao.float8.config import Float8LinearConfig

    return Float8LinearConfig.from_recipe_name(name)


VARIANTS: dict[str, Callable] = {
    "rowwise": lambda: _swap("rowwise", dict, pow2=True),
    "tensorwise": lambda: _swap("tensorwise", dict, pow2=False),
    **{f"{rec} {g} only": (lambda rec=rec, g=g: _only(rec, g))
       for g in GEMMS for rec in ("rowwise", "tensorwise")},
    "rowwise_with_gw_hp": lambda: _torchao("rowwise_with_gw_hp"),
    "rowwise no pow2": lambda: _swap("rowwise", dict, pow2=False),
    "rowwise dy e5m2": lambda: _swap("rowwise", _e5m2_dy, pow2=True),
    "rowwise gw tensorwise": lambda: _swap("rowwise", lambda c: c | _gw_tensorwise_e4m3(), pow2=True),
    "tensorwise pow2": lambda: _swap("tensorwise", dict, pow2=True),
}
DEFAULT = [v for v in VARIANTS if v not in ("rowwise", "tensorwise")]


def grad_error(variants: list[str], seed: int, pre_steps: int, batches: int = 4) -> list[str]:
    """Each variant's quantisation error without a trajectory: the debug model in float64 (train.precision
    fp64's FP8 path: fp8 operands, GEMM in fp64), its loss and gradient on Markov-corpus batches against the
    same model without FP8, after `pre_steps` fp64 AdamW steps. Returns table rows, means over the batches:
    the loss's error |Δ| and signed Δ (relative: a bias shows as signed ≈ |Δ|), the gradient's relative error
    ‖g − g_ref‖ / ‖g_ref‖ and its component along g_ref (g·g_ref / ‖g_ref‖² − 1: a shrink or growth of the
    step)."""
    import copy

    import torch

    from pentatron.lab.common import MarkovCorpus, debug_model, grad_vector, lm_loss
    from pentatron.parallel.fp8 import apply_fp8

    model = debug_model(seed=seed, dtype=torch.float64)
    data = MarkovCorpus(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(pre_steps):
        opt.zero_grad()
        lm_loss(model, *data.batch(8, 64)).backward()
        opt.step()
    held = [data.batch(8, 64) for _ in range(batches)]

    def grads(m: torch.nn.Module) -> list[tuple[float, torch.Tensor]]:
        out = []
        for batch in held:
            m.zero_grad()
            loss = lm_loss(m, *batch)
            loss.backward()
            out.append((loss.item(), grad_vector(m)))
        return out

    ref = grads(model)
    rows = [f"float64, debug model after {pre_steps} AdamW steps (seed {seed}), {batches} batches of 8×64",
            "| variant | loss rel err | loss signed | grad rel err | grad along ref − 1 |", "|---|---:|---:|---:|---:|"]
    for v in variants:
        m = copy.deepcopy(model)
        apply_fp8(m, VARIANTS[v]())
        got = grads(m)
        n = len(held)
        loss_err = sum(abs(a - r) / r for (a, _), (r, _) in zip(got, ref)) / n
        loss_signed = sum((a - r) / r for (a, _), (r, _) in zip(got, ref)) / n
        rel = sum(float((g - r).norm() / r.norm()) for (_, g), (_, r) in zip(got, ref)) / n
        along = sum(float(g @ r / (r @ r)) - 1 for (_, g), (_, r) in zip(got, ref)) / n
        rows.append(f"| {v} | {loss_err:.2e} | {loss_signed:+.2e} | {rel:.4f} | {along:+.4f} |")
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def summary(paths: list[Path]) -> list[str]:
    """Per benchmark --json (one seed each): the split yardstick and each recipe's max / mean gap, and over the
    seeds how often rowwise's gap exceeds tensorwise's (a paired comparison needs no yardstick)."""
    rows = ["| curves | split max / mean | bound max / mean | tensorwise max / mean | rowwise max / mean "
            "| verdicts tw / rw |", "|---|---:|---:|---:|---:|---|"]
    worse, tw_sum, rw_sum = [0, 0], [0.0, 0.0], [0.0, 0.0]
    for path in paths:
        c = json.loads(path.read_text())["debug"]
        split = fp8_loss.gaps(c["bf16 split"], c["bf16"])
        bound = tuple(fp8_loss.FACTOR * x for x in split)
        tw, rw = (fp8_loss.gaps(c[f"fp8 {r}"], c["bf16"]) for r in ("tensorwise", "rowwise"))
        verdict = ["within" if g[0] <= bound[0] and g[1] <= bound[1] else "outside" for g in (tw, rw)]
        worse = [w + (rw[i] > tw[i]) for i, w in enumerate(worse)]
        tw_sum, rw_sum = [a + b for a, b in zip(tw_sum, tw)], [a + b for a, b in zip(rw_sum, rw)]
        rows.append(f"| {path.stem} | {split[0]:.4f} / {split[1]:.4f} | {bound[0]:.4f} / {bound[1]:.4f} "
                    f"| {tw[0]:.4f} / {tw[1]:.4f} | {rw[0]:.4f} / {rw[1]:.4f} | {' / '.join(verdict)} |")
    n = len(paths)
    rows.append(f"rowwise's gap above tensorwise's in {worse[0]} of {n} (max) and {worse[1]} of {n} (mean); "
                f"over the seeds, max gap tensorwise {tw_sum[0] / n:.4f}, rowwise {rw_sum[0] / n:.4f}; mean gap "
                f"tensorwise {tw_sum[1] / n:.4f}, rowwise {rw_sum[1] / n:.4f}")
    return rows


def check_emulation(keep: tuple[str, ...] = ("layers.1.attn.q_proj", "layers.1.mlp.down_proj")) -> list[str]:
    """torchao's emulated FP8 GEMM against torch._scaled_mm, the debug model in bf16 with FP8 in `keep` only
    (the reference fp8 kernel is slow): logits and the whole gradient, emulated vs _scaled_mm, set against
    what FP8 itself moves them (vs the same model without FP8)."""
    import copy

    import torch

    from pentatron.lab.common import MarkovCorpus, debug_model, grad_vector, lm_loss
    from pentatron.parallel.fp8 import apply_fp8, fp8_targets

    base = debug_model(seed=0, dtype=torch.bfloat16)
    batch = MarkovCorpus(seed=0).batch(8, 64)

    def run(config) -> tuple[torch.Tensor, torch.Tensor]:
        m = copy.deepcopy(base)
        if config is not None:
            apply_fp8(m, config, skip=[n for n in fp8_targets(m) if n not in keep])
        logits = m(batch[0]).double()
        lm_loss(m, *batch).backward()
        return logits, grad_vector(m)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    hp = run(None)
    rows = [f"FP8 in {', '.join(keep)} of the bf16 debug model, one 8×64 batch: relative distance (norm)",
            "| recipe | logits: emulated vs _scaled_mm | logits: FP8 vs none | grad: emulated vs _scaled_mm "
            "| grad: FP8 vs none |", "|---|---:|---:|---:|---:|"]
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        config = _torchao(recipe)
        real, emu = run(config), run(dataclasses.replace(config, emulate=True))
        rows.append(f"| {recipe} | {rel(emu[0], real[0]):.1e} | {rel(real[0], hp[0]):.1e} "
                    f"| {rel(emu[1], real[1]):.1e} | {rel(real[1], hp[1]):.1e} |")
    return rows


def child(variant: str, emulate: bool, argv: list[str]) -> int:
    """`pentatron train` with parallel/fp8.py's recipe swapped for the variant's config."""
    import pentatron.parallel.fp8 as fp8
    from pentatron.cli import main as cli

    config = VARIANTS[variant]()
    # not dataclasses.replace: it re-runs torchao's one-dtype-per-operand check, which _config bypasses
    object.__setattr__(config, "emulate", emulate)
    fp8.recipe_config = lambda recipe: config
    return cli(argv)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--baseline", type=Path, help="benchmarks/fp8_loss.py --json of the same seed (debug model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT)
    p.add_argument("--steps", type=int, default=fp8_loss.MODELS["debug"][5])
    p.add_argument("--json", type=Path, help="write the variants' curves here (rewritten after each run)")
    p.add_argument("--grad-error", type=int, metavar="STEPS", help="instead: each variant's one-step gradient "
                   "error in float64 after STEPS fp64 steps (no training curves, no --baseline)")
    p.add_argument("--emulate", action="store_true", help="emulated FP8 GEMMs (benchmarks/fp8_loss.py --emulate)")
    p.add_argument("--summary", type=Path, nargs="+", metavar="JSON", help="instead: tabulate benchmark "
                   "--json files (one seed each)")
    p.add_argument("--batches", type=int, default=4, help="--grad-error: batches averaged over")
    p.add_argument("--check-emulation", action="store_true", help="instead: torchao's emulated FP8 GEMM "
                   "against torch._scaled_mm (one layer in FP8, the reference kernel is slow)")
    p.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    if args.child:
        sys.exit(child(args.child, args.emulate, rest))
    if args.summary:
        print("\n".join(summary(args.summary)))
        return
    if args.check_emulation:
        print("\n".join(check_emulation()))
        return
    if args.grad_error is not None:
        print("\n".join(grad_error(args.variants, args.seed, args.grad_error, args.batches)))
        return
    if args.baseline is None:
        p.error("--baseline is required")
    base = json.loads(args.baseline.read_text())["debug"]
    ref = base["bf16"]
    split_max, split_mean = fp8_loss.gaps(base["bf16 split"], ref)
    bound = (fp8_loss.FACTOR * split_max, fp8_loss.FACTOR * split_mean)
    curves: dict[str, list[float]] = {}
    rows = [f"seed {args.seed}: bound max / mean = {bound[0]:.4f} / {bound[1]:.4f} (split gap × {fp8_loss.FACTOR:g})",
            "| variant | max gap | mean gap | max / bound | mean / bound | same as benchmark |",
            "|---|---:|---:|---:|---:|---|"]
    for name in ("tensorwise", "rowwise"):
        mx, mn = fp8_loss.gaps(base[f"fp8 {name}"], ref)
        rows.append(f"| {name} (benchmark) | {mx:.4f} | {mn:.4f} | {mx / bound[0]:.2f} | {mn / bound[1]:.2f} | — |")
    with tempfile.TemporaryDirectory() as tmp:
        for v in args.variants:
            launcher = (str(Path(__file__).resolve()), "--child", v, *(["--emulate"] if args.emulate else []))
            out = Path(tmp) / v.replace(" ", "_")
            curves[v], wall = fp8_loss.train("debug", "fp8 rowwise", args.steps, out, args.seed, launcher)
            print(f"{v}: {wall:.0f} s", file=sys.stderr, flush=True)
            if args.json:
                args.json.write_text(json.dumps(curves))
            mx, mn = fp8_loss.gaps(curves[v], ref)
            same = (("yes" if curves[v] == base[f"fp8 {v}"] else "NO") if v in ("rowwise", "tensorwise") else "—")
            rows.append(f"| {v} | {mx:.4f} | {mn:.4f} | {mx / bound[0]:.2f} | {mn / bound[1]:.2f} | {same} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
