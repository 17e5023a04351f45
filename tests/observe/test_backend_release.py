"""Issue 46's flaky profiled tensor peak: a buffer whose last reference drops on a thread the profiler does not
see (a gloo worker still holding a finished op's work; the watchdog holding the main thread's frames) was
counted live until the profile ended. While profiling, the comm layer returns once the backend has let go
(observe/backend_release.py), and the watchdog reads the main thread's stack without frame objects. The same
on real gloo ranks: tests/observe/test_report.py's tp2 case."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from pentatron.device_clock import DeviceClock
from pentatron.observe import backend_release
from pentatron.observe.flight_recorder import FlightRecorder
from pentatron.observe.profiler import CommTimer
from pentatron.observe.watchdog import main_thread_stack
from tests.observe.comm_stub import TwoRankComm


def _drop_later(refs: list, seconds: float) -> threading.Thread:
    """Another thread drops `refs` (autograd nodes: C++ references to a tensor, as a backend's work holds)."""
    th = threading.Thread(target=lambda: (time.sleep(seconds), refs.clear()))
    th.start()
    return th


def test_a_profiled_op_returns_once_the_backend_let_go_of_its_tensors():
    rec = FlightRecorder(0)
    rec.timer = CommTimer(DeviceClock(torch.device("cpu")))
    t = torch.ones(4, requires_grad=True)
    out = torch.zeros(8, requires_grad=True)
    a = rec.enter(TwoRankComm(), "all_gather", "tp", t, tensors=(t, out))
    assert [n for _, n in a.held] == [1, 1]  # before the backend got them
    backend = [t.sin(), out.sin()]  # the backend's references, dropped on its own thread after the wait
    th = _drop_later(backend, 0.05)
    rec.issued([a], async_op=False).after_wait()
    assert not backend and t._use_count() == 1 and out._use_count() == 1
    assert a.held is None and a.done and rec.timer.late == 0  # the record keeps no tensor
    th.join()
    rec.timer = None
    b = rec.enter(TwoRankComm(), "all_reduce", "tp", t)  # not profiling: nothing held, nothing waited for
    assert b.held is None


def test_a_reference_the_backend_never_drops_is_counted_late_not_waited_for_ever():
    t = torch.ones(4, requires_grad=True)
    held = backend_release.note([t, None, torch.ones(2, device="meta")])  # CPU tensors only
    assert [x is t for x, _ in held] == [True]
    kept = t.sin()
    start = time.monotonic()
    assert not backend_release.wait_released(held, timeout_s=0.05)
    assert 0.05 <= time.monotonic() - start < 5 and kept.requires_grad


def _blocked_here(go: threading.Event, done: threading.Event) -> None:
    go.set()
    done.wait(10)  # the main thread waits here while the watchdog's thread reads its stack


def test_the_watchdog_reads_the_main_threads_stack_without_frame_objects(monkeypatch):
    """Frame objects made from another thread keep the frames' locals (tensors) alive while that thread holds
    them: the old `sys._current_frames()` read freed them on the watchdog's thread when the main thread had
    left the function meanwhile."""
    go, done, got = threading.Event(), threading.Event(), []

    def no_frames(*_):
        raise AssertionError("frame objects of the main thread made")

    def watch() -> None:
        go.wait(10)
        try:
            got.append(main_thread_stack())
        finally:
            done.set()

    monkeypatch.setattr(sys, "_current_frames", no_frames)
    th = threading.Thread(target=watch)
    th.start()
    _blocked_here(go, done)
    th.join()
    stack = got[0]
    assert len(stack) == 6 and "threading.py" in stack[-1] and "(wait)" in stack[-1], stack  # innermost last
    assert "test_backend_release.py" in stack[-3] and "(_blocked_here): done.wait(10)" in stack[-3], stack
    assert "(test_the_watchdog_reads_the_main_threads_stack_without_frame_objects): _blocked_here(" in stack[-4]


@pytest.mark.parametrize("limit", [1, 3])
def test_the_stack_keeps_the_innermost_frames(limit: int):
    got: list[list[str]] = []
    go, done = threading.Event(), threading.Event()

    def watch() -> None:
        go.wait(10)
        got.append(main_thread_stack(limit))
        done.set()

    th = threading.Thread(target=watch)
    th.start()
    _blocked_here(go, done)
    th.join()
    assert len(got[0]) == limit and "(wait)" in got[0][-1]  # Event.wait → Condition.wait, innermost
    assert limit < 3 or "(_blocked_here)" in got[0][0]
