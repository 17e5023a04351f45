"""What makes the observer's numbers true on GPU, tested on CPU where it can be: the device clock's CPU
path, the peak-memory reset after set-up, the flight recorder's device-event completion (with a stand-in
event), the PyTorch flight-recorder environment, and the shares the run prints bounded by their
definitions: MFU, and the profiler's split of a step's time."""

from __future__ import annotations

import mmap
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pentatron.device_clock import DeviceClock
from pentatron.distributed.launch import (
    TORCH_TRACE_PREFIX,
    torch_flight_recorder_env,
    torch_trace_dump_prefix,
)
from pentatron.observe.flight_recorder import FlightRecorder, completion_event_for
from pentatron.observe.memory import PeakMemory, memory_kind, process_peak_rss, reset_process_peak_rss
from pentatron.observe.profiler import CommTimer, format_summary, split_step_time
from pentatron.observe.system import bounded_mfu
from pentatron.observe.watchdog import torch_trace_note
from tests.observe.comm_stub import TwoRankComm


def test_device_clock_sums_spans_per_name_on_cpu():
    clock = DeviceClock(torch.device("cpu"))
    assert not clock.cuda and clock.collect() == {}
    t0 = clock.mark()
    time.sleep(0.02)
    clock.span("forward", t0)
    t1 = clock.mark()
    time.sleep(0.01)
    clock.span("forward", t1)
    clock.span("optimizer", t1, t1 + 0.5)
    got = clock.collect()
    assert got["forward"] >= 0.03 and got["optimizer"] == pytest.approx(0.5)
    assert clock.collect() == {}  # collected once


