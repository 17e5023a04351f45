"""Our DDP vs torch DistributedDataParallel, and our ZeRO-3 vs torch `fully_shard` (FSDP2), side by side:
4 gloo ranks on CPU, the debug model, the same data, optimizer (torch AdamW) and global-norm clipping.

    python benchmarks/data_parallel.py [--ranks 4] [--steps 20] [--seq-len 256] [--micro-batch 4]

`--param-gather`: ZeRO-1's parameter all-gather waited right after the step (parallel.overlap_param_gather
off) vs overlapped with the next forward (on), in ONE set of processes: two copies of the model (same seed,
same batches), one runner each, their steps interleaved (off, on, off, ...) so machine-load drift hits
both alike. Reports each one's median step time, the time its ranks spent waiting for the gathers (off:
the whole `after_optimizer_step`; on: issuing it plus the waits in the forward pre-hooks) and the ledger's
all-gather bytes per step (the same by construction). `--model`/`--layers`/`--vocab` pick the shape.

Each implementation runs in its own fresh set of processes, so that the peak resident memory
(ru_maxrss, minus the same process's RSS just before the model is built) belongs to it alone.
tokens/s counts every rank's tokens; the first `--warmup` steps are not timed.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import add_timing_args, best_of, run_on_ranks

IMPLS = ("ours-ddp", "torch-ddp", "ours-zero3", "torch-fsdp2")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2 parameters and grads are DTensors
    return t.numel() * t.element_size()


def _batches(rank: int, args: argparse.Namespace, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=g)
            for _ in range(args.steps + args.warmup)]


def _run(impl: str, rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from pentatron.config import load_config
    from pentatron.distributed.context import ParallelContext
    from pentatron.layout import ParallelLayout
    from pentatron.models.llama import build_model
    from pentatron.parallel.parallelize import parallelize
    from pentatron.precision import resolve_precision

    torch.set_num_threads(args.threads)
    cfg = load_config(None, [f"parallel.zero={3 if impl == 'ours-zero3' else 0}", f"train.seq_len={args.seq_len}",
                             f"train.micro_batch={args.micro_batch}",
                             f"train.global_batch={args.micro_batch * world}"], world_size=world)
    model_cfg = cfg.model_config()
    batches = _batches(rank, args, model_cfg.vocab_size)
    base_rss = _rss_bytes()
    model = build_model(model_cfg, seed=0)
    clip, lr = cfg.train.clip, cfg.train.lr

    def loss_of(m: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())

    if impl.startswith("ours"):
        ctx = ParallelContext.from_layout(ParallelLayout(dp=world), "cpu")
        runner = parallelize(model, ctx, cfg, resolve_precision("fp32", torch.device("cpu")))

        def step(tokens: torch.Tensor) -> None:
            runner.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
            runner.clip_grads(clip)
            runner.step(lr)

        def state_bytes() -> int:
            return runner.memory().total
    else:
        if impl == "torch-ddp":
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_mb)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.train.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=lr,
                                betas=(cfg.train.beta1, cfg.train.beta2), eps=cfg.train.eps)

        def step(tokens: torch.Tensor) -> None:
            opt.zero_grad(set_to_none=True)
            loss_of(wrapped, tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()

        def state_bytes() -> int:
            # Parameters, gradients and Adam moments held on this rank (torch DDP's internal bucket
            # buffers, another 4Ψ unless gradient_as_bucket_view, are not visible here).
            moments = sum(_local_bytes(v) for st in opt.state.values() for k, v in st.items() if k != "step")
            return sum(_local_bytes(p) + _local_bytes(p.grad) for p in model.parameters()) + moments

    for tokens in batches[: args.warmup]:
        step(tokens)
    dist.barrier()
    start = time.perf_counter()
    for tokens in batches[args.warmup:]:
        step(tokens)
    dist.barrier()
    elapsed = time.perf_counter() - start
    tokens = args.steps * world * args.micro_batch * args.seq_len
    return {"tokens_per_s": tokens / elapsed, "peak_rss_delta": _peak_rss_bytes() - base_rss,
            "step_ms": 1000 * elapsed / args.steps, "state_bytes": state_bytes()}


def _rank_main(rank: int, world: int, impl: str, args: argparse.Namespace) -> dict[str, Any]:
    return _run(impl, rank, world, args)


def _timed_waits(issue: Any, acc: dict[str, Any]) -> Any:
    """Wrap an engine's `_issue` so that the works it returns add the seconds their `wait()` blocks (gloo:
    until the gather is done) to acc["wait"] while acc["timing"]: the gather time left exposed."""
    class Timed:
        def __init__(self, work: Any) -> None:
            self.work = work

        def wait(self) -> None:
            t = time.perf_counter()
            self.work.wait()
            if acc["timing"]:
                acc["wait"] += time.perf_counter() - t

    return lambda b: Timed(issue(b))


def _gather_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Off and on runners side by side on this rank, steps interleaved; each one's step times."""
    from pentatron.config import load_config
    from pentatron.distributed.context import ParallelContext
    from pentatron.layout import ParallelLayout
    from pentatron.models.llama import build_model
    from pentatron.parallel.parallelize import parallelize
    from pentatron.precision import resolve_precision

    torch.set_num_threads(args.threads)
    ctx = ParallelContext.from_layout(ParallelLayout(dp=world), "cpu")
    runs: dict[str, dict[str, Any]] = {}
    for mode in ("off", "on"):
        cfg = load_config(None, [f"model.name={args.model}", f"model.n_layers={args.layers}",
                                 f"model.vocab_size={args.vocab}", "parallel.zero=1",
                                 f"parallel.bucket_mb={args.bucket_mb}",
                                 f"parallel.overlap_param_gather={'true' if mode == 'on' else 'false'}",
                                 f"train.seq_len={args.seq_len}", f"train.micro_batch={args.micro_batch}",
                                 f"train.global_batch={args.micro_batch * world}"], world_size=world)
        model = build_model(cfg.model_config(), seed=0)
        runner = parallelize(model, ctx, cfg, resolve_precision(args.precision, torch.device("cpu")))
        r = runs[mode] = {"runner": runner, "cfg": cfg, "times": [], "blocks": [], "opt": [], "wait": 0.0,
                          "timing": False}
        runner.engine._issue = _timed_waits(runner.engine._issue, r)
    batches = _batches(rank, args, runs["off"]["cfg"].model_config().vocab_size)
    # Blocks of `block` steps, off then on, alternating. Within a block "on" overlaps each step's gathers with
    # its next step's forward (where a step's time includes waiting the previous step's gathers); the
    # block's first step (nothing in flight before it) is not timed, and its last step's gathers are waited
    # after it (untimed, so that they never run behind the other runner's steps).
    block, timed = args.block, 0
    while timed < args.steps:
        for r in runs.values():  # off, on, off, on, ...: load drift hits both alike
            runner, cfg = r["runner"], r["cfg"]
            dist.barrier()  # not inside the block: a barrier between steps would hide the gathers for free
            times = []
            for k in range(block):
                tokens = batches[(timed + k) % len(batches)]
                runner.comm.ledger.begin_step()
                r["timing"] = k > 0
                start = time.perf_counter()
                runner.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
                runner.clip_grads(cfg.train.clip)
                opt = time.perf_counter()
                runner.step(cfg.train.lr)  # off: the optimizer + waiting every gather; on: + issuing them
                if k > 0:
                    times.append(time.perf_counter() - start)
                    r["opt"].append(time.perf_counter() - opt)
                r["gather_bytes"] = runner.comm.ledger.summary().bytes("dp", "all_gather")
            r["timing"] = False
            runner.wait_param_gather()
            r["times"] += times
            r["blocks"].append(sorted(times)[len(times) // 2])
        timed += block - 1
    out = {}
    for mode, r in runs.items():
        times, engine = sorted(r["times"]), r["runner"].engine
        out[mode] = {"step_s": times[len(times) // 2], "gather_bytes": r["gather_bytes"], "blocks": r["blocks"],
                     "opt_s": sorted(r["opt"])[len(r["opt"]) // 2],
                     "wait_s": r["wait"] / len(times),
                     "gather_buckets": len(engine.gather_buckets), "grad_buckets": len(engine.layout.buckets),
                     "params": sum(p.numel() for p in engine.params), "timed": len(times)}
        engine.close()
    return out


def run_impl(impl: str, args: argparse.Namespace) -> dict[str, Any]:
    results = run_on_ranks(_rank_main, args.ranks, (impl, args), impl)
    return {"tokens_per_s": min(r["tokens_per_s"] for r in results),
            "step_ms": max(r["step_ms"] for r in results),
            "peak_rss_delta": max(r["peak_rss_delta"] for r in results),
            "state_bytes": max(r["state_bytes"] for r in results)}


def param_gather(args: argparse.Namespace) -> None:
    results = run_on_ranks(_gather_rank, args.ranks, (args,), "param-gather")
    off, on = ({k: max(r[mode][k] for r in results) for k in results[0][mode] if k != "blocks"}
               for mode in ("off", "on"))
    # each block pair (off then on, adjacent in time) as one ratio, per rank; the slowest rank's
    paired = sorted(max(r["on"]["blocks"][i] / r["off"]["blocks"][i] for r in results)
                    for i in range(len(results[0]["on"]["blocks"])))
    print(f"{args.ranks} gloo ranks on CPU ({os.cpu_count()} cores), ZeRO-1, {args.model} cut to {args.layers} layers, "
          f"vocab {args.vocab} ({off['params'] / 1e6:.1f}M parameters, {args.precision}), seq_len {args.seq_len}, "
          f"micro-batch {args.micro_batch} per rank, {off['timed']} timed steps each, "
          f"bucket_mb {args.bucket_mb}, blocks of {args.block} interleaved off/on; median step, slowest rank\n")
    print("| parallel.overlap_param_gather | step (ms) | runner.step (ms) | waiting for gathers (ms/step) | "
          "all-gather bytes/step (ledger) | gather buckets (gradient buckets) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in (("false (waited after the step)", off), ("true (overlapped)", on)):
        print(f"| {name} | {1000 * r['step_s']:.0f} | {1000 * r['opt_s']:.0f} | {1000 * r['wait_s']:.0f} | "
              f"{r['gather_bytes']:,} | "
              f"{r['gather_buckets']} ({r['grad_buckets']}) |")
    q = len(paired) // 4
    print(f"\nstep time on / off: medians {on['step_s'] / off['step_s']:.3f}; median paired block ratio "
          f"{paired[len(paired) // 2]:.3f} (quartiles {paired[q]:.3f} / {paired[-1 - q]:.3f}, {len(paired)} blocks)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--param-gather", action="store_true", help="ZeRO-1 parameter gather: overlapped vs not")
    ap.add_argument("--model", default="smollm-135m")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--bucket-mb", type=float, default=8.0, help="--param-gather: parallel.bucket_mb")
    ap.add_argument("--block", type=int, default=4, help="--param-gather: steps per off/on block")
    add_timing_args(ap)
    args = ap.parse_args()
    if args.param_gather:
        param_gather(args)
        return
    best = best_of(IMPLS, args.repeats, lambda impl: run_impl(impl, args))
    print(f"{args.ranks} gloo ranks on CPU ({os.cpu_count()} cores), debug model, seq_len {args.seq_len}, "
          f"micro-batch {args.micro_batch} per rank, {args.steps} timed steps, best of {args.repeats}\n")
    print("| implementation | tokens/s | step (ms) | model state per rank (MiB) | peak RSS over baseline, "
          "per rank (MiB) | tokens/s vs torch |")
    print("|---|---:|---:|---:|---:|---:|")
    pairs = {"ours-ddp": "torch-ddp", "ours-zero3": "torch-fsdp2"}
    for impl in IMPLS:
        r = best[impl]
        ref = pairs.get(impl)
        ratio = f"{r['tokens_per_s'] / best[ref]['tokens_per_s']:.2f}×" if ref else "(reference)"
        print(f"| {impl} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.0f} | {r['state_bytes'] / 2**20:.2f} | "
              f"{r['peak_rss_delta'] / 2**20:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
