"""Activation recomputation: none, selective (the attention core, whose s² intermediates dominate
activation memory at long sequence) or full (each decoder block keeps only its input).

The checkpointed forward is installed on the module *instance*, so parameter names — and therefore
checkpoints and Hugging Face exports — are unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False)

    return run


def apply_recompute(model: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"train.recompute must be none, selective or full, got {mode!r}")
    # A pipeline rank's stages keep their layers in a dict keyed by global index.
    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in blocks:
        target = block.attn.core if mode == "selective" else block
        target.forward = _checkpointed(target.forward)
