"""The non-finite guard on real process groups: a NaN gradient (finite loss, NaN global norm — the
issue's lr=1e6 case) injected on one rank at step 2 is skipped on every rank with parameters, fp32
masters and AdamW moments and step counters bitwise unchanged (dp2 ZeRO-1, dp2 ZeRO-3, pp2 with the
tied embedding); `stop` exits 3 keeping the last clean checkpoint; a non-finite state is never saved."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pentatron.cli import main
from pentatron.config import load_config
from tests.multiprocess import run_ranks

CASES = {"dp2 zero1": ["parallel.dp=2", "parallel.zero=1"], "dp2 zero3": ["parallel.dp=2", "parallel.zero=3"],
         "pp2": ["parallel.pp=2"]}


def _config(world: int, root: Path, extra: list[str], steps: int = 3):
    return load_config(None, [f"train.steps={steps}", "train.seq_len=32", "train.micro_batch=2",
                              "train.global_batch=8", "train.warmup=1", "train.peak_tflops=1.0",
                              "train.nonfinite='skip'", "parallel.bucket_mb=1.0", "log.progress=false",
                              "log.tensorboard=false", f"log.dir={json.dumps(str(root))}", *extra], world_size=world)


def _snapshot(trainer) -> dict[str, np.ndarray]:
    return {f"{part}/{k}": t.detach().clone().numpy() for part, ts in trainer.state_dict().items()
            for k, t in ts.items()}


def _rank_fn(rank: int, world: int, dataset: str, root: str) -> dict[str, Any]:
    from pentatron.train.trainer import Trainer

    out = {}
    for label, extra in CASES.items():
        trainer = Trainer(_config(world, Path(root) / label.replace(" ", "_"), extra), dataset_dir=Path(dataset))
        clip = trainer.runner.clip_grads

        def poisoned_clip(max_norm: float, trainer=trainer, clip=clip) -> torch.Tensor:
            if trainer.step == 1 and trainer.rank == 0:  # during step 2, on one rank only
                trainer.engine.owned_grads()[0].view(-1)[0] = float("nan")
            return clip(max_norm)

        trainer.runner.clip_grads = poisoned_clip
        records, states = [], []
        for _ in range(3):
            records.append(trainer.train_step())
            states.append(_snapshot(trainer))
        trainer.engine.close()
        unchanged = all(np.array_equal(states[0][k], states[1][k]) for k in states[0])
        changed_after = any(not np.array_equal(states[1][k], states[2][k]) for k in states[0])
        steps = [float(v) for k, v in states[1].items() if k.endswith(".step")]
        out[label] = {"skipped": [r["skipped_steps"] for r in records], "flag": ["nonfinite" in r for r in records],
                      "unchanged": unchanged, "changed_after": changed_after, "adam_steps": steps,
                      "loss3": records[2]["loss"]}
    return out


@pytest.fixture(scope="module")
def results(default_dataset, tmp_path_factory):
    return run_ranks(_rank_fn, 2, args=(str(default_dataset), str(tmp_path_factory.mktemp("nonfinite"))))


@pytest.mark.parametrize("label", list(CASES))
def test_skip_leaves_parameters_and_optimizer_state_bitwise_unchanged(results, label):
    for r in results:
        got = r[label]
        assert got["skipped"] == [0, 1, 1] and got["flag"] == [False, True, False]
        assert got["unchanged"], f"{label}: the skipped step changed the state"
        assert got["adam_steps"] and set(got["adam_steps"]) == {1.0}  # AdamW's step counters not advanced
        assert got["changed_after"] and np.isfinite(got["loss3"])  # training goes on


CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "debug.toml")


def test_stop_exits_3_and_the_last_checkpoint_stays_clean(tmp_path, default_dataset, capsys):
    """The issue's reproduction: lr=1e6 gives a NaN gradient norm within a few steps."""
    ck = tmp_path / "ck"
    code = main(["train", CONFIG, f"--set=data.path={json.dumps(str(default_dataset))}",
                 f"--set=log.dir={json.dumps(str(tmp_path / 'runs'))}", "--set=log.progress=false",
                 "--set=log.tensorboard=false", "--set=train.lr=1e6", "--set=train.steps=8", "--set=train.warmup=0",
                 "--set=checkpoint.every=1", "--set=checkpoint.keep=1", f"--set=checkpoint.dir={json.dumps(str(ck))}"])
    err = capsys.readouterr().err
    assert code == 3, err[-2000:]
    assert "non-finite" in err and "train.nonfinite='skip'" in err and "Traceback" not in err
    latest = ck / (ck / "latest").read_text()
    step = json.loads((latest / "meta.json").read_text())["step"]
    (run,) = [p for p in (tmp_path / "runs").iterdir() if not p.is_symlink()]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert "nonfinite" in records[-1] and records[-1]["step"] == step + 1  # the step after the last save
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(latest, tmp_path / "flat.pt")
    flat = torch.load(tmp_path / "flat.pt", weights_only=False)
    tensors = [t for part in flat.values() for t in part.values()]
    assert tensors and all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())


