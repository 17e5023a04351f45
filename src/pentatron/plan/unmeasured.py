"""Our own recipe's predictions on a GPU Pentatron has not run on (issue 48, item 3).

The time model prices the pentatron recipe from kernel and collective measurements; on a CUDA GPU nothing
has measured Pentatron's own training step yet (benchmarks/gpu_check.py has not run on one: docs/
benchmark-history.md, "GPU device check"), so a prediction there is the model's, unmeasured, and it is
above what published frameworks measure on similar layouts (Llama-3-8B on 8 H100: 60 % MFU predicted). Until
a measured profile of that GPU is given (`--hardware-profile`), each such prediction says so and shows a
range: the MFU band that published frameworks measured with dense bf16/fp16 models on that GPU, applied to
this layout. The band's sources are tuning rows of benchmarks/published_runs.toml (their MFU against the
datasheet's dense peak, the planner's FLOP count), not held-out ones:

Hopper (H100 SXM; the H200 has the same die and is taken to behave alike, inferred):
  low  33 %: torchtitan Llama 3.1 8B on 8 H100, FSDP, bf16, eager (docs/performance.md at d4c86e375, Table 1:
             5,762 tokens/s/GPU at seq 8192 = 334 TFLOP/s of 989); compiled 6,667 = 39 %.
  high 49 %: Megatron-Core r0.8 weak-scaling table, 16B on 192 H100 (489 TFLOP/s; the table's 1.7B-462B
             rows 41-49 %; its strong-scaling text: GPT-3 175B 47 % on 96 GPUs, 42 % on 4,608).
  inside:    Llama 3 405B on 8-16K H100 380-430 TFLOP/s (38-43 %, arXiv:2407.21783 Table 4); torchao
             Llama 3 8B bf16 on 8 H100 6,150 tokens/s/GPU (36 %).
A100 (40 and 80 GB):
  low  32 %: Korthikanti et al. 2022 (arXiv:2205.05198) Table 5, 22B at tp 8 with full recompute.
  high 60 %: torchtitan Llama 2 13B on 64 A100 without activation checkpointing (docs/performance.md).
  inside:    Megatron-LM 2021 Table 1 (33-39 % with full recompute), Korthikanti et al. 175B-1T with
             sequence parallelism and selective recompute (51-56 %), torchtitan Llama 3 8B/70B (50-55 %).
  outside, not similar: data parallelism alone over 768+ A100s (ZeRO-3, 11-24 %).

The range is [top x low/high, top] with top = min(predicted MFU, high): where the model predicts more than
any framework measured, the band itself; where it predicts less (a communication-bound layout), the same
relative spread below the prediction. Other GPUs and FP8 have no band here: the prediction is then
labelled unmeasured without one.
"""

from __future__ import annotations

from dataclasses import dataclass

from pentatron.hardware.catalogue import GPUSpec
from pentatron.plan.layout import compute_dtype
from pentatron.plan.recipes import not_ours
from pentatron.plan.search import Prediction

# What train.fp8 costs on a GPU where its casts run eager (train.compile off, or linears outside compiled regions:
# tp, cp, zero-bubble), each cast several unfused kernels. Measured on one H200 (benchmarks/gpu_check.py part fp8,
# 2026-12-04; benchmarks/measured/): a 4-layer Llama-3-8B-shaped stack, 2 x 4096 tokens, all eager: bf16 62,769
# tokens/s, tensorwise 37,825, rowwise 36,511. FP8 inside compiled blocks (casts fused) is not measured yet.
EAGER_FP8_ON_GPU = ("eager FP8 casts measured 0.60x (tensorwise) and 0.58x (rowwise) bf16's tokens/s on an H200 "
                    "(benchmarks/gpu_check.py, 2026-12-04): slower, not faster, on a GPU; FP8 in compiled blocks "
                    "(casts fused) is not measured yet")


@dataclass(frozen=True)
class Band:
    """Measured MFU of published frameworks on one GPU family (fractions of the dense datasheet peak)."""

    low: float
    high: float
    sources: str


HOPPER = Band(0.33, 0.49, "torchtitan Llama 3.1 8B on 8 H100 33-39 %, Llama 3 405B 38-43 %, "
                          "Megatron-Core r0.8 41-49 %")
