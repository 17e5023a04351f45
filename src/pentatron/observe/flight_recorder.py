"""Flight recorder: the last N collectives and point-to-point calls of this rank, numbered per group.

`Comm` calls `enter()` just before it issues an op and the op's `Work` marks the record done when it
is waited on. On CUDA that is not when the op finished: under NCCL `wait()` only makes the current
stream wait for the collective's stream, and returns at once. There the recorder records a CUDA event
on the current stream after the wait (it completes once the collective and everything queued before
it have run) and marks the records done when the event's `query()` says so, polled by the watchdog
thread and at each new op; a collective that hangs on the GPU then stays pending, so the watchdog
sees it, instead of a hang that surfaces later in `float(loss)` with nothing pending.

Each record carries a per-group sequence number (collectives: per mesh dimension, so the k-th dp
all-reduce of rank 0 and of rank 1 are the same op; point to point: per (dimension, direction, peer),
so rank 0's send #k to rank 1 is rank 1's recv #k from rank 0), the op, shape, dtype, training step,
micro-batch and the first call site outside the comm layer.

Those numbers are what the hang watchdog (`observe/watchdog.py`) compares across ranks, and what
check mode (`observe/collective_check.py`) exchanges before each op. Recording is a few attribute
writes and a deque append per op (see benchmarks/flight_recorder.py for its measured cost).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pentatron.observe import backend_release

if TYPE_CHECKING:
    from pentatron.distributed.comm import Comm

DEFAULT_CAPACITY = 512
# Frames in these files are the comm machinery, not the caller worth naming.
_MACHINERY = ("distributed/comm.py", "observe/flight_recorder.py", "observe/collective_check.py", "/contextlib.py")


class FlightRecord:
    """One op as this rank issued it; `done` turns True when its handle has been waited on."""

    __slots__ = ("seq", "op", "dim", "ranks", "peer", "shape", "dtype", "step", "micro", "site", "t", "done",
                 "range", "held")

    def __init__(self, seq: int, op: str, dim: str, ranks: tuple[int, ...], peer: int | None,
                 shape: tuple[int, ...], dtype: str, step: int, micro: int | None,
                 site: tuple[str, int, str], t: float) -> None:
        self.seq, self.op, self.dim, self.ranks, self.peer = seq, op, dim, ranks, peer
        self.shape, self.dtype, self.step, self.micro, self.site, self.t = shape, dtype, step, micro, site, t
        self.done = False
        self.range: Any = None  # profiling: the open record_function range
        self.held: backend_release.Held | None = None  # profiling: the op's tensors until the backend lets go

    @property
    def key(self) -> str:
        """The counter this record is numbered in (see `seq_key`)."""
        return seq_key(self.dim, self.op, self.peer)

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "op": self.op, "dim": self.dim, "ranks": list(self.ranks), "peer": self.peer,
                "shape": list(self.shape), "dtype": self.dtype, "step": self.step, "micro": self.micro,
                "site": format_site(self.site), "t": self.t, "done": self.done}


def seq_key(dim: str, op: str, peer: int | None) -> str:
    """Collectives are numbered per dimension; p2p per direction and peer (global rank)."""
    if peer is None:
        return dim
    return f"{dim}:{op}:{peer}"


def format_site(site: tuple[str, int, str]) -> str:
    path, line, func = site
    parts = path.replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{line} ({func})"


def call_site() -> tuple[str, int, str]:
    """The first frame outside the comm machinery (file, line, function)."""
    f = sys._getframe(2)
    while f.f_back is not None and f.f_code.co_filename.replace("\\", "/").endswith(_MACHINERY):
        f = f.f_back
    return f.f_code.co_filename, f.f_lineno, f.f_code.co_name


class FlightRecorder:
    """Ring buffer of this rank's last `capacity` ops plus per-group counters (entered / completed).

    `step` and `micro` are set by the trainer (`note_step`, `note_micro`) and stamped on each record.
    `check` is the check-mode verifier (None: off). `completion_event` makes a marker with `record()`
    and `query()` (on CUDA `torch.cuda.Event`, see `completion_event_for`); None: an op is done when
    its wait returns (gloo, CPU)."""

    def __init__(self, rank: int, capacity: int = DEFAULT_CAPACITY, check: Any | None = None,
                 completion_event: Callable[[], Any] | None = None) -> None:
        self.rank = rank
        self.records: deque[FlightRecord] = deque(maxlen=capacity)
        self.entered: dict[str, int] = {}
        self.completed: dict[str, int] = {}
        self.step = 0
        self.micro: int | None = None
        self.check = check
        self.last_progress = time.monotonic()
        self.pending = 0  # records entered and not yet waited on
        self._ranks: dict[str, tuple[int, ...]] = {}
        self.timer: Any | None = None  # observe.profiler.CommTimer while profiling
        self.completion_event = completion_event
        self._in_flight: deque[tuple[Any, list[FlightRecord]]] = deque()  # (event, records), issue order
        # With device completions the watchdog's thread marks records done too: the counters take a lock.
        self._lock = threading.Lock()
        self.outside: FlightRecord | None = None  # collective work outside the comm layer in progress (a save)

    # ------------------------------------------------------------------ recording (hot path)
    def enter(self, comm: Comm, op: str, dim: str, tensor: torch.Tensor | None,
              peer: int | None = None, tensors: Sequence[torch.Tensor] | None = None) -> FlightRecord:
        """Number and record one op about to be issued; in check mode, verify it against the group first.
        `tensors`: every tensor the backend gets (default: `tensor`), held while profiling until it lets go."""
        key = seq_key(dim, op, peer)
        seq = self.entered.get(key, 0) + 1
        ranks = self._ranks.get(dim)
        if ranks is None:
            ranks = self._ranks[dim] = tuple(comm.ctx.group_ranks(dim)) if dim != "world" else \
                tuple(range(comm.ctx.world_size))
        shape = tuple(tensor.shape) if tensor is not None else ()
        dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else "-"
        rec = FlightRecord(seq, op, dim, ranks, peer, shape, dtype, self.step, self.micro, call_site(),
                           time.time())
        if self.check is not None and peer is None:
            self.check.verify_collective(comm, rec)
        self.entered[key] = seq
        self.records.append(rec)
        if self.completion_event is None:  # only this thread counts: no lock on the CPU path
            self.pending += 1
            self.last_progress = time.monotonic()
        else:
            self.poll()
            with self._lock:
                self.pending += 1
                self.last_progress = time.monotonic()
        if self.timer is not None:
            rec.held = backend_release.note([tensor] if tensors is None else tensors)
            self.timer.open(rec)
        return rec

    def enter_outside(self, comm: Comm, op: str) -> FlightRecord:
        """Collective work of every rank that bypasses the comm layer (DCP's checkpoint save; see
        `Comm.outside`), recorded as one pending world op until `leave_outside`. Its inner progress is not
        visible here, so a slow write must not look like a hang: while it is pending the watchdog calls
        `alive()` as long as the rank it watches keeps its heartbeat, and only a stopped or dead rank stalls it."""
        with self._lock:
            seq = self.entered.get("world", 0) + 1
            rec = FlightRecord(seq, op, "world", tuple(range(comm.ctx.world_size)), None, (), "-", self.step,
                               self.micro, call_site(), time.time())
            self.entered["world"] = seq
            self.records.append(rec)
            self.pending += 1
            self.last_progress = time.monotonic()
            self.outside = rec
        return rec

    def leave_outside(self, rec: FlightRecord) -> None:
        self.outside = None
        self.done(rec)

    def alive(self) -> None:
        """The watchdog's word that the work outside the comm layer still progresses (see `enter_outside`)."""
        with self._lock:
            if self.outside is not None:
                self.last_progress = time.monotonic()

    def issued(self, recs: list[FlightRecord], async_op: bool) -> _WaitHooks:
        """The op(s) have been handed to the backend; the returned hooks run around their wait."""
        if self.timer is not None and async_op:
            for r in reversed(recs):
                self.timer.close(r)  # the issue; the wait is timed separately
        return _WaitHooks(self, recs, async_op)

    def enter_batch(self, comm: Comm, dim: str, ops: list[tuple[str, torch.Tensor, int]]) -> list[FlightRecord]:
        """Record a batch of (op, tensor, peer global rank) sends/receives (not verified in check mode:
        see CollectiveChecker)."""
        return [self.enter(comm, op, dim, t, peer) for op, t, peer in ops]

    def waited(self, recs: list[FlightRecord]) -> None:
        """The caller's wait on these records returned: done now, or on CUDA once an event recorded
        now on the current stream (ordered after the op by the wait) has completed."""
        if self.completion_event is None:
            for r in recs:
                self.done(r)
            return
        event = self.completion_event()
        event.record()
        self._in_flight.append((event, recs))

    def poll(self) -> None:
        """Mark done the records whose completion event has completed (oldest first; non-blocking)."""
        if not self._in_flight:
            return
        with self._lock:
            while self._in_flight and self._in_flight[0][0].query():
                for r in self._in_flight.popleft()[1]:
                    self._done(r)

    def done(self, rec: FlightRecord) -> None:
        if self.completion_event is None:
            self._done(rec)
            return
        with self._lock:
            self._done(rec)

    def _done(self, rec: FlightRecord) -> None:
        if not rec.done:
            rec.done = True
            self.pending -= 1
            key = rec.key
            if rec.seq > self.completed.get(key, 0):
                self.completed[key] = rec.seq
            self.last_progress = time.monotonic()

    def stalled_for(self) -> float:
        """Seconds since the last progress while some op is still pending (0 when nothing is pending)."""
        if self._in_flight:
            self.poll()
        if self.pending <= 0:
            return 0.0
        return time.monotonic() - self.last_progress

    # ------------------------------------------------------------------ dumps
    def snapshot(self, reason: str) -> dict[str, Any]:
        """Everything the diagnosis needs from this rank, JSON-ready. Safe from another thread: it
        copies the deque first (a record appended meanwhile is simply not included)."""
        records = list(self.records)
        return {"rank": self.rank, "pid": os.getpid(), "host": os.uname().nodename, "reason": reason,
                "time": time.time(), "step": self.step, "micro": self.micro,
                "stalled_s": self.stalled_for(), "entered": dict(self.entered),
                "completed": dict(self.completed), "records": [r.to_dict() for r in records]}


