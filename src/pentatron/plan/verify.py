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

With tp > 1 (and SP) or pp > 1 the bytes are traced on one rank of the layout it is given: the model
is split as the runtime does (`parallelize`: this rank's pipeline stage, then tensor parallelism, then
recompute) and its collectives run through `_ShapeComm`, which gives each result its shape and no
value (on meta there are no values): the saved tensors are the real parallelized block's. For pp > 1
the traced stage is the last one (its layers, the final norm, the LM head and the vocab-parallel loss,
fed the hidden state it receives). Parameters are counted for the whole model and for that rank;
FLOPs for the whole model (per-rank FLOPs are that total split by the planner's rules, unit-tested).
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
from torch.utils.flop_counter import FlopCounterMode, mm_flop

from pentatron.distributed.comm import Comm, CommLedger, Work
from pentatron.models.config import ModelConfig
from pentatron.plan.flops import (
    flop_breakdown,
    hardware_flops_per_token,
    total_params,
)
from pentatron.plan.layout import Layout, Workload, chunk_layers
from pentatron.plan.memory import (
    LOSS_CHUNK_TOKENS,
    llama_layer_activation_bytes,
    pipeline_boundary_bytes,
    rank_params,
    rope_shared_bytes,
    stage_extras,
)
from pentatron.plan.recipes import training_loss

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


class _ShapeComm(Comm):
    """The comm layer of one rank on the meta device: each collective leaves its output as allocated
    (the right shape; meta tensors hold no values), so the parallel code runs its real forward."""

    def __init__(self, layout: Any) -> None:
        from pentatron.distributed.context import DERIVED_DIMS, MESH_DIMS, ParallelContext

        ctx = ParallelContext(layout, 0, torch.device("meta"), {d: None for d in (*MESH_DIMS, *DERIVED_DIMS)})
        super().__init__(ctx, CommLedger(), strict=False)

    def all_reduce(self, tensor: torch.Tensor, dim: str, op: str = "sum", async_op: bool = False) -> Work | None:
        return self._done(None, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, dim: str, op: str = "sum",
                       async_op: bool = False) -> Work | None:
        return self._done(None, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, dim: str,
                   async_op: bool = False) -> Work | None:
        return self._done(None, async_op)


def _meta_model(cfg: ModelConfig, dtype: torch.dtype, recompute: str, tp: int = 1, sp: bool = False,
                pp: int = 1, seq_len: int = 1) -> tuple[torch.nn.Module, Comm | None]:
    """The model on the meta device as one rank runs it: for pp > 1 the last pipeline stage, under tp its
    tensor-parallel shard (with the comm its collectives go through), then recompute (`parallelize`'s order)."""
    from pentatron.layout import ParallelLayout
    from pentatron.models.llama import Llama
    from pentatron.parallel.pipeline.stages import PipelineStage, stage_layers
    from pentatron.parallel.recompute import apply_recompute
    from pentatron.parallel.tensor import apply_tensor_parallel

    with torch.device("meta"):
        model: torch.nn.Module = Llama(cfg)
    for p in model.parameters():  # as models.llama.build_model: parameters cast, RoPE tables stay fp32
        p.data = p.data.to(dtype)
    if pp > 1:
        ranges = stage_layers(cfg, pp, 1, seq_len)
        model = PipelineStage(model, pp - 1, pp, ranges[-1])
    comm = None
    if tp > 1:
        comm = _ShapeComm(ParallelLayout(tp=tp, sp=sp, seq_len=seq_len))
        apply_tensor_parallel(model, comm.ctx, comm, sp=sp)
    apply_recompute(model, recompute)
    return model, comm


def _loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor, comm: Comm | None = None,
          positions: torch.Tensor | None = None, chunk_tokens: int = 0) -> torch.Tensor:
    """The trainer's loss: with `chunk_tokens` > 0 (train.loss_chunk_tokens, the default) the LM head's
    chunked loss (models/loss.py, vocab-parallel under tp), else parallel/parallelize._loss_fn's
    cross-entropy on fp32 logits (vocab-parallel under tp)."""
    from pentatron.parallel.parallelize import set_loss_chunk_tokens
    from pentatron.parallel.tensor import vocab_parallel_cross_entropy

    if chunk_tokens > 0:
        set_loss_chunk_tokens(model, chunk_tokens)
        return model(tokens, positions, targets=targets)
    logits = model(tokens) if positions is None else model(tokens, positions)
    if comm is not None:
        return vocab_parallel_cross_entropy(logits.float(), targets, comm)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _addmm_flops(self_shape: Any, a_shape: Any, b_shape: Any, *args: Any, **kwargs: Any) -> int:
    """FLOPs of the in-place `addmm_` (the counter's own table has `addmm` only): its matmul."""
    return mm_flop(a_shape, b_shape)


