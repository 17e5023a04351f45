"""FP8 GEMMs for the decoder's linear layers (train.fp8), composed with our own TP/SP, CP, DP/ZeRO and PP.

The scaling is torchao's (0.18): its recipes (`Float8LinearConfig.from_recipe_name`: which of the six
casts of a linear's three GEMMs is tensorwise or rowwise, e4m3 or e5m2, power-of-two scales), its amax
(`tensor_to_amax`), scale (`amax_to_scale`), cast (`hp_tensor_and_scale_to_float8`) and its `mm` on
`Float8TrainingTensor`s, which calls `torch._scaled_mm`. The autograd Function below is torchao's
`matmul_with_hp_or_float8_args` with one step added between amax and scale: the amax is MAX-all-reduced
over every mesh dimension that splits an axis it spans. So a tensor-parallel shard is scaled by the whole
tensor's amax and a context-parallel token shard by the whole sequence's, and every layout quantises
exactly the values the 1-process run quantises (MAX is exact in any order). Which axes a cast spans:

    operand   2-D view       split over             tensorwise amax spans   rowwise (torchao's axiswise dim)
    X         [tokens, in]   tokens: cp; in: tp (row-parallel)   both        input: in; input_for_grad_weight: tokens
    Wᵀ        [in, out]      in: tp (row); out: tp (column)      both        weight: in; weight_for_grad_input: out
    dY        [tokens, out]  tokens: cp; out: tp (column)        both        grad_output: out; for grad_weight: tokens

Tokens are never split over tp inside a linear (SP gathers them before a column-parallel layer, and a
row-parallel layer's output gradient is gathered back in backward), and never reduced over dp: a data-
parallel rank's micro-batch is the 1-process run's micro-batch of the same samples (data/loader.py), so
per-micro-batch scales are what the 1-process run uses. Rowwise over an unsplit axis needs no collective
(e.g. a column-parallel layer's input and weight casts).

The GEMM: bf16/fp32 runs call torchao's `mm` (`torch._scaled_mm`, which on CPU accumulates in fp32).
Under train.precision = "fp64" (the parity mode, docs/testing.md) the same fp8 operands are multiplied in
float64 (`to_original_precision`: fp8 value / scale, then an fp64 GEMM), so a layout differs from the
1-process run only by float64 rounding, far below the distance to any fp8 rounding boundary: the casts
see the same values and quantise them identically, and parity holds to 1e-10.

Under train.compile (parallel/compile.py) a decoder block, or its attention or MLP, whose FP8 linears reduce
nothing is compiled with them inside, so inductor fuses each cast's amax, scale and cast (torchao's design:
its float8 training is meant to run compiled); a linear whose casts all-reduce (tp: it communicates anyway,
cp: `reduce`) stays eager with its collectives. So the Function below has no Python side effect a compiled
graph could not replay: the numerics log's statistics are one float64 tensor updated in place (`stats`).

Only what is named here converts: the attention projections and the dense MLP's (not the LM head, the
embedding, the norms, the MoE router or experts: torch's grouped GEMM has no FP8 form on CPU), minus the
train.fp8_skip patterns.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd import Function

from pentatron.distributed.comm import Comm


def _quiet_import() -> None:
    """Import torchao without its load-time noise on every rank: it tries its CUDA kernel libraries (absent
    on a CPU build: one warning per library) and registers an Enum that torch calls deprecated."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_quiet_import()
from torchao.float8.config import Float8LinearConfig, ScalingGranularity, ScalingType  # noqa: E402
from torchao.float8.float8_training_tensor import (  # noqa: E402
    Float8TrainingTensor,
    GemmInputRole,
    LinearMMConfig,
    ScaledMMConfig,
    hp_tensor_and_scale_to_float8,
)
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax  # noqa: E402

from pentatron.models.llama import MLP, Attention  # noqa: E402
from pentatron.parallel.fp8_stats import OPERANDS, empty_stats  # noqa: E402
from pentatron.parallel.tensor import ColumnParallelLinear, RowParallelLinear  # noqa: E402

FP8_RECIPES = ("tensorwise", "rowwise")
FP8_TARGETS = ("layers.*.attn.q_proj", "layers.*.attn.k_proj", "layers.*.attn.v_proj", "layers.*.attn.o_proj",
               "layers.*.mlp.gate_proj", "layers.*.mlp.up_proj", "layers.*.mlp.down_proj")
