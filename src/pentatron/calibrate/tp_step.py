"""The tensor-parallel step as its ranks run it, for `pentatron bench` on a CPU (`tp_step` in the profile).

Inside a tensor-parallel step a gloo all-reduce costs more than one timed in a loop, even after a block
of compute (the ranks arrive at each one apart), and the rest of a micro-batch takes about what the
1-process one takes although TP halves the arithmetic: the TP wrappers (the f/g autograd
functions, the vocab-parallel embedding and loss, the comm layer's bookkeeping) add op dispatch the
plain model's host term does not have, and the ranks dispatch on cores they share.

So bench runs the real thing: a tiny Llama (arithmetic negligible, like `measure_host_overhead`'s)
made tensor-parallel over every benched process with `apply_tensor_parallel`, forward through
`vocab_parallel_cross_entropy` and backward, at 2 and 6 layers, timing the time each rank spends
inside the tp collectives apart from the rest:

* `collective`: [(bytes, seconds)], the mean seconds of one activation all-reduce as the step experiences
  it (its latency and the wait for the other ranks), at 16, 128 and 1024 tokens (4 KiB .. 256 KiB at
  tp2): the tp layer's own collectives, not a loop of them; the planner interpolates it;
* `layer_fwd_s`, `layer_bwd_s`: host seconds per TP decoder layer outside the collectives (from the
  2 -> 6 layer difference), less the tiny model's own attention call (charged at the run's shape);
* `ends_fwd_s`, `ends_bwd_s`: the same for the vocab-parallel embedding, the head and the loss;
* `compiled_layer`: with `compiled`, the layer's host seconds again with its blocks compiled as
  `train.compile` compiles a tensor-parallel block (parallel/compile.py: each communication-free piece,
  the norms, RoPE, the attention core, the MLP's activation, a region of its own).

All ranks compute at once here, so these already include the ranks sharing the node's cores.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from pentatron.calibrate.timers import ATTEMPTS

TOKENS = 16  # one sequence; an activation of the tiny model is TOKENS x hidden fp32 numbers
COLLECTIVE_TOKENS = (16, 128, 1024)  # the in-step collective by size: activations of these many tokens
HEAD_DIM = 32
WARMUP, ITERS = 3, 20  # iterations per model; every rank runs the same count (the collectives pair them)


@dataclass(frozen=True)
class TPStep:
    layer_fwd_s: float
    layer_bwd_s: float
    ends_fwd_s: float
    ends_bwd_s: float
    collective: tuple[tuple[int, float], ...]  # (activation bytes, mean seconds per all-reduce in the step)
    tp: int
    compiled_layer: tuple[float, float] | None = None  # (fwd, bwd) host seconds per compiled TP layer

    def to_profile(self) -> dict[str, float | int]:
        """The `tp_step` table of the profile (microseconds)."""
        compiled = {} if self.compiled_layer is None else {
            "compiled_layer_fwd_us": round(self.compiled_layer[0] * 1e6, 2),
            "compiled_layer_bwd_us": round(self.compiled_layer[1] * 1e6, 2)}
        return {"layer_fwd_us": round(self.layer_fwd_s * 1e6, 2), "layer_bwd_us": round(self.layer_bwd_s * 1e6, 2),
                "ends_fwd_us": round(self.ends_fwd_s * 1e6, 2), "ends_bwd_us": round(self.ends_bwd_s * 1e6, 2),
                "collective_bytes": [b for b, _ in self.collective],
                "collective_us": [round(t * 1e6, 2) for _, t in self.collective], "tp": self.tp, **compiled}


class _TimedComm:
    """Accumulates the seconds this rank spends inside the comm layer's calls (every call of the TP
    layers goes through `comm.all_reduce` on CPU/gloo, synchronously), and each call's (bytes, seconds)."""

    def __init__(self, comm: Any) -> None:
        self.seconds, self.calls = 0.0, 0
        self.log: list[tuple[int, float]] = []
        inner = comm.all_reduce

        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = inner(tensor, *args, **kwargs)
            dt = time.perf_counter() - t0
            self.seconds += dt
            self.calls += 1
            self.log.append((tensor.numel() * tensor.element_size(), dt))
            return out

        comm.all_reduce = all_reduce  # this instance only: bench's own tp context

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


