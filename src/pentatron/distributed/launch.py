"""Process launch: `pentatron train --nproc N` re-executes itself under torchrun; a process started by
torchrun or by SLURM's srun joins the process group from the environment those launchers set."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def adopt_slurm_env() -> None:
    """Map srun's variables onto torchrun's, so `srun pentatron train …` works without torchrun.
    MASTER_ADDR/PORT must come from the job script (the first node of the allocation)."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")


def launched_world_size() -> int | None:
    """The world size set by an outer launcher (torchrun, srun), or None for a plain process."""
    adopt_slurm_env()
    ws = os.environ.get("WORLD_SIZE")
    return int(ws) if ws is not None else None


def run_under_torchrun(nproc: int, argv: list[str]) -> int:
    """Start `nproc` local copies of `pentatron <argv>` with torchrun and return its exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "pentatron.cli", *argv]
    return subprocess.call(cmd)


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the default process group when launched with more than one process (NCCL on GPU, gloo on CPU)."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def local_device(kind: str) -> torch.device:
    """The device for this process: LOCAL_RANK picks the GPU when CUDA is used."""
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device='cuda' but no CUDA device is available")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")
