"""Will the run fit in memory? The planner's memory model for this exact layout, asked before any worker
starts, against the device's memory (CUDA) or the host's available RAM for all its local ranks (CPU).

A run that cannot fit is refused with the predicted breakdown and what to change, instead of dying in an
RMSNorm after minutes (or waking the host's OOM killer); `train.allow_overcommit = true` tries anyway.
The prediction is the planner's `memory_per_gpu` (the pipeline rank needing the most) plus what the
planner leaves out because it is no GPU-run question: the RoPE tables of `model.max_seq_len` (two fp32
tables per rank) and, on a CPU host, each process's own footprint (Python, torch, the data loader).
Only a run that cannot fit is refused: the live tensors alone (`required`, no fragmentation margin) must
exceed what the host or device has.
"""

from __future__ import annotations

import os
from pathlib import Path

from pentatron.config import Config, resolved_dp
from pentatron.rank_memory import CPU_PROCESS_BYTES, rope_table_bytes

GiB = 1 << 30
def available_ram_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The host's MemAvailable (None where /proc/meminfo is not there)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_problems(cfg: Config, world_size: int, local_ranks: int) -> list[str]:
    """[] when the run fits (or the user allowed overcommit), else one problem with the breakdown."""
    import torch

    from pentatron.distributed.launch import local_device
    from pentatron.hardware.catalogue import detect_gpu, get_gpu
    from pentatron.observe.report import REFERENCE_GPU, planner_layout
    from pentatron.plan.memory import memory_per_gpu
    from pentatron.plan.recipes import kernels_for_compile

    if cfg.train.allow_overcommit:
        return []
    device = local_device(cfg.train.device)
    try:
        lay, w = planner_layout(cfg, world_size, device.type)
        spec = detect_gpu(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        gpu = spec or get_gpu(REFERENCE_GPU)
        mem = memory_per_gpu(w, lay, gpu, kernels=kernels_for_compile(cfg.train.compile, device.type))
    except Exception:  # noqa: BLE001 - a layout the planner cannot model: it has no opinion, training decides
        return []
    rope = rope_table_bytes(cfg)
    fix = ("lower train.micro_batch or train.seq_len, shard more (parallel.zero, parallel.tp, parallel.pp), use "
           "train.recompute, or set train.allow_overcommit=true to try anyway")
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
        need = mem.required + rope
        where = f"{torch.cuda.get_device_name(device)} has {have / GiB:.1f} GiB"
    else:
        avail = available_ram_bytes()
        if avail is None:
            return []
        per_rank = mem.tensors + rope + CPU_PROCESS_BYTES
        need, have = per_rank * local_ranks, avail
        where = f"this host has {have / GiB:.1f} GiB available for {local_ranks} local rank(s)"
    if need <= have:
        return []
    if rope > need / 2:
        fix = f"lower model.max_seq_len (its RoPE tables alone need {rope / GiB:.1f} GiB per rank), or {fix}"
    parts = {"parameters": mem.parameters, "gradients": mem.gradients, "optimizer": mem.optimizer + mem.master_weights,
             "activations": mem.activations + mem.recompute_working, "logits/loss": mem.logits_loss,
             "comm buffers": mem.comm_buffers, "RoPE tables": rope}
    shown = ", ".join(f"{k} {v / GiB:.2f}" for k, v in parts.items() if v >= GiB / 100)
    per = "per rank" if device.type == "cuda" else f"per rank ({CPU_PROCESS_BYTES >> 20} MiB process each)"
    return [f"the run needs ≈ {need / GiB:.1f} GiB but {where} (predicted {per}, GiB: {shown}; "
            f"dp={resolved_dp(cfg, world_size)} tp={cfg.parallel.tp} pp={cfg.parallel.pp} cp={cfg.parallel.cp}); "
            f"{fix}"]


def local_rank_count(world_size: int) -> int:
    """Ranks on this host: what the outer launcher says, else all of them (a local launch)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else world_size
