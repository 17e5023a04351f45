"""The 1-process trainer: metrics, and its runs equal the plain reference loop (`tests/reference_loop.py`)
whatever the micro-batching, recomputation or a checkpoint resume — in float64 on both sides, to
`EXACT_RTOL` (1e-10) in the losses, gradient norms and final parameters: rounding sits near 1e-15
whatever kernels the CPU picks."""

import json
import math

import pytest
import torch

from pentatron.config import TrainConfig, load_config
from pentatron.train.lr_schedule import lr_at
from pentatron.train.trainer import Trainer
from tests.reference_loop import EXACT_RTOL, FP64, reference_run, relative_error

REQUIRED = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_mem_bytes", "comm_bytes"}


def _cfg(tmp_path, *overrides):
    base = ["train.seq_len=64", "train.micro_batch=4", "train.global_batch=8", "train.warmup=2",
            "train.peak_tflops=1.0", f"log.dir={json.dumps(str(tmp_path / 'log'))}", "log.progress=false",
            "log.tensorboard=false"]
    return load_config(None, base + list(overrides), world_size=1)


def _fit(tmp_path, dataset, *overrides):
    return Trainer(_cfg(tmp_path, *overrides), dataset_dir=dataset).fit()


def _fit_fp64(tmp_path, dataset, *overrides):
    """A float64 run: its records and final parameters (the tied head under its embedding's name)."""
    trainer = Trainer(_cfg(tmp_path, FP64, *overrides), dataset_dir=dataset)
    records = trainer.fit()
    params = {"embed.weight" if n == "lm_head.weight" else n: t.numpy()
              for n, t in trainer.runner.full_parameters().items()}
    return records, params


def _reference(dataset, steps, **kwargs):
    """`_cfg`'s run (seq 64, global batch 8, TrainConfig's optimizer defaults) in the plain float64 loop."""
    d = TrainConfig()
    kwargs.setdefault("min_ratio", d.min_lr_ratio)
    return reference_run(dataset, steps=steps, seq_len=64, global_batch=8, lr=d.lr, eps=d.eps,
                         weight_decay=d.weight_decay, clip=d.clip, dtype=torch.float64, **kwargs)


def _assert_equals_reference(records, params, ref, what):
    assert len(records) == len(ref["losses"]), what
    for r, loss, norm in zip(records, ref["losses"], ref["norms"], strict=True):
        assert r["loss"] == pytest.approx(loss, rel=EXACT_RTOL), (what, r["step"])
        assert r["grad_norm"] == pytest.approx(norm, rel=EXACT_RTOL), (what, r["step"])
    assert params.keys() == ref["params"].keys(), what
    for name, t in params.items():
        err = relative_error(t, ref["params"][name])
        assert err <= EXACT_RTOL, f"{what}: {name} off by {err:.2e}"


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
    # the reference computes the global batch of 8 as one batch
    ref = _reference(default_dataset, 3, warmup=2)
    for micro in (2, 8):
        _assert_equals_reference(*_fit_fp64(tmp_path / str(micro), default_dataset, "train.steps=3",
                                            f"train.micro_batch={micro}"), ref, f"micro-batch {micro}")


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_modes_train_identically(tmp_path, default_dataset, mode):
    ref = _reference(default_dataset, 3, warmup=2)  # the same run as above: computed once per session
    _assert_equals_reference(*_fit_fp64(tmp_path, default_dataset, "train.steps=3", f"train.recompute='{mode}'"),
                             ref, mode)


def test_bf16_mixed_precision_runs_on_cpu(tmp_path, default_dataset):
    records = _fit(tmp_path, default_dataset, "train.steps=4", "train.precision='bf16'")
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]


def test_checkpoint_resume_is_exact(tmp_path, default_dataset):
    common = ("train.schedule='constant'", "train.warmup=0")
    ckpt = f"checkpoint.dir={json.dumps(str(tmp_path / 'ckpt'))}"
    # 6 straight steps of the plain loop at a constant lr (its cosine with min_ratio 1, no warmup)
    straight = _reference(default_dataset, 6, warmup=0, min_ratio=1.0)
    first, _ = _fit_fp64(tmp_path / "r", default_dataset, "train.steps=3", ckpt, *common)
    resumed, params = _fit_fp64(tmp_path / "r", default_dataset, "train.steps=6", ckpt, *common)
    assert [r["step"] for r in first] == [1, 2, 3] and [r["step"] for r in resumed] == [4, 5, 6]
    _assert_equals_reference(first + resumed, params, straight, "resumed")


def test_a_longer_resume_keeps_the_lr_continuous_and_says_so(tmp_path, default_dataset, capsys):
    """Issue 52: 150 steps resumed with train.steps=300 jumped from 2.00e-04 to 5.21e-04 (the cosine was
    recomputed over the new length). It says so now, and train.resume_schedule = "continue" gives the
    resumed step the LR the saved schedule gave it."""
    ckpt = f"checkpoint.dir={json.dumps(str(tmp_path / 'ckpt'))}"
    first = _fit(tmp_path, default_dataset, "train.steps=3", ckpt)
    saved_next = json.loads((tmp_path / "ckpt" / "step_00000003" / "meta.json").read_text())["schedule"]["next_lr"]
    resumed = _fit(tmp_path, default_dataset, "train.steps=6", ckpt, "train.resume_schedule='continue'")
    assert len(first) == 3 and saved_next == pytest.approx(lr_at(3, _cfg(tmp_path, "train.steps=3").train))
    assert resumed[0]["step"] == 4 and resumed[0]["lr"] == pytest.approx(saved_next, rel=1e-12)
    # each record names its layout and its start (the report compares a layout with its own steps)
    assert resumed[0]["start_step"] == 3 and resumed[0]["layout"] == first[0]["layout"] != ""
    assert lr_at(3, _cfg(tmp_path, "train.steps=6").train) > 2 * saved_next  # what the recomputed cosine gave
    assert "resume at step 3 changes train.steps 3 → 6; train.resume_schedule='continue'" in capsys.readouterr().out


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
