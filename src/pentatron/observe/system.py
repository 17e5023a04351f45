"""Facts about the device a rank runs on: peak memory and peak FLOP/s (for MFU)."""

from __future__ import annotations

import resource
import sys
import time

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the caching allocator's peak; CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 1024, seconds: float = 0.3) -> float:
    """Achieved FLOP/s of a square matmul on this device: the honest 'peak' when no datasheet applies."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up (threads, kernels)
    iters, start = 0, time.perf_counter()
    while True:
        a @ b
        iters += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * n**3 * iters / elapsed


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float | None) -> tuple[float, str]:
    """Peak dense FLOP/s per device and where the number came from."""
    if override_tflops is not None:
        return override_tflops * 1e12, "train.peak_tflops"
    if device.type == "cuda":
        from pentatron.plan.hardware import detect_gpu

        name = torch.cuda.get_device_name(device)
        spec = detect_gpu(name)
        key = {torch.bfloat16: "bf16", torch.float16: "bf16", torch.float32: "tf32"}.get(dtype, "bf16")
        if spec is not None and key in spec.peak_flops:
            return spec.peak_flops[key], f"datasheet ({spec.name}, {key})"
    return measure_matmul_flops(device, dtype), "measured matmul"
