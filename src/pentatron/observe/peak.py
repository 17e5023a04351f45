"""A CPU's peak matmul FLOP/s, measured so that it is an upper bound for MFU: all hardware threads,
several sizes, the best of repeats, and remembered per machine as the best ever seen (a measurement
taken while the machine was busy can only raise it later, never lower it).

A CPU has no datasheet number we can look up portably, and a short single-size matmul taken at
start-up undershoots (the issue that motivated this file: MFU 1.61 against a 0.09 TFLOP/s 'peak').
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

SIZES = (256, 512, 1024, 2048)


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "pentatron" / "cpu_peak_flops.json"


def machine_key(dtype: torch.dtype) -> str:
    """What the peak depends on: the host, its CPU model and thread count, torch's kernels, the dtype."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}|{model}|{os.cpu_count()} threads|torch {torch.__version__}|{dtype}"


def measure_cpu_peak(dtype: torch.dtype = torch.float32, sizes: tuple[int, ...] = SIZES, repeats: int = 3,
                     seconds: float = 0.08) -> float:
    """Best achieved FLOP/s of square matmuls over `sizes` × `repeats`, using every hardware thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or previous)
    best = 0.0
    try:
        for n in sizes:
            a = torch.randn(n, n, dtype=dtype)
            b = torch.randn(n, n, dtype=dtype)
            a @ b  # warm-up: thread pool, packing buffers
            for _ in range(repeats):
                iters, start = 0, time.perf_counter()
                while True:
                    a @ b
                    iters += 1
                    elapsed = time.perf_counter() - start
                    if elapsed >= seconds:
                        break
                best = max(best, 2 * n**3 * iters / elapsed)
    finally:
        torch.set_num_threads(previous)
    return best


def cpu_peak_flops(dtype: torch.dtype, refresh: bool, path: Path | None = None) -> float:
    """This machine's peak FLOP/s: the cached best, re-measured first when `refresh` (or when nothing
    is cached). Only one process per machine should refresh at a time (it uses every thread)."""
    path = path or cache_path()
    key = machine_key(dtype)
    try:
        cache = json.loads(path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    cached = float(cache.get(key, 0.0)) if isinstance(cache.get(key, 0.0), (int, float)) else 0.0
    if cached > 0 and not refresh:
        return cached
    peak = max(cached, measure_cpu_peak(dtype))
    if peak > cached:
        cache[key] = peak
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home: the measurement still holds for this run
    return peak

