"""The prepared device check (issue 35): one command, about 3-5 minutes on one H200 (on a host with several, part
multi_gpu adds at most 3.5 and chip_spread a quarter of a minute), a JSON file and a table.

    python benchmarks/gpu_check.py --out gpu_check.json      # on a CUDA host: the real sizes
    python benchmarks/gpu_check.py --toy                     # every part at toy size on CPU (make test runs it)
    python benchmarks/gpu_check.py --parts kernel_rates,train # some parts only
    python benchmarks/gpu_check.py --calibration-out hw.toml  # also the GPU's calibration, as a hardware file
    python benchmarks/gpu_check.py --from-json run.json --calibration-out hw.toml  # that of a stored run

The JSON is rewritten after each part, so a run cut short keeps what it measured. The first run on a GPU (one
H200, 2026-12-04) is benchmarks/measured/gpu_check_h200_2026-12-04.json; the H100/H200 catalogue entries hold
its calibration (calibrate/gpu_calibration.py).

Parts (each one reports on its own; a failing part does not stop the others):
  kernel_rates  each GEMM of the linears of the training part's model, Llama-3-8B and -70B (forward, dX, dW),
                causal GQA attention by SDPA backend (forward, backward) and an HBM copy, on random bf16
                operands, beside the seconds the planner's time model gives each on this GPU's catalogue entry
  train         1-GPU bf16 training of a ~1B Llama (16 layers, h 2048, ffn 5632, vocab 32000, seq 4096) for
                30 steps through the Trainer: tokens/s, MFU, peak allocated / reserved since training began,
                beside the planner's prediction for the same layout (`observe.report.predicted`'s inputs)
  sdpa_backend  the attention kernel SDPA actually ran in one training step (profiler kernel names: flash,
                mem-efficient, cuDNN or math); on CPU the ATen op it dispatched to
  step_profile  where a training step's time goes: 2 steps of the training part's Trainer under torch.profiler
                (after 1 warm-up step), the device kernels (CPU: ATen ops' self time) in seconds per step by
                category (gemm, attention, optimizer, compiled, nccl, other), the device-busy seconds
                (overlapping kernels counted once), the wall seconds and the idle fraction 1 - busy/wall, the
                top 12 kernels; beside them the planner's GEMM, attention, optimizer and remaining seconds of
                the same step and, on a catalogue GPU, measured over predicted for each
  ring_kernel   ring attention's block kernels (on CUDA: fused, i.e. what training picks, and flash,
                memory-efficient and cuDNN each) against the math reference in fp64, with GQA (4 query heads
                per kv head): outputs, log-sum-exp and dQ/dK/dV, causal and not, fp32 and bf16 (flash and
                cuDNN bf16 only); forward + backward time of each (best of 5)
  documents     document-masked attention as training runs it (CUDA bf16: one varlen flash call) against
                the per-segment loop in fp64, output and dQ/dK/dV; forward time of both
  stage_startup start-up of one pipeline rank's share of Llama-3.1-70B (pp 8, the stage with the most
                parameters): built on meta, only that stage materialised on the device and initialised;
                the measured peak beside the stage's parameter bytes
  syncs         device→host synchronisations per training step, from torch.cuda.set_sync_debug_mode("warn");
                on CPU the calls that would sync on CUDA (item, tolist, float(t), cpu(), ...), counted
  fp8           FP8 GEMMs (train.fp8 tensorwise and rowwise) against bf16 on an 8B-shaped stack (h 4096, ffn
                14336, 32/8 heads, 4 layers, vocab 32000, seq 4096, micro-batch 2), each 10 steps through the
                Trainer, eager, and on CUDA again with compiled blocks (train.compile "auto": the FP8 casts
                fused): tokens/s of each and the ratios to bf16 of the same compile setting
  compile       the training part's run (train.compile "auto": compiled blocks on CUDA) against the same run
                with train.compile=false: tokens/s of each, the ratio, compile seconds and recompiles.
                CUDA only: on a CPU "auto" is eager, and benchmarks/compile_speed.py compares the two there
  multi_gpu     our multi-process training as users launch it (`pentatron train --nproc N`, N = min(GPUs, 8)
                rounded down to a power of two, NCCL) on the training part's model and random tokens, the global
                batch × dp: dp N ZeRO-1, dp N ZeRO-3, tp N + sp and (N >= 4) tp 2 + sp × dp N/2 ZeRO-1, 12 steps
                each: steady tokens/s and the ledger's bytes sent per step beside the planner's step and bytes for
                the same layout and world size on this GPU's catalogue entry (its calibration applied),
                measured/predicted. Within 150 s (the layouts left when it is spent are not started, and named);
                a failed launch keeps its stderr tail. One GPU: skipped. CPU: dp 2 ZeRO-1 on 2 gloo ranks only,
                measured only (a datasheet GPU's prediction is not about this machine)
  chip_spread   the same bf16 GEMM (8192^3) sustained on every GPU of the host at once (10 s after a 3 s warm-up,
                so the clocks settle under the power limit): each GPU's TFLOP/s, their median, spread and slowest,
                beside the planner's same-SKU spread (hardware/chip_spread.py: sigma 1.48 %, the expected slowest
                of n). Needs 2 or more GPUs: skipped on one and on a CPU

With --toy, or when no CUDA device is present, every part runs at toy size on CPU; a part without a CPU
analogue says "skipped: ..." (compile).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

MIB, GIB = 2**20, 2**30


@dataclass(frozen=True)
class Sizes:
    model: dict[str, Any]  # [model] overrides of `base`
    base: str
    seq_len: int
    micro_batch: int
    global_batch: int
    steps: int
    profile_steps: int  # extra steps: the SDPA profile (1) and the sync count (the rest)
    ring: tuple[int, int, int, int]  # b, heads, s, d of the block kernel check
    ring_kv: int  # its kv heads (GQA)
    stage_model: str
    stage_pp: int


GPU = Sizes(model=dict(vocab_size=32000, hidden_size=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                       ffn_hidden_size=5632, max_seq_len=4096, tie_embeddings=False),
            base="llama3-8b", seq_len=4096, micro_batch=4, global_batch=8, steps=30, profile_steps=4,
            ring=(1, 8, 2048, 128), ring_kv=2, stage_model="llama3.1-70b", stage_pp=8)
# the fp8 part: Llama-3-8B's layer shape, 4 layers (~1.1B parameters with a 32000 vocabulary: fits with its
# fp32 masters and Adam states, three runs well under a minute on an H200)
FP8_GPU = Sizes(model=dict(vocab_size=32000, hidden_size=4096, n_layers=4, n_heads=32, n_kv_heads=8,
                           ffn_hidden_size=14336, max_seq_len=4096, tie_embeddings=False),
                base="llama3-8b", seq_len=4096, micro_batch=2, global_batch=2, steps=10, profile_steps=0,
                ring=GPU.ring, ring_kv=GPU.ring_kv, stage_model=GPU.stage_model, stage_pp=GPU.stage_pp)
TOY = Sizes(model=dict(vocab_size=512, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_size=128,
                       max_seq_len=64, tie_embeddings=False),
            base="debug", seq_len=32, micro_batch=2, global_batch=4, steps=3, profile_steps=2,
            ring=(1, 4, 64, 16), ring_kv=1, stage_model="debug", stage_pp=2)
FP8_TOY = Sizes(model={**TOY.model, "n_layers": 1}, base=TOY.base, seq_len=TOY.seq_len, micro_batch=TOY.micro_batch,
                global_batch=TOY.micro_batch, steps=2, profile_steps=0, ring=TOY.ring, ring_kv=TOY.ring_kv,
                stage_model=TOY.stage_model, stage_pp=TOY.stage_pp)


# ---------------------------------------------------------------------------- helpers
def synthetic_dataset(path: Path, vocab: int, tokens: int, seed: int = 0) -> Path:
    """A tokenized dataset directory of uniform random ids (no tokenizer, no corpus: seconds to write)."""
    from pentatron.data.index import INDEX_FILE, INDEX_VERSION, token_dtype

    path.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab)
    ids = np.random.default_rng(seed).integers(1, vocab, size=tokens, dtype=np.int64).astype(dtype)
    ids.tofile(path / "shard_00000.bin")
    index = {"version": INDEX_VERSION, "dtype": str(np.dtype(dtype)), "vocab_size": vocab, "eos_id": 0,
             "eos_token": "<eos>", "shards": [{"file": "shard_00000.bin", "tokens": tokens}],
             "total_tokens": tokens, "num_documents": 1, "max_token_id": int(ids.max()),
             "fingerprint": f"gpu-check-random-{vocab}-{tokens}-{seed}"}
    (path / INDEX_FILE).write_text(json.dumps(index))
    return path


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else str(value)


def release_memory(device: torch.device) -> None:
    """Between parts: what the last one dropped is collected, and on CUDA returned by the caching allocator."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def part(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """Run one part; its exception becomes its status, so that the other parts still run."""
    start = time.perf_counter()
    try:
        out = fn(*args)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # a kernel's fault is reported by the part that launched it, not the next one
        out.setdefault("status", "ok")
    except Exception as e:  # noqa: BLE001 - the check reports every part
        out = {"status": f"failed: {type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=-12)}
    out["seconds"] = round(time.perf_counter() - start, 3)
    return out


def _gib(n: float | None) -> float | None:
    return None if n is None else round(n / GIB, 3)


# ---------------------------------------------------------------------------- (a) training, (b) SDPA, (e) syncs
def run_sets(size: Sizes, device_type: str, *extra: str) -> list[str]:
    """The overrides of a part's training run (the model, batch and precision the planner is told about)."""
    sets = [f"model.name={_toml(size.base)}", *(f"model.{k}={_toml(v)}" for k, v in size.model.items()),
            f"train.seq_len={size.seq_len}", f"train.micro_batch={size.micro_batch}",
            f"train.global_batch={size.global_batch}", f"train.steps={size.steps}", "train.warmup=2",
            "train.precision='bf16'", f"train.device={_toml(device_type)}", *extra]
    if device_type == "cpu":
        sets.append("train.peak_tflops=1.0")  # no CPU peak measurement in the toy run (seconds)
    return sets