AMPERE = Band(0.32, 0.60, "Megatron-LM 2021/2022 32-56 %, torchtitan on 64 A100 50-60 %")
# catalogue names (and their aliases' targets) -> band; bf16/fp16 compute only
BANDS = {"h100-sxm": HOPPER, "h200": HOPPER, "a100-40gb": AMPERE, "a100-80gb": AMPERE}
BAND_DTYPES = ("bf16", "fp16")


def measured_on(gpu: GPUSpec) -> bool:
    """Has Pentatron's own step been measured on this hardware? A `pentatron bench` profile (a CPU's, or
    one given for a GPU with --hardware-profile) measured it, and gpu_check calibrated the GPUs whose catalogue
    entry carries `Efficiency.our_step`; any other datasheet GPU has not."""
    return gpu.device_type == "cpu" or gpu.profile is not None or bool(gpu.efficiency.our_step)


def calibration_note(p: Prediction, gpu: GPUSpec) -> str | None:
    """Our recipe on a GPU whose step gpu_check measured: what was measured and what still is the model's."""
    if not_ours(p.layout.recipe) is not None or not gpu.efficiency.our_step:  # as timing.our_step_factor applies
        return None
    factors = ", ".join(f"{v:.2f}x with {k} kernels" for k, v in gpu.efficiency.our_step.items())
    note = (f"calibrated: Pentatron's own step was measured ({gpu.efficiency.our_step_source or gpu.source}): its "
            f"per-GPU work took {factors} this model's, applied here; communication between GPUs is the model's "
            "(our NCCL path has not been measured on a GPU)")
    if p.layout.precision == "fp8":  # the model prices fused casts; ours are not (yet)
        note += f". FP8: {EAGER_FP8_ON_GPU}, where this model predicts a speed-up"
    return note


@dataclass(frozen=True)
class Unmeasured:
    """An unmeasured prediction of our recipe and the range published frameworks' efficiency gives it."""

    gpu: str
    band: Band | None
    mfu: tuple[float, float] | None  # (low, high) fractions of the dense peak; None without a band
    tokens_per_s_per_gpu: tuple[float, float] | None

    def table_note(self) -> str:
        """Under the ranked table: whose numbers its MFU and tokens/s columns are."""
        band = (f"; published frameworks measured {100 * self.band.low:.0f}-{100 * self.band.high:.0f}% MFU on "
                "similar layouts (range of the best layout below)") if self.band and self.mfu else ""
        return (f"unmeasured: Pentatron's recipe has not run on {self.gpu}, so the MFU and tokens/s columns are "
                f"the model's{band}")

    def line(self, predicted_mfu: float) -> str:
        head = (f"unmeasured: Pentatron's recipe has not run on {self.gpu} (no measured profile; "
                f"benchmarks/gpu_check.py has not calibrated it), so MFU {100 * predicted_mfu:.1f}% is the model's")
        if self.mfu is None or self.tokens_per_s_per_gpu is None or self.band is None:
            return head + "; no published framework measurement for this GPU and precision: treat it as an upper bound"
        (lo, hi), (tlo, thi) = self.mfu, self.tokens_per_s_per_gpu
        return (f"{head}; expect MFU {100 * lo:.0f}-{100 * hi:.0f}% = {tlo:,.0f}-{thi:,.0f} tokens/s/GPU, the "
                f"range published frameworks measured on similar layouts ({self.band.sources}; "
                "sources in plan/unmeasured.py)")


def unmeasured(p: Prediction, gpu: GPUSpec) -> Unmeasured | None:
    """None where the prediction is measured ground (another framework's recipe, or a measured profile)."""
    if p.layout.recipe.name != "pentatron" or measured_on(gpu):
        return None
    band = BANDS.get(gpu.name) if compute_dtype(p.layout.precision) in BAND_DTYPES else None
    if band is None or p.rate.mfu <= 0:
        return Unmeasured(gpu.name, band, None, None)
    top = min(p.rate.mfu, band.high)
    mfu = (top * band.low / band.high, top)
    per_mfu = p.rate.tokens_per_s_per_gpu / p.rate.mfu
    return Unmeasured(gpu.name, band, mfu, (mfu[0] * per_mfu, mfu[1] * per_mfu))
