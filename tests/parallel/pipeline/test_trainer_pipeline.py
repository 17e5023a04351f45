"""Pipeline parallelism through the real `Trainer`: 4 steps of the (tied) debug model equal the
1-process plain PyTorch loop (tests/reference_loop.py, which shares no code with the trainer) — losses and
grad norms each step, every parameter's step-1 gradient, final parameters gathered from every stage — for
pp=2 with each of the four schedules (interleaved with v=2 over the 4 layers) and with an explicit
split (parallel.pp_layers=[1,3]), pp=4 with 1F1B,
pp=2 × dp=2 with ZeRO-1, and pp=2 × tp=2 with and without sequence parallelism.

Both sides run in float64 and agree to `EXACT_RTOL` (1e-10) relative: rounding sits near 1e-15 whatever
kernels the CPU picks, and a real defect (a missing 1/m, a wrong shard) shows at 1e-6 or more.
One `run_ranks` call per world size runs its configurations in sequence (process start-up dominates
on the 2-core CI machine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pentatron.cli import main
from pentatron.config import Config, load_config
from pentatron.parallel.pipeline.trace import read_chrome_trace
from pentatron.schedules import bubble_fraction
from tests.multiprocess import run_ranks
from tests.reference_loop import EXACT_RTOL, FP64, reference_run, relative_error

STEPS, SEQ, MICRO, GLOBAL = 4, 32, 2, 8
TOL = EXACT_RTOL
LR, EPS, WARMUP = 1e-3, 1e-4, 2

# (label, world size, overrides): m = GLOBAL / (dp · MICRO) micro-batches per step.
CASES: dict[int, list[tuple[str, list[str]]]] = {
    2: [(f"pp=2 {s}", ["parallel.pp=2", f"parallel.pp_schedule={s}"]) for s in ("afab", "1f1b", "zb")]
    + [("pp=2 interleaved v=2", ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2"]),
       ("pp=2 1f1b pp_layers=[1,3]", ["parallel.pp=2", "parallel.pp_layers=[1,3]"])],
    4: [("pp=4 1f1b", ["parallel.pp=4"]),
        ("pp=2 dp=2 zero=1", ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1"]),
        ("pp=2 tp=2", ["parallel.pp=2", "parallel.tp=2"]),
        ("pp=2 tp=2 sp", ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true"]),
        # ZeRO-2 reduce-scatters a bucket whenever it completes, in the pipeline's backward order (tied
        # and ZeRO-3 compositions: tests/parallel/test_composition_parity.py).
        ("pp=2 dp=2 zero=2 untied", ["parallel.pp=2", "parallel.dp=2", "parallel.zero=2", "model.name=debug-untied"])],
}


def _config(world: int, extra: list[str], log_dir: str = "runs/test") -> Config:
    return load_config(None, [f"train.steps={STEPS}", f"train.seq_len={SEQ}", f"train.micro_batch={MICRO}",
                              f"train.global_batch={GLOBAL}", f"train.lr={LR}", f"train.eps={EPS}",
                              f"train.warmup={WARMUP}", "train.peak_tflops=1.0", "parallel.bucket_mb=1.0",
                              "log.progress=false", "log.tensorboard=false", f"log.dir={log_dir}", FP64, *extra],
                       world_size=world)


def _run(cfg: Config, dataset_dir: Path) -> dict[str, Any]:
    from pentatron.train.trainer import Trainer

    trainer = Trainer(cfg, dataset_dir=dataset_dir)
    records = [trainer.train_step()]
    grads = {n: g.numpy() for n, g in trainer.runner.full_gradients().items()}  # step 1, after clipping
    records += [trainer.train_step() for _ in range(cfg.train.steps - 1)]
    full = trainer.runner.full_parameters()
    trainer.engine.close()
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
            "bubble": [r.get("bubble") for r in records], "peak": records[-1].get("pp_peak_in_flight"),
            "params": {n: p.numpy() for n, p in full.items()}, "grads": grads, "comm": trainer.last_comm.bytes_map()}


def _ranks(rank: int, world: int, dataset_dir: Path, log_dir: str) -> dict[str, dict[str, Any]]:
    out = {}
    for label, extra in CASES[world]:
        trace = ["log.pp_trace=true"] if label == "pp=2 1f1b" else []
        out[label] = _run(_config(world, extra + trace, log_dir), dataset_dir)
    return out


def _reference(dataset_dir: Path, model: str = "debug") -> dict[str, Any]:
    """The plain loop with the trainer's hyperparameters (its defaults: cosine to 0.1, clip 1, decay 0.1)."""
    return reference_run(dataset_dir, model=model, steps=STEPS, seq_len=SEQ, global_batch=GLOBAL, lr=LR, eps=EPS,
                         warmup=WARMUP, dtype=torch.float64)


@pytest.fixture(scope="module")
def reference(default_dataset) -> dict[str, Any]:
    return _reference(default_dataset)


