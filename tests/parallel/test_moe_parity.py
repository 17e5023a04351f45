"""MoE training on real gloo ranks equals a plain single-process loop (`tests/parallel/moe_reference.py`).

4 steps of the debug MoE (8 experts, top-2, a shared expert, layer 0 dense; dropless) through the real
`Trainer`, with the Switch aux loss + z-loss (`debug-moe`) or with the aux-free bias (`debug-moe-auxfree`),
must match the reference in the loss and gradient norm of every step, every parameter's step-1
gradient and final value (‖Δ‖/‖ref‖) — so the balancing losses' gradient is included — all to
`EXACT_RTOL` (1e-10: both sides run in float64, where rounding sits near 1e-15 whatever kernels the CPU
picks), the tokens routed to every expert at every step (exactly) and the final selection biases.
Every replica of a tensor must be bitwise identical on all ranks holding it.

With `moe.capacity_factor=1.0` (3 steps) the layouts must also drop exactly the assignments one process
drops — capacity is over the whole micro-batch, so under cp (ring, Ulysses, hybrid) and sp the kept ones
are chosen across the ranks sharing it — checked by the same parity and by every layer's dropped fraction
per step. Under sp (tp2, × ep2, × cp2) each tp rank routes its sequence shard: the same parity shows the
counts, the capacity and the MoE gradients summed over tp.

The "docs" cases train with document masking on short packed documents (tests/documents_data.py) against the
one-process masked MoE run (`moe_reference_run(documents=True)`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pentatron.config import Config, load_config
from pentatron.models.moe import moe_layers
from tests.multiprocess import run_ranks
from tests.parallel.moe_reference import moe_reference_run
from tests.reference_loop import EXACT_RTOL, FP64, relative_error
from tests.strict_comm import strict_comm_fixture

strict_comm = strict_comm_fixture("module")  # NCCL's ordering and device rules on gloo

# 4 steps: exact (float64) parity needs no long run for a defect to show (it does from step 1 or 2), and
# float64 MoE costs twice fp32 on CPU (torch._grouped_mm has no fp64 kernel: a padded bmm instead)
STEPS, SEQ, MICRO, GLOBAL, LR, EPS, WARMUP = 4, 32, 2, 8, 1e-3, 1e-4, 2
CAP_STEPS = 3
CAPACITY = ["moe.capacity_factor=1.0", f"train.steps={CAP_STEPS}"]  # drops ~15 % of a layer's assignments
CHECK = "distributed.check_collectives=true"

CASES: dict[int, dict[str, list[str]]] = {
    2: {
        "dp2 zero1 aux-loss": ["parallel.dp=2", "parallel.zero=1"],
        "dp2 zero0 aux-free": ["parallel.dp=2", "model.name='debug-moe-auxfree'"],
        "tp2 aux-loss (experts replicated over tp)": ["parallel.tp=2"],
        "pp2 aux-loss": ["parallel.pp=2"],
        # check mode on (each collective's descriptor compared across its group first): the uneven
        # token all-to-all is accepted, and the run is the same
        "ep2 zero0 aux-loss": ["parallel.dp=2", "parallel.ep=2", CHECK],
        "ep2 zero2 aux-free": ["parallel.dp=2", "parallel.ep=2", "parallel.zero=2", "model.name='debug-moe-auxfree'"],
        # cp: each rank routes its half of every sequence; the balancing loss counts assignments over the
        # whole sequences (summed over cp), so it equals the single-process loss
        "cp2×ep2 aux-free": ["parallel.dp=1", "parallel.cp=2", "parallel.ep=2", "model.name='debug-moe-auxfree'"],
        "cp2 aux-loss": ["parallel.dp=1", "parallel.cp=2"],
        # capacity over the micro-batch: the cp ranks choose the kept assignments together
        "cp2 ring capacity 1.0": ["parallel.dp=1", "parallel.cp=2", *CAPACITY],
        "cp2 ulysses capacity 1.0": ["parallel.dp=1", "parallel.cp=2", "parallel.cp_mode='ulysses'", *CAPACITY, CHECK],
        # sp: each tp rank routes its sequence shard; counts and capacity over the micro-batch, the MoE
        # layer's gradients (and so the balancing losses') summed over tp
        "tp2 sp aux-loss": ["parallel.tp=2", "parallel.sp=true"],
        "tp2 sp capacity 1.0": ["parallel.tp=2", "parallel.sp=true", *CAPACITY],
        "docs ep2 zero1 aux-loss": ["parallel.dp=2", "parallel.ep=2", "parallel.zero=1", "data.document_mask=true"],
    },
    4: {
        "ep4 zero1 aux-loss": ["parallel.dp=4", "parallel.ep=4", "parallel.zero=1"],
        "ep2×dp2 zero3 aux-loss": ["parallel.dp=4", "parallel.ep=2", "parallel.zero=3"],
        "ep2×tp2 aux-loss": ["parallel.dp=2", "parallel.tp=2", "parallel.ep=2"],
        "ep2×pp2 aux-free": ["parallel.dp=2", "parallel.pp=2", "parallel.ep=2", "model.name='debug-moe-auxfree'"],
        "cp4 hybrid (ulysses 2 × ring 2) × ep2 capacity 1.0": ["parallel.dp=1", "parallel.cp=4", "parallel.ep=2",
                                                              "parallel.cp_mode='hybrid'", "parallel.cp_ulysses=2",
                                                              *CAPACITY],
        "ep2 (from dp2)×tp2 sp aux-free": ["parallel.dp=2", "parallel.tp=2", "parallel.sp=true", "parallel.ep=2",
                                           "model.name='debug-moe-auxfree'"],
        # capacity chosen over tp, then cp (the micro-batch shared by 4 ranks)
        "cp2 ring×tp2 sp capacity 1.0": ["parallel.dp=1", "parallel.cp=2", "parallel.tp=2", "parallel.sp=true",
                                         *CAPACITY],
    },
}


def _model(extra: list[str]) -> str:
    """The reference a case is compared with: its model, with " capacity" when it sets a capacity factor."""
    model = "debug-moe-auxfree" if any("auxfree" in e for e in extra) else "debug-moe"
    return model + (" capacity" if CAPACITY[0] in extra else "") + (" docs" if DOCS in extra else "")


DOCS = "data.document_mask=true"


def _config(world: int, extra: list[str], log_dir: str) -> Config:
    model = [] if any(e.startswith("model.name") for e in extra) else ["model.name='debug-moe'"]
    return load_config(None, [f"train.steps={STEPS}", f"train.seq_len={SEQ}", f"train.micro_batch={MICRO}",
                              f"train.global_batch={GLOBAL}", f"train.lr={LR}", f"train.eps={EPS}",
                              f"train.warmup={WARMUP}", "train.schedule='cosine'", "train.clip=1.0",
                              "train.peak_tflops=1.0", "parallel.bucket_mb=0.25", "log.progress=false",
                              "log.tensorboard=false", f"log.dir={log_dir!r}", FP64, *model, *extra],
                       world_size=world)


def _train(cfg: Config, dataset_dir: Path) -> dict[str, Any]:
    from pentatron.train.trainer import Trainer

    trainer = Trainer(cfg, dataset_dir=dataset_dir)
    out: dict[str, Any] = {"losses": [], "norms": [], "loads": [], "dropped": []}
    for step in range(cfg.train.steps):
        record = trainer.train_step()
        out["losses"].append(record["loss"])
        out["norms"].append(record["grad_norm"])
        out["loads"].append({n: m["tokens_per_expert"] for n, m in record.get("moe", {}).items()})
        out["dropped"].append({n: m["dropped_frac"] for n, m in record.get("moe", {}).items()})
        if step == 0:
            out["grads"] = {n: g.numpy() for n, g in trainer.runner.full_gradients().items()}
    out["params"] = {n: t.numpy() for n, t in trainer.runner.full_parameters().items()}
    out["biases"] = {n: m.router.expert_bias.numpy().copy() for n, m in moe_layers(trainer.model).items()}
    trainer.engine.close()
    return out


def _ranks(rank: int, world: int, dataset_dir: Path, documents_dir: Path, log_dir: str
           ) -> dict[str, dict[str, Any]]:
    return {label: _train(_config(world, extra, log_dir), documents_dir if DOCS in extra else dataset_dir)
            for label, extra in CASES[world].items()}


def _merged(runs: list[dict[str, Any]], label: str, key: str) -> dict[str, np.ndarray]:
    """One tensor per name from every rank; replicas (over dp/tp, the tied copies) must be bitwise equal."""
    merged: dict[str, np.ndarray] = {}
    for rank, res in enumerate(runs):
        for name, t in res[label][key].items():
            name = "embed.weight" if name == "lm_head.weight" else name
            if name in merged:
                np.testing.assert_array_equal(t, merged[name], err_msg=f"{label}: rank {rank}'s {key} {name}")
            merged[name] = t
    return merged


@pytest.fixture(scope="module")
def references(default_dataset, documents_dataset) -> dict[str, dict[str, Any]]:
    common = dict(seq_len=SEQ, global_batch=GLOBAL, micro_batch=MICRO, lr=LR, eps=EPS, warmup=WARMUP,
                  dtype=torch.float64)
    refs = {m: moe_reference_run(default_dataset, model=m, steps=STEPS, **common)
            for m in ("debug-moe", "debug-moe-auxfree")}
    refs["debug-moe capacity"] = moe_reference_run(default_dataset, model="debug-moe", steps=CAP_STEPS,
                                                   capacity_factor=1.0, **common)
    refs["debug-moe docs"] = moe_reference_run(documents_dataset, model="debug-moe", steps=STEPS, documents=True,
                                               **common)
    return refs




def check_parity(runs: list[dict[str, Any]], label: str, ref: dict[str, Any]) -> None:
    for rank, res in enumerate(runs):
        for key in ("losses", "norms"):
            np.testing.assert_allclose(res[label][key], ref[key], rtol=EXACT_RTOL, err_msg=f"{label} rank {rank}")
    for key in ("grads", "params"):
        got = _merged(runs, label, key)
        assert got.keys() == ref[key].keys(), label
        for name, t in got.items():
            err = relative_error(t, ref[key][name])
            assert err <= EXACT_RTOL, f"{label}: {key} of {name} off by {err:.2e}"
    for name, bias in _merged(runs, label, "biases").items():
        np.testing.assert_array_equal(bias, ref["biases"][name], err_msg=f"{label}: bias of {name}")
    for step in range(len(ref["losses"])):
        loads = {n: c for res in runs for n, c in res[label]["loads"][step].items()}
        assert loads == ref["loads"][step], f"{label}: expert loads at step {step + 1}"
        dropped = {n: d for res in runs for n, d in res[label]["dropped"][step].items()}
        assert dropped == ref["dropped"][step], f"{label}: dropped fractions at step {step + 1}"


def test_reference_balancing_terms_are_live(references) -> None:
    """The parity below would be weaker if the balancing terms did nothing in 4 steps."""
    assert any(b.any() for b in references["debug-moe-auxfree"]["biases"].values())
    assert all(not b.any() for b in references["debug-moe"]["biases"].values())
    assert all(d == 0 for step in references["debug-moe"]["dropped"] for d in step.values())  # dropless
    assert all(d > 0.05 for step in references["debug-moe capacity"]["dropped"] for d in step.values())


@pytest.mark.parametrize("world", sorted(CASES))
def test_moe_parallel_equals_plain_loop(world, references, default_dataset, documents_dataset, tmp_path):
    runs = run_ranks(_ranks, world, args=(default_dataset, documents_dataset, str(tmp_path)), timeout=900)
    for label, extra in CASES[world].items():
        check_parity(runs, label, references[_model(extra)])
