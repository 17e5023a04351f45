"""Mixed-precision policy: what dtype the model computes in, what gradients accumulate in, what the
optimizer keeps. bf16 = bf16 weights and activations, fp32 gradient accumulation and fp32 master
weights (the Megatron recipe); fp32 = everything fp32 (the CPU default)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    param_dtype: torch.dtype
    grad_dtype: torch.dtype = torch.float32  # gradient accumulation across micro-batches
    master_dtype: torch.dtype = torch.float32  # optimizer's copy of the weights

    @property
    def needs_master_copy(self) -> bool:
        return self.param_dtype != self.master_dtype


def resolve_precision(name: str, device: torch.device) -> PrecisionPolicy:
    """'auto' → bf16 on CUDA, fp32 elsewhere (CPU bf16 matmuls are slow and the tests need exact fp32)."""
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    if name == "bf16":
        return PrecisionPolicy("bf16", torch.bfloat16)
    if name == "fp32":
        return PrecisionPolicy("fp32", torch.float32)
    raise ValueError(f"train.precision must be auto, fp32 or bf16, got {name!r}")
