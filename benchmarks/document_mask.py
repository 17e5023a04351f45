"""Document masking on CPU: a forward + backward of decoder blocks at seq 4096 with documents of mean length
seq/8, masked vs unmasked causal, in one process and under cp2 ring, side by side in one run.

    python benchmarks/document_mask.py [--seq-len 4096] [--mean-doc 512] [--layers 2] [--hidden 256]

The blocks, sizes and timing are `context_parallel.py`'s (fp32, micro-batch 1, 1 thread per rank, the
slowest rank's step). Document lengths are exponential with the given mean (seed 0). Masked: RoPE positions
restart per document and attention stays inside each (models/documents.py in one process; the ring computes
only the (document) rectangles each block shares, ring_attention.py). Before timing, the cp2 masked output
and input gradient are checked against the one-process masked blocks. `pairs`: query·key pairs per rank
(the ring's count; in one process Σ n(n+1)/2 per head).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import torch
from context_parallel import _blocks, _model_cfg, _setup
from ranks import best_of, run_on_ranks


def _documents(seq: int, mean: int) -> Any:
    from pentatron.models.documents import Documents

    rng = np.random.default_rng(0)
    starts, p = [0], 0
    while True:
        p += max(1, int(rng.exponential(mean)))
        if p >= seq:
            return Documents((tuple(starts),), seq)
        starts.append(p)


def _forward(blocks: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: Any) -> torch.Tensor:
    for b in blocks:
        x = b(x, cos, sin) if docs is None else b(x, cos, sin, docs)
    return x


def _step(rank: int, world: int, masked: bool, args: argparse.Namespace) -> dict[str, Any]:
    ctx, blocks, rotary, full, held = _setup(world, "ring", 1, args, args.seq_len, args.layers)
    docs = _documents(args.seq_len, args.mean_doc) if masked else None
    positions = docs.positions()[:, held] if masked else held
    cos, sin = rotary(positions)
    x = full[:, held].clone().requires_grad_()
    grad_out = torch.randn(full.shape, generator=torch.Generator().manual_seed(2))[:, held]
    y = _forward(blocks, x, cos, sin, docs)
    y.backward(grad_out)
    check = {}
    if world > 1:  # the same masked (or unmasked) blocks on the whole sequence in this process
        ref_blocks = _blocks(args, args.seq_len, args.layers)[0]
        xr = full.clone().requires_grad_()
        cr, sr = rotary(docs.positions() if masked else torch.arange(args.seq_len))
        yr = _forward(ref_blocks, xr, cr, sr, docs)
        yr.backward(torch.randn(full.shape, generator=torch.Generator().manual_seed(2)))
        check = {"max_err": max((y - yr[:, held]).abs().max().item(), (x.grad - xr.grad[:, held]).abs().max().item())}
    heads = args.hidden // 64
    pairs = (blocks[0].attn.core.count.pairs if world > 1
             else heads * (docs.pairs() if masked else args.seq_len * (args.seq_len + 1) // 2))
    for _ in range(args.warmup):
        _forward(blocks, x, cos, sin, docs).backward(grad_out)
    ctx.comm.barrier("world")
    t0 = time.perf_counter()
    for _ in range(args.steps):
        _forward(blocks, x, cos, sin, docs).backward(grad_out)
    return {"step_s": (time.perf_counter() - t0) / args.steps, "pairs": pairs, **check}


IMPLS = {"cp1 unmasked": (1, False), "cp1 masked": (1, True), "ring-cp2 unmasked": (2, False),
         "ring-cp2 masked": (2, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--mean-doc", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}, {os.cpu_count()} CPUs")
    docs = _documents(args.seq_len, args.mean_doc)
    print(f"{len(docs.starts[0])} documents, pairs masked/dense causal "
          f"{docs.pairs() / (args.seq_len * (args.seq_len + 1) // 2):.3f}")

    def run(label: str) -> dict[str, Any]:
        world, masked = IMPLS[label]
        res = run_on_ranks(_step, world, (masked, args), label)
        slowest = max(res, key=lambda r: r["step_s"])
        return {**slowest, "tokens_per_s": args.seq_len / slowest["step_s"], "pairs": [r["pairs"] for r in res],
                "max_err": max(r.get("max_err", 0.0) for r in res)}

    best = best_of(tuple(IMPLS), args.repeats, run)
    print("\n| run | ranks | step (s) | vs unmasked | max abs err vs 1 process | pairs per rank, layer |")
    print("|---|---:|---:|---:|---:|---|")
    for label, (world, masked) in IMPLS.items():
        r, base = best[label], best[label.replace("masked", "unmasked") if masked else label]
        print(f"| {label} | {world} | {r['step_s']:.3f} | {base['step_s'] / r['step_s']:.2f}× | "
              f"{r['max_err']:.1e} | {r['pairs']} |")
    _planner_line(args, docs, best["cp1 unmasked"]["step_s"] / best["cp1 masked"]["step_s"])


def _planner_line(args: argparse.Namespace, docs: Any, measured: float) -> None:
    """The planner's attention term for these documents (plan/flops.py, from the run's measured E[L], E[L²] as a
    run records them, and from the mean alone) against the counted pairs, and the speed-up its FLOPs predict for
    the blocks (no LM head here) against the measured one-process speed-up."""
    from pentatron.models.documents import documents_record
    from pentatron.plan.flops import DocumentLengths, flop_breakdown

    cfg, rec = _model_cfg(args, args.seq_len), documents_record([docs])
    dense = flop_breakdown(cfg, args.seq_len, causal=True)
    for name, lengths in (("measured E[L], E[L²]", DocumentLengths(rec["mean_tokens"], rec["mean_sq_tokens"])),
                          ("--mean-doc-tokens alone", DocumentLengths(args.mean_doc))):
        masked = flop_breakdown(cfg, args.seq_len, causal=True, documents=lengths)
        blocks = (masked.training - 3 * masked.lm_head, dense.training - 3 * dense.lm_head)
        print(f"planner ({name}): attention pairs {lengths.pair_share(args.seq_len):.3f} of dense causal "
              f"(counted {rec['attention_pairs']:.3f}); block FLOPs predict {blocks[1] / blocks[0]:.2f}× "
              f"(cp1 measured {measured:.2f}×)")


if __name__ == "__main__":
    main()
