"""Pipeline schedules as data: for every rank, the ordered list of compute actions it runs in one step.

One definition, three users: the pipeline engine executes a `Schedule`, the planner `simulate`s it for
the bubble and the in-flight activation count, and the drawing tool draws its `Timeline`.

Conventions
* `Action.chunk` is the **local** virtual-chunk index on the rank (0..v-1). Stages are placed
  Megatron-style: rank r holds global stages r, r+p, r+2p, ..., so `stage = chunk * p + rank`.
* Kinds: F forward; BW full backward; B backward w.r.t. inputs only; W backward w.r.t. weights only.
  Per (stage, micro-batch) a schedule has exactly one F and either one BW or one B and one W.
* Communication is implied by the dependencies (no explicit send/recv actions): an action whose input
  comes from another rank waits for it. `simulate` executes the compute order alone (a schedule either
  runs or deadlocks regardless of the action costs). How the messages are grouped into point-to-point
  batches is `p2p_plan` (the engine issues exactly that plan), and `check_p2p` replays a plan under
  NCCL's rules: per rank, batches complete in issue order, and a batch completes only once every peer
  has each matching operation in the batch it is executing. `validate` runs both.
* Bubble fraction = idle / (busy + idle) over the p ranks and one window, the step's makespan:
  (p * makespan - total busy time) / (p * makespan), the share of the pipeline's time its ranks sit idle,
  in [0, 1] by construction (`idle_share`); AFAB/1F1B come out at (p-1)/(m+p-1). The Ultra-Scale
  Playbook's bubble, idle time over ideal compute time ((p-1)/m, unbounded: 7.0 for p=8, m=1), is
  `Timeline.bubble_ratio`; the two convert as share = ratio / (1 + ratio).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from math import inf, isfinite
from typing import Literal


class ScheduleError(ValueError):
    """An invalid schedule request or a schedule that breaks a dependency or deadlocks."""


class Kind(str, Enum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Schedule:
    p: int  # pipeline ranks
    m: int  # micro-batches per step
    v: int  # virtual chunks (stages) per rank
    actions: list[list[Action]]  # actions[rank] in execution order
    name: str = "custom"

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.p + rank

    def rank_of(self, stage: int) -> int:
        return stage % self.p

    @property
    def split_backward(self) -> bool:
        return any(a.kind in (Kind.B, Kind.W) for acts in self.actions for a in acts)


F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW


def _check_pm(p: int, m: int, name: str) -> None:
    for k, val in (("p", p), ("m", m)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ScheduleError(f"{name}: {k} must be a positive integer, got {val!r}")


# ---------------------------------------------------------------- generators
def afab(p: int, m: int) -> Schedule:
    """All-forward-all-backward (GPipe): every micro-batch forward, then every backward. Holds m."""
    _check_pm(p, m, "afab")
    acts = [[Action(F, i) for i in range(m)] + [Action(BW, i) for i in range(m)] for _ in range(p)]
    return Schedule(p, m, 1, acts, "afab")


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): rank r runs min(p-1-r, m) warm-up forwards, then alternates F and BW, then
    drains. Same bubble as AFAB, but at most p - r micro-batches in flight. Works for any m >= 1."""
    _check_pm(p, m, "1f1b")
    acts = []
    for r in range(p):
        nw = min(p - 1 - r, m)
        a = [Action(F, i) for i in range(nw)]
        for i in range(m - nw):
            a += [Action(F, nw + i), Action(BW, i)]
        a += [Action(BW, i) for i in range(m - nw, m)]
        acts.append(a)
    return Schedule(p, m, 1, acts, "1f1b")


def interleaved_groups(p: int, m: int) -> list[int]:
    """How an interleaved schedule groups its m ≥ p micro-batches: m // p groups, as equal as possible and
    larger first, so each holds at least p (the chunks' round trip) — all p when p divides m."""
    rounds = m // p
    base, extra = divmod(m, rounds)
    return [base + 1] * extra + [base] * (rounds - extra)


