"""Data parallelism inside a pipeline: what moves, when, and what is held.

dp2×pp2 on the tied debug model, 1F1B with m = 4 micro-batches per step:
- ZeRO-3 ledger bytes equal the formula of each gather choice, per unit u of this rank's stage (its
  padded size P_u, ring volumes over dp): re-gather per micro-batch = 2m all-gathers + 1 reduce-scatter
  of every unit per step; gathered per step = 1 all-gather + 1 reduce-scatter.
- Peak parameter memory, measured on the parameters' real storages at every module's forward and
  backward: gathering per step holds the whole stage; per micro-batch at most two units (the one
  computing and the prefetched one).
- Overlap: the gradient reduction (DDP's bucket all-reduce, ZeRO-3's reduce-scatter) of the last stage
  is issued during its last backward, before the pipeline's last send of the step — not after the
  schedule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pentatron.config import load_config
from pentatron.distributed.comm import ring_bytes
from tests.multiprocess import run_ranks
from tests.strict_comm import strict_comm_fixture

strict_comm = strict_comm_fixture("module")  # NCCL's p2p ordering and device rules on gloo

M = 4  # micro-batches per step: global 8 / (dp 2 · micro 1)
CASES = {"zero3 micro_batch": ["parallel.zero=3", "parallel.zero3_gather='micro_batch'"],
         "zero3 step": ["parallel.zero=3", "parallel.zero3_gather='step'"],
         "zero0": ["parallel.zero=0", "parallel.bucket_mb=0.1"]}


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the parameters that currently hold data."""
    storages = {p.data.untyped_storage().data_ptr(): p.data.untyped_storage().nbytes()
                for p in model.parameters() if p.data.numel()}
    return sum(storages.values())


def _run(rank: int, world: int, dataset_dir: Path, log_dir: str) -> dict[str, Any]:
    from pentatron.train.trainer import Trainer

    out = {}
    for label, extra in CASES.items():
        cfg = load_config(None, ["parallel.dp=2", "parallel.pp=2", "train.seq_len=32", "train.micro_batch=1",
                                 "train.global_batch=8", "train.steps=2", "train.warmup=1", "train.peak_tflops=1.0",
                                 "log.progress=false", "log.tensorboard=false", f"log.dir={log_dir!r}", *extra],
                          world_size=world)
        trainer = Trainer(cfg, dataset_dir=dataset_dir)
        model, peak = trainer.model, [0]

        def sample(*_: Any, model: torch.nn.Module = model, peak: list[int] = peak) -> None:
            peak[0] = max(peak[0], _held_bytes(model))

        handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(sample),
                                                        m.register_full_backward_pre_hook(sample))]
        trainer.train_step()
        trainer.train_step()  # the second step: nothing left over from construction
        for h in handles:
            h.remove()
        # Units of this rank's stage: each layer, the embedding (first stage), final norm and head (last);
        # their sizes from the placements (ZeRO-3 has emptied the parameters themselves).
        units: dict[str, int] = {}
        for name, placement in trainer.runner.placements.items():
            unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name.split(".")[0]
            units[unit] = units.get(unit, 0) + placement.numel
        padded = [-(-n // 2) * 2 * 4 for n in units.values()]  # fp32 bytes, padded to a multiple of dp
        events = [(e.op, e.dim, e.payload_bytes, e.bytes) for e in trainer.comm.ledger.events]
        out[label] = {"events": events, "padded": padded, "peak": peak[0], "pp_rank": trainer.pp_rank}
        trainer.engine.close()
    return out


@pytest.fixture(scope="module")
def runs(default_dataset, tmp_path_factory) -> list[dict[str, Any]]:
    return run_ranks(_run, 4, args=(default_dataset, str(tmp_path_factory.mktemp("log"))), timeout=600)


def _dp_bytes(events: list[tuple], op: str) -> tuple[int, int]:
    chosen = [e for e in events if e[0] == op and e[1] == "dp"]
    return len(chosen), sum(e[3] for e in chosen)


@pytest.mark.parametrize("mode, gathers_per_unit", [("micro_batch", 2 * M), ("step", 1)])
def test_zero3_under_pp_ledger_equals_the_formula_of_each_choice(runs, mode, gathers_per_unit):
    for res in runs:
        r = res[f"zero3 {mode}"]
        ring = [ring_bytes("all_gather", p, 2) for p in r["padded"]]
        assert _dp_bytes(r["events"], "all_gather") == (gathers_per_unit * len(ring), gathers_per_unit * sum(ring))
        scatter = [ring_bytes("reduce_scatter", p, 2) for p in r["padded"]]
        assert _dp_bytes(r["events"], "reduce_scatter") == (len(scatter), sum(scatter))


def test_zero3_gather_choice_trades_parameter_memory(runs):
    for res in runs:
        per_step, per_micro = res["zero3 step"], res["zero3 micro_batch"]
        assert per_step["peak"] == sum(per_step["padded"])  # the whole stage, gathered once
        two_largest = sum(sorted(per_micro["padded"])[-2:])
        assert 0 < per_micro["peak"] <= two_largest < per_step["peak"]


@pytest.mark.parametrize("label, op", [("zero0", "all_reduce"), ("zero3 micro_batch", "reduce_scatter"),
                                       ("zero3 step", "reduce_scatter")])
def test_gradient_reduction_overlaps_the_last_stage_backward(runs, label, op):
    for res in runs:
        r = res[label]
        if r["pp_rank"] != 1:
            continue
        ops = r["events"]
        first_reduce = next(i for i, e in enumerate(ops) if e[0] == op and e[1] == "dp" and e[2] > 8)
        last_send = max(i for i, e in enumerate(ops) if e[0] == "send" and e[1] == "pp")
        assert first_reduce < last_send, ops
