"""The non-finite guard: a NaN/inf loss or gradient norm never reaches the weights or a checkpoint.

The loss (averaged over dp, broadcast over pp) and the global gradient norm (all-reduced over every
dimension) are the same number on every rank, so every rank takes the same decision without another
collective. `train.nonfinite`:
- "skip": the optimizer step is not taken (parameters, fp32 masters and AdamW moments and step counters
  unchanged; the gradients are zeroed by the next step), the batch counts as consumed, and the record
  carries `skipped_steps`, the run's running count; a job none of whose steps was taken stops (exit 3)
  at its last step instead of ending as if it had trained, and saves nothing meanwhile (`never_updated`);
- "stop": the run stops with `NonFiniteStop` (exit code 3) before the update; nothing is saved, so the
  last checkpoint stays the last clean state.
Before every save the whole state is checked too (`state_is_finite`), so a non-finite state is never
written whatever produced it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch

NonFiniteAction = Literal["skip", "stop"]
EXIT_CODE = 3


class NonFiniteStop(FloatingPointError):
    """The run met a non-finite loss, gradient norm or state and was told to stop (exit code 3)."""


class NonFiniteGuard:
    def __init__(self, action: NonFiniteAction) -> None:
        self.action = action
        self.skipped = 0
        self.taken = 0  # this job's steps that updated the model

    def check(self, step: int, loss: float, grad_norm: float) -> str | None:
        """None: take the optimizer step. Else what is non-finite: the caller takes no step (counted here
        under "skip"; under "stop" the caller raises `NonFiniteStop(stop_message(...))` once logged)."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.taken += 1
            return None
        if self.action == "skip":
            self.skipped += 1
        return f"step {step}: loss {loss}, gradient norm {grad_norm}"

    @property
    def never_updated(self) -> bool:
        """Every step of this job so far was skipped: the model is what the job started from, not worth a save."""
        return self.taken == 0

    def never_updated_message(self, steps: int) -> str:
        return (f"every one of this job's {steps} step(s) had a non-finite loss or gradient norm and was skipped "
                "(train.nonfinite='skip'): the model was never updated and nothing was saved. Lower train.lr or "
                "model.init_std, or set train.nonfinite='stop' to stop at the first such step")

    @staticmethod
    def stop_message(problem: str) -> str:
        return (f"non-finite {problem}; stopped before the update (train.nonfinite='stop'): the last checkpoint "
                "is the last clean state. Lower train.lr, or set train.nonfinite='skip' to skip such steps")


@torch.no_grad()
def local_nonfinite_count(tensors: Iterable[torch.Tensor]) -> int:
    """How many of `tensors` hold a NaN or inf (this rank's part of the state). One fused max-|x| norm
    per (device, dtype) group: NaN and inf propagate into it, and it is several times faster than
    `isfinite(t).all()` per tensor (no boolean copy of the state)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point() and t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    bad = 0
    for group in groups.values():
        norms = torch.stack(torch._foreach_norm(group, float("inf")))
        bad += int((~torch.isfinite(norms)).sum())
    return bad