def _merged_params(runs: list[dict[str, Any]], label: str, key: str = "params") -> dict[str, np.ndarray]:
    """The full model (or its step-1 gradients) from every rank's stages; each replica must be identical."""
    merged: dict[str, np.ndarray] = {}
    for res in runs:
        for name, p in res[label][key].items():
            if name in merged:
                np.testing.assert_array_equal(p, merged[name], err_msg=f"{label}: replicas of {name} differ")
            merged[name] = p
    if "untied" not in label:
        # The last stage's copy of the tied embedding (its LM head) equals the first stage's, bit for bit.
        np.testing.assert_array_equal(merged.pop("lm_head.weight"), merged["embed.weight"], err_msg=label)
    return merged


def _assert_parity(ref: dict[str, Any], runs: list[dict[str, Any]], label: str) -> None:
    for rank, res in enumerate(runs):
        got = res[label]
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=TOL, err_msg=f"{label} rank {rank}: losses")
        np.testing.assert_allclose(got["norms"], ref["norms"], rtol=TOL, err_msg=f"{label} rank {rank}: norms")
        assert all(b is not None and b >= 0 for b in got["bubble"]), got["bubble"]
        assert got["comm"]["pp"], got["comm"]
    grads = _merged_params(runs, label, "grads")
    assert grads.keys() == ref["grads"].keys()
    for name, full in ref["grads"].items():
        err = relative_error(grads[name], full)
        assert err <= TOL, f"{label}: step-1 gradient of {name} off by {err:.2e}"
    params = _merged_params(runs, label)
    assert params.keys() == ref["params"].keys()
    for name, full in ref["params"].items():
        err = np.abs(params[name] - full).max() / np.abs(full).max()
        assert err <= TOL, f"{label}: {name} differs by {err:.2e} (relative to its max)"


def test_pp2_every_schedule_through_the_trainer_equals_one_process(reference, default_dataset, tmp_path):
    runs = run_ranks(_ranks, 2, args=(default_dataset, str(tmp_path)))
    assert reference["losses"][-1] < reference["losses"][0] - 0.2  # it trains: parity is not vacuous
    for label, _ in CASES[2]:
        _assert_parity(reference, runs, label)
    # Engine-counted in-flight micro-batches (m = 4): all of them for AFAB, at most p for 1F1B.
    assert [r["pp=2 afab"]["peak"] for r in runs] == [4, 4]
    assert max(r["pp=2 1f1b"]["peak"] for r in runs) <= 2
    # parallel.pp_layers=[1,3]: the first rank holds layer 0 only, the second layers 1-3
    held = [{n.split(".")[1] for n in r["pp=2 1f1b pp_layers=[1,3]"]["params"] if n.startswith("layers.")}
            for r in runs]
    assert held == [{"0"}, {"1", "2", "3"}], held
    # log.pp_trace: one Chrome trace per pipeline rank per step; merged they form the step's timeline.
    files = sorted((tmp_path / "pp_trace").glob(f"step{STEPS:06d}.rank*.json"))
    assert len(files) == 2 and all(json.loads(f.read_text())["traceEvents"] for f in files)
    timeline = read_chrome_trace(files)
    assert timeline.p == 2 and all(len(s) == 2 * 4 for s in timeline.slots)  # m F + m B per rank
    print("measured bubble pp=2 m=4:", {label: round(float(np.mean(runs[0][label]["bubble"][1:])), 3)
                                         for label, _ in CASES[2]},
          "closed form 1f1b:", bubble_fraction("1f1b", 2, 4))


def test_pp_with_dp_zero1_and_tp_sp_through_the_trainer_equals_one_process(reference, default_dataset, tmp_path):
    runs = run_ranks(_ranks, 4, args=(default_dataset, str(tmp_path)))
    untied = _reference(default_dataset, "debug-untied")
    for label, _ in CASES[4]:
        _assert_parity(untied if "untied" in label else reference, runs, label)
    assert runs[0]["pp=2 dp=2 zero=1"]["comm"]["dp"] and runs[0]["pp=2 tp=2"]["comm"]["tp"]


# ------------------------------------------------------------------------------------ errors before launch
@pytest.mark.parametrize(("overrides", "message"), [
    # debug.toml: global 8 / (dp 2 · micro 4) = 1 micro-batch < p = 2 (1F1B/AFAB/ZB accept any m ≥ 1)
    (["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2"],
     "must be at least the pipeline ranks p=2"),
    (["parallel.pp=4", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "train.micro_batch=1"],
     "not divisible by pp × pp_virtual"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=3", "train.micro_batch=1"],
     "pp_virtual=3 does not divide model.n_layers=4"),
    (["parallel.pp=4", "model.n_layers=3", "train.micro_batch=1"], "fewer than the 4"),
    (["parallel.pp=2", "parallel.pp_virtual=2", "train.micro_batch=1"], "needs parallel.pp_schedule='interleaved'"),
])
def test_cli_refuses_bad_pipeline_configs_before_launch(capsys, overrides, message):
    args = [a for o in overrides for a in ("--set", o)]
    code = main(["train", "configs/debug.toml", "--nproc", "4", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


def test_pipeline_checkpoint_config_is_accepted():
    # Save and exact resume are tested in tests/checkpoint/test_parallel_checkpoint.py.
    assert _config(2, ["parallel.pp=2", "checkpoint.dir=/tmp/x"]).checkpoint.dir == "/tmp/x"
