"""The point-to-point plan under NCCL's rules (`schedules.check_p2p`): the engine's plan passes for every
schedule the layout allows; the pre-issue-35 order (`legacy_plan`) is refused wherever messages cross
in both directions, with the ranks and ops on the cycle named; a plan whose messages do not pair is
refused too."""

from __future__ import annotations

import pytest

from pentatron.schedules import (
    P2PBatch,
    P2POp,
    Schedule,
    ScheduleError,
    action_messages,
    check_p2p,
    interleaved_1f1b,
    make_schedule,
    p2p_plan,
    validate,
)
from tests.parallel.pipeline.legacy_plan import lazy_receive_plan


def _every_schedule() -> list[Schedule]:
    out = []
    for p in (2, 3, 4, 8):
        for m in (1, 2, 3, 4, 5, 8, 16):
            out += [make_schedule(n, p, m) for n in ("afab", "1f1b", "zb")]
            out += [make_schedule("interleaved", p, m, v) for v in (2, 3) if m >= p]
            out += [interleaved_1f1b(p, m, 2, all_warmup=False)] if m >= p else []
    return out


def test_the_engine_plan_passes_the_nccl_model_for_every_schedule():
    schedules = _every_schedule()
    assert len(schedules) > 100
    for s in schedules:
        validate(s)  # the compute order and p2p_plan(s) under NCCL's rules
        plan = p2p_plan(s)
        # every message the schedule implies is sent and received exactly once
        implied = {op.msg for r in range(s.p) for a in s.actions[r] for op in action_messages(s, r, a)[1]}
        for kind in ("send", "recv"):
            got = [op.msg for bs in plan for b in bs for op in b.ops if op.op == kind]
            assert sorted(got) == sorted(implied), (s.name, s.p, s.m, s.v, kind)


@pytest.mark.parametrize(("name", "p", "m", "v"), [("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 16, 1),
                                                   ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2),
                                                   ("zb", 2, 4, 1), ("zb", 4, 8, 1)])
def test_the_old_issue_order_is_refused(name, p, m, v):
    s = make_schedule(name, p, m, v)
    with pytest.raises(ScheduleError, match="p2p deadlock under NCCL ordering, cycle of ranks") as e:
        check_p2p(s, lazy_receive_plan(s))
    text = str(e.value)
    assert "waits to send" in text and "which rank" in text  # the ops on the cycle, by rank
    with pytest.raises(ScheduleError):
        validate(s, lazy_receive_plan(s))
    validate(s)  # the engine's own plan for the same schedule passes


def test_the_old_order_names_the_1f1b_steady_state_cycle():
    s = make_schedule("1f1b", 2, 4)
    with pytest.raises(ScheduleError) as e:
        check_p2p(s, lazy_receive_plan(s))
    text = str(e.value)
    assert "cycle of ranks 0 → 1 → 0" in text
    assert "rank 0 in batch 1 (before action 2) waits to send act(stage 1, mb 1) to rank 1" in text
    assert "rank 1 in batch 1 (before action 2) waits to send grad(stage 0, mb 0) to rank 0" in text


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 8)])
def test_afab_survives_even_the_old_order(p, m):
    s = make_schedule("afab", p, m)
    check_p2p(s, lazy_receive_plan(s))


def test_mismatched_and_unpaired_plans_are_refused():
    s = make_schedule("afab", 2, 2)
    a0, a1 = ("act", 1, 0), ("act", 1, 1)
    swapped = [[P2PBatch(1, (P2POp("send", 1, a0),)), P2PBatch(2, (P2POp("send", 1, a1),))],
               [P2PBatch(0, (P2POp("recv", 0, a1), P2POp("recv", 0, a0)))]]
    with pytest.raises(ScheduleError, match="do not match"):
        check_p2p(s, swapped)
    with pytest.raises(ScheduleError, match="has no matching receive"):
        check_p2p(s, [swapped[0], [P2PBatch(0, (P2POp("recv", 0, a0),))]])
    with pytest.raises(ScheduleError, match="for 1 ranks"):
        check_p2p(s, swapped[:1])
