"""Mixed-precision policy: what dtype the model computes in, what gradients accumulate in, what the
optimizer keeps. bf16 = bf16 weights and activations, fp32 gradient accumulation and fp32 master
weights (the Megatron recipe); fp32 = everything fp32 (the CPU default); fp64 = everything float64, the
parity suite's mode: rounding then sits near 1e-15, so a layout's run equals the 1-process run to 1e-10
whatever kernels the CPU picks (docs/testing.md). Where the model "upcasts to fp32" for stability it
upcasts to at least fp32 (`wide`), so fp64 never passes through fp32."""

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


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype stable arithmetic runs in for operands of `dtype`: fp32, or fp64 when they are fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in `wide_dtype` (as `.float()`, which would round an fp64 tensor to fp32)."""
    return t if t.dtype == torch.float64 else t.float()


def resolve_precision(name: str, device: torch.device) -> PrecisionPolicy:
    """'auto' → bf16 on CUDA, fp32 elsewhere (CPU bf16 matmuls are slow and the tests need exact fp32)."""
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    if name == "bf16":
        return PrecisionPolicy("bf16", torch.bfloat16)
    if name == "fp32":
        return PrecisionPolicy("fp32", torch.float32)
    if name == "fp64":
        return PrecisionPolicy("fp64", torch.float64, torch.float64, torch.float64)
    raise ValueError(f"train.precision must be auto, fp32, fp64 or bf16, got {name!r}")


def fp32_matmul_precision(policy: PrecisionPolicy, device: torch.device) -> str | None:
    """The `torch.set_float32_matmul_precision` an fp32 run on CUDA takes: "high", TF32 tensor cores (10-bit
    mantissa products, fp32 accumulation), which the planner and MFU price it at (`peak_flops["tf32"]`);
    torch's default ("highest") runs fp32 matmuls at the CUDA-core fp32 rate, several times lower. None:
    leave it (CPU, where the setting changes nothing the run relies on; bf16, whose matmuls are bf16; fp64,
    exact by design)."""
    return "high" if device.type == "cuda" and policy.param_dtype == torch.float32 else None


def apply_matmul_precision(policy: PrecisionPolicy, device: torch.device) -> None:
    """Set `fp32_matmul_precision`'s choice for this process (process-wide: torch has no per-module setting).
    Through `set_float32_matmul_precision`, which keeps torch's legacy `allow_tf32` flag and its newer
    `fp32_precision` settings consistent (setting one of them directly makes reading the other raise)."""
    if (mode := fp32_matmul_precision(policy, device)) is not None:
        torch.set_float32_matmul_precision(mode)
