"""Validation ([eval]) in one process, through `Trainer.fit` as `pentatron train` runs it:

- its loss is the mean cross-entropy of the trained model over the held-out tokens, computed here
  independently (the plain model's forward and `F.cross_entropy` over windows read straight from the
  shard files at the split this test works out) to `EXACT_RTOL` in float64 — for the dense model and for
  the MoE model, whose balancing losses must stay out of it;
- it is reported: the console line, metrics.jsonl's `val` at steps 2 and 4 only, TensorBoard's `val/loss`
  and `val/perplexity`, summary.json and the console summary, the run report (validation loss beside the
  training loss);
- a resume from step 2 evaluates the same batches: step 3-4 losses and the step-4 validation loss equal
  the uninterrupted run's bit for bit.
(Parallel layouts: tests/parallel/test_validation_parity.py.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pentatron.config import load_config
from pentatron.data.index import read_index
from pentatron.models.llama import build_model
from pentatron.observe.summary import finish_run
from pentatron.train.trainer import Trainer
from tests.multiprocess import rank_threads
from tests.reference_loop import EXACT_RTOL, FP64

SEQ, GLOBAL, BATCHES = 32, 8, 2
HOLDOUT = BATCHES * GLOBAL * SEQ + 1 + 100  # 100 tokens past the last validation window: never read


def _cfg(log_dir: Path, *extra: str):
    return load_config(None, ["train.steps=4", f"train.seq_len={SEQ}", "train.micro_batch=4",
                              f"train.global_batch={GLOBAL}", "train.warmup=2", "train.peak_tflops=1.0", FP64,
                              f"log.dir={json.dumps(str(log_dir))}", "log.progress=false", "eval.every=2",
                              f"eval.batches={BATCHES}", f"eval.holdout_tokens={HOLDOUT}", *extra], world_size=1)


def _stream(dataset: Path) -> np.ndarray:
    """The dataset's whole token stream, read from its shard files without the loader."""
    index = read_index(dataset)
    return np.concatenate([np.fromfile(dataset / s.file, dtype=index.dtype) for s in index.shards if s.tokens])


def _independent_val_loss(dataset: Path, model: str, params: dict[str, torch.Tensor]) -> float:
    from pentatron.models.registry import get_model_config

    stream = _stream(dataset)
    split = len(stream) - HOLDOUT
    windows = np.stack([stream[split + j * SEQ: split + j * SEQ + SEQ + 1] for j in range(BATCHES * GLOBAL)])
    tokens = torch.from_numpy(windows.astype(np.int64))
    net = build_model(get_model_config(model), dtype=torch.float64)
    net.load_state_dict({n: p for n, p in params.items() if n in net.state_dict()}, strict=False)
    loaded = dict(net.named_parameters())
    assert all(torch.equal(loaded[n], p) for n, p in params.items() if n in loaded)
    with torch.no_grad():
        logits = net(tokens[:, :-1])
    return float(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))


def _run(cfg, dataset: Path) -> tuple[Trainer, list[dict[str, Any]]]:
    trainer = Trainer(cfg, dataset_dir=dataset)
    records = trainer.fit()
    finish_run(trainer, records, wall_s=1.0)
    return trainer, records


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The ranks' intra-op threads (1): tiny fp64 matmuls on a loaded 2-core machine spend more CPU
    spinning in a second thread than computing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads())
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dense(default_dataset, tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("val")
    ck = f"checkpoint.dir={json.dumps(str(root / 'ck'))}"
    trainer, records = _run(_cfg(root / "run", "log.tensorboard=true", ck, "checkpoint.every=2"), default_dataset)
    params = trainer.runner.full_parameters()
    trainer.close()
    resumed, again = _run(_cfg(root / "resumed", "log.tensorboard=false", ck, "checkpoint.resume_from='2'"),
                          default_dataset)
    resumed.close()
    return {"records": records, "params": params, "run": root / "run", "resumed": again}


def test_validation_loss_is_the_mean_cross_entropy_over_the_held_out_tokens(dense, default_dataset):
    val = dense["records"][-1]["val"]
    expected = _independent_val_loss(default_dataset, "debug", dense["params"])
    assert val["loss"] == pytest.approx(expected, rel=EXACT_RTOL)
    assert val["perplexity"] == pytest.approx(math.exp(expected), rel=1e-9)
    assert val["tokens"] == BATCHES * GLOBAL * SEQ and val["batches"] == BATCHES


def test_validation_is_reported_everywhere(dense):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = dense["run"]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val" in r] == [2, 4]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("val/loss")
    assert [e.step for e in scalars] == [2, 4]
    assert [e.value for e in scalars] == pytest.approx([r["val"]["loss"] for r in records if "val" in r], rel=1e-6)
    assert [e.step for e in events.Scalars("val/perplexity")] == [2, 4]
    summary = json.loads((run / "summary.json").read_text())["validation"]
    assert summary["final"] == records[-1]["val"]["loss"] and summary["final_step"] == 4
    assert summary["evaluations"] == 2 and summary["min"] == min(r["val"]["loss"] for r in records if "val" in r)
    report = json.loads((run / "report.json").read_text())["measured"]
    assert report["final_val_loss"] == records[-1]["val"]["loss"]
    assert "final validation loss" in (run / "report.md").read_text() and (run / "report.png").is_file()


def test_console_says_each_evaluation_and_the_summary_the_last(default_dataset, tmp_path, capsys):
    trainer, records = _run(_cfg(tmp_path, "train.steps=2", "log.tensorboard=false", "eval.batches=1"),
                            default_dataset)
    trainer.close()
    out = capsys.readouterr().out
    loss = records[-1]["val"]["loss"]
    assert f"pentatron: validation at step 2: loss {loss:.4f}, perplexity {math.exp(loss):.2f} " \
           f"(1 batch, {GLOBAL * SEQ} tokens" in out
    assert f"validation   loss final {loss:.4f}" in out


def test_a_resume_evaluates_the_same_batches(dense):
    first, again = dense["records"], dense["resumed"]
    assert [r["step"] for r in again] == [3, 4]
    assert [r["loss"] for r in again] == [r["loss"] for r in first[2:]]
    assert again[-1]["val"]["loss"] == first[-1]["val"]["loss"]


def test_moe_validation_loss_leaves_the_balancing_losses_out(default_dataset, tmp_path):
    trainer, records = _run(_cfg(tmp_path, "train.steps=2", "log.tensorboard=false", "model.name='debug-moe'"),
                            default_dataset)
    params = trainer.runner.full_parameters()
    trainer.close()
    assert records[-1]["moe"], "the MoE statistics of training are reported"
    expected = _independent_val_loss(default_dataset, "debug-moe", params)
    assert records[-1]["val"]["loss"] == pytest.approx(expected, rel=EXACT_RTOL)
