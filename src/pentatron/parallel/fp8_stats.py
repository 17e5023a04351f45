"""What train.fp8's GEMMs record and how the rest of the package finds them, without importing torchao
(parallel/fp8.py does, which costs seconds at import): the numerics log and the compile pass read these.

An FP8 linear holds its GEMM as `module.gemm`, a parallel/fp8.py `Fp8Gemm`, whose `stats` tensor keeps per
operand (columns x, w, dy) the largest amax (row 0) and the smallest scale (row 1) its casts used since last
cleared, and whose `reduce` maps each cast's role to the mesh dims its amax is all-reduced over."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

OPERANDS = ("x", "w", "dy")  # the columns of Fp8Gemm.stats


def empty_stats(device: torch.device | str = "cpu") -> torch.Tensor:
    """[amax, scale] × (x, w, dy) before any cast: amax -1 (no cast yet: an amax is ≥ 0), scale +inf."""
    return torch.tensor([[-1.0] * 3, [math.inf] * 3], dtype=torch.float64, device=device)


def fp8_gemm(module: nn.Module) -> Any | None:
    """The module's FP8 GEMM (an `Fp8Gemm`, found by its `stats`), or None."""
    gemm = getattr(module, "gemm", None)
    return gemm if hasattr(gemm, "stats") else None