def interleaved_1f1b(p: int, m: int, v: int, all_warmup: bool = True) -> Schedule:
    """Megatron-LM interleaved 1F1B with v chunks per rank (rank r holds stages r, r+p, ...), for any m ≥ p.

    Micro-batches advance in groups through chunk 0, then chunk 1, …; the backwards follow the same order
    with the chunks reversed. Groups (`interleaved_groups`): p micro-batches each when p divides m (Megatron-
    LM's rule, which asked for that); otherwise m // p groups as equal as possible, larger first — every
    group holds at least p, so a micro-batch's next chunk never waits for a forward queued behind a
    backward (a smaller last group, as in Megatron-Core's table, deadlocks e.g. p=4, m=5, v=3; one group
    of all m for m < 2p is torch.distributed.pipelining's rule). Warm-up is 2(p-1-r) + (v-1)·g forwards
    (g: the first, largest group), all of them when m == p. Bubble (p-1)/(v m) when p divides m. v == 1 is
    plain 1F1B. all_warmup=False keeps the counted warm-up when m == p too, as torch.distributed.
    pipelining's ScheduleInterleaved1F1B does (torch 2.5-2.6 `_calculate_single_rank_operations`:
    min((v-1)p + 2(p-1-r), m v), no m == p case).
    """
    _check_pm(p, m, "interleaved")
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ScheduleError(f"interleaved: v (virtual chunks per rank) must be a positive integer, got {v!r}")
    if v == 1:
        return one_f_one_b(p, m)
    if m < p:
        raise ScheduleError(f"interleaved: micro-batches m={m} must be at least the pipeline ranks p={p} (each "
                            f"micro-batch goes round the {p} ranks once per chunk); try m={p}, or pp_virtual=1")
    total = m * v
    groups = interleaved_groups(p, m)
    fwd: list[tuple[int, int]] = []
    start = 0
    for g in groups:
        fwd += [(i, c) for c in range(v) for i in range(start, start + g)]
        start += g
    bwd = [(i, v - 1 - c) for i, c in fwd]

    acts = []
    for r in range(p):
        nw = total if m == p and all_warmup else min(2 * (p - 1 - r) + (v - 1) * groups[0], total)
        a = [Action(F, *fwd[k]) for k in range(nw)]
        for k in range(total - nw):
            a.append(Action(F, *fwd[nw + k]))
            a.append(Action(BW, *bwd[k]))
        a += [Action(BW, *bwd[k]) for k in range(total - nw, total)]
        acts.append(a)
    return Schedule(p, m, v, acts, "interleaved")


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", handcrafted H1): backward split into B
    (input grads, on the critical path) and W (weight grads, deferrable). Rank r steps x = 0 .. m+p-2 and
    at each step runs F(x), B(x-(p-1-r)), W(x-(p-1)) when those micro-batches exist: the 1F1B order of F
    and B, with W trailing by p-1 so that it fills the idle slots 1F1B leaves in cool-down. At most p
    micro-batches are in flight (F run, W not yet), as in 1F1B; with t_F = t_B = t_W the bubble is
    (p-1)(t_F + t_B - t_W) per rank, a third of 1F1B's (p-1)(t_F + t_B + t_W)."""
    _check_pm(p, m, "zb-h1")
    acts = []
    for r in range(p):
        a = []
        for x in range(m + p - 1):
            for kind, i in ((F, x), (B, x - (p - 1 - r)), (W, x - (p - 1))):
                if 0 <= i < m:
                    a.append(Action(kind, i))
        acts.append(a)
    return Schedule(p, m, 1, acts, "zb-h1")


SCHEDULES = ("afab", "1f1b", "interleaved", "zb")


