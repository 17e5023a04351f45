"""The pipeline's stage-to-stage hop as a step meets it, for `pentatron bench` on a CPU (`pp_step` in the
profile).

In a balanced 1F1B steady state both neighbours compute a micro-batch's block at once, then each sends
one message (an activation downstream, a gradient upstream) and waits for the other's: every block is
followed by such a swap, so the step pays one hop per micro-batch on top of the compute. Such a hop
costs more than a ping-pong's one-way time: gloo's threads have slept, the ranks arrive apart, and the
wake-up waits for a core that computes.

So bench times that swap as the step issues it: every pair of ranks (0-1, 2-3, ...) runs COMPUTE_S of
in-step GEMMs, then sends and receives a message of each size in HOP_BYTES in one batch; the seconds
from the end of its compute to both transfers done (the wait for the neighbour's compute included),
the mean over ITERS, averaged over the ranks. The mean, not the median or the fastest: a step pays
one hop per micro-batch and so their sum, and the hops' times are skewed. All ranks compute at once,
so the figures include the ranks sharing the node's cores.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from pentatron.calibrate.cpu_kernels import agreed_compute
from pentatron.distributed.comm import P2P

HOP_BYTES = (4 * 2**10, 32 * 2**10, 256 * 2**10, 2**20)  # stage boundaries: a debug micro-batch's is 32 KiB
COMPUTE_S = 0.005  # one micro-batch's block on a stage: a CPU debug-model pp2 stage takes 3-8 ms
WARMUP, ITERS = 3, 60  # per size; both ranks of a pair run the same count (the transfers pair them)


@dataclass(frozen=True)
class PPStep:
    hop: tuple[tuple[int, float], ...]  # (message bytes, mean seconds per hop in a step)
    compute_s: float  # the compute block actually run before each hop

    def to_profile(self) -> dict[str, Any]:
        """The `pp_step` table of the profile (microseconds)."""
        return {"hop_bytes": [b for b, _ in self.hop], "hop_us": [round(t * 1e6, 2) for _, t in self.hop],
                "compute_us": round(self.compute_s * 1e6, 2)}


def measure_pp_step(comm: Any, dim: str, compute: Any) -> PPStep:
    """Run on every rank of the group `dim` (a collective call; its size must be even). `compute()`:
    about 0.5 ms of in-step work (cpu_kernels.step_compute), repeated to make COMPUTE_S."""
    size, rank = comm.ctx.size(dim), comm.ctx.local_rank(dim)
    if size < 2 or size % 2:
        raise ValueError(f"the pipeline hop is timed between pairs of ranks: {dim} has {size}")
    peer = rank ^ 1
    block = agreed_compute(comm, dim, compute, COMPUTE_S)
    out: list[float] = []
    blocks: list[float] = []
    for nbytes in HOP_BYTES:
        comm.ledger.begin_step()  # the ledger is per step: do not let it grow across sizes
        outgoing = torch.zeros(nbytes // 4)
        incoming = torch.empty_like(outgoing)
        times = []
        for i in range(WARMUP + ITERS):
            comm.barrier(dim)
            t1 = time.perf_counter()
            block()
            outgoing.add_(1.0)  # the stage has just written its output
            t2 = time.perf_counter()
            comm.batch_p2p([P2P("send", outgoing, peer), P2P("recv", incoming, peer)], dim).wait()
            t3 = time.perf_counter()
            if i >= WARMUP:
                times.append(t3 - t2)
                blocks.append(t2 - t1)
        out.append(statistics.fmean(times))
    vals = torch.tensor(out + [statistics.median(blocks)], dtype=torch.float64)
    comm.all_reduce(vals, dim)
    vals /= size
    *hops, block_s = vals.tolist()
    return PPStep(tuple(zip(HOP_BYTES, hops, strict=True)), block_s)
