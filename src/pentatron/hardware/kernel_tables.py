"""Measured attention rates by shape (from `pentatron bench` on a CPU, see `cpu_kernels.py`) and how the
planner reads them between the measured points: causal attention FLOP/s on a (sequence length, head
dim) grid, interpolated linearly in log(rate) over log(size) (the rate changes by factors with each
doubling, not by steps) and clamped to the grid's edges outside it; `log_grid_value` is that reading for
a grid of any number of axes (fp8_rowwise.py reads its (M, K, N) table with it). No torch here: `pentatron
plan` reads it without importing torch."""

from __future__ import annotations

import bisect
import itertools
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


def log_grid_value(values: tuple[float, ...], axes: tuple[tuple[tuple[float, ...], float], ...]) -> float:
    """A measured grid read between its points: `values` stored row-major over `axes`, each given as
    (its grid points, where to read it); multilinear in log(value) over log(coordinate), clamped."""
    spans = [log_axis(dims, x) for dims, x in axes]
    acc = 0.0
    for corner in itertools.product(*(((i0, 1 - f), (i1, f)) for i0, i1, f in spans)):
        weight = math.prod(wt for _, wt in corner)
        if weight:
            index = 0
            for (i, _), (dims, _) in zip(corner, axes, strict=True):
                index = index * len(dims) + i
            acc += weight * math.log(values[index])
    return math.exp(acc)


def attention_rate(grid: AttentionGrid, seq: float, head_dim: float) -> tuple[float, float]:
    """(forward, backward) FLOP/s of causal attention at this sequence length and head dim."""
    axes = ((grid.seq, seq), (grid.head_dim, head_dim))
    return log_grid_value(grid.fwd, axes), log_grid_value(grid.bwd, axes)


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