FP8_ALIGN = 16  # torch._scaled_mm's (CUDA) rule for every GEMM dimension; kept on CPU so a config moves as is

_ROLES = ("input", "weight", "grad_output", "weight_for_grad_input", "grad_output_for_grad_weight",
          "input_for_grad_weight")
# each cast: (operand's axes in its 2-D view, torchao's axiswise dim for a rowwise recipe)
_AXES: dict[str, tuple[tuple[str, str], int]] = {
    "input": (("tokens", "in"), -1),
    "weight": (("in", "out"), 0),
    "grad_output": (("tokens", "out"), -1),
    "weight_for_grad_input": (("in", "out"), -1),
    "grad_output_for_grad_weight": (("tokens", "out"), 0),
    "input_for_grad_weight": (("tokens", "in"), 0),
}


# the operand each cast reads (the numerics log's keys): x, w or dy
OPERAND = {"input": "x", "input_for_grad_weight": "x", "weight": "w", "weight_for_grad_input": "w",
           "grad_output": "dy", "grad_output_for_grad_weight": "dy"}


@dataclass
class Fp8Gemm:
    """One linear layer's FP8 GEMM: the recipe and the mesh dims each cast's amax is reduced over. `stats` keeps,
    per operand (columns x, w, dy), the largest amax (row 0) and the smallest scale (row 1) its casts used since
    the numerics log last cleared them (a rowwise cast: its largest row's): the log's per-layer statistics, one
    float64 tensor on the compute device updated in place (a compiled region replays that; no host sync)."""

    config: Float8LinearConfig
    mm_config: LinearMMConfig
    reduce: dict[str, tuple[str, ...]]  # role → mesh dims
    comm: Comm | None
    stats: torch.Tensor = field(default_factory=empty_stats)

    def clear_stats(self) -> None:
        """Back to `empty_stats`, by device kernels (no host-to-device copy, which would synchronise)."""
        self.stats[0].fill_(-1.0)
        self.stats[1].fill_(math.inf)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _Fp8Matmul.apply(x, weight, self)

    def cast(self, t: torch.Tensor, role: str) -> Any:
        """`t` as a Float8TrainingTensor scaled for `role` (torchao's steps, the amax reduced over the split);
        `t` itself where the recipe keeps that cast in high precision (ScalingType.DISABLED)."""
        cast = getattr(self.config, f"cast_config_{role}")
        if cast.scaling_type is ScalingType.DISABLED:
            return t
        rowwise = cast.scaling_granularity is ScalingGranularity.AXISWISE
        dim = _AXES[role][1] if rowwise else None
        amax = tensor_to_amax(t, scaling_granularity=cast.scaling_granularity, axiswise_dim=dim)
        for d in self.reduce[role]:
            self.comm.all_reduce(amax, d, op="max")
        scale = amax_to_scale(amax, cast.target_dtype, self.config.round_scales_to_power_of_2)
        i = OPERANDS.index(OPERAND[role])
        self.stats[0, i] = torch.maximum(self.stats[0, i], amax.max().to(torch.float64))
        self.stats[1, i] = torch.minimum(self.stats[1, i], scale.min().to(torch.float64))
        gemm_role = (GemmInputRole.INPUT if role.startswith("input") else
                     GemmInputRole.WEIGHT if role.startswith("weight") else GemmInputRole.GRAD_OUTPUT)
        return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, self.mm_config, gemm_role, dim)


def _mm(a: Any, b: Any) -> torch.Tensor:
    """a @ b of two Float8TrainingTensors: torch._scaled_mm (torchao's dispatch), or in float64 for fp64 runs;
    of two plain tensors (a GEMM the recipe keeps in high precision: torchao's config forbids a mixed pair),
    the plain GEMM in their dtype."""
    if not isinstance(a, Float8TrainingTensor):
        return a @ b
    if a._orig_dtype == torch.float64:
        return a.to_original_precision() @ b.to_original_precision()
    return torch.mm(a, b)


