"""The engine's point-to-point order before issue 35, kept as a fixture: every send its own batch, issued
as soon as its producer finishes, and receives posted lazily when an action needs one (in one batch with
every earlier message the same sender issues before it). Asynchronous sends made it work on gloo; under
NCCL's ordering it deadlocks 1F1B, interleaved and ZB (the NCCL model refuses it; strict mode hangs)."""

from __future__ import annotations

from collections import defaultdict

from pentatron.schedules import MsgKey, P2PBatch, P2POp, Schedule, action_messages


def lazy_receive_plan(s: Schedule) -> list[list[P2PBatch]]:
    sent: dict[tuple[int, int], list[MsgKey]] = defaultdict(list)  # (src, dst) -> messages in sending order
    for src in range(s.p):
        for a in s.actions[src]:
            for op in action_messages(s, src, a)[1]:
                sent[(src, op.peer)].append(op.msg)
    plans = []
    for r in range(s.p):
        posted: dict[int, int] = defaultdict(int)
        have: set[MsgKey] = set()
        batches: list[P2PBatch] = []
        for i, a in enumerate(s.actions[r]):
            recv, send = action_messages(s, r, a)
            for op in recv:
                if op.msg not in have:
                    order = sent[(op.peer, r)]
                    upto = order.index(op.msg, posted[op.peer]) + 1
                    due = order[posted[op.peer]:upto]
                    batches.append(P2PBatch(i, tuple(P2POp("recv", op.peer, m) for m in due)))
                    have.update(due)
                    posted[op.peer] = upto
            batches += [P2PBatch(i + 1, (op,)) for op in send]
        plans.append(batches)
    return plans
