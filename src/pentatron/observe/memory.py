"""A rank's peak memory during training, set-up excluded.

The peak of a run must not be the peak of building it (a full model materialised before sharding, a
checkpoint read): `PeakMemory` is created when training begins, keeps the set-up peak apart, and
resets the counters. On CUDA it reports the caching allocator's peak of allocated tensors and of
reserved memory (what the device actually lost to this process, fragmentation included). On CPU it
reports the process's peak resident set: on Linux writing "5" to /proc/self/clear_refs resets that
peak (VmHWM); where that is not allowed the figure is the peak since the process started, and the
label says so.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")


def process_peak_rss() -> int:
    """Bytes: the process's peak resident set (VmHWM where /proc has it, else getrusage's maxrss)."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


def reset_process_peak_rss() -> bool:
    """Reset the peak resident set to the current one (Linux clear_refs "5"); False where not possible.
    Note that getrusage's ru_maxrss, of this process and as its parent sees it, is reset with it."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


class PeakMemory:
    """Create it when training begins: it remembers the set-up peak and resets the peak counters."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.setup_peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            self.since_training = True
        else:
            self.setup_peak_bytes = process_peak_rss()
            self.since_training = reset_process_peak_rss()

    def read(self) -> dict[str, int | None]:
        """The step record's fields: `peak_mem_bytes` (CUDA: allocated; CPU: resident set) and
        `peak_mem_reserved_bytes` (CUDA's reserved; None on CPU)."""
        if self.cuda:
            return {"peak_mem_bytes": int(torch.cuda.max_memory_allocated(self.device)),
                    "peak_mem_reserved_bytes": int(torch.cuda.max_memory_reserved(self.device))}
        return {"peak_mem_bytes": process_peak_rss(), "peak_mem_reserved_bytes": None}

    @property
    def kind(self) -> str:
        return memory_kind(self.device.type, self.since_training)


def memory_kind(device_type: str, since_training: bool) -> str:
    """What the peak figures are, in words (the summary's label)."""
    if device_type == "cuda":
        return "CUDA caching allocator since training began: allocated tensors / reserved by the allocator"
    if since_training:
        return "CPU process peak resident set since training began (whole process: Python, torch, data)"
    return ("CPU process peak resident set since the process started, set-up included (it cannot be reset "
            "here; whole process: Python, torch, data)")
