"""Every collective and point-to-point call, and the per-step communication ledger.

Nothing else in Pentatron calls `torch.distributed` collectives: each call here records one
`CommEvent` (op, mesh dimension, dtype, bytes, time issued), which is what makes the ledger exact.

What "bytes" means (per rank, per call), for a tensor of S bytes and a group of N ranks:

- `payload_bytes`: the logical buffer the op works on: the tensor of an all-reduce or broadcast, the
  *full* (N-chunk) input of a reduce-scatter, the *full* output of an all-gather, the message of a
  send/recv.
- `bytes` (the number the ledger sums and the trainer logs as `comm_bytes`): what this rank sends
  on the wire under the bandwidth-optimal ring algorithm NCCL uses for large messages, which is also
  what it receives: all-reduce 2(N−1)/N·S, reduce-scatter (N−1)/N·S, all-gather (N−1)/N·S,
  broadcast (N−1)/N·S (pipelined ring, averaged over ranks), all-to-all the input less the chunk this
  rank keeps ((N−1)/N·S when even), send S (sent), recv S (received).
  These are the Ultra-Scale Playbook's volumes; they do not depend on the backend actually used.

A group of size 1 (or a 1-process run) moves nothing: the op degenerates to a local copy and
nothing is recorded. On gloo (CPU), torch ≥ 2.11 implements `reduce_scatter_tensor` and
`all_gather_into_tensor` natively, so the same calls run on CPU and GPU.

Strict mode (`Comm.strict`, on when the environment has PENTATRON_STRICT_COMM=1, so that spawned
ranks and trainer subprocesses inherit it; the tests' mode, on by default in `tests/multiprocess.py`'s
ranks) holds gloo runs to NCCL's contract, emulated where this layer meets `torch.distributed`
(`nccl_contract`, which lists the rules and what is not emulated), so the code above cannot tell:
- one work per p2p batch, as NCCL's `batch_isend_irecv` returns (`batch_p2p` gives its callers one
  handle per batch in every mode, so they never pair handles with ops);
- ordering: `batch_p2p` waits for every operation of the batch before it returns, so no later
  operation (point-to-point or collective) is issued while a batch is in flight. A send on gloo
  completes only once the peer has posted its receive, so a program whose p2p order would deadlock
  under NCCL (a send blocking until the matching receive runs) hangs here too, instead of passing
  thanks to gloo's asynchronous sends;
- device discipline: every tensor handed to a collective or p2p must be on the run's device
  (`ctx.device`: same device type, and the same index when the context names one), else
  `CommDeviceError` names the op, the dimension and both devices (an NCCL group has no CPU backend);
- a group's first op is joined by every rank of the group (NCCL creates its communicator then), else
  `CommFirstUseError` names the ranks that did not come.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from pentatron.distributed import nccl_contract
from pentatron.distributed.ring import ring_bytes

Op = Literal["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send", "recv", "barrier"]
# torch 2.13 renamed the flat-tensor collectives (the old names still work, with a warning).
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


STRICT_ENV = "PENTATRON_STRICT_COMM"


class CommDeviceError(RuntimeError):
    """A tensor handed to a collective or p2p is not on the run's device (strict mode)."""


@dataclass(frozen=True)
class CommEvent:
    op: str
    dim: str
    dtype: str
    payload_bytes: int
    bytes: int
    group_size: int
    seq: int
    t: float  # time.perf_counter() when issued


@dataclass
class CommSummary:
    """One step's communication: by dimension, then op → bytes / payload bytes / calls."""

    by_dim: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)

    def bytes(self, dim: str | None = None, op: str | None = None) -> int:
        return sum(v["bytes"] for d, ops in self.by_dim.items() if dim in (None, d)
                   for o, v in ops.items() if op in (None, o))

    def calls(self, dim: str | None = None, op: str | None = None) -> int:
        return sum(v["calls"] for d, ops in self.by_dim.items() if dim in (None, d)
                   for o, v in ops.items() if op in (None, o))

    def bytes_map(self) -> dict[str, dict[str, int]]:
        """{dimension: {op: bytes}}: the `comm_bytes` metrics field."""
        return {d: {o: v["bytes"] for o, v in ops.items()} for d, ops in self.by_dim.items()}

    def calls_map(self) -> dict[str, dict[str, int]]:
        return {d: {o: v["calls"] for o, v in ops.items()} for d, ops in self.by_dim.items()}

    def table(self) -> str:
        rows = [f"{'dim':<6} {'op':<15} {'calls':>6} {'payload':>12} {'wire bytes/rank':>16}"]
        for d, ops in sorted(self.by_dim.items()):
            for o, v in sorted(ops.items()):
                rows.append(f"{d:<6} {o:<15} {v['calls']:>6} {_human(v['payload_bytes']):>12} "
                            f"{_human(v['bytes']):>16}")
        if len(rows) == 1:
            rows.append("(no communication)")
        return "\n".join(rows)


