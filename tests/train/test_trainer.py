import json
import math

import pytest
import torch

from pentatron.config import load_config
from pentatron.train.trainer import Trainer

REQUIRED = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_mem_bytes", "comm_bytes"}


def _cfg(tmp_path, *overrides):
    base = ["train.seq_len=64", "train.micro_batch=4", "train.global_batch=8", "train.warmup=2",
            "train.peak_tflops=1.0", f"log.dir={json.dumps(str(tmp_path / 'log'))}", "log.progress=false",
            "log.tensorboard=false"]
    return load_config(None, base + list(overrides), world_size=1)


def _fit(tmp_path, dataset, *overrides):
    return Trainer(_cfg(tmp_path, *overrides), dataset_dir=dataset).fit()


def test_loss_falls_from_ln_vocab_and_metrics_are_logged(tmp_path, default_dataset):
    records = _fit(tmp_path, default_dataset, "train.steps=40", "train.lr=3e-3", "log.tensorboard=true")
    first, last = records[0]["loss"], records[-1]["loss"]
    assert first == pytest.approx(math.log(4096), abs=0.3)
    assert last < first - 2.0, [round(r["loss"], 3) for r in records]
    lines = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 40 and set(lines[0]) >= REQUIRED
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["peak_mem_bytes"] > 0 for r in lines)
    # Peaks since training began; CPU has no reserved figure; step 1 also carries the set-up's peak.
    assert all(r["peak_mem_reserved_bytes"] is None for r in lines)
    assert lines[0]["setup_peak_mem_bytes"] > 0 and all("setup_peak_mem_bytes" not in r for r in lines[1:])
    assert any((tmp_path / "log" / "tensorboard").iterdir())


def test_a_step_faster_than_the_stated_peak_gives_mfu_1_not_more(tmp_path, default_dataset, capsys):
    """train.peak_tflops far below what the CPU does: the first step proves the peak low and becomes it
    (MFU exactly 1, a warning says so), later steps are measured against the fastest step so far."""
    trainer = Trainer(_cfg(tmp_path, "train.steps=3", "train.peak_tflops=1e-9"), dataset_dir=default_dataset)
    records = trainer.fit()
    assert records[0]["mfu"] == 1.0 and all(0 < r["mfu"] <= 1 for r in records), [r["mfu"] for r in records]
    assert trainer.peak_flops > 1e3 and trainer.peak_source.startswith("raised to step")
    assert "above the peak 1e-09 TFLOP/s (train.peak_tflops)" in capsys.readouterr().err


def test_gradient_accumulation_equals_one_big_micro_batch(tmp_path, default_dataset):
    accum = _fit(tmp_path / "a", default_dataset, "train.steps=3", "train.micro_batch=2")
    whole = _fit(tmp_path / "b", default_dataset, "train.steps=3", "train.micro_batch=8")
    for a, b in zip(accum, whole):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_modes_train_identically(tmp_path, default_dataset, mode):
    ref = _fit(tmp_path / "ref", default_dataset, "train.steps=3")
    got = _fit(tmp_path / mode, default_dataset, "train.steps=3", f"train.recompute='{mode}'")
    for a, b in zip(ref, got):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_bf16_mixed_precision_runs_on_cpu(tmp_path, default_dataset):
    records = _fit(tmp_path, default_dataset, "train.steps=4", "train.precision='bf16'")
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]


def test_checkpoint_resume_is_exact(tmp_path, default_dataset):
    common = ("train.schedule='constant'", "train.warmup=0")
    ckpt = f"checkpoint.dir={json.dumps(str(tmp_path / 'ckpt'))}"
    straight = _fit(tmp_path / "s", default_dataset, "train.steps=6", *common)
    first = _fit(tmp_path / "r", default_dataset, "train.steps=3", ckpt, *common)
    resumed = _fit(tmp_path / "r", default_dataset, "train.steps=6", ckpt, *common)
    assert [r["step"] for r in first] == [1, 2, 3] and [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(straight, first + resumed):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a["step"], a["loss"], b["loss"])


def test_crash_during_save_keeps_last_good_checkpoint(tmp_path, default_dataset, monkeypatch):
    import torch.distributed.checkpoint as dcp  # checkpoint/store.py imports it where it saves

    ckpt = f"checkpoint.dir={json.dumps(str(tmp_path / 'ckpt'))}"
    _fit(tmp_path, default_dataset, "train.steps=2", ckpt, "checkpoint.every=1")
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_00000002"

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", crash)
    from pentatron.checkpoint.errors import CheckpointWriteError

    with pytest.raises(CheckpointWriteError, match="disk full"):
        _fit(tmp_path, default_dataset, "train.steps=4", ckpt, "checkpoint.every=1")
    monkeypatch.undo()
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_00000002"
    trainer = Trainer(_cfg(tmp_path, "train.steps=4", ckpt), dataset_dir=default_dataset)
    assert trainer.step == 2  # resumes from the last complete checkpoint
    assert torch.isfinite(next(trainer.model.parameters())).all()
