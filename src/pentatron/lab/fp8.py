"""FP8 traps, measured with the trainer's own FP8 path (parallel/fp8.py: torchao's amax, scale and cast,
torch._scaled_mm): (g) one activation outlier under tensorwise scaling, (h) FP8 in the first/last layers."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch

from pentatron.lab.common import MarkovCorpus, Verdict, debug_model, lm_loss, save_plot

# parallel/fp8.py (torchao) is imported inside the experiments: `pentatron lab`'s parser lists them, and
# every other `pentatron` command should not pay for torchao's import.

OUTLIER_RATIOS = (0.0, 1e2, 1e3, 1e4, 1e5, 3e5, 1e6)  # outlier ÷ the median |activation|; 0: none
HEADLINE_RATIO = 1e6
# where FP8 is used, as the edges experiment's bars show it (the keys of its KL table)
KL_BARS = (*(f"layer {i} only" for i in range(4)), "everywhere", "first/last fp32", "middle fp32", "lm head only")
LAYER = "layers.1.mlp.up_proj"  # a linear whose input is a real hidden state (RMS-normed, O(1))


def _layer_input(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The [tokens, in] input the debug model feeds LAYER on a Markov batch (fp32)."""
    seen: dict[str, torch.Tensor] = {}
    hook = model.get_submodule(LAYER).register_forward_hook(lambda m, args, out: seen.update(x=args[0].detach()))
    with torch.no_grad():
        model(tokens)
    hook.remove()
    return seen["x"].reshape(-1, seen["x"].shape[-1]).float()


def fp8_outlier(out: Path, quick: bool) -> Verdict:
    """(g) One token's activation carries an outlier (the "massive activations" of LLMs sit on a few tokens,
    e.g. the first). A tensorwise scale is 448 / amax for the whole tensor, so every other element is scaled
    down with it, into e4m3's subnormals (< 2⁻⁶, 3 bits fewer) and then to zero. A rowwise (per-token) scale
    confines the damage to the outlier's own row. Measured on LAYER's real input and weight, per recipe and
    outlier size: the fraction of the other tokens' non-zero elements that are subnormal or zero after the
    cast, and the forward GEMM's relative error on those tokens vs the float64 GEMM."""
    from pentatron.parallel.fp8 import local_gemm

    batch = (4, 64) if quick else (8, 64)
    model = debug_model()
    x0 = _layer_input(model, MarkovCorpus(seed=0).batch(*batch)[0])
    weight = model.get_submodule(LAYER).weight.detach().float()
    median = float(x0.abs().median())
    smallest_normal = torch.finfo(torch.float8_e4m3fn).smallest_normal
    others = torch.ones_like(x0, dtype=torch.bool)
    others[0] = False  # the outlier's token
    counted = others & (x0 != 0)
    results: dict[str, dict[str, list[float]]] = {}
    for recipe in ("tensorwise", "rowwise"):
        gemm = local_gemm(recipe)
        sub, zero, err = [], [], []  # sub: subnormal or zero
        for ratio in OUTLIER_RATIOS:
            x = x0.clone()
            if ratio:
                x[0, 5] = ratio * median
            q = gemm.cast(x, "input")._data.float().abs()
            sub.append(float(((q < smallest_normal) & counted).sum() / counted.sum()))
            zero.append(float(((q == 0) & counted).sum() / counted.sum()))
            with torch.no_grad():
                y = gemm(x, weight).double()[1:]
            ref = (x.double() @ weight.double().t())[1:]
            err.append(float((y - ref).norm() / ref.norm()))
        results[recipe] = {"subnormal": sub, "zero": zero, "err": err}
    tw, rw = results["tensorwise"], results["rowwise"]
    i = OUTLIER_RATIOS.index(HEADLINE_RATIO)
    breaks = next((r for r, e in zip(OUTLIER_RATIOS, tw["err"]) if e > 2 * tw["err"][0]), None)
    reproduced = tw["err"][i] > 10 * rw["err"][i] and tw["subnormal"][i] > 0.9 and rw["subnormal"][i] < 0.01
    # the sweep on a log axis; the no-outlier case (ratio 0, not a point of that axis) as reference lines
    xs = [math.log10(r) for r in OUTLIER_RATIOS[1:]]
    plot = save_plot(out / "lab_fp8_outlier.png", "FP8 cast of an activation with one outlier (e4m3)", [
        {"title": "other tokens' elements subnormal or zero", "xlabel": "log10(outlier / median |x|)",
         "ylabel": "fraction", "series": {f"{r}: {k}": (xs, results[r][k][1:]) for r in results
                                          for k in ("subnormal", "zero")}},
        {"title": "GEMM error on the other tokens vs fp64", "xlabel": "log10(outlier / median |x|)",
         "ylabel": "‖y − ref‖ / ‖ref‖", "logy": True, "series": {r: (xs, results[r]["err"][1:]) for r in results},
         "lines": {f"{r}, no outlier": results[r]["err"][0] for r in results}}])
    sweep = ", ".join(f"{r:.0e}: {100 * s:.1f}%/{e:.3f}" for r, s, e in zip(OUTLIER_RATIOS[1:], tw["subnormal"][1:],
                                                                        tw["err"][1:]))
    text = (f"{LAYER} input ({x0.shape[0]} tokens × {x0.shape[1]}), one element of token 0 set to "
            f"{HEADLINE_RATIO:.0e} × the median |x| ({median:.3f}): tensorwise leaves {100 * tw['subnormal'][i]:.1f}% "
            f"of the other tokens' elements subnormal or zero ({100 * tw['zero'][i]:.1f}% zero) and their GEMM error"
            f" is {tw['err'][i]:.3f}; rowwise {100 * rw['subnormal'][i]:.2f}%, error {rw['err'][i]:.4f} "
            f"({tw['err'][i] / rw['err'][i]:.0f}×; no outlier: {tw['err'][0]:.4f} / {rw['err'][0]:.4f}). "
            f"Tensorwise sweep (ratio: subnormal/error) {sweep}; its error "
            + (f"first doubles at {breaks:.0e} × the median" if breaks else "never doubles"))
    return Verdict("fp8-outlier", reproduced, text,
                   {"ratios": list(OUTLIER_RATIOS), "headline": HEADLINE_RATIO, "median": median,
                    "breaks_at": breaks, **{f"{r}_{k}": v for r in results for k, v in results[r].items()}}, plot)


