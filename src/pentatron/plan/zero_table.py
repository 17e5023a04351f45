"""`pentatron plan --zero-table`: the Ultra-Scale Playbook's exercise 2 as a command (issue 48, item 5).

The same layout at ZeRO 0, 1, 2 and 3 side by side, per GPU, from the planner's memory model (the fullest
pipeline rank, as `pentatron plan` judges fit): weights, gradients, the optimizer's fp32 master weights and
Adam's two moments, activations (saved activations and the recompute's working set), the loss (logits and
its working set) and the rest (communication buffers, the optimizer step's copies, CUDA context +
fragmentation margin). docs/planner.md compares it cell by cell with the playbook's published figure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pentatron.hardware.catalogue import GiB, GPUSpec
from pentatron.plan.layout import Layout, Workload
from pentatron.plan.memory import MemoryBreakdown
from pentatron.plan.search import predict

COLUMNS = ("weights", "gradients", "fp32 master", "moments", "activations", "loss", "other", "total")


@dataclass(frozen=True)
class ZeroRow:
    zero: int
    memory: MemoryBreakdown
    fits: bool
    tight: bool  # fits only without the fragmentation margin

    @property
    def cells(self) -> dict[str, float]:
        """Bytes per GPU by column."""
        m = self.memory
        return {"weights": m.parameters, "gradients": m.gradients, "fp32 master": m.master_weights,
                "moments": m.optimizer, "activations": m.activations + m.recompute_working, "loss": m.logits_loss,
                "other": m.comm_buffers + m.optimizer_step + m.reserved, "total": m.total}


def zero_rows(w: Workload, lay: Layout, gpu: GPUSpec, kernels: str) -> list[ZeroRow]:
    """`lay` at each ZeRO stage (everything else as given)."""
    out = []
    for zero in range(4):
        p = predict(w, replace(lay, zero=zero), gpu, kernels=kernels)
        out.append(ZeroRow(zero, p.memory, p.fits, p.tight))
    return out


def format_zero_table(w: Workload, lay: Layout, gpu: GPUSpec, rows: list[ZeroRow]) -> str:
    head = (f"ZeRO memory per GPU (GiB), {w.cfg.name} at seq {w.seq_len}, micro-batch {lay.micro_batch}, "
            f"recompute {lay.recompute}, {lay.short()} with zero varied, on {gpu.name} "
            f"({gpu.hbm_bytes / GiB:.0f} GiB)")
    lines = [head, f"{'stage':<7}" + "".join(f"{c:>12}" for c in COLUMNS) + "  fits"]
    for r in rows:
        c = r.cells
        fit = ("tight" if r.tight else "yes") if r.fits else "NO"
        lines.append(f"{'ZeRO-' + str(r.zero):<7}" + "".join(f"{c[k] / GiB:>12.2f}" for k in COLUMNS) + f"  {fit}")
    lines.append("moments = Adam's two fp32 moments; activations = saved activations + the recompute's working set; "
                 "loss = the logits and the loss's working set; other = communication buffers, the optimizer "
                 "step's copies, CUDA context and the 5 % fragmentation margin (docs/planner.md, 'ZeRO memory "
                 "table': the Ultra-Scale Playbook's figure beside it)")
    return "\n".join(lines)


def zero_table_json(rows: list[ZeroRow]) -> list[dict[str, Any]]:
    return [{"zero": r.zero, "fits": r.fits, "tight": r.tight, "bytes": r.cells, "pipeline_rank": r.memory.rank}
            for r in rows]
