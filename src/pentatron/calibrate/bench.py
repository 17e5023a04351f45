"""`pentatron bench`: measure this machine and write a hardware profile the planner reads instead of
datasheet numbers.

Measured: dense matmul FLOP/s (bf16 and fp32/TF32), memory-copy bandwidth, and the bus bandwidth of
all-reduce / all-gather / reduce-scatter by message size over N local processes (gloo on CPU, NCCL
on GPU), through the project's comm layer. Bus bandwidth follows nccl-tests: algorithm bandwidth
(payload / time) times 2(n-1)/n for all-reduce and (n-1)/n for all-gather and reduce-scatter, so it
is comparable across group sizes and with link speeds. Only one machine is measured: inter-node
figures stay those of the catalogue entry (or equal the intra-node ones on an unknown device).
On a CPU the kernels are also measured as a training step runs them (`cpu_kernels.py`), eager and
compiled (`compiled_kernels.py`: what `train.compile` changes), the collectives after a block of compute,
and how much the node's processes slow each other when all compute.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from pentatron.calibrate.compiled_kernels import measure_compiled
from pentatron.calibrate.cpu_kernels import (
    ATTN_HEAD_DIM,
    ATTN_SEQ,
    measure_cpu_kernels,
    reference_kernels,
    step_compute,
)
from pentatron.calibrate.dp_step import measure_dp_step
from pentatron.calibrate.pp_step import measure_pp_step
from pentatron.calibrate.timers import best_of as _best_of
from pentatron.calibrate.timers import sync as _sync
from pentatron.calibrate.timers import timed as _timed
from pentatron.calibrate.tp_step import HEAD_DIM as TP_HEAD_DIM
from pentatron.calibrate.tp_step import measure_tp_step, tiny_attention_shape
from pentatron.hardware.catalogue import GB, GiB, detect_gpu
from pentatron.hardware.profile import PROFILE_SCHEMA

OPS = ("all_reduce", "all_gather", "reduce_scatter")


class BenchError(ValueError):
    """The requested measurement cannot run here (reported as an input error)."""


@dataclass
class BenchResult:
    device: str
    device_name: str
    nproc: int
    backend: str
    matmul_flops: dict[str, float]  # dtype -> FLOP/s
    copy_bandwidth: float  # bytes/s (read + write)
    memory_bytes: int
    busbw: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # op -> [(bytes, B/s)]
    copy_curve: list[tuple[int, float]] = field(default_factory=list)  # [(bytes, B/s)] by buffer size
    matmul_curve: list[tuple[int, float]] = field(default_factory=list)  # [(FLOPs per call, FLOP/s)] fp32
    host_overhead: tuple[float, ...] = ()  # (layer fwd, layer bwd, ends fwd, ends bwd) seconds per micro-batch
    host_optimizer_per_tensor: float = 0.0  # seconds per parameter tensor of an optimizer step
    # CPU kernels inside a step (cpu_kernels): "stream_curve", "matmul_curve", "head_curve", "attention_grid",
    # "optimizer_per_element", "reference" (alone) and "node_slowdown" (every process at once)
    cpu_kernels: dict[str, Any] = field(default_factory=dict)
    # CPU, >= 2 processes: the tensor-parallel step over all of them (tp_step.TPStep.to_profile), the
    # data-parallel step's synchronisations (dp_step.DPStep.to_profile) and, with an even count, the
    # pipeline's hop between stages (pp_step.PPStep.to_profile)
    tp_step: dict[str, float | int] = field(default_factory=dict)
    # CPU: train.compile's kernels (compiled_kernels.measure_compiled, from the measured saving of compiling a
    # layer): "host" (layer fwd, bwd seconds) and "chain" [(operand bytes, fused B/s)]; empty where inductor
    # could not compile here
    compiled: dict[str, Any] = field(default_factory=dict)
    dp_step: dict[str, Any] = field(default_factory=dict)
    pp_step: dict[str, Any] = field(default_factory=dict)
    torch_version: str = torch.__version__
    host: str = field(default_factory=platform.node)
    when: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        lines = [f"device: {self.device_name} ({self.device}), {self.nproc} process(es), backend {self.backend}"]
        for k, v in self.matmul_flops.items():
            lines.append(f"  matmul {k:<5} {v / 1e12:10.3f} TFLOP/s")
        lines.append(f"  memory copy  {self.copy_bandwidth / GB:10.2f} GB/s")
        for op, pts in self.busbw.items():
            best = max(b for _, b in pts)
            lines.append(f"  {op:<14} bus bandwidth up to {best / GB:.2f} GB/s "
                         f"({_size(pts[0][0])} .. {_size(pts[-1][0])})")
        if self.nproc < 2:
            lines.append("  collectives: skipped (one process)")
        return "\n".join(lines)


def _size(n: float) -> str:
    for unit, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= s:
            return f"{n / s:g} {unit}"
    return f"{n:g} B"


GPU_GEMM_N = 8192  # bf16 GEMM edge bench times on a GPU (square: m = n = k)


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int, seconds: float) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    t = _timed(lambda: torch.mm(a, b, out=out), device, seconds)
    return 2 * n**3 / t


def measure_copy(device: torch.device, nbytes: int, seconds: float) -> float:
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), device, seconds)
    return 2 * nbytes / t  # read + write


# Copy sizes for the bandwidth curve: from cache-resident (a debug model's activations) to DRAM.
COPY_CURVE_BYTES = tuple(2**k for k in range(14, 27, 2))  # 16 KiB .. 64 MiB


def measure_host_overhead(device: torch.device, seconds: float) -> tuple[float, float, float, float]:
    """Host seconds per micro-batch that eager PyTorch spends outside the arithmetic: (per decoder layer
    forward, per layer backward, embedding + head + loss forward, their backward). A tiny Llama (h=64,
    4 tokens: the arithmetic is negligible) at 2 and 6 layers: the difference per layer is the layer's
    op dispatch and autograd cost, the rest the ends'. What a CPU step pays on top of the FLOPs."""
    import torch.nn.functional as F

    from pentatron.models.config import ModelConfig
    from pentatron.models.llama import Llama

    def run(n_layers: int) -> tuple[float, float]:
        cfg = ModelConfig(vocab_size=64, hidden_size=64, n_layers=n_layers, n_heads=2, n_kv_heads=1,
                          ffn_hidden_size=128, max_seq_len=16)
        model = Llama(cfg).to(device)
        tokens = torch.zeros(1, 4, dtype=torch.long, device=device)

        def fwd() -> torch.Tensor:
            return F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())

        t_f = _best_of(lambda: fwd().detach(), device, 3 * seconds, min_iters=10)
        t_fb = _best_of(lambda: fwd().backward(), device, 3 * seconds, min_iters=10)
        return t_f, t_fb - t_f

    (f2, b2), (f6, b6) = run(2), run(6)
    # the layer's attention kernel at this tiny shape is not host work: the planner charges attention
    # at the run's shape from the attention grid (cpu_kernels), so its tiny-shape cost comes off here
    af, ab = _tiny_attention(device, seconds)
    lf, lb = max(0.0, (f6 - f2) / 4 - af), max(0.0, (b6 - b2) / 4 - ab)
    return lf, lb, max(0.0, f2 - 2 * (lf + af)), max(0.0, b2 - 2 * (lb + ab))


