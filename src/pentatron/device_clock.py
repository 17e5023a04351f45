"""Times on the clock of the device that does the work, with no host sync per measurement.

On CUDA the host runs ahead of the GPU, so a host timestamp taken "after the forward" only says when the
forward was *queued*. `DeviceClock.mark()` notes a point in the stream of work instead: on CUDA a timing
event recorded on the current stream, on CPU `time.perf_counter()`. Marks are resolved once, at the end of
a step, in one of two ways:

- `seconds(marks)`: each mark as an absolute host-clock second (the pipeline's action slots, compared
  across ranks by `measured_bubble`). On CUDA it waits for the last mark (one sync) and places every
  event at the host time the clock was made plus its elapsed time since then; that anchor assumes the
  queue was empty when the clock was made (a clock per step, made after the previous step's loss was
  read);
- `span(name, start)` … `collect()`: seconds summed per name (the profiler's phases); on CUDA one wait
  for the stream, then every event's elapsed time.

    clock = DeviceClock(device)
    t0 = clock.mark(); ...; clock.span("forward", t0)      # as often as needed
    seconds = clock.collect()                               # {"forward": ...}, once per step
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch


class DeviceClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._spans: list[tuple[str, Any, Any]] = []
        self._origin_host = time.perf_counter()
        self._origin = self.mark() if self.cuda else None

    def mark(self) -> Any:
        """A point in the device's timeline: a recorded CUDA event, or a host timestamp on CPU."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        """`marks` as host-clock seconds (one wait for the device on CUDA: for the last mark)."""
        if not self.cuda:
            return [float(m) for m in marks]
        if not marks:
            return []
        marks[-1].synchronize()  # events complete in stream order: the last one implies the rest
        return [self._origin_host + self._origin.elapsed_time(ev) / 1e3 for ev in marks]

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


def wait_for_compute(device: torch.device) -> None:
    """The host waits for the work queued on `device`'s current (compute) stream — the end of a training step
    on the host's clock — and not for the collectives still in flight on the communication library's own
    streams: ZeRO-1/2's parameter all-gathers, issued after the optimizer, go on while the next step's data and
    first kernels are prepared, and the forward waits them bucket by bucket (a device-wide synchronize would
    drain them here, exposing every one). Nothing to wait for on CPU, where every op has returned."""
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()
