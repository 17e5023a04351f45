"""Timing windows for `pentatron bench`'s measurements (bench.py, compiled_kernels.py): mean seconds per
call over a time budget, and the fastest of several windows."""

from __future__ import annotations

import time
from typing import Any

import torch

ATTEMPTS = 3  # a per-layer host term ≤ 0 is noise (another process took the core): measured again


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Any, device: torch.device, seconds: float, min_iters: int = 3) -> float:
    """Mean seconds per call: one warm-up, then repeat until the budget is used (at least min_iters)."""
    fn()
    sync(device)
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        if n >= min_iters:
            sync(device)
            if time.perf_counter() - t0 >= seconds:
                break
    sync(device)
    return (time.perf_counter() - t0) / n


def best_of(fn: Any, device: torch.device, seconds: float, repeats: int = 3, min_iters: int = 3) -> float:
    """The fastest of `repeats` timed windows (seconds per call): on a shared machine the other windows
    measure the neighbours' load, not the kernel (mamf-finder also reports the best)."""
    return min(timed(fn, device, seconds / repeats, min_iters) for _ in range(repeats))
