"""Cost of the flight recorder (check mode off): paired A/B on the same processes, plus its cost per op.

    python benchmarks/flight_recorder.py --pairs 10 --block 4

1. Per op, in isolation: `FlightRecorder.enter` + the wait hooks, on a 1-process context (µs/op).
2. In training: 2 gloo ranks, debug model with tp=2 (the layout with the most collectives per step:
   two all-reduces per block forward and backward), one Trainer per rank. Blocks of `--block` steps
   alternate recorder on / off (ABBA order, so drift hits both alike); the step time is rank 0's:
   median per mode, and the median over adjacent (on, off) block pairs of their ratio. The hang
   watchdog thread is not started here (the Trainer starts it in fit()).
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranks import run_on_ranks  # noqa: E402

from pentatron.config import load_config  # noqa: E402
from pentatron.data.tokenize import ensure_default_dataset  # noqa: E402
from pentatron.distributed.context import ParallelContext  # noqa: E402
from pentatron.observe.flight_recorder import FlightRecorder  # noqa: E402


def per_op_cost(n: int = 20000) -> float:
    """Seconds per recorded op (enter + issued + after_wait) with a 1-process context."""
    ctx = ParallelContext.single()
    rec = FlightRecorder(0)
    t = torch.zeros(1024)
    for _ in range(1000):  # warm-up
        rec.issued([rec.enter(ctx.comm, "all_reduce", "world", t)], False).after_wait()
    start = time.perf_counter()
    for _ in range(n):
        rec.issued([rec.enter(ctx.comm, "all_reduce", "world", t)], False).after_wait()
    return (time.perf_counter() - start) / n


def _rank(rank: int, world: int, args: argparse.Namespace, data: str, log_dir: str) -> dict:
    from pentatron.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    steps = args.warmup + 2 * args.pairs * args.block
    cfg = load_config(None, [f"train.steps={steps}", "train.warmup=1", f"train.seq_len={args.seq_len}",
                             f"train.micro_batch={args.micro_batch}", f"train.global_batch={args.micro_batch}",
                             "train.device='cpu'", "parallel.tp=2", f"log.dir='{log_dir}'",
                             "log.tensorboard=false", "log.progress=false"], world_size=world)
    trainer = Trainer(cfg, dataset_dir=Path(data))
    recorder = trainer.comm.recorder
    times: dict[str, list[float]] = {"on": [], "off": []}
    blocks: list[tuple[str, float]] = []  # (mode, median step time of the block), in run order
    ops_per_step = []
    for _ in range(args.warmup):
        trainer.train_step()
    order = ["on", "off", "off", "on"] * ((args.pairs + 1) // 2)
    for mode in order[:2 * args.pairs]:
        trainer.comm.recorder = recorder if mode == "on" else None
        block = []
        for _ in range(args.block):
            n0 = sum(recorder.entered.values())
            start = time.perf_counter()
            trainer.train_step()
            block.append(time.perf_counter() - start)
            if mode == "on":
                ops_per_step.append(sum(recorder.entered.values()) - n0)
        times[mode] += block
        blocks.append((mode, statistics.median(block)))
    trainer.comm.recorder = recorder
    trainer.observer.close([])
    # adjacent blocks form a pair (ABBA: on/off, off/on, …): the ratio within a pair cancels slow drift
    pair_ratios = []
    for (m1, t1), (_, t2) in zip(blocks[0::2], blocks[1::2]):
        on, off = (t1, t2) if m1 == "on" else (t2, t1)
        pair_ratios.append(on / off)
    return {"on": times["on"], "off": times["off"], "ops_per_step": statistics.median(ops_per_step),
            "pair_ratios": pair_ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=10, help="on/off block pairs")
    ap.add_argument("--block", type=int, default=4, help="steps per block")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    print(f"uptime: {os.popen('uptime').read().strip()}")
    op = per_op_cost()
    print(f"recorder cost per op (enter + wait hooks, 1 process): {op * 1e6:.2f} µs")
    with tempfile.TemporaryDirectory() as tmp:
        data = ensure_default_dataset(Path(tmp) / "data", vocab_size=4096, max_bytes=400_000, progress=False)
        results = run_on_ranks(_rank, 2, (args, str(data), str(Path(tmp) / "run")), "flight recorder")
    r = results[0]
    on, off = statistics.median(r["on"]), statistics.median(r["off"])
    print(f"uptime: {os.popen('uptime').read().strip()}")
    out = {"per_op_us": op * 1e6, "ops_per_step": r["ops_per_step"], "step_on_s": on, "step_off_s": off,
           "ratio": on / off, "estimated_overhead": r["ops_per_step"] * op / off,
           "steps_per_mode": len(r["on"]), "pair_ratio_median": statistics.median(r["pair_ratios"]),
           "pair_ratio_quartiles": statistics.quantiles(r["pair_ratios"], n=4) if len(r["pair_ratios"]) > 1 else []}
    print(json.dumps(out, indent=1))
    print(f"step time, recorder on / off (median of {len(r['on'])} steps each, rank 0): {on * 1e3:.1f} ms / "
          f"{off * 1e3:.1f} ms = {on / off:.4f}; {r['ops_per_step']:.0f} recorded ops per step × "
          f"{op * 1e6:.2f} µs = {100 * r['ops_per_step'] * op / off:.3f}% of the step; median of the "
          f"{len(r['pair_ratios'])} paired block ratios on/off: {statistics.median(r['pair_ratios']):.4f}")


if __name__ == "__main__":
    main()
