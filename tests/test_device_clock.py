"""DeviceClock's absolute times (the pipeline engine's action slots): host clock on CPU; on CUDA, events read
once per step. The CUDA branch runs here against a stand-in `torch.cuda.Event` (host-clocked, counting
synchronisations). Its per-name spans: tests/observe/test_device_truth.py."""

from __future__ import annotations

import time

import pytest
import torch

from pentatron import device_clock as clock_mod
from pentatron.device_clock import DeviceClock


class _Event:
    syncs = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t: float | None = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        _Event.syncs += 1

    def elapsed_time(self, end: _Event) -> float:
        assert self.t is not None and end.t is not None, "both events recorded"
        return (end.t - self.t) * 1e3  # milliseconds, as CUDA's


def test_cpu_uses_the_host_clock():
    t = DeviceClock(torch.device("cpu"))
    assert not t.cuda
    a, b = t.mark(), t.mark()
    assert t.seconds([a, b]) == [a, b] and a <= b


def test_cuda_events_are_read_once_at_the_end(monkeypatch):
    monkeypatch.setattr(clock_mod.torch.cuda, "Event", _Event)
    _Event.syncs = 0
    t = DeviceClock(torch.device("cuda", 0))
    assert t.cuda
    before = time.perf_counter()
    marks = [t.mark() for _ in range(6)]
    after = time.perf_counter()
    assert _Event.syncs == 0  # no sync per action
    secs = t.seconds(marks)
    assert _Event.syncs == 1
    assert secs == sorted(secs) and secs[0] == pytest.approx(before, abs=0.05)
    assert secs[-1] == pytest.approx(after, abs=0.05)
    assert t.seconds([]) == []