def _run(n_layers: int, tp: int, ctx: Any, timer: _TimedComm, n_tokens: int = TOKENS,
         compiled: bool = False) -> dict[str, float]:
    """Medians over ITERS of (forward, backward) wall seconds and seconds inside collectives, and the
    mean seconds of an activation-sized all-reduce ("act"), for the tiny TP Llama at `n_layers` on
    `n_tokens` tokens."""
    from pentatron.models.config import ModelConfig
    from pentatron.models.llama import Llama
    from pentatron.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy

    hidden = HEAD_DIM * tp  # one query and one kv head per rank: no replicated kv heads, no extra hook
    cfg = ModelConfig(vocab_size=16 * tp, hidden_size=hidden, n_layers=n_layers, n_heads=tp, n_kv_heads=tp,
                      ffn_hidden_size=2 * hidden, max_seq_len=n_tokens)
    torch.manual_seed(0)  # every rank builds the same full model and keeps its slice
    model = apply_tensor_parallel(Llama(cfg).to(ctx.device), ctx)
    if compiled:  # the first (warm-up) iteration compiles every region, forward and backward
        from pentatron.parallel.compile import apply_compile

        apply_compile(model, True, ctx.device)
    tokens = torch.arange(n_tokens, device=ctx.device).remainder(cfg.vocab_size).unsqueeze(0)
    rows: list[tuple[float, float, float, float]] = []
    act_bytes, act = n_tokens * hidden * 4, []
    for i in range(WARMUP + ITERS):
        ctx.comm.barrier("tp")
        timer.take()
        t0 = time.perf_counter()
        loss = vocab_parallel_cross_entropy(model(tokens).float(), tokens, ctx.comm)
        t1 = time.perf_counter()
        cf, _ = timer.take()
        loss.backward()
        t2 = time.perf_counter()
        cb, _ = timer.take()
        model.zero_grad(set_to_none=True)
        if i >= WARMUP:
            rows.append((t1 - t0, t2 - t1, cf, cb))
            act += [t for n, t in timer.log if n == act_bytes]
        timer.log.clear()
    med = [statistics.median(r[k] for r in rows) for k in range(4)]
    return {"f": med[0], "b": med[1], "cf": med[2], "cb": med[3],
            "act": statistics.fmean(act) if act else 0.0, "act_bytes": float(act_bytes)}


def _per_layer(ctx: Any, tp: int, r2: dict[str, float], r6: dict[str, float], tiny_attention: tuple[float, float]
               ) -> tuple[float, float, float, float]:
    """(layer fwd, layer bwd, ends fwd, ends bwd) host seconds from the 2- and 6-layer runs, the mean over
    the ranks (a collective call)."""
    vals = torch.tensor([r2["f"], r2["b"], r2["cf"], r2["cb"], r6["f"], r6["b"], r6["cf"], r6["cb"]],
                        dtype=torch.float64)
    ctx.comm.all_reduce(vals, "tp")  # the mean over ranks (not timed: the wrapper is only read above)
    f2, b2, cf2, cb2, f6, b6, cf6, cb6 = (vals / tp).tolist()
    af, ab = tiny_attention
    lf = max(0.0, ((f6 - cf6) - (f2 - cf2)) / 4 - af)
    lb = max(0.0, ((b6 - cb6) - (b2 - cb2)) / 4 - ab)
    return lf, lb, max(0.0, (f2 - cf2) - 2 * (lf + af)), max(0.0, (b2 - cb2) - 2 * (lb + ab))


def _layer_terms(ctx: Any, tp: int, timer: _TimedComm, tiny_attention: tuple[float, float], compiled: bool = False
                 ) -> tuple[dict[str, float], tuple[float, float, float, float]]:
    """The 6-layer run and `_per_layer`'s terms, repeated while the 6-layer model came out no slower per layer
    than the 2-layer one (the ranks decide alike: the terms are means over them)."""
    for _ in range(ATTEMPTS):
        r6 = _run(6, tp, ctx, timer, compiled=compiled)
        terms = _per_layer(ctx, tp, _run(2, tp, ctx, timer, compiled=compiled), r6, tiny_attention)
        if terms[0] > 0 and terms[1] > 0:
            break
    return r6, terms


def measure_tp_step(ctx: Any, tiny_attention: tuple[float, float], compiled: bool = False) -> TPStep:
    """Run on every rank of a tensor-parallel context `ctx` (a collective call); `tiny_attention`: the
    (forward, backward) seconds of one local attention call of the tiny model (1 head, TOKENS tokens,
    HEAD_DIM), which the planner charges at the run's shape instead. Averages over the ranks. `compiled`:
    also the compiled layer's host seconds."""
    tp = ctx.size("tp")
    timer = _TimedComm(ctx.comm)
    r6, (lf, lb, ef, eb) = _layer_terms(ctx, tp, timer, tiny_attention)
    compiled_layer = _layer_terms(ctx, tp, timer, tiny_attention, compiled=True)[1][:2] if compiled else None
    sizes = [r6] + [_run(2, tp, ctx, timer, n) for n in COLLECTIVE_TOKENS if n != TOKENS]
    acts = torch.tensor([r["act"] for r in sizes], dtype=torch.float64)
    ctx.comm.all_reduce(acts, "tp")
    collective = tuple((int(r["act_bytes"]), t / tp) for r, t in zip(sizes, acts.tolist(), strict=True))
    return TPStep(lf, lb, ef, eb, collective, tp, compiled_layer)


def tiny_attention_shape() -> tuple[int, int, int]:
    """(local heads, kv heads, tokens) of the tiny TP model's attention call, with head dim HEAD_DIM."""
    return 1, 1, TOKENS