def _human(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


class CommLedger:
    """Collects `CommEvent`s between `begin_step()` and `end_step()`."""

    def __init__(self) -> None:
        self.events: list[CommEvent] = []
        self._seq = 0

    def begin_step(self) -> None:
        self.events = []

    def record(self, op: str, dim: str, dtype: torch.dtype, payload_bytes: int, group_size: int,
               wire_bytes: int | None = None) -> None:
        """`wire_bytes`: what this rank really sends, when the ring formula does not say (uneven all-to-all)."""
        self._seq += 1
        sent = ring_bytes(op, payload_bytes, group_size) if wire_bytes is None else wire_bytes
        self.events.append(CommEvent(op, dim, str(dtype).removeprefix("torch."), payload_bytes, sent, group_size,
                                     self._seq, time.perf_counter()))

    def summary(self) -> CommSummary:
        agg: dict[str, dict[str, dict[str, int]]] = defaultdict(
            lambda: defaultdict(lambda: {"bytes": 0, "payload_bytes": 0, "calls": 0}))
        for e in self.events:
            v = agg[e.dim][e.op]
            v["bytes"] += e.bytes
            v["payload_bytes"] += e.payload_bytes
            v["calls"] += 1
        return CommSummary({d: dict(ops) for d, ops in agg.items()})

    def end_step(self) -> CommSummary:
        return self.summary()


class Work:
    """A handle on an issued collective or a whole p2p batch (or an already finished local op); waiting
    it again does nothing."""

    def __init__(self, work: Any | None = None, hooks: Any | None = None) -> None:
        self._work = work
        self._hooks = hooks  # flight recorder: before_wait() / after_wait() (completion, profiler ranges)

    def wait(self) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.before_wait()
        if self._work is not None:
            self._work.wait()
            self._work = None
        if hooks is not None:  # also for a blocking call, which returns no work object
            hooks.after_wait()


@dataclass(frozen=True)
class P2P:
    """One send or receive of a batched exchange; `peer` is a rank *within the dimension's group*."""

    op: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int


class MeshGroups(Protocol):
    """What the comm layer needs of the mesh (`ParallelContext` provides it): the group and size of each
    dimension. A protocol, so that the comm layer does not import the context that owns it."""

    world_size: int
    device: torch.device

    def group(self, dim: str) -> dist.ProcessGroup | None: ...

    def size(self, dim: str) -> int: ...

    def local_rank(self, dim: str) -> int: ...

    def group_ranks(self, dim: str) -> list[int]: ...


class CommRecorder(Protocol):
    """What the comm layer tells an attached recorder (`observe.flight_recorder.FlightRecorder`): each op
    before it is issued (`enter` returns its record, opaque here) and once issued (`issued` returns the
    hooks run around its wait). A protocol, so that the comm layer imports nothing above it."""

    def enter(self, comm: Comm, op: str, dim: str, tensor: torch.Tensor | None, peer: int | None = None) -> Any: ...

    def enter_batch(self, comm: Comm, dim: str, ops: list[tuple[str, torch.Tensor, int]]) -> list[Any]: ...

    def issued(self, recs: list[Any], async_op: bool) -> Any: ...

    def enter_outside(self, comm: Comm, op: str) -> Any: ...

    def leave_outside(self, rec: Any) -> None: ...


class Comm:
    """The comm layer bound to one ParallelContext. `dim` names a mesh dimension ("dp", "tp", …,
    "dp_cp") or "world"."""

    def __init__(self, ctx: MeshGroups, ledger: CommLedger, strict: bool | None = None) -> None:
        self.ctx = ctx
        self.ledger = ledger
        self.recorder: CommRecorder | None = None  # set by observe.watchdog.attach_flight_recorder
        # Strict mode (see the module docstring); None: from the environment.
        self.strict = os.environ.get(STRICT_ENV, "") == "1" if strict is None else strict

    def _check_device(self, op: str, dim: str, *tensors: torch.Tensor) -> None:
        want = self.ctx.device
        for t in tensors:
            got = t.device
            if got.type != want.type or (want.index is not None and got.index != want.index):
                raise CommDeviceError(f"{op} over {dim!r}: a {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} "
                                      f"tensor on {got}, but the run's device is {want} (build it there)")

    def _strict_checks(self, op: str, dim: str, group: dist.ProcessGroup, *tensors: torch.Tensor) -> None:
        """Strict mode, before an op is issued: its tensors on the run's device, and a group's first op
        joined by all its ranks (NCCL's communicator init)."""
        if self.strict:
            self._check_device(op, dim, *tensors)
            nccl_contract.first_use(group, op, dim)

    def _group(self, dim: str) -> tuple[dist.ProcessGroup | None, int]:
        if dim == "world":
            n = self.ctx.world_size
            return (dist.group.WORLD if n > 1 else None), n
        return self.ctx.group(dim), self.ctx.size(dim)

    def _enter(self, op: str, dim: str, tensor: torch.Tensor, payload_bytes: int, n: int,
               wire_bytes: int | None = None, output: torch.Tensor | None = None) -> Any:
        """Ledger, and the flight recorder (numbering, check mode; while profiling it also holds the op's
        tensors, `output` too, until the backend lets go of them) when one is attached."""
        self.ledger.record(op, dim, tensor.dtype, payload_bytes, n, wire_bytes)
        if self.recorder is None:
            return None
        return self.recorder.enter(self, op, dim, tensor, tensors=None if output is None else (tensor, output))

    def _done(self, work: Any, async_op: bool, rec: Any = None) -> Work | None:
        w = Work(work, None if rec is None or self.recorder is None else self.recorder.issued([rec], async_op))
        if async_op:
            return w
        w.wait()
        return None

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, dim: str, op: str = "sum", async_op: bool = False) -> Work | None:
        group, n = self._group(dim)
        if group is None or n == 1:
            return self._done(None, async_op)
        self._strict_checks("all_reduce", dim, group, tensor)
        rec = self._enter("all_reduce", dim, tensor, _nbytes(tensor), n)
        return self._done(dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group, async_op=async_op), async_op, rec)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, dim: str, op: str = "sum",
                       async_op: bool = False) -> Work | None:
        """`input` holds N equal chunks (flat, chunk r for group rank r); `output` gets this rank's
        chunk reduced over the group."""
        group, n = self._group(dim)
        if input.numel() != n * output.numel():
            raise ValueError(f"reduce_scatter over {dim} (size {n}): input has {input.numel()} elements, "
                             f"output {output.numel()}; input must be exactly {n}× output")
        if group is None or n == 1:
            output.copy_(input.view_as(output))
            return self._done(None, async_op)
        self._strict_checks("reduce_scatter", dim, group, output, input)
        rec = self._enter("reduce_scatter", dim, input, _nbytes(input), n, output=output)
        work = _reduce_scatter(output, input, op=_REDUCE_OPS[op], group=group, async_op=async_op)
        return self._done(work, async_op, rec)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, dim: str,
                   async_op: bool = False) -> Work | None:
        """`output` (N× the size of `input`) gets every group rank's `input`, concatenated in rank order."""
        group, n = self._group(dim)
        if output.numel() != n * input.numel():
            raise ValueError(f"all_gather over {dim} (size {n}): output has {output.numel()} elements, "
                             f"input {input.numel()}; output must be exactly {n}× input")
        if group is None or n == 1:
            output.copy_(input.view_as(output))
            return self._done(None, async_op)
        self._strict_checks("all_gather", dim, group, output, input)
        rec = self._enter("all_gather", dim, input, _nbytes(output), n, output=output)
        return self._done(_all_gather(output, input, group=group, async_op=async_op), async_op, rec)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, dim: str,
                   output_splits: list[int] | None = None, input_splits: list[int] | None = None,
                   async_op: bool = False) -> Work | None:
        """Chunk r of `input` (along its first axis) goes to group rank r; `output` receives every rank's
        chunk for this rank, in rank order. Splits (first-axis sizes per rank) may be uneven; None: equal."""
        group, n = self._group(dim)
        if group is None or n == 1:
            output.copy_(input.view_as(output))
            return self._done(None, async_op)
        self._strict_checks("all_to_all", dim, group, output, input)
        row = _nbytes(input) // max(1, input.shape[0])
        own = (input_splits[self.ctx.local_rank(dim)] if input_splits is not None
               else input.shape[0] // n) * row
        rec = self._enter("all_to_all", dim, input, _nbytes(input), n, wire_bytes=_nbytes(input) - own,
                          output=output)
        work = dist.all_to_all_single(output, input, output_splits, input_splits, group=group, async_op=async_op)
        return self._done(work, async_op, rec)

    def broadcast(self, tensor: torch.Tensor, dim: str, src: int = 0, async_op: bool = False) -> Work | None:
        """Broadcast from group rank `src` along `dim`."""
        group, n = self._group(dim)
        if group is None or n == 1:
            return self._done(None, async_op)
        self._strict_checks("broadcast", dim, group, tensor)
        rec = self._enter("broadcast", dim, tensor, _nbytes(tensor), n)
        work = dist.broadcast(tensor, src=self._global(dim, src), group=group, async_op=async_op)
        return self._done(work, async_op, rec)

    def barrier(self, dim: str = "world") -> None:
        group, n = self._group(dim)
        if group is not None and n > 1:
            self._strict_checks("barrier", dim, group)
            rec = None if self.recorder is None else self.recorder.enter(self, "barrier", dim, None)
            dist.barrier(group=group)
            if rec is not None:
                self.recorder.issued([rec], False).after_wait()

    @contextmanager
    def outside(self, op: str) -> Iterator[None]:
        """Collective work that does not go through this layer — DCP's checkpoint save runs its own gathers and
        barriers on the default group — shown to the flight recorder as one world op for its duration, so that
        a rank stopped or killed meanwhile is a pending op the hang watchdog names, as it names one mid-step."""
        recorder = self.recorder
        rec = recorder.enter_outside(self, op) if recorder is not None and self.ctx.world_size > 1 else None
        try:
            yield
        finally:
            if rec is not None:
                recorder.leave_outside(rec)

    # ------------------------------------------------------------------ point to point
    def send(self, tensor: torch.Tensor, dim: str, dst: int) -> None:
        self.batch_p2p([P2P("send", tensor, dst)], dim).wait()

    def recv(self, tensor: torch.Tensor, dim: str, src: int) -> None:
        self.batch_p2p([P2P("recv", tensor, src)], dim).wait()

    def batch_p2p(self, ops: list[P2P], dim: str) -> Work:
        """Issue several sends/receives together (deadlock-free for exchanges); returns one handle for the
        whole batch, whose wait waits for every op of it. One, because NCCL's `batch_isend_irecv` returns
        one work per batch where gloo returns one per op: a caller that never pairs handles with ops runs
        the same on both. In strict mode the batch is done when it returns (NCCL's ordering: see the
        module docstring)."""
        work = self._batch_p2p(ops, dim)
        if self.strict:
            work.wait()
        return work

    def _batch_p2p(self, ops: list[P2P], dim: str) -> Work:
        group, n = self._group(dim)
        if not ops:
            return Work()
        if group is None or n == 1:
            raise ValueError(f"point-to-point along {dim!r} needs a group of more than one rank")
        for o in ops:
            self._strict_checks(o.op, dim, group, o.tensor)  # the group's first use is checked once
        p2p = []
        for o in ops:
            self.ledger.record(o.op, dim, o.tensor.dtype, _nbytes(o.tensor), n)
            fn = dist.isend if o.op == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, o.tensor, self._global(dim, o.peer), group=group))
        recorder = self.recorder
        recs = None if recorder is None else recorder.enter_batch(
            self, dim, [(o.op, o.tensor, self._global(dim, o.peer)) for o in ops])
        work = nccl_contract.one_work(dist.batch_isend_irecv(p2p))  # NCCL's shape on every backend
        # the batch's records are issued, waited and done together, as its one work is on NCCL
        return Work(work, None if recorder is None or recs is None else recorder.issued(recs, True))

    def _global(self, dim: str, group_rank: int) -> int:
        if dim == "world":
            return group_rank
        return self.ctx.group_ranks(dim)[group_rank]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
