"""Facts about the device a rank runs on: peak memory and peak FLOP/s (for MFU)."""

from __future__ import annotations

import os
import resource
import sys
import time

import torch

from pentatron.observe.peak import cpu_calibration


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


def bounded_mfu(achieved: float, peak: float) -> tuple[float, float]:
    """(MFU, the peak it is taken against) of a step that did `achieved` model FLOP/s per device. A peak is
    the most a device can do, so a step that did more proves the stated peak low (a CPU calibration taken
    on a busy machine, train.peak_tflops set too low, a datasheet entry of another dtype, or a FLOP count
    above the work done, as the full attention square is under a causal kernel): that step's rate is the
    peak then. MFU = achieved / max(peak, achieved), in [0, 1] by that definition."""
    peak = max(peak, achieved)
    return (achieved / peak if peak > 0 else 0.0), peak


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float | None) -> tuple[float, str]:
    """Peak dense FLOP/s per device (on CPU: per rank) and where the number came from."""
    if override_tflops is not None:
        return override_tflops * 1e12, "train.peak_tflops"
    if device.type == "cuda":
        from pentatron.hardware.catalogue import detect_gpu

        name = torch.cuda.get_device_name(device)
        spec = detect_gpu(name)
        key = {torch.bfloat16: "bf16", torch.float16: "bf16", torch.float32: "tf32"}.get(dtype, "bf16")
        if spec is not None and key in spec.peak_flops:
            return spec.peak_flops[key], f"datasheet ({spec.name}, {key})"
        best = max(measure_matmul_flops(device, dtype, n) for n in (4096, 8192, 8192))
        return best, f"measured {name} matmul, best of 3 (no datasheet entry; set train.peak_tflops)"
    # The CPU is shared by this host's ranks: each one's share of the machine's measured peak, so
    # MFU = job FLOP/s ÷ (machine peak × hosts) can never exceed 1.
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cal = cpu_calibration(dtype, refresh=False)
    share = f", ÷ {local_ranks} ranks on this host" if local_ranks > 1 else ""
    return cal.flops / local_ranks, (f"measured CPU peak {cal.flops / 1e12:.3f} TFLOP/s, all {os.cpu_count()} "
                                     f"threads, best over sizes and repeats, {cal.describe()}{share}")
