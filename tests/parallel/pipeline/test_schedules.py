"""Schedules as data: closed-form bubbles and in-flight counts come out of the simulator, and the
validator catches broken or deadlocking schedules."""

from __future__ import annotations

import pytest

from pentatron.schedules import (
    BW,
    Action,
    B,
    F,
    Schedule,
    ScheduleError,
    Slot,
    Timeline,
    W,
    afab,
    bubble_fraction,
    busy_window,
    idle_share,
    interleaved_1f1b,
    last_stage_awaiting_backward_closed,
    make_schedule,
    one_f_one_b,
    peak_awaiting_backward,
    peak_in_flight,
    peak_in_flight_closed,
    peak_in_flight_weighted,
    simulate,
    validate,
    zero_bubble_h1,
)

GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 12, 32)]


@pytest.mark.parametrize("name", ["afab", "1f1b"])
@pytest.mark.parametrize(("p", "m"), GRID)
def test_afab_and_1f1b_bubble_is_p_minus_1_over_m(name, p, m):
    """The playbook's ratio (idle / ideal compute) is (p-1)/m; the bubble the project shows is the idle
    share of the pipeline's time, ratio / (1 + ratio) = (p-1)/(m+p-1). Issue 46: this test asserted the
    ratio as `bubble_fraction`, which a run report printed as a percentage above 100 %."""
    tl = simulate(make_schedule(name, p, m))
    assert tl.bubble_ratio == pytest.approx((p - 1) / m, abs=1e-12)
    assert bubble_fraction(name, p, m) == tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


def test_playbook_bubble_figures():
    # Ultra-Scale Playbook, pipeline section, p = 8: its ratios, and the idle shares they are
    ratio = {(m, v): simulate(make_schedule("interleaved" if v > 1 else "1f1b", 8, m, v)).bubble_ratio
             for m, v in ((1, 1), (8, 1), (32, 1), (32, 8))}
    assert ratio[(1, 1)] == pytest.approx(7.0) and ratio[(8, 1)] == pytest.approx(0.875)
    assert round(ratio[(32, 1)], 3) == 0.219 and round(ratio[(32, 8)], 3) == 0.027
    assert bubble_fraction("1f1b", 8, 1) == pytest.approx(7 / 8)  # the ratio's 700 %
    assert bubble_fraction("1f1b", 8, 8) == pytest.approx(7 / 15)
    assert bubble_fraction("1f1b", 8, 32) == pytest.approx(7 / 39)
    assert bubble_fraction("interleaved", 8, 32, 8) == pytest.approx(7 / 263)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 16, 3), (8, 8, 4),
                                           (8, 32, 8), (3, 9, 5)])
def test_interleaved_bubble_is_p_minus_1_over_vm(p, m, v):
    # per-chunk costs are 1/v of a stage's: the bubble does not depend on the scale
    tl = simulate(make_schedule("interleaved", p, m, v), 1 / v, 2 / v, 0)
    assert tl.bubble_ratio == pytest.approx((p - 1) / (v * m), abs=1e-12)
    assert tl.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if p > 1])
def test_zero_bubble_h1_beats_1f1b(p, m):
    zb, ofob = bubble_fraction("zb", p, m), bubble_fraction("1f1b", p, m)
    assert zb < ofob
    if m >= p:  # Qi et al.: (p-1)(tF + tB - tW) idle per rank against 1F1B's (p-1)(tF + tB + tW)
        assert zb == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
        assert simulate(make_schedule("zb", p, m)).bubble_ratio == pytest.approx((p - 1) / (3 * m), abs=1e-12)


def test_the_bubble_is_a_share_of_the_window_at_its_bounds():
    """idle / (busy + idle): 0 when every rank is busy the whole window, near 1 when each is busy a
    moment, never outside [0, 1] even for busy times a rounding step above the window; no window, 0."""
    assert idle_share([10.0, 10.0], 10.0) == 0.0
    assert idle_share([1e-3, 1e-3], 10.0) == pytest.approx(1 - 1e-4)
    assert idle_share([10.0, 0.0], 10.0) == 0.5
    assert idle_share([10.0 + 1e-12, 10.0], 10.0) == 0.0
    assert idle_share([], 10.0) == idle_share([1.0], 0.0) == idle_share([1.0], float("nan")) == 0.0
    # the playbook's ratio for busy 1 of 10 on 2 ranks is 9.0: as a share, 0.9
    tl = Timeline(2, [[], []], 10.0, [1.0, 1.0])
    assert tl.bubble_ratio == pytest.approx(9.0) and tl.bubble_fraction == pytest.approx(0.9)


