"""Pipeline parallelism on CPU gloo: our engine's 1F1B and interleaved 1F1B (and AFAB, ZB-H1) against
`torch.distributed.pipelining`'s schedules on the very same stage modules; tokens/s, and our measured
bubble next to the predicted one.

    python benchmarks/pipeline.py --pp 4 --microbatches 8 --steps 6 --warmup 2

Every rank runs each implementation in turn in one set of processes (same stages, same random tokens);
a step is forward + backward of all micro-batches (no optimizer: identical in both). Step time is the
slowest rank's, median over the timed steps. The bubble is measured from our engine's per-action
timestamps as the ranks' idle share of the step, (p · makespan − Σ busy) / (p · makespan), the planner's
definition; "predicted" is the closed form for uniform stages ((p−1)/(m+p−1) for AFAB and 1F1B) and
"simulated" is `schedules.simulate` fed with the measured mean duration of each kind of action on each
stage (so it accounts for unequal stages, but not for communication).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from pentatron.distributed.context import ParallelContext
from pentatron.layout import ParallelLayout
from pentatron.models.llama import build_model
from pentatron.models.registry import get_model_config
from pentatron.parallel.pipeline.engine import PipelineEngine
from pentatron.parallel.pipeline.stages import PipelineStage, build_stages, stage_layers
from pentatron.parallel.pipeline.trace import recorded_timeline
from pentatron.schedules import Kind, Slot, make_schedule, simulate


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _variants(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(implementation, schedule, v)."""
    out = [("ours", "1f1b", 1), ("torch", "1f1b", 1), ("ours", "interleaved", args.virtual),
           ("torch", "interleaved", args.virtual)]
    if args.all_schedules:
        out += [("ours", "afab", 1), ("ours", "zb", 1)]
    return out


def _rank_main(rank: int, args: argparse.Namespace, store: str, queue: Any) -> None:
    torch.set_num_threads(args.threads)
    p = args.pp
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=p)
    try:
        ctx = ParallelContext.from_layout(ParallelLayout(pp=p), "cpu")
        cfg = dataclasses.replace(get_model_config("debug-untied"), n_layers=args.layers, hidden_size=args.hidden,
                                  n_heads=args.hidden // 64, n_kv_heads=max(1, args.hidden // 128),
                                  ffn_hidden_size=4 * args.hidden)
        g = torch.Generator().manual_seed(0)
        n_steps = args.warmup + args.steps
        batches = [torch.randint(0, cfg.vocab_size, (args.microbatches * args.micro_batch, args.seq + 1), generator=g)
                   for _ in range(n_steps)]
        # Repeats interleave the implementations (a noisy neighbour hurts all of them alike); each keeps
        # its best repeat.
        for impl, name, v in [x for _ in range(args.repeats) for x in _variants(args)]:
            stages = build_stages(build_model(cfg, seed=0), p, rank, stage_layers(cfg, p, v, args.seq))
            times, slots = [], []
            run = _ours(stages, ctx, name, v, args) if impl == "ours" else _torch(stages, name, args)
            for step in range(n_steps):
                tokens = batches[step]
                for st in stages:
                    st.zero_grad(set_to_none=True)
                ctx.comm.barrier()
                t0 = time.perf_counter()
                out = run(tokens[:, :-1], tokens[:, 1:])
                elapsed = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # benchmark bookkeeping, not model traffic
                if step >= args.warmup:
                    times.append(float(elapsed))
                    if out is not None:
                        slots.append(out)
            queue.put((rank, impl, name, v, times, slots))
    finally:
        dist.destroy_process_group()


Runner = Callable[[torch.Tensor, torch.Tensor], Any]


def _ours(stages: list[PipelineStage], ctx: ParallelContext, name: str, v: int, args: argparse.Namespace) -> Runner:
    schedule = make_schedule(name, args.pp, args.microbatches, v)
    engine = PipelineEngine(stages, schedule, ctx.comm, ctx.coords["pp"], loss_fn)
    mb = args.micro_batch

    def run(x: torch.Tensor, y: torch.Tensor):
        mbs = [(x[i:i + mb], y[i:i + mb]) for i in range(0, x.shape[0], mb)]
        return engine.step(mbs).slots

    return run


def _torch(stages: list[PipelineStage], name: str, args: argparse.Namespace) -> Runner:
    from torch.distributed import pipelining

    pstages = [pipelining.PipelineStage(st, st.index, st.n_stages, torch.device("cpu")) for st in stages]
    if name == "1f1b":
        sched = pipelining.Schedule1F1B(pstages[0], args.microbatches, loss_fn=loss_fn)
    else:
        sched = pipelining.ScheduleInterleaved1F1B(pstages, args.microbatches, loss_fn=loss_fn)
    first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)

    def run(x: torch.Tensor, y: torch.Tensor):
        kwargs: dict[str, Any] = {}
        if last:
            kwargs.update(target=y, losses=[])
        if first:
            sched.step(x, **kwargs)
        else:
            sched.step(**kwargs)
        return None

    return run


