"""A resume that changes the LR schedule (train.resume_schedule): the LR at the resume step, each mode's
rules, and a resume without changes keeping the schedule it saved."""

import pytest

from pentatron.config import TrainConfig
from pentatron.train.lr_schedule import LrSchedule, lr_at, resumed_schedule

OLD = TrainConfig(steps=150, warmup=10, lr=1e-3, min_lr_ratio=0.1, schedule="cosine")


def _resume(saved_cfg: TrainConfig, new: TrainConfig, step: int, saved_anchor: LrSchedule | None = None):
    saved = (saved_anchor or LrSchedule(saved_cfg)).record(step)
    return resumed_schedule(new, saved, step)


def test_continue_keeps_the_lr_continuous_and_decays_to_the_new_floor():
    new = TrainConfig(steps=300, warmup=10, lr=1e-3, min_lr_ratio=0.1, schedule="cosine", resume_schedule="continue")
    s0 = 120
    schedule, line = _resume(OLD, new, s0)
    assert schedule.at(s0) == pytest.approx(lr_at(s0, OLD), rel=1e-12)  # what the old run's next step had
    assert lr_at(s0, new) > 2 * lr_at(s0, OLD)  # recomputing over 300 steps would have jumped
    lrs = [schedule.at(s) for s in range(s0, 300)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])) and lrs[-1] == pytest.approx(1e-4, rel=1e-3)
    assert line is not None and "\n" not in line
    assert "train.steps 150 → 300" in line and "train.resume_schedule='continue'" in line
    assert f"at step {s0 + 1}" in line


def test_recompute_by_default_takes_the_new_schedule_at_the_absolute_step_and_says_the_jump():
    new = TrainConfig(steps=300, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    assert new.resume_schedule == "recompute"
    schedule, line = _resume(OLD, new, 150)
    assert [schedule.at(s) for s in (150, 299)] == [lr_at(150, new), lr_at(299, new)]
    assert f"'recompute': LR {lr_at(150, new):.3g} at step 151 where the saved schedule gives {lr_at(150, OLD):.3g}" \
        in line and 'train.resume_schedule = "continue" keeps it' in line


def test_restart_warms_up_again_over_the_remaining_steps():
    new = TrainConfig(steps=200, warmup=10, lr=5e-4, min_lr_ratio=0.1, resume_schedule="restart")
    schedule, _ = _resume(OLD, new, 100)
    assert schedule.at(100) == pytest.approx(5e-4 / 10) and schedule.at(109) == pytest.approx(5e-4)
    assert schedule.at(200) == pytest.approx(5e-5)


@pytest.mark.parametrize("kind", ["wsd", "constant"])
def test_continue_for_wsd_and_constant(kind):
    old = TrainConfig(steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.0, schedule=kind, decay_fraction=0.2)
    new = TrainConfig(steps=100, warmup=10, lr=2e-3, min_lr_ratio=0.0, schedule=kind, decay_fraction=0.2,
                      resume_schedule="continue")
    schedule, _ = _resume(old, new, 50)
    assert schedule.at(50) == pytest.approx(1e-3)
    if kind == "constant":
        assert schedule.at(99) == pytest.approx(1e-3)
    else:  # held, then the decay phase down to the floor
        assert schedule.at(79) == pytest.approx(1e-3) and schedule.at(99) == pytest.approx(0.0, abs=1e-12)
    inside, _ = _resume(old, new, 90)  # resumed inside the decay phase: from lr0 to the floor
    assert inside.at(90) == pytest.approx(lr_at(90, old))
    end = pytest.approx(0.0, abs=1e-12) if kind == "wsd" else pytest.approx(lr_at(90, old))
    assert inside.at(99) == end


def test_resumed_inside_the_warmup_ramps_from_the_current_lr():
    old = TrainConfig(steps=100, warmup=20, lr=1e-3)
    new = TrainConfig(steps=100, warmup=20, lr=2e-3, resume_schedule="continue")
    schedule, _ = _resume(old, new, 5)
    assert schedule.at(5) == pytest.approx(lr_at(5, old)) and schedule.at(19) == pytest.approx(2e-3)
    assert schedule.at(50) == lr_at(50, new)


def test_an_unchanged_resume_keeps_the_continued_schedule_and_says_nothing():
    new = TrainConfig(steps=300, warmup=10, lr=1e-3, min_lr_ratio=0.1, resume_schedule="continue")
    continued, _ = _resume(OLD, new, 120)
    again, line = _resume(new, new, 200, saved_anchor=continued)  # a second resume, nothing changed
    assert line is None and [again.at(s) for s in (200, 299)] == [continued.at(200), continued.at(299)]


def test_a_batch_change_is_said_and_leaves_the_schedule():
    new = TrainConfig(steps=150, warmup=10, lr=1e-3, min_lr_ratio=0.1, global_batch=16)
    schedule, line = _resume(OLD, new, 100)
    assert schedule.at(120) == lr_at(120, OLD)
    assert "train.global_batch 8 → 16" in line and "not rescaled" in line


def test_an_old_checkpoint_without_a_record_keeps_todays_rule():
    schedule, line = resumed_schedule(OLD, None, 100)
    assert line is None and schedule.at(120) == lr_at(120, OLD)
