"""Mixture-of-Experts measurements on CPU: load balancing over a real training run, an MoE layer against a
dense MLP of the same active FLOPs, and expert-parallel scaling on gloo ranks.

    python benchmarks/moe.py balance --steps 200     # debug-moe without balancing / aux loss / aux-free bias
    (or one variant per process: balance --model debug-moe --out a.json ...; then balance-report *.json)
    python benchmarks/moe.py layer                   # MoE layer fwd+bwd vs a dense SwiGLU of equal active FLOPs
    python benchmarks/moe.py ep --ranks 1 2 4        # MoE layer fwd+bwd per rank, ep = ranks, fixed tokens per rank
    python benchmarks/moe.py grouped                 # 64-expert top-8 layer fwd+bwd: grouped GEMM vs per-expert loop

Prints markdown tables (for BENCHMARKS.md). Timings are medians of repeated runs on whatever the machine
is doing: say the load (`uptime`) beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranks import run_on_ranks  # noqa: E402

from pentatron.models.config import ModelConfig, MoEConfig  # noqa: E402
from pentatron.models.llama import MLP  # noqa: E402
from pentatron.models.moe import Experts, MoE, grouped_mm_supported  # noqa: E402

VARIANTS = {"no balancing": "debug-moe-nobalance", "aux loss 0.01 (+ z 0.001)": "debug-moe",
            "aux-free bias γ=1e-3": "debug-moe-auxfree"}


# ---------------------------------------------------------------------------------------------- balance
def balance(args: argparse.Namespace) -> None:
    """Train each variant (or only `--model`), write its per-step records to `--out`, print the table."""
    from pentatron.config import load_config
    from pentatron.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    runs = {}
    for label, model in VARIANTS.items():
        if args.model and model != args.model:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(None, [f"model.name='{model}'", f"train.steps={args.steps}", f"train.seq_len={args.seq}",
                                     f"train.micro_batch={args.batch}", f"train.global_batch={args.batch}",
                                     "train.warmup=10", "log.progress=false", "log.tensorboard=false",
                                     f"log.dir='{tmp}'", "log.every=50"])
            start = time.perf_counter()
            records = Trainer(cfg).fit()
            runs[label] = {"records": [{k: r[k] for k in ("step", "loss", "moe")} for r in records],
                           "wall_s": time.perf_counter() - start, "seq": args.seq, "batch": args.batch}
    if args.out:
        Path(args.out).write_text(json.dumps(runs))
    balance_table(runs, args.tail)


def balance_table(runs: dict[str, Any], tail_n: int) -> None:
    any_run = next(iter(runs.values()))
    print(f"\n{len(any_run['records'])} steps, debug-moe (8 experts, top-2, 1 shared, layer 0 dense), seq "
          f"{any_run['seq']} × {any_run['batch']} sequences per step, 1 process; figures averaged over the last "
          f"{tail_n} steps\n")
    print("| balancing | loss | worst layer's max/mean load | max/mean per MoE layer | wall (s) |")
    print("|---|---:|---:|---|---:|")
    for label, run in runs.items():
        tail = run["records"][-tail_n:]
        worst = statistics.mean(max(m["imbalance"] for m in r["moe"].values()) for r in tail)
        per_layer = ", ".join(f"{statistics.mean(r['moe'][n]['imbalance'] for r in tail):.2f}" for n in tail[0]["moe"])
        loss = statistics.mean(r["loss"] for r in tail)
        print(f"| {label} | {loss:.4f} | {worst:.2f} | {per_layer} | {run['wall_s']:.0f} |")


def balance_report(args: argparse.Namespace) -> None:
    runs: dict[str, Any] = {}
    for f in args.files:
        runs.update(json.loads(Path(f).read_text()))
    balance_table({label: runs[label] for label in VARIANTS if label in runs}, args.tail)


# ---------------------------------------------------------------------------------------------- layer
def _time(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def layer(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    h, e, k, f = args.hidden, args.experts, args.top_k, args.expert_ffn
    base = ModelConfig(vocab_size=64, hidden_size=h, n_layers=1, n_heads=8, n_kv_heads=8, ffn_hidden_size=k * f)
    moe = MoE(ModelConfig(**{**base.__dict__, "moe": MoEConfig(n_experts=e, top_k=k, expert_ffn_size=f)}))
    dense = MLP(base)  # a SwiGLU of width k·f: the FLOPs of the k experts a token visits
    for p in [*moe.parameters(), *dense.parameters()]:
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(args.tokens, h)

    def step(m: torch.nn.Module) -> Any:
        return lambda: m(x).square().mean().backward()

    t_moe, t_dense = _time(step(moe), args.repeats), _time(step(dense), args.repeats)
    flops = 6 * args.tokens * 3 * h * k * f  # fwd + bwd of the active expert matmuls (router excluded)
    print(f"\nMoE layer vs dense SwiGLU of the same active FLOPs: {args.tokens} tokens, h={h}, {e} experts of "
          f"width {f}, top-{k} (dense width {k * f}); fp32, {torch.get_num_threads()} threads, median of "
          f"{args.repeats}\n")
    print("| layer | params | fwd+bwd (ms) | GFLOP/s (active matmuls) |")
    print("|---|---:|---:|---:|")
    for name, m, t in (("dense SwiGLU", dense, t_dense), ("MoE (router + experts)", moe, t_moe)):
        n = sum(p.numel() for p in m.parameters())
        print(f"| {name} | {n:,} | {1e3 * t:.1f} | {flops / t / 1e9:.1f} |")
    print(f"\nMoE / dense time: {t_moe / t_dense:.2f}×")


# ---------------------------------------------------------------------------------------------- grouped
def _loop_experts(ex: Experts, x: torch.Tensor, counts: list[int], offsets: Any = None) -> torch.Tensor:
    """The experts as they ran before: one SwiGLU matmul chain per expert (a Python loop)."""
    outs = []
    for j, xj in enumerate(x.split(counts)):
        h = torch.nn.functional.silu(torch.nn.functional.linear(xj, ex.gate_proj[j]))
        outs.append(torch.nn.functional.linear(h * torch.nn.functional.linear(xj, ex.up_proj[j]), ex.down_proj[j]))
    return torch.cat(outs)


def grouped(args: argparse.Namespace) -> None:
    """One MoE layer fwd+bwd with the grouped experts (now) and with the per-expert loop (before),
    interleaved, best of `repeats`; the same router decisions, so the same work."""
    torch.manual_seed(0)
    h, e, k, f = args.hidden, args.experts, args.top_k, args.expert_ffn
    cfg = ModelConfig(vocab_size=64, hidden_size=h, n_layers=1, n_heads=8, n_kv_heads=8, ffn_hidden_size=k * f,
                      moe=MoEConfig(n_experts=e, top_k=k, expert_ffn_size=f))
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(args.tokens, h)
    grouped_forward = Experts.forward

    def step(forward: Any) -> float:
        Experts.forward = forward
        try:
            layer.zero_grad(set_to_none=True)
            t = time.perf_counter()
            layer(x).square().mean().backward()
            return time.perf_counter() - t
        finally:
            Experts.forward = grouped_forward

    kinds = {"per-expert loop (before)": _loop_experts, "grouped GEMM (now)": grouped_forward}
    for fn in kinds.values():
        step(fn)  # warm-up
    best = {name: float("inf") for name in kinds}
    for _ in range(args.repeats):
        for name, fn in kinds.items():
            best[name] = min(best[name], step(fn))
    path = "torch._grouped_mm" if grouped_mm_supported(x, layer.experts.gate_proj) else "padded bmm"
    print(f"\nMoE layer fwd+bwd, {args.tokens} tokens, h={h}, {e} experts of width {f}, top-{k} (no shared "
          f"expert, dropless); fp32, {torch.get_num_threads()} threads, best of {args.repeats} interleaved; "
          f"grouped path: {path}; load {os.getloadavg()[0]:.2f}\n")
    print("| experts | fwd+bwd (ms) | tokens/s |")
    print("|---|---:|---:|")
    for name, t in best.items():
        print(f"| {name} | {1e3 * t:.1f} | {args.tokens / t:,.0f} |")
    loop_t, grouped_t = best["per-expert loop (before)"], best["grouped GEMM (now)"]
    print(f"\ngrouped / loop tokens/s: {loop_t / grouped_t:.2f}×")


# ---------------------------------------------------------------------------------------------- ep
def _ep_rank(rank: int, world: int, tokens: int, hidden: int, experts: int, ffn: int, repeats: int) -> dict:
    from pentatron.distributed.context import ParallelContext
    from pentatron.layout import ParallelLayout
    from pentatron.parallel.expert import apply_expert_parallel

    torch.set_num_threads(1)
    ctx = ParallelContext.from_layout(ParallelLayout(dp=world, ep=world), "cpu")
    torch.manual_seed(0)
    base = ModelConfig(vocab_size=64, hidden_size=hidden, n_layers=1, n_heads=8, n_kv_heads=8, ffn_hidden_size=ffn,
                       moe=MoEConfig(n_experts=experts, top_k=2, expert_ffn_size=ffn))
    layer = MoE(base)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    holder = torch.nn.Module()
    holder.cfg = base
    holder.moe = layer
    apply_expert_parallel(holder, ctx)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        layer(x).square().mean().backward()

    times = []
    step()
    ctx.comm.ledger.begin_step()
    step()
    a2a = ctx.comm.ledger.end_step().bytes("ep", "all_to_all")
    for _ in range(repeats):
        ctx.comm.barrier()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return {"time": statistics.median(times), "a2a": a2a}


def ep(args: argparse.Namespace) -> None:
    rows = []
    for world in args.ranks:
        res = run_on_ranks(_ep_rank, world, (args.tokens, args.hidden, args.experts, args.expert_ffn, args.repeats),
                           f"ep{world}")
        rows.append((world, max(r["time"] for r in res), statistics.mean(r["a2a"] for r in res)))
    print(f"\nExpert parallelism, weak scaling: {args.tokens} tokens per rank, h={args.hidden}, {args.experts} experts "
          f"of width {args.expert_ffn}, top-2, ep = ranks, 1 thread per rank, gloo; median of {args.repeats}\n")
    print("| ep | experts per rank | fwd+bwd, slowest rank (ms) | tokens/s (all ranks) | all-to-all bytes per rank |")
    print("|---:|---:|---:|---:|---:|")
    for world, t, a2a in rows:
        print(f"| {world} | {args.experts // world} | {1e3 * t:.1f} | {world * args.tokens / t:,.0f} | {a2a:,.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    b = sub.add_parser("balance")
    b.add_argument("--steps", type=int, default=200)
    b.add_argument("--tail", type=int, default=20)
    b.add_argument("--seq", type=int, default=64)
    b.add_argument("--batch", type=int, default=8)
    b.add_argument("--model", default="", help="only this variant (registry name)")
    b.add_argument("--out", default="", help="write the runs' records here (JSON)")
    b.add_argument("--threads", type=int, default=torch.get_num_threads())
    r = sub.add_parser("balance-report", help="the table from several `balance --out` files")
    r.add_argument("files", nargs="+")
    r.add_argument("--tail", type=int, default=20)
    for name in ("layer", "ep", "grouped"):
        s = sub.add_parser(name)
        s.add_argument("--tokens", type=int, default=4096 if name == "layer" else 2048)
        s.add_argument("--hidden", type=int, default=256 if name == "grouped" else 512)
        s.add_argument("--experts", type=int, default=64 if name == "grouped" else 8)
        s.add_argument("--top-k", type=int, default=8 if name == "grouped" else 2)
        s.add_argument("--expert-ffn", type=int, default=128 if name == "grouped" else 512)
        s.add_argument("--repeats", type=int, default=5)
        if name == "ep":
            s.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = p.parse_args()
    run = {"balance": balance, "balance-report": balance_report, "layer": layer, "ep": ep, "grouped": grouped}
    run[args.what](args)
    print(json.dumps({"command": " ".join(sys.argv)}))


if __name__ == "__main__":
    main()