def _resident_bytes() -> int:
    """VmRSS: the resident set now (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_peak_memory_excludes_the_set_up_peak_on_cpu():
    # 256 MiB touched during "set-up", in an anonymous mapping of its own: unmapping it returns the pages
    # to the system whatever the allocator does. (A freed torch tensor need not: on a CI runner the peak after
    # the reset equalled the set-up peak to the byte, the freed pages presumably still resident.)
    blob = mmap.mmap(-1, 256 * 2**20)
    for offset in range(0, len(blob), mmap.PAGESIZE):
        blob[offset] = 1
    assert _resident_bytes() >= 256 * 2**20
    blob.close()
    before = process_peak_rss()
    mem = PeakMemory(torch.device("cpu"))
    assert mem.setup_peak_bytes >= before - 2**20
    got = mem.read()
    assert got["peak_mem_reserved_bytes"] is None
    if mem.since_training:  # Linux lets a process reset its peak: the set-up's 256 MiB are gone
        assert got["peak_mem_bytes"] <= mem.setup_peak_bytes - 200 * 2**20, (got, mem.setup_peak_bytes)
        assert "since training began" in mem.kind
        # The peak follows the resident set after the reset. Compared with VmRSS rather than with the
        # 128 MiB asked for: in a long-lived worker the allocator may serve part of it from pages
        # already resident (seen once in the full suite: the peak stayed put, so did, presumably, RSS).
        rss_before = _resident_bytes()
        big = torch.ones(128 * 2**20 // 4)
        rss_after, peak = _resident_bytes(), mem.read()["peak_mem_bytes"]
        assert peak >= rss_after - 2**20, (peak, rss_after)
        assert peak >= got["peak_mem_bytes"] + (rss_after - rss_before) - 2**20, (got, peak, rss_before, rss_after)
        del big
    else:
        assert "since the process started" in mem.kind
    assert reset_process_peak_rss() == mem.since_training
    assert "reserved" in memory_kind("cuda", True) and "set-up included" in memory_kind("cpu", False)


class FakeEvent:
    """Stands in for torch.cuda.Event: completes when the test says the device got there."""

    device_done = 0
    count = 0

    def __init__(self) -> None:
        FakeEvent.count += 1
        self.n = FakeEvent.count

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.n <= FakeEvent.device_done




def test_a_waited_collective_counts_as_done_only_when_its_device_event_completes():
    rec = FlightRecorder(0, completion_event=FakeEvent)
    comm = TwoRankComm()
    a = rec.enter(comm, "all_reduce", "dp", torch.ones(4))
    rec.issued([a], async_op=False).after_wait()  # NCCL's wait returned: the stream is ordered, no more
    assert not a.done and rec.pending == 1
    time.sleep(0.05)
    assert rec.stalled_for() >= 0.05  # what the watchdog sees while the GPU is stuck in it
    FakeEvent.device_done = FakeEvent.count  # the GPU got past the event
    assert rec.stalled_for() == 0.0 and a.done and rec.completed["dp"] == 1
    b = rec.enter(comm, "all_reduce", "dp", torch.ones(4))
    c = rec.enter(comm, "all_reduce", "dp", torch.ones(4))
    rec.issued([b], async_op=True).after_wait()
    rec.issued([c], async_op=True).after_wait()
    FakeEvent.device_done = FakeEvent.count - 1  # b finished on the device, c not yet
    rec.poll()
    assert b.done and not c.done and rec.snapshot("t")["completed"] == {"dp": 2}


def test_on_cpu_a_collective_is_done_when_its_wait_returns():
    assert completion_event_for(torch.device("cpu")) is None
    rec = FlightRecorder(0)
    a = rec.enter(TwoRankComm(), "all_reduce", "dp", torch.ones(4))
    rec.issued([a], async_op=False).after_wait()
    assert a.done and rec.pending == 0 and rec.stalled_for() == 0.0


def test_torch_flight_recorder_env_is_set_unless_the_user_set_it(tmp_path: Path):
    env: dict[str, str] = {}
    set_now = torch_flight_recorder_env(tmp_path / "flight", env)
    assert env == set_now == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                              "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "flight" / TORCH_TRACE_PREFIX)}
    assert (tmp_path / "flight").is_dir()  # torch writes there from its own thread: it must exist
    assert torch_trace_dump_prefix(env) == str(tmp_path / "flight" / TORCH_TRACE_PREFIX)
    # The user's choices win, under the old or the new name.
    user = {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_FR_DUMP_TEMP_FILE": "/x/t_"}
    assert torch_flight_recorder_env(tmp_path / "other", user) == {}
    assert user == {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_FR_DUMP_TEMP_FILE": "/x/t_"}
    assert torch_trace_dump_prefix(user) == "/x/t_" and not (tmp_path / "other").exists()
    assert torch_trace_dump_prefix({}) == "/tmp/nccl_trace_rank_"


def test_the_diagnosis_line_names_the_torch_dumps(tmp_path: Path):
    prefix = str(tmp_path / TORCH_TRACE_PREFIX)
    (tmp_path / f"{TORCH_TRACE_PREFIX}1").write_bytes(b"x")
    note = torch_trace_note(prefix, 3)
    assert f"dumps: {prefix}<rank> (written: ranks 1)" in note
    assert f"torchfrtrace {tmp_path} --prefix {TORCH_TRACE_PREFIX}" in note


def test_mfu_cannot_exceed_one_a_faster_step_raises_the_peak():
    """MFU = achieved / peak, where a peak is the most the device does: a step faster than the stated peak
    (a busy CPU calibration, a low train.peak_tflops) proves it low and becomes the peak, so MFU is 1, not
    more; at or below the peak it is the plain ratio and the peak stands; no work, 0."""
    assert bounded_mfu(5e12, 1e12) == (1.0, 5e12)
    assert bounded_mfu(1e12, 1e12) == (1.0, 1e12)
    assert bounded_mfu(2.5e11, 1e12) == (0.25, 1e12)
    assert bounded_mfu(0.0, 1e12) == (0.0, 1e12) and bounded_mfu(0.0, 0.0) == (0.0, 0.0)
    peak = 1.0
    for achieved in (3.0, 2.0, 7.0, 7.0, 0.5):  # the trainer's loop: each step against the peak so far
        mfu, peak = bounded_mfu(achieved, peak)
        assert 0.0 <= mfu <= 1.0 and peak >= achieved
    assert peak == 7.0


def test_comm_time_counts_once_inside_the_step_under_its_phase():
    """A batch's ops open together and close in issue order: the interval counts once (it counted once per
    op, so a pipeline's send + recv batch twice); outside a step nothing counts (the step's wall time
    does not hold it either)."""
    clock = DeviceClock(torch.device("cpu"))
    timer = CommTimer(clock)
    send, recv = (SimpleNamespace(dim="pp", op=op, range=None) for op in ("send", "recv"))
    timer.open(send)
    timer.close(send)  # between two steps (phase None)
    timer.phase = "forward"
    start = time.perf_counter()
    timer.open(send)
    timer.open(recv)
    time.sleep(0.02)
    timer.close(send)
    timer.close(recv)
    elapsed = time.perf_counter() - start
    got = clock.collect()
    assert set(got) == {"comm/pp/forward"} and 0.02 <= got["comm/pp/forward"] <= elapsed
    assert dict(timer.calls) == {"pp": 2} and send.range is None and recv.range is None


def _shares(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"(-?[\d.]+)%", text)]


def test_the_profilers_split_of_a_step_is_disjoint_parts_of_it():
    """Comm comes out of the phase it fell in (not spread over the phases), other is what is left: the
    parts add up to the wall time; a comm interval larger than its phase (CUDA: recorded on another
    stream) leaves that phase 0, not negative, and every printed share stays within 0..100 %."""
    phases = {"forward": 3.0, "backward": 4.0, "optimizer": 1.0}
    comm = {("pp", "forward"): 1.0, ("pp", "backward"): 2.0, ("dp", "between"): 0.5}
    compute, by_dim, other = split_step_time(10.0, phases, comm)
    assert compute == {"forward": 2.0, "backward": 2.0, "optimizer": 1.0}
    assert by_dim == {"pp": 3.0, "dp": 0.5} and other == 1.5
    compute, by_dim, other = split_step_time(2.0, {"forward": 1.0, "backward": 1.0, "optimizer": 0.0},
                                             {("pp", "backward"): 1.5})
    assert compute == {"forward": 1.0, "backward": 0.0, "optimizer": 0.0} and other == 0.0
    summary = {"rank": 0, "steps": [2, 3], "wall_s": 2.0, "compute_s": compute, "comm_s": by_dim,
               "comm_calls": {"pp": 4}, "other_s": other}
    shares = _shares(format_summary(summary))
    assert all(0 <= x <= 100 for x in shares) and shares[-3:] == [40.0, 60.0, 0.0], shares
    all_comm = {"rank": 0, "steps": [1, 1], "wall_s": 1.0, "compute_s": {"forward": 0.0}, "comm_s": {"pp": 1.0},
                "comm_calls": {}, "other_s": 0.0}
    assert _shares(format_summary(all_comm))[-3:] == [0.0, 100.0, 0.0]