def test_a_ranks_busy_time_never_exceeds_its_own_window():
    """Under load a mark can land a tick early: overlapping actions count once, a slot ending before it
    starts counts nothing, so busy <= last end - first start whatever the timestamps."""
    a = Action(F, 0)
    assert busy_window([Slot(0, a, 0.0, 5.1), Slot(0, a, 5.0, 10.0)]) == (10.0, 0.0, 10.0)
    assert busy_window([Slot(0, a, 0.0, 4.0), Slot(0, a, 1.0, 2.0), Slot(0, a, 6.0, 7.0)]) == (5.0, 0.0, 7.0)
    assert busy_window([Slot(0, a, 3.0, 2.0)]) == (0.0, 3.0, 2.0)
    assert busy_window([]) == (0.0, float("inf"), float("-inf"))


@pytest.mark.parametrize(("p", "m"), GRID)
def test_peak_in_flight(p, m):
    assert peak_in_flight(afab(p, m)) == [m] * p
    ofob = peak_in_flight(one_f_one_b(p, m))
    assert max(ofob) <= p and ofob == [min(p - r, m) for r in range(p)]
    assert max(peak_in_flight(zero_bubble_h1(p, m))) <= p


@pytest.mark.parametrize("name", ["afab", "1f1b", "zb", "interleaved"])
@pytest.mark.parametrize(("p", "m", "v"), [(1, 3, 1), (2, 4, 2), (4, 4, 2), (4, 8, 3), (4, 12, 2), (8, 16, 4),
                                           (3, 9, 1)])
def test_closed_form_in_flight_matches_schedule(name, p, m, v):
    vv = v if name == "interleaved" else 1
    sched = make_schedule(name, p, m, vv)
    assert peak_in_flight_closed(name, p, m, vv) == peak_in_flight(sched)
    assert last_stage_awaiting_backward_closed(name, p, m, vv) == peak_awaiting_backward(sched, p - 1, vv - 1)


@pytest.mark.parametrize(("p", "v"), [(2, 2), (4, 2), (4, 3), (8, 2), (8, 4)])
def test_counted_warmup_when_microbatches_equal_ranks(p, v):
    """torch.distributed.pipelining's ScheduleInterleaved1F1B with m == p: rank r warms up
    min((v-1)p + 2(p-1-r), pv) forwards instead of all of them, runs to completion, and its last stage
    holds one micro-batch's loss at a time (Megatron's all-forwards-first holds p)."""
    counted = interleaved_1f1b(p, p, v, all_warmup=False)
    validate(counted)
    warm = [min((v - 1) * p + 2 * (p - 1 - r), p * v) for r in range(p)]
    assert [sum(1 for a in acts[: warm[r]] if a.kind == F) for r, acts in enumerate(counted.actions)] == warm
    assert peak_in_flight(counted) == peak_in_flight_closed("interleaved", p, p, v, all_warmup=False)
    assert peak_in_flight(counted)[-1] < p * v == peak_in_flight(interleaved_1f1b(p, p, v))[-1]
    assert peak_awaiting_backward(counted, p - 1, v - 1) == 1 == last_stage_awaiting_backward_closed(
        "interleaved", p, p, v, all_warmup=False)
    assert make_schedule("interleaved", p, 2 * p, v, all_warmup=False).actions == interleaved_1f1b(p, 2 * p, v).actions


@pytest.mark.parametrize("name", ["afab", "1f1b", "zb"])
@pytest.mark.parametrize(("p", "m"), GRID)
def test_generated_schedules_validate(name, p, m):
    s = make_schedule(name, p, m)
    validate(s)
    per_rank = 3 * m if name == "zb" else 2 * m
    assert all(len(a) == per_rank for a in s.actions)