EDGES = ("layers.0.*", "layers.3.*")  # the debug model's first and last decoder layers
MIDDLE = ("layers.1.*", "layers.2.*")
LR = 3e-3


def _train(steps: int, seed: int = 0, fp8_skip: tuple[str, ...] | None = None) -> tuple[torch.nn.Module, list[float]]:
    """AdamW at LR (10 warmup steps) on the Markov corpus; `fp8_skip` given: tensorwise FP8 GEMMs except those."""
    from pentatron.parallel.fp8 import apply_fp8

    model = debug_model(seed=seed)
    if fp8_skip is not None:
        apply_fp8(model, "tensorwise", skip=fp8_skip)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    data = MarkovCorpus(seed=0)
    losses = []
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = LR * min(1.0, step / 10)
        loss = lm_loss(model, *data.batch(8, 64))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def fp8_edges(out: Path, quick: bool) -> Verdict:
    """(h) FP8 in the first and last decoder layers (the published recipes keep them, or at least the LM head,
    in high precision: train.fp8_skip). Two measurements. (1) Training: fp32 vs tensorwise FP8 everywhere vs
    FP8 with the first/last layers skipped, the gap set against the gap between two fp32 runs that differ
    only in their init seed. (2) Deterministic: one fp32 model trained `steps` steps, its held-out output
    distribution with FP8 GEMMs everywhere, with the first/last layers kept fp32, and — the control, the same
    number of GEMMs kept — with the two middle layers kept fp32; KL(fp32 ‖ FP8) per token. The verdict is (2):
    the edges are the trap if keeping them high precision removes at least twice as much of the FP8 error as
    keeping the middle layers does."""
    from pentatron.parallel.fp8 import Fp8Linear, apply_fp8, local_gemm

    steps, train_steps = (60, 20) if quick else (60, 60)
    held = MarkovCorpus(seed=0, stream=12345).batch(16, 64)
    base, fp32 = _train(steps)
    runs = {"fp32": fp32 if train_steps == steps else _train(train_steps)[1],
            "fp32, init seed 1": _train(train_steps, seed=1)[1],
            "fp8 everywhere": _train(train_steps, fp8_skip=())[1],
            "fp8, first/last fp32": _train(train_steps, fp8_skip=EDGES)[1]}
    tail = min(10, train_steps)
    final = {k: sum(v[-tail:]) / tail for k, v in runs.items()}
    noise = abs(final["fp32, init seed 1"] - final["fp32"])
    gap_all, gap_skip = final["fp8 everywhere"] - final["fp32"], final["fp8, first/last fp32"] - final["fp32"]
    significant = max(abs(gap_all), abs(gap_skip), abs(gap_all - gap_skip)) > noise
    kl: dict[str, float] = {}
    with torch.no_grad():
        ref = base(held[0]).double().log_softmax(-1)
        for name, skip in [("everywhere", ()), ("first/last fp32", EDGES), ("middle fp32", MIDDLE)] + \
                [(f"layer {i} only", tuple(f"layers.{j}.*" for j in range(4) if j != i)) for i in range(4)]:
            model = copy.deepcopy(base)
            apply_fp8(model, "tensorwise", skip=skip)
            q = model(held[0]).double().log_softmax(-1)
            kl[name] = float((ref.exp() * (ref - q)).sum(-1).mean())
        # the LM head in FP8 (train.fp8 never converts it; measured for comparison), decoder fp32
        model = copy.deepcopy(base)
        model.lm_head = Fp8Linear(model.lm_head.weight, local_gemm("tensorwise"))
        logits = model(held[0]).double()
        kl["lm head only"] = float((ref.exp() * (ref - logits.log_softmax(-1))).sum(-1).mean())
        exact = base(held[0]).double()
        head_logit_err = float((logits - exact).norm() / exact.norm())
    cut_edges = kl["everywhere"] / kl["first/last fp32"]
    cut_middle = kl["everywhere"] / kl["middle fp32"]
    reproduced = cut_edges > 2 * cut_middle
    xs = list(range(1, train_steps + 1))
    plot = save_plot(out / "lab_fp8_edges.png", "FP8 in the first/last decoder layers (debug model)", [
        {"title": f"training loss ({train_steps} steps)", "xlabel": "step", "ylabel": "loss",
         "series": {k: (xs, v) for k, v in runs.items()}},
        {"kind": "bar", "title": f"KL(fp32 ‖ FP8) of the {steps}-step fp32 model's outputs",
         "ylabel": "nats / token", "logy": True, "categories": [f"FP8 {k}" for k in KL_BARS],
         "series": {"KL": [kl[k] for k in KL_BARS]}}])
    per_layer = ", ".join(f"{i}: {kl[f'layer {i} only']:.1e}" for i in range(4))
    sig = ("larger than" if significant else "within") + f" the seed-to-seed gap of fp32 ({noise:.3f})"
    text = (f"training {train_steps} steps, mean of the last {tail} losses: fp32 {final['fp32']:.3f}, FP8 "
            f"everywhere {gap_all:+.3f}, FP8 with first/last fp32 {gap_skip:+.3f} — {sig}"
            + ("" if significant else ": not significant at this scale") +
            f". Output KL of the {steps}-step fp32 model with FP8 GEMMs: everywhere {kl['everywhere']:.2e}, first/"
            f"last kept fp32 {kl['first/last fp32']:.2e} ({cut_edges:.1f}× less), middle kept fp32 "
            f"{kl['middle fp32']:.2e} ({cut_middle:.1f}× less); FP8 in one layer only: {per_layer}; the LM head "
            f"alone in FP8 (never converted by train.fp8): {kl['lm head only']:.1e}, logit error "
            f"{head_logit_err:.4f} (relative)")
    return Verdict("fp8-edges", reproduced, text,
                   {"final": final, "seed_gap": noise, "gap_all": gap_all, "gap_skip": gap_skip,
                    "significant": significant, "kl": kl, "head_logit_err": head_logit_err, "cut_edges": cut_edges,
                    "cut_middle": cut_middle, "steps": steps, "train_steps": train_steps}, plot)
