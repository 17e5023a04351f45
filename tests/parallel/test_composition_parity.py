"""Every composition of the parallel dimensions equals a plain single-process PyTorch loop.

dp × ZeRO-0/1/2/3 × tp (± sp) × pp (1F1B, interleaved, zero-bubble) × recompute, tied and untied
embeddings, Qwen3's q/k norms (tp2 × sp × pp2), Qwen3-MoE (ep2 × tp2 + sp, ep2 × pp2) — including the
compositions that used to be refused:
ZeRO-3 under pipeline parallelism (both gather choices), ZeRO-2 under pp with a tied embedding,
and the 8-rank dp2×tp2×pp2 layouts.
Each run trains 4 steps in float64 (`train.precision='fp64'`) through the real `Trainer` on real gloo
ranks and must match `tests/reference_loop.py` (which shares no code with the parallel runtime), also in
float64, in the loss and gradient norm of every step, in every parameter's step-1 gradient (‖Δ‖/‖ref‖) and
in the final parameters, all to `EXACT_RTOL` (1e-10; rounding sits near 1e-15 on any CPU); every replica of
a tensor must be bitwise identical on all ranks holding it. The fp32 and bf16 runs users train with are
held to derived tolerances in test_reduced_precision_parity.py.

One `run_ranks` call per world size runs its layouts in sequence (process start-up dominates on the 2-core
CI machine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pentatron.config import Config, load_config
from tests.multiprocess import run_ranks
from tests.reference_loop import EXACT_RTOL, FP64, relative_error
from tests.strict_comm import strict_comm_fixture

strict_comm = strict_comm_fixture("module")  # NCCL's p2p ordering and device rules on gloo

STEPS, SEQ, MICRO, GLOBAL, LR, EPS, WARMUP = 4, 32, 2, 8, 1e-3, 1e-4, 2
TOL = EXACT_RTOL

DP2PP2 = ["parallel.dp=2", "parallel.pp=2"]
QWEN3 = ["model.name=debug-qwen3"]
QWEN3_MOE = ["model.name=debug-qwen3-moe"]
DP2TP2PP2 = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.sp=true"]
CASES: dict[int, dict[str, list[str]]] = {
    4: {
        "dp2×pp2 zero3 tied (re-gather per micro-batch)": [*DP2PP2, "parallel.zero=3"],
        "dp2×pp2 zero3 tied (gathered per step)": [*DP2PP2, "parallel.zero=3", "parallel.zero3_gather='step'"],
        "dp2×pp2 zero3 untied": [*DP2PP2, "parallel.zero=3", "model.name=debug-untied"],
        "dp2×pp2 zero3 tied zb": [*DP2PP2, "parallel.zero=3", "parallel.pp_schedule=zb"],
        "dp2×pp2 zero2 tied": [*DP2PP2, "parallel.zero=2"],
        "dp2×pp2 zero1 tied selective": [*DP2PP2, "parallel.zero=1", "train.recompute=selective"],
        "dp2×pp2 zero0 tied interleaved": [*DP2PP2, "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2"],
        # Qwen3's q/k norms: one gain per head_dim shared by the heads each tp rank splits, so its gradient is
        # summed over tp (SP or not: the same hook); one case, for the test-time budget
        "qwen3 tp2×pp2 sp": [*QWEN3, "parallel.tp=2", "parallel.pp=2", "parallel.sp=true"],
        # Qwen3-MoE (q/k norms in MoE blocks, untied): ep2 borrowed from dp2 × tp2 + sp (the q/k norm gains summed
        # over tp, each tp rank routing its sequence shard) and ep2 × pp2; against the micro-batched MoE loop
        "qwen3-moe untied ep2 (from dp2)×tp2 sp": [*QWEN3_MOE, "parallel.dp=2", "parallel.tp=2", "parallel.sp=true",
                                                  "parallel.ep=2"],
        "qwen3-moe untied ep2×pp2": [*QWEN3_MOE, *DP2PP2, "parallel.ep=2"],
        # HSDP: ZeRO-3 and ZeRO-2 over 2-rank shard groups, 2 replicas all-reducing their shards; and ZeRO-1
        # under pp2 with 1-rank shard groups (replicated optimizer state, gradients all-reduced across replicas)
        "hsdp dp4 = 2 replicas × 2 shards zero3": ["parallel.dp=4", "parallel.zero=3", "parallel.dp_shard=2"],
        "hsdp dp4 = 2 replicas × 2 shards zero2 accumulating": ["parallel.dp=4", "parallel.zero=2",
                                                                "parallel.dp_shard=2", "train.micro_batch=1"],
        "hsdp dp2 = 2 replicas × 1 shard ×pp2 zero1 tied": [*DP2PP2, "parallel.zero=1", "parallel.dp_shard=1"],
    },
    8: {
        "dp2×tp2×pp2 zero2 sp full recompute": [*DP2TP2PP2, "parallel.zero=2", "train.recompute=full"],
        "dp2×tp2×pp2 zero3 sp interleaved": [*DP2TP2PP2, "parallel.zero=3", "parallel.pp_schedule=interleaved",
                                             "parallel.pp_virtual=2"],
    },
}


def _config(world: int, extra: list[str], log_dir: str) -> Config:
    """The parity runs' config: float64 unless `extra` names another train.precision (a later override wins)."""
    return load_config(None, [f"train.steps={STEPS}", f"train.seq_len={SEQ}", f"train.micro_batch={MICRO}",
                              f"train.global_batch={GLOBAL}", f"train.lr={LR}", f"train.eps={EPS}",
                              f"train.warmup={WARMUP}", "train.schedule='cosine'", "train.clip=1.0",
                              "train.peak_tflops=1.0", "parallel.bucket_mb=0.25", "log.progress=false",
                              "log.tensorboard=false", f"log.dir={log_dir!r}", FP64, *extra], world_size=world)


