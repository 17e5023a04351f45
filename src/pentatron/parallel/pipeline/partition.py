"""How a Llama's decoder layers split into pipeline stages: the cost estimate and the partition.

Kept apart from `stages.py` (the stage modules) and free of torch, so the planner
(`plan/layout.layers_per_chunk`) reproduces the engine's split without importing torch.
Layers are assigned either from an explicit per-stage list, or balanced by a cost estimate in which
the embedding and the LM head + loss count like layers do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pentatron.layout import partition_problems
from pentatron.models.config import ModelConfig


class PartitionError(ValueError):
    """A partition request that cannot be met (raised before any process group starts)."""


@dataclass(frozen=True)
class StageCosts:
    """Forward FLOPs per token of each piece of the model (backward is ~2x for all of them alike)."""

    layer: float
    embed: float
    head: float

    @classmethod
    def of(cls, cfg: ModelConfig, seq_len: int) -> StageCosts:
        h, v = cfg.hidden_size, cfg.vocab_size
        # Matmuls: 2 FLOPs per weight per token; attention scores + weighted sum: 2·2·s·h (causal
        # halves it, but FlashAttention-style kernels do roughly the full work on CPU anyway).
        layer = 2 * cfg.layer_params() + 4 * seq_len * h
        # The embedding is a lookup (memory-bound, ~no FLOPs) but its backward scatters h values per
        # token into a V×h gradient: count it as touching h values, like a norm.
        embed = float(4 * h)
        # LM head matmul + log-softmax/cross-entropy over the vocabulary (~5 FLOPs per logit).
        head = 2 * h * v + 5 * v
        return cls(float(layer), embed, float(head))


def _balanced(n_layers: int, n_stages: int, costs: StageCosts) -> list[int]:
    """Layers per stage (each ≥ 1, contiguous) minimising the most expensive stage; ties broken
    towards earlier stages holding more layers. Exact dynamic programme, O(stages · layers²)."""
    inf = float("inf")

    def cost(stage: int, lo: int, hi: int) -> float:
        c = (hi - lo) * costs.layer
        if stage == 0:
            c += costs.embed
        if stage == n_stages - 1:
            c += costs.head
        return c

    # best[s][i]: minimal max-cost putting the first i layers into stages 0..s-1; cut[s][i]: the smallest j
    # (layers before stage s-1) reaching it. Over j, best[s-1][j] never decreases (one more layer cannot
    # lower the best max-cost) and the last stage's cost(s-1, j, i) strictly decreases, so the minimum of their
    # max sits at the first j where the first reaches the second, or just before it: a bisection, not a scan
    # (the planner partitions deep models over many stages: 126 layers over 100 stages was 1.6M steps).
    best = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        prev = best[s - 1]
        for i in range(s, n_layers - (n_stages - s) + 1):
            lo, hi = s - 1, i - 1  # first j in [lo, hi] with prev[j] >= cost(s-1, j, i); hi + 1 if none
            if prev[hi] < cost(s - 1, hi, i):
                lo = hi + 1
            else:
                while lo < hi:
                    mid = (lo + hi) // 2
                    if prev[mid] >= cost(s - 1, mid, i):
                        hi = mid
                    else:
                        lo = mid + 1
            j = lo
            if j > s - 1 and (j == i or cost(s - 1, j - 1, i) <= max(prev[j], cost(s - 1, j, i))):
                j -= 1  # the last j before the crossing is as good or better (and smaller: ties go to it)
            best[s][i], cut[s][i] = max(prev[j], cost(s - 1, j, i)), j
    counts, i = [], n_layers
    for s in range(n_stages, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def partition(n_layers: int, n_stages: int, *, costs: StageCosts | None = None, uniform: bool = False,
              layers: Sequence[int] | None = None) -> list[range]:
    """Layer ranges for stages 0..n_stages-1: from `layers` (counts per stage) if given, else equal
    (`uniform`, or no `costs`), else balanced by `costs`."""
    problems = partition_problems(n_layers, n_stages, uniform=uniform or costs is None, layers=layers)
    if problems:
        raise PartitionError("; ".join(problems))
    if layers is not None:
        counts = list(layers)
    elif uniform or costs is None:
        counts = [n_layers // n_stages] * n_stages
    else:
        counts = _balanced(n_layers, n_stages, costs)
    out, lo = [], 0
    for c in counts:
        out.append(range(lo, lo + c))
        lo += c
    return out
