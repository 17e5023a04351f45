"""`log.profile = "a:b"`: torch.profiler traces of steps a..b on every rank, with Pentatron's own
ranges, and a one-page summary per rank of where the time went.

Ranges (record_function, so they show in Chrome / Perfetto next to torch's ops):
  pentatron/step N            the whole step
  pentatron/forward           each forward of the model (of each pipeline stage chunk)
  pentatron/backward          from the end of a forward to the next forward / the gradient sync's end
  pentatron/optimizer         clipping and the optimizer step
  comm/<dim>/<op>             a blocking collective, or the issue of an async one
  comm/<dim>/<op>/wait        the wait on an async collective or message

Summary per rank (`profile/rank<r>.summary.txt` and .json): wall time of the profiled steps split
into forward, backward, optimizer, communication by dimension, and other (data, logging, Python
between the phases). Communication is the time this rank was *blocked* in the comm layer: a
transfer hidden behind compute costs nothing there, and waiting for a slower peer (a pipeline
bubble, a straggler) counts as communication of that dimension, since that is where the rank
idled. The parts are disjoint, so their shares add up to 100 %: an interval in the comm layer counts
once (a batch's ops together), only inside the step, and is taken out of the phase it fell in.
Times are the device's (`device_clock.DeviceClock`): on CUDA, events recorded on the current
stream at each phase boundary and read once at the end of the step, so a phase is the GPU time its
work took rather than the host time it took to queue it; a blocking comm op (or wait) is the time
the stream waited for the collective. On CPU, wall clock. The trace's device lanes show the kernels.

Memory (`tensor_memory_growth_bytes`): the most bytes of tensors allocated on this rank's device
during the profiled steps and live at once, from the profiler's allocator events. Tensors that were
live before profiling began (parameters, gradient buffers, optimizer state: `model_state_bytes`) are
not in it, so on a CPU, where no allocator keeps statistics, model state + growth is the rank's peak
of tensor memory over those steps. While profiling, every comm op returns only once the backend has let
go of its CPU tensors (`backend_release`): a buffer freed on gloo's worker thread would be a free the
profiler never sees, and would count as live until the end.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from pentatron.device_clock import DeviceClock
from pentatron.observe import backend_release
from pentatron.observe.flight_recorder import FlightRecord

PHASES = ("forward", "backward", "optimizer")
BETWEEN = "between"  # inside a step, outside the phases


class CommTimer:
    """Opens a range per comm op (or its wait) and adds the time this rank was blocked in the comm layer to
    its dimension: once for ops open together (a batch's records open together and close in any order:
    the outermost interval counts), only inside a profiled step, and under the step's phase it fell in
    (`phase`, kept by the profiler; None outside a step), so that it is a disjoint part of the step."""

    def __init__(self, clock: DeviceClock) -> None:
        self.clock = clock
        self.calls: dict[str, int] = defaultdict(int)
        self.phase: str | None = None
        self._open = 0  # ranges open now
        self._start: tuple[str, Any] | None = None  # span name and start of the outermost one, in a step
        self.late = 0  # ops whose tensors the backend still held after backend_release's timeout

    def open(self, rec: FlightRecord, wait: bool = False) -> None:
        rf = record_function(f"comm/{rec.dim}/{rec.op}{'/wait' if wait else ''}")
        rf.__enter__()
        rec.range = rf
        if self._open == 0 and self.phase is not None:
            self._start = (f"comm/{rec.dim}/{self.phase}", self.clock.mark())
        self._open += 1

    def close(self, rec: FlightRecord) -> None:
        if rec.range is None:
            return
        rf, rec.range = rec.range, None
        rf.__exit__(None, None, None)
        self._open -= 1
        if self.phase is not None:
            self.calls[rec.dim] += 1
        if self._open == 0 and self._start is not None:
            name, t0 = self._start
            self._start = None
            self.clock.span(name, t0)


class _Phase:
    """One open record_function range with its start on the device's clock, and the comm timer told
    which phase its ops fall in."""

    def __init__(self, name: str, category: str, clock: DeviceClock, timer: CommTimer) -> None:
        self.rf = record_function(name)
        self.rf.__enter__()
        self.category, self.clock, self.timer = category, clock, timer
        self.t0 = clock.mark()
        timer.phase = BETWEEN if category == "wall" else category  # the step opens between phases

    def close(self) -> None:
        self.rf.__exit__(None, None, None)
        self.clock.span(self.category, self.t0)
        self.timer.phase = None if self.category == "wall" else BETWEEN


class StepProfiler:
    def __init__(self, steps: tuple[int, int], out_dir: Path, rank: int, device: torch.device,
                 recorder: Any, model: nn.Module, model_state: Callable[[], int] | None = None) -> None:
        self.first, self.last = steps
        self.dir = out_dir
        self.rank = rank
        self.device = device
        self.recorder = recorder
        self.modules = list(getattr(model, "stages", None) or [model])
        self.model_state = model_state  # bytes of this rank's persistent model state (live before profiling)
        self.active = False
        self._prof: Any = None
        self._hooks: list[Any] = []
        self._step: _Phase | None = None
        self._fwd: _Phase | None = None
        self._bwd: _Phase | None = None
        self._opt: _Phase | None = None
        self.time: dict[str, float] = defaultdict(float)
        self.comm_s: dict[tuple[str, str], float] = defaultdict(float)  # (dim, phase) -> seconds
        self.clock = DeviceClock(device)
        self.timer = CommTimer(self.clock)
        self.steps_done = 0

    # ------------------------------------------------------------------ trainer hooks (via RunObserver)
    def begin_step(self, step: int) -> None:
        if step == self.first and self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, profile_memory=True)
            self._prof.__enter__()
            self.recorder.timer = self.timer
            self._hooks = [h for m in self.modules for h in (m.register_forward_pre_hook(self._fwd_begin),
                                                             m.register_forward_hook(self._fwd_end))]
            self.active = True
        if self.active:
            self._step = _Phase(f"pentatron/step {step}", "wall", self.clock, self.timer)

    def _fwd_begin(self, *_: Any) -> None:
        self._end_backward()
        self._fwd = _Phase("pentatron/forward", "forward", self.clock, self.timer)

    def _fwd_end(self, *_: Any) -> None:
        if self._fwd is not None:
            self._fwd.close()
            self._fwd = None
        self._bwd = _Phase("pentatron/backward", "backward", self.clock, self.timer)

    def _end_backward(self) -> None:
        if self._bwd is not None:
            self._bwd.close()
            self._bwd = None

    def after_backward(self) -> None:
        if self.active:
            self._end_backward()
            self._opt = _Phase("pentatron/optimizer", "optimizer", self.clock, self.timer)

    def after_optimizer(self) -> None:
        if self.active and self._opt is not None:
            self._opt.close()
            self._opt = None

    def end_step(self, step: int) -> None:
        if not self.active or self._step is None:
            return
        self._end_backward()
        self._step.close()
        self._step = None
        for name, seconds in self.clock.collect().items():  # the step's one wait for the device
            if name.startswith("comm/"):
                self.comm_s[tuple(name.removeprefix("comm/").rsplit("/", 1))] += seconds
            else:
                self.time[name] += seconds
        self.steps_done += 1
        if step >= self.last:
            self.finish()

    def finish(self) -> None:
        """Stop profiling (at step b, or at the end of a shorter run) and write the trace and summary."""
        if not self.active:
            return
        self.active = False
        for h in self._hooks:
            h.remove()
        self.recorder.timer = None
        self._prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.dir / f"rank{self.rank}.trace.json"))
        summary = self.summary()
        summary["tensor_memory_growth_bytes"] = peak_allocation_growth(self._prof, self.device)
        if self.timer.late:  # their frees may have happened on a backend thread, unseen: growth overstated
            summary["backend_release_late"] = self.timer.late
        if self.model_state is not None:
            summary["model_state_bytes"] = self.model_state()
        (self.dir / f"rank{self.rank}.summary.json").write_text(json.dumps(summary, indent=1))
        (self.dir / f"rank{self.rank}.summary.txt").write_text(format_summary(summary) + "\n")

    def summary(self) -> dict[str, Any]:
        """Seconds per category over the profiled steps: compute per phase, communication per dimension,
        other; disjoint parts of the wall time (`split_step_time`)."""
        wall = self.time["wall"]
        compute, comm, other = split_step_time(wall, {k: self.time[k] for k in PHASES}, self.comm_s)
        return {"rank": self.rank, "steps": [self.first, self.first + self.steps_done - 1], "wall_s": wall,
                "compute_s": compute, "comm_s": comm, "comm_calls": dict(self.timer.calls), "other_s": other}


def split_step_time(wall: float, phases: dict[str, float], comm: dict[tuple[str, str], float]
                    ) -> tuple[dict[str, float], dict[str, float], float]:
    """(compute per phase, communication per dimension, other) of `wall` seconds of steps, from the phases'
    seconds and the comm seconds per (dimension, phase they fell in, or `BETWEEN`). Each comm interval lies
    inside its phase and the phases inside the step, all on one clock, so a phase's compute is its time
    less its comm and other is what the step has left: parts of the wall time that add up to it. The
    clamps at 0 absorb rounding and, on CUDA, a comm op recorded on another stream than the phase's (its
    events need not nest inside the phase's): nothing else can make a part negative."""
    in_phase: dict[str, float] = defaultdict(float)
    by_dim: dict[str, float] = defaultdict(float)
    for (dim, phase), seconds in comm.items():
        in_phase[phase] += seconds
        by_dim[dim] += seconds
    compute = {k: max(0.0, v - in_phase[k]) for k, v in phases.items()}
    other = max(0.0, wall - sum(compute.values()) - sum(by_dim.values()))
    return compute, dict(by_dim), other


