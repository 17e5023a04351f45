"""Materialise only this rank's pieces of a model that the parallel steps cut up on the meta device.

`parallelize` runs the pipeline split, TP/SP, CP and EP on meta parameters (no storage) and records
each parameter's `Placement`. Then every local parameter gets storage on the run's device, filled with
exactly the values the 1-process model starts from:

- without ZeRO-3 sharding, the whole local tensor: the box of the full parameter that the placement
  describes (tp shard along its dim, the ep rank's experts along dim 0);
- under ZeRO-1/2/3, the engine fills its own flat storage (ZeRO-3: only this rank's pieces) through
  `LocalInit.fill`, never allocating the local tensor.

Values come from `models.param_init.fill_slice`: only the tiles of the full parameter that the box (or
range of it) overlaps are drawn, each from a CPU generator keyed by (seed, init name, tile index), and
copied to the device. A rank's work is its share; its peak while building is its share plus one tile.

A meta tensor cannot take storage through `p.data = …` (incompatible tensor types), so a parameter is
given storage with `torch.utils.swap_tensors`, which keeps the Parameter object (ties, the engines'
maps and the modules all hold it) but not its autograd hooks: hooks on parameters are registered
after materialisation (`tensor.register_grad_hooks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pentatron.models.config import ModelConfig
from pentatron.models.llama import param_init
from pentatron.models.param_init import Box, fill_slice
from pentatron.parallel.placement import Placement


def local_box(pl: Placement) -> Box:
    """The (start, length) along each dim of the full tensor that this rank's local tensor covers."""
    full = pl.full_shape
    box = [(0, n) for n in full]
    if pl.tp.dim is not None and pl.tp.parts > 1:
        d, n = pl.tp.dim, pl.local_shape[pl.tp.dim]
        box[d] = (pl.tp.index * n, n)
    if pl.expert is not None:
        n = pl.local_shape[0]
        box[0] = (pl.expert[0] * n, n)
    return tuple(box)


@dataclass(frozen=True)
class LocalInit:
    """Fills any part of this rank's parameters with the 1-process model's initial values."""

    cfg: ModelConfig
    seed: int
    init_names: dict[str, str]  # full model's parameter name → the name its init is drawn from (ties)
    dtype: torch.dtype
    device: torch.device

    def fill(self, pl: Placement, out: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """Write elements [lo, hi) of the flattened local tensor of `pl` into `out`."""
        full = pl.full_shape
        init = param_init(self.cfg, self.seed, self.init_names.get(pl.name, pl.name), len(full))
        fill_slice(out, init, full, local_box(pl), lo, pl.numel if hi is None else hi)

    def local_tensor(self, pl: Placement) -> torch.Tensor:
        t = torch.empty(pl.local_shape, dtype=self.dtype, device=self.device)
        self.fill(pl, t)
        return t


def give_storage(p: nn.Parameter, t: torch.Tensor) -> None:
    """Point parameter `p` (meta or not) at `t`, keeping the Parameter object."""
    if p.is_meta:
        torch.utils.swap_tensors(p, nn.Parameter(t, requires_grad=p.requires_grad))
    else:
        p.data = t


def materialize_params(module: nn.Module, placements: dict[str, Placement], init: LocalInit) -> int:
    """Give every meta parameter of `module` its local tensor; returns the elements materialised."""
    done = 0
    for name, p in module.named_parameters():
        if p.is_meta:
            give_storage(p, init.local_tensor(placements[name]))
            done += p.numel()
    return done


def meta_parameters(module: nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters() if p.is_meta]