class _WaitHooks:
    """Called by `Work.wait`: profiling ranges around the wait, then the records marked done."""

    __slots__ = ("recorder", "recs", "async_op")

    def __init__(self, recorder: FlightRecorder, recs: list[FlightRecord], async_op: bool) -> None:
        self.recorder, self.recs, self.async_op = recorder, recs, async_op

    def before_wait(self) -> None:
        timer = self.recorder.timer
        if timer is not None and self.async_op:
            for r in self.recs:
                timer.open(r, wait=True)

    def after_wait(self) -> None:
        timer = self.recorder.timer
        for r in self.recs:  # profiling: the backend's references gone before the caller can drop its own
            if r.held is not None:
                if not backend_release.wait_released(r.held) and timer is not None:
                    timer.late += 1
                r.held = None
        if timer is not None:
            for r in reversed(self.recs):
                timer.close(r)
        self.recorder.waited(self.recs)


def completion_event_for(device: Any) -> Callable[[], Any] | None:
    """What tells the recorder an op finished on `device`: a CUDA event there, nothing on CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.Event
    return None


def note_step(comm: Comm, step: int) -> None:
    """Trainer hook: ops from now on belong to optimizer step `step` (micro-batch unknown)."""
    if comm.recorder is not None:
        comm.recorder.step = step
        comm.recorder.micro = None


def note_micro(comm: Comm, micro: int | None) -> None:
    """Trainer hook: ops from now on belong to micro-batch `micro` of the current step."""
    if comm.recorder is not None:
        comm.recorder.micro = micro
