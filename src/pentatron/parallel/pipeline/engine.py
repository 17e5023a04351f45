"""The pipeline engine: executes any valid `Schedule` on this rank's stages, one optimizer step at a time.

The schedule says *what* to run and in which order (F, BW, or split B and W, per micro-batch and
chunk); communication follows from it. An action whose input lives on another rank receives it; a
forward sends its output downstream, a backward sends its input gradient upstream. Every rank knows
the whole schedule, so every rank derives the same point-to-point plan, `schedules.p2p_plan`: per
rank, an ordered list of batches, each a set of sends and receives issued together (one
`batch_p2p`) at a fixed place between two actions. Both ends of a message sit in batches of the same
time slot of the schedule's unit-cost timeline, and every rank issues its batches in slot order: so
the program is deadlock-free under NCCL's rules (per rank, p2p batches complete in issue order; a
send may block until the peer's matching receive runs), which `schedules.validate` checks by replaying
the plan (`check_p2p`). Receive buffers are pre-allocated ([micro_batch, seq, hidden] activations
and gradients) when their batch is issued; an action waits only for the batches holding the receives it
consumes (`batch_p2p` returns one handle per batch, as NCCL does). On gloo the same plan runs; `Comm`
strict mode (PENTATRON_STRICT_COMM=1) emulates NCCL's contract (one work per batch, every batch waited
before the next operation), which is how the tests hold the engine to NCCL's API and ordering.

Memory: a (chunk, micro-batch)'s saved activations are dropped as soon as its last backward action
(BW, or W when split) is done; the engine counts the in-flight ones and reports the peak. Every
action is timed from after its inputs have arrived (so waiting shows up as bubble) to its end: with
CUDA events on a CUDA device (recorded per action, read once at the end of the step), else with
`time.perf_counter()`.

Validation runs a `schedules.forward_only` schedule through its own engine under `torch.no_grad()`:
the same forwards and messages, no saved activations, no listener calls.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pentatron.device_clock import DeviceClock
from pentatron.distributed.comm import P2P, Comm, Work
from pentatron.models.documents import Documents
from pentatron.parallel.pipeline.split_backward import SplitBackward
from pentatron.parallel.pipeline.stages import PipelineStage
from pentatron.schedules import (
    Action,
    Kind,
    MsgKey,
    P2PBatch,
    Schedule,
    Slot,
    busy_window,
    idle_share,
    p2p_plan,
    validate,
)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class BackwardListener(Protocol):
    """Told about every backward action (the data-parallel engine: when a chunk's gradients are final)."""

    def before_backward(self, chunk: int, last: bool, weights_only: bool = False) -> None: ...

    def after_backward(self, chunk: int) -> None: ...


@dataclass
class PipelineStepResult:
    """What one step of the engine produced on this rank."""

    loss: torch.Tensor | None  # mean loss over the micro-batches (on the rank holding the last stage)
    slots: list[Slot]  # every executed action, absolute time.perf_counter() start/end (CUDA events on CUDA)
    peak_in_flight: int  # most (chunk, micro-batch) activation sets held at once
    losses: list[torch.Tensor] = field(default_factory=list)  # per micro-batch, unscaled


@dataclass
class _Saved:
    """A (chunk, micro-batch)'s state between its forward and its last backward action."""

    input: torch.Tensor | None  # the received activation (a leaf requiring grad); None on stage 0
    output: torch.Tensor  # the stage output, or the scaled loss on the last stage
    sent: MsgKey | None = None  # the message carrying `output` downstream (its send is done once the grad came back)
    split: SplitBackward | None = None


class PipelineEngine:
    """Runs `schedule` for pipeline rank `rank` over `stages` (this rank's chunks, in chunk order).

    `act_shape(micro_batch_inputs)` gives the activation shape crossing stage boundaries (default
    [b, s, hidden]); `act_dtype` its dtype (default: the stages' parameter dtype). `dim` is the mesh
    dimension whose group ranks are the pipeline ranks. `listener` is told before and after every
    backward action which chunk it is for and whether it is that chunk's last one producing weight
    gradients in this step (so that gradient reduction can start while other chunks still compute).
    `plan`: the point-to-point batches of every rank (default `schedules.p2p_plan(schedule)`, which
    `validate` proves deadlock-free under NCCL's rules); another plan runs as given, unchecked (a test
    runs the pre-issue-35 order to show that strict mode catches it).
    """

    def __init__(self, stages: Sequence[PipelineStage], schedule: Schedule, comm: Comm, rank: int,
                 loss_fn: LossFn, *, dim: str = "pp", act_shape: Callable[[torch.Tensor], torch.Size] | None = None,
                 act_dtype: torch.dtype | None = None, listener: BackwardListener | None = None,
                 plan: Sequence[Sequence[P2PBatch]] | None = None, head_loss: bool = False) -> None:
        validate(schedule)  # the schedule, and its own p2p plan under NCCL's rules
        plan = p2p_plan(schedule) if plan is None else plan
        if len(stages) != schedule.v:
            raise ValueError(f"rank {rank} holds {len(stages)} stage(s) but the schedule has v={schedule.v} per rank")
        for c, st in enumerate(stages):
            if st.index != schedule.stage(rank, c) or st.n_stages != schedule.n_stages:
                raise ValueError(f"rank {rank} chunk {c} is stage {st.index}/{st.n_stages}, the schedule expects "
                                 f"{schedule.stage(rank, c)}/{schedule.n_stages}")
        self.stages, self.schedule, self.comm, self.rank, self.loss_fn, self.dim = \
            list(stages), schedule, comm, rank, loss_fn, dim
        hidden = stages[0].cfg.hidden_size
        self.act_shape = act_shape or (lambda x: torch.Size((*x.shape[:2], hidden)))
        self.act_dtype = act_dtype or next(stages[0].parameters()).dtype
        self.listener = listener
        # The last stage's head computes the loss from the targets (chunked, models/loss.py) instead of
        # handing full logits to `loss_fn`.
        self.head_loss = head_loss
        # Per chunk, the index of its last action producing weight gradients (BW, or W when split).
        self._last_weight_action: dict[int, int] = {}
        for i, a in enumerate(schedule.actions[rank]):
            if a.kind in (Kind.BW, Kind.W):
                self._last_weight_action[a.chunk] = i
        # This rank's batches by the action they precede (in issue order).
        self._batches: dict[int, list[P2PBatch]] = defaultdict(list)
        for batch in plan[rank]:
            self._batches[batch.before].append(batch)

    # ------------------------------------------------------------------ one step
    def step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
             positions: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
             documents: Sequence[Documents] | None = None) -> PipelineStepResult:
        """Forward and backward every micro-batch as the schedule orders; gradients accumulate in the
        stages' parameters (each micro-batch's loss divided by m, as the non-pipelined path does).
        `positions`: the sequence's token positions (default 0..s-1 of the token ids), or one entry per
        micro-batch; `documents[i]`: micro-batch i's (document masking), handed to every stage that runs
        it — each pipeline rank holds the micro-batches' tokens, so boundaries need no message. The caller
        zeroes gradients before and runs the optimizer after."""
        s = self.schedule
        if len(micro_batches) != s.m:
            raise ValueError(f"the schedule is for {s.m} micro-batches per step, got {len(micro_batches)}")
        self._mbs = micro_batches
        self._device = self.stages[0].rotary.cos.device
        seq = micro_batches[0][0].shape[1]
        if positions is None or isinstance(positions, torch.Tensor):
            positions = [positions] * s.m
        self._positions = [p if p is not None else torch.arange(seq, device=self._device) for p in positions]
        self._documents = list(documents) if documents is not None else None
        self._shape = self.act_shape(micro_batches[0][0])
        self._buffers: dict[MsgKey, torch.Tensor] = {}  # posted receives' buffers, until consumed
        self._recv_work: dict[MsgKey, Work] = {}
        self._outbox: dict[MsgKey, torch.Tensor] = {}  # produced, its send batch not issued yet
        self._send_work: dict[MsgKey, tuple[Work, torch.Tensor]] = {}
        self._local: dict[MsgKey, torch.Tensor] = {}  # hand-offs between two stages of this rank
        self._saved: dict[tuple[int, int], _Saved] = {}
        self._losses: list[torch.Tensor] = []
        self._timer = DeviceClock(self._device)  # marks each action's start and end (a clock per step)
        timer = self._timer
        marks: list[tuple[Action, object, object]] = []
        in_flight = peak = 0
        actions = s.actions[self.rank]
        try:
            for i, a in enumerate(actions):
                self._issue(i)
                # Each kind runs in its own method so that no tensor outlives it in a local variable.
                if a.kind == Kind.F:
                    t0 = self._forward(a)
                    in_flight += 1
                    peak = max(peak, in_flight)
                    marks.append((a, t0, timer.mark()))
                    continue
                if self.listener is not None:
                    self.listener.before_backward(a.chunk, i == self._last_weight_action.get(a.chunk),
                                                  weights_only=a.kind == Kind.W)
                if a.kind in (Kind.BW, Kind.B):
                    t0 = self._backward(a)
                    in_flight -= a.kind == Kind.BW
                else:
                    t0 = self._weight(a)
                    in_flight -= 1
                if self.listener is not None:
                    self.listener.after_backward(a.chunk)
                marks.append((a, t0, timer.mark()))
            self._issue(len(actions))
            for w, _ in self._send_work.values():
                w.wait()
            assert not self._saved and not self._buffers and not self._outbox, \
                "every activation and message is consumed by the end of the step"
            losses = self._losses
        finally:
            self._send_work, self._saved, self._buffers, self._mbs, self._outbox = {}, {}, {}, [], {}
            self._losses, self._local, self._recv_work, self._positions = [], {}, {}, []
            self._documents = None
        times = timer.seconds([m for _, t0, t1 in marks for m in (t0, t1)])
        slots = [Slot(self.rank, a, times[2 * k], times[2 * k + 1]) for k, (a, _, _) in enumerate(marks)]
        loss = torch.stack(losses).mean() if losses else None
        return PipelineStepResult(loss, slots, peak, losses)

    def _forward(self, a: Action) -> object:
        st, stage = self.schedule.stage(self.rank, a.chunk), self.stages[a.chunk]
        if stage.is_first:
            x = self._mbs[a.microbatch][0].to(self._device)
        else:
            x = self._receive(("act", st, a.microbatch)).requires_grad_()
        t0 = self._timer.mark()
        targets = self._mbs[a.microbatch][1].to(self._device) if stage.is_last else None
        positions = self._positions[a.microbatch]
        docs = () if self._documents is None else (self._documents[a.microbatch],)
        out = (stage(x, positions, targets, *docs) if stage.is_last and self.head_loss
               else stage(x, positions, None, *docs))
        sent = None
        if stage.is_last:
            loss = out if self.head_loss else self.loss_fn(out, targets)
            self._losses.append(loss.detach())
            out = loss / self.schedule.m  # the same scaling as gradient accumulation without a pipeline
        else:
            sent = ("act", st + 1, a.microbatch)
            self._produce(sent, out.detach())
        if torch.is_grad_enabled():  # a forward-only step (validation, `schedules.forward_only`) keeps nothing
            self._saved[(a.chunk, a.microbatch)] = _Saved(None if stage.is_first else x, out, sent)
        return t0

    def _backward(self, a: Action) -> object:
        """BW (full backward), or B (input gradients only; W follows later)."""
        st, stage = self.schedule.stage(self.rank, a.chunk), self.stages[a.chunk]
        key = (a.chunk, a.microbatch)
        state = self._saved[key]
        grad = None if stage.is_last else self._receive(("grad", st, a.microbatch))
        t0 = self._timer.mark()
        if a.kind == Kind.BW:
            torch.autograd.backward([state.output], [grad] if grad is not None else None)
            dx = state.input.grad if state.input is not None else None
        else:
            state.split = SplitBackward([state.output], [grad], [state.input] if state.input is not None else [])
            # On stage 0 (token ids in) there is no input gradient: B does nothing, W does it all.
            dx = (state.split.backward_input() or [None])[0]
        if st > 0:
            if dx is None:
                raise RuntimeError(f"stage {st}: its input got no gradient (is the input used?)")
            self._produce(("grad", st - 1, a.microbatch), dx)
        if a.kind == Kind.BW:
            self._free(key)
        return t0

    def _weight(self, a: Action) -> object:
        t0 = self._timer.mark()
        key = (a.chunk, a.microbatch)
        split = self._saved[key].split
        assert split is not None, "validate() guarantees B before W"
        split.backward_weight()
        self._free(key)
        return t0

    # ------------------------------------------------------------------ communication
    def _produce(self, msg: MsgKey, tensor: torch.Tensor) -> None:
        """An action's output for another stage: handed over locally, or sent in its planned batch."""
        dst = self.schedule.rank_of(msg[1])
        if dst == self.rank:
            self._local[msg] = tensor
        else:
            self._outbox[msg] = tensor

    def _issue(self, before: int) -> None:
        """Issue the plan's batches due before action `before`, each as one `batch_p2p`."""
        for batch in self._batches.get(before, ()):
            ops = []
            for op in batch.ops:
                if op.op == "send":
                    if op.msg not in self._outbox:
                        raise RuntimeError(f"pipeline rank {self.rank}: the p2p plan sends {op.msg} before "
                                           "the action producing it ran")
                    ops.append(P2P("send", self._outbox.pop(op.msg), op.peer))
                else:
                    self._buffers[op.msg] = torch.empty(self._shape, dtype=self.act_dtype, device=self._device)
                    ops.append(P2P("recv", self._buffers[op.msg], op.peer))
            # One handle for the whole batch (NCCL returns one work per batch): each of its messages
            # waits on it, so consuming a receive also waits for the batch's sends, as on NCCL.
            work = self.comm.batch_p2p(ops, self.dim)
            for op, p2p in zip(batch.ops, ops, strict=True):
                if op.op == "send":
                    self._send_work[op.msg] = (work, p2p.tensor)  # the entry keeps the tensor until done
                else:
                    self._recv_work[op.msg] = work

    def _receive(self, msg: MsgKey) -> torch.Tensor:
        """The tensor for `msg`: a local hand-off, or a posted receive, waited for now."""
        src = self.schedule.rank_of(msg[1] - 1 if msg[0] == "act" else msg[1] + 1)
        if src == self.rank:
            return self._local.pop(msg)
        if msg not in self._recv_work:
            raise RuntimeError(f"pipeline rank {self.rank}: the p2p plan posts no receive of {msg} before "
                               "the action consuming it")
        self._recv_work.pop(msg).wait()
        return self._buffers.pop(msg)

    def _free(self, key: tuple[int, int]) -> None:
        state = self._saved.pop(key)
        # The gradient for our output has arrived, so the downstream stage has received the output:
        # this wait returns at once, and releasing the handle lets the activation memory go.
        sent = self._send_work.pop(state.sent, None) if state.sent is not None else None
        if sent is not None:
            sent[0].wait()


def measured_bubble(result: PipelineStepResult, comm: Comm, dim: str = "pp") -> float:
    """The step's bubble over all pipeline ranks, as a share of the pipeline's time in [0, 1], from each
    rank's own timestamps: one all-gather of (busy, first start, last end) over `dim`, on the run's device
    (an NCCL group has no CPU backend), and one device-to-host copy (every pipeline rank must call it).
    Same definition as `schedules.Timeline.bubble_fraction`: idle / (busy + idle) over the window from the
    first action's start to the last one's end on any rank. Each rank's busy time is measured inside its
    own window on its own clock (`busy_window`), and every rank's window lies inside the common one, so
    the share stays in [0, 1] however loaded the machine (clocks of other hosts only widen the window)."""
    mine = torch.tensor(busy_window(result.slots), dtype=torch.float64, device=comm.ctx.device)
    p = comm.ctx.size(dim)
    every = torch.empty(p * 3, dtype=torch.float64, device=comm.ctx.device)
    comm.all_gather(every, mine, dim)
    rows = every.view(p, 3).tolist()
    makespan = max(r[2] for r in rows) - min(r[1] for r in rows)
    return idle_share([r[0] for r in rows], makespan)