def test_interleaved_places_stages_megatron_style():
    s = interleaved_1f1b(4, 8, 2)
    validate(s)
    assert s.n_stages == 8 and s.stage(1, 1) == 5 and s.rank_of(5) == 1
    # every rank runs every micro-batch through both of its chunks
    for r in range(4):
        fwd = {(a.microbatch, a.chunk) for a in s.actions[r] if a.kind == F}
        assert fwd == {(i, c) for i in range(8) for c in range(2)}


def test_non_uniform_costs_and_comm():
    p, m = 4, 8
    s = one_f_one_b(p, m)
    costs = [1.0, 1.0, 1.0, 3.0]  # a heavy last stage (LM head) bounds the step
    t = simulate(s, costs, costs, 0.0)
    assert t.makespan >= m * (3.0 + 3.0)
    # m = 1: the makespan is the chain F0..F3 then B3..B0 plus one hop per boundary each way
    t1 = simulate(one_f_one_b(p, 1), 1.0, 2.0, 0.0, comm=0.5)
    assert t1.makespan == pytest.approx(p * 3.0 + 2 * (p - 1) * 0.5)


def test_timeline_respects_dependencies():
    s = interleaved_1f1b(4, 8, 2)
    t = simulate(s, 1.0, 1.5, 0.5, comm=0.1)
    end = {}
    for r, slots in enumerate(t.slots):
        for a, b in zip(slots, slots[1:], strict=False):
            assert b.start >= a.end - 1e-12  # one action at a time per rank
        for sl in slots:
            end[(sl.action.kind, s.stage(r, sl.action.chunk), sl.action.microbatch)] = sl.end
    for r, slots in enumerate(t.slots):
        for sl in slots:
            st, i = s.stage(r, sl.action.chunk), sl.action.microbatch
            if sl.action.kind == F and st > 0:
                assert sl.start >= end[(F, st - 1, i)] + 0.1 - 1e-12
            if sl.action.kind == BW and st < s.n_stages - 1:
                assert sl.start >= end[(BW, st + 1, i)] + 0.1 - 1e-12
    assert sum(t.busy) == pytest.approx(4 * 8 * 2 * (1.0 + 1.5 + 0.5))


def test_validator_catches_deadlock():
    # rank 1 waits for F1 from rank 0, which waits for rank 1's backward of micro-batch 0
    s = Schedule(2, 2, 1, [[Action(F, 0), Action(BW, 0), Action(F, 1), Action(BW, 1)],
                           [Action(F, 1), Action(F, 0), Action(BW, 0), Action(BW, 1)]])
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(s)


@pytest.mark.parametrize(("actions", "match"), [
    ([[Action(BW, 0), Action(F, 0)], [Action(F, 0), Action(BW, 0)]], "before its forward"),
    ([[Action(F, 0)], [Action(F, 0), Action(BW, 0)]], "needs exactly one BW"),
    ([[Action(F, 0), Action(F, 0), Action(BW, 0)], [Action(F, 0), Action(BW, 0)]], "appears twice"),
    ([[Action(F, 0), Action(W, 0), Action(B, 0)], [Action(F, 0), Action(BW, 0)]], "before its B"),
    ([[Action(F, 0), Action(B, 0), Action(BW, 0)], [Action(F, 0), Action(BW, 0)]], "needs exactly one BW"),
    ([[Action(F, 3), Action(BW, 3)], [Action(F, 0), Action(BW, 0)]], "out of range"),
    ([[Action(F, 0), Action(BW, 0)]], "2 ranks"),
])
def test_validator_catches_broken_schedules(actions, match):
    with pytest.raises(ScheduleError, match=match):
        validate(Schedule(2, 1, 1, actions))


