"""AdamW over fp32 master weights (whole parameters or ZeRO pieces) and global-norm clipping.

Shared by the data-parallel engines (which decide what each rank owns) and the trainer; the learning-rate
schedule is in `train/lr_schedule.py`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.adam import adam

from pentatron.config import TrainConfig


@dataclass(eq=False)
class Slot:
    """One tensor the optimizer updates: a whole parameter, or (ZeRO) one rank's piece of it.

    `master` is the fp32 tensor stepped in place, `grad` its fp32 gradient (same shape), `model` the
    lower-precision copy to refresh after the step (None when the master *is* the model's storage),
    `key` the checkpoint name ("<param name>" or "<param name>[lo:hi]" for a piece of the flattened
    parameter)."""

    key: str
    master: torch.Tensor
    grad: torch.Tensor
    model: torch.Tensor | None
    decay: bool


# Where torch 2.13 has a fused (one kernel per dtype/device group) AdamW: its `_fused_adamw_` for these
# devices and floating dtypes. Anything else steps with the multi-tensor `foreach` kernels.
_FUSED_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu"})
_FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def adamw_impl(masters: list[torch.Tensor]) -> str:
    """"fused" when every master is a floating tensor on a device with torch's fused AdamW, else "foreach"."""
    ok = all(m.device.type in _FUSED_DEVICES and m.dtype in _FUSED_DTYPES for m in masters)
    return "fused" if ok else "foreach"


class AdamW:
    """AdamW over `Slot`s (torch's implementation, so the arithmetic is torch's). Weight decay is
    decoupled and per element, so stepping a parameter whole or in pieces gives identical values.

    `impl` is torch's fused kernel by default (`adamw_impl`: foreach only where fused is unsupported);
    "foreach" forces the multi-tensor path (the benchmark's A/B). Both are torch's AdamW formula; the
    fused kernel rounds a few operations differently (last bits, measured in BENCHMARKS.md).

    The step is torch's functional `torch.optim.adam.adam` (decoupled weight decay: AdamW), called on
    state kept here, as `torch.optim.AdamW.step` calls it on its own: the same kernels, without the
    class, whose construction imports torch._dynamo (~1.4 s of CPU in every rank's start-up)."""

    def __init__(self, slots: list[Slot], cfg: TrainConfig, impl: str | None = None) -> None:
        self.slots = slots
        self.master = [s.master for s in slots]
        self.impl = impl or adamw_impl(self.master)
        if self.impl not in ("fused", "foreach"):
            raise ValueError(f"AdamW impl must be 'fused' or 'foreach', not {self.impl!r}")
        self.betas, self.eps, self.weight_decay = (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay
        self.state: list[dict[str, torch.Tensor]] = [{} for _ in slots]  # per slot, created at first use

    def _slot_state(self, i: int) -> dict[str, torch.Tensor]:
        state, master = self.state[i], self.slots[i].master
        if not state:
            # where torch's own lazy init puts the step counter: on the master's device (fp32) for the
            # fused kernel, which reads it there; a CPU scalar of the default dtype for foreach
            step = (torch.zeros((), dtype=torch.float32, device=master.device) if self.impl == "fused"
                    else torch.tensor(0.0))
            state.update(step=step, exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master))
        return state

    @torch.no_grad()
    def step(self, lr: float) -> None:
        fused = self.impl == "fused"
        for decay in (True, False):  # torch's two parameter groups: decayed matrices, undecayed gains
            idx = [i for i, s in enumerate(self.slots) if s.decay == decay]
            if not idx:
                continue
            states = [self._slot_state(i) for i in idx]
            adam([self.slots[i].master for i in idx], [self.slots[i].grad for i in idx],
                 [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states], [],
                 [st["step"] for st in states], foreach=not fused, fused=fused, capturable=False,
                 differentiable=False, grad_scale=None, found_inf=None, has_complex=False,
                 decoupled_weight_decay=True, amsgrad=False, beta1=self.betas[0], beta2=self.betas[1], lr=lr,
                 weight_decay=self.weight_decay if decay else 0.0, eps=self.eps, maximize=False)
        self._refresh_models()

    def _refresh_models(self) -> None:
        """The model's lower-precision copies from the masters, as one multi-tensor copy (the same rounding
        as a `copy_` per slot; on CUDA a few kernels for all slots instead of one launch per slot)."""
        pairs = [(s.model, s.master) for s in self.slots if s.model is not None]
        if pairs:
            models, masters = zip(*pairs, strict=True)
            torch._foreach_copy_(list(models), list(masters))

    def named_state(self) -> dict[str, torch.Tensor]:
        """The optimizer state as {"<slot key>.<field>": tensor}, keyed by parameter name so a
        checkpoint does not depend on parameter order. Tensors are the live state: loading into
        them in place restores the optimizer. Fresh state is created (zeros, step 0) if needed."""
        out: dict[str, torch.Tensor] = {}
        for i, s in enumerate(self.slots):
            state = self._slot_state(i)
            for key in ("step", "exp_avg", "exp_avg_sq"):
                out[f"{s.key}.{key}"] = state[key]
            if s.model is not None:
                out[f"{s.key}.master"] = s.master
        return out

    @torch.no_grad()
    def load_named_state(self, state: dict[str, torch.Tensor] | None = None) -> None:
        """Finish a restore done in place into `named_state()`'s tensors: refresh the model copies."""
        self._refresh_models()

    def master_bytes(self) -> int:
        """Bytes of the fp32 masters kept apart from the model's (bf16) parameters."""
        return sum(s.master.numel() * s.master.element_size() for s in self.slots if s.model is not None)

    def state_bytes(self) -> int:
        """Bytes of the Adam moments: measured once allocated (at the first step or a restore), before
        that the two tensors per slot that the step will allocate."""
        total = 0
        for s, state in zip(self.slots, self.state, strict=True):
            if state:
                total += sum(state[k].numel() * state[k].element_size() for k in ("exp_avg", "exp_avg_sq"))
            else:
                total += 2 * s.master.numel() * s.master.element_size()
        return total


def param_slots(params: list[nn.Parameter], names: list[str], master_dtype: torch.dtype) -> list[Slot]:
    """One slot per whole parameter, stepping an fp32 master from the parameter's fp32 `main_grad` and
    copying the result back into the (possibly bf16) parameter; with fp32 parameters the master *is* the
    parameter. Norm gains (1-D tensors) get no weight decay."""
    slots = []
    for name, p in zip(names, params, strict=True):
        master = p if p.dtype == master_dtype else p.detach().to(master_dtype).clone()
        slots.append(Slot(name, master, p.main_grad, None if master is p else p, p.ndim >= 2))
    return slots


class MixedPrecisionAdamW(AdamW):
    """AdamW over whole parameters (`param_slots`)."""

    def __init__(self, params: list[nn.Parameter], cfg: TrainConfig, master_dtype: torch.dtype,
                 names: list[str] | None = None) -> None:
        super().__init__(param_slots(params, names or [str(i) for i in range(len(params))], master_dtype), cfg)


# torch's CPU norm kernel accumulates a whole tensor in fp32 lanes: -1.6e-4 relative on 16M elements
# (-6e-6 on 0.5M), against 5e-8 when each 16 Ki-element piece is normed apart and the pieces' squares
# are summed in fp64. The pieces are views (no copy). CUDA's multi-tensor norm reduces in a tree and
# takes whole tensors.
_CPU_NORM_PIECE = 16384


def _norm_operands(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    if grads[0].device.type != "cpu":
        return grads
    return [piece for g in grads for piece in g.reshape(-1).split(_CPU_NORM_PIECE)]


@torch.no_grad()
def grad_norm_squared(grads: list[torch.Tensor], device: torch.device | str | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Σ‖g‖² in `dtype` (fp32; fp64 for fp64 gradients, which the engines pass), kept squared so that
    sharded callers can sum partial results before the sqrt, from
    `torch._foreach_norm` (no copy of any gradient; the squares of the per-tensor norms summed in fp64),
    one device computation (no host sync). A rank without gradients returns 0 on `device` (default: the
    gradients'; pass the run's device): its result goes into collectives, and NCCL has no CPU tensors."""
    if not grads:
        return torch.zeros((), dtype=dtype, device=device)
    norms = torch._foreach_norm(_norm_operands(grads), 2, dtype=dtype)
    return torch.stack(norms).double().pow(2).sum().to(dtype)



@torch.no_grad()
def clip_by_total_norm(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale grads in place so that the global norm is at most max_norm (no-op when max_norm == 0)."""
    if max_norm <= 0 or not grads:
        return
    scale = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    if all(g.dtype == scale.dtype for g in grads):
        torch._foreach_mul_(grads, scale)
    else:
        for g in grads:
            g.mul_(scale.to(g.dtype))
