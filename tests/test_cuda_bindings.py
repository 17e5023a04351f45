"""What a CUDA run binds that a CPU run leaves alone, decided on CPU (no GPU in the suite; these paths are
unrun on one): the default process group's `device_id` (eager NCCL communicator), TF32 for fp32 matmuls
(the peak MFU and the planner price fp32 at), and the hang watchdog thread's current device."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pentatron.distributed import launch
from pentatron.observe.flight_recorder import FlightRecorder
from pentatron.observe.watchdog import Watchdog
from pentatron.precision import apply_matmul_precision, fp32_matmul_precision, resolve_precision

CUDA1 = torch.device("cuda", 1)
CPU = torch.device("cpu")


def test_the_default_group_is_bound_to_the_rank_gpu_on_cuda_only(monkeypatch):
    assert launch.process_group_device(CUDA1) == {"device_id": CUDA1}
    assert launch.process_group_device(CPU) == {}
    calls: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((("set_device", d), {})))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    store = object()
    launch.init_distributed(CUDA1, store=store)
    launch.init_distributed(CPU, store=store)
    (set_dev, _), (nccl, nccl_kw), (gloo, gloo_kw) = calls
    assert set_dev == ("set_device", CUDA1)  # the current device set before the group binds to it
    assert nccl == ("nccl",) and nccl_kw["device_id"] == CUDA1 and nccl_kw["store"] is store
    assert gloo == ("gloo",) and "device_id" not in gloo_kw


@pytest.mark.parametrize(("precision", "device", "mode"), [
    ("fp32", CUDA1, "high"), ("auto", CUDA1, None), ("bf16", CUDA1, None), ("fp64", CUDA1, None),
    ("fp32", CPU, None), ("auto", CPU, None)])
def test_fp32_matmuls_run_on_tf32_on_cuda_only(precision, device, mode):
    policy = resolve_precision(precision, device)
    assert fp32_matmul_precision(policy, device) == mode
    before = torch.get_float32_matmul_precision()
    try:
        apply_matmul_precision(policy, device)
        assert torch.get_float32_matmul_precision() == (mode or before)
        if mode is not None:  # both of torch's flags agree (reading the legacy one raises when they are mixed)
            assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("device", [CUDA1, CPU])
def test_the_watchdog_thread_sets_its_cuda_device_before_polling(monkeypatch, tmp_path: Path, device):
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))
    polled = threading.Event()

    class Recorder(FlightRecorder):
        def stalled_for(self) -> float:
            if not polled.is_set():
                calls.append(("first poll", CPU))
                polled.set()
            return super().stalled_for()

    dog = Watchdog(Recorder(0), 2, tmp_path, timeout_s=60.0, device=device)
    dog.poll_s = 0.01
    dog.start()
    try:
        assert polled.wait(10)
        time.sleep(0.05)
    finally:
        dog.stop()
    # On the watchdog's own thread, once, before its first poll of the recorder's events.
    bound = [("pentatron-watchdog-0", CUDA1)] if device.type == "cuda" else []
    assert calls == [*bound, ("first poll", CPU)]


@pytest.mark.parametrize("device", [CUDA1, CPU])
def test_the_step_end_waits_for_the_compute_stream_not_the_collectives(monkeypatch, device):
    """The trainer's step-end wait (`wait_for_compute`) syncs the host with the rank's compute stream only: a
    device-wide synchronize would also drain the ZeRO-1/2 parameter all-gathers issued after the optimizer,
    which the next forward waits bucket by bucket."""
    from pentatron.device_clock import wait_for_compute

    calls: list[tuple[str, torch.device]] = []

    class Stream:
        def __init__(self, d: torch.device) -> None:
            self.device = d

        def synchronize(self) -> None:
            calls.append(("stream", self.device))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: Stream(d))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(("device", d)))
    wait_for_compute(device)
    assert calls == ([("stream", CUDA1)] if device.type == "cuda" else [])


def test_host_batches_reach_a_gpu_pinned_and_asynchronously(monkeypatch):
    """A pageable host→GPU copy waits for the stream's queued work (4 syncs per step on an H200): batches go
    through pinned memory with non_blocking; a CPU run, or a tensor already on a device, moves plainly."""
    from pentatron.host_copy import to_device

    calls: list[tuple[str, tuple, dict]] = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append(("pin", (), {})) or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(("to", a, k)) or real_to(self, CPU))
    t = torch.arange(4)
    to_device(t, CUDA1)
    assert calls == [("pin", (), {}), ("to", (CUDA1,), {"non_blocking": True})]
    calls.clear()
    to_device(t, CPU)
    assert calls == [("to", (CPU,), {})]