def run_config(size: Sizes, device_type: str, *extra: str) -> Any:
    """The Config of a part's 1-process training run."""
    from pentatron.config import load_config

    return load_config(None, run_sets(size, device_type, *extra), world_size=1)


def make_trainer(size: Sizes, device: torch.device, work: Path, *extra: str) -> Any:
    from pentatron.train.trainer import Trainer

    steps = size.steps + size.profile_steps + sum(STEP_PROFILE)
    cfg = run_config(size, device.type, "log.progress=false", "log.tensorboard=false",
                     f"log.every={max(1, size.steps // 6)}", f"log.dir={_toml(str(work / 'run'))}", *extra)
    tokens = (steps + 2) * size.global_batch * (size.seq_len + 1)
    data = synthetic_dataset(work / "data", size.model["vocab_size"], tokens)
    return Trainer(cfg, dataset_dir=data)


@dataclass(frozen=True)
class PlannerInputs:
    """What the planner is told about a run; `hardware` names the GPU it prices it on."""

    workload: Any
    layout: Any
    gpu: Any  # GPUSpec: this device's catalogue entry, else the reference GPU
    here: bool  # whether `gpu` is this device (False on a CPU or an uncatalogued GPU)
    kernels: str  # what the run runs: "fused" (compiled blocks) or "eager"

    @property
    def hardware(self) -> str:
        return self.gpu.name if self.here else f"{self.gpu.name} (reference: not this device)"


def planner_inputs(trainer: Any) -> PlannerInputs:
    """The planner's view of the trainer's run, as `observe.report.predicted` builds it."""
    from pentatron.hardware.catalogue import detect_gpu, get_gpu
    from pentatron.observe.report import REFERENCE_GPU, layout_and_workload
    from pentatron.plan.recipes import kernels_for_compile

    device = trainer.device
    gpu = detect_gpu(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    lay, w = layout_and_workload(trainer.cfg.to_dict(), 1, device.type)
    return PlannerInputs(w, lay, gpu or get_gpu(REFERENCE_GPU), gpu is not None,
                         kernels_for_compile(trainer.cfg.train.compile, device.type))


def train_part(trainer: Any) -> dict[str, Any]:
    from pentatron.plan.memory import memory_for_rank
    from pentatron.plan.search import predict

    records = trainer.fit()
    steady = records[min(3, len(records) - 1):]  # the first steps pay for allocator and kernel warm-up
    pi = planner_inputs(trainer)
    w, lay, kernels = pi.workload, pi.layout, pi.kernels
    pred = predict(w, lay, pi.gpu, kernels=kernels)
    mem = memory_for_rank(w, lay, pi.gpu, 0, kernels)
    reserved = [r["peak_mem_reserved_bytes"] for r in records if r.get("peak_mem_reserved_bytes") is not None]
    return {
        "model_parameters": trainer.n_params, "layout": lay.short(), "steps": len(records),
        "tokens_per_step": trainer.tokens_per_step,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady), "peak_source": trainer.peak_source,
        "step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "final_loss": records[-1]["loss"],
        "peak_allocated_gib": _gib(max(r["peak_mem_bytes"] for r in records)),
        "peak_reserved_gib": _gib(max(reserved)) if reserved else None,
        "compiled": trainer.runner.compiled.summary() if trainer.runner.compiled else None,
        "memory_kind": trainer.observer.memory.kind,
        "setup_peak_gib": _gib(trainer.observer.memory.setup_peak_bytes),
        "planner": {"hardware": pi.hardware,
                    "tensors_gib": _gib(mem.tensors), "total_gib": _gib(mem.total),
                    "step_time_s": pred.step.step, "kernels": kernels,
                    "note": "tensors ≈ max_memory_allocated; total adds the CUDA context (1 GiB) and 5 % "
                            "fragmentation ≈ max_memory_reserved + context"},
    }


def attention_backend(names: list[str]) -> str:
    """Which SDPA implementation these kernel (CUDA) or op (CPU) names show."""
    low = [n.lower() for n in names]
    if any("cudnn" in n for n in low):  # before flash: cuDNN's SDPA kernels have "flash" in their names
        return "cudnn"
    if any("flash" in n for n in low):
        return "flash"
    if any("efficient" in n or "fmha" in n for n in low):
        return "mem_efficient"
    return "math"


def sdpa_part(trainer: Any) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        trainer.train_step()
        if cuda:
            torch.cuda.synchronize(trainer.device)
    events = prof.key_averages()
    kernels = [e.key for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    ops = [e.key for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    attn = [n for n in (kernels if cuda else ops)
            if any(s in n.lower() for s in ("flash", "attention", "fmha", "sdpa", "mha"))]
    return {"backend": attention_backend(attn), "from": "CUDA kernels" if cuda else "ATen ops (CPU)",
            "attention_names": sorted(set(attn))[:12],
            "sdpa_ops": sorted({n for n in ops if "scaled_dot_product" in n})}


SYNCING_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


@contextmanager
def count_host_reads(counts: Counter[str]) -> Iterator[None]:
    """CPU stand-in for the sync debug mode: count the Tensor calls that read a value to the host."""
    originals = {m: getattr(torch.Tensor, m) for m in SYNCING_METHODS}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            counts[name] += 1
            return fn(self, *a, **k)
        return counted

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def syncs_part(trainer: Any, steps: int) -> dict[str, Any]:
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    trainer.train_step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
        sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
        return {"syncs_per_step": len(syncs) / steps, "steps": steps, "how": "torch.cuda.set_sync_debug_mode('warn')",
                "top_sites": dict(sites.most_common(10))}
    counts: Counter[str] = Counter()
    with count_host_reads(counts):
        for _ in range(steps):
            trainer.train_step()
    return {"syncs_per_step": sum(counts.values()) / steps, "steps": steps,
            "how": "CPU: Tensor calls that would sync on CUDA (" + ", ".join(SYNCING_METHODS) + ")",
            "by_call": dict(counts)}


# ---------------------------------------------------------------------------- (i) where a step's time goes
STEP_PROFILE = (1, 2)  # un-profiled warm-up steps, profiled steps
# Name fragments (lower case) of each category, tried in this order, the first match wins: Inductor's
# Triton kernels are compiled code whatever they compute, CUTLASS's fmha kernels are attention before
# "cutlass" makes them GEMMs. What matches none is "other": elementwise, reductions, copies.
CATEGORIES = (("nccl", ("nccl", "c10d::", "gloo")),
              ("compiled", ("triton_",)),
              ("attention", ("flash", "fmha", "sdpa", "scaled_dot_product", "attention")),
              ("optimizer", ("multi_tensor_apply", "foreach", "adam")),
              ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul")))
# on a CPU the GEMMs are these ATen ops ("mm" alone would match too much)
CPU_GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul",
                          "aten::linear", "aten::_addmm_activation", "aten::mv", "aten::addmv", "aten::dot"})
CATEGORY_NAMES = ("gemm", "attention", "optimizer", "compiled", "nccl", "other")  # as reported
# kineto activity types that occupy the GPU; a GPU-side user annotation (a record_function range drawn on
# the device's timeline) or a CUPTI sync record spans other work and idle gaps, and is not counted
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_RECORDS = frozenset({"Event Sync", "Stream Wait Event", "Stream Sync", "Context Sync", "Unknown Sync"})


def kernel_category(name: str) -> str:
    """The category of a device kernel's (CUDA) or ATen op's (CPU) name."""
    if name in CPU_GEMM_OPS:
        return "gemm"
    low = name.lower()
    return next((c for c, frags in CATEGORIES if any(f in low for f in frags)), "other")


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: kernels that overlap on concurrent streams count once."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _device_work(event: Any, not_work: set[str]) -> bool:
    """Whether a CUDA-side profiler event is work on the GPU (a kernel, a copy or a memset); `not_work`: the
    names of the host's user annotations and of CUPTI's sync records."""
    kind = getattr(event, "activity_type", None)  # torch builds whose FunctionEvent carries kineto's type
    if isinstance(kind, str) and kind:
        return kind in DEVICE_WORK
    return not getattr(event, "is_user_annotation", False) and event.name not in not_work


def profile_seconds(events: list[Any], cuda: bool) -> tuple[list[tuple[str, float]], float]:
    """(name, seconds) of each device kernel (CUDA) or ATen op (CPU: its self time, so that nested ops count
    once), and the busy seconds: the union of the kernels' intervals (CUDA) or the sum of the ops' self
    times, which one thread's ops cannot overlap (CPU)."""
    DT = torch.autograd.DeviceType
    if cuda:
        not_work = SYNC_RECORDS | {e.name for e in events
                                   if e.device_type == DT.CPU and getattr(e, "is_user_annotation", False)}
        device = [e for e in events if e.device_type == DT.CUDA]
        work = [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6) for e in device if _device_work(e, not_work)]
        if not work:  # say what the profiler gave rather than report an idle GPU
            kinds = Counter(str(getattr(e, "activity_type", "?")) for e in device)
            raise RuntimeError(f"no kernel among {len(device)} CUDA-side profiler events (activity types: "
                               f"{dict(kinds)})")
        return [(n, end - start) for n, start, end in work], busy_seconds([(start, end) for _, start, end in work])
    rows = [(e.name, e.self_cpu_time_total / 1e6) for e in events
            if e.device_type == DT.CPU and e.name.startswith("aten::") and not getattr(e, "is_user_annotation", False)]
    return rows, sum(secs for _, secs in rows)


