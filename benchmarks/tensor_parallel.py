"""Our tensor parallelism vs PyTorch's `torch.distributed.tensor.parallel` (DTensor ColwiseParallel /
RowwiseParallel, and its SequenceParallel plan), on the same stack of decoder blocks, with and
without sequence parallelism: gloo ranks on CPU, forward + backward per step.

    python benchmarks/tensor_parallel.py [--tp 2] [--layers 4] [--hidden 512] [--seq-len 256] [--micro-batch 4]

Each implementation runs in its own fresh set of processes. tokens/s is the micro-batch's b·s tokens
per step (the tp ranks work on the same tokens together). Before timing, every implementation's
output and input gradient are checked against the unsharded stack, so the comparison is between
equal computations. Collective calls per step are counted with our ledger (ours) and with DTensor's `CommDebugMode`
(DTensor's functional collectives do not go through our comm layer).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from ranks import add_timing_args, best_of, run_on_ranks
from torch.utils._python_dispatch import TorchDispatchMode

IMPLS = ("ours-tp", "torch-tp", "ours-tp-sp", "torch-tp-sp")


def _model_cfg(args: argparse.Namespace) -> Any:
    from pentatron.models.registry import get_model_config

    heads = args.hidden // 64
    return replace(get_model_config("debug"), hidden_size=args.hidden, n_layers=args.layers, n_heads=heads,
                   n_kv_heads=max(heads // 2, 1), ffn_hidden_size=args.hidden * 8 // 3 // 64 * 64,
                   max_seq_len=args.seq_len)


def _torch_plan(sp: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    out = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=out),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=out),
    }
    if sp:
        plan.update({
            "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return plan


class _CountCollectives(TorchDispatchMode):
    """Counts the collectives DTensor dispatches (functional collectives, not their waits/wrappers)."""

    KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "_c10d_functional" and any(k in func.__name__ for k in self.KINDS):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _run(impl: str, rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from pentatron.distributed.context import ParallelContext
    from pentatron.layout import ParallelLayout
    from pentatron.models.llama import build_model
    from pentatron.parallel.tensor import apply_tensor_parallel, sum_partial_param_grads

    torch.set_num_threads(args.threads)
    cfg = _model_cfg(args)
    sp = impl.endswith("-sp")
    ctx = ParallelContext.from_layout(ParallelLayout(tp=world), "cpu")
    s, b, h = args.seq_len, args.micro_batch, cfg.hidden_size
    local = slice(rank * s // world, (rank + 1) * s // world) if sp else slice(None)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(b, s, h, generator=g) for _ in range(args.steps + args.warmup)]

    reference = build_model(cfg, seed=0)
    model = build_model(cfg, seed=0)
    if impl.startswith("ours"):
        apply_tensor_parallel(model, ctx, sp=sp)
    else:
        from torch.distributed.tensor.parallel import parallelize_module

        for block in model.layers:
            parallelize_module(block, ctx.mesh["tp"], _torch_plan(sp))
    cos, sin = model.rotary(torch.arange(s))

    def run(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        for block in m.layers:
            x = block(x, cos, sin)
        return x

    # Same computation check: output and input gradient against the unsharded stack.
    x_ref = inputs[0].clone().requires_grad_()
    y_ref = run(reference, x_ref)
    y_ref.pow(2).sum().backward()
    x = inputs[0][:, local].clone().requires_grad_()
    y = run(model, x)
    y.pow(2).sum().backward()
    err = max(float((y.detach() - y_ref.detach()[:, local]).abs().max() / y_ref.abs().max()),
              float((x.grad - x_ref.grad[:, local]).abs().max() / x_ref.grad.abs().max()))
    if err > 1e-4:
        raise AssertionError(f"{impl}: output/grad differ from the unsharded stack by {err:.2e}")

    def step(x: torch.Tensor) -> None:
        model.zero_grad(set_to_none=True)
        run(model, x[:, local].requires_grad_()).pow(2).mean().backward()
        if impl.startswith("ours"):  # the norm weights' partial gradients (SP): one all-reduce per step
            sum_partial_param_grads(model)

    for x in inputs[: args.warmup]:
        step(x)
    if impl.startswith("ours"):
        ctx.comm.ledger.begin_step()
        step(inputs[0])
        calls = ctx.comm.ledger.summary().calls("tp")
    else:
        with _CountCollectives() as counter:  # DTensor's functional collectives bypass our ledger
            step(inputs[0])
        calls = counter.calls
    dist.barrier()
    start = time.perf_counter()
    for x in inputs[args.warmup:]:
        step(x)
    dist.barrier()
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": args.steps * b * s / elapsed, "step_ms": 1000 * elapsed / args.steps,
            "calls": calls, "check_err": err}


def _rank_main(rank: int, world: int, impl: str, args: argparse.Namespace) -> dict[str, Any]:
    return _run(impl, rank, world, args)


def run_impl(impl: str, args: argparse.Namespace) -> dict[str, Any]:
    results = run_on_ranks(_rank_main, args.tp, (impl, args), impl)
    return {"tokens_per_s": min(r["tokens_per_s"] for r in results),
            "step_ms": max(r["step_ms"] for r in results),
            "calls": results[0]["calls"], "check_err": max(r["check_err"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    add_timing_args(ap)
    args = ap.parse_args()
    best = best_of(IMPLS, args.repeats, lambda impl: run_impl(impl, args))
    cfg = _model_cfg(args)
    print(f"tp={args.tp} gloo ranks on CPU ({os.cpu_count()} cores, {args.threads} thread/rank), {cfg.n_layers} "
          f"decoder blocks (h={cfg.hidden_size}, {cfg.n_heads} heads, {cfg.n_kv_heads} kv heads, "
          f"ffn={cfg.ffn_hidden_size}, SwiGLU), seq_len {args.seq_len}, micro-batch {args.micro_batch}, "
          f"fwd+bwd, {args.steps} timed steps, best of {args.repeats}\n")
    print("| implementation | tokens/s | step (ms) | collectives/step | max rel. err vs unsharded | "
          "tokens/s vs torch |")
    print("|---|---:|---:|---:|---:|---:|")
    pairs = {"ours-tp": "torch-tp", "ours-tp-sp": "torch-tp-sp"}
    for impl in IMPLS:
        r = best[impl]
        ref = pairs.get(impl)
        ratio = f"{r['tokens_per_s'] / best[ref]['tokens_per_s']:.2f}×" if ref else "(reference)"
        print(f"| {impl} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {r['calls']} | {r['check_err']:.1e} | "
              f"{ratio} |")


if __name__ == "__main__":
    main()
