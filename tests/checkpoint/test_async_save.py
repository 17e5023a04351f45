"""Asynchronous checkpoints: the same bytes as a synchronous save, exact resume on 2 ranks (ZeRO-1, the
writes coordinated on their own gloo group), a write that fails in the background is reported and never
becomes `latest`, and SIGKILLs while saves are in flight never leave a `latest` that fails verification."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pentatron.checkpoint import manifest
from pentatron.config import load_config
from tests.launchers import ROOT, _env
from tests.multiprocess import run_ranks


def _config(root: Path, steps: int, *extra: str, world: int = 1):
    return load_config(None, [f"train.steps={steps}", "train.seq_len=32", "train.micro_batch=2",
                              "train.global_batch=8", "train.warmup=1", "train.peak_tflops=1.0",
                              "parallel.bucket_mb=0.05", "log.progress=false", "log.tensorboard=false",
                              f"log.dir={json.dumps(str(root / 'log'))}", "checkpoint.every=1", *extra],
                       world_size=world)


def _tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    flat = torch.load(out, weights_only=False)
    return {f"{p}/{k}": t for p, ts in flat.items() for k, t in ts.items()}


def test_async_checkpoints_hold_the_same_tensors_as_sync_ones(tmp_path, default_dataset):
    from pentatron.train.trainer import Trainer

    dirs = {}
    for mode in ("sync", "async"):
        ck = tmp_path / mode
        cfg = _config(tmp_path / f"log-{mode}", 3, f"checkpoint.dir={json.dumps(str(ck))}",
                      f"checkpoint.async_save={'true' if mode == 'async' else 'false'}", "checkpoint.keep=3")
        trainer = Trainer(cfg, dataset_dir=default_dataset)
        trainer.fit()
        assert len(trainer.save_blocked_s) == 3
        dirs[mode] = ck
    for step in (1, 2, 3):
        name = f"step_{step:08d}"
        manifest.verify(dirs["async"] / name)
        a, b = _tensors(dirs["sync"] / name), _tensors(dirs["async"] / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert (dirs["async"] / "latest").read_text() == "step_00000003"


class _Unpicklable:
    def __reduce__(self):  # noqa: ANN204
        raise OSError("no space left on device (simulated by an object that cannot be written)")


def test_a_failed_background_write_is_reported_and_never_becomes_latest(tmp_path, default_dataset, capsys):
    from pentatron.train.trainer import Trainer

    ck = tmp_path / "ck"
    trainer = Trainer(_config(tmp_path, 2, f"checkpoint.dir={json.dumps(str(ck))}", "checkpoint.async_save=true"),
                      dataset_dir=default_dataset)
    trainer.train_step()
    trainer.save_checkpoint()
    trainer.async_saver.wait()
    assert (ck / "latest").read_text() == "step_00000001"
    trainer.train_step()
    state = trainer.state_dict()
    state["extra"] = {"unwritable": _Unpicklable()}  # the write fails in the background thread
    trainer.async_saver.save(trainer.step, state, {"step": trainer.step}, None)
    trainer.async_saver.wait()
    err = capsys.readouterr().err
    assert "background save failed" in err and "latest stays step_00000001" in err, err
    assert (ck / "latest").read_text() == "step_00000001" and not list(ck.glob("step_00000002*"))
    assert trainer.async_saver.failed and trainer.async_saver.failed[0].startswith("checkpoint of step 2")


def _rank_fn(rank: int, world: int, dataset: str, root: str) -> dict[str, Any]:
    from pentatron.train.trainer import Trainer

    def run(steps: int, extra: list[str]) -> list[float]:
        trainer = Trainer(_config(Path(root), steps, "parallel.dp=2", "parallel.zero=1", *extra, world=world),
                          dataset_dir=Path(dataset))
        losses = [r["loss"] for r in trainer.fit()]
        trainer.engine.close()
        return losses

    ck = f"checkpoint.dir={json.dumps(root + '/ck')}"
    straight = run(4, [])
    first = run(2, [ck, "checkpoint.async_save=true"])
    resumed = run(4, [ck, "checkpoint.async_save=true"])
    return {"straight": straight, "resumed": first + resumed}


def test_async_resume_on_two_ranks_is_exact(tmp_path, default_dataset):
    for r in run_ranks(_rank_fn, 2, args=(str(default_dataset), str(tmp_path)), timeout=300):
        assert r["resumed"] == r["straight"]


@pytest.mark.parametrize("after_saves", [3])
def test_sigkill_while_async_saves_are_in_flight_leaves_a_verified_latest(tmp_path, default_dataset, after_saves):
    ck, runs = tmp_path / "ck", tmp_path / "runs"
    flags = [str(ROOT / "configs" / "debug.toml"), f"--set=data.path={json.dumps(str(default_dataset))}",
             f"--set=log.dir={json.dumps(str(runs))}", "--set=log.progress=false", "--set=log.tensorboard=false",
             "--set=checkpoint.every=1", "--set=checkpoint.async_save=true", "--set=checkpoint.keep=2",
             f"--set=checkpoint.dir={json.dumps(str(ck))}"]
    proc = subprocess.Popen([sys.executable, "-m", "pentatron.cli", "train", *flags, "--set=train.steps=1000"],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, deadline = 0, time.monotonic() + 240
    while seen < after_saves and time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen += "blocked training" in line
    proc.send_signal(signal.SIGKILL)  # right after starting a save: its write is in flight
    proc.wait()
    assert seen == after_saves
    latest = ck / (ck / "latest").read_text()
    manifest.verify(latest)
    step = json.loads((latest / "meta.json").read_text())["step"]
    done = subprocess.run([sys.executable, "-m", "pentatron.cli", "train", *flags, f"--set=train.steps={step + 1}"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and f"at step {step}" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    # a 1-process async save is intended: DCP's notice about it (from its writer thread) is not shown
    assert "UserWarning" not in done.stderr, done.stderr[-2000:]
    assert not list(ck.glob("*.tmp"))  # the killed job's partial save was removed at start
