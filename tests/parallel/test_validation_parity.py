"""Validation ([eval], parallel/evaluate.py) in parallel layouts on real gloo ranks, through the `Trainer`:

- it changes nothing in training: the fp32 training losses and gradient norms of a run evaluating every
  2 steps equal, bit for bit, those of the same run with eval.every = 0 (pp2 1F1B, MoE ep2 with the aux-free
  bias, which the step's expert loads move: an evaluation's routing must not count);
- its loss is the one-process one: in float64 the validation loss of each layout (pp2 interleaved v=2,
  MoE ep2, tp2+sp, cp2 ring, dp2 ZeRO-3) equals the 1-process
  trainer's at both evaluations to `EXACT_RTOL` (the 1-process value is checked against an independent
  forward in tests/train/test_validation.py).

One 2-rank launch runs every case in sequence (process start-up dominates on the 2-core machine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pentatron.config import Config, load_config
from tests.multiprocess import rank_threads, run_ranks
from tests.reference_loop import EXACT_RTOL, FP64

STEPS, SEQ, MICRO, GLOBAL = 4, 32, 2, 8
EVAL = ["eval.every=2", "eval.batches=2", f"eval.holdout_tokens={2 * GLOBAL * SEQ + 1}"]
MOE = "model.name='debug-moe'"

# label -> (overrides, the 1-process run its fp64 validation loss must equal (None: not run in fp64),
# whether its fp32 training is also compared with eval off)
CASES: dict[str, tuple[list[str], str | None, bool]] = {
    "pp2 1f1b": (["parallel.pp=2"], None, True),
    "pp2 interleaved v2": (["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2"],
                           "dense", False),
    "moe ep2": (["parallel.dp=2", "parallel.ep=2", MOE], "moe", False),
    # the aux-free bias moves by the step's loads: an evaluation's routing counted in would move it
    "moe ep2 aux-free": (["parallel.dp=2", "parallel.ep=2", "model.name='debug-moe-auxfree'"], None, True),
    "tp2 sp": (["parallel.tp=2", "parallel.sp=true"], "dense", False),
    "cp2 ring": (["parallel.dp=1", "parallel.cp=2"], "dense", False),
    "dp2 zero3": (["parallel.dp=2", "parallel.zero=3"], "dense", False),
}


def _config(world: int, extra: list[str], log_dir: str) -> Config:
    return load_config(None, [f"train.steps={STEPS}", f"train.seq_len={SEQ}", f"train.micro_batch={MICRO}",
                              f"train.global_batch={GLOBAL}", "train.lr=1e-3", "train.eps=1e-4", "train.warmup=2",
                              "train.peak_tflops=1.0", "parallel.bucket_mb=1.0", "log.progress=false",
                              "log.tensorboard=false", f"log.dir={json.dumps(log_dir)}", *EVAL, *extra],
                       world_size=world)


def _fit(cfg: Config, dataset_dir: Path) -> dict[str, Any]:
    """`Trainer.fit`'s steps and evaluations, without its logging and report (tests/train/test_validation.py
    runs `fit` itself)."""
    from pentatron.train.trainer import Trainer

    trainer = Trainer(cfg, dataset_dir=dataset_dir)
    out: dict[str, Any] = {"losses": [], "norms": [], "val": {}}
    while trainer.step < cfg.train.steps:
        record = trainer.train_step()
        out["losses"].append(record["loss"])
        out["norms"].append(record["grad_norm"])
        if trainer.validation is not None and trainer.validation.due(trainer.step):
            out["val"][trainer.step] = trainer.validation.run()["loss"]
    trainer.engine.close()
    return out


def _ranks(rank: int, world: int, dataset_dir: Path, log_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, (extra, reference, bitwise) in CASES.items():
        if reference is not None:
            out[label, "fp64"] = _fit(_config(world, [FP64, *extra], log_dir), dataset_dir)
        if bitwise:
            out[label, "fp32"] = _fit(_config(world, ["train.precision='fp32'", *extra], log_dir), dataset_dir)
            out[label, "fp32 no eval"] = _fit(_config(world, ["train.precision='fp32'", "eval.every=0", *extra],
                                                      log_dir), dataset_dir)
    return out


@pytest.fixture(scope="module")
def runs(default_dataset, tmp_path_factory) -> list[dict[str, Any]]:
    log_dir = str(tmp_path_factory.mktemp("val-runs"))
    return run_ranks(_ranks, 2, args=(default_dataset, log_dir))


@pytest.fixture(scope="module")
def one_process(default_dataset, tmp_path_factory) -> dict[str, dict[str, Any]]:
    log_dir = str(tmp_path_factory.mktemp("val-one"))
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads())  # as the ranks run (and cheaper on the loaded 2-core machine)
    try:
        return {"dense": _fit(_config(1, [FP64], log_dir), default_dataset),
                "moe": _fit(_config(1, [FP64, MOE], log_dir), default_dataset)}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("label", [k for k, (_, reference, _) in CASES.items() if reference is not None])
def test_validation_loss_equals_the_one_process_loss(runs, one_process, label):
    ref = one_process[CASES[label][1]]["val"]
    assert list(ref) == [2, 4]
    for rank, res in enumerate(runs):
        got = res[label, "fp64"]["val"]
        assert list(got) == [2, 4], (label, rank)
        np.testing.assert_allclose([got[s] for s in ref], [ref[s] for s in ref], rtol=EXACT_RTOL,
                                   err_msg=f"{label} rank {rank}")


@pytest.mark.parametrize("label", [k for k, (_, _, bitwise) in CASES.items() if bitwise])
def test_training_with_validation_equals_training_without_bitwise(runs, label):
    for rank, res in enumerate(runs):
        on, off = res[label, "fp32"], res[label, "fp32 no eval"]
        assert list(on["val"]) == [2, 4] and not off["val"], (label, rank)
        assert on["losses"] == off["losses"], f"{label} rank {rank}: fp32 training losses differ"
        assert on["norms"] == off["norms"], f"{label} rank {rank}: fp32 gradient norms differ"