def forward_only(p: int, m: int, v: int = 1) -> Schedule:
    """Forwards only (validation: no backward, nothing kept for one): each rank runs its chunks in order,
    every micro-batch through chunk 0, then chunk 1, …, so a micro-batch's next stage never waits for
    more than its predecessor."""
    _check_pm(p, m, "forward")
    return Schedule(p, m, v, [[Action(F, i, c) for c in range(v) for i in range(m)] for _ in range(p)], "forward")


def make_schedule(name: str, p: int, m: int, v: int = 1, all_warmup: bool = True) -> Schedule:
    """Generator by config name (`parallel.pp_schedule`: afab | 1f1b | interleaved | zb); `all_warmup`:
    see `interleaved_1f1b`."""
    key = name.lower().replace("_", "-")
    if key in ("afab", "gpipe"):
        gen = afab(p, m)
    elif key in ("1f1b", "one-f-one-b"):
        gen = one_f_one_b(p, m)
    elif key in ("interleaved", "interleaved-1f1b"):
        return interleaved_1f1b(p, m, v, all_warmup)
    elif key in ("zb", "zb-h1", "zero-bubble"):
        gen = zero_bubble_h1(p, m)
    else:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if v != 1:
        raise ScheduleError(f"{gen.name}: v (virtual chunks) must be 1, got {v}; only 'interleaved' uses v")
    return gen


# ---------------------------------------------------------------- validation and simulation
@dataclass(frozen=True)
class Slot:
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    p: int
    slots: list[list[Slot]]  # per rank, in execution order
    makespan: float
    busy: list[float]  # per rank compute time
    name: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def bubble_fraction(self) -> float:
        """The bubble as a share of the pipeline's time, in [0, 1]: idle / (busy + idle) over all ranks in
        the window [0, makespan] (AFAB and 1F1B: (p-1)/(m+p-1))."""
        return idle_share(self.busy, self.makespan)

    @property
    def bubble_ratio(self) -> float:
        """The playbook's bubble, idle time / ideal compute time (AFAB and 1F1B: (p-1)/m). Unbounded, so
        never shown as a percentage: `bubble_fraction` is ratio / (1 + ratio)."""
        total = sum(self.busy)
        return (self.p * self.makespan - total) / total if total else 0.0

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]


def idle_share(busy: Sequence[float], window: float) -> float:
    """Idle / (busy + idle) of ranks that were each busy `busy[r]` seconds within one window of `window`
    seconds: (len(busy) · window − Σ busy) / (len(busy) · window), in [0, 1] by construction. A rank's busy
    time counts at most the window: measured (`busy_window`) or simulated it cannot exceed it but by
    rounding, which is all the clamp absorbs."""
    if not isfinite(window) or window <= 0:
        return 0.0
    held = [min(max(b, 0.0), window) for b in busy]
    idle = sum(window - b for b in held)
    total = idle + sum(held)
    return idle / total if total > 0 else 0.0


def busy_window(slots: Sequence[Slot]) -> tuple[float, float, float]:
    """One rank's (busy, first start, last end) from its action slots on one clock: busy is the time
    covered by at least one action (an overlap counted once), so it cannot exceed last end − first start
    whatever the timestamps (under load a mark may land a tick early); (0, inf, -inf) without slots."""
    busy, first, last, covered = 0.0, inf, -inf, -inf
    for s in sorted(slots, key=lambda s: s.start):
        first, last = min(first, s.start), max(last, s.end)
        lo = max(s.start, covered)
        if s.end > lo:
            busy += s.end - lo
            covered = s.end
    return (min(busy, max(last - first, 0.0)) if slots else 0.0), first, last


def _per_stage(cost: float | Sequence[float], n: int, what: str) -> list[float]:
    if isinstance(cost, int | float):
        vals = [float(cost)] * n
    else:
        vals = [float(c) for c in cost]
        if len(vals) != n:
            raise ScheduleError(f"{what}: expected one cost per stage ({n}), got {len(vals)}")
    if any(c < 0 for c in vals):
        raise ScheduleError(f"{what}: costs must be >= 0")
    return vals


