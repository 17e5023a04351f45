"""Timestamps of the pipeline's actions without a host sync per action.

`mark()` notes "now" in the stream of work: on CPU the host clock (`time.perf_counter()`), on CUDA an
event recorded on the current stream (`torch.cuda.Event(enable_timing=True)`), since a host clock there
times kernel *launches*, not the kernels. `seconds(marks)` turns a step's marks into absolute
`perf_counter` seconds once, at the end of the step: on CUDA it waits for the last event (one sync per
step) and places every event at the host time of the step's first mark plus its elapsed time since it.
That anchor assumes the queue was empty when the step began (true after the previous step's loss was
read), so cross-rank comparisons (`measured_bubble`) stay on one clock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch


class StepTimer(Protocol):
    def mark(self) -> object: ...

    def seconds(self, marks: Sequence[object]) -> list[float]: ...


class HostTimer:
    def mark(self) -> object:
        return time.perf_counter()

    def seconds(self, marks: Sequence[object]) -> list[float]:
        return [float(m) for m in marks]  # type: ignore[arg-type]


class CudaEventTimer:
    def __init__(self) -> None:
        self._origin = torch.cuda.Event(enable_timing=True)
        self._origin.record()
        self._origin_host = time.perf_counter()

    def mark(self) -> object:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, marks: Sequence[object]) -> list[float]:
        if not marks:
            return []
        marks[-1].synchronize()  # type: ignore[attr-defined]  # the last one: every earlier one is done too
        return [self._origin_host + self._origin.elapsed_time(ev) / 1e3 for ev in marks]  # type: ignore[arg-type]


def step_timer(device: torch.device) -> StepTimer:
    """The timer for one step of work on `device`."""
    return CudaEventTimer() if device.type == "cuda" else HostTimer()
