"""AdamW over fp32 master weights, global-norm clipping, and learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from pentatron.config import TrainConfig


class MixedPrecisionAdamW:
    """AdamW that steps fp32 master weights from the fp32 `main_grad`s and copies the result back
    into the (possibly bf16) model parameters. With fp32 parameters the master *is* the parameter.
    Norm gains (1-D tensors) get no weight decay."""

    def __init__(self, params: list[nn.Parameter], cfg: TrainConfig, master_dtype: torch.dtype) -> None:
        self.params = params
        self.master = [p if p.dtype == master_dtype else p.detach().to(master_dtype).clone() for p in params]
        decay = [m for m in self.master if m.ndim >= 2]
        no_decay = [m for m in self.master if m.ndim < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        self.inner = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                                       betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for g in self.inner.param_groups:
            g["lr"] = lr
        for m, p in zip(self.master, self.params):
            m.grad = p.main_grad
        self.inner.step()
        for m, p in zip(self.master, self.params):
            # Drop the alias: autograd must never accumulate into main_grad through `.grad`.
            m.grad = None
            if m is not p:
                p.copy_(m)

    def named_state(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The optimizer state as {"<param name>.<field>": tensor}, keyed by parameter name so a
        checkpoint does not depend on parameter order. Tensors are the live state: loading into
        them in place restores the optimizer. Fresh state is created (zeros, step 0) if needed."""
        out: dict[str, torch.Tensor] = {}
        for name, m, p in zip(names, self.master, self.params):
            state = self.inner.state[m]
            if not state:
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(m),
                             exp_avg_sq=torch.zeros_like(m))
            for key in ("step", "exp_avg", "exp_avg_sq"):
                out[f"{name}.{key}"] = state[key]
            if m is not p:
                out[f"{name}.master"] = m
        return out

    @torch.no_grad()
    def load_named_state(self, state: dict[str, torch.Tensor], names: list[str]) -> None:
        """Finish a restore done in place into `named_state()`'s tensors: refresh the model copies."""
        for m, p in zip(self.master, self.params):
            if m is not p:
                p.copy_(m)


def grad_norm_squared(grads: list[torch.Tensor]) -> torch.Tensor:
    """Σ‖g‖² in fp32 (kept squared so that sharded callers can sum partial results before the sqrt)."""
    if not grads:
        return torch.zeros(())
    return torch.stack([g.float().pow(2).sum() for g in grads]).sum()


@torch.no_grad()
def clip_by_total_norm(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale grads in place so that the global norm is at most max_norm (no-op when max_norm == 0)."""
    if max_norm <= 0:
        return
    scale = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))


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