def test_a_nonfinite_state_is_never_saved(tmp_path, default_dataset):
    from pentatron.train.nonfinite import NonFiniteStop
    from pentatron.train.trainer import Trainer

    cfg = _config(1, tmp_path / "log", [f"checkpoint.dir={json.dumps(str(tmp_path / 'ck'))}"], steps=1)
    trainer = Trainer(cfg, dataset_dir=default_dataset)
    trainer.train_step()
    with torch.no_grad():
        trainer.params[0].view(-1)[0] = float("inf")
    with pytest.raises(NonFiniteStop, match="not saved"):
        trainer.save_checkpoint()
    assert not list((tmp_path / "ck").glob("step_*"))


def test_a_run_whose_every_step_was_skipped_exits_3_and_saves_nothing(tmp_path, default_dataset, capsys):
    """model.init_std=1e30 under train.nonfinite='skip': every loss is non-finite, every step skipped. It exited 0
    with a normal summary and saved the untrained model."""
    ck = tmp_path / "ck"
    code = main(["train", CONFIG, f"--set=data.path={json.dumps(str(default_dataset))}",
                 f"--set=log.dir={json.dumps(str(tmp_path / 'runs'))}", "--set=log.progress=false",
                 "--set=log.tensorboard=false", "--set=model.init_std=1e30", "--set=train.nonfinite='skip'",
                 "--set=train.steps=2", "--set=train.peak_tflops=1.0", "--set=checkpoint.every=1",
                 f"--set=checkpoint.dir={json.dumps(str(ck))}"])
    out = capsys.readouterr()
    assert code == 3, out.err[-2000:]
    stops = [line for line in out.err.splitlines() if line.startswith("pentatron: stopped")]
    assert len(stops) == 1 and "every one of this job's 2 step(s)" in stops[0] and "nothing was saved" in stops[0]
    assert "Traceback" not in out.err and "summary" not in out.out
    assert not list(ck.glob("step_*")) and not (ck / "latest").exists()


def test_the_other_ranks_leave_only_once_rank_0_has_said_why():
    """`--nproc 2`, train.lr=1e6 exited 3 without the line (and without report.md) one run in three: rank 1 exited
    at once, and torchrun's agent then stopped rank 0 while it wrote the report. Now the other ranks wait on the
    job's store until rank 0 has spoken — bounded by distributed.timeout_s, and not at all once the store is gone."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from pentatron.runner import _leave_after_rank_0
    from tests.launchers import free_port

    port = free_port()
    store0 = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    store1 = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))  # rank 1's client
    rank1 = threading.Thread(target=_leave_after_rank_0, args=(store1, 1, 60.0))
    rank1.start()
    time.sleep(0.5)
    assert rank1.is_alive()  # rank 0 is still writing its report: rank 1 stays
    started = time.monotonic()
    _leave_after_rank_0(store0, 0, 60.0)  # rank 0 has printed the line
    rank1.join(timeout=10)
    assert not rank1.is_alive() and time.monotonic() - started < 10
    start = time.monotonic()
    _leave_after_rank_0(dist.HashStore(), 1, 0.2)  # rank 0 never says it: the wait is bounded
    assert time.monotonic() - start < 5