class _Fp8Matmul(Function):
    """y = x Wᵀ with every GEMM operand cast to FP8 (torchao's `matmul_with_hp_or_float8_args`, amax reduced).
    Backward computes only the gradients autograd asks for (zero-bubble's B and W passes each ask for one)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, gemm: Fp8Gemm) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.gemm = gemm
        x2 = x.reshape(-1, x.shape[-1])
        y = _mm(gemm.cast(x2, "input"), gemm.cast(weight.t(), "weight"))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        gemm: Fp8Gemm = ctx.gemm
        dy = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            wt = gemm.cast(weight.t(), "weight_for_grad_input")
            grad_x = _mm(gemm.cast(dy, "grad_output"), wt.t()).reshape(*x.shape)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            grad_w = _mm(gemm.cast(dy, "grad_output_for_grad_weight").t(), gemm.cast(x2, "input_for_grad_weight"))
        return grad_x, grad_w, None


class Fp8Linear(nn.Module):
    """A plain (unsharded) linear layer whose GEMM is FP8; holds the replaced layer's Parameter (same name)."""

    def __init__(self, weight: nn.Parameter, gemm: Fp8Gemm) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8={self.gemm.config.cast_config_weight.short_str()}"


def recipe_config(recipe: str) -> Float8LinearConfig:
    """torchao's published recipe by name (tensorwise: torchtitan's default; rowwise: its rowwise recipe)."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"train.fp8 must be off, {' or '.join(FP8_RECIPES)}, got {recipe!r}")
    return Float8LinearConfig.from_recipe_name(recipe)


def _mm_config(config: Float8LinearConfig) -> LinearMMConfig:
    """Float8Linear's per-GEMM settings (fast accumulation in the forward GEMM only, as torchao's recipes)."""
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    return LinearMMConfig(*(ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim)
                            for g in gemms))


def local_gemm(recipe: str) -> Fp8Gemm:
    """One unsharded FP8 GEMM of a recipe (no amax reduction): what the failure lab casts and multiplies with."""
    config = recipe_config(recipe)
    return Fp8Gemm(config, _mm_config(config), {role: () for role in _ROLES}, None)


def fp8_targets(model: nn.Module, skip: Sequence[str] = ()) -> list[str]:
    """The names of the linear modules train.fp8 converts: attention projections and dense MLPs, not skipped."""
    out = []
    for name, _ in model.named_modules():
        if not any(fnmatch.fnmatchcase(name, p) for p in FP8_TARGETS):
            continue
        parent = model.get_submodule(name.rpartition(".")[0])
        if isinstance(parent, (Attention, MLP)) and not any(fnmatch.fnmatchcase(name, p) for p in skip):
            out.append(name)
    return out


def apply_fp8(model: nn.Module, recipe: str | Float8LinearConfig, comm: Comm | None = None, cp: int = 1,
              skip: Sequence[str] = (), device: torch.device | str | None = None) -> list[str]:
    """Give the decoder's linear layers FP8 GEMMs (after tensor parallelism: a column- or row-parallel layer
    keeps its collectives and gets the FP8 GEMM inside). Parameters are untouched (same objects, names,
    placements). `recipe`: a train.fp8 name, or any torchao config (research ablations). `device`: where the
    GEMMs run (their statistics live there; default: the parameters' device, CPU for a meta model). Returns the
    converted module names."""
    config = recipe if isinstance(recipe, Float8LinearConfig) else recipe_config(recipe)
    if device is None:
        device = next(model.parameters()).device
        device = torch.device("cpu") if device.type == "meta" else device
    mm_config = _mm_config(config)
    names = fp8_targets(model, skip)
    for name in names:
        module = model.get_submodule(name)
        split: dict[str, tuple[str, ...]] = {"tokens": ("cp",) if cp > 1 else (), "in": (), "out": ()}
        if isinstance(module, ColumnParallelLinear):
            split["out"] = ("tp",)
        elif isinstance(module, RowParallelLinear):
            split["in"] = ("tp",)
        reduce = {}
        for role in _ROLES:
            axes, dim = _AXES[role]
            cast = getattr(config, f"cast_config_{role}")
            rowwise = cast.scaling_granularity is ScalingGranularity.AXISWISE
            # a high-precision cast has no amax, so nothing to reduce
            spanned = [] if cast.scaling_type is ScalingType.DISABLED else [axes[dim]] if rowwise else list(axes)
            reduce[role] = tuple(sorted({d for a in spanned for d in split[a]}))
        gemm = Fp8Gemm(config, mm_config, reduce, comm, empty_stats(device))
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.gemm = gemm
        else:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, Fp8Linear(module.weight, gemm))
    return names


def fp8_gemms(model: nn.Module) -> dict[str, Fp8Gemm]:
    """Every FP8 GEMM of a model by module name (the numerics log reads their amaxes)."""
    return {n: m.gemm for n, m in model.named_modules() if isinstance(getattr(m, "gemm", None), Fp8Gemm)}
