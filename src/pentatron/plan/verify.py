"""`pentatron plan --verify`: check the planner's formulas against the real model code.

The actual `models/llama.Llama` is built on the meta device (shapes only, no memory), with the
trainer's recompute wrapping and loss, and we count:
* parameters: the module's unique parameters;
* FLOPs: `torch.utils.flop_counter.FlopCounterMode` over forward, loss and backward. On meta (and CPU
  with the math backend) SDPA decomposes into bmm's over the *full* s x s square (the causal mask is
  applied by masking, not by skipping), so the counter sees 4*s*h_q per token per layer forward, which
  is exactly the planner's convention (PaLM/Megatron: causal half not subtracted). Careful: on real CPU
  tensors SDPA dispatches to `_scaled_dot_product_flash_attention_for_cpu`, which the counter does not
  know and counts as 0 FLOPs; on meta the math path is used, so the count is complete;
* bytes kept for backward: a dispatch mode records the storage of every tensor the forward creates;
  after forward + loss (logits dropped) the storages still alive are exactly what autograd (or the
  checkpoint) holds for backward, parameters and buffers excluded. For this pass SDPA is routed to the
  fused CPU flash-attention op (meta kernel available), which keeps q, k, v, out and the logsumexp like
  the CUDA flash kernels our GPU runs use, instead of the math path's s x s probabilities.

Single device only (tp = pp = cp = 1): the parallel code is not on meta; the sharding rules applied on
top of these totals are covered by unit tests.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from pentatron.models.config import ModelConfig
from pentatron.plan.flops import (
    flop_breakdown,
    hardware_flops_per_token,
    total_params,
)
from pentatron.plan.memory import llama_layer_activation_bytes, rope_shared_bytes, stage_extras

TOLERANCE = 0.02


@dataclass(frozen=True)
class Check:
    quantity: str
    analytic: float
    traced: float

    @property
    def rel_error(self) -> float:
        if self.traced == 0:
            return 0.0 if self.analytic == 0 else float("inf")
        return abs(self.analytic - self.traced) / abs(self.traced)

    @property
    def ok(self) -> bool:
        return self.rel_error <= TOLERANCE

    def as_dict(self) -> dict[str, Any]:
        return {"quantity": self.quantity, "analytic": self.analytic, "traced": self.traced,
                "rel_error": self.rel_error, "ok": self.ok}


class _FlashSDPA(TorchFunctionMode):
    """Route causal SDPA to the fused flash-attention op so saved tensors match the GPU kernels."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and kwargs.get("is_causal") and kwargs.get("attn_mask") is None:
            q, k, v = args[:3]
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, True, scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


class _LiveStorages(TorchDispatchMode):
    """Remember every storage created by an op (a freed one may be reused: keep the live record)."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip = skip
        self.seen: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata in self.skip:
                    continue
                old = self.seen.get(ref.cdata)
                if old is None or old[0].expired():
                    self.seen[ref.cdata] = (ref, t.untyped_storage().nbytes())
        return out

    def live_bytes(self) -> int:
        gc.collect()
        return sum(n for ref, n in self.seen.values() if not ref.expired())


def _meta_model(cfg: ModelConfig, dtype: torch.dtype, recompute: str) -> torch.nn.Module:
    from pentatron.models.llama import Llama
    from pentatron.parallel.recompute import apply_recompute

    with torch.device("meta"):
        model = Llama(cfg)
    for p in model.parameters():  # as models.llama.build_model: parameters cast, RoPE tables stay fp32
        p.data = p.data.to(dtype)
    apply_recompute(model, recompute)
    return model


def _loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # the trainer's loss (train/trainer.py): cross-entropy on fp32 logits
    logits = model(tokens)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def verify_model(cfg: ModelConfig, seq_len: int, *, micro_batch: int = 1, recompute: str = "none",
                 precision: str = "bf16") -> list[Check]:
    """Analytic vs traced parameters, FLOPs and saved activation bytes for one micro-batch."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    b, s = micro_batch, seq_len
    tokens_n = b * s
    checks = []
    model = _meta_model(cfg, dtype, recompute)
    traced_params = sum(p.numel() for p in model.parameters())
    checks.append(Check("parameters", total_params(cfg), traced_params))
    if cfg.moe is not None:
        # Routing is data-dependent (top-k, token counts): the meta device cannot run it, so an MoE model
        # is checked for its parameters only (FLOPs and activations are the planner's formulas, untraced).
        return checks

    tokens = torch.zeros(b, s, dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False)
    with counter:
        loss = _loss(model, tokens, tokens)
        fwd = counter.get_total_flops()
        loss.backward()
    total = counter.get_total_flops()
    fb = flop_breakdown(cfg, s)
    checks.append(Check("forward FLOPs", fb.forward * tokens_n, fwd))
    # the meta pass runs SDPA's math path (selective replays only QK^T) and torch's early-stop checkpoint
    checks.append(Check(f"training FLOPs (fwd+bwd, recompute {recompute})",
                        hardware_flops_per_token(cfg, s, recompute, attention="math", early_stop=True) * tokens_n,
                        total))
    del loss, model
    gc.collect()

    model = _meta_model(cfg, dtype, recompute)
    skip = {StorageWeakRef(t.untyped_storage()).cdata for t in [*model.parameters(), *model.buffers()]}
    tracker = _LiveStorages(skip)
    with _FlashSDPA(), tracker:
        tok = torch.zeros(b, s, dtype=torch.long, device="meta")
        loss = _loss(model, tok, tok.clone())
        del tok
        saved = tracker.live_bytes()
    layer = llama_layer_activation_bytes(cfg, tokens_n, s, precision=precision, recompute=recompute)
    extra, _ = stage_extras(cfg, tokens_n, first=True, last=True, precision=precision)
    # + the loss scalar and nll's total weight (two fp32 scalars)
    analytic = cfg.n_layers * layer.saved + extra + rope_shared_bytes(cfg, s, precision, recompute) + 8
    checks.append(Check(f"bytes saved for backward (recompute {recompute})", analytic, saved))
    del loss, model
    gc.collect()
    return checks


def format_checks(name: str, seq_len: int, micro_batch: int, checks: list[Check]) -> str:
    lines = [f"verify {name}: seq {seq_len}, micro-batch {micro_batch} (meta device, single GPU)",
             f"  {'quantity':<46} {'analytic':>16} {'traced':>16} {'error':>8}"]
    for c in checks:
        lines.append(f"  {c.quantity:<46} {c.analytic:>16.6g} {c.traced:>16.6g} {100 * c.rel_error:>7.3f}%"
                     + ("" if c.ok else "  FAIL"))
    return "\n".join(lines)