def verify_model(cfg: ModelConfig, seq_len: int, *, micro_batch: int = 1, recompute: str = "none",
                 precision: str = "bf16", tp: int = 1, sp: bool = False, pp: int = 1,
                 loss_chunk_tokens: int = LOSS_CHUNK_TOKENS) -> list[Check]:
    """Analytic vs traced parameters, FLOPs and saved activation bytes for one micro-batch; the bytes
    (and the rank's parameters) on one rank of the layout (tp, sp, pp): the last stage for pp > 1.
    `loss_chunk_tokens`: train.loss_chunk_tokens, the loss traced (training's default: the chunked loss,
    whose backward recomputes the head's logits; 0: the loss from full fp32 logits)."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    loss_kind = training_loss(loss_chunk_tokens)
    chunk = loss_chunk_tokens
    b, s = micro_batch, seq_len
    tokens_n = b * s
    sp = sp and tp > 1
    checks = []
    model, _ = _meta_model(cfg, dtype, recompute)
    traced_params = sum(p.numel() for p in model.parameters())
    checks.append(Check("parameters", total_params(cfg), traced_params))
    parallel = tp > 1 or pp > 1
    w = Workload(cfg, s, b)
    lay = Layout(tp=tp, sp=sp, pp=pp, micro_batch=b, recompute=recompute, precision=precision)
    if parallel:
        part, _ = _meta_model(cfg, dtype, recompute, tp, sp, pp, s)
        rp = rank_params(w, lay, pp - 1)  # experts whole on the rank: verify builds no ep split
        checks.append(Check(f"parameters on one rank ({_where(tp, sp, pp)})", rp.dense + rp.expert,
                            sum(p.numel() for p in part.parameters())))
        del part
    if cfg.moe is not None:
        # Routing is data-dependent (top-k, token counts): the meta device cannot run it, so an MoE model
        # is checked for its parameters only (FLOPs and activations are the planner's formulas, untraced).
        return checks

    tokens = torch.zeros(b, s, dtype=torch.long, device="meta")
    # the chunked loss's fp32 dW accumulates in place (addmm_), which the counter's table lacks
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_flops})
    with counter:
        loss = _loss(model, tokens, tokens, chunk_tokens=chunk)
        fwd = counter.get_total_flops()
        loss.backward()
    total = counter.get_total_flops()
    fb = flop_breakdown(cfg, s)
    checks.append(Check("forward FLOPs", fb.forward * tokens_n, fwd))
    # the meta pass runs SDPA's math path (selective replays only QK^T) and torch's early-stop checkpoint;
    # the chunked loss's backward replays the head GEMM of every chunk but the last
    checks.append(Check(f"training FLOPs (fwd+bwd, recompute {recompute}, loss {loss_kind})",
                        hardware_flops_per_token(cfg, s, recompute, attention="math", early_stop=True,
                                                 cross_entropy=loss_kind, loss_tokens=micro_batch * s,
                                                 chunk_tokens=max(chunk, 1)) * tokens_n,
                        total))
    del loss, model
    gc.collect()

    model, comm = _meta_model(cfg, dtype, recompute, tp, sp, pp, s)
    skip = {StorageWeakRef(t.untyped_storage()).cdata for t in [*model.parameters(), *model.buffers()]}
    tracker = _LiveStorages(skip)
    with _FlashSDPA(), tracker:
        tok = torch.zeros(b, s, dtype=torch.long, device="meta")
        if pp > 1:  # the last stage's input: the hidden state it receives (its sequence shard under SP)
            x = torch.zeros(b, s // tp if sp else s, cfg.hidden_size, dtype=dtype, device="meta",
                            requires_grad=True)
            loss = _loss(model, x, tok.clone(), comm, torch.arange(s, device="meta"), chunk)
            del x
        else:
            loss = _loss(model, tok, tok.clone(), comm, chunk_tokens=chunk)
        del tok
        saved = tracker.live_bytes()
    layer = llama_layer_activation_bytes(cfg, tokens_n, s, precision=precision, recompute=recompute, tp=tp, sp=sp)
    n_layers = chunk_layers(w, lay)[-1] if pp > 1 else cfg.n_layers
    extra, _ = stage_extras(cfg, tokens_n, first=pp == 1, last=True, precision=precision, tp=tp, sp=sp,
                            cross_entropy=loss_kind, loss_chunk_tokens=max(chunk, 1))
    # + the loss scalar and nll's total weight (two fp32 scalars; our own losses' mean, chunked or
    # vocab-parallel, divides by an int64 token count instead); for pp > 1 the received input
    scalars = 4 + 8 if loss_kind == "chunked" or tp > 1 else 8
    analytic = (n_layers * layer.saved + extra + rope_shared_bytes(cfg, s, precision, recompute) + scalars
                + pipeline_boundary_bytes(w, lay, pp - 1, 1))
    where = f", {_where(tp, sp, pp)}" if parallel else ""
    checks.append(Check(f"bytes saved for backward (recompute {recompute}{where})", analytic, saved))
    del loss, model
    gc.collect()
    return checks


def _where(tp: int, sp: bool, pp: int) -> str:
    parts = [f"tp{tp}" + ("+sp" if sp else "")] if tp > 1 else []
    return ", ".join(parts + ([f"pp{pp} last stage"] if pp > 1 else []))


def format_checks(name: str, seq_len: int, micro_batch: int, checks: list[Check],
                  loss_chunk_tokens: int = LOSS_CHUNK_TOKENS) -> str:
    loss = (f"the loss in chunks of {loss_chunk_tokens} tokens" if loss_chunk_tokens > 0
            else "the loss from full fp32 logits")
    lines = [f"verify {name}: seq {seq_len}, micro-batch {micro_batch}, {loss} (meta device)",
             f"  {'quantity':<46} {'analytic':>16} {'traced':>16} {'error':>8}"]
    for c in checks:
        lines.append(f"  {c.quantity:<46} {c.analytic:>16.6g} {c.traced:>16.6g} {100 * c.rel_error:>7.3f}%"
                     + ("" if c.ok else "  FAIL"))
    return "\n".join(lines)