def _check_structure(s: Schedule) -> None:
    if len(s.actions) != s.p:
        raise ScheduleError(f"{s.name}: expected action lists for {s.p} ranks, got {len(s.actions)}")
    seen: dict[tuple[Kind, int, int], int] = {}
    for r, acts in enumerate(s.actions):
        for pos, a in enumerate(acts):
            if not isinstance(a.kind, Kind):
                raise ScheduleError(f"{s.name}: rank {r} position {pos}: unknown action kind {a.kind!r}")
            if not 0 <= a.microbatch < s.m or not 0 <= a.chunk < s.v:
                raise ScheduleError(f"{s.name}: rank {r} position {pos}: {a} is out of range "
                                    f"(m={s.m}, v={s.v})")
            key = (a.kind, s.stage(r, a.chunk), a.microbatch)
            if key in seen:
                raise ScheduleError(f"{s.name}: rank {r}: {a} appears twice (positions {seen[key]} and {pos})")
            seen[key] = pos
            if a.kind in (B, W, BW):
                if (F, key[1], key[2]) not in seen:
                    raise ScheduleError(f"{s.name}: rank {r} position {pos}: {a} comes before its forward")
                if a.kind == W and (B, key[1], key[2]) not in seen:
                    raise ScheduleError(f"{s.name}: rank {r} position {pos}: {a} comes before its B")
    forward_only = all(k == F for k, _, _ in seen)  # a validation schedule (`forward_only`)
    for st in range(s.n_stages):
        for i in range(s.m):
            has = {k for k in Kind if (k, st, i) in seen}
            where = f"stage {st} (rank {s.rank_of(st)}, chunk {st // s.p}), micro-batch {i}"
            if F not in has:
                raise ScheduleError(f"{s.name}: {where} has no forward")
            if has - {F} not in ({BW}, {B, W}) and not forward_only:
                raise ScheduleError(f"{s.name}: {where} needs exactly one BW, or one B and one W; "
                                    f"has {sorted(k.value for k in has - {F})}")


def _deps(s: Schedule, r: int, a: Action) -> list[tuple[str, int, int]]:
    """Events (kind class, stage, micro-batch) that must finish before `a` may start on rank r."""
    st, i = s.stage(r, a.chunk), a.microbatch
    if a.kind == F:
        return [("F", st - 1, i)] if st > 0 else []
    if a.kind == W:
        return [("B", st, i)]
    deps = [("F", st, i)]
    if st < s.n_stages - 1:
        deps.append(("B", st + 1, i))
    return deps


