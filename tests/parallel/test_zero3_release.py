"""ZeRO-3 frees what it releases: once a unit is released after its forward, its gathered parameters take
no memory until its backward gathers them again, also where autograd saved views of the weights
(`F.linear` saves `weight.t()`, `_grouped_mm` `weight.transpose(-2, -1)`: eager linears).

Every buffer an all-gather fills is tracked by a weak reference to its storage; whenever backward asks for a
unit (before its gather is waited on), the bytes of those storages still alive are summed. They must equal
what the engine itself holds gathered (nothing orphaned, kept alive only by autograd), and at the first
backward, right after the forward, stay within the prefetch window: nothing is held then but the unit
backward needs first, possibly prefetched (at most the largest unit).
One small 2-rank launch, one step per case: dp2 uncompiled and compiled, pp2 and tp2 (sp) with ZeRO-3 over
one dp rank (the same gather and free per unit; pp interleaves forwards and backwards), and dp2 MoE."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from pentatron.config import load_config
from tests.multiprocess import run_ranks
from tests.reference_loop import FP64

CASES: dict[str, list[str]] = {
    "dp2 eager": ["parallel.dp=2", "train.compile=false"],
    # aot_eager: AOTAutograd decides what the compiled blocks save, as with inductor, without codegen's cost
    "dp2 compiled": ["parallel.dp=2", "train.compile=true", "train.compile_backend='aot_eager'"],
    "pp2 eager": ["parallel.dp=1", "parallel.pp=2", "train.compile=false", "train.global_batch=4"],
    "tp2 sp eager": ["parallel.dp=1", "parallel.tp=2", "parallel.sp=true", "train.compile=false",
                     "train.global_batch=4"],
    "dp2 moe eager": ["parallel.dp=2", "model.name='debug-moe'", "train.compile=false"],  # experts: _grouped_mm
}


def _live_bytes(tracked: dict[int, StorageWeakRef]) -> int:
    """Bytes of the tracked storages still alive (their current size: a freed one may be resized to 0)."""
    return sum(torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
               for ref in tracked.values() if not ref.expired())


def _probe(extra: list[str], dataset_dir: Path, log_dir: str, world: int) -> dict[str, Any]:
    from pentatron.train.trainer import Trainer

    cfg = load_config(None, ["train.steps=1", "train.seq_len=32", "train.micro_batch=2", "train.global_batch=8",
                             "train.warmup=1", "train.peak_tflops=1.0", "log.progress=false",
                             "log.tensorboard=false", f"log.dir={log_dir!r}", "parallel.zero=3", FP64, *extra],
                      world_size=world)
    trainer = Trainer(cfg, dataset_dir=dataset_dir)
    engine = trainer.engine
    tracked: dict[int, StorageWeakRef] = {}
    samples: list[tuple[int, int]] = []  # (live gathered bytes, bytes the engine holds) per backward request
    gather, ensure = engine._gather, engine._ensure

    def tracking_gather(u: Any) -> None:
        gather(u)
        ref = StorageWeakRef(u.full.untyped_storage())
        tracked.setdefault(ref.cdata, ref)

    def measuring_ensure(u: Any) -> None:
        if torch._C._current_autograd_node() is not None:  # asked for by backward
            samples.append((_live_bytes(tracked), engine.gathered_bytes()))
        ensure(u)

    engine._gather, engine._ensure = tracking_gather, measuring_ensure
    trainer.train_step()
    unit_bytes = sorted(u.bucket.padded * engine.param_shard.element_size() for u in engine.units)
    engine.close()
    compiled = trainer.runner.compiled is not None and bool(trainer.runner.compiled.regions)
    return {"samples": samples, "compiled": compiled, "window": unit_bytes[-1], "total": sum(unit_bytes),
            "units": len(unit_bytes)}


def _ranks(rank: int, world: int, dataset_dir: Path, log_dir: str) -> dict[str, dict[str, Any]]:
    return {label: _probe(extra, dataset_dir, log_dir, world) for label, extra in CASES.items()}


def test_released_units_hold_no_gathered_bytes(default_dataset, tmp_path):
    runs = run_ranks(_ranks, 2, args=(default_dataset, str(tmp_path)), timeout=600)
    problems = []
    for rank, res in enumerate(runs):
        for label, got in res.items():
            samples = got["samples"]
            if not samples:
                problems.append(f"{label} rank {rank}: backward asked for no unit")
                continue
            if got["compiled"] != ("train.compile=true" in CASES[label]):
                problems.append(f"{label} rank {rank}: compiled regions {got['compiled']}")
            first_live = samples[0][0]
            print(f"{label} rank {rank}: live gathered bytes at the first backward {first_live} "
                  f"(window {got['window']}, all {got['units']} units {got['total']})")
            if first_live > got["window"]:
                problems.append(f"{label} rank {rank}: {first_live} gathered bytes alive after the forward, "
                                f"window {got['window']}")
            orphaned = [live - held for live, held in samples if live != held]
            if orphaned:
                problems.append(f"{label} rank {rank}: gathered bytes alive beyond what the engine holds, "
                                f"per backward request: {orphaned}")
    assert not problems, "\n".join(problems)
