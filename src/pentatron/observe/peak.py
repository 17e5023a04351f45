"""A CPU's peak matmul FLOP/s, measured so that it is an upper bound for MFU: all hardware threads,
several sizes, the best of repeats — and a fixed calibration per machine, so that two runs' MFU compare:
stored with the load it was measured under and its date, re-measured only while it was taken on a busy
machine and the machine is quieter now (a busy measurement undershoots; the higher is kept).

A CPU has no datasheet number we can look up portably, and a short single-size matmul taken at
start-up undershoots (the issue that motivated this file: MFU 1.61 against a 0.09 TFLOP/s 'peak').
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
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


QUIET_LOAD = 0.25  # runnable processes per hardware thread below which a calibration is trusted as it is


@dataclass(frozen=True)
class Calibration:
    """A machine's measured peak, with the load it was measured under (1-minute load average per hardware
    thread, before measuring) and when (UTC, ISO 8601); `load` None: an entry older than this record."""

    flops: float
    load: float | None
    measured: str | None

    def describe(self) -> str:
        when = f"calibrated {self.measured[:10]}" if self.measured else "calibrated earlier"
        if self.load is None:
            return f"{when}, load not recorded"
        return f"{when} at load {self.load:.2f}/thread" + ("" if self.load <= QUIET_LOAD else
                                                           ", busy: re-measured when the machine is quieter")


def current_load() -> float:
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def _entry(raw: object) -> Calibration | None:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool) and raw > 0:
        return Calibration(float(raw), None, None)
    if isinstance(raw, dict) and isinstance(raw.get("flops"), (int, float)) and raw["flops"] > 0:
        load = raw.get("load")
        return Calibration(float(raw["flops"]), float(load) if isinstance(load, (int, float)) else None,
                           raw.get("measured") if isinstance(raw.get("measured"), str) else None)
    return None


def _worth_remeasuring(cached: Calibration, load: float) -> bool:
    """A quiet calibration stands; a busy one (or one of unknown load) yields to a quieter machine."""
    if cached.load is None:
        return load <= QUIET_LOAD
    return cached.load > QUIET_LOAD and load < cached.load


def cpu_calibration(dtype: torch.dtype, refresh: bool, path: Path | None = None) -> Calibration:
    """This machine's peak FLOP/s, a fixed calibration so that runs are comparable: measured once, and again
    (`refresh`, by one process per machine: it uses every thread) only while the calibration on file was
    taken on a busy machine and the machine is quieter now — a busy measurement undershoots, so the higher
    of the two is kept. A quiet calibration is never re-measured."""
    path = path or cache_path()
    key = machine_key(dtype)
    try:
        cache = json.loads(path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    cached = _entry(cache.get(key))
    if cached is not None and not refresh:
        return cached
    load = current_load()
    if cached is not None and not _worth_remeasuring(cached, load):
        return cached
    flops = measure_cpu_peak(dtype)
    best = Calibration(flops, load, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if cached is not None and cached.flops > flops:
        best = Calibration(cached.flops, min(load, cached.load if cached.load is not None else load), best.measured)
    cache[key] = {"flops": best.flops, "load": best.load, "measured": best.measured}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the measurement still holds for this run
    return best


def cpu_peak_flops(dtype: torch.dtype, refresh: bool, path: Path | None = None) -> float:
    """`cpu_calibration`'s FLOP/s."""
    return cpu_calibration(dtype, refresh, path).flops
