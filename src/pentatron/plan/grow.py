"""When no layout of the asked GPU count fits: the smallest count that does, for `pentatron plan` to
recommend with its best layout.

The counts tried are powers of two and, beyond one node, whole nodes (multiples of the node size): the
search doubles the count until some layout fits, then bisects between the last count that did not and
the first that did. Each probe stops at the first trainable layout that fits (`fits_on`), so a probe
costs far less than a full search; only the count found is then searched in full (by the caller).
Fitting is assumed to grow with the count (more GPUs shard more), which the global batch's divisibility
can break: the answer is the smallest count found this way, said so where it is printed.
"""

from __future__ import annotations

from typing import Any

from pentatron.hardware.catalogue import GPUSpec
from pentatron.plan.layout import Workload, problems, trainable_problems
from pentatron.plan.memory import memory_floor, memory_per_gpu
from pentatron.plan.recipes import PENTATRON, resolve_kernels
from pentatron.plan.search import enumerate_layouts, memory_budget


def fits_on(w: Workload, gpu: GPUSpec, gpus: int, fixed: dict[str, Any], kernels: str | None = None) -> bool:
    """Whether some trainable layout of `gpus` GPUs fits in memory (the search's rules, stopping at the
    first one found)."""
    kernels = resolve_kernels(fixed.get("recipe", PENTATRON), kernels)
    budget = memory_budget(gpu)
    for lay in enumerate_layouts(w, gpu, gpus, fixed):
        if memory_floor(w, lay, gpu, kernels) > budget * (1 + 1e-9):
            continue
        if memory_per_gpu(w, lay, gpu, kernels).total > budget:
            continue
        if not problems(w, lay, gpu, gpus) and not trainable_problems(w, lay, gpus):
            return True
    return False


def candidate_counts(above: int, limit: int, gpus_per_node: int) -> list[int]:
    """Powers of two and whole nodes greater than `above`, up to `limit`, ascending."""
    powers = {1 << k for k in range(limit.bit_length()) if above < 1 << k <= limit}
    top = max(powers, default=limit)
    nodes = set(range(gpus_per_node, min(limit, top) + 1, gpus_per_node)) if gpus_per_node > 0 else set()
    return sorted(c for c in powers | nodes if above < c <= limit)


def smallest_fitting(w: Workload, gpu: GPUSpec, gpus: int, fixed: dict[str, Any], limit: int,
                     kernels: str | None = None) -> int | None:
    """The smallest count above `gpus` (of `candidate_counts`) on which a layout fits; None up to `limit`."""
    counts = candidate_counts(gpus, limit, gpu.gpus_per_node)
    lo, hi = -1, None  # counts[lo] did not fit, counts[hi] did
    step = 1
    while hi is None:  # double (along the candidates) until one fits
        i = min(lo + step, len(counts) - 1)
        if i <= lo:
            return None
        if fits_on(w, gpu, counts[i], fixed, kernels):
            hi = i
        else:
            lo, step = i, step * 2
            if i == len(counts) - 1:
                return None
    while hi - lo > 1:  # bisect between the last miss and the first fit
        mid = (lo + hi) // 2
        if fits_on(w, gpu, counts[mid], fixed, kernels):
            hi = mid
        else:
            lo = mid
    return counts[hi]