def simulate(s: Schedule, cost_f: float | Sequence[float] = 1.0, cost_b: float | Sequence[float] = 1.0,
             cost_w: float | Sequence[float] = 1.0, comm: float = 0.0, *, record: bool = True) -> Timeline:
    """Execute the schedule in list order with the given per-stage costs (scalar = uniform; a sequence has
    one entry per global stage). `cost_b` is the input-gradient pass; a BW costs cost_b + cost_w. `comm`
    is added to every dependency that crosses ranks. Raises ScheduleError on a broken or deadlocking
    schedule. `record=False` skips the per-action slots (faster, for the planner's search)."""
    _check_structure(s)
    n, m, p = s.n_stages, s.m, s.p
    cf, cb, cw = _per_stage(cost_f, n, "cost_f"), _per_stage(cost_b, n, "cost_b"), _per_stage(cost_w, n, "cost_w")
    cost = {F: cf, B: cb, W: cw, BW: [x + y for x, y in zip(cb, cw, strict=True)]}
    # Event ids: forward done (stage, mb) -> st*m+i; input-gradient done -> (n+st)*m+i.
    nev = 2 * n * m
    done = [-1.0] * nev
    plans = []  # per rank: (duration, produced event ids, [(dep event id, extra delay)])
    for r in range(p):
        plan = []
        for a in s.actions[r]:
            st, i = s.stage(r, a.chunk), a.microbatch
            deps = []
            if a.kind == F:
                if st > 0:
                    deps.append(((st - 1) * m + i, comm if s.rank_of(st - 1) != r else 0.0))
                prod = st * m + i
            elif a.kind == W:
                deps.append(((n + st) * m + i, 0.0))
                prod = -1
            else:
                deps.append((st * m + i, 0.0))
                if st < n - 1:
                    deps.append(((n + st + 1) * m + i, comm if s.rank_of(st + 1) != r else 0.0))
                prod = (n + st) * m + i
            plan.append((cost[a.kind][st], prod, deps))
        plans.append(plan)
    ptr, free = [0] * p, [0.0] * p
    slots: list[list[Slot]] = [[] for _ in range(p)]
    busy = [0.0] * p
    left = sum(len(x) for x in plans)
    while left:
        progressed = False
        for r in range(p):
            plan, k = plans[r], ptr[r]
            t_free = free[r]
            while k < len(plan):
                dur, prod, deps = plan[k]
                start = t_free
                for ev, delay in deps:
                    end = done[ev]
                    if end < 0:
                        break
                    if end + delay > start:
                        start = end + delay
                else:
                    t_free = start + dur
                    if prod >= 0:
                        done[prod] = t_free
                    if record:
                        slots[r].append(Slot(r, s.actions[r][k], start, t_free))
                    busy[r] += dur
                    k += 1
                    continue
                break
            if k != ptr[r]:
                left -= k - ptr[r]
                ptr[r], free[r] = k, t_free
                progressed = True
        if not progressed:
            stuck = []
            for r in range(p):
                if ptr[r] < len(s.actions[r]):
                    a = s.actions[r][ptr[r]]
                    need = [f"{k}{i} of stage {st}" for k, st, i in _deps(s, r, a)
                            if done[(st if k == "F" else n + st) * m + i] < 0]
                    stuck.append(f"rank {r} at {a} waits for {', '.join(need)}")
            raise ScheduleError(f"{s.name}: deadlock: " + "; ".join(stuck))
    return Timeline(p, slots, max(free) if p else 0.0, busy, s.name)


def validate(s: Schedule, plan: Sequence[Sequence[P2PBatch]] | None = None) -> None:
    """Raise ScheduleError unless every dependency is respected, the schedule runs to completion, and its
    point-to-point plan (`plan`, default `p2p_plan(s)`: what the engine issues) cannot deadlock under
    NCCL's ordering rules (`check_p2p`)."""
    simulate(s, 1.0, 1.0, 1.0, 0.0)
    check_p2p(s, p2p_plan(s) if plan is None else plan)


# ---------------------------------------------------------------- point-to-point plan and its NCCL model
# A message between stages: ("act", receiving stage, micro-batch) or ("grad", receiving stage, micro-batch).
MsgKey = tuple[str, int, int]


@dataclass(frozen=True)
class P2POp:
    op: Literal["send", "recv"]
    peer: int  # pipeline rank
    msg: MsgKey

    def __str__(self) -> str:
        kind, st, i = self.msg
        return f"{self.op} {kind}(stage {st}, mb {i}) {'to' if self.op == 'send' else 'from'} rank {self.peer}"


@dataclass(frozen=True)
class P2PBatch:
    """Operations issued together (one `batch_p2p`) just before the rank's action number `before`
    (`before == len(actions)`: after its last action)."""

    before: int
    ops: tuple[P2POp, ...]


