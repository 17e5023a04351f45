"""The pipeline engine: executes any valid `Schedule` on this rank's stages, one optimizer step at a time.

The schedule says *what* to run and in which order (F, BW, or split B and W, per micro-batch and
chunk); communication follows from it. An action whose input lives on another rank receives it; a
forward sends its output downstream, a backward sends its input gradient upstream. Because every
rank knows the whole schedule, every rank knows in advance the exact sequence of messages each
neighbour will send it, and their shapes ([micro_batch, seq, hidden] activations and gradients).
So receives are posted *in the sender's order* (with pre-allocated buffers, batched into one
`batch_p2p` call whenever several are due): point-to-point messages between two ranks match in
order, and this makes the match right for any schedule, including the interleaved ones where
activations and gradients cross the same pair of ranks in both directions. Sends are asynchronous;
receives block in list order, exactly the semantics `schedules.validate` checks, so a schedule
that validates cannot deadlock here.

Memory: a (chunk, micro-batch)'s saved activations are dropped as soon as its last backward action
(BW, or W when split) is done; the engine counts the in-flight ones and reports the peak. Every
action is timestamped (after its inputs have arrived, so waiting shows up as bubble).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pentatron.distributed.comm import P2P, Comm, Work
from pentatron.parallel.pipeline.split_backward import SplitBackward
from pentatron.parallel.pipeline.stages import PipelineStage
from pentatron.schedules import Action, Kind, Schedule, Slot, validate

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class BackwardListener(Protocol):
    """Told about every backward action (the data-parallel engine: when a chunk's gradients are final)."""

    def before_backward(self, chunk: int, last: bool, weights_only: bool = False) -> None: ...

    def after_backward(self, chunk: int) -> None: ...
# A message between stages: ("act", receiving stage, micro-batch) or ("grad", receiving stage, micro-batch).
MsgKey = tuple[str, int, int]


@dataclass
class PipelineStepResult:
    """What one step of the engine produced on this rank."""

    loss: torch.Tensor | None  # mean loss over the micro-batches (on the rank holding the last stage)
    slots: list[Slot]  # every executed action, with absolute time.perf_counter() start/end
    peak_in_flight: int  # most (chunk, micro-batch) activation sets held at once
    losses: list[torch.Tensor] = field(default_factory=list)  # per micro-batch, unscaled


def outgoing(schedule: Schedule, rank: int) -> dict[int, list[MsgKey]]:
    """The messages `rank` sends while running its actions, per destination rank, in sending order."""
    out: dict[int, list[MsgKey]] = defaultdict(list)
    last = schedule.n_stages - 1
    for a in schedule.actions[rank]:
        st = schedule.stage(rank, a.chunk)
        if a.kind == Kind.F and st < last and schedule.rank_of(st + 1) != rank:
            out[schedule.rank_of(st + 1)].append(("act", st + 1, a.microbatch))
        elif a.kind in (Kind.BW, Kind.B) and st > 0 and schedule.rank_of(st - 1) != rank:
            out[schedule.rank_of(st - 1)].append(("grad", st - 1, a.microbatch))
    return out


@dataclass
class _Saved:
    """A (chunk, micro-batch)'s state between its forward and its last backward action."""

    input: torch.Tensor | None  # the received activation (a leaf requiring grad); None on stage 0
    output: torch.Tensor  # the stage output, or the scaled loss on the last stage
    sent: Work | None = None  # the send of `output` downstream (done once the grad came back)
    split: SplitBackward | None = None


class PipelineEngine:
    """Runs `schedule` for pipeline rank `rank` over `stages` (this rank's chunks, in chunk order).

    `act_shape(micro_batch_inputs)` gives the activation shape crossing stage boundaries (default
    [b, s, hidden]); `act_dtype` its dtype (default: the stages' parameter dtype). `dim` is the mesh
    dimension whose group ranks are the pipeline ranks. `listener` is told before and after every
    backward action which chunk it is for and whether it is that chunk's last one producing weight
    gradients in this step (so that gradient reduction can start while other chunks still compute).
    """

    def __init__(self, stages: Sequence[PipelineStage], schedule: Schedule, comm: Comm, rank: int,
                 loss_fn: LossFn, *, dim: str = "pp", act_shape: Callable[[torch.Tensor], torch.Size] | None = None,
                 act_dtype: torch.dtype | None = None, listener: BackwardListener | None = None) -> None:
        validate(schedule)
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
        # Per chunk, the index of its last action producing weight gradients (BW, or W when split).
        self._last_weight_action: dict[int, int] = {}
        for i, a in enumerate(schedule.actions[rank]):
            if a.kind in (Kind.BW, Kind.W):
                self._last_weight_action[a.chunk] = i
        # What each neighbour will send us, in its order: the receive plan (the schedule is data).
        self._expected = {src: msgs for src in range(schedule.p) if src != rank
                          for dst, msgs in outgoing(schedule, src).items() if dst == rank}

    # ------------------------------------------------------------------ one step
    def step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
             positions: torch.Tensor | None = None) -> PipelineStepResult:
        """Forward and backward every micro-batch as the schedule orders; gradients accumulate in the
        stages' parameters (each micro-batch's loss divided by m, as the non-pipelined path does).
        `positions`: the sequence's token positions (default 0..s-1 of the token ids). The caller zeroes
        gradients before and runs the optimizer after."""
        s = self.schedule
        if len(micro_batches) != s.m:
            raise ValueError(f"the schedule is for {s.m} micro-batches per step, got {len(micro_batches)}")
        self._mbs = micro_batches
        self._device = self.stages[0].rotary.cos.device
        seq = micro_batches[0][0].shape[1]
        self._positions = positions if positions is not None else torch.arange(seq, device=self._device)
        self._shape = self.act_shape(micro_batches[0][0])
        self._buffers: dict[MsgKey, torch.Tensor] = {}
        self._recv_work: dict[MsgKey, Work] = {}
        self._posted = dict.fromkeys(self._expected, 0)
        self._local: dict[MsgKey, torch.Tensor] = {}  # hand-offs between two stages of this rank
        self._grad_sends: list[tuple[Work, torch.Tensor]] = []
        self._saved: dict[tuple[int, int], _Saved] = {}
        self._losses: list[torch.Tensor] = []
        slots: list[Slot] = []
        in_flight = peak = 0
        try:
            for i, a in enumerate(s.actions[self.rank]):
                # Each kind runs in its own method so that no tensor outlives it in a local variable.
                if a.kind == Kind.F:
                    t0 = self._forward(a)
                    in_flight += 1
                    peak = max(peak, in_flight)
                    slots.append(Slot(self.rank, a, t0, time.perf_counter()))
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
                slots.append(Slot(self.rank, a, t0, time.perf_counter()))
            for w, _ in self._grad_sends:
                w.wait()
            assert not self._saved and not self._buffers, "every activation is freed by the end of the step"
            losses = self._losses
        finally:
            self._grad_sends, self._saved, self._buffers, self._mbs = [], {}, {}, []
            self._losses, self._local, self._recv_work, self._positions = [], {}, {}, None
        loss = torch.stack(losses).mean() if losses else None
        return PipelineStepResult(loss, slots, peak, losses)

    def _forward(self, a: Action) -> float:
        st, stage = self.schedule.stage(self.rank, a.chunk), self.stages[a.chunk]
        if stage.is_first:
            x = self._mbs[a.microbatch][0].to(self._device)
        else:
            x = self._receive(("act", st, a.microbatch)).requires_grad_()
        t0 = time.perf_counter()
        out = stage(x, self._positions)
        sent = None
        if stage.is_last:
            loss = self.loss_fn(out, self._mbs[a.microbatch][1].to(self._device))
            self._losses.append(loss.detach())
            out = loss / self.schedule.m  # the same scaling as gradient accumulation without a pipeline
        else:
            sent = self._send(("act", st + 1, a.microbatch), out.detach())
        self._saved[(a.chunk, a.microbatch)] = _Saved(None if stage.is_first else x, out, sent)
        return t0

    def _backward(self, a: Action) -> float:
        """BW (full backward), or B (input gradients only; W follows later)."""
        st, stage = self.schedule.stage(self.rank, a.chunk), self.stages[a.chunk]
        key = (a.chunk, a.microbatch)
        state = self._saved[key]
        grad = None if stage.is_last else self._receive(("grad", st, a.microbatch))
        t0 = time.perf_counter()
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
            work = self._send(("grad", st - 1, a.microbatch), dx)
            if work is not None:
                self._grad_sends.append((work, dx))
        if a.kind == Kind.BW:
            self._free(key)
        return t0

    def _weight(self, a: Action) -> float:
        t0 = time.perf_counter()
        key = (a.chunk, a.microbatch)
        split = self._saved[key].split
        assert split is not None, "validate() guarantees B before W"
        split.backward_weight()
        self._free(key)
        return t0

    # ------------------------------------------------------------------ communication
    def _send(self, msg: MsgKey, tensor: torch.Tensor) -> Work | None:
        dst = self.schedule.rank_of(msg[1])
        if dst == self.rank:
            self._local[msg] = tensor
            return None
        return self.comm.batch_p2p([P2P("send", tensor, dst)], self.dim)[0]

    def _receive(self, msg: MsgKey) -> torch.Tensor:
        """The tensor for `msg`, posting (in one batch) every receive the sender issues up to it."""
        src = self.schedule.rank_of(msg[1] - 1 if msg[0] == "act" else msg[1] + 1)
        if src == self.rank:
            return self._local.pop(msg)
        if msg not in self._recv_work:
            plan = self._expected[src]
            upto = plan.index(msg, self._posted[src]) + 1
            ops = []
            for k in plan[self._posted[src]:upto]:
                self._buffers[k] = torch.empty(self._shape, dtype=self.act_dtype, device=self._device)
                ops.append((k, P2P("recv", self._buffers[k], src)))
            for (k, _), w in zip(ops, self.comm.batch_p2p([op for _, op in ops], self.dim), strict=True):
                self._recv_work[k] = w
            self._posted[src] = upto
        self._recv_work.pop(msg).wait()
        return self._buffers.pop(msg)

    def _free(self, key: tuple[int, int]) -> None:
        state = self._saved.pop(key)
        # The gradient for our output has arrived, so the downstream stage has received the output:
        # this wait returns at once, and releasing the handle lets the activation memory go.
        if state.sent is not None:
            state.sent.wait()


def measured_bubble(result: PipelineStepResult, comm: Comm, dim: str = "pp") -> float:
    """The step's bubble fraction over all pipeline ranks, from each rank's own timestamps: three scalar
    collectives over `dim` (every pipeline rank must call it). Same definition as
    `schedules.Timeline.bubble_fraction`: (p · makespan − Σ busy) / Σ busy."""
    slots = result.slots
    busy = torch.tensor([sum(s.end - s.start for s in slots)], dtype=torch.float64)
    first = torch.tensor([min((s.start for s in slots), default=float("inf"))], dtype=torch.float64)
    last = torch.tensor([max((s.end for s in slots), default=float("-inf"))], dtype=torch.float64)
    comm.all_reduce(busy, dim)
    comm.all_reduce(first, dim, op="min")
    comm.all_reduce(last, dim, op="max")
    p = comm.ctx.size(dim)
    total = float(busy)
    return (p * float(last - first) - total) / total if total > 0 else 0.0
