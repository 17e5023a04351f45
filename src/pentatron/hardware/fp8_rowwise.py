"""FP8 with row-wise scaling (torchao's "rowwise" recipe): what a linear costs, read from a measurement.

Row-wise scaled GEMMs run in a CUTLASS kernel that is far less efficient than cuBLAS's per-tensor one at
small and medium shapes (pytorch/pytorch#147971: "a long tail down to 50 %"), and the recipe casts each
operand once per GEMM it feeds, with scales along a different axis each time. Neither follows from the
per-tensor model in `plan.timing._linear`, so the planner reads torchao's published microbenchmark instead:
the speedup over bf16 of a compiled LayerNorm -> Linear -> Sigmoid block, forward + backward, by the
forward's (M, K, N), on an H100 (torchao `docs/static/fp8-rowwise-perf.png`, added to
`torchao/float8/README.md` in fdddb2c, 2025-06-06, PyTorch 2.8.0a0+git48807d5; reproduced by
`benchmarks/float8/float8_roofline.py --shape_gen_name sweep --float8_recipe_name rowwise`).

The benchmark's own definition of that speedup is (ln + bf16 gemms + sigmoid) / (ln + fp8 gemms + fp8
overhead + sigmoid) (float8_roofline.py, "e2e speedup"), so the linear's row-wise time is recovered by
taking the LayerNorm and Sigmoid back out, priced as the planner prices any memory-bound op:
    t_rowwise = (t_bf16 + t_ln_sigmoid) / speedup - t_ln_sigmoid
and never below the per-tensor FP8 model (row-wise does all of per-tensor's work and more).
No torch here: `pentatron plan` reads it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pentatron.hardware.kernel_tables import log_grid_value

# LayerNorm (no affine) and Sigmoid, compiled: forward reads x and writes y (2 + 2 bytes per bf16
# element), backward reads x and dy and writes dx (2 + 2 + 2): 10 bytes per element of the LayerNorm's
# [M, K] input and of the Sigmoid's [M, N] one.
LN_SIGMOID_BYTES_PER_ELEMENT = 10


@dataclass(frozen=True)
class SpeedupGrid:
    """Speedup of the fp8 block over bf16 at m[i], k[j], n[l], stored m-major then k then n."""

    m: tuple[float, ...]
    k: tuple[float, ...]
    n: tuple[float, ...]
    speedup: tuple[float, ...]

    def at(self, m: float, k: float, n: float) -> float:
        """Interpolated linearly in log(speedup) over log(m), log(k), log(n); clamped to the grid's edges
        (shapes beyond the largest M take its row: speedups grow with M, so this errs slow)."""
        return log_grid_value(self.speedup, ((self.m, m), (self.k, k), (self.n, n)))


_P2 = (1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0)
# Read off the published table row by row: for each M, one line per K with N = 1024 .. 32768.
H100_ROWWISE = SpeedupGrid(m=_P2, k=_P2, n=_P2, speedup=(
    # M = 1024
    0.42, 0.42, 0.50, 0.51, 0.56, 0.56,
    0.40, 0.38, 0.42, 0.50, 0.50, 0.56,
    0.48, 0.43, 0.46, 0.53, 0.57, 0.60,
    0.45, 0.48, 0.54, 0.62, 0.60, 0.62,
    0.46, 0.48, 0.54, 0.60, 0.60, 0.61,
    0.45, 0.50, 0.55, 0.60, 0.62, 0.65,
    # M = 2048
    0.43, 0.43, 0.48, 0.55, 0.62, 0.65,
    0.38, 0.45, 0.58, 0.65, 0.72, 0.75,
    0.43, 0.50, 0.68, 0.78, 0.81, 0.82,
    0.46, 0.58, 0.73, 0.82, 0.87, 0.89,
    0.48, 0.62, 0.75, 0.83, 0.84, 0.85,
    0.50, 0.64, 0.75, 0.84, 0.83, 0.99,
    # M = 4096
    0.45, 0.47, 0.57, 0.66, 0.72, 0.76,
    0.43, 0.53, 0.70, 0.83, 0.90, 0.91,
    0.44, 0.64, 0.84, 1.01, 1.01, 1.04,
    0.53, 0.72, 0.91, 1.01, 1.07, 1.13,
    0.53, 0.74, 0.92, 1.05, 1.10, 1.18,
    0.54, 0.75, 0.93, 1.02, 1.17, 1.18,
    # M = 8192
    0.48, 0.52, 0.65, 0.77, 0.83, 0.84,
    0.45, 0.64, 0.82, 1.01, 1.03, 1.06,
    0.52, 0.76, 1.00, 1.13, 1.17, 1.19,
    0.59, 0.85, 1.05, 1.20, 1.31, 1.41,
    0.58, 0.82, 1.03, 1.22, 1.37, 1.40,
    0.59, 0.82, 1.04, 1.30, 1.36, 1.46,
    # M = 16384
    0.48, 0.58, 0.73, 0.86, 0.85, 0.89,
    0.51, 0.70, 0.90, 1.05, 1.07, 1.15,
    0.57, 0.79, 1.02, 1.20, 1.26, 1.40,
    0.61, 0.87, 1.08, 1.33, 1.39, 1.49,
    0.59, 0.83, 1.07, 1.34, 1.42, 1.55,
    0.60, 0.85, 1.16, 1.35, 1.48, 1.72,
    # M = 32768
    0.51, 0.62, 0.77, 0.87, 0.88, 0.94,
    0.54, 0.73, 0.91, 1.08, 1.14, 1.27,
    0.59, 0.81, 1.04, 1.28, 1.35, 1.49,
    0.63, 0.87, 1.11, 1.41, 1.50, 1.62,
    0.60, 0.83, 1.16, 1.39, 1.49, 1.73,
    0.63, 0.93, 1.16, 1.48, 1.70, 1.52,
))


def rowwise_seconds(grid: SpeedupGrid, m: float, k: float, n: float, bf16_s: float, ln_sigmoid_s: float,
                    tensorwise_s: float) -> float:
    """Forward + backward seconds of a row-wise FP8 linear y[m, n] = x[m, k] W[k, n], from the bf16
    linear's modelled seconds and the LayerNorm + Sigmoid seconds the measured block also contained."""
    return max((bf16_s + ln_sigmoid_s) / grid.at(m, k, n) - ln_sigmoid_s, tensorwise_s)
