"""Run one benchmark implementation on N fresh gloo processes and collect each rank's result dict.

Each call starts new processes, so per-process measurements (peak RSS) belong to that implementation
alone. A rank that raises reports `{"error": ...}` instead of leaving the parent waiting.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

RankFn = Callable[..., dict[str, Any]]


def _entry(fn: RankFn, rank: int, world: int, store: str, args: tuple, q: mp.Queue) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        q.put((rank, fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 - report, never hang the parent
        q.put((rank, {"error": f"{type(e).__name__}: {e}"}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn: RankFn, world: int, args: tuple, label: str, timeout: float = 1800) -> list[dict[str, Any]]:
    """fn(rank, world, *args) on `world` spawned processes; results by rank; the first error is raised."""
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, store, args, q)) for r in range(world)]
        for p in procs:
            p.start()
        results = dict(q.get(timeout=timeout) for _ in procs)
        for p in procs:
            p.join()
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        raise RuntimeError(f"{label}: {errors[0]}")
    return [results[r] for r in range(world)]


def best_of(impls: tuple[str, ...], repeats: int, run: Callable[[str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Run every implementation `repeats` times and keep each one's fastest run (by tokens/s). The
    implementations are interleaved, so machine-load drift hits every one of them alike."""
    best: dict[str, dict[str, Any]] = {}
    for _ in range(repeats):
        for impl in impls:
            r = run(impl)
            if impl not in best or r["tokens_per_s"] > best[impl]["tokens_per_s"]:
                best[impl] = r
    return best


def add_timing_args(ap: argparse.ArgumentParser) -> None:
    """The flags every side-by-side benchmark shares: timed steps, warm-up, batch shape, threads, repeats."""
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--repeats", type=int, default=1, help="run the whole comparison this many times; best kept")
