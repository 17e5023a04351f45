"""bf16 mixed precision (bf16 weights and activations, fp32 gradient accumulation and fp32 master weights)
gives the same training in every layout as on one process, within bf16's precision.

dp2 with ZeRO-1 and ZeRO-3, tp2 and pp2 run 10 steps against the 1-process bf16 trainer (itself pinned to
a plain PyTorch loop in fp32 by tests/train/test_reference_loop.py). A layout changes the order of the
bf16 additions inside matmuls (tp splits the reductions, dp the batch) and bf16 keeps 8 bits of mantissa
(relative rounding 2⁻⁹ ≈ 0.2 % per operation), so the stated tolerance is: losses within 0.1 % relative at
every step, the step-1 gradient of every parameter within 3 % (‖Δ‖/‖ref‖), final parameters within 1 %.
Measured (torch 2.13 CPU): losses ≤ 1.1e-4, step-1 gradients ≤ 2.0e-3 (dp, pp) and 1.2e-2 (tp2: the
attention and MLP reductions split in two), final parameters ≤ 3.8e-3.
A real bug (a missing reduction, a gradient scaled by dp or m, a stale shard) moves these by far more:
the same comparison in fp32 holds to 1e-5 (test_composition_parity.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pentatron.config import Config, load_config
from tests.multiprocess import run_ranks
from tests.reference_loop import relative_error

STEPS = 10
LOSS_TOL, GRAD_TOL, PARAM_TOL = 1e-3, 3e-2, 1e-2
LAYOUTS = {"dp2 zero1": ["parallel.dp=2", "parallel.zero=1"], "dp2 zero3": ["parallel.dp=2", "parallel.zero=3"],
           "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"]}


def _config(world: int, extra: list[str], log_dir: str) -> Config:
    return load_config(None, [f"train.steps={STEPS}", "train.seq_len=32", "train.micro_batch=2", "train.global_batch=8",
                              "train.lr=1e-3", "train.eps=1e-4", "train.warmup=2", "train.precision='bf16'",
                              "train.peak_tflops=1.0", "parallel.bucket_mb=0.25", "log.progress=false",
                              "log.tensorboard=false", f"log.dir={log_dir!r}", *extra], world_size=world)


def _train(cfg: Config, dataset_dir: Path) -> dict[str, Any]:
    from pentatron.train.trainer import Trainer

    trainer = Trainer(cfg, dataset_dir=dataset_dir)
    assert trainer.policy.name == "bf16" and all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    out: dict[str, Any] = {"losses": []}
    for step in range(STEPS):
        out["losses"].append(trainer.train_step()["loss"])
        if step == 0:
            out["grads"] = {n: g.float().numpy() for n, g in trainer.runner.full_gradients().items()}
    out["params"] = {n: t.float().numpy() for n, t in trainer.runner.full_parameters().items()}
    trainer.engine.close()
    return out


def _ranks(rank: int, world: int, dataset_dir: Path, log_dir: str) -> dict[str, dict[str, Any]]:
    return {label: _train(_config(world, extra, log_dir), dataset_dir) for label, extra in LAYOUTS.items()}


def test_bf16_layouts_match_one_process_within_bf16_precision(default_dataset, tmp_path):
    ref = _train(_config(1, [], str(tmp_path)), default_dataset)
    runs = run_ranks(_ranks, 2, args=(default_dataset, str(tmp_path)), timeout=900)
    worst: dict[str, tuple[float, float, float]] = {}
    for label in LAYOUTS:
        losses = max(float(np.max(np.abs(np.array(r[label]["losses"]) / np.array(ref["losses"]) - 1))) for r in runs)
        grads: dict[str, np.ndarray] = {}
        params: dict[str, np.ndarray] = {}
        for r in runs:
            grads.update({n: g for n, g in r[label]["grads"].items() if n != "lm_head.weight"})
            params.update({n: p for n, p in r[label]["params"].items() if n != "lm_head.weight"})
        assert grads.keys() == ref["grads"].keys() == params.keys(), label
        g_err = max(relative_error(g, ref["grads"][n]) for n, g in grads.items())
        p_err = max(relative_error(p, ref["params"][n]) for n, p in params.items())
        worst[label] = (losses, g_err, p_err)
    print("bf16 worst relative errors (loss, step-1 grad, final param):", worst)
    for label, (loss_err, g_err, p_err) in worst.items():
        assert loss_err <= LOSS_TOL and g_err <= GRAD_TOL and p_err <= PARAM_TOL, (label, worst[label])
