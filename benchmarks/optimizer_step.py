"""Optimizer step of a ≈100M-parameter Llama's fp32 masters on CPU: the global norm, clipping and AdamW, as
`optim.py` does them now (fused AdamW, `torch._foreach_norm` over views, `_foreach_mul_`) against the path
before (foreach AdamW, a squared copy of every gradient for the norm, one `mul_` per gradient).

    python benchmarks/optimizer_step.py --repeats 5

Interleaved (old, new, old, new, ...), best of `--repeats`; also the last-bit difference fused vs foreach
after `--drift-steps` steps from the same state (relative L2 of the masters). Say the load (`uptime`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from pentatron.config import TrainConfig
from pentatron.optim import AdamW, Slot, clip_by_total_norm, grad_norm_squared


def llama_shapes(vocab: int, hidden: int, layers: int, ffn: int) -> list[tuple[int, ...]]:
    """Parameter shapes of an untied Llama (MHA): embedding, per layer q/k/v/o + gate/up/down + 2 norms, head."""
    per_layer = [(hidden, hidden)] * 4 + [(ffn, hidden), (ffn, hidden), (hidden, ffn), (hidden,), (hidden,)]
    return [(vocab, hidden), *per_layer * layers, (hidden,), (vocab, hidden)]


def make_slots(shapes: list[tuple[int, ...]], seed: int) -> list[Slot]:
    g = torch.Generator().manual_seed(seed)
    return [Slot(str(i), torch.randn(s, generator=g) * 0.02, torch.randn(s, generator=g) * 1e-3, None, len(s) >= 2)
            for i, s in enumerate(shapes)]


def old_norm_squared(grads: list[torch.Tensor]) -> torch.Tensor:
    """The norm before: a squared fp32 copy of every gradient, summed."""
    return torch.stack([g.float().pow(2).sum() for g in grads]).sum()


def old_clip(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))


def step_fn(slots: list[Slot], impl: str) -> tuple[AdamW, object]:
    opt = AdamW(slots, TrainConfig(lr=1e-4, weight_decay=0.1), impl=impl)
    grads = [s.grad for s in slots]

    def run() -> dict[str, float]:
        t0 = time.perf_counter()
        sq = old_norm_squared(grads) if impl == "foreach" else grad_norm_squared(grads)
        norm = sq.sqrt()
        t1 = time.perf_counter()
        # max_norm far above the norm: the scale is 1, so repeated steps do not shrink the gradients
        (old_clip if impl == "foreach" else clip_by_total_norm)(grads, norm, 1e9)
        t2 = time.perf_counter()
        opt.step(1e-4)
        t3 = time.perf_counter()
        return {"norm": t1 - t0, "clip": t2 - t1, "adamw": t3 - t2, "total": t3 - t0}

    return opt, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--drift-steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shapes = llama_shapes(args.vocab, args.hidden, args.layers, args.ffn)
    n = sum(torch.Size(s).numel() for s in shapes)
    runs = {impl: step_fn(make_slots(shapes, 0), impl) for impl in ("foreach", "fused")}
    best: dict[str, dict[str, float]] = {}
    for impl in runs:  # warm-up: allocates the moments
        runs[impl][1]()
    for _ in range(args.repeats):
        for impl, (_, run) in runs.items():
            t = run()
            best[impl] = {k: min(v, best.get(impl, {}).get(k, v)) for k, v in t.items()}
    # Same start, same gradients, `drift-steps` steps each: how far the fused kernel's rounding moves the masters.
    drift = {}
    for impl in ("foreach", "fused"):
        slots = make_slots(shapes, 1)
        opt = AdamW(slots, TrainConfig(lr=1e-3, weight_decay=0.1), impl=impl)
        for _ in range(args.drift_steps):
            opt.step(1e-3)
        drift[impl] = torch.cat([s.master.reshape(-1) for s in slots])
    rel = float((drift["fused"].double() - drift["foreach"].double()).norm() / drift["foreach"].double().norm())
    print(f"\nOptimizer step, {n / 1e6:.1f}M fp32 parameters ({len(shapes)} tensors: Llama h={args.hidden}, "
          f"{args.layers} layers, ffn {args.ffn}, vocab {args.vocab}, untied), {torch.get_num_threads()} threads, "
          f"best of {args.repeats}, interleaved; load {os.getloadavg()[0]:.2f}\n")
    print("| path | norm (ms) | clip (ms) | AdamW (ms) | step total (ms) |")
    print("|---|---:|---:|---:|---:|")
    labels = {"foreach": "before: foreach AdamW, copy-per-gradient norm", "fused": "now: fused AdamW, _foreach_norm"}
    for impl, t in best.items():
        print(f"| {labels[impl]} | {1e3 * t['norm']:.1f} | {1e3 * t['clip']:.1f} | {1e3 * t['adamw']:.1f} | "
              f"{1e3 * t['total']:.1f} |")
    ratio = {k: best["foreach"][k] / best["fused"][k] for k in ("total", "adamw", "norm")}
    print(f"\nratio before / now: total {ratio['total']:.2f}×, AdamW {ratio['adamw']:.2f}×, norm {ratio['norm']:.2f}×")
    print(f"fused vs foreach masters after {args.drift_steps} steps: relative L2 difference {rel:.2e}")
    print(json.dumps({"command": " ".join(sys.argv)}))


if __name__ == "__main__":
    main()
