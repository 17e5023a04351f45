"""Learning-rate schedules: linear warmup, then cosine, warmup-stable-decay (WSD) or constant."""

from __future__ import annotations

import math

from pentatron.config import TrainConfig


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
    decay_steps = max(int(round(cfg.steps * cfg.decay_fraction)), 1)
    decay_start = cfg.steps - decay_steps
    if step < decay_start:
        return peak
    t = min((step - decay_start + 1) / decay_steps, 1.0)
    return peak + (floor - peak) * t
