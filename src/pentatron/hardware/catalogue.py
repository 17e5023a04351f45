"""Hardware catalogue: what one accelerator (and its node and network) can do, from datasheets.

All rates are per GPU and per direction, in SI units (FLOP/s, bytes/s, seconds); capacities in bytes.
The trainer uses `detect_gpu(torch.cuda.get_device_name())` and `peak_flops` for MFU; the planner uses
every field. Numbers quoted "dense" are without 2:4 structured sparsity (datasheets usually print the
sparse figure, twice as large). What `pentatron bench` measures on a machine is a separate `Profile`
(hardware/profile.py) a GPUSpec may carry; the time model reads both through `GPUSpec.speeds` (hardware/speeds.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pentatron.hardware.chip_spread import CHIP_SPREAD
from pentatron.hardware.fabric import H100_NDR_ALLREDUCE, FabricCurve
from pentatron.hardware.fp8_rowwise import H100_ROWWISE, SpeedupGrid
from pentatron.hardware.kernel_tables import log_grid_value
from pentatron.hardware.profile import PROFILE_KEYS, PROFILE_SCHEMA, BusBwTable, Profile, interp_log, profile_from_dict
from pentatron.hardware.speeds import Speeds, speeds_for
from pentatron.user_files import read_json, read_toml

__all__ = ["GB", "GiB", "TFLOPS", "US", "BusBwTable", "Efficiency", "GPUSpec", "detect_gpu", "get_gpu",
           "gpu_names", "hardware_from_data", "hardware_from_dict", "interp_log", "load_hardware_toml",
           "with_overrides", "with_profile", "DeviceType"]

DeviceType = Literal["cpu", "cuda"]  # what a plan is for: a CPU (its calibration or profile) or a CUDA GPU

TFLOPS = 1e12
GB = 1e9
GiB = 2**30
US = 1e-6
GEMM_TILE = 128  # output tile edge of tensor-core GEMM kernels (cuBLAS/CUTLASS 128x128 class)


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet peaks real kernels reach (from published micro-benchmarks, see Sources)."""

    # large, well-shaped GEMMs (cuBLAS micro-benchmark, not training runs)
    matmul: float = 0.75
    # link bandwidth NCCL's ring/tree algorithms reach as bus bandwidth (nccl-tests)
    collective: float = 0.80
    # FlashAttention-2 (torch SDPA's flash backend), forward and backward
    attention: tuple[float, float] = (0.70, 0.55)
    # other attention kernels (flash3, cudnn) where the GPU has them: kernel -> (forward, backward)
    attention_kernels: dict[str, tuple[float, float]] = field(default_factory=dict)
    # measured by sequence length (head dim 128): kernel -> (seq lengths, forward, backward fractions of peak),
    # read log-linearly between the points and clamped outside them; beats the scalars above for that kernel
    attention_by_seq: dict[str, tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]] = field(
        default_factory=dict)
    # the kernel torch SDPA dispatches causal bf16 attention to on this GPU (what `pentatron train` runs)
    sdpa_kernel: str = "flash2"
    # Pentatron's own step measured on this GPU against this time model (gpu_check): kernels ("fused" compiled
    # blocks, "eager") -> measured / modelled per-GPU work (the stage phases: what the model does not attribute
    # yet, e.g. the host syncs and launch gaps); empty = not measured, and `plan` labels our recipe unmeasured
    our_step: dict[str, float] = field(default_factory=dict)
    our_step_source: str = ""  # where our_step was measured (a hardware file's own `source` where empty)
    hbm: float = 0.90  # streaming (elementwise) kernels of the HBM bandwidth
    # small-k loss of FP8 (1-byte) and 16-bit GEMMs: x k / (k + k0) (a fixed prologue/epilogue per output
    # tile); 0 = not measured for this GPU
    fp8_gemm_k0: float = 0.0
    gemm_k0: float = 0.0
    # FP8 with row-wise scaling: the measured speedup over bf16 by shape (hardware/fp8_rowwise.py); None = not
    # measured on this GPU, and row-wise FP8 is refused
    fp8_rowwise: SpeedupGrid | None = None
    # the cluster fabric's measured all-reduce by node count and bytes (hardware/fabric.py), used where it
    # applies instead of the link x `collective`; None = link model only. A file setting the network drops it.
    fabric: FabricCurve | None = None
    # sigma of one chip's compute speed around the median chip's (hardware/chip_spread.py): a step on n chips
    # computes at the expected slowest of n; 0 = every chip alike (CPUs)
    chip_spread: float = 0.0


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator model plus the node and network it usually sits in (a datasheet), and optionally
    the profile `pentatron bench` measured on such a machine."""

    name: str
    peak_flops: dict[str, float]  # dtype ("bf16", "fp16", "fp8", "tf32", "fp32") -> dense FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    gpus_per_node: int = 8
    intra_node_bandwidth: float = 0.0  # NVLink, bytes/s per GPU per direction
    inter_node_bandwidth: float = 0.0  # InfiniBand/RoCE, bytes/s per GPU per direction (rail-optimised)
    intra_node_latency: float = 2 * US  # alpha per collective step inside a node
    inter_node_latency: float = 6 * US  # alpha per collective step across nodes
    # Network interface cards per node (each `inter_node_bandwidth * gpus_per_node / nics_per_node`).
    nics_per_node: int = 0  # 0 = one per GPU (rail-optimised DGX/HGX nodes)
    # Streaming multiprocessors: GEMM tiles are spread over them in waves (wave quantisation).
    sm_count: int = 132
    efficiency: Efficiency = field(default_factory=Efficiency)
    profile: Profile | None = None  # measured by `pentatron bench` (hardware/profile.py); None = datasheet only
    source: str = ""
    # The planner's memory margin (`pentatron plan --headroom`), not the device's: a layout fits only if its
    # predicted memory x (1 + headroom) <= hbm_bytes (`plan.search.memory_budget`). 0 outside the plan command.
    headroom: float = 0.0

    @property
    def device_type(self) -> DeviceType:
        """"cpu" for a CPU (the built-in calibration or a CPU `pentatron bench` profile), else "cuda": what
        train.compile's "auto" decides on (config.compile_enabled) and which form of the chunked loss the
        planner's memory counts (plan/loss_memory.py)."""
        return "cpu" if self.name in ("cpu", "bench-cpu") else "cuda"

    @cached_property
    def speeds(self) -> Speeds:
        """The kernel and collective speeds the time model reads (hardware/speeds.py)."""
        return speeds_for(self)

    # the efficiencies under their former names (readers outside the time model)
    @property
    def matmul_efficiency(self) -> float:
        return self.efficiency.matmul

    @property
    def collective_efficiency(self) -> float:
        return self.efficiency.collective

    @property
    def hbm_efficiency(self) -> float:
        return self.efficiency.hbm

    @property
    def fp8_rowwise(self) -> SpeedupGrid | None:
        return self.efficiency.fp8_rowwise

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype` ("bf16", "fp8", ...); KeyError naming what this GPU has."""
        key = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
        if key == "tf32" and key not in self.peak_flops and "fp32" in self.peak_flops:
            key = "fp32"  # no TF32 units (CPUs, bench profiles): fp32 matmuls run at the fp32 rate
        if key not in self.peak_flops:
            raise KeyError(f"{self.name} has no {dtype!r} peak; known: {', '.join(sorted(self.peak_flops))}")
        return self.peak_flops[key]

    def gemm_shape_efficiency(self, m: float, n: float, k: float, operand_bytes: int) -> float:
        """Fraction of the matmul efficiency a GEMM C[m,n] = A[m,k] B[k,n] keeps: wave quantisation of its
        128x128 output tiles over the SMs, times k / (k + k0), the small-k loss of the measured kernels
        (fp8_gemm_k0 for 1-byte operands, gemm_k0 for 2-byte ones)."""
        tiles = math.ceil(m / GEMM_TILE) * math.ceil(n / GEMM_TILE)
        waves = math.ceil(tiles / self.sm_count)
        k0 = {1: self.efficiency.fp8_gemm_k0, 2: self.efficiency.gemm_k0}.get(operand_bytes, 0.0)
        return tiles / (waves * self.sm_count) * (k / (k + k0) if k0 else 1.0)

    def attention(self, kernel: str, seq: float | None = None) -> tuple[float, float]:
        """(forward, backward) fraction of peak of a fused attention kernel at this sequence length (where it
        was measured by length); "sdpa" is the kernel torch SDPA picks on this GPU; a kernel this GPU lacks
        (FlashAttention-3 before Hopper) falls back to FlashAttention-2."""
        eff = self.efficiency
        if kernel == "sdpa":
            kernel = eff.sdpa_kernel
        if kernel != "flash2" and kernel not in eff.attention_kernels and kernel not in eff.attention_by_seq:
            kernel = "flash2"
        if seq and (curve := eff.attention_by_seq.get(kernel)):
            seqs, fwd, bwd = curve
            return log_grid_value(fwd, ((seqs, seq),)), log_grid_value(bwd, ((seqs, seq),))
        return eff.attention if kernel == "flash2" else eff.attention_kernels.get(kernel, eff.attention)

    def sharing(self, ranks: int) -> GPUSpec:
        """This device as each of `ranks` processes on one node sees it when all of them compute at once
        (the profile's `node_slowdown`, measured with gpus_per_node processes; linear in the other busy
        processes in between): compute rates divided, host times multiplied (`Profile.shared`)."""
        prof = self.profile
        if prof is None or not prof.node_slowdown or ranks <= 1 or self.gpus_per_node <= 1:
            return self
        share = (min(ranks, self.gpus_per_node) - 1) / (self.gpus_per_node - 1)
        mm, st, host = (1 + (prof.node_slowdown.get(k, 1.0) - 1) * share for k in ("matmul", "stream", "host"))
        return replace(self, peak_flops={k: v / mm for k, v in self.peak_flops.items()},
                       hbm_bandwidth=self.hbm_bandwidth / st, profile=prof.shared(mm, st, host))

    @property
    def nics(self) -> int:
        return self.nics_per_node or self.gpus_per_node

    def problems(self) -> list[str]:
        out = []
        if not self.peak_flops or any(not (v > 0) for v in self.peak_flops.values()):
            out.append(f"hardware {self.name!r}: peak_flops must be positive numbers, got {self.peak_flops}")
        for f in ("hbm_bytes", "hbm_bandwidth", "gpus_per_node", "intra_node_bandwidth",
                  "inter_node_bandwidth"):
            v = getattr(self, f)
            if not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                out.append(f"hardware {self.name!r}: {f} must be > 0, got {v!r}")
        eff = self.efficiency
        for f, v in (("matmul_efficiency", eff.matmul), ("collective_efficiency", eff.collective),
                     ("hbm_efficiency", eff.hbm)):
            if not 0 < v <= 1:
                out.append(f"hardware {self.name!r}: {f} must be in (0, 1], got {v!r}")
        if not all(0 < x <= 1 for x in eff.attention):
            out.append(f"hardware {self.name!r}: attention_efficiency must be in (0, 1], got {eff.attention}")
        if self.sm_count < 1:
            out.append(f"hardware {self.name!r}: sm_count must be >= 1, got {self.sm_count}")
        return out


_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                  "float8": "fp8", "float8_e4m3fn": "fp8"}


# Sources (all per GPU, dense):
#  A100: NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 312 TF, TF32 156 TF, FP32 19.5 TF;
#        HBM2 40 GB @ 1,555 GB/s, HBM2e 80 GB @ 2,039 GB/s; NVLink3 600 GB/s total (300 each way).
#        DGX A100 user guide: 8x ConnectX-6 200 Gb/s HDR for compute -> 25 GB/s per GPU.
#  H100 SXM5: NVIDIA H100 datasheet (2023): BF16 989.4 TF, FP8 1,978.9 TF, TF32 494.7 TF, FP32 66.9 TF;
#        HBM3 80 GB @ 3.35 TB/s; NVLink4 900 GB/s total. DGX H100: 8x ConnectX-7 400 Gb/s NDR -> 50 GB/s.
#  H200 SXM: NVIDIA H200 datasheet (2024): compute as H100 SXM; HBM3e 141 GB @ 4.8 TB/s; NVLink4 900 GB/s.
#  B200: NVIDIA DGX B200 datasheet (2024) / HGX B200 spec: FP8 4.5 PF, BF16 2.25 PF, TF32 1.1 PF dense,
#        FP32 ~75 TF; HBM3e 180 GB @ 8 TB/s; NVLink5 1.8 TB/s total; 8x ConnectX-7 400 Gb/s per node.
#  Latencies: nccl-tests small-message all_reduce on 8-GPU NVLink nodes (~10-20 us for ~14 ring steps ->
#        ~1-2 us per step); IB hop ~5-6 us with NCCL protocol overhead.
#  matmul_efficiency: the rate of one large, fully-waved GEMM as a run meets it (random-valued operands, the
#        timed mean), before the shape terms below.
#        A100: 0.825 = 257 TFLOP/s / 312 / 0.998 (this model's wave quantisation at that shape): cuBLAS
#        bf16 8192x8192x8192 with torch.randn operands on an A100 (400 W), H. He, "Strangely, Matrix
#        Multiplications on GPUs Run Faster When Given 'Predictable' Data!" (2024),
#        https://www.thonking.ai/p/strangely-matrix-multiplications (the same GEMM reaches 295 TFLOP/s on
#        zeros: the randn rate is power-limited). It replaces the former 0.87, the "maximum achievable
#        matmul FLOPS" (S. Bekman, ml-engineering, compute/accelerator/README.md, MAMF table: A100 SXM
#        267.9 TF = 85.9 %), which is the best shape of a brute-force sweep and the fastest of 100
#        iterations, so an upper bound rather than a run's rate (its README: "chances are close to 0 that
#        you will ever hit that exact shape").
#        H100 SXM: 0.80 (MAMF 792.1 TF = 80.1 %); with gemm_k0 below and this model's wave quantisation it
#        sits within 1.5 % of the tile-lang M=N=8192 K-sweep (K = 1024..16384), a timed sweep of ordinary
#        shapes, so it is kept. B200: carried over from H100 until measured.
#  collective_efficiency: nccl-tests all_reduce bus bandwidth ~ 80% of NVLink/IB line rate at >=256 MB.
#  fabric (H100 SXM, H200): cross-node all-reduce over all 8 GPUs of each node, NCCL bus bandwidth by node
#        count (4..1024) and bytes (1 MiB..16 GiB), NVIDIA GTC 2024 S62129 slide 35 (NVLSTree, 32 to 8K GPUs,
#        8 x 400 Gb/s per node; hardware/fabric.py has the readings): 365-379 GB/s at >= 4 GiB on every node
#        count (the link model's 8 x 50 x 0.80 = 320), 276 GB/s at 128 MiB on 4 nodes and 157 on 1024 (the
#        link model with NCCL's tree latency: ~300 and ~270). Replaces the link model only for what was
#        measured; other groups and collectives keep it. The H200 has the same NICs (taken alike, inferred).
#        A100 (8 x 200 Gb/s HDR): only one published point was found, 192 GB/s at 32 GPUs (GTC 2025 S72583
#        slide 12, "NVL3 + 8x 200Gb RDMA (DGX A100)"), no node-count curve: not applied.
#  sm_count: A100 108, H100 SXM/H200 132 (NVIDIA Hopper/Ampere whitepapers), B200 148 (2 dies x 74).
#  attention_efficiency (FlashAttention-2, torch SDPA's flash backend): Dao 2023 (arXiv:2307.08691):
#        A100 fwd up to 73%, bwd up to 63% of peak. flash3 on H100: fwd ~740 TF (75%), bwd ~60% (Shah et al.
#        2024, FlashAttention-3, arXiv:2407.08608). B200: the H100's former datasheet-era figures (FA2 ~35 %
#        fwd by the FA3 paper's abstract, bwd at FA2's A100 ratio: 0.30; cuDNN taken equal to FA3), unmeasured.
#  attention_by_seq (H100 SXM, H200): measured on one H200 SXM (700 W, torch 2.11.0+cu130, 2026-12-04,
#        `python benchmarks/gpu_check.py`, part kernel_rates; BENCHMARKS.md "GPU device check"): causal GQA
#        attention through torch SDPA, bf16, 32 query / 8 kv heads, head dim 128, batch x seq = 16384 tokens,
#        random operands, CUDA events; FLOPs counted as the planner does (4·h·d·b·s·(s+1)/2 forward, 2.5x
#        backward) over the dense bf16 peak 989.4 TF. At seq 2048 / 4096 / 8192:
#          FLASH_ATTENTION (FlashAttention-2): fwd 0.298 / 0.313 / 0.302, bwd 0.204 / 0.237 / 0.287
#          CUDNN_ATTENTION:                    fwd 0.552 / 0.570 / 0.616, bwd 0.354 / 0.410 / 0.460
#        (the 16-head 1B shape at 4096 and the 64-head 70B shape at 8192 read within 4 % of these). The
#        H100 SXM has the same SM90 die, clocks and power limit: taken alike (inferred).
#  our_step (H100 SXM, H200): `benchmarks/gpu_check.py` on that H200 (2026-12-04), parts train and compile: 1-GPU
#        bf16 training of a 0.89B Llama (16 layers, h 2048, 2 micro-batches of 4 x 4096 tokens), step 0.3925 s with
#        compiled blocks and 0.5127 s eager, where this model gives stage phases of 0.3486 s / 0.4224 s and an
#        optimizer of 0.0070 s: (measured - optimizer) / phases = 1.106 (fused), 1.197 (eager). Checked on a
#        run not used for it: the fp8 part's bf16 run (h 4096, 4 layers, eager) measured 0.1305 s, 1.05x the
#        calibrated model (1.24x without). The H100 SXM is taken alike (same die; inferred).
#  sdpa_kernel: on the H200 torch 2.11's SDPA ran cuDNN's kernels for `pentatron train`'s attention (gpu_check
#        part sdpa_backend: cudnn_generated_fort_native_sdpa_sm90_flash_fprop/bprop); before Hopper, flash.
#  fp8_gemm_k0 (Hopper): FP8 GEMM M=N=8192 sweep over K on an H800 SXM (the H100 SXM's compute die;
#        tile-lang repository, benchmark/matmul_fp8/README.md): 569, 858, 1129, 1343, 1467, 1507, 1541
#        TFLOP/s at K = 256 .. 16384. The ratio of the K=16384 and K=1024 points gives k0 = 409 (k/(k + k0)
#        scaled to the large-K rate also matches K=2048..8192 within 3%); with our 0.80 matmul_efficiency
#        and H100 wave quantisation the model sits 2-5% under the sweep.
#  gemm_k0 (Hopper, bf16/fp16): the same sweep for FP16 (tile-lang benchmark/matmul/README.md, H800 SXM, M=N=8192):
#        386, 520, 628, 705, 736, 758, 766 TFLOP/s at K = 256 .. 16384; the K=16384/K=1024 ratio gives k0 = 244,
#        which reproduces K = 2048, 4096, 8192 within 1.5 % (K = 256 within 3 %). Ampere and Blackwell: not
#        measured here, k0 = 0.
#  fp8_rowwise (H100, H200): torchao's row-wise FP8 block speedup table measured on an H100 (hardware/fp8_rowwise.py);
#        the H200 has the same SM90 die and the same CUTLASS kernel, so the H100's ratios are used there.
#  chip_spread (every datasheet GPU): 1.48 % of the median chip's speed, from Sinha et al. SC22's 8 % average
#        spread between same-SKU GPUs of five clusters (hardware/chip_spread.py); a step on n GPUs computes at
#        the expected slowest of n. V100/MI60-era measurements, taken to hold for A100, Hopper, Blackwell.
#  hbm_efficiency: streaming kernels reach ~90% of nominal HBM bandwidth (BabelStream copy/triad on
#        A100 and H100, Deakin et al.); applied to elementwise traffic, not to GEMM/attention roofs.
#  HBM capacity is the nominal GiB; torch reports slightly less (e.g. 79.1 GiB on an H100 80GB).
_A100_EFF = Efficiency(matmul=0.825, attention=(0.73, 0.63), chip_spread=CHIP_SPREAD)
_HOPPER_ATTENTION = {"flash2": ((2048, 4096, 8192), (0.298, 0.313, 0.302), (0.204, 0.237, 0.287)),
                     "cudnn": ((2048, 4096, 8192), (0.552, 0.570, 0.616), (0.354, 0.410, 0.460))}
_HOPPER_EFF = Efficiency(matmul=0.80, attention=(0.30, 0.24), attention_by_seq=_HOPPER_ATTENTION, sdpa_kernel="cudnn",
                         our_step={"fused": 1.106, "eager": 1.197},
                         our_step_source="benchmarks/gpu_check.py on one H200 SXM, 2026-12-04; the H100 SXM "
                                         "taken alike",
                         attention_kernels={"flash3": (0.75, 0.60), "cudnn": (0.58, 0.41)},
                         fp8_gemm_k0=409.0, gemm_k0=244.0, fp8_rowwise=H100_ROWWISE, fabric=H100_NDR_ALLREDUCE,
                         chip_spread=CHIP_SPREAD)
_B200_EFF = Efficiency(matmul=0.80, attention=(0.35, 0.30),
                       attention_kernels={"flash3": (0.75, 0.60), "cudnn": (0.75, 0.60)}, chip_spread=CHIP_SPREAD)
_CATALOGUE: dict[str, GPUSpec] = {
    "a100-40gb": GPUSpec(
        name="a100-40gb",
        peak_flops={"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS},
        hbm_bytes=40 * GiB, hbm_bandwidth=1555 * GB, gpus_per_node=8,
        intra_node_bandwidth=300 * GB, inter_node_bandwidth=25 * GB,
        intra_node_latency=2 * US, inter_node_latency=6 * US, sm_count=108, efficiency=_A100_EFF,
        source="NVIDIA A100 datasheet; DGX A100 user guide"),
    "a100-80gb": GPUSpec(
        name="a100-80gb",
        peak_flops={"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS},
        hbm_bytes=80 * GiB, hbm_bandwidth=2039 * GB, gpus_per_node=8,
        intra_node_bandwidth=300 * GB, inter_node_bandwidth=25 * GB,
        intra_node_latency=2 * US, inter_node_latency=6 * US, sm_count=108, efficiency=_A100_EFF,
        source="NVIDIA A100 datasheet; DGX A100 user guide"),
    "h100-sxm": GPUSpec(
        name="h100-sxm",
        peak_flops={"bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "fp8": 1978.9 * TFLOPS,
                    "tf32": 494.7 * TFLOPS, "fp32": 66.9 * TFLOPS},
        hbm_bytes=80 * GiB, hbm_bandwidth=3350 * GB, gpus_per_node=8,
        intra_node_bandwidth=450 * GB, inter_node_bandwidth=50 * GB,
        intra_node_latency=2 * US, inter_node_latency=6 * US, sm_count=132, efficiency=_HOPPER_EFF,
        source="NVIDIA H100 datasheet; DGX H100 user guide"),
    "h200": GPUSpec(
        name="h200",
        peak_flops={"bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "fp8": 1978.9 * TFLOPS,
                    "tf32": 494.7 * TFLOPS, "fp32": 66.9 * TFLOPS},
        hbm_bytes=141 * GiB, hbm_bandwidth=4800 * GB, gpus_per_node=8,
        intra_node_bandwidth=450 * GB, inter_node_bandwidth=50 * GB,
        intra_node_latency=2 * US, inter_node_latency=6 * US, sm_count=132, efficiency=_HOPPER_EFF,
        source="NVIDIA H200 datasheet; DGX H200 user guide"),
    "b200": GPUSpec(
        name="b200",
        peak_flops={"bf16": 2250 * TFLOPS, "fp16": 2250 * TFLOPS, "fp8": 4500 * TFLOPS,
                    "tf32": 1100 * TFLOPS, "fp32": 75 * TFLOPS},
        hbm_bytes=180 * GiB, hbm_bandwidth=8000 * GB, gpus_per_node=8,
        intra_node_bandwidth=900 * GB, inter_node_bandwidth=50 * GB,
        intra_node_latency=2 * US, inter_node_latency=6 * US, sm_count=148, efficiency=_B200_EFF,
        source="NVIDIA DGX B200 datasheet; HGX B200 specification"),
}

_ALIASES = {"a100": "a100-80gb", "a100-40": "a100-40gb", "a100-80": "a100-80gb", "h100": "h100-sxm",
            "h100-80gb": "h100-sxm", "h100-sxm5": "h100-sxm", "h200-sxm": "h200", "b200-sxm": "b200"}


def gpu_names() -> list[str]:
    """Catalogue names (aliases such as "h100" are accepted by `get_gpu` too)."""
    return sorted(_CATALOGUE)


def get_gpu(name: str) -> GPUSpec:
    """The catalogue entry for `name` (case-insensitive, aliases allowed); KeyError listing known names."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _CATALOGUE:
        raise KeyError(f"unknown GPU {name!r}; known GPUs: {', '.join(gpu_names() + sorted(_ALIASES))}")
    return _CATALOGUE[key]


def detect_gpu(device_name: str) -> GPUSpec | None:
    """Map a `torch.cuda.get_device_name()` string to the catalogue, or None when unknown.

    Variants with different clocks or memory (H100 PCIe/NVL, GH200) return None rather than a wrong peak,
    so MFU is not silently misreported.
    """
    s = device_name.lower()
    if re.search(r"\bgh200\b|\bgb200\b", s):
        return None
    if re.search(r"\bb200\b", s):
        return _CATALOGUE["b200"]
    if re.search(r"\bh200\b", s):
        return _CATALOGUE["h200"]
    if re.search(r"\bh100\b", s):
        if "pcie" in s or "nvl" in s:
            return None
        return _CATALOGUE["h100-sxm"]
    if re.search(r"\ba100\b", s):
        if "pcie" in s:
            return None
        return _CATALOGUE["a100-80gb" if "80gb" in s else "a100-40gb"]
    return None



# ---- user-defined hardware (TOML) ----
# Human units in the file; converted to SI on load. A `base` key starts from a catalogue entry.
# file key -> (GPUSpec field, scale)
_DATASHEET_SCALARS: dict[str, tuple[str, float]] = {
    "hbm_gib": ("hbm_bytes", GiB),
    "hbm_bandwidth_gb_s": ("hbm_bandwidth", GB),
    "gpus_per_node": ("gpus_per_node", 1),
    "intra_node_bandwidth_gb_s": ("intra_node_bandwidth", GB),
    "inter_node_bandwidth_gb_s": ("inter_node_bandwidth", GB),
    "intra_node_latency_us": ("intra_node_latency", US),
    "inter_node_latency_us": ("inter_node_latency", US),
    "sm_count": ("sm_count", 1),
    "nics_per_node": ("nics_per_node", 1),
}
_NETWORK_KEYS = frozenset({"gpus_per_node", "inter_node_bandwidth_gb_s", "inter_node_latency_us", "nics_per_node"})
_INTEGRAL = frozenset({"hbm_bytes", "gpus_per_node", "sm_count", "nics_per_node"})
# file key -> Efficiency field
_EFFICIENCY_SCALARS = {"matmul_efficiency": "matmul", "collective_efficiency": "collective",
                       "hbm_efficiency": "hbm", "fp8_gemm_k0": "fp8_gemm_k0", "gemm_k0": "gemm_k0",
                       "chip_spread": "chip_spread"}
_META_KEYS = frozenset({"base", "name", "source", "measured"})  # `measured`: free-form bench metadata


def _number(d: dict[str, Any], key: str, where: str, problems: list[str]) -> float | None:
    v = d[key]
    if not isinstance(v, int | float) or isinstance(v, bool):
        problems.append(f"{where}: {key} must be a number, got {v!r}")
        return None
    return v


def _base(d: dict[str, Any], where: str, problems: list[str]) -> dict[str, Any]:
    """The fields of the catalogue entry named by `base` (none without one)."""
    if d.get("base") is None:
        return {}
    try:
        gpu = get_gpu(str(d["base"]))
    except KeyError as e:
        problems.append(f"{where}: base: {e.args[0]}")
        return {}
    return {f.name: getattr(gpu, f.name) for f in fields(GPUSpec)}


def _peak(d: dict[str, Any], where: str, problems: list[str]) -> dict[str, Any]:
    peak = d.get("peak_tflops")
    if peak is None:
        return {}
    if not isinstance(peak, dict):
        problems.append(f"{where}: peak_tflops must be a table like {{ bf16 = 989 }}")
        return {}
    return {"peak_flops": {_DTYPE_ALIASES.get(k.lower(), k.lower()): float(v) * TFLOPS for k, v in peak.items()}}


def _datasheet_scalars(d: dict[str, Any], where: str, problems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, (attr, scale) in _DATASHEET_SCALARS.items():
        if key in d and (v := _number(d, key, where, problems)) is not None:
            out[attr] = int(v * scale) if attr in _INTEGRAL else float(v * scale)
    return out


def _efficiency(d: dict[str, Any], base: Efficiency, where: str, problems: list[str]) -> Efficiency:
    kw: dict[str, Any] = {}
    for key, attr in _EFFICIENCY_SCALARS.items():
        if key in d and (v := _number(d, key, where, problems)) is not None:
            kw[attr] = float(v)
    ae = d.get("attention_efficiency")
    if ae is not None:
        if not (isinstance(ae, list) and len(ae) == 2 and all(isinstance(x, int | float) for x in ae)):
            problems.append(f"{where}: attention_efficiency must be [forward, backward] fractions")
        else:
            kw["attention"] = (float(ae[0]), float(ae[1]))
            # the given FlashAttention-2 fractions replace its measured curve
            kw["attention_by_seq"] = {k: v for k, v in base.attention_by_seq.items() if k != "flash2"}
    if "attention_by_seq" in d:
        kw["attention_by_seq"] = {**kw.get("attention_by_seq", base.attention_by_seq),
                                  **_attention_curves(d["attention_by_seq"], where, problems)}
    if (sk := d.get("sdpa_kernel")) is not None:
        if sk not in ATTENTION_KERNELS:
            problems.append(f"{where}: sdpa_kernel must be one of {', '.join(ATTENTION_KERNELS)}, got {sk!r}")
        else:
            kw["sdpa_kernel"] = sk
    if not 0.0 <= kw.get("chip_spread", 0.0) < 0.2:
        problems.append(f"{where}: chip_spread must be in [0, 0.2): the spread of one chip's speed around the "
                        f"median chip's, as a fraction (the catalogue's is {CHIP_SPREAD:.4f}), got {kw['chip_spread']}")
    if (ours := d.get("our_step")) is not None:
        if not (isinstance(ours, dict) and set(ours) <= {"fused", "eager"}
                and all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in ours.values())):
            problems.append(f"{where}: our_step must be a table like {{ fused = 1.1, eager = 1.2 }} (positive)")
        else:
            kw["our_step"], kw["our_step_source"] = {k: float(v) for k, v in ours.items()}, ""
    return replace(base, **kw) if kw else base


ATTENTION_KERNELS = ("flash2", "flash3", "cudnn")


def _attention_curves(t: Any, where: str, problems: list[str]) -> dict[str, tuple[tuple[float, ...], ...]]:
    """[attention_by_seq.KERNEL] tables: seq (increasing), forward and backward fractions in (0, 1]."""
    if not isinstance(t, dict):
        problems.append(f"{where}: attention_by_seq must hold tables like [attention_by_seq.cudnn]")
        return {}
    out: dict[str, tuple[tuple[float, ...], ...]] = {}
    for kernel, c in t.items():
        cols = _number_lists(c, ("seq", "forward", "backward"))
        if (kernel not in ATTENTION_KERNELS or cols is None or any(a >= b for a, b in zip(cols[0], cols[0][1:]))
                or not all(0 < v <= 1 for col in cols[1:] for v in col)):
            problems.append(f"{where}: attention_by_seq.{kernel} must give a kernel of {', '.join(ATTENTION_KERNELS)} "
                            "equal-length lists seq (increasing), forward and backward (fractions in (0, 1])")
            continue
        out[kernel] = cols
    return out


def _number_lists(t: Any, keys: tuple[str, ...]) -> tuple[tuple[float, ...], ...] | None:
    """The lists under `keys` of table `t` as floats, when each is a non-empty list of numbers of one length."""
    if not isinstance(t, dict):
        return None
    cols = [t.get(k) for k in keys]
    if not all(isinstance(c, list) and c and all(isinstance(v, int | float) and not isinstance(v, bool) for v in c)
               for c in cols) or len({len(c) for c in cols}) != 1:
        return None
    return tuple(tuple(float(v) for v in c) for c in cols)


def hardware_from_dict(d: dict[str, Any], where: str = "hardware", profile: dict[str, Any] | None = None
                       ) -> GPUSpec:
    """A GPUSpec from the TOML layout in docs/planner.md; the measured keys (`profile.PROFILE_KEYS`) may sit
    in `d` itself or apart in `profile`. ValueError listing every problem at once."""
    problems: list[str] = []
    measured = {**{k: v for k, v in d.items() if k in PROFILE_KEYS}, **(profile or {})}
    known = PROFILE_KEYS | _META_KEYS | set(_DATASHEET_SCALARS) | set(_EFFICIENCY_SCALARS) \
        | {"peak_tflops", "attention_efficiency", "attention_by_seq", "sdpa_kernel", "our_step"}
    kw = _base(d, where, problems)
    kw["name"] = str(d.get("name", kw.get("name", "custom")))
    kw["source"] = str(d.get("source", kw.get("source", "user TOML")))
    kw.update(_peak(d, where, problems))
    kw.update(_datasheet_scalars(d, where, problems))
    kw["efficiency"] = _efficiency(d, kw.get("efficiency", Efficiency()), where, problems)
    if _NETWORK_KEYS & set(d):  # another network than the one the base's fabric curve was measured on
        kw["efficiency"] = replace(kw["efficiency"], fabric=None)
    kw["profile"] = profile_from_dict(measured, where, problems)
    unknown = sorted(set(d) - known) + sorted(set(profile or {}) - PROFILE_KEYS)
    if unknown:
        problems.append(f"{where}: unknown key(s): {', '.join(unknown)}")
    for req in ("peak_flops", "hbm_bytes", "hbm_bandwidth"):
        if req not in kw:
            problems.append(f"{where}: missing {req} (or give base = \"h100\" to start from the catalogue)")
    if problems:
        raise ValueError("; ".join(problems))
    spec = GPUSpec(**kw)
    if spec.problems():
        raise ValueError("; ".join(spec.problems()))
    return spec


def hardware_from_data(data: dict[str, Any], where: str) -> GPUSpec:
    """A parsed hardware or profile file: a profile (`schema = "pentatron.profile/1"`, [hardware] and
    [profile] tables), or hardware keys at the top level or under [gpu] (older profiles mix both there)."""
    if "schema" in data:
        if data["schema"] != PROFILE_SCHEMA:
            raise ValueError(f"{where}: schema {data['schema']!r} is not {PROFILE_SCHEMA!r} (re-run pentatron bench)")
        extra = sorted(set(data) - {"schema", "hardware", "profile", "measured"})
        hw, prof = data.get("hardware"), data.get("profile", {})
        if extra or not isinstance(hw, dict) or not isinstance(prof, dict):
            raise ValueError(f"{where}: a profile holds tables [hardware] and [profile] (and [measured])"
                             + (f"; unknown key(s): {', '.join(extra)}" if extra else ""))
        return hardware_from_dict(hw, where=where, profile=prof)
    if "gpu" in data and isinstance(data["gpu"], dict):
        data = data["gpu"]
    return hardware_from_dict(data, where=where)


def load_hardware_toml(path: str | Path) -> GPUSpec:
    """Load user-defined hardware or a `pentatron bench` profile (TOML, or JSON by its suffix)."""
    p = Path(path)
    # missing, unreadable, not UTF-8, not JSON/TOML: an UnreadableFile, a ValueError naming the file
    data = read_json(p, "hardware file") if p.suffix == ".json" else read_toml(p, "hardware file")
    return hardware_from_data(data, where=str(p))


def with_overrides(spec: GPUSpec, **kw: Any) -> GPUSpec:
    """A copy with some fields changed (e.g. gpus_per_node for a different node size)."""
    return replace(spec, **kw)


def with_profile(spec: GPUSpec, **kw: Any) -> GPUSpec:
    """A copy whose profile has some curves set (`Profile` fields), starting from its own or an empty one."""
    return replace(spec, profile=replace(spec.profile or Profile(), **kw))
