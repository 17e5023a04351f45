"""Retention by run lineage, the fresh-run refusal, stale partial saves and the directory lock.

The store-level cases reproduce the issue's scenarios on a 1-process DCP save: a new run into a
directory holding an older run's later steps, and a rollback; the lock is held by a real second
process (and released by the kernel when that process is SIGKILLed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from pentatron.checkpoint.lineage import prune
from pentatron.checkpoint.store import CheckpointStore
from pentatron.cli import main

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "debug.toml")


def _save(store: CheckpointStore, step: int) -> Path:
    return store.save(step, {"w": torch.full((4,), float(step))}, {"step": step})


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step_*"))


def _latest_is_complete(root: Path) -> bool:
    return (root / (root / "latest").read_text() / "meta.json").is_file()


def test_a_new_run_never_prunes_an_older_runs_checkpoints(tmp_path):
    old = CheckpointStore(tmp_path, keep=2)
    for step in (5, 10, 15, 20):
        _save(old, step)
    assert _names(tmp_path) == ["step_00000015", "step_00000020"]
    new = CheckpointStore(tmp_path, keep=2)  # the case: a fresh run wrote step_5, step_10 and lost them
    for step in (5, 10):
        _save(new, step)
        assert _latest_is_complete(tmp_path)
    assert _names(tmp_path) == ["step_00000005", "step_00000010", "step_00000015", "step_00000020"]
    _save(new, 15)  # step 15 exists (the old run's): the new one is step_15-r1; the new run's step 5 goes
    assert _names(tmp_path) == ["step_00000010", "step_00000015", "step_00000015-r1", "step_00000020"]
    assert (tmp_path / "latest").read_text() == "step_00000015-r1"
    assert json.loads((tmp_path / "step_00000015" / "meta.json").read_text())["run_id"] == old.run_id


def test_a_rollback_branches_off_and_keeps_the_abandoned_checkpoints(tmp_path):
    run = CheckpointStore(tmp_path, keep=3)
    for step in (5, 10, 15):
        _save(run, step)
    (tmp_path / "latest").write_text("step_00000005")  # the user rolls back to step 5 and resumes
    resumed = CheckpointStore(tmp_path, keep=1)
    meta = resumed.load(tmp_path / "step_00000005", {"w": torch.zeros(4)})
    resumed.continue_lineage(tmp_path / "step_00000005", meta)
    assert resumed.run_id != run.run_id and resumed.parent == "step_00000005"
    _save(resumed, 10)
    _save(resumed, 15)
    assert _names(tmp_path) == ["step_00000005", "step_00000010", "step_00000015", "step_00000015-r1"]
    assert (tmp_path / "latest").read_text() == "step_00000015-r1" and _latest_is_complete(tmp_path)


def test_resuming_the_newest_checkpoint_continues_its_lineage(tmp_path):
    run = CheckpointStore(tmp_path, keep=2)
    for step in (1, 2):
        _save(run, step)
    again = CheckpointStore(tmp_path, keep=2)
    latest = again.latest()
    again.continue_lineage(latest, again.load(latest, {"w": torch.zeros(4)}))
    assert again.run_id == run.run_id
    _save(again, 3)
    assert _names(tmp_path) == ["step_00000002", "step_00000003"]


def test_retention_never_removes_what_latest_names(tmp_path):
    run = CheckpointStore(tmp_path, keep=3)
    for step in (1, 2, 3):
        _save(run, step)
    (tmp_path / "latest").write_text("step_00000001")
    prune(tmp_path, run.run_id, keep=1)
    assert _names(tmp_path) == ["step_00000001", "step_00000003"]


def test_stale_partial_saves_are_removed_at_start(tmp_path):
    run = CheckpointStore(tmp_path, keep=2)
    _save(run, 1)
    (tmp_path / "step_00000007.tmp").mkdir()
    (tmp_path / "step_00000007.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "latest.tmp").write_text("step_00000007")
    CheckpointStore(tmp_path).clean_stale()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]


def _flags(tmp: Path, dataset: Path, ck: Path, *extra: str) -> list[str]:
    return [f"--set=data.path={json.dumps(str(dataset))}", f"--set=log.dir={json.dumps(str(tmp / 'runs'))}",
            "--set=log.progress=false", "--set=log.tensorboard=false", "--set=train.steps=2",
            f"--set=checkpoint.dir={json.dumps(str(ck))}", *extra]


def test_a_fresh_run_into_a_directory_with_checkpoints_is_refused_unless_forced(tmp_path, default_dataset, capsys):
    ck = tmp_path / "ck"
    assert main(["train", CONFIG, *_flags(tmp_path, default_dataset, ck)]) == 0
    first = _names(ck)
    capsys.readouterr()
    assert main(["train", CONFIG, *_flags(tmp_path, default_dataset, ck, "--set=checkpoint.resume=false")]) == 2
    err = capsys.readouterr().err
    assert "already holds checkpoints" in err and "--force-new" in err and "checkpoint.resume=true" in err, err
    assert "Traceback" not in err
    assert main(["train", CONFIG, *_flags(tmp_path, default_dataset, ck), "--force-new"]) == 0
    assert set(first) <= set(_names(ck)) and _latest_is_complete(ck)  # the first run's checkpoint is kept


_HOLD = """
import sys, time
from pathlib import Path
from pentatron.checkpoint.lock import CheckpointDirLock
lock = CheckpointDirLock(Path(sys.argv[1])); lock.acquire(); print("locked", flush=True); time.sleep(120)
"""


def test_a_locked_directory_is_refused_naming_the_holder_until_it_dies(tmp_path, default_dataset, capsys):
    ck = tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(ck)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["train", CONFIG, *_flags(tmp_path, default_dataset, ck)]) == 2
        err = capsys.readouterr().err
        assert "in use by another job" in err and f"pid {holder.pid}" in err, err
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the kernel released the dead holder's lock
        if main(["train", CONFIG, *_flags(tmp_path, default_dataset, ck)]) == 0:
            break
    else:
        raise AssertionError("the lock of a SIGKILLed job was not released")


def test_a_lock_that_is_a_directory_is_named(tmp_path):
    """`.lock` a directory: the lock file is named, with what to do (was "cannot be locked (Is a directory)")."""
    from pentatron.config import load_config
    from pentatron.runner import hold_checkpoint_lock

    (tmp_path / "ck" / ".lock").mkdir(parents=True)
    cfg = load_config(None, [f"checkpoint.dir={json.dumps(str(tmp_path / 'ck'))}"])
    problems: list[str] = []
    assert hold_checkpoint_lock(cfg, problems) is None
    assert problems == [f"checkpoint.dir {str(tmp_path / 'ck')!r} cannot be locked: {tmp_path / 'ck' / '.lock'} is a "
                        "directory, not its lock file; remove it"]
