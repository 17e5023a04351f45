"""The data-parallel step's synchronisations as its ranks meet them, for `pentatron bench` on a CPU
(`dp_step` in the profile).

A gradient all-reduce inside a step costs more than the same all-reduce timed back to back: gloo's
threads have slept through the backward, the caches hold the backward's data, and the ranks arrive
apart. So bench times the gradient all-reduce the way a step issues it:

* `collective`: [(bytes, seconds)], the median seconds of an all-reduce of a freshly written gradient
  buffer after a backward's worth of compute (COMPUTE_S of in-step GEMMs), at GRAD_BYTES; the median,
  not the fastest: a step pays one of these, the typical one;
* `scalar_s`: the median seconds of a one-number all-reduce issued right after it, when the ranks are
  already together: what each of the trainer's per-step scalars costs (the loss's mean over data
  parallelism, the gradient norm's sum, the pipeline's statistics).

All ranks compute at once, so the figures already include the ranks sharing the node's cores.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from pentatron.calibrate.cpu_kernels import agreed_compute

GRAD_BYTES = (256 * 2**10, 2**20, 4 * 2**20)  # gradient buffers (a debug model's is 4.4 MiB in fp32)
COMPUTE_S = 0.01  # the compute before each all-reduce: a CPU debug-model backward is 10-25 ms
WARMUP, ITERS = 2, 16  # per size; every rank runs the same count (the collectives pair them)


@dataclass(frozen=True)
class DPStep:
    collective: tuple[tuple[int, float], ...]  # (gradient bytes, median seconds per all-reduce in a step)
    scalar_s: float  # median seconds of a scalar all-reduce right after the gradients'
    compute_s: float  # the compute block actually run before each all-reduce

    def to_profile(self) -> dict[str, Any]:
        """The `dp_step` table of the profile (microseconds)."""
        return {"collective_bytes": [b for b, _ in self.collective],
                "collective_us": [round(t * 1e6, 2) for _, t in self.collective],
                "scalar_us": round(self.scalar_s * 1e6, 2), "compute_us": round(self.compute_s * 1e6, 2)}


def measure_dp_step(comm: Any, dim: str, compute: Any) -> DPStep:
    """Run on every rank of the group `dim` (a collective call). `compute()`: about 0.5 ms of in-step
    work (cpu_kernels.step_compute), repeated to make COMPUTE_S. Medians over iterations, then the mean
    over the ranks."""
    block = agreed_compute(comm, dim, compute, COMPUTE_S)
    scalar = torch.zeros(1)
    out: list[float] = []
    scalars: list[float] = []
    blocks: list[float] = []
    for size in GRAD_BYTES:
        comm.ledger.begin_step()  # the ledger is per step: do not let it grow across sizes
        grads = torch.zeros(size // 4)
        times = []
        for i in range(WARMUP + ITERS):
            comm.barrier(dim)
            t0 = time.perf_counter()
            block()
            grads.add_(1.0)  # the backward has just written the gradients
            t1 = time.perf_counter()
            comm.all_reduce(grads, dim)
            t2 = time.perf_counter()
            comm.all_reduce(scalar, dim)
            t3 = time.perf_counter()
            if i >= WARMUP:
                times.append(t2 - t1)
                scalars.append(t3 - t2)
                blocks.append(t1 - t0)
        out.append(statistics.median(times))
    vals = torch.tensor(out + [statistics.median(scalars), statistics.median(blocks)], dtype=torch.float64)
    comm.all_reduce(vals, dim)
    vals /= comm.ctx.size(dim)
    *coll, scalar_s, block_s = vals.tolist()
    return DPStep(tuple(zip(GRAD_BYTES, coll, strict=True)), scalar_s, block_s)
