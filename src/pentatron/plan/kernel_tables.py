"""Measured attention rates by shape (from `pentatron bench` on a CPU, see `bench_cpu.py`) and how the
planner reads them between the measured points: causal attention FLOP/s on a (sequence length, head
dim) grid, interpolated linearly in log(rate) over log(size) (the rate changes by factors with each
doubling, not by steps) and clamped to the grid's edges outside it. No torch here: `pentatron plan`
reads it without importing torch."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AttentionGrid:
    """Causal attention forward and backward FLOP/s (both over the forward's FLOPs) at seq[i], head_dim[j],
    stored seq-major."""

    seq: tuple[float, ...]
    head_dim: tuple[float, ...]
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]


def log_axis(dims: tuple[float, ...], x: float) -> tuple[int, int, float]:
    """(lower index, upper index, weight of the upper one) of x on the log axis `dims`, clamped."""
    if x <= dims[0]:
        return 0, 0, 0.0
    if x >= dims[-1]:
        return len(dims) - 1, len(dims) - 1, 0.0
    i = bisect.bisect_right(dims, x) - 1
    return i, i + 1, (math.log(x) - math.log(dims[i])) / (math.log(dims[i + 1]) - math.log(dims[i]))


def attention_rate(grid: AttentionGrid, seq: float, head_dim: float) -> tuple[float, float]:
    """(forward, backward) FLOP/s of causal attention at this sequence length and head dim."""
    (i0, i1, fi), (j0, j1, fj) = log_axis(grid.seq, seq), log_axis(grid.head_dim, head_dim)
    cols = len(grid.head_dim)
    out = []
    for table in (grid.fwd, grid.bwd):
        acc = 0.0
        for i, wi in ((i0, 1 - fi), (i1, fi)):
            for j, wj in ((j0, 1 - fj), (j1, fj)):
                if wi * wj:
                    acc += wi * wj * math.log(table[i * cols + j])
        out.append(math.exp(acc))
    return out[0], out[1]


GFLOP = 1e9


def _positive_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, int | float) and not isinstance(x, bool) and x >= 0
                                                   for x in v)


def parse_attention_grid(d: Any, where: str, problems: list[str]) -> AttentionGrid | None:
    """`{seq = [...], head_dim = [...], fwd_gflop_s = [...], bwd_gflop_s = [...]}` (seq-major)."""
    keys = ("seq", "head_dim", "fwd_gflop_s", "bwd_gflop_s")
    if not isinstance(d, dict) or not all(_positive_list(d.get(k)) for k in keys):
        problems.append(f"{where}: attention_fp32 needs lists {', '.join(keys)}")
        return None
    seq, hd = tuple(float(x) for x in d["seq"]), tuple(float(x) for x in d["head_dim"])
    n = len(seq) * len(hd)
    if len(d["fwd_gflop_s"]) != n or len(d["bwd_gflop_s"]) != n or min(d["fwd_gflop_s"] + d["bwd_gflop_s"]) <= 0:
        problems.append(f"{where}: attention_fp32 needs {n} positive rates (seq x head_dim) forward and backward")
        return None
    if list(seq) != sorted(set(seq)) or list(hd) != sorted(set(hd)) or seq[0] <= 0 or hd[0] <= 0:
        problems.append(f"{where}: attention_fp32 seq and head_dim must be increasing positive sizes")
        return None
    return AttentionGrid(seq, hd, tuple(float(x) * GFLOP for x in d["fwd_gflop_s"]),
                         tuple(float(x) * GFLOP for x in d["bwd_gflop_s"]))
