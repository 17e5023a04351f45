"""Numerics you can see: per-layer gradient norm, update/weight ratio, parameter norm and max |activation|
of each block's output every `log.numerics_every` steps, and loss-spike detection on every step.

Per-layer numbers are this rank's view: the gradient elements it owns after the data-parallel
reduction (all of them without ZeRO; its shard with ZeRO ≥ 1), its tensor-parallel shard, its
pipeline stage's layers. The trainer logs rank 0's (first stage, tp shard 0). A layer is the
parameter name up to the block index ("layers.3") or its first component ("embed", "norm", …).

Under train.fp8, `fp8_amax` and `fp8_scale` give, per FP8 linear layer and operand ("layers.0.attn.q_proj.x",
… ".w", ".dy": input, weight, output gradient), the largest amax and the smallest scale its casts used during
the step (parallel/fp8.py; rowwise: the largest row's). The scale is fp8's largest value ÷ amax: an amax
growing by orders of magnitude, or a scale collapsing, is an overflow coming, and an operand whose amax is
far above its typical values leaves those values in fp8's subnormals or at zero.

A non-finite number is written as the string "nan" / "inf" (JSON has no NaN). `nonfinite_acts` lists
the blocks whose output was not finite, in forward order: the first is where a NaN appeared in the
forward pass. `nonfinite_grads` lists the layers whose gradient is not finite (after a forward NaN,
all of them; a NaN born in backward spares the layers backward had not reached).
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pentatron.parallel.fp8_stats import OPERANDS, fp8_gemm

_BLOCK = re.compile(r"(?:^|\.)(layers\.\d+)(?:\.|$)")


def layer_of(param_name: str) -> str:
    m = _BLOCK.search(param_name)
    return m.group(1) if m else param_name.split(".")[0]


def _num(v: float) -> float | str:
    return v if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))


def _norms(pairs: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    sq: dict[str, torch.Tensor] = {}
    for layer, t in pairs:
        s = t.detach().float().pow(2).sum()
        sq[layer] = sq[layer] + s if layer in sq else s
    if not sq:
        return {}
    values = torch.stack(list(sq.values())).sqrt().tolist()  # one device→host copy
    return dict(zip(sq, values))


class LayerNumerics:
    """Hooks on each block's output, and per-layer norms computed from the parameters on demand."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {p: layer_of(n) for n, p in model.named_parameters()}
        self.active = False
        self.act_max: dict[str, float] = {}
        self._act: dict[str, torch.Tensor] = {}
        self._before: dict[nn.Parameter, torch.Tensor] = {}
        self._hooks = [m.register_forward_hook(self._hook(name)) for name, m in self._blocks(model)]
        # train.fp8's GEMMs (parallel/fp8.py's Fp8Gemm, found without importing torchao)
        self.fp8 = {name: g for name, m in model.named_modules() if (g := fp8_gemm(m)) is not None}

    @staticmethod
    def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
        out = []
        for name, m in model.named_modules():
            found = _BLOCK.search(name)
            if found and name.endswith(found.group(1)):
                out.append((found.group(1), m))
        return out

    def _hook(self, layer: str) -> Any:
        def hook(_m: nn.Module, _inputs: Any, output: Any) -> None:
            if self.active and isinstance(output, torch.Tensor):
                m = output.detach().abs().amax().float()
                self._act[layer] = torch.maximum(self._act[layer], m) if layer in self._act else m
        return hook

    def begin(self, active: bool) -> None:
        self.active = active
        self._act = {}
        self._before = {}
        for gemm in self.fp8.values():
            gemm.clear_stats()

    def gradients(self, owned: list[tuple[nn.Parameter, torch.Tensor]]) -> dict[str, Any]:
        """After the gradient sync: per-layer gradient and parameter norms; snapshot for the update ratio."""
        grads = _norms((self.names.get(p, "?"), g) for p, g in owned)
        params = _norms((self.names.get(p, "?"), p) for p in self.names)
        self._before = {p: p.detach().clone() for p in self.names}
        order = list(dict.fromkeys(self.names.values()))
        bad = [layer for layer in order if layer in grads and not math.isfinite(grads[layer])]
        acts = dict(zip(self._act, torch.stack(list(self._act.values())).tolist())) if self._act else {}
        fp8 = self._fp8() if self.active else {}
        return {**fp8, "grad_norm": {k: _num(v) for k, v in grads.items()},
                "param_norm": {k: _num(v) for k, v in params.items()},
                "act_max": {k: _num(v) for k, v in acts.items()},
                "nonfinite_acts": [k for k, v in acts.items() if not math.isfinite(v)],
                "nonfinite_grads": bad}

    def _fp8(self) -> dict[str, Any]:
        """fp8_amax / fp8_scale by "<module>.<operand>", for the operands cast since `begin` (Fp8Gemm.stats: row 0
        amax, -1 where none was cast; row 1 scale; columns x, w, dy), in one device→host copy."""
        if not self.fp8:
            return {}
        values = torch.stack([g.stats for g in self.fp8.values()]).tolist()
        cast = [(f"{name}.{op}", amax[i], scale[i]) for name, (amax, scale) in zip(self.fp8, values)
                for i, op in enumerate(OPERANDS) if amax[i] >= 0]
        if not cast:
            return {}
        return {"fp8_amax": {k: _num(a) for k, a, _ in cast}, "fp8_scale": {k: _num(s) for k, _, s in cast}}

    def updates(self) -> dict[str, Any]:
        """After the optimizer step: ‖Δw‖ / ‖w‖ per layer (Adam's is about lr / typical |w|)."""
        if not self._before:
            return {}
        delta = _norms((self.names[p], p.detach() - w) for p, w in self._before.items() if p.shape == w.shape)
        weight = _norms((self.names[p], w) for p, w in self._before.items() if p.shape == w.shape)
        self._before = {}
        return {"update_ratio": {k: _num(delta[k] / weight[k]) if weight[k] > 0 else _num(float("nan"))
                                 for k in delta}}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


@dataclass
class Spike:
    step: int
    loss: float
    z: float
    mean: float
    std: float
    samples: list[int]

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "loss": _num(self.loss), "z": _num(self.z), "mean": self.mean,
                "std": self.std, "samples": self.samples}

    def describe(self) -> str:
        head = ", ".join(map(str, self.samples[:8])) + (" …" if len(self.samples) > 8 else "")
        return (f"loss spike at step {self.step}: {self.loss:.4f} is {self.z:.1f} σ above the last "
                f"window mean {self.mean:.4f} (σ {self.std:.4f}); samples of this step: {head}")


class SpikeDetector:
    """z-score of each loss against the previous `window` losses (spikes are kept out of the window, so
    one spike does not hide the next). A non-finite loss is always a spike."""

    def __init__(self, window: int = 50, z: float = 4.0, min_history: int = 10) -> None:
        self.window: deque[float] = deque(maxlen=window)
        self.z = z
        self.min_history = min_history

    def update(self, step: int, loss: float, samples: list[int]) -> Spike | None:
        hist = list(self.window)
        if not math.isfinite(loss):
            return Spike(step, loss, float("inf"), _mean(hist), _std(hist), samples)
        spike = None
        if len(hist) >= self.min_history:
            mean, std = _mean(hist), _std(hist)
            z = (loss - mean) / max(std, 1e-6 * max(abs(mean), 1.0))
            if z > self.z:
                spike = Spike(step, loss, z, mean, std, samples)
        if spike is None:
            self.window.append(loss)
        return spike


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