def action_messages(s: Schedule, rank: int, a: Action) -> tuple[list[P2POp], list[P2POp]]:
    """(receives it needs, sends it produces) of one action; hand-offs within the rank are not messages."""
    st, i, last = s.stage(rank, a.chunk), a.microbatch, s.n_stages - 1
    recv: list[P2POp] = []
    send: list[P2POp] = []
    if a.kind == F:
        if st > 0 and s.rank_of(st - 1) != rank:
            recv.append(P2POp("recv", s.rank_of(st - 1), ("act", st, i)))
        if st < last and s.rank_of(st + 1) != rank:
            send.append(P2POp("send", s.rank_of(st + 1), ("act", st + 1, i)))
    elif a.kind in (B, BW):
        if st < last and s.rank_of(st + 1) != rank:
            recv.append(P2POp("recv", s.rank_of(st + 1), ("grad", st, i)))
        if st > 0 and s.rank_of(st - 1) != rank:
            send.append(P2POp("send", s.rank_of(st - 1), ("grad", st - 1, i)))
    return recv, send


def p2p_plan(s: Schedule) -> list[list[P2PBatch]]:
    """Per rank, the point-to-point batches the engine issues, in issue order: one batch per time slot of
    the schedule's unit-cost timeline (F = B = W = 1, BW = 2, so every action starts and ends on an
    integer slot). A message belongs to the slot in which its producer finishes; in that slot's batch
    the sender posts its send and the receiver its receive, beside every other message of the slot. On
    each rank the batch of slot t comes after every action started before t (so after the producer of
    its sends, and before the consumer of its receives, which starts at t or later).

    Deadlock-free under NCCL's rules by construction: every rank issues its batches in slot order and
    both ends of a message sit in batches of the same slot, so the lowest unfinished slot's batches are
    all at the head of their ranks and complete together. (Pairing each action's sends with the next
    action's receives, enough for 1F1B, deadlocks interleaved schedules with m > p: `check_p2p` says so.)
    Within a batch ops are sorted by message, so a pair's messages match in the same order on both sides."""
    tl = simulate(s, 1.0, 1.0, 1.0, 0.0)
    plans: list[list[P2PBatch]] = []
    produced: dict[MsgKey, float] = {}  # message -> slot in which its producer ends
    for r in range(s.p):
        for slot in tl.slots[r]:
            for op in action_messages(s, r, slot.action)[1]:
                produced[op.msg] = slot.end
    for r in range(s.p):
        starts = [slot.start for slot in tl.slots[r]]
        by_slot: dict[float, list[P2POp]] = defaultdict(list)
        for a in s.actions[r]:
            recv, send = action_messages(s, r, a)
            for op in recv + send:
                by_slot[produced[op.msg]].append(op)
        plans.append([P2PBatch(sum(st < t for st in starts), tuple(sorted(ops, key=lambda o: (o.msg, o.op))))
                      for t, ops in sorted(by_slot.items())])
    return plans