def peak_allocation_growth(prof: Any, device: torch.device) -> int:
    """Peak over time of the bytes allocated on `device` while `prof` (profile_memory=True) ran and not
    yet freed: the profiler's "[memory]" events (+ allocation, − free) summed in time order."""
    dev = torch.device(device)
    index = (dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else None

    def mine(e: Any) -> bool:
        return (e.name() == "[memory]" and str(e.device_type()).split(".")[-1].lower() == dev.type
                and (index is None or e.device_index() == index))

    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if mine(e))
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def summary_tensor_peak(s: dict[str, Any]) -> int | None:
    """A rank's peak of tensor memory over its profiled steps, from its summary: the model state live
    before them plus the most they allocated at once (None when the summary lacks either)."""
    if "tensor_memory_growth_bytes" not in s or "model_state_bytes" not in s:
        return None
    return s["model_state_bytes"] + s["tensor_memory_growth_bytes"]


def format_summary(s: dict[str, Any]) -> str:
    # shares of the parts' sum: each in [0, 1] by construction (the parts are the wall time, but for a clamp)
    whole = sum(s["compute_s"].values()) + sum(s["comm_s"].values()) + s["other_s"] or 1e-12
    lines = [f"rank {s['rank']}: where the time went, steps {s['steps'][0]}..{s['steps'][1]} "
             f"({s['wall_s']:.3f} s wall)",
             f"  {'category':<30} {'seconds':>9} {'share':>7}"]
    rows = [(f"compute: {k}", v) for k, v in s["compute_s"].items()]
    rows += [(f"comm: {d} ({s['comm_calls'].get(d, 0)} calls)", v) for d, v in sorted(s["comm_s"].items())]
    rows.append(("other / idle between phases", s["other_s"]))
    for name, v in rows:
        lines.append(f"  {name:<30} {v:>9.4f} {100 * v / whole:>6.1f}%")
    total_comm = sum(s["comm_s"].values())
    lines.append(f"  compute {100 * sum(s['compute_s'].values()) / whole:.1f}% · communication "
                 f"{100 * total_comm / whole:.1f}% · other {100 * s['other_s'] / whole:.1f}%")
    if "tensor_memory_growth_bytes" in s:
        lines.append(f"  tensor memory: at most {s['tensor_memory_growth_bytes'] / 2**20:,.1f} MiB allocated during "
                     "these steps and live at once (beyond the tensors that existed before them)")
    if s.get("backend_release_late"):
        lines.append(f"  ({s['backend_release_late']} comm ops' tensors were still held by the backend after "
                     f"{backend_release.RELEASE_TIMEOUT_S:g} s: their frees may be missing, the memory overstated)")
    return "\n".join(lines)
