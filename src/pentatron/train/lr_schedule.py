"""Learning-rate schedules: linear warmup, then cosine, warmup-stable-decay (WSD) or constant — and what
becomes of the schedule when a run resumes with other settings (`train.resume_schedule`).

A checkpoint records the schedule in effect (`LrSchedule.record`): its fields and the LR its next step
would have had. A resume that changes the schedule's fields (steps, lr, warmup, schedule, min_lr_ratio,
decay_fraction) says so in one line and follows `train.resume_schedule` (s0: the resume step, 0-based;
lr0: the saved schedule's LR at s0):

- "continue": the LR is continuous at s0. Inside the new warmup (s0 < warmup) it ramps linearly
  from lr0 to the new lr at step warmup-1, then follows the new schedule. After it, the new schedule's
  shape runs over the remaining steps starting from lr0 instead of the peak: cosine from lr0 down to
  lr·min_lr_ratio (never above lr0) at step `steps`; WSD holds lr0 until the decay phase, then decays
  linearly to that floor (from s0 when the decay phase has begun); constant stays at lr0.
- "recompute" (default): the new settings' schedule at the absolute step, as if the run had used them from
  step 0 (the LR may jump at s0; the line says so and names "continue"). The default because a run
  stopped early on purpose (steps = 1000 to try it out) and then extended to its real length wants the
  long run's schedule, and a schedule's value at a step then never depends on how the run was cut.
- "restart": warmup again from s0: the new schedule laid over the remaining steps (s0 … steps).

A resume that changes nothing keeps the schedule it saved (one that was itself continued stays so),
whatever `train.resume_schedule` says: that switch only decides what a change does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from pentatron.config import TrainConfig

# What a schedule is made of (compared at a resume), and the batch fields a resume also names if changed.
SCHEDULE_FIELDS = ("steps", "lr", "warmup", "schedule", "min_lr_ratio", "decay_fraction")
BATCH_FIELDS = ("global_batch", "seq_len")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine / WSD / constant."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup:
        return peak * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        span = max(cfg.steps - cfg.warmup, 1)
        t = min((step - cfg.warmup) / span, 1.0)
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * t))
    # warmup-stable-decay: hold the peak, then decay linearly to the floor over the last fraction.
    decay_steps, decay_start = _wsd_decay(cfg)
    if step < decay_start:
        return peak
    t = min((step - decay_start + 1) / decay_steps, 1.0)
    return peak + (floor - peak) * t


def _wsd_decay(cfg: TrainConfig) -> tuple[int, int]:
    """(steps of the WSD decay phase, its first step)."""
    decay_steps = max(int(round(cfg.steps * cfg.decay_fraction)), 1)
    return decay_steps, cfg.steps - decay_steps


@dataclass(frozen=True)
class Anchor:
    """Where a resume changed the schedule: step s0 (0-based), the LR lr0 the saved schedule gave there,
    and the `train.resume_schedule` mode that shapes the steps from s0 on."""

    step: int
    lr: float
    mode: str


@dataclass(frozen=True)
class LrSchedule:
    """A run's schedule: `cfg`'s, re-shaped from `anchor` on when a resume changed it."""

    cfg: TrainConfig
    anchor: Anchor | None = None

    def at(self, step: int) -> float:
        """The LR of optimizer step `step` (0-based)."""
        a, cfg = self.anchor, self.cfg
        if a is None or step < a.step:
            return lr_at(step, cfg)
        if a.mode == "restart":
            remaining = max(cfg.steps - a.step, 1)
            return lr_at(step - a.step, dataclasses.replace(cfg, steps=remaining, warmup=min(cfg.warmup, remaining)))
        return _continued(step, cfg, a.step, a.lr)

    def record(self, step: int) -> dict[str, Any]:
        """What a checkpoint at `step` (steps done) keeps: the fields, the anchor, the next step's LR."""
        fields = {k: getattr(self.cfg, k) for k in SCHEDULE_FIELDS + BATCH_FIELDS}
        return {**fields, "anchor": dataclasses.asdict(self.anchor) if self.anchor else None,
                "next_lr": self.at(step)}


def _continued(step: int, cfg: TrainConfig, s0: int, lr0: float) -> float:
    """"continue": the schedule from s0 on, starting at lr0 (see the module's docstring)."""
    peak = cfg.lr
    floor = min(peak * cfg.min_lr_ratio, lr0)
    if s0 < cfg.warmup:  # resumed inside the warmup: ramp from lr0 to the peak, then the schedule as set
        if step >= cfg.warmup:
            return lr_at(step, cfg)
        last = cfg.warmup - 1
        return lr0 + (peak - lr0) * (step - s0) / (last - s0) if last > s0 else peak
    if cfg.schedule == "constant":
        return lr0
    if cfg.schedule == "cosine":
        t = min((step - s0) / max(cfg.steps - s0, 1), 1.0)
        return floor + (lr0 - floor) * 0.5 * (1 + math.cos(math.pi * t))
    decay_steps, decay_start = _wsd_decay(cfg)
    if s0 < decay_start:  # still stable: hold lr0, then the decay phase as set
        if step < decay_start:
            return lr0
        return lr0 + (floor - lr0) * min((step - decay_start + 1) / decay_steps, 1.0)
    # inside the decay phase: from lr0 at s0 linearly to the floor at the last step
    return lr0 + (floor - lr0) * min((step - s0) / max(cfg.steps - 1 - s0, 1), 1.0)


def resumed_schedule(cfg: TrainConfig, saved: dict[str, Any] | None, step: int) -> tuple[LrSchedule, str | None]:
    """The schedule of a run resumed at `step` (steps done) from a checkpoint whose schedule record is
    `saved` (None: a checkpoint older than the record, or imported weights: the config's schedule), and
    the one line to print when the resume changes the schedule or the batch (None: nothing changed)."""
    if not saved:
        return LrSchedule(cfg), None
    changed = [k for k in SCHEDULE_FIELDS + BATCH_FIELDS if k in saved and saved[k] != getattr(cfg, k)]
    said = ", ".join(f"train.{k} {saved[k]} → {getattr(cfg, k)}" for k in changed)
    if not any(k in SCHEDULE_FIELDS for k in changed):  # the schedule stays as saved (continued or not)
        kept = saved.get("anchor")
        schedule = LrSchedule(cfg, Anchor(**kept) if kept else None)
        return schedule, (f"resume at step {step} changes {said}: the tokens per step change, the LR schedule "
                          "does not (the LR is not rescaled for the batch)" if changed else None)
    mode = cfg.resume_schedule
    lr0 = float(saved.get("next_lr", lr_at(step, cfg)))
    schedule = LrSchedule(cfg, None if mode == "recompute" else Anchor(step, lr0, mode))
    now = schedule.at(step)
    jump = "" if mode == "continue" or math.isclose(now, lr0, rel_tol=1e-9) else (
        f'; train.resume_schedule = "continue" keeps it at {lr0:.3g} and decays from there')
    return schedule, (f"resume at step {step} changes {said}; train.resume_schedule={mode!r}: LR {now:.3g} at step "
                      f"{step + 1} where the saved schedule gives {lr0:.3g}, {schedule.at(cfg.steps - 1):.3g} at "
                      f"step {cfg.steps}{jump}")