def check_p2p(s: Schedule, plan: Sequence[Sequence[P2PBatch]]) -> None:
    """Replay per-rank batches under NCCL's rules and raise ScheduleError on a mismatch or a deadlock.

    Messages between a pair of ranks match in issue order (the k-th send r→q with q's k-th receive from
    r), and must then carry the same message. A rank executes its batches one at a time, in order; an
    operation completes once its partner is in the batch its rank is executing; a batch completes once
    all of its operations have. A deadlock is reported as the cycle of ranks waiting on each other."""
    if len(plan) != s.p:
        raise ScheduleError(f"{s.name}: a p2p plan for {len(plan)} ranks, the schedule has {s.p}")
    where: dict[tuple[int, int, str, int], tuple[int, int, P2POp]] = {}  # (src, dst, op, k) -> (rank, batch, op)
    count: dict[tuple[int, int, str], int] = defaultdict(int)
    for r, batches in enumerate(plan):
        for bi, b in enumerate(batches):
            for op in b.ops:
                src, dst = (r, op.peer) if op.op == "send" else (op.peer, r)
                k = count[(src, dst, op.op)]
                count[(src, dst, op.op)] += 1
                where[(src, dst, op.op, k)] = (r, bi, op)
    partner: dict[tuple[int, int, P2POp], tuple[int, int]] = {}
    for (src, dst, kind, k), (r, bi, op) in where.items():
        other = where.get((src, dst, "recv" if kind == "send" else "send", k))
        if other is None:
            raise ScheduleError(f"{s.name}: rank {r} batch {bi}: {op} (#{k} from {src} to {dst}) has no "
                                f"matching {'receive' if kind == 'send' else 'send'}")
        if other[2].msg != op.msg:
            raise ScheduleError(f"{s.name}: messages {src}→{dst} #{k} do not match: rank {r} {op}, "
                                f"rank {other[0]} {other[2]}")
        partner[(r, bi, op)] = other[:2]
    head = [0] * s.p
    done: set[tuple[int, int, P2POp]] = set()
    progressed = True
    while progressed:
        progressed = False
        for r in range(s.p):
            if head[r] < len(plan[r]):
                for op in plan[r][head[r]].ops:
                    q, qb = partner[(r, head[r], op)]
                    if head[q] == qb:
                        done.add((r, head[r], op))
        for r in range(s.p):
            while head[r] < len(plan[r]) and all((r, head[r], op) in done for op in plan[r][head[r]].ops):
                head[r] += 1
                progressed = True
    stuck = [r for r in range(s.p) if head[r] < len(plan[r])]
    if not stuck:
        return

    def waits_on(r: int) -> tuple[int, P2POp, int]:
        """The first peer whose partner batch `r`'s head batch waits for: (peer, op, peer's batch)."""
        for op in plan[r][head[r]].ops:
            q, qb = partner[(r, head[r], op)]
            if (r, head[r], op) not in done:
                return q, op, qb
        raise AssertionError("a stuck batch has an unfinished op")

    r, seen = stuck[0], []
    while r not in seen:
        seen.append(r)
        r = waits_on(r)[0]
    cycle = seen[seen.index(r):]
    lines = []
    for r in cycle:
        q, op, qb = waits_on(r)
        lines.append(f"rank {r} in batch {head[r]} (before action {plan[r][head[r]].before}) waits to "
                     f"{op}, which rank {q} posts only in its batch {qb} (it is in batch {head[q]})")
    raise ScheduleError(f"{s.name}: p2p deadlock under NCCL ordering, cycle of ranks "
                        f"{' → '.join(map(str, [*cycle, cycle[0]]))}: " + "; ".join(lines))


def peak_in_flight(s: Schedule) -> list[int]:
    """Per rank, the most (chunk, micro-batch) pairs whose forward has run and whose last backward action
    (BW, or W when split) has not: the number of activation sets the rank holds at its peak. For v > 1
    the unit is one chunk's activations (1/v of the rank's layers)."""
    return [int(peak_in_flight_weighted(s, r, [1] * s.v)) for r in range(s.p)]


def peak_in_flight_weighted(s: Schedule, rank: int, weights: Sequence[float]) -> float:
    """`peak_in_flight` of one rank with chunk c counting weights[c] (e.g. its decoder layers): exact where
    the rank's chunks are unequal, such as an embedding-only first chunk, where the count is not."""
    cur = peak = 0.0
    for a in s.actions[rank]:
        if a.kind == F:
            cur += weights[a.chunk]
            peak = max(peak, cur)
        elif a.kind in (BW, W):
            cur -= weights[a.chunk]
    return peak


def peak_awaiting_backward(s: Schedule, rank: int, chunk: int) -> int:
    """Most micro-batches of one (rank, chunk) whose forward has run and whose input-gradient pass (B or
    BW) has not: how many copies of state freed by B (e.g. the last stage's loss) the chunk holds."""
    cur = peak = 0
    for a in s.actions[rank]:
        if a.chunk != chunk:
            continue
        if a.kind == F:
            cur += 1
            peak = max(peak, cur)
        elif a.kind in (B, BW):
            cur -= 1
    return peak


