"""(e) A learning rate that is too high, switched on without warmup: a loss spike, then divergence,
caught by the loss-spike detector and watched by the non-finite guard."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from pentatron.lab.common import MarkovCorpus, Verdict, debug_model, lm_loss, save_plot
from pentatron.observe.numerics import SpikeDetector

STABLE_LR = 3e-3


def _run(steps: int, jump_at: int, high_lr: float | None) -> dict:
    """Warm up to STABLE_LR over 10 steps; with `high_lr`, jump to it at step `jump_at` (no re-warmup),
    e.g. a resumed run given a larger peak LR. Clipping off, like a config that forgot it."""
    model = debug_model()
    opt = torch.optim.AdamW(model.parameters(), lr=STABLE_LR, betas=(0.9, 0.95), weight_decay=0.1)
    data = MarkovCorpus(seed=0)
    spikes = SpikeDetector(window=20, z=4.0, min_history=5)
    losses, norms, found, nonfinite_at = [], [], [], None
    for step in range(1, steps + 1):
        lr = STABLE_LR * min(1.0, step / 10)
        if high_lr is not None and step >= jump_at:
            lr = high_lr
        for g in opt.param_groups:
            g["lr"] = lr
        loss = lm_loss(model, *data.batch(8, 64))
        opt.zero_grad()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        value = loss.item()
        losses.append(value)
        norms.append(norm)
        spike = spikes.update(step, value, [])
        if spike is not None:
            found.append((step, spike.z))
        if not math.isfinite(value) or not math.isfinite(norm):  # the trainer's non-finite guard
            nonfinite_at = step
            break
        opt.step()
    return {"losses": losses, "norms": norms, "spikes": found, "nonfinite_at": nonfinite_at}


def lr_spike(out: Path, quick: bool) -> Verdict:
    steps, jump_at, high_lr = (30, 16, 1.0) if quick else (60, 31, 1.0)
    good = _run(steps, jump_at, None)
    bad = _run(steps, jump_at, high_lr)
    xs_g, xs_b = range(1, len(good["losses"]) + 1), range(1, len(bad["losses"]) + 1)
    plot = save_plot(out / "lab_lr_spike.png", f"LR {STABLE_LR:g} vs a jump to {high_lr:g} at step {jump_at}", [
        {"title": "training loss", "xlabel": "step", "ylabel": "loss",
         "series": {f"lr {STABLE_LR:g}": (list(xs_g), good["losses"]),
                    f"lr → {high_lr:g} at step {jump_at}, no warmup": (list(xs_b), bad["losses"])}},
        {"title": "gradient norm", "xlabel": "step", "ylabel": "‖g‖", "logy": True,
         "series": {f"lr {STABLE_LR:g}": (list(xs_g), good["norms"]),
                    f"lr → {high_lr:g}": (list(xs_b), bad["norms"])}}])
    first = bad["spikes"][0] if bad["spikes"] else None
    final_good, final_bad = good["losses"][-1], bad["losses"][-1]
    diverged = not math.isfinite(final_bad) or final_bad > bad["losses"][0] or final_bad > final_good + 1.0
    reproduced = first is not None and first[0] >= jump_at and diverged and not good["spikes"]
    guard = (f"the non-finite guard stopped the run at step {bad['nonfinite_at']}" if bad["nonfinite_at"]
             else "the non-finite guard did not fire (fp32 and RMSNorm keep the loss finite: the loss-spike "
                  "detector is what catches this divergence)")
    spike = f"first spike at step {first[0]} (z = {first[1]:.1f})" if first else "no spike detected"
    text = (f"lr jumps from {STABLE_LR:g} to {high_lr:g} at step {jump_at}: {spike}, {len(bad['spikes'])} spike "
            f"steps in all; loss {bad['losses'][jump_at - 2]:.2f} before the jump, {max(bad['losses']):.2f} at "
            f"worst, {final_bad:.2f} at the end vs {final_good:.2f} for the stable run (no spikes there); {guard}")
    return Verdict("lr-spike", reproduced, text,
                   {"first_spike_step": first[0] if first else None, "spike_steps": [s for s, _ in bad["spikes"]],
                    "good_spikes": len(good["spikes"]), "final_good": final_good, "final_bad": final_bad,
                    "nonfinite_at": bad["nonfinite_at"], "jump_at": jump_at}, plot)