def _train(cfg: Config, dataset_dir: Path, validate: bool = False) -> dict[str, Any]:
    """Losses, norms, step-1 gradients, final parameters; with `validate`, the validation `fit` runs after
    the last step ("val")."""
    from pentatron.train.trainer import Trainer

    trainer = Trainer(cfg, dataset_dir=dataset_dir)
    out: dict[str, Any] = {"losses": [], "norms": []}
    for step in range(STEPS):
        record = trainer.train_step()
        out["losses"].append(record["loss"])
        out["norms"].append(record["grad_norm"])
        if step == 0:
            out["comm"] = record["comm_calls"]
            out["grads"] = {n: g.double().numpy() for n, g in trainer.runner.full_gradients().items()}
    out["params"] = {n: t.double().numpy() for n, t in trainer.runner.full_parameters().items()}
    if (report := trainer.runner.compiled) is not None:  # train.compile: its regions, FP8 linears outside them
        from pentatron.parallel.compile import eager_fp8_linears

        out["regions"], out["eager_fp8"] = list(report.regions), eager_fp8_linears(trainer.runner.model)
    if validate:
        out["val"] = trainer.validation.run()  # as `fit` runs it after the last step
    trainer.engine.close()
    return out


def _ranks(rank: int, world: int, dataset_dir: Path, log_dir: str) -> dict[str, dict[str, Any]]:
    return {label: _train(_config(world, extra, log_dir), dataset_dir) for label, extra in CASES[world].items()}


def _merged(runs: list[dict[str, Any]], label: str, key: str, tied: bool) -> dict[str, np.ndarray]:
    """One tensor per name from every rank; replicas (over dp, and tied copies) must be bitwise equal."""
    merged: dict[str, np.ndarray] = {}
    for rank, res in enumerate(runs):
        for name, t in res[label][key].items():
            name = "embed.weight" if tied and name == "lm_head.weight" else name
            if name in merged:
                np.testing.assert_array_equal(t, merged[name], err_msg=f"{label}: rank {rank}'s {key} {name}")
            merged[name] = t
    return merged


def _reference(label: str, tied: bool) -> str:
    """The `references` entry (conftest.py) a case is compared with."""
    if "qwen3-moe" in label:
        return "debug-qwen3-moe"
    return "debug-qwen3" if "qwen3" in label else "debug" if tied else "debug-untied"


@pytest.mark.parametrize("world", sorted(CASES))
def test_every_composition_equals_a_plain_loop(world, references, default_dataset, tmp_path, request):
    if any("qwen3-moe" in label for label in CASES[world]):  # the MoE loop's reference only where a case needs it
        references = {**references, "debug-qwen3-moe": request.getfixturevalue("qwen3_moe_reference")}
    runs = run_ranks(_ranks, world, args=(default_dataset, str(tmp_path)), timeout=900)
    for label in CASES[world]:
        tied = "untied" not in label
        ref = references[_reference(label, tied)]
        for rank, res in enumerate(runs):
            np.testing.assert_allclose(res[label]["losses"], ref["losses"], rtol=TOL,
                                       err_msg=f"{label} rank {rank}: losses")
            np.testing.assert_allclose(res[label]["norms"], ref["norms"], rtol=TOL,
                                       err_msg=f"{label} rank {rank}: grad norms")
        if "hsdp" in label:  # the shards reduce-scattered within a shard group, all-reduced across replicas
            comm = runs[0][label]["comm"]
            assert comm["dp_replicate"]["all_reduce"] >= 1, (label, comm)
            assert set(comm.get("dp", {})) <= {"all_reduce"}, (label, comm)  # over all of dp: the loss average only
            if "2 shards" in label:
                assert comm["dp_shard"]["reduce_scatter"] >= 1 and comm["dp_shard"]["all_gather"] >= 1, (label, comm)
        for key, ref_key in (("grads", "grads"), ("params", "params")):
            got = _merged(runs, label, key, tied)
            assert got.keys() == ref[ref_key].keys(), label
            for name, t in got.items():
                err = relative_error(t, ref[ref_key][name])
                assert err <= TOL, f"{label}: {key} of {name} off by {err:.2e}"