def peak_in_flight_closed(name: str, p: int, m: int, v: int = 1, all_warmup: bool = True) -> list[int]:
    """`peak_in_flight` of a generated schedule without generating it (the planner's search asks for
    thousands): AFAB m; 1F1B min(p - r, m); ZB-H1 min(p, m); interleaved min(2(p-1-r) + (v-1)g + 1, mv)
    with g the first micro-batch group (p when p divides m; every forward first when m == p). Tests check
    these against the schedules themselves."""
    key = name.lower().replace("_", "-")
    if key in ("afab", "gpipe"):
        return [m] * p
    if key in ("1f1b", "one-f-one-b") or (key in ("interleaved", "interleaved-1f1b") and v == 1):
        return [min(p - r, m) for r in range(p)]
    if key in ("zb", "zb-h1", "zero-bubble"):
        return [min(p, m)] * p
    if key in ("interleaved", "interleaved-1f1b"):
        if m == p and all_warmup:
            return [m * v] * p
        g = interleaved_groups(p, m)[0] if m >= p else p
        return [min(2 * (p - 1 - r) + (v - 1) * g + 1, m * v) for r in range(p)]
    raise ScheduleError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")


@lru_cache(maxsize=4096)  # the unequal-group case simulates the schedule: the planner asks per layout and rank
def last_stage_awaiting_backward_closed(name: str, p: int, m: int, v: int = 1, all_warmup: bool = True) -> int:
    """`peak_awaiting_backward` of the last stage (rank p-1, chunk v-1), which holds the loss: AFAB m;
    1F1B and ZB-H1 1 (B follows F at once); interleaved 1, or m when m == p (all forwards first), read off
    the schedule when p does not divide m."""
    key = name.lower().replace("_", "-")
    if key in ("afab", "gpipe") or (key in ("interleaved", "interleaved-1f1b") and v > 1 and m == p
                                    and all_warmup):
        return m
    if key in ("interleaved", "interleaved-1f1b") and v > 1 and m > p and m % p:
        # unequal micro-batch groups: no closed form (1 or more), the schedule itself says
        return peak_awaiting_backward(interleaved_1f1b(p, m, v, all_warmup), p - 1, v - 1)
    if key in ("1f1b", "one-f-one-b", "zb", "zb-h1", "zero-bubble", "interleaved", "interleaved-1f1b"):
        return 1
    raise ScheduleError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")


def bubble_fraction(name: str, p: int, m: int, v: int = 1, *, t_f: float = 1.0, t_b: float = 1.0,
                    t_w: float = 1.0, comm: float = 0.0) -> float:
    """Simulated bubble (idle share, `Timeline.bubble_fraction`) of a named schedule with uniform per-stage
    costs (per chunk for interleaved)."""
    return simulate(make_schedule(name, p, m, v), t_f, t_b, t_w, comm).bubble_fraction


IDLE_WARNING_SHARE = 0.5  # at least half of every step idle: more stages than the micro-batches can fill


def idle_warning(name: str, p: int, m: int, v: int, dp: int, micro_batch: int) -> str | None:
    """One line when a pipeline of `p` stages idles at least IDLE_WARNING_SHARE of each step (its simulated
    bubble) with `m` micro-batches per step, saying what gives it enough (4·p micro-batches); None otherwise.
    Not an error: a test or a debug run may want it; a user who did not ask for it pays for every idle stage."""
    if p < 2:
        return None
    share = bubble_fraction(name, p, m, v)
    if share < IDLE_WARNING_SHARE:
        return None
    want = 4 * p
    return (f"warning: the pipeline idles {100 * share:.0f}% of each step: pp={p} ({name}) with {m} "
            f"micro-batch{'es' if m > 1 else ''} per step (train.global_batch / (dp x train.micro_batch)); "
            f"{want} would keep it under {100 * bubble_fraction(name, p, want, v):.0f}%, e.g. "
            f"train.global_batch={want * dp * micro_batch}")