def planner_split(pi: PlannerInputs) -> tuple[dict[str, float], dict[str, float] | None, str | None]:
    """The planner's step for the run (`predict(...).step`) and, where its public pieces give one, its split
    into GEMMs (the decoder layers' `dense_linears`, the LM head's `head_gemm` and the chunked loss's replay
    of it), attention (`attention_times`), the optimizer (`StepTime.optimizer`) and the rest (elementwise,
    loss, embedding, gradient accumulation), in seconds per step. Else None and why."""
    from pentatron.plan.flops import loss_replayed_tokens
    from pentatron.plan.search import predict
    from pentatron.plan.timing import attention_times, dense_linears, head_gemm

    w, lay, gpu = pi.workload, pi.layout, pi.gpu
    st = predict(w, lay, gpu, kernels=pi.kernels).step
    step = {"step_s": st.step, "optimizer_s": st.optimizer}
    # forward GEMMs and attention cores replayed in backward, per recompute mode (plan/timing.py layer_phase)
    replay = {"none": (0.0, 0.0), "selective": (0.0, 1.0), "full": (1.0, 1.0), "full-alternate": (0.5, 0.5)}
    if w.moe_spec is not None:
        return step, None, "MoE layers: their expert GEMMs are not in dense_linears"
    if lay.world != 1:
        return step, None, f"{lay.short()}: the split is written for one GPU (no pipeline bubble or collectives)"
    if lay.recompute not in replay:
        return step, None, f"recompute {lay.recompute!r}: which matmuls it replays is inside layer_phase"
    gemm_replay, attn_replay = replay[lay.recompute]
    lin = dense_linears(w, lay, gpu)
    layer = lin.qkv + lin.o + lin.up + lin.down
    head = head_gemm(w, lay, gpu)
    tokens = lay.micro_batch * w.seq_len / lay.cp
    head_s = head.total
    if lay.recipe.cross_entropy == "chunked":
        head_s += head.f * loss_replayed_tokens(tokens, lay.recipe.loss_chunk_tokens) / tokens
    attn_f, attn_b = attention_times(w, lay, gpu)
    m, n = lay.microbatches(w), w.cfg.n_layers
    gemm = m * (n * (layer.total + gemm_replay * layer.f) + head_s)
    attention = m * n * (attn_f + attn_b + attn_replay * attn_f)
    split = {"gemm_s": gemm, "attention_s": attention, "optimizer_s": st.optimizer,
             "rest_s": st.step - gemm - attention - st.optimizer}
    return step, split, None


