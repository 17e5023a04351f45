"""fp32 and bf16 — the precisions users train in — give the same training in every layout as on one
process, within tolerances derived from the precision's own sensitivity (docs/testing.md), not guessed.

The exact parity suite runs every layout in float64 against a float64 plain loop to 1e-10. Here a few
layouts users run (dp with ZeRO and accumulation, tp + sp, pp 1F1B) train 10 steps in fp32 and in bf16 on
2 gloo ranks, and each is compared with the *exact* run (`reference_run` in float64, which shares no code
with the runtime): loss and gradient norm of every step, every parameter's step-1 gradient and final value.

Error model: a layout computes the same sums as one process in another order (dp splits the batch, tp the
reductions, pp nothing but the accumulation), so its rounding error against the exact run is of the same
size as that of a 1-process run in the same precision with another summation order. Two such samples are
measured on this machine, with these kernels: the 1-process trainer with the whole global batch in one
micro-batch, and with micro-batches of 1 (accumulated). For each quantity q (loss, norm, grads, params):

    tol_q = FACTOR · max(sample errors of q, u)       u: the precision's unit roundoff (2⁻²⁴, 2⁻⁹)

FACTOR = 4: on torch 2.13 CPU (AVX-512) every layout's error sat within 1.5× of the larger sample (largest
ratio: fp32 pp2's loss, 1.53e-7 against 1.03e-7); 4 leaves room for other kernels (the samples move with
them) while a real defect still shows: one element of one gradient left unscaled by 1/dp moves that
parameter's step-1 gradient by 2e-5 relative, 24× the fp32 samples' 8.5e-7.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pentatron.config import Config
from tests.multiprocess import run_ranks
from tests.parallel.test_composition_parity import EPS, GLOBAL, LR, SEQ, STEPS, WARMUP, _train
from tests.parallel.test_composition_parity import _config as composition_config
from tests.reference_loop import reference_run, relative_error

FACTOR = 4.0
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-9}
QUANTITIES = ("loss", "norm", "grads", "params")
LAYOUTS: dict[str, dict[str, list[str]]] = {
    "fp32": {"dp2 zero1 accum": ["parallel.dp=2", "parallel.zero=1", "train.micro_batch=2"],
             "tp2 sp": ["parallel.tp=2", "parallel.sp=true", "train.micro_batch=4"],
             "pp2 1f1b": ["parallel.pp=2", "train.micro_batch=2"]},
    "bf16": {"dp2 zero3": ["parallel.dp=2", "parallel.zero=3", "train.micro_batch=4"],
             "tp2 sp": ["parallel.tp=2", "parallel.sp=true", "train.micro_batch=4"],
             "pp2 1f1b": ["parallel.pp=2", "train.micro_batch=2"]},
}


def _config(world: int, precision: str, extra: list[str], log_dir: str) -> Config:
    """The composition tests' config in `precision` (bf16: bf16 weights, fp32 gradients and master)."""
    return composition_config(world, [f"train.precision='{precision}'", *extra], log_dir)


def _ranks(rank: int, world: int, dataset_dir: Path, log_dir: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(precision, label): _train(_config(world, precision, extra, log_dir), dataset_dir)
            for precision, layouts in LAYOUTS.items() for label, extra in layouts.items()}


def _errors(run: dict[str, Any], exact: dict[str, Any]) -> dict[str, float]:
    """Each quantity's largest relative error against the exact run (a tied head is the embedding)."""
    def rel(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))

    def worst(tensors: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
        named = {("embed.weight" if n == "lm_head.weight" else n): t for n, t in tensors.items()}
        assert named.keys() == ref.keys()
        return max(relative_error(t, ref[n]) for n, t in named.items())

    return {"loss": rel(run["losses"], exact["losses"]), "norm": rel(run["norms"], exact["norms"]),
            "grads": worst(run["grads"], exact["grads"]), "params": worst(run["params"], exact["params"])}


def tolerances(samples: list[dict[str, float]], precision: str) -> dict[str, float]:
    """The error model of the module docstring: FACTOR × the larger sample error, at least FACTOR × u."""
    return {q: FACTOR * max(max(s[q] for s in samples), UNIT_ROUNDOFF[precision]) for q in QUANTITIES}


def test_tolerance_is_factor_times_the_larger_sample_and_never_below_the_unit_roundoff():
    samples = [dict.fromkeys(QUANTITIES, 1e-6), {"loss": 3e-6, "norm": 1e-9, "grads": 0.0, "params": 2e-6}]
    tol = tolerances(samples, "fp32")
    assert tol == pytest.approx({"loss": 1.2e-5, "norm": 4e-6, "grads": 4e-6, "params": 8e-6})
    assert tolerances([dict.fromkeys(QUANTITIES, 0.0)], "bf16") == dict.fromkeys(QUANTITIES, FACTOR * 2.0**-9)


def test_fp32_and_bf16_layouts_match_the_exact_run_within_derived_tolerances(default_dataset, tmp_path):
    common = dict(steps=STEPS, seq_len=SEQ, global_batch=GLOBAL, lr=LR, eps=EPS, warmup=WARMUP)
    exact = reference_run(default_dataset, dtype=torch.float64, **common)
    tol = {}
    for precision in LAYOUTS:  # the two summation orders of one process, in this precision
        samples = [_errors(_train(_config(1, precision, [f"train.micro_batch={mb}"], str(tmp_path)), default_dataset),
                           exact) for mb in (GLOBAL, 1)]
        tol[precision] = tolerances(samples, precision)
    runs = run_ranks(_ranks, 2, args=(default_dataset, str(tmp_path)), timeout=900)
    failures = []
    for key in runs[0]:
        merged = {**runs[0][key], "grads": {}, "params": {}}  # losses and norms: every rank logs the same
        for res in runs:
            merged["grads"].update(res[key]["grads"])
            merged["params"].update(res[key]["params"])
        err = _errors(merged, exact)
        failures += [f"{' '.join(key)}: {q} off by {err[q]:.2e} > {tol[key[0]][q]:.2e}"
                     for q in QUANTITIES if not err[q] <= tol[key[0]][q]]
    assert not failures, "\n".join(failures)