def _measured(args: argparse.Namespace, name: str, v: int, per_rank_slots: list[list[list[Slot]]]) -> dict[str, float]:
    """Median measured bubble over the timed steps, the closed form, and the simulation with measured costs."""
    schedule = make_schedule(name, args.pp, args.microbatches, v)
    bubbles, dur = [], {}
    for step in range(len(per_rank_slots[0])):
        tl = recorded_timeline([per_rank_slots[r][step] for r in range(args.pp)], name)
        bubbles.append(tl.bubble_fraction)
        for r, slots in enumerate(tl.slots):
            for s in slots:
                dur.setdefault((s.action.kind, schedule.stage(r, s.action.chunk)), []).append(s.end - s.start)
    n = schedule.n_stages

    def cost(kind: Kind) -> list[float]:
        return [statistics.mean(dur[(kind, st)]) if (kind, st) in dur else 0.0 for st in range(n)]

    if schedule.split_backward:
        cf, cb, cw = cost(Kind.F), cost(Kind.B), cost(Kind.W)
    else:
        cf, cb, cw = cost(Kind.F), cost(Kind.BW), [0.0] * n
    p, m = args.pp, args.microbatches  # the idle share: (p-1) units idle per rank of m (v·m chunks) busy
    closed = {"afab": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1),
              "interleaved": (p - 1) / (v * m + p - 1)}.get(name, float("nan"))
    return {"measured": statistics.median(bubbles), "closed": closed,
            "uniform": simulate(schedule).bubble_fraction, "simulated": simulate(schedule, cf, cb, cw).bubble_fraction}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--virtual", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="run the whole comparison this many times, keep the best")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--all-schedules", action="store_true", help="also time our AFAB and ZB-H1")
    args = ap.parse_args()

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, args, store, queue)) for r in range(args.pp)]
        for pr in procs:
            pr.start()
        n_results = args.pp * len(_variants(args)) * args.repeats
        results = [queue.get(timeout=1800) for _ in range(n_results)]
        for pr in procs:
            pr.join()
        if any(pr.exitcode for pr in procs):
            print("a rank failed", file=sys.stderr)
            return 1

    tokens = args.microbatches * args.micro_batch * args.seq
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}
    best: dict[tuple[str, str, int], int] = {}  # which repeat was fastest (by rank 0's slowest-rank times)
    by_repeat: dict[tuple[str, str, int, int, int], tuple[list[float], list]] = {}
    seen: dict[tuple[int, str, str, int], int] = {}
    for rank, impl, name, v, times, slots in results:
        k = (rank, impl, name, v)
        rep = seen[k] = seen.get(k, -1) + 1
        by_repeat[(impl, name, v, rep, rank)] = (times, slots)
    for impl, name, v in _variants(args):
        best[(impl, name, v)] = min(range(args.repeats),
                                    key=lambda r: statistics.median(by_repeat[(impl, name, v, r, 0)][0]))
        r = best[(impl, name, v)]
        rows[(impl, name, v)] = {"times": by_repeat[(impl, name, v, r, 0)][0],
                                 "slots": [by_repeat[(impl, name, v, r, k)][1] for k in range(args.pp)]}
    print(f"p={args.pp} m={args.microbatches} micro-batch {args.micro_batch} seq {args.seq} hidden {args.hidden} "
          f"layers {args.layers}, {tokens} tokens/step, {args.threads} thread(s)/rank\n")
    print("| implementation | schedule | step (ms) | tokens/s | vs torch | bubble measured | simulated (measured "
          "costs) | closed form |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (impl, name, v), row in rows.items():
        step = statistics.median(row["times"])
        ref = rows.get(("torch", name, v))
        ratio = f"{statistics.median(ref['times']) / step:.2f}×" if ref and impl == "ours" else "(reference)" \
            if impl == "torch" else "—"
        label = f"{name} v={v}" if v > 1 else name
        if impl == "ours":
            b = _measured(args, name, v, row["slots"])
            bub = f"{b['measured']:.1%} | {b['simulated']:.1%} | {b['closed']:.1%}" if b["closed"] == b["closed"] \
                else f"{b['measured']:.1%} | {b['simulated']:.1%} | {b['uniform']:.1%} (sim., t_F=t_B=t_W)"
        else:
            bub = "— | — | —"
        print(f"| {impl} | {label} | {step * 1e3:.0f} | {tokens / step:,.0f} | {ratio} | {bub} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
