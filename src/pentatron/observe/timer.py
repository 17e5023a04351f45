"""Intervals measured on the clock of the device that does the work.

On CUDA the host runs ahead of the GPU, so a host timestamp taken "after the forward" only says when
the forward was *queued*. `DeviceClock` marks points in the stream instead: on CUDA a timing event
recorded on the current stream (no synchronisation), on CPU `time.perf_counter()`. Spans are summed
once per step by `collect()`, which on CUDA waits for the stream a single time and then reads every
event's elapsed time; nothing is synchronised per phase.

    clock = DeviceClock(device)
    t0 = clock.mark(); ...; clock.span("forward", t0)      # as often as needed
    seconds = clock.collect()                               # {"forward": ...}, once per step
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch


class DeviceClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._spans: list[tuple[str, Any, Any]] = []

    def mark(self) -> Any:
        """A point in the device's timeline: a recorded CUDA event, or a host timestamp on CPU."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def span(self, name: str, start: Any, end: Any | None = None) -> None:
        """Count the interval `start` → `end` (now, when None) under `name`; resolved by `collect`."""
        self._spans.append((name, start, self.mark() if end is None else end))

    def collect(self) -> dict[str, float]:
        """Seconds per name over the spans since the last call (one wait for the device on CUDA)."""
        spans, self._spans = self._spans, []
        out: dict[str, float] = defaultdict(float)
        if not spans:
            return {}
        if self.cuda:
            spans[-1][2].synchronize()  # events complete in stream order: the last one implies the rest
            for name, start, end in spans:
                end.synchronize()  # a no-op unless it was recorded on another stream
                out[name] += start.elapsed_time(end) / 1000.0
        else:
            for name, start, end in spans:
                out[name] += end - start
        return dict(out)
