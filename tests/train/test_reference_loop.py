"""The 1-process trainer equals a plain PyTorch loop (torch AdamW with the same decay groups,
clip_grad_norm_, the same warmup + cosine schedule) for 4 steps: losses, gradient norms, every
parameter's step-1 gradient and the final parameters — with two accumulation micro-steps on the
trainer's side and one whole batch on the reference's. This pins the trainer to an implementation that
shares none of its code, so the multi-process parity tests may compare against either. And the reference
runs are computed once per session for each set of arguments, each caller getting its own copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pentatron.config import load_config
from tests.reference_loop import once_per_session, reference_run, relative_error

STEPS, SEQ, GLOBAL, LR, EPS, WARMUP = 4, 32, 8, 1e-3, 1e-4, 2
TOL = 1e-5


@pytest.mark.parametrize("model", ["debug", "debug-untied"])
def test_one_process_trainer_equals_a_plain_pytorch_loop(default_dataset, tmp_path, model):
    from pentatron.train.trainer import Trainer

    cfg = load_config(None, [f"model.name={model}", f"train.steps={STEPS}", f"train.seq_len={SEQ}",
                             "train.micro_batch=4", f"train.global_batch={GLOBAL}", f"train.lr={LR}",
                             f"train.eps={EPS}", f"train.warmup={WARMUP}", "train.schedule='cosine'",
                             "train.clip=1.0", "log.progress=false", "log.tensorboard=false",
                             f"log.dir={str(tmp_path)!r}", "train.peak_tflops=1.0"], world_size=1)
    trainer = Trainer(cfg, dataset_dir=default_dataset)
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        record = trainer.train_step()
        losses.append(record["loss"])
        norms.append(record["grad_norm"])
        if step == 0:
            grads = {n: g.numpy() for n, g in trainer.runner.full_gradients().items()}
    params = {n: t.numpy() for n, t in trainer.runner.full_parameters().items()}

    ref = reference_run(default_dataset, model=model, steps=STEPS, seq_len=SEQ, global_batch=GLOBAL, lr=LR,
                        eps=EPS, warmup=WARMUP)
    np.testing.assert_allclose(losses, ref["losses"], rtol=TOL)
    np.testing.assert_allclose(norms, ref["norms"], rtol=TOL)
    assert ref["norms"][0] > 1.0, "the first step must exercise clipping"
    assert set(grads) == set(ref["grads"])
    for name, g in grads.items():
        assert relative_error(g, ref["grads"][name]) <= TOL, name
    for name, p in params.items():
        assert relative_error(p, ref["params"][name]) <= TOL, name


def test_a_reference_run_is_computed_once_per_arguments_and_handed_out_as_copies():
    calls = []

    @once_per_session
    def run(dataset_dir: Path, *, steps: int, lr: float = 1.0) -> dict:
        calls.append((str(dataset_dir), steps, lr))
        return {"losses": [float(steps)], "params": {"w": np.zeros(2)}}

    first = run(Path("a"), steps=2)
    assert run(Path("a"), steps=2, lr=1.0)["losses"] == first["losses"] and len(calls) == 1  # default passed
    first["losses"].append(9.0)
    first["params"]["w"][0] = 9.0
    again = run(Path("a"), steps=2)
    assert again["losses"] == [2.0] and not again["params"]["w"].any()  # a caller's change reaches no other
    run(Path("a"), steps=3)
    run(Path("b"), steps=2)
    assert [c[:3] for c in calls] == [("a", 2, 1.0), ("a", 3, 1.0), ("b", 2, 1.0)]
