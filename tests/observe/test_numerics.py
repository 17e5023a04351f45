"""Numerics in a real training run: per-layer norms in metrics.jsonl, a NaN injected into a block's
input shows up there (and stops the run), and the loss-spike detector."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pentatron.config import load_config
from pentatron.observe.numerics import SpikeDetector, layer_of
from pentatron.train.trainer import Trainer


def _cfg(tmp_path: Path, steps: int, every: int):
    return load_config(None, [f"train.steps={steps}", "train.seq_len=32", "train.micro_batch=2",
                              "train.global_batch=4", "train.device='cpu'", "train.warmup=1",
                              f"log.dir='{tmp_path}/run'", "log.tensorboard=false", "log.progress=false",
                              f"log.numerics_every={every}", "data.default_corpus_bytes=200000",
                              f"data.cache_dir='{tmp_path}/data'"])


def _records(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_layer_names():
    assert layer_of("layers.3.attn.q_proj.weight") == "layers.3"
    assert layer_of("stages.0.layers.12.mlp.up.weight") == "layers.12"
    assert layer_of("embed.weight") == "embed"


def test_numerics_in_metrics_and_nan_injection(tmp_path: Path):
    trainer = Trainer(_cfg(tmp_path, steps=4, every=3))
    blocks = trainer.model.layers
    poison = {"on": False}

    def inject(_module, args):  # a NaN enters block 2's input at step 4
        if poison["on"]:
            return (args[0] * float("nan"), *args[1:])
        return None

    blocks[2].register_forward_pre_hook(inject)
    original = trainer.train_step

    def step():
        poison["on"] = trainer.step == 3
        return original()

    trainer.train_step = step
    with pytest.raises(FloatingPointError, match="step 4"):
        trainer.fit()
    recs = _records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert "numerics" in recs[0] and "numerics" not in recs[1]  # step 1, every 3rd, and the last
    n1 = recs[0]["numerics"]
    layers = [f"layers.{i}" for i in range(len(blocks))]
    assert set(layers) <= set(n1["grad_norm"]) and "embed" in n1["grad_norm"]
    assert all(n1["grad_norm"][k] > 0 and n1["param_norm"][k] > 0 for k in layers)
    assert all(0 < n1["update_ratio"][k] < 1 for k in layers)
    assert all(0 < n1["act_max"][k] < math.inf for k in layers)
    assert n1["nonfinite_acts"] == [] and n1["nonfinite_grads"] == []
    assert "numerics" in recs[2] and recs[2]["numerics"]["nonfinite_acts"] == []
    n3 = recs[3]["numerics"]
    assert n3["nonfinite_acts"][0] == "layers.2" and n3["act_max"]["layers.1"] != "nan"
    assert n3["act_max"]["layers.2"] == "nan" and n3["grad_norm"]["layers.0"] == "nan"
    assert "layers.0" in n3["nonfinite_grads"]
    assert recs[3]["loss_spike"]["z"] == "inf" and len(recs[3]["loss_spike"]["samples"]) == 4


def test_spike_detector():
    det = SpikeDetector(window=20, z=4.0, min_history=5)
    losses = [5.0 - 0.01 * i + 0.005 * (-1) ** i for i in range(30)]
    assert all(det.update(i, x, [i]) is None for i, x in enumerate(losses))
    spike = det.update(30, 9.0, [7, 8])
    assert spike is not None and spike.z > 4 and spike.samples == [7, 8] and spike.step == 30
    assert det.update(31, losses[-1], [9]) is None  # the spike did not enter the window