def _tiny_attention(device: torch.device, seconds: float, heads: int = 2, kv_heads: int = 1,
                    tokens: int = 4, head_dim: int = 32) -> tuple[float, float]:
    """Forward and backward seconds of a tiny model's attention call (default: the tiny Llama's, 1 x 2
    heads, 1 kv head, 4 tokens, head dim 32)."""
    import torch.nn.functional as F

    q = torch.zeros(1, heads, tokens, head_dim, device=device, requires_grad=True)
    k, v = (torch.zeros(1, kv_heads, tokens, head_dim, device=device, requires_grad=True) for _ in range(2))
    g = torch.ones(1, heads, tokens, head_dim, device=device)

    def fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    t_f = _best_of(lambda: fwd().detach(), device, seconds, min_iters=10)
    t_fb = _best_of(lambda: torch.autograd.grad(fwd(), (q, k, v), g), device, seconds, min_iters=10)
    return t_f, max(0.0, t_fb - t_f)


def measure_optimizer_overhead(device: torch.device, seconds: float, n_tensors: int = 64) -> float:
    """Host seconds per parameter tensor of one optimizer step on tiny tensors (the arithmetic is
    negligible): the gradient-norm term, clipping and torch's AdamW, as the trainer runs them."""
    params = [torch.zeros(8, device=device, requires_grad=True) for _ in range(n_tensors)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step() -> None:
        norm = torch.stack([(p.grad.float() ** 2).sum() for p in params]).sum().sqrt()
        for p in params:
            p.grad.mul_(1.0 / (norm + 1e-6))
        opt.step()

    return _best_of(step, device, 3 * seconds, min_iters=5) / n_tensors


def measure_copy_curve(device: torch.device, seconds: float) -> list[tuple[int, float]]:
    """Copy bandwidth by buffer size: what a memory-bound op on a tensor that size reaches, the per-op
    cost of a small one included (the planner's elementwise terms read it at their tensor sizes)."""
    out = []
    for n in COPY_CURVE_BYTES:
        src = torch.ones(n // 4, device=device)
        dst = torch.empty_like(src)
        out.append((n, 2 * n / _best_of(lambda s=src, d=dst: d.copy_(s), device, 3 * seconds)))
    return out


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * GiB


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sizes(max_bytes: int) -> list[int]:
    out, n = [], 4096
    while n <= max_bytes:
        out.append(n)
        n *= 2
    return out or [max_bytes]


def _timed_collective(fn: Any, comm: Any, device: torch.device, seconds: float) -> float:
    """Like `_timed`, but every rank must run the same number of calls: calibrate, agree on the largest
    count (all-reduce max), then time."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(2):
        fn()
    _sync(device)
    per = max((time.perf_counter() - t0) / 2, 1e-7)
    n = torch.tensor([float(min(1000, max(3, int(seconds / per / 3))))], device=device)
    comm.all_reduce(n, "dp", op="max")
    iters = int(n.item())
    best = float("inf")
    for _ in range(3):  # the fastest of 3 windows, as for the kernels: the others measure the neighbours
        comm.barrier("dp")
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def _ping_pong(comm: Any, buf: torch.Tensor, rank: int) -> None:
    """Rank 0 sends `buf` to rank 1, which sends it back (the pipeline's send/recv through the comm layer)."""
    if rank == 0:
        comm.send(buf, "dp", 1)
        comm.recv(buf, "dp", 1)
    else:
        comm.recv(buf, "dp", 0)
        comm.send(buf, "dp", 0)


def _exchange(comm: Any, buf: torch.Tensor, rank: int) -> None:
    """Ranks 0 and 1 swap `buf`-sized messages, sending and receiving at once (one batch of both)."""
    from pentatron.distributed.comm import P2P

    peer = 1 - rank
    incoming = torch.empty_like(buf)
    comm.batch_p2p([P2P("send", buf, peer), P2P("recv", incoming, peer)], "dp").wait()


def _tp_step(ctx: Any, tiny_attention: tuple[float, float]) -> dict[str, Any]:
    """tp_step's table, its compiled layer included where inductor compiles here (one line on stderr, and
    the eager measurement only, where it does not)."""
    from torch._dynamo.exc import TorchDynamoException

    try:
        return measure_tp_step(ctx, tiny_attention, compiled=True).to_profile()
    except (TorchDynamoException, RuntimeError, OSError) as e:
        print(f"pentatron bench: the compiled TP layer not measured: {type(e).__name__}: "
              f"{str(e).splitlines()[0][:200]}", file=sys.stderr)
        return measure_tp_step(ctx, tiny_attention).to_profile()


def _collective_worker(rank: int, world: int, port: int, device_type: str, max_bytes: int, seconds: float,
                       out_path: str) -> None:
    """One process of the collective benchmark; rank 0 writes the result file."""
    import torch.distributed as dist

    from pentatron.distributed.context import ParallelContext
    from pentatron.distributed.launch import process_group_device, shutdown_distributed
    from pentatron.layout import ParallelLayout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor collective names, torch >= 2.12
    # bound to the GPU as training's group is (eager NCCL communicator): the same collectives are timed
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world,
                            **process_group_device(device))
    finished = False
    contexts: list[ParallelContext] = []
    try:
        ctx = ParallelContext.from_layout(ParallelLayout(dp=world), device)
        contexts.append(ctx)
        comm = ctx.comm
        concurrent = {}
        if device_type == "cpu":  # every process of the node computes at once, as the ranks of a run do
            comm.barrier("dp")
            concurrent = reference_kernels(device, seconds)
        results: dict[str, list[tuple[int, float]]] = {op: [] for op in OPS}
        sizes = _sizes(max_bytes)
        budget = seconds / max(1, len(sizes))
        # CPU: time each collective as a step issues it, after a block of compute (about 0.5 ms of
        # GEMMs), less that block: gloo's threads wake up, caches are cold, ranks arrive apart; a
        # tight loop of collectives measured 0.46-0.66 ms per 128 KiB all-reduce, in a step 0.9-1.2 ms
        between, t_between = (lambda: None), 0.0
        if device_type == "cpu":
            between = step_compute(device)
            t_between = _timed_collective(between, comm, device, budget)

        def timed(fn: Any) -> float:
            return max(1e-7, _timed_collective(lambda: (between(), fn()), comm, device, budget) - t_between)

        for size in sizes:
            n = max(world, size // 4 // world * world)  # float32 elements, divisible by the group
            full = torch.ones(n, device=device)
            shard = torch.ones(n // world, device=device)
            payload = n * 4
            calls = {
                "all_reduce": lambda full=full: comm.all_reduce(full, "dp"),
                "all_gather": lambda full=full, shard=shard: comm.all_gather(full, shard, "dp"),
                "reduce_scatter": lambda full=full, shard=shard: comm.reduce_scatter(shard, full, "dp"),
            }
            for op in OPS:
                t = timed(calls[op])
                factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
                results[op].append((payload, payload * factor / t))
            if world == 2:  # pipeline p2p: a ping-pong, one way = half the round trip
                t = timed(lambda full=full: _ping_pong(comm, full, rank)) / 2
                results.setdefault("p2p", []).append((payload, payload / t))
                if device_type == "cpu":  # both ranks send and receive at once (the tied gradients' swap)
                    t = timed(lambda full=full: _exchange(comm, full, rank))
                    results.setdefault("exchange", []).append((payload, payload / t))
            comm.ledger.begin_step()  # the ledger is per step: do not let it grow across sizes
        tp_step, dp_step, pp_step = {}, {}, {}
        if device_type == "cpu":  # the data-parallel step's synchronisations (dp_step)
            dp_step = measure_dp_step(comm, "dp", step_compute(device)).to_profile()
        if device_type == "cpu" and world % 2 == 0:  # the pipeline's hop between stages (pp_step)
            pp_step = measure_pp_step(comm, "dp", step_compute(device)).to_profile()
        if device_type == "cpu":  # the real tensor-parallel layer over every process (tp_step)
            heads, kv, tokens = tiny_attention_shape()
            attn = _tiny_attention(device, seconds / 3, heads, kv, tokens, TP_HEAD_DIM)
            tp_ctx = ParallelContext.from_layout(ParallelLayout(tp=world), device)
            contexts.append(tp_ctx)
            tp_step = _tp_step(tp_ctx, attn)
        if rank == 0:
            Path(out_path).write_text(json.dumps({"busbw": results, "concurrent": concurrent, "tp_step": tp_step,
                                                  "dp_step": dp_step, "pp_step": pp_step}))
        finished = True
    finally:
        # As training leaves: the groups let go (`ParallelContext.release`), a barrier when all went
        # well, then the process group destroyed.
        for c in contexts:
            c.release()
        shutdown_distributed(finished)


def run_benchmarks(device: str = "auto", nproc: int | None = None, max_bytes: int | None = None,
                   seconds: float = 0.1) -> BenchResult:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device is available")
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if nproc is None:
        nproc = torch.cuda.device_count() if device == "cuda" else 2
    if device == "cuda" and nproc > torch.cuda.device_count():
        raise BenchError(f"--nproc {nproc} exceeds the {torch.cuda.device_count()} CUDA devices")
    max_bytes = max_bytes or (256 * 2**20 if device == "cuda" else 4 * 2**20)  # CPU: a debug model's gradients
    if device == "cuda":
        name = torch.cuda.get_device_name(dev)
        flops = {"bf16": measure_matmul(dev, torch.bfloat16, GPU_GEMM_N, seconds),
                 "tf32": measure_matmul(dev, torch.float32, 4096, seconds)}
        copy = measure_copy(dev, 1 * GiB, seconds)
    else:
        name = platform.processor() or platform.machine() or "cpu"
        flops = {"fp32": measure_matmul(dev, torch.float32, 512, seconds),
                 "bf16": measure_matmul(dev, torch.bfloat16, 256, seconds)}
        copy = measure_copy(dev, 64 * 2**20, seconds)
    result = BenchResult(device, name, nproc, "nccl" if device == "cuda" else "gloo", flops, copy,
                         _memory_bytes(dev))
    if device == "cpu":  # GPU tensors of real models dwarf the L2: the large-buffer rate applies
        result.copy_curve = measure_copy_curve(dev, seconds)
        result.host_overhead = measure_host_overhead(dev, seconds)
        result.host_optimizer_per_tensor = measure_optimizer_overhead(dev, seconds)
        result.cpu_kernels = measure_cpu_kernels(dev, seconds, result.host_optimizer_per_tensor)
        result.cpu_kernels["reference"] = reference_kernels(dev, seconds)  # alone, for node_slowdown
        result.matmul_curve = result.cpu_kernels["matmul_curve"]
        result.compiled = measure_compiled(dev, seconds, result.host_overhead[:2],
                                           result.cpu_kernels["stream_curve"])
    if nproc >= 2:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "busbw.json")
            mp.spawn(_collective_worker, args=(nproc, _free_port(), device, max_bytes, seconds * 3, out),
                     nprocs=nproc, join=True)
            got = json.loads(Path(out).read_text())
            result.busbw = {op: [tuple(x) for x in pts] for op, pts in got["busbw"].items()}
            result.tp_step = got.get("tp_step") or {}
            result.dp_step = got.get("dp_step") or {}
            result.pp_step = got.get("pp_step") or {}
            if got["concurrent"] and result.cpu_kernels:
                solo = result.cpu_kernels["reference"]
                # n processes fairly sharing the node's compute are at most n times slower; more is other
                # tenants' load during the measurement
                result.cpu_kernels["node_slowdown"] = {k: min(float(nproc), max(1.0, got["concurrent"][k] / solo[k]))
                                                       for k in solo}
    return result


def profile_dict(r: BenchResult) -> dict[str, Any]:
    """The profile file's content (schema `hardware.profile.PROFILE_SCHEMA`, human units): the datasheet part
    under "hardware", the measured curves under "profile", where and when under "measured"."""
    return {"schema": PROFILE_SCHEMA, "hardware": _hardware_table(r), "profile": _profile_table(r),
            "measured": {"host": r.host, "when": r.when, "torch": r.torch_version, "device": r.device_name,
                         "nproc": r.nproc, "backend": r.backend}}


def _hardware_table(r: BenchResult) -> dict[str, Any]:
    """The device as measured, in the keys of a `--hardware` file (hardware/catalogue.py)."""
    known = detect_gpu(r.device_name) if r.device == "cuda" else None
    hw: dict[str, Any] = {"name": f"bench-{known.name if known else r.device}",
                          "source": f"pentatron bench on {r.host} ({r.device_name}), {r.when}"}
    best_bus = max((b for pts in r.busbw.values() for _, b in pts), default=r.copy_bandwidth)
    if known is not None:
        # keep the datasheet peak (the MFU denominator); the measurement sets the achievable fraction, less
        # what the planner charges that square GEMM's shape itself (waves, small k), so that it predicts
        # the measured rate at that shape instead of charging the shape twice
        hw["base"] = known.name
        shape = known.gemm_shape_efficiency(GPU_GEMM_N, GPU_GEMM_N, GPU_GEMM_N, 2)
        hw["matmul_efficiency"] = round(min(1.0, r.matmul_flops["bf16"] / (known.peak_flops["bf16"] * shape)), 4)
    else:
        hw["peak_tflops"] = {k: v / 1e12 for k, v in r.matmul_flops.items()}
        hw["matmul_efficiency"] = 1.0
        hw["sm_count"] = 1 if r.device == "cpu" else 132
        hw["inter_node_bandwidth_gb_s"] = best_bus / GB  # not measurable on one machine
        hw["collective_efficiency"] = 1.0
    hw["hbm_gib"] = r.memory_bytes / GiB
    hw["hbm_bandwidth_gb_s"] = r.copy_bandwidth / GB
    hw["gpus_per_node"] = max(1, r.nproc)
    hw["intra_node_bandwidth_gb_s"] = best_bus / GB
    return hw


def _profile_table(r: BenchResult) -> dict[str, Any]:
    """The measured curves, in the keys `hardware.profile.profile_from_dict` reads."""
    prof: dict[str, Any] = {}
    if r.host_overhead:
        prof["host_us"] = {k: round(v * 1e6, 2) for k, v in zip(("layer_fwd", "layer_bwd", "ends_fwd", "ends_bwd"),
                                                                 r.host_overhead, strict=True)}
        prof["host_us"]["optimizer_per_tensor"] = round(r.host_optimizer_per_tensor * 1e6, 2)
    if r.tp_step:
        prof["tp_step"] = dict(r.tp_step)
    if r.compiled:
        (lf, lb), chain = r.compiled["host"], r.compiled["chain"]
        prof["compiled"] = {"layer_fwd_us": round(lf * 1e6, 2), "layer_bwd_us": round(lb * 1e6, 2),
                            "chain_bytes": [n for n, _ in chain], "chain_gb_s": [round(b / GB, 4) for _, b in chain]}
    if r.dp_step:
        prof["dp_step"] = dict(r.dp_step)
    if r.pp_step:
        prof["pp_step"] = dict(r.pp_step)
    if r.matmul_curve:
        prof["matmul_fp32"] = {"flops": [f for f, _ in r.matmul_curve],
                               "gflop_s": [v / 1e9 for _, v in r.matmul_curve]}
    head = r.cpu_kernels.get("head_curve")
    if head:
        prof["lm_head_fp32"] = {"flops": [row[0] for row in head],
                                **{f"{k}_gflop_s": [round(row[i] / 1e9, 3) for row in head]
                                   for i, k in enumerate(("fwd", "dx", "dw"), start=1)}}
    ck = r.cpu_kernels
    if ck:
        prof["optimizer_ns_per_element"] = round(ck["optimizer_per_element"] * 1e9, 4)
        stream = ck["stream_curve"]
        prof["stream_bw"] = {"bytes": [n for n, _ in stream], "gb_s": [b / GB for _, b in stream]}
        if ck.get("node_slowdown"):
            prof["node_slowdown"] = {k: round(v, 3) for k, v in ck["node_slowdown"].items()}
        att = {(s, d): (f, b) for s, d, f, b in ck["attention_grid"]}
        prof["attention_fp32"] = {
            "seq": list(ATTN_SEQ), "head_dim": list(ATTN_HEAD_DIM),
            "fwd_gflop_s": [round(att[s, d][0] / 1e9, 3) for s in ATTN_SEQ for d in ATTN_HEAD_DIM],
            "bwd_gflop_s": [round(att[s, d][1] / 1e9, 3) for s in ATTN_SEQ for d in ATTN_HEAD_DIM]}
    if r.copy_curve:
        prof["copy_bw"] = {"bytes": [n for n, _ in r.copy_curve], "gb_s": [b / GB for _, b in r.copy_curve]}
    if r.busbw:
        prof["busbw"] = {op: {"bytes": [s for s, _ in pts], "gb_s": [b / GB for _, b in pts]}
                         for op, pts in r.busbw.items()}
    return prof


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v) if isinstance(v, int) else f"{v:.6g}"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


_TABLES = ("hardware", "profile", "busbw", "measured", "attention_fp32")  # written as [sections]


def to_toml(d: dict[str, Any]) -> str:
    """Minimal TOML writer for the profile's nesting (tables of scalars, lists and inline tables)."""
    lines: list[str] = []

    def table(prefix: str, t: dict[str, Any]) -> None:
        scalars = {k: v for k, v in t.items() if not (isinstance(v, dict) and k in _TABLES)
                   and not (isinstance(v, dict) and all(isinstance(x, dict) for x in v.values()) and v)}
        subs = {k: v for k, v in t.items() if k not in scalars}
        if prefix:
            lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in scalars.items())
        lines.append("")
        for k, v in subs.items():
            table(f"{prefix}.{k}" if prefix else k, v)

    table("", d)
    return "\n".join(lines).strip() + "\n"


def write_profile(r: BenchResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof = profile_dict(r)
    if path.suffix == ".json":
        path.write_text(json.dumps(prof, indent=2) + "\n")
    else:
        path.write_text("# Hardware profile measured by `pentatron bench`; read by `pentatron plan "
                        "--hardware-profile`.\n" + to_toml(prof))
    return path
