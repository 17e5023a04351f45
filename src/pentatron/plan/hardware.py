"""Hardware catalogue: what one accelerator (and its node and network) can do, from datasheets or bench.

All rates are per GPU and per direction, in SI units (FLOP/s, bytes/s, seconds); capacities in bytes.
The trainer uses `detect_gpu(torch.cuda.get_device_name())` and `peak_flops` for MFU; the planner uses
every field. Numbers quoted "dense" are without 2:4 structured sparsity (datasheets usually print the
sparse figure, twice as large).
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pentatron.plan.fp8_rowwise import H100_ROWWISE, SpeedupGrid
from pentatron.plan.kernel_tables import AttentionGrid, parse_attention_grid

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - 3.10 fallback
    import tomli as tomllib  # type: ignore[no-redef]

TFLOPS = 1e12
GB = 1e9
GiB = 2**30
US = 1e-6
GEMM_TILE = 128  # output tile edge of tensor-core GEMM kernels (cuBLAS/CUTLASS 128x128 class)

# Collective name -> ((message bytes, bus bandwidth B/s), ...) measured by `pentatron bench`.
BusBwTable = dict[str, tuple[tuple[float, float], ...]]


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator model plus the node and network it usually sits in."""

    name: str
    peak_flops: dict[str, float]  # dtype ("bf16", "fp16", "fp8", "tf32", "fp32") -> dense FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    gpus_per_node: int = 8
    intra_node_bandwidth: float = 0.0  # NVLink, bytes/s per GPU per direction
    inter_node_bandwidth: float = 0.0  # InfiniBand/RoCE, bytes/s per GPU per direction (rail-optimised)
    intra_node_latency: float = 2 * US  # alpha per collective step inside a node
    inter_node_latency: float = 6 * US  # alpha per collective step across nodes
    # Fraction of peak that large, well-shaped GEMMs reach (cuBLAS micro-benchmark, not training runs).
    matmul_efficiency: float = 0.75
    # Fraction of link bandwidth NCCL's ring/tree algorithms reach as bus bandwidth (nccl-tests).
    collective_efficiency: float = 0.80
    # Streaming multiprocessors: GEMM tiles are spread over them in waves (wave quantisation).
    sm_count: int = 132
    # Fraction of peak FlashAttention-2 (torch SDPA's flash backend) reaches, forward and backward.
    attention_efficiency: tuple[float, float] = (0.70, 0.55)
    # Other attention kernels (flash3, cudnn) where the GPU has them: kernel -> (forward, backward).
    attention_kernels: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Fraction of HBM bandwidth streaming (elementwise) kernels reach.
    hbm_efficiency: float = 0.90
    # FP8 GEMMs lose throughput at small k (a fixed prologue/epilogue per output tile): efficiency x
    # k / (k + fp8_gemm_k0); 0 = not measured for this GPU
    fp8_gemm_k0: float = 0.0
    # The same small-k loss of 16-bit (bf16/fp16) GEMMs: efficiency x k / (k + gemm_k0); 0 = not measured
    gemm_k0: float = 0.0
    # FP8 with row-wise scaling: the measured speedup over bf16 by shape (plan/fp8_rowwise.py); None = not
    # measured on this GPU, and row-wise FP8 is refused
    fp8_rowwise: SpeedupGrid | None = None
    # Network interface cards per node (each `inter_node_bandwidth * gpus_per_node / nics_per_node`).
    nics_per_node: int = 0  # 0 = one per GPU (rail-optimised DGX/HGX nodes)
    # Optional measured bus-bandwidth curves (from `pentatron bench`), replacing the link model above.
    measured_busbw: BusBwTable = field(default_factory=dict)
    # Optional, measured on the cluster: ((nodes, bus bandwidth B/s), ...) of an all-reduce over every GPU
    # of that many nodes. It caps the bus bandwidth of any all-reduce spanning that many nodes: when all
    # GPUs reduce at once (data parallelism) the fabric carries no more, whichever ranks a group holds.
    # Empty: the link model alone (a non-blocking fabric).
    allreduce_busbw_by_nodes: tuple[tuple[float, float], ...] = ()
    # Optional measured copy bandwidth (read + write, B/s) by buffer size (from `pentatron bench`): on a
    # CPU small tensors stay in the caches, so elementwise ops run far above the large-buffer rate
    measured_copy_bw: tuple[tuple[float, float], ...] = ()
    # Optional measured fp32 matmul FLOP/s by the FLOPs of one call (bench, CPU): small GEMMs run far
    # below the large-matrix rate; the per-call cost is included
    measured_matmul_fp32: tuple[tuple[float, float], ...] = ()
    # Optional (bench, CPU; cpu_kernels.measure_head_curve): an LM head's GEMMs, whose wide output off a
    # narrow input runs below the square curve: (FLOPs of one call, forward, dX, dW FLOP/s) by FLOPs
    measured_head_fp32: tuple[tuple[float, float, float, float], ...] = ()
    # Optional measured host seconds per micro-batch outside the arithmetic (bench, CPU: eager op
    # dispatch and autograd, serial with compute there): per decoder layer and for embedding + head +
    # loss, forward and backward; 0 on GPUs, where launches overlap the kernels (KERNEL_OVERHEAD)
    host_layer_s: tuple[float, float] = (0.0, 0.0)
    host_ends_s: tuple[float, float] = (0.0, 0.0)
    host_optimizer_per_tensor_s: float = 0.0  # optimizer step (norm, clip, AdamW) per parameter tensor
    # Optional CPU kernels measured as a step runs them (calibrate/cpu_kernels.py: operands out of the L2, outputs
    # kept alive): an out-of-place elementwise op's bytes/s by operand size (reads + write), causal
    # attention FLOP/s by (seq, head dim), and the optimizer step's seconds per parameter element.
    # Absent on GPUs: the paths above apply there.
    measured_stream_bw: tuple[tuple[float, float], ...] = ()
    measured_attention_fp32: AttentionGrid | None = None
    optimizer_per_element_s: float = 0.0
    # Optional (bench, CPU): how much slower each process computes when every process of the node
    # computes at once (cores sharing execution units, caches, memory bandwidth), by kind of work:
    # {"matmul", "stream", "host"} -> factor >= 1. GPUs compute independently: empty.
    node_slowdown: dict[str, float] = field(default_factory=dict)
    # Optional (bench, CPU, >= 2 processes; calibrate/tp_step.py): the tensor-parallel step as its ranks run it,
    # measured with every process busy (so `sharing` leaves it alone): host seconds per TP decoder layer
    # and for the vocab-parallel ends (embedding, head, loss) outside the collectives, forward and
    # backward, replacing host_layer_s / host_ends_s when tp > 1; and the seconds of one tp all-reduce as
    # the step experiences it (latency, the ranks arriving apart) by activation bytes, which replaces
    # the measured curve for tp collectives (comm.in_step_time). Empty: not measured.
    host_tp_layer_s: tuple[float, float] = (0.0, 0.0)
    host_tp_ends_s: tuple[float, float] = (0.0, 0.0)
    tp_collective: tuple[tuple[float, float], ...] = ()  # ((bytes, seconds), ...) by bytes
    # Optional (bench, CPU, >= 2 processes; calibrate/dp_step.py): the data-parallel step's synchronisations as its
    # ranks meet them: the gradient all-reduce after a backward's compute by bytes (replacing the
    # measured curve for the per-step gradient collectives, comm.dp_in_step_time), and one scalar
    # all-reduce right after it (each of the trainer's per-step scalars, comm.scalar_time). Empty: not
    # measured.
    dp_collective: tuple[tuple[float, float], ...] = ()  # ((bytes, seconds), ...) by bytes
    scalar_collective_s: float = 0.0
    # Optional (bench, CPU, an even number >= 2 of processes; calibrate/pp_step.py): the pipeline's hop between
    # two stages as a step meets it, both neighbours computing, then swapping a message: by message
    # bytes, replacing the ping-pong curve for pipeline sends (comm.pp_hop_time). Empty: not measured.
    pp_hop: tuple[tuple[float, float], ...] = ()  # ((bytes, seconds), ...) by bytes
    source: str = ""

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype` ("bf16", "fp8", ...); KeyError naming what this GPU has."""
        key = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
        if key == "tf32" and key not in self.peak_flops and "fp32" in self.peak_flops:
            key = "fp32"  # no TF32 units (CPUs, bench profiles): fp32 matmuls run at the fp32 rate
        if key not in self.peak_flops:
            raise KeyError(f"{self.name} has no {dtype!r} peak; known: {', '.join(sorted(self.peak_flops))}")
        return self.peak_flops[key]

    def gemm_shape_efficiency(self, m: float, n: float, k: float, operand_bytes: int) -> float:
        """Fraction of `matmul_efficiency` a GEMM C[m,n] = A[m,k] B[k,n] keeps: wave quantisation of its
        128x128 output tiles over the SMs, times k / (k + k0), the small-k loss of the measured kernels
        (fp8_gemm_k0 for 1-byte operands, gemm_k0 for 2-byte ones)."""
        tiles = math.ceil(m / GEMM_TILE) * math.ceil(n / GEMM_TILE)
        waves = math.ceil(tiles / self.sm_count)
        k0 = {1: self.fp8_gemm_k0, 2: self.gemm_k0}.get(operand_bytes, 0.0)
        return tiles / (waves * self.sm_count) * (k / (k + k0) if k0 else 1.0)

    def attention(self, kernel: str) -> tuple[float, float]:
        """(forward, backward) fraction of peak of a fused attention kernel; a kernel this GPU lacks
        (FlashAttention-3 before Hopper) falls back to FlashAttention-2."""
        if kernel == "flash2":
            return self.attention_efficiency
        return self.attention_kernels.get(kernel, self.attention_efficiency)

    def stream_bandwidth(self, nbytes: float, efficiency: bool = True) -> float:
        """Bytes/s a memory-bound kernel streaming a working set of `nbytes` reaches: the measured copy
        curve at that size when bench provided one (it includes the per-op cost a small copy pays),
        else the nominal HBM bandwidth (times `hbm_efficiency` unless `efficiency=False`)."""
        if self.measured_copy_bw:
            return interp_log(self.measured_copy_bw, nbytes)
        return self.hbm_bandwidth * (self.hbm_efficiency if efficiency else 1.0)

    def op_bandwidth(self, operand_bytes: float, working_set: float, efficiency: bool = True) -> float:
        """Bytes/s of an eager elementwise op on operands of `operand_bytes` inside a step: bench's
        in-step curve when measured, else `stream_bandwidth(working_set)`."""
        if self.measured_stream_bw:
            return interp_log(self.measured_stream_bw, operand_bytes)
        return self.stream_bandwidth(working_set, efficiency)

    def sharing(self, ranks: int) -> GPUSpec:
        """This device as each of `ranks` processes on one node sees it when all of them compute at once
        (`node_slowdown`, measured with gpus_per_node processes; linear in the other busy processes in
        between): compute rates divided, host times multiplied. Communication curves are unchanged:
        bench measured them with every process running."""
        if not self.node_slowdown or ranks <= 1 or self.gpus_per_node <= 1:
            return self
        share = (min(ranks, self.gpus_per_node) - 1) / (self.gpus_per_node - 1)
        mm, st, host = (1 + (self.node_slowdown.get(k, 1.0) - 1) * share for k in ("matmul", "stream", "host"))
        att = self.measured_attention_fp32
        if att is not None:
            att = replace(att, fwd=tuple(x / mm for x in att.fwd), bwd=tuple(x / mm for x in att.bwd))
        return replace(
            self, peak_flops={k: v / mm for k, v in self.peak_flops.items()},
            measured_matmul_fp32=tuple((f, r / mm) for f, r in self.measured_matmul_fp32),
            measured_head_fp32=tuple((f, *(r / mm for r in rates)) for f, *rates in self.measured_head_fp32),
            measured_attention_fp32=att, hbm_bandwidth=self.hbm_bandwidth / st,
            measured_copy_bw=tuple((n, b / st) for n, b in self.measured_copy_bw),
            measured_stream_bw=tuple((n, b / st) for n, b in self.measured_stream_bw),
            optimizer_per_element_s=self.optimizer_per_element_s * st,
            host_layer_s=(self.host_layer_s[0] * host, self.host_layer_s[1] * host),
            host_ends_s=(self.host_ends_s[0] * host, self.host_ends_s[1] * host),
            host_optimizer_per_tensor_s=self.host_optimizer_per_tensor_s * host, node_slowdown={})

    def host_layer(self, tp: int) -> tuple[float, float]:
        """Host (forward, backward) seconds per decoder layer and micro-batch: the tensor-parallel
        layer's as bench ran it when tp > 1 and measured, else the plain layer's."""
        return self.host_tp_layer_s if tp > 1 and self.tp_collective else self.host_layer_s

    def host_ends(self, tp: int) -> tuple[float, float]:
        """Host (forward, backward) seconds per micro-batch of embedding, head and loss (as `host_layer`)."""
        return self.host_tp_ends_s if tp > 1 and self.tp_collective else self.host_ends_s

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
        for f in ("matmul_efficiency", "collective_efficiency", "hbm_efficiency"):
            v = getattr(self, f)
            if not 0 < v <= 1:
                out.append(f"hardware {self.name!r}: {f} must be in (0, 1], got {v!r}")
        if not all(0 < x <= 1 for x in self.attention_efficiency):
            out.append(f"hardware {self.name!r}: attention_efficiency must be in (0, 1], "
                       f"got {self.attention_efficiency}")
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
#  matmul_efficiency: "maximum achievable matmul FLOPS" micro-benchmarks (S. Bekman, ml-engineering,
#        compute/accelerator/benchmarks/mamf-finder.py): A100 SXM ~87%, H100 SXM ~80% of dense peak.
#        B200 figure is an assumption carried over from H100 until measured.
#  collective_efficiency: nccl-tests all_reduce bus bandwidth ~ 80% of NVLink/IB line rate at >=256 MB.
#  sm_count: A100 108, H100 SXM/H200 132 (NVIDIA Hopper/Ampere whitepapers), B200 148 (2 dies x 74).
#  attention_efficiency (FlashAttention-2, torch SDPA's flash backend): Dao 2023 (arXiv:2307.08691):
#        A100 fwd up to 73%, bwd up to 63% of peak. On H100 FA2 reaches only ~35% (Shah et al. 2024,
#        FlashAttention-3, arXiv:2407.08608, abstract); its backward is taken at FA2's A100 bwd/fwd ratio
#        (63/73): 0.35 * 0.86 = 0.30. flash3 on H100: fwd ~740 TF (75%), bwd ~60% (same paper); cuDNN 9
#        fused attention on Hopper is taken equal to FA3 (an assumption until measured). B200: H100's.
#  fp8_gemm_k0 (Hopper): FP8 GEMM M=N=8192 sweep over K on an H800 SXM (the H100 SXM's compute die;
#        tile-lang repository, benchmark/matmul_fp8/README.md): 569, 858, 1129, 1343, 1467, 1507, 1541
#        TFLOP/s at K = 256 .. 16384. The ratio of the K=16384 and K=1024 points gives k0 = 409 (k/(k + k0)
#        scaled to the large-K rate also matches K=2048..8192 within 3%); with our 0.80 matmul_efficiency
#        and H100 wave quantisation the model sits 2-5% under the sweep.
#  gemm_k0 (Hopper, bf16/fp16): the same sweep for FP16 (tile-lang benchmark/matmul/README.md, H800 SXM, M=N=8192):
#        386, 520, 628, 705, 736, 758, 766 TFLOP/s at K = 256 .. 16384; the K=16384/K=1024 ratio gives k0 = 244,
#        which reproduces K = 2048, 4096, 8192 within 1.5 % (K = 256 within 3 %). Ampere and Blackwell: not
#        measured here, k0 = 0.
#  fp8_rowwise (H100, H200): torchao's row-wise FP8 block speedup table measured on an H100 (plan/fp8_rowwise.py);
#        the H200 has the same SM90 die and the same CUTLASS kernel, so the H100's ratios are used there.
#  hbm_efficiency: streaming kernels reach ~90% of nominal HBM bandwidth (BabelStream copy/triad on
#        A100 and H100, Deakin et al.); applied to elementwise traffic, not to GEMM/attention roofs.
#  HBM capacity is the nominal GiB; torch reports slightly less (e.g. 79.1 GiB on an H100 80GB).
_CATALOGUE: dict[str, GPUSpec] = {
    "a100-40gb": GPUSpec(
        name="a100-40gb",
        peak_flops={"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS},
        hbm_bytes=40 * GiB, hbm_bandwidth=1555 * GB, gpus_per_node=8,
        intra_node_bandwidth=300 * GB, inter_node_bandwidth=25 * GB,
        intra_node_latency=2 * US, inter_node_latency=6 * US, matmul_efficiency=0.87,
        sm_count=108, attention_efficiency=(0.73, 0.63),
        source="NVIDIA A100 datasheet; DGX A100 user guide"),
    "a100-80gb": GPUSpec(
        name="a100-80gb",
        peak_flops={"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS},
        hbm_bytes=80 * GiB, hbm_bandwidth=2039 * GB, gpus_per_node=8,
        intra_node_bandwidth=300 * GB, inter_node_bandwidth=25 * GB,
        intra_node_latency=2 * US, inter_node_latency=6 * US, matmul_efficiency=0.87,
        sm_count=108, attention_efficiency=(0.73, 0.63),
        source="NVIDIA A100 datasheet; DGX A100 user guide"),
    "h100-sxm": GPUSpec(
        name="h100-sxm",
        peak_flops={"bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "fp8": 1978.9 * TFLOPS,
                    "tf32": 494.7 * TFLOPS, "fp32": 66.9 * TFLOPS},
        hbm_bytes=80 * GiB, hbm_bandwidth=3350 * GB, gpus_per_node=8,
        intra_node_bandwidth=450 * GB, inter_node_bandwidth=50 * GB,
        intra_node_latency=2 * US, inter_node_latency=6 * US, matmul_efficiency=0.80,
        sm_count=132, attention_efficiency=(0.35, 0.30),
        fp8_gemm_k0=409.0, gemm_k0=244.0, fp8_rowwise=H100_ROWWISE,
        attention_kernels={"flash3": (0.75, 0.60), "cudnn": (0.75, 0.60)},
        source="NVIDIA H100 datasheet; DGX H100 user guide"),
    "h200": GPUSpec(
        name="h200",
        peak_flops={"bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "fp8": 1978.9 * TFLOPS,
                    "tf32": 494.7 * TFLOPS, "fp32": 66.9 * TFLOPS},
        hbm_bytes=141 * GiB, hbm_bandwidth=4800 * GB, gpus_per_node=8,
        intra_node_bandwidth=450 * GB, inter_node_bandwidth=50 * GB,
        intra_node_latency=2 * US, inter_node_latency=6 * US, matmul_efficiency=0.80,
        sm_count=132, attention_efficiency=(0.35, 0.30),
        fp8_gemm_k0=409.0, gemm_k0=244.0, fp8_rowwise=H100_ROWWISE,
        attention_kernels={"flash3": (0.75, 0.60), "cudnn": (0.75, 0.60)},
        source="NVIDIA H200 datasheet; DGX H200 user guide"),
    "b200": GPUSpec(
        name="b200",
        peak_flops={"bf16": 2250 * TFLOPS, "fp16": 2250 * TFLOPS, "fp8": 4500 * TFLOPS,
                    "tf32": 1100 * TFLOPS, "fp32": 75 * TFLOPS},
        hbm_bytes=180 * GiB, hbm_bandwidth=8000 * GB, gpus_per_node=8,
        intra_node_bandwidth=900 * GB, inter_node_bandwidth=50 * GB,
        intra_node_latency=2 * US, inter_node_latency=6 * US, matmul_efficiency=0.80,
        sm_count=148, attention_efficiency=(0.35, 0.30),
        attention_kernels={"flash3": (0.75, 0.60), "cudnn": (0.75, 0.60)},
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
_TOML_SCALARS = {
    "hbm_gib": ("hbm_bytes", GiB),
    "hbm_bandwidth_gb_s": ("hbm_bandwidth", GB),
    "gpus_per_node": ("gpus_per_node", 1),
    "intra_node_bandwidth_gb_s": ("intra_node_bandwidth", GB),
    "inter_node_bandwidth_gb_s": ("inter_node_bandwidth", GB),
    "intra_node_latency_us": ("intra_node_latency", US),
    "inter_node_latency_us": ("inter_node_latency", US),
    "matmul_efficiency": ("matmul_efficiency", 1),
    "collective_efficiency": ("collective_efficiency", 1),
    "sm_count": ("sm_count", 1),
    "hbm_efficiency": ("hbm_efficiency", 1),
    "nics_per_node": ("nics_per_node", 1),
    "fp8_gemm_k0": ("fp8_gemm_k0", 1),
    "gemm_k0": ("gemm_k0", 1),
    "optimizer_ns_per_element": ("optimizer_per_element_s", 1e-9),
}


def hardware_from_dict(d: dict[str, Any], where: str = "hardware") -> GPUSpec:
    """A GPUSpec from the TOML layout in docs/planner.md; ValueError listing every problem at once."""
    d = dict(d)
    problems: list[str] = []
    base_name = d.pop("base", None)
    kw: dict[str, Any] = {}
    if base_name is not None:
        try:
            kw = {f.name: getattr(get_gpu(str(base_name)), f.name) for f in fields(GPUSpec)}
        except KeyError as e:
            problems.append(f"{where}: base: {e.args[0]}")
    kw["name"] = str(d.pop("name", kw.get("name", "custom")))
    kw["source"] = str(d.pop("source", kw.get("source", "user TOML")))
    peak = d.pop("peak_tflops", None)
    if peak is not None:
        if not isinstance(peak, dict):
            problems.append(f"{where}: peak_tflops must be a table like {{ bf16 = 989 }}")
        else:
            kw["peak_flops"] = {_DTYPE_ALIASES.get(k.lower(), k.lower()): float(v) * TFLOPS
                                for k, v in peak.items()}
    busbw = d.pop("busbw", None)
    if busbw is not None:
        kw["measured_busbw"] = _parse_busbw(busbw, where, problems)
    by_nodes = d.pop("allreduce_busbw_by_nodes", None)
    if by_nodes is not None:  # {nodes = [...], gb_s = [...]}: the same shape as a bandwidth curve
        if isinstance(by_nodes, dict) and "nodes" in by_nodes:
            by_nodes = {"bytes": by_nodes["nodes"], "gb_s": by_nodes.get("gb_s")}
        kw["allreduce_busbw_by_nodes"] = _parse_busbw({"allreduce_busbw_by_nodes": by_nodes}, where,
                                                      problems).get("allreduce_busbw_by_nodes", ())
    copy_bw = d.pop("copy_bw", None)
    if copy_bw is not None:
        kw["measured_copy_bw"] = _parse_busbw({"copy_bw": copy_bw}, where, problems).get("copy_bw", ())
    host = d.pop("host_us", None)
    if host is not None:
        try:
            kw["host_layer_s"] = (float(host["layer_fwd"]) * US, float(host["layer_bwd"]) * US)
            kw["host_ends_s"] = (float(host["ends_fwd"]) * US, float(host["ends_bwd"]) * US)
            kw["host_optimizer_per_tensor_s"] = float(host.get("optimizer_per_tensor", 0.0)) * US
        except (TypeError, KeyError, ValueError):
            problems.append(f"{where}: host_us needs numbers layer_fwd, layer_bwd, ends_fwd, ends_bwd")
    mm = d.pop("matmul_fp32", None)
    if mm is not None:  # {flops = [...], gflop_s = [...]}
        if isinstance(mm, dict) and "flops" in mm and "gflop_s" in mm:
            mm = {"bytes": mm["flops"], "gb_s": mm["gflop_s"]}  # same shape as a bandwidth curve
        kw["measured_matmul_fp32"] = _parse_busbw({"matmul_fp32": mm}, where, problems).get("matmul_fp32", ())
    head = d.pop("lm_head_fp32", None)
    if head is not None:  # {flops = [...], fwd_gflop_s = [...], dx_gflop_s = [...], dw_gflop_s = [...]}
        try:
            rows = sorted(zip(head["flops"], head["fwd_gflop_s"], head["dx_gflop_s"], head["dw_gflop_s"], strict=True))
            table = tuple((float(f), *(float(r) * GB for r in rates)) for f, *rates in rows)
            if not table or any(x <= 0 for row in table for x in row):
                raise ValueError
            kw["measured_head_fp32"] = table
        except (TypeError, KeyError, ValueError):
            problems.append(f"{where}: lm_head_fp32 needs equally long, non-empty lists of positive flops, "
                            "fwd_gflop_s, dx_gflop_s, dw_gflop_s")
    stream = d.pop("stream_bw", None)
    if stream is not None:
        kw["measured_stream_bw"] = _parse_busbw({"stream_bw": stream}, where, problems).get("stream_bw", ())
    slow = d.pop("node_slowdown", None)
    if slow is not None:
        if isinstance(slow, dict) and all(isinstance(v, int | float) and v >= 1 for v in slow.values()):
            kw["node_slowdown"] = {str(k): float(v) for k, v in slow.items()}
        else:
            problems.append(f"{where}: node_slowdown must be a table of factors >= 1, like {{ matmul = 2.0 }}")
    tp_step = d.pop("tp_step", None)
    if tp_step is not None:
        try:
            kw["host_tp_layer_s"] = (float(tp_step["layer_fwd_us"]) * US, float(tp_step["layer_bwd_us"]) * US)
            kw["host_tp_ends_s"] = (float(tp_step["ends_fwd_us"]) * US, float(tp_step["ends_bwd_us"]) * US)
            kw["tp_collective"] = _in_step_points(tp_step)
        except (TypeError, KeyError, ValueError):
            problems.append(f"{where}: tp_step needs numbers layer_fwd_us, layer_bwd_us, ends_fwd_us, ends_bwd_us "
                            "and equally long lists of positive collective_bytes, collective_us")
    dp_step = d.pop("dp_step", None)
    if dp_step is not None:
        try:
            pts = _in_step_points(dp_step)
            scalar = float(dp_step["scalar_us"]) * US
            if scalar <= 0:
                raise ValueError
            kw["dp_collective"], kw["scalar_collective_s"] = pts, scalar
        except (TypeError, KeyError, ValueError):
            problems.append(f"{where}: dp_step needs a positive number scalar_us and equally long lists of "
                            "positive collective_bytes, collective_us")
    pp_step = d.pop("pp_step", None)
    if pp_step is not None:
        try:
            kw["pp_hop"] = _in_step_points(pp_step, "hop")
        except (TypeError, KeyError, ValueError):
            problems.append(f"{where}: pp_step needs equally long lists of positive hop_bytes, hop_us")
    if "attention_fp32" in d:
        kw["measured_attention_fp32"] = parse_attention_grid(d.pop("attention_fp32"), where, problems)
    for key, (attr, scale) in _TOML_SCALARS.items():
        if key in d:
            v = d.pop(key)
            if not isinstance(v, int | float) or isinstance(v, bool):
                problems.append(f"{where}: {key} must be a number, got {v!r}")
                continue
            integral = attr in ("hbm_bytes", "gpus_per_node", "sm_count", "nics_per_node")
            kw[attr] = int(v * scale) if integral else float(v * scale)
    ae = d.pop("attention_efficiency", None)
    if ae is not None:
        if not (isinstance(ae, list) and len(ae) == 2 and all(isinstance(x, int | float) for x in ae)):
            problems.append(f"{where}: attention_efficiency must be [forward, backward] fractions")
        else:
            kw["attention_efficiency"] = (float(ae[0]), float(ae[1]))
    d.pop("measured", None)  # free-form bench metadata (host, torch version, ...)
    if d:
        problems.append(f"{where}: unknown key(s): {', '.join(sorted(d))}")
    for req in ("peak_flops", "hbm_bytes", "hbm_bandwidth"):
        if req not in kw:
            problems.append(f"{where}: missing {req} (or give base = \"h100\" to start from the catalogue)")
    if problems:
        raise ValueError("; ".join(problems))
    spec = GPUSpec(**kw)
    if spec.problems():
        raise ValueError("; ".join(spec.problems()))
    return spec


def interp_log(table: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """Linear interpolation of (size, value) points in log(size); clamped at both ends."""
    sizes = [x for x, _ in table]
    i = bisect.bisect_left(sizes, nbytes)
    if i == 0:
        return table[0][1]
    if i >= len(table):
        return table[-1][1]
    (s0, b0), (s1, b1) = table[i - 1], table[i]
    f = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return b0 + f * (b1 - b0)


def _in_step_points(tbl: Any, name: str = "collective") -> tuple[tuple[float, float], ...]:
    """A bench step table's in-step times, ((bytes, seconds), ...) by bytes, from its lists
    `<name>_bytes` and `<name>_us`; ValueError/KeyError/TypeError unless equally long, non-empty and
    positive."""
    pts = tuple(sorted((float(b), float(t) * US) for b, t in
                       zip(tbl[f"{name}_bytes"], tbl[f"{name}_us"], strict=True)))
    if not pts or any(b <= 0 or t <= 0 for b, t in pts):
        raise ValueError
    return pts


def _parse_busbw(tbl: Any, where: str, problems: list[str]) -> BusBwTable:
    out: BusBwTable = {}
    if not isinstance(tbl, dict):
        problems.append(f"{where}: busbw must be a table of collectives")
        return out
    for op, t in tbl.items():
        sizes, bws = (t.get("bytes"), t.get("gb_s")) if isinstance(t, dict) else (None, None)
        if not isinstance(sizes, list) or not isinstance(bws, list) or len(sizes) != len(bws) or not sizes:
            problems.append(f"{where}: busbw.{op} needs equal-length lists `bytes` and `gb_s`")
            continue
        out[op] = tuple(sorted((float(s), float(b) * GB) for s, b in zip(sizes, bws, strict=True)))
    return out


def load_hardware_toml(path: str | Path) -> GPUSpec:
    """Load user-defined hardware or a `pentatron bench` profile. The GPU may sit under a [gpu] table."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"hardware file {str(p)!r} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"hardware file {str(p)!r}: invalid TOML: {e}") from None
    if "gpu" in data and isinstance(data["gpu"], dict):
        data = data["gpu"]
    return hardware_from_dict(data, where=str(p))


def with_overrides(spec: GPUSpec, **kw: Any) -> GPUSpec:
    """A copy with some fields changed (e.g. gpus_per_node for a different node size)."""
    return replace(spec, **kw)