@pytest.mark.parametrize(("call", "match"), [
    (lambda: interleaved_1f1b(4, 2, 2), "must be at least the pipeline ranks p=4"),
    (lambda: interleaved_1f1b(4, 8, 0), "v .* must be a positive integer"),
    (lambda: one_f_one_b(0, 4), "p must be a positive integer"),
    (lambda: afab(2, 0), "m must be a positive integer"),
    (lambda: make_schedule("gpipe2", 2, 2), "unknown pipeline schedule"),
    (lambda: make_schedule("1f1b", 2, 2, 2), "only 'interleaved' uses v"),
])
def test_bad_requests(call, match):
    with pytest.raises(ScheduleError, match=match):
        call()


def test_interleaved_v1_is_1f1b():
    assert interleaved_1f1b(4, 8, 1).actions == one_f_one_b(4, 8).actions


def test_weighted_in_flight_walks_the_order_of_unequal_chunks():
    """Interleaved p=2, m=4, v=2, rank 0 runs F(0,c0) F(1,c0) F(0,c1) F(1,c1) F(2,c0) BW(0,c1) F(3,c0)
    BW(1,c1) F(2,c1) BW(0,c0) F(3,c1) BW(1,c0) then the cool-down: 5 chunks in flight at the peak. With
    an empty first chunk (an embedding-only stage) at most two one-layer chunks are held, not the 3 that
    the 5 heaviest chunks in turn would bound; with an empty last chunk, 4."""
    s = interleaved_1f1b(2, 4, 2)
    assert peak_in_flight(s)[0] == 5 == peak_in_flight_weighted(s, 0, (1, 1))
    assert peak_in_flight_weighted(s, 0, (0, 1)) == 2
    assert peak_in_flight_weighted(s, 0, (1, 0)) == 4
    # Llama 3 405B's split (pp16, v8, 32 micro-batches): rank 0's warm-up is 142 forwards, chunks 0..7 of
    # micro-batches 0..15 and chunk 0 of 16..29, so with chunk 0 empty it holds 16 x 7 layers
    llama = interleaved_1f1b(16, 32, 8)
    assert peak_in_flight_weighted(llama, 0, (0,) + (1,) * 7) == 16 * 7


def test_interleaving_runs_any_m_of_at_least_p():
    """Every m ≥ p (not only multiples of p): the schedule validates — dependencies and NCCL's p2p ordering —
    and the planner's closed forms (micro-batches in flight, the loss stage's backlog) match it; for p | m
    it is the classic schedule of groups of p."""
    from pentatron.schedules import interleaved_groups

    for p in (2, 3, 4, 8):
        for v in (2, 3, 4):
            for m in range(p, 3 * p + 2):
                for all_warmup in (True, False):
                    s = interleaved_1f1b(p, m, v, all_warmup)
                    validate(s)
                    assert peak_in_flight(s) == peak_in_flight_closed("interleaved", p, m, v, all_warmup)
                    assert (peak_awaiting_backward(s, p - 1, v - 1)
                            == last_stage_awaiting_backward_closed("interleaved", p, m, v, all_warmup))
    assert interleaved_groups(2, 5) == [3, 2] and interleaved_groups(4, 8) == [4, 4] and interleaved_groups(4, 6) == [6]
    # p | m: micro-batches 0..p-1 go through chunk 0, then chunk 1 (the classic order)
    first = [a for a in interleaved_1f1b(2, 4, 2).actions[0] if a.kind == F][:4]
    assert [(a.microbatch, a.chunk) for a in first] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_a_pipeline_idle_half_of_each_step_is_said_with_what_fills_it():
    """pp2 with one micro-batch per step idles half of it (the trainer prints this line at start); the line
    names the batch that fills the stages, and that batch's own bubble is below the warning's share."""
    from pentatron.schedules import IDLE_WARNING_SHARE, idle_warning

    line = idle_warning("1f1b", 2, 1, 1, 1, 2)
    assert line is not None and "idles 50%" in line and "train.global_batch=16" in line
    assert bubble_fraction("1f1b", 2, 8) < IDLE_WARNING_SHARE
    assert idle_warning("1f1b", 2, 2, 1, 1, 2) is None  # 1/3 idle: said by the report, not warned
    assert idle_warning("1f1b", 1, 1, 1, 1, 2) is None  # no pipeline
    assert "idles 75%" in idle_warning("afab", 4, 1, 1, 2, 1)