def _wall_per_step(trainer: Any, steps: int) -> float:
    """Wall seconds per training step over `steps` steps, the device drained before and after."""
    from pentatron.calibrate.timers import sync

    sync(trainer.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    sync(trainer.device)
    return (time.perf_counter() - t0) / steps


def step_profile_part(trainer: Any) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    warm, steps = STEP_PROFILE
    warm_wall = _wall_per_step(trainer, warm)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        wall = _wall_per_step(trainer, steps)
    rows, busy = profile_seconds(list(prof.events()), cuda)
    busy /= steps
    cats = dict.fromkeys(CATEGORY_NAMES, 0.0)
    by_name: dict[str, list[float]] = {}
    for name, secs in rows:
        cats[kernel_category(name)] += secs / steps
        calls_secs = by_name.setdefault(name, [0.0, 0.0])
        calls_secs[0] += 1 / steps
        calls_secs[1] += secs / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    out: dict[str, Any] = {
        "from": "CUDA kernels, copies and memsets" if cuda else "ATen ops' self time (CPU)",
        "steps": steps, "categories_s": cats, "busy_s": busy, "wall_s": wall, "idle_fraction": 1 - busy / wall,
        "kernel_s": sum(cats.values()), "overlap_s": sum(cats.values()) - busy,
        "warm_step_wall_s": warm_wall, "idle_fraction_unprofiled": 1 - busy / warm_wall,
        "top_kernels": [{"name": n[:120], "category": kernel_category(n), "calls_per_step": round(c, 2),
                         "s_per_step": s} for n, (c, s) in top],
        "how": (f"{warm} un-profiled warm-up step(s) (its wall: warm_step_wall_s), then {steps} steps under "
                "torch.profiler, device synchronised before and after; per step. busy: "
                + ("the union of the kernels' [start, end] on every stream (sorted by start, merged where they "
                   "overlap); categories sum the kernels' durations, so they exceed busy by overlap_s"
                   if cuda else "the sum of the ATen ops' self times (the categories' sum)")
                + "; wall: perf_counter over the profiled steps (the profiler's host overhead included)")}
    pi = planner_inputs(trainer)
    step, split, why = planner_split(pi)
    out["planner"] = {"hardware": pi.hardware, "kernels": pi.kernels, **step}
    out["planner_split"] = split
    if split is None:
        out["planner_split_reason"] = why
    elif pi.here:  # a datasheet GPU's prediction says nothing about a CPU
        measured = {"gemm_s": cats["gemm"], "attention_s": cats["attention"], "optimizer_s": cats["optimizer"],
                    "rest_s": cats["compiled"] + cats["nccl"] + cats["other"]}
        out["measured_over_predicted"] = {k.removesuffix("_s"): measured[k] / v for k, v in split.items() if v > 0}
        out["measured_over_predicted"].update(step_wall=wall / step["step_s"],
                                              step_wall_unprofiled=warm_wall / step["step_s"])
    return out


# ---------------------------------------------------------------------------- (f) compiled vs eager
def compile_part(size: Sizes, device: torch.device, work: Path, compiled: dict[str, Any]) -> dict[str, Any]:
    """The training part's tokens/s (compiled blocks) against the same run with train.compile=false."""
    if device.type != "cuda":
        return {"status": "skipped: train.compile 'auto' is eager on a CPU (benchmarks/compile_speed.py "
                          "compares compiled and eager there)"}
    if compiled.get("status") != "ok" or not compiled.get("compiled"):
        return {"status": f"skipped: the training part ran no compiled blocks ({compiled.get('status')})"}
    trainer = make_trainer(size, device, work / "eager", "train.compile=false")
    try:
        records = trainer.fit()
    finally:
        trainer.close()
    steady = records[min(3, len(records) - 1):]
    eager = statistics.median(r["tokens_per_s"] for r in steady)
    return {"compiled_tokens_per_s": compiled["tokens_per_s"], "eager_tokens_per_s": eager,
            "speedup": compiled["tokens_per_s"] / eager, "compile_s": compiled["compiled"]["compile_s"],
            "recompiles": compiled["compiled"]["recompiles"], "graphs": compiled["compiled"]["graphs"]}


# ---------------------------------------------------------------------------- (j) multi-GPU
MULTI_STEPS, TOY_MULTI_STEPS = 12, 6  # each layout's run; the steps after the first 3 are its steady rate
MULTI_BUDGET_S, TOY_MULTI_BUDGET_S = 150.0, 120.0  # the whole part: layouts left when it is spent are not started
LAUNCH_GRACE_S = 60.0  # how far past the budget a started launch may run before it is stopped (a hung collective)
TAIL_CHARS = 3000  # of a failed launch's stderr, kept in the JSON


@dataclass(frozen=True)
class MultiLayout:
    name: str
    sets: tuple[str, ...]  # its parallel.* overrides
    dp: int  # the global batch grows with dp: each replica does the training part's step (weak scaling)


def multi_gpu_layouts(n: int, toy: bool) -> list[MultiLayout]:
    """What the part runs on n ranks: on CPU only the first (the suite's cost is a launch per layout)."""
    out = [MultiLayout(f"dp{n} zero1", ("parallel.zero=1",), n)]
    if not toy:
        out += [MultiLayout(f"dp{n} zero3", ("parallel.zero=3",), n),
                MultiLayout(f"tp{n} sp", (f"parallel.tp={n}", "parallel.sp=true"), 1)]
        if n >= 4:
            out.append(MultiLayout(f"tp2 sp dp{n // 2} zero1",
                                   ("parallel.tp=2", "parallel.sp=true", "parallel.zero=1"), n // 2))
    return out


def launch_train(sets: list[str], nproc: int, cwd: Path, timeout_s: float) -> tuple[int | None, str, str]:
    """`pentatron train --nproc N --set ...` as a user runs it (this process's pentatron and interpreter):
    (exit code, None when it was stopped after `timeout_s`; stdout; stderr)."""
    import subprocess

    import pentatron

    env = {k: v for k, v in os.environ.items()  # no outer launcher's variables: the CLI launches its own ranks
           if not k.startswith(("SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(pentatron.__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pentatron.cli", "train", "--nproc", str(nproc), *(f"--set={s}" for s in sets)]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        proc.terminate()  # the elastic agent stops its ranks on SIGTERM; a SIGKILLed one takes them along
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return None, out, err


def multi_gpu_run(layout: MultiLayout, n: int, size: Sizes, device_type: str, data: Path, work: Path,
                  steps: int, timeout_s: float, gpu: Any) -> dict[str, Any]:
    """One layout launched on n ranks: its steady tokens/s from the run's metrics.jsonl, the ledger's bytes,
    and on a catalogue GPU the planner's step for the layout the run wrote to run.json."""
    from dataclasses import replace

    from pentatron.observe.report import RUN_INFO, layout_and_workload, load_records, measured
    from pentatron.plan.comm import bytes_by_dim
    from pentatron.plan.recipes import kernels_for_compile
    from pentatron.plan.search import predict

    log_dir = work / f"multi_{layout.name.replace(' ', '_')}"
    sz = replace(size, global_batch=size.global_batch * layout.dp, steps=steps)
    sets = run_sets(sz, device_type, *layout.sets, "log.progress=false", "log.tensorboard=false",
                    f"log.every={steps}", f"log.dir={_toml(str(log_dir))}", f"data.path={_toml(str(data))}")
    started = time.perf_counter()
    code, out, err = launch_train(sets, n, work, timeout_s)
    row: dict[str, Any] = {"launch_s": round(time.perf_counter() - started, 1), "global_batch": sz.global_batch}
    if code != 0:
        row["status"] = f"failed: exit code {code}" if code is not None else f"failed: stopped after {timeout_s:.0f} s"
        row["stderr_tail"] = (err or out)[-TAIL_CHARS:]
        return row
    found = sorted(p for p in log_dir.iterdir() if (p / "metrics.jsonl").is_file()) if log_dir.is_dir() else []
    if not found:
        row.update(status="failed: exit code 0 but no metrics.jsonl under log.dir", stderr_tail=err[-TAIL_CHARS:])
        return row
    run_dir = found[0]  # the one run (its directory, or `latest` beside it)
    records = load_records(run_dir)
    info = json.loads((run_dir / RUN_INFO).read_text())
    steady = records[min(3, len(records) - 1):]  # the first steps pay for allocator, NCCL and kernel warm-up
    meas = measured(records)
    lay, w = layout_and_workload(info["config"], info["world_size"], device_type)
    row.update(status="ok", layout=lay.short(), world=info["world_size"], steps=len(records),
               tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
               step_time_s=statistics.median(r["step_time_s"] for r in steady), final_loss=records[-1]["loss"],
               peak_gib_rank0=_gib(max(r["peak_mem_bytes"] for r in records)),
               comm_sent_per_step=meas["comm_sent_per_step"], comm_bytes_per_step=meas["comm_bytes_per_step"])
    if gpu is not None:
        kernels = kernels_for_compile(info["config"]["train"]["compile"], device_type)
        st = predict(w, lay, gpu, kernels=kernels).step
        row["planner"] = {"step_time_s": st.step, "tokens_per_s": w.global_batch * w.seq_len / st.step,
                          "kernels": kernels, "dp_exposed_s": st.dp_exposed, "exposed_by_dim": st.exposed_by_dim,
                          "comm_sent_per_step": bytes_by_dim(list(st.collectives))}
        row["measured_over_predicted"] = row["step_time_s"] / st.step
    return row


def multi_gpu_part(size: Sizes, device: torch.device, work: Path) -> dict[str, Any]:
    """Our multi-process training through the CLI launcher, a few layouts on N = min(GPUs, 8) (a power of
    two) NCCL ranks, each beside the planner's step on this GPU's catalogue entry (its calibration applied);
    on CPU (--toy) one layout on 2 gloo ranks, measured only."""
    from pentatron.hardware.catalogue import detect_gpu

    cuda = device.type == "cuda"
    count = torch.cuda.device_count() if cuda else 0
    if cuda and count < 2:
        return {"status": "skipped: one GPU"}
    n = 1 << (min(count, 8).bit_length() - 1) if cuda else 2
    steps, budget = (MULTI_STEPS, MULTI_BUDGET_S) if cuda else (TOY_MULTI_STEPS, TOY_MULTI_BUDGET_S)
    layouts = multi_gpu_layouts(n, toy=not cuda)
    tokens = (steps + 2) * size.global_batch * max(lay.dp for lay in layouts) * (size.seq_len + 1)
    data = synthetic_dataset(work / "multi_data", size.model["vocab_size"], tokens)
    gpu = detect_gpu(torch.cuda.get_device_name(device)) if cuda else None
    started, runs, skipped = time.perf_counter(), {}, []
    for layout in layouts:
        spent = time.perf_counter() - started
        if spent > budget:
            skipped.append(layout.name)
            continue
        try:
            runs[layout.name] = multi_gpu_run(layout, n, size, device.type, data, work, steps,
                                              budget - spent + LAUNCH_GRACE_S, gpu)
        except Exception as e:  # noqa: BLE001 - one layout's unreadable run must not hide the others'
            runs[layout.name] = {"status": f"failed: {type(e).__name__}: {e}",
                                 "traceback": traceback.format_exc(limit=-6)}
    out: dict[str, Any] = {
        "world": n, "devices": count if cuda else None, "backend": "nccl" if cuda else "gloo", "steps": steps,
        "budget_s": budget, "planner_gpu": gpu.name if gpu else None, "runs": runs,
        "how": "pentatron train --nproc N on the training part's model and random tokens; global batch = the "
               "training part's × dp; median tokens/s of the steps after the first 3 (rank 0's metrics.jsonl); "
               "peak_gib_rank0: allocated since training began on CUDA, the resident set on CPU"}
    if skipped:
        out["skipped_layouts"] = skipped
        out["note"] = f"the part's {budget:.0f} s budget was spent: {', '.join(skipped)} not run"
    if cuda and gpu is None:
        out["note_planner"] = "no catalogue GPU: measured only"
    failed = [name for name, r in runs.items() if r["status"] != "ok"]
    if failed:
        out["status"] = "failed: " + "; ".join(f"{name} ({runs[name]['status'].removeprefix('failed: ')})"
                                               for name in failed)
    return out


# ---------------------------------------------------------------------------- (g) FP8 vs bf16
FP8_RUNS = ("bf16", "tensorwise", "rowwise")


def _fp8_runs(size: Sizes, device: torch.device, work: Path, compile_: bool | str) -> dict[str, Any]:
    """bf16, tensorwise and rowwise runs of `size` under train.compile=`compile_`, with the ratios to bf16."""
    runs: dict[str, Any] = {}
    for run in FP8_RUNS:
        fp8 = "off" if run == "bf16" else run
        trainer = make_trainer(size, device, work / f"fp8_{run}{'_compiled' if compile_ else ''}",
                               f"train.compile={_toml(compile_)}", f"train.fp8={_toml(fp8)}")
        try:
            records = trainer.fit()
            compiled = trainer.runner.compiled.summary() if trainer.runner.compiled else None
        finally:
            trainer.close()
            del trainer
            release_memory(device)
        steady = records[min(3, len(records) - 1):]
        runs[run] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
                     "step_time_s": statistics.median(r["step_time_s"] for r in steady),
                     "final_loss": records[-1]["loss"], "steps": len(records),
                     "peak_allocated_gib": _gib(max(r["peak_mem_bytes"] for r in records)),
                     **({"compiled": compiled} if compiled else {})}
    base = runs["bf16"]["tokens_per_s"]
    return {"runs": runs, "speedup": {r: runs[r]["tokens_per_s"] / base for r in FP8_RUNS[1:]}}


def fp8_part(size: Sizes, device: torch.device, work: Path) -> dict[str, Any]:
    """Tokens/s of the same stack, data and seed in bf16 and with train.fp8 tensorwise / rowwise (the trainer's
    FP8 path, parallel/fp8.py), one run after the other, each eager (`runs`, `speedup`); on CUDA the three again
    with compiled blocks (train.compile "auto", the FP8 casts fused inside them: `compiled`, its speedups against
    compiled bf16); the median of the steps after the first 3."""
    from pentatron.config import compile_enabled

    eager = _fp8_runs(size, device, work, False)
    compiled = (_fp8_runs(size, device, work, "auto") if compile_enabled("auto", device.type) else
                {"status": "skipped: train.compile 'auto' is eager on a CPU (the eager runs are the same)"})
    return {"shape": {**size.model, "seq_len": size.seq_len, "micro_batch": size.micro_batch}, **eager,
            "compiled": compiled}


# ---------------------------------------------------------------------------- (c) ring attention's block kernel
def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _best_time(fn: Callable[[], Any], device: torch.device, repeats: int = 5) -> float:
    """Seconds of the fastest of `repeats` calls, the device synchronised around each."""
    from pentatron.calibrate.timers import sync

    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _kernel_case(kernel: Any, inputs: tuple[torch.Tensor, ...], causal: bool, scale: float,
                 refs: tuple[torch.Tensor, ...], tolerance: float, device: torch.device) -> dict[str, Any]:
    """One block kernel against the fp64 references (out, lse, dq, dk, dv), and its forward + backward time."""
    q, k, v, dout = inputs
    case: dict[str, Any] = {"kernel": kernel.name, "causal": causal, "tolerance": tolerance}

    def step() -> tuple[torch.Tensor, ...]:
        out, lse = kernel.forward(q, k, v, causal, scale)
        return out, lse, *kernel.backward(dout, q, k, v, out, lse, causal, scale)

    try:
        got = step()
        case["max_rel_err"] = {n: _rel(a, r) for n, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, refs)}
        case["ok"] = all(e <= tolerance for e in case["max_rel_err"].values())
        case["fwd_bwd_ms"] = round(1e3 * _best_time(step, device, 5 if device.type == "cuda" else 1), 3)
    except Exception as e:  # a kernel this GPU or build lacks: reported, the others still run
        case.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
    return case


def ring_kernel_part(size: Sizes, device: torch.device) -> dict[str, Any]:
    from pentatron.parallel.attention_kernels import CUDA_ONLY, FusedKernel, block_kernel

    math_ = block_kernel("math")
    b, h, s, d = size.ring
    hk, scale = size.ring_kv, d ** -0.5
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
    names = ("fused", *CUDA_ONLY) if device.type == "cuda" else ("fused",)
    cases, ok, chosen = [], True, {}
    for dtype in (torch.float32, torch.bfloat16):
        for causal in (False, True):
            g = torch.Generator(device="cpu").manual_seed(1234 + causal)
            q, dout = (torch.randn(b, h, s, d, generator=g).to(device, dtype) for _ in range(2))
            k, v = (torch.randn(b, hk, s, d, generator=g).to(device, dtype) for _ in range(2))
            q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
            ref_out, ref_lse = math_.forward(q64, k64, v64, causal, scale)
            refs = (ref_out, ref_lse, *math_.backward(do64, q64, k64, v64, ref_out, ref_lse, causal, scale))
            chosen[f"{dtype}{' causal' if causal else ''}".removeprefix("torch.")] = FusedKernel().choose(
                q, k, causal).name
            for name in names:
                if name in ("flash", "cudnn") and dtype == torch.float32:
                    continue  # fp16/bf16 kernels
                case = _kernel_case(block_kernel(name), (q, k, v, dout), causal, scale, refs, tolerance[dtype],
                                    device)
                ok &= case["ok"]
                cases.append({"dtype": str(dtype).removeprefix("torch."), **case})
    return {"shape_bhsd": [b, h, s, d], "kv_heads": hk, "device": str(device), "reference": "math kernel in fp64",
            "fused_chooses": chosen, "all_ok": ok, "cases": cases}


def documents_part(size: Sizes, device: torch.device) -> dict[str, Any]:
    """Document masking's attention as training runs it (CUDA bf16: one varlen flash call; elsewhere the
    per-segment loop) against the loop in fp64: output and dQ/dK/dV, documents of mean length seq/8."""
    from pentatron.models.documents import Documents, _varlen_applies, document_attention, segment_loop_attention

    b, h, s, d = size.ring
    rng = np.random.default_rng(7)
    starts = tuple(tuple(sorted({0, *rng.integers(1, s, size=7).tolist()})) for _ in range(b))
    docs = Documents(starts, s)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(99)
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g).to(device, dtype) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = document_attention(*leaves, docs)
    out.backward(dout)
    ref_leaves = [t.double().detach().requires_grad_() for t in (q, k, v)]
    ref = segment_loop_attention(*ref_leaves, docs)
    ref.backward(dout.double())
    errs = {"out": _rel(out.detach(), ref.detach()),
            **{n: _rel(a.grad, r.grad) for n, a, r in zip(("dq", "dk", "dv"), leaves, ref_leaves)}}
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4

    with torch.no_grad():
        kernel_s = _best_time(lambda: document_attention(q, k, v, docs), device)
        loop_s = _best_time(lambda: segment_loop_attention(q, k, v, docs), device)
    return {"kernel": "varlen flash" if _varlen_applies(q) else "per-segment SDPA loop",
            "shape_bhsd": [b, h, s, d], "documents": sum(len(r) for r in starts), "dtype": str(dtype),
            "max_rel_err": errs, "tolerance": tolerance, "all_ok": all(e <= tolerance for e in errs.values()),
            "forward_ms_kernel": round(1e3 * kernel_s, 3), "forward_ms_loop": round(1e3 * loop_s, 3)}


# ---------------------------------------------------------------------------- (d) one pipeline stage of 70B
def stage_startup_part(size: Sizes, device: torch.device) -> dict[str, Any]:
    from pentatron.models import llama
    from pentatron.models.registry import get_model_config
    from pentatron.observe.profiler import peak_allocation_growth
    from pentatron.parallel.pipeline.stages import PipelineStage, stage_layers

    cfg = get_model_config(size.stage_model)
    with torch.device("meta"):
        full = llama.Llama(cfg)
    ranges = stage_layers(cfg, size.stage_pp, 1, size.seq_len)
    stages = [PipelineStage(full, i, size.stage_pp, ranges[i]) for i in range(size.stage_pp)]
    counts = [sum(p.numel() for p in st.parameters()) for st in stages]
    index = counts.index(max(counts))
    stage = stages[index]
    del full, stages  # only this stage's modules stay referenced (all still on meta)
    param_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    # On CPU no allocator keeps a peak (and RSS reuses pages freed by the parts before): the profiler's
    # allocation events give the same figure, the most tensor bytes live at once.
    watch = nullcontext() if cuda else torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                              profile_memory=True)
    start = time.perf_counter()
    with watch as prof:
        stage.to_empty(device=device)
        llama.init_weights(stage, 0)  # the model's own init, by parameter name: the stage keeps the full names
        if cuda:
            torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else peak_allocation_growth(prof, device)
    finite = all(bool(torch.isfinite(p).all()) for p in stage.parameters())
    del stage
    return {"model": size.stage_model, "pp": size.stage_pp, "stage": index, "layers": [ranges[index].start,
            ranges[index].stop], "stage_parameters": max(counts), "stage_param_gib": _gib(param_bytes),
            "full_model_fp32_gib": _gib(4 * sum(counts)), "startup_s": round(seconds, 3),
            "peak_gib": _gib(peak), "peak_over_stage_params": round(peak / param_bytes, 3),
            "measured": "CUDA max_memory_allocated above the baseline" if cuda
            else "CPU: the profiler's allocation events, most tensor bytes live at once",
            "weights_finite": finite}


# ---------------------------------------------------------------------------- (h) kernel rates against the time model
# (name, tokens, n_out, n_in): the training part's linears (1B, 4 x 4096 tokens), Llama-3-8B's (2 x 4096) and
# Llama-3-70B's at tp 1 (1 x 4096), and an M = N = 8192 sweep over K (the planner's small-k term)
GEMM_SHAPES = (("1b qkv", 16384, 4096, 2048), ("1b o", 16384, 2048, 2048), ("1b gate_up", 16384, 11264, 2048),
               ("1b down", 16384, 2048, 5632), ("1b head", 16384, 32000, 2048),
               ("8b qkv", 8192, 6144, 4096), ("8b o", 8192, 4096, 4096), ("8b gate_up", 8192, 28672, 4096),
               ("8b down", 8192, 4096, 14336), ("8b head", 8192, 128256, 4096),
               ("70b qkv", 4096, 10240, 8192), ("70b o", 4096, 8192, 8192), ("70b gate_up", 4096, 57344, 8192),
               ("70b down", 4096, 8192, 28672),
               ("k1024", 8192, 8192, 1024), ("k4096", 8192, 8192, 4096), ("k16384", 8192, 8192, 16384))
# (name, batch, heads, kv heads, seq, head dim): causal GQA attention as the models call SDPA
ATTENTION_SHAPES = (("1b s4096", 4, 16, 8, 4096, 128), ("8b s2048", 8, 32, 8, 2048, 128),
                    ("8b s4096", 4, 32, 8, 4096, 128), ("8b s8192", 2, 32, 8, 8192, 128),
                    ("70b s8192", 1, 64, 8, 8192, 128))
TOY_GEMM_SHAPES = (("toy", 256, 128, 64), ("toy k", 128, 128, 256))
TOY_ATTENTION_SHAPES = (("toy", 2, 4, 2, 128, 16),)
SDPA_BACKENDS = ("default", "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def _timed(fn: Callable[[], Any], device: torch.device, budget_s: float = 0.05) -> float:
    """Mean seconds of `fn` over enough calls to fill `budget_s` (CUDA events on a GPU), after 2 warm-ups. Not
    calibrate.timers.timed: that checks its budget by draining the device after every call past the third, a host
    round trip per call that sub-millisecond kernels (the attention backward at seq 2048) would pay."""
    for _ in range(2):
        fn()
    cuda = device.type == "cuda"
    once = _best_time(fn, device, 1)
    reps = max(3, min(50, int(budget_s / max(once, 1e-6))))
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant figures (a toy CPU GEMM's 0.04 TFLOP/s stays non-zero)."""
    return float(f"{x:.{digits}g}")


def _causal_sdpa(qkv: tuple[torch.Tensor, ...], dout: torch.Tensor | None = None) -> None:
    """Causal GQA attention as the models call it; with `dout`, its backward too."""
    out = torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True)
    if dout is not None:
        out.backward(dout)


def kernel_rates_part(device: torch.device) -> dict[str, Any]:
    """Each GEMM of a linear (forward, dX, dW) and causal attention (forward, backward) timed on random bf16
    operands, beside the seconds the planner's time model gives the same kernel on this GPU's catalogue entry
    (`Speeds.linear`, `Speeds.attention` with the flash2 efficiencies our recipe is priced with). On a CPU
    (toy) only the measured rates: a datasheet GPU's prediction would not be about this machine."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pentatron.hardware.catalogue import detect_gpu
    from pentatron.plan.recipes import TRAINING_ATTENTION

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    gpu = detect_gpu(torch.cuda.get_device_name(device)) if cuda else None
    peak = gpu.flops("bf16") if gpu else None
    g = torch.Generator(device="cpu").manual_seed(5)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    gemms = []
    for name, m, n, k in GEMM_SHAPES if cuda else TOY_GEMM_SHAPES:
        x, w, dy = rand(m, k), rand(n, k), rand(m, n)
        secs = (_timed(partial(torch.nn.functional.linear, x, w), device), _timed(partial(torch.mm, dy, w), device),
                _timed(partial(torch.mm, dy.t(), x), device))
        row: dict[str, Any] = {"name": name, "tokens": m, "n_out": n, "n_in": k,
                               "ms": [round(1e3 * t, 4) for t in secs],
                               "tflop_s": [_sig(2 * m * n * k / t / 1e12) for t in secs]}
        if gpu:
            pred = gpu.speeds.linear(m, n, k, peak, 2)
            row["predicted_ms"] = [round(1e3 * t, 4) for t in pred]
            row["measured_over_predicted"] = [round(t / p, 3) for t, p in zip(secs, pred)]
        gemms.append(row)
        del x, w, dy
    attention = []
    for name, b, h, hk, s, d in ATTENTION_SHAPES if cuda else TOY_ATTENTION_SHAPES:
        q, k, v = rand(b, h, s, d), rand(b, hk, s, d), rand(b, hk, s, d)
        dout = rand(b, h, s, d)
        flops = 4 * h * d * b * s * (s + 1) / 2  # the planner's count: causal pairs, forward
        row = {"name": name, "bhkvsd": [b, h, hk, s, d], "forward_tflop": flops / 1e12, "backends": {}}
        for backend in SDPA_BACKENDS if cuda else ("default",):
            ctx = nullcontext() if backend == "default" else sdpa_kernel([getattr(SDPBackend, backend)])
            leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
            try:
                with ctx:
                    with torch.no_grad():
                        f = _timed(partial(_causal_sdpa, leaves), device)
                    fb = _timed(partial(_causal_sdpa, leaves, dout), device)
            except Exception as e:  # noqa: BLE001 - a backend this build or shape lacks
                row["backends"][backend] = {"error": f"{type(e).__name__}: {e}"[:200]}
                continue
            bwd = max(fb - f, 1e-9)
            r: dict[str, Any] = {"forward_ms": round(1e3 * f, 4), "backward_ms": round(1e3 * bwd, 4),
                                 "forward_tflop_s": _sig(flops / f / 1e12),
                                 "backward_tflop_s": _sig(2.5 * flops / bwd / 1e12)}
            if gpu:
                pf, pb = gpu.speeds.attention(flops, s, d, "bf16", TRAINING_ATTENTION, peak, 0.0)
                r["measured_over_predicted"] = [round(f / pf, 3), round(bwd / pb, 3)]
                r["efficiency"] = [round(flops / f / peak, 3), round(2.5 * flops / bwd / peak, 3)]
            row["backends"][backend] = r
        attention.append(row)
        del q, k, v, dout
    n = (2**30 if cuda else 2**22) // 2
    src = torch.empty(n, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), device)
    copy = {"bytes_moved": 2 * n * src.element_size(), "gb_s": round(2 * n * src.element_size() / copy_s / 1e9, 1)}
    if gpu:
        copy["planner_gb_s"] = round(gpu.hbm_bandwidth * gpu.efficiency.hbm / 1e9, 1)
    out: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "gemms": gemms, "attention": attention,
                           "copy": copy, "planner_gpu": gpu.name if gpu else None,
                           "how": "random operands; CUDA events, mean of >= 3 calls filling 50 ms, after 2 warm-ups; "
                                  "backward = (forward + backward) - forward"}
    if gpu:
        ratios = [x for r in gemms for x in r["measured_over_predicted"]]
        out["gemm_measured_over_predicted_median"] = statistics.median(ratios)
        for backend in SDPA_BACKENDS:
            got = [r["backends"][backend]["measured_over_predicted"] for r in attention
                   if "measured_over_predicted" in r["backends"].get(backend, {})]
            if got:
                out.setdefault("attention_measured_over_predicted_median", {})[backend] = [
                    statistics.median(x[0] for x in got), statistics.median(x[1] for x in got)]
    return out


CHIP_SPREAD_GEMM = 8192  # m = n = k of the sustained GEMM
CHIP_SPREAD_WARMUP_S, CHIP_SPREAD_S = 3.0, 10.0


def chip_spread_stats(tflop_s: list[float]) -> dict[str, Any]:
    """Per-chip rates of one sustained GEMM (n >= 2): their median, whisker-free spread and the slowest chip's
    time over the median chip's, beside the planner's model for n chips (hardware/chip_spread.py)."""
    from pentatron.hardware.chip_spread import CHIP_SPREAD, slowest_chip

    med = statistics.median(tflop_s)
    return {"tflop_s": [_sig(x) for x in tflop_s], "median_tflop_s": _sig(med),
            "range_over_median": round((max(tflop_s) - min(tflop_s)) / med, 4),
            "sigma_over_median": round(statistics.stdev(tflop_s) / med, 4),
            "slowest_time_over_median": round(med / min(tflop_s), 4),
            "planner_sigma": round(CHIP_SPREAD, 4),
            "planner_slowest": round(slowest_chip(len(tflop_s), CHIP_SPREAD), 4)}


def _sustained_gemm(device: torch.device, out: dict[int, float]) -> None:
    """One GPU's bf16 GEMM rate over CHIP_SPREAD_S seconds, after CHIP_SPREAD_WARMUP_S of the same (a thread)."""
    n = CHIP_SPREAD_GEMM
    with torch.cuda.device(device):
        a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
        for seconds in (CHIP_SPREAD_WARMUP_S, CHIP_SPREAD_S):
            torch.cuda.synchronize(device)
            calls, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                for _ in range(20):
                    torch.mm(a, b)
                calls += 20
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t0
        out[device.index] = 2 * n**3 * calls / elapsed / 1e12


def chip_spread_part(device: torch.device) -> dict[str, Any]:
    """Every GPU of the host running the same GEMM at once: how far apart same-SKU chips are (see the docstring)."""
    import threading

    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2:
        return {"status": f"skipped: needs 2 or more CUDA GPUs (found {gpus})"}
    rates: dict[int, float] = {}
    threads = [threading.Thread(target=_sustained_gemm, args=(torch.device("cuda", i), rates)) for i in range(gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(rates) != gpus:
        return {"status": f"failed: {gpus - len(rates)} of {gpus} GPUs reported no rate"}
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    return {"gpus": gpus, "names": names, "gemm": CHIP_SPREAD_GEMM, "seconds_each": CHIP_SPREAD_S,
            **chip_spread_stats([rates[i] for i in range(gpus)])}


# ---------------------------------------------------------------------------- the GPU's calibration
def calibration(result: dict[str, Any]) -> dict[str, Any]:
    """What this run calibrates on its GPU (calibrate/gpu_calibration.py): the attention curves, SDPA's kernel
    and our step against the model, as a hardware file for `pentatron plan --hardware-profile`."""
    from pentatron.calibrate.gpu_calibration import (
        attention_by_seq,
        calibrated,
        hardware_toml,
        measured_over_model,
        sdpa_kernel,
        with_kernels,
    )
    from pentatron.hardware.catalogue import detect_gpu
    from pentatron.observe.report import planner_layout

    p = result["parts"]
    gpu = None if result["toy"] else detect_gpu(result["device"])
    if gpu is None:
        return {"status": "skipped: no catalogue GPU (toy run, or a GPU the catalogue does not know)"}
    need = [k for k in ("kernel_rates", "sdpa_backend", "train") if p.get(k, {}).get("status") != "ok"]
    if need:
        return {"status": f"skipped: needs parts {', '.join(need)}"}
    curves, sdpa = attention_by_seq(p["kernel_rates"]), sdpa_kernel(p["sdpa_backend"])
    model = with_kernels(gpu, curves, sdpa)
    runs = {"fused": (p["train"]["tokens_per_s"], ())}
    if p.get("compile", {}).get("status") == "ok":
        runs["eager"] = (p["compile"]["eager_tokens_per_s"], ("train.compile=false",))
    ours = {}
    for kernels, (tokens_per_s, extra) in runs.items():
        lay, w = planner_layout(run_config(GPU, "cuda", *extra), 1, "cuda")
        ours[kernels] = measured_over_model(w.global_batch * w.seq_len / tokens_per_s, w, lay, model, kernels)
    eff = calibrated(gpu, curves, sdpa, ours)
    source = f"benchmarks/gpu_check.py on {result['device']}, torch {result['torch']}"
    return {"status": "ok", "base": gpu.name, "attention_by_seq": {k: [list(c) for c in v] for k, v in curves.items()},
            "sdpa_kernel": eff.sdpa_kernel, "our_step": ours, "toml": hardware_toml(gpu.name, eff, source)}


# ---------------------------------------------------------------------------- the run
PARTS = ("kernel_rates", "train", "sdpa_backend", "step_profile", "syncs", "fp8", "compile", "multi_gpu", "chip_spread",
         "ring_kernel", "documents", "stage_startup")


def run(toy: bool, work: Path, only: set[str] | None = None,
        save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every part (or those in `only`), cheapest and most telling first; `save` gets the result after each
    part, so that a run cut short by a time limit still leaves what it measured."""
    cuda = torch.cuda.is_available() and not toy
    size = GPU if cuda else TOY
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "cuda": torch.version.cuda, "toy": not cuda, "parts": {}}
    parts = result["parts"]

    def wanted(*names: str) -> bool:
        return only is None or any(n in only for n in names)

    def record(name: str, out: dict[str, Any]) -> None:
        parts[name] = out
        result["wall_s"] = round(time.perf_counter() - started, 1)
        print(f"gpu_check: {name} {out.get('status')} ({out.get('seconds', 0):.1f} s)", flush=True)
        if save:
            save(result)

    if wanted("kernel_rates"):
        record("kernel_rates", part(kernel_rates_part, device))
        release_memory(device)
    if wanted("train", "sdpa_backend", "step_profile", "syncs"):
        try:
            trainer = make_trainer(size, device, work)
        except Exception as e:  # noqa: BLE001
            trainer = None
            failed = {"status": f"failed: {type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
            for name in ("train", "sdpa_backend", "step_profile", "syncs"):
                record(name, failed)
        if trainer is not None:
            try:
                record("train", part(train_part, trainer))
                record("sdpa_backend", part(sdpa_part, trainer))
                record("step_profile", part(step_profile_part, trainer))
                record("syncs", part(syncs_part, trainer, size.profile_steps - 1))
            finally:
                trainer.close()
                del trainer
                release_memory(device)  # the 1B model, its gradients and optimizer state: gone before the rest
    if wanted("fp8"):
        record("fp8", part(fp8_part, FP8_GPU if cuda else FP8_TOY, device, work))
        release_memory(device)
    if wanted("compile"):
        record("compile", part(compile_part, size, device, work, parts.get("train", {})))
        release_memory(device)
    if wanted("multi_gpu"):
        record("multi_gpu", part(multi_gpu_part, size, device, work))
    if wanted("chip_spread"):
        record("chip_spread", part(chip_spread_part, device))
    if wanted("ring_kernel"):
        record("ring_kernel", part(ring_kernel_part, size, device))
    if wanted("documents"):
        record("documents", part(documents_part, size, device))
    if wanted("stage_startup"):
        record("stage_startup", part(stage_startup_part, size, device))
    return result


def multi_gpu_row(r: dict[str, Any]) -> str:
    def one(name: str, x: dict[str, Any]) -> str:
        if x["status"] != "ok":
            return f"{name} {x['status'].upper()}"
        sent = sum(x["comm_sent_per_step"].values()) / MIB
        text = f"{name} {x['tokens_per_s']:,.0f} tokens/s, sent {sent:,.1f} MiB/step"
        if "planner" in x:
            text += (f" (planner {x['planner']['tokens_per_s']:,.0f} tokens/s, "
                     f"{sum(x['planner']['comm_sent_per_step'].values()) / MIB:,.1f} MiB; measured/predicted step "
                     f"{x['measured_over_predicted']:.2f})")
        return text

    return (f"{r['world']} {r['backend']} ranks: " + "; ".join(one(k, x) for k, x in r["runs"].items())
            + (f"; {r['note']}" if "note" in r else "")
            + ("" if r["planner_gpu"] else " (measured only: no catalogue GPU)"))


def table(result: dict[str, Any]) -> str:
    p = result["parts"]
    rows: list[tuple[str, str, str]] = []

    def add(name: str, key: str, text: Callable[[dict[str, Any]], str]) -> None:
        r = p.get(key, {})
        if r.get("status") != "ok":
            rows.append((name, key, r.get("status", "missing")))
            return
        try:
            rows.append((name, key, text(r)))
        except (KeyError, TypeError, ValueError) as e:
            rows.append((name, key, f"(unreadable: {e})"))

    add("(a) training", "train", lambda r: (
        f"{r['model_parameters'] / 1e6:,.1f}M params {r['layout']}: {r['tokens_per_s']:,.0f} tokens/s, MFU "
        f"{100 * r['mfu']:.1f} %, peak "
        + (f"{r['peak_allocated_gib']} GiB resident set (CPU)" if r["peak_reserved_gib"] is None
           else f"{r['peak_allocated_gib']} GiB allocated / {r['peak_reserved_gib']} GiB reserved")
        + f"; planner {r['planner']['tensors_gib']} GiB tensors / {r['planner']['total_gib']} GiB total"))
    add("(b) SDPA backend", "sdpa_backend", lambda r: f"{r['backend']} ({r['from']}: "
        f"{', '.join(r['attention_names'][:3]) or '-'})")
    add("(c) ring block kernel", "ring_kernel", lambda r: (
        f"{'ok' if r['all_ok'] else 'MISMATCH'}; fused picks {', '.join(sorted(set(r['fused_chooses'].values())))}; "
        + ", ".join(f"{c['kernel']} {c['dtype']}{' causal' if c['causal'] else ''} "
                    + (f"{max(c['max_rel_err'].values()):.1e} {c['fwd_bwd_ms']} ms" if "error" not in c else "ERROR")
                    for c in r["cases"])))
    add("(c2) document masking", "documents", lambda r: (
        f"{'ok' if r['all_ok'] else 'MISMATCH'} ({r['kernel']}, {r['documents']} documents); worst rel err "
        f"{max(r['max_rel_err'].values()):.1e}; forward {r['forward_ms_kernel']} ms vs loop {r['forward_ms_loop']} ms"))
    add("(d) stage start-up", "stage_startup", lambda r: (
        f"{r['model']} pp{r['pp']} stage {r['stage']} (layers {r['layers'][0]}-{r['layers'][1] - 1}, "
        f"{r['stage_param_gib']} GiB fp32): {r['startup_s']} s, peak {r['peak_gib']} GiB = "
        f"{r['peak_over_stage_params']} × its parameters (whole model fp32: {r['full_model_fp32_gib']} GiB)"))
    add("(e) syncs per step", "syncs", lambda r: f"{r['syncs_per_step']:g} ({r['how']})")
    add("(f) compiled vs eager", "compile", lambda r: (
        f"{r['compiled_tokens_per_s']:,.0f} vs {r['eager_tokens_per_s']:,.0f} tokens/s = {r['speedup']:.2f}×; "
        f"{r['compile_s']} s compiling, {r['recompiles']} recompiles"))
    add("(g) FP8 vs bf16", "fp8", lambda r: (
        f"h {r['shape']['hidden_size']} × {r['shape']['n_layers']} layers, {r['shape']['micro_batch']}×"
        f"{r['shape']['seq_len']} tokens: eager bf16 {r['runs']['bf16']['tokens_per_s']:,.0f} tokens/s; " + ", ".join(
            f"{k} {r['runs'][k]['tokens_per_s']:,.0f} ({v:.2f}×)" for k, v in r["speedup"].items())
        + ("; compiled bf16 {:,.0f}; ".format(r["compiled"]["runs"]["bf16"]["tokens_per_s"]) + ", ".join(
            f"{k} {r['compiled']['runs'][k]['tokens_per_s']:,.0f} ({v:.2f}×)"
            for k, v in r["compiled"]["speedup"].items()) if "runs" in r["compiled"] else
           f"; compiled {r['compiled']['status']}")))
    add("(h) kernel rates", "kernel_rates", lambda r: (
        f"{len(r['gemms'])} GEMM shapes, measured/predicted median {r['gemm_measured_over_predicted_median']:.2f}; "
        + ", ".join(f"attention {b.lower().removesuffix('_attention')} fwd {f:.2f} bwd {bw:.2f}"
                    for b, (f, bw) in r["attention_measured_over_predicted_median"].items())
        + f"; copy {r['copy']['gb_s']:,} GB/s (planner {r['copy']['planner_gb_s']:,})"
        if r["planner_gpu"] else
        f"{len(r['gemms'])} GEMM shapes, {len(r['attention'])} attention shapes, copy {r['copy']['gb_s']} GB/s "
        "(measured only: no catalogue GPU)"))
    add("(i) step profile", "step_profile", lambda r: (
        f"busy {1e3 * r['busy_s']:.4g} / wall {1e3 * r['wall_s']:.4g} ms per step, idle "
        f"{100 * r['idle_fraction']:.0f} % ({100 * r['idle_fraction_unprofiled']:.0f} % un-profiled); "
        + ", ".join(f"{k} {100 * v / r['busy_s']:.0f} %" for k, v in r["categories_s"].items() if v > 0)
        + ("; measured/predicted " + ", ".join(f"{k} {v:.2f}" for k, v in r["measured_over_predicted"].items())
           if "measured_over_predicted" in r else
           f"; planner ({r['planner']['hardware']}) {1e3 * r['planner']['step_s']:.4g} ms"
           + (f": gemm {1e3 * r['planner_split']['gemm_s']:.4g}, attention "
              f"{1e3 * r['planner_split']['attention_s']:.4g}, rest {1e3 * r['planner_split']['rest_s']:.4g}"
              if r["planner_split"] else f" ({r['planner_split_reason']})"))))
    add("(j) multi-GPU", "multi_gpu", multi_gpu_row)
    add("(k) chip spread", "chip_spread", lambda r: (
        f"{r['gpus']} GPUs, bf16 GEMM {r['gemm']}^3 for {r['seconds_each']:g} s each at once: median "
        f"{r['median_tflop_s']:,} TFLOP/s, range {100 * r['range_over_median']:.1f} %, sigma "
        f"{100 * r['sigma_over_median']:.2f} % (planner {100 * r['planner_sigma']:.2f} %), slowest "
        f"x{r['slowest_time_over_median']:.3f} of the median's time (planner x{r['planner_slowest']:.3f})"))
    width = max(len(r[0]) for r in rows)
    head = f"pentatron gpu_check on {result['device']}, torch {result['torch']}" + \
           (" (toy sizes)" if result["toy"] else "") + f", {result['wall_s']} s"
    return "\n".join([head] + [f"  {name:<{width}}  {text}" for name, _, text in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toy", action="store_true", help="toy sizes on CPU (automatic without CUDA)")
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="where the JSON goes")
    ap.add_argument("--parts", default="", help="comma-separated parts to run (default: all): " + ", ".join(PARTS))
    ap.add_argument("--calibration-out", type=Path, default=None,
                    help="write the GPU's calibration as a hardware file (pentatron plan --hardware-profile)")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="run nothing: the calibration of a stored gpu_check JSON (with --calibration-out)")
    args = ap.parse_args(argv)
    if args.from_json is not None:
        cal = calibration(json.loads(args.from_json.read_text()))
        print(f"gpu_check: calibration {cal['status']}" + (f": our_step {cal['our_step']}, SDPA kernel "
                                                           f"{cal['sdpa_kernel']}" if cal["status"] == "ok" else ""))
        if cal["status"] == "ok" and args.calibration_out is not None:
            args.calibration_out.write_text(cal["toml"])
        return 0 if cal["status"] == "ok" else 1
    only = {p.strip() for p in args.parts.split(",") if p.strip()} or None
    if only and only - set(PARTS):
        print(f"gpu_check: unknown part(s) {', '.join(sorted(only - set(PARTS)))}; known: {', '.join(PARTS)}",
              file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict[str, Any]) -> None:
        args.out.write_text(json.dumps(result, indent=1))

    with tempfile.TemporaryDirectory(prefix="pentatron-gpu-check-") as tmp:
        result = run(args.toy, Path(tmp), only, save)
    result["calibration"] = calibration(result)
    save(result)
    print(table(result))
    print(f"gpu_check: calibration {result['calibration']['status']}")
    if result["calibration"]["status"] == "ok" and args.calibration_out is not None:
        args.calibration_out.write_text(result["calibration"]["toml"])
        print(f"gpu_check: hardware file for `pentatron plan --hardware-profile` in {args.calibration_out}")
    print(f"gpu_check: JSON in {args.out}")
    done = all(r.get("status") == "ok" or r.get("status", "").startswith("skipped") for r in result["parts"].values())
    return 0 if done else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
