"""Start-up time of sharded initialisation: seconds to draw one rank's share of a Llama-3-8B layer stack.

    python benchmarks/sharded_init_speed.py [--layers 1] [--ranks 0,7] [--repeat 3] [--src DIR]

The layer's parameters have Llama-3-8B's exact shapes (h 4096, ffn 14336, 32 / 8 heads of 128). For each
layout, each listed rank's share is filled through `models.param_init.fill_slice`, as `LocalInit` fills it,
into bf16 storage (the drawn values are fp32; the copy casts):

- zero1 dp8: every rank holds whole parameters (ZeRO-1 shards the optimizer state only);
- zero3 dp8: rank r holds [r·N/8, (r+1)·N/8) of the layer's parameters flattened in order (one range per
  parameter it touches), as ZeRO-3's pieces cut them;
- tp8: the TP plan's shards (models/llama_tp_plan.py): q/k/v, gate and up split along dim 0 (rows), o and
  down along dim 1 (columns); norms replicated.

The shares are cut here from those rules, not by `parallelize` (that would need 8 ranks). `--src DIR` runs
another source tree (e.g. the previous init, `git archive <commit> src | tar -x -C DIR`): its `fill_slice`
takes the same arguments. Prints one JSON line per layout and rank: the fastest of `--repeat` fills, the
values held, and the values drawn per value held (tile edges, or the old scheme's rows).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

H, FFN, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
WORLD = 8


def layer_shapes() -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, shape, tp split dim) of one Llama-3-8B decoder layer, in its parameter order."""
    return [("attn_norm", (H,), None), ("q_proj", (HEADS * HEAD_DIM, H), 0), ("k_proj", (KV_HEADS * HEAD_DIM, H), 0),
            ("v_proj", (KV_HEADS * HEAD_DIM, H), 0), ("o_proj", (H, HEADS * HEAD_DIM), 1), ("mlp_norm", (H,), None),
            ("gate_proj", (FFN, H), 0), ("up_proj", (FFN, H), 0), ("down_proj", (H, FFN), 1)]


def shares(layout: str, rank: int, layers: int) -> list[tuple[str, tuple[int, ...], tuple, int, int]]:
    """(name, full shape, box, lo, hi) of every piece `rank` holds under `layout`."""
    params = [(f"layers.{i}.{n}", s, d) for i in range(layers) for n, s, d in layer_shapes()]
    whole = [(n, s, tuple((0, x) for x in s), 0, math.prod(s)) for n, s, _ in params]
    if layout == "zero1 dp8":
        return whole
    if layout == "tp8":
        out = []
        for n, s, d in params:
            box = [(0, x) for x in s]
            if d is not None:
                box[d] = (rank * s[d] // WORLD, s[d] // WORLD)
            out.append((n, s, tuple(box), 0, math.prod(b for _, b in box)))
        return out
    total = sum(math.prod(s) for _, s, _ in params)  # zero3 dp8: the rank's range of the flat concatenation
    lo, hi = rank * total // WORLD, (rank + 1) * total // WORLD
    out, start = [], 0
    for n, s, box, _, numel in whole:
        a, z = max(lo, start), min(hi, start + numel)
        if a < z:
            out.append((n, s, box, a - start, z - start))
        start += numel
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--ranks", default="0,7")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--src", help="another source tree's src/ (its pentatron package is timed)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.src or Path(__file__).resolve().parents[1] / "src").resolve()))
    from pentatron.models.param_init import ParamInit, fill_slice, param_seed

    torch.set_num_threads(1)
    drawn = [0]
    draw = torch.randn

    def counting_randn(*a: object, **k: object) -> torch.Tensor:  # values drawn, whichever scheme draws them
        t = draw(*a, **k)
        drawn[0] += t.numel()
        return t

    torch.randn = counting_randn  # this process only
    for layout in ("zero1 dp8", "zero3 dp8", "tp8"):
        for rank in (int(r) for r in args.ranks.split(",")):
            pieces = shares(layout, rank, args.layers)
            held = sum(hi - lo for *_, lo, hi in pieces)
            buf = torch.empty(held, dtype=torch.bfloat16)
            best = math.inf
            for _ in range(args.repeat):
                drawn[0], off, t0 = 0, 0, time.perf_counter()
                for name, shape, box, lo, hi in pieces:
                    init = ParamInit(ones=len(shape) == 1, std=0.02, seed=param_seed(0, name))
                    fill_slice(buf[off: off + hi - lo], init, shape, box, lo, hi)
                    off += hi - lo
                best = min(best, time.perf_counter() - t0)
            print(json.dumps({"layout": layout, "rank": rank, "seconds": round(best, 3), "held": held,
                              "drawn_per_held": round(drawn[0] / held, 3), "src": args.src or "this tree"}),
                  flush=True)


if __name__ == "__main__":
    main()
