"""Per-rank memory accounting of model state: what each data-parallel/ZeRO stage keeps, measured
from the tensors actually allocated, and the Ultra-Scale Playbook formula it should equal.

For Ψ parameters (Ψ counted after padding each bucket to a multiple of dp), parameter bytes P per
element (4 fp32, 2 bf16), fp32 gradient accumulation (4 per element, always: `main_grad`), Adam
moments (8) and a separate fp32 master copy (4, only when parameters are not fp32) — with fp64 state
(`train.precision='fp64'`, the parity suite's mode) the state's 4, 8 and 4 bytes double:

    stage 0:  PΨ + 4Ψ + 8Ψ + MΨ
    stage 1:  PΨ + 4Ψ + (8Ψ + MΨ)/dp            optimizer state and master sharded
    stage 2:  PΨ + (4Ψ + 8Ψ + MΨ)/dp            + gradients sharded
    stage 3:  (PΨ + 4Ψ + 8Ψ + MΨ)/dp            + parameters sharded

Transient buffers (ZeRO-2 gradient buckets in flight, ZeRO-3 gathered layers) are reported
separately as the peak seen so far.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MemoryReport:
    params: int
    grads: int
    optimizer: int
    master: int
    transient_peak: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.master

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}

    def describe(self) -> str:
        mib = 2**20
        return (f"params {self.params / mib:.2f} MiB, grads {self.grads / mib:.2f} MiB, optimizer "
                f"{self.optimizer / mib:.2f} MiB, master {self.master / mib:.2f} MiB "
                f"(total {self.total / mib:.2f} MiB per rank"
                + (f"; transient peak {self.transient_peak / mib:.2f} MiB)" if self.transient_peak else ")"))


def zero_formula(stage: int, numel: int, dp: int, param_bytes: int, master: bool,
                 state_bytes: int = 4) -> MemoryReport:
    """The bytes per rank each stage should keep (see the module docstring); `state_bytes`: the gradient
    and optimizer element size (4: fp32; 8: fp64)."""
    m = state_bytes if master else 0
    params, grads, optim = param_bytes * numel, state_bytes * numel, 2 * state_bytes * numel
    mast = m * numel
    if stage >= 1:
        optim, mast = optim // dp, mast // dp
    if stage >= 2:
        grads //= dp
    if stage >= 3:
        params //= dp
    return MemoryReport(params, grads, optim, mast)
