"""Contiguous fp32 gradient storage.

Every parameter gets `param.main_grad`, a view into one flat buffer; a post-accumulate-grad hook adds
the freshly computed `param.grad` (in the compute dtype) into it and frees `param.grad`. Gradients of
all micro-batches of a step therefore accumulate in fp32 whatever the compute dtype, and the flat
layout is what data parallelism reduces (in buckets) and ZeRO shards (by offset).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class GradBuffer:
    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype = torch.float32,
                 on_grad_ready: Callable[[nn.Parameter], None] | None = None) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        device = params[0].device if params else torch.device("cpu")
        self.data = torch.zeros(self.numel, dtype=dtype, device=device)
        self.offsets: dict[nn.Parameter, int] = {}
        self._on_grad_ready = on_grad_ready
        self._handles = []
        offset = 0
        for p in params:
            self.offsets[p] = offset
            p.main_grad = self.data[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
            self._handles.append(p.register_post_accumulate_grad_hook(self._accumulate))

    def _accumulate(self, p: nn.Parameter) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None
        if self._on_grad_ready is not None:
            self._on_grad_ready(p)

    def zero(self) -> None:
        self.data.zero_()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
