"""A run lets go of its process groups when it ends, finished or failed, so that destroying them joins
their gloo worker threads while the interpreter is whole. A group kept alive past that (the run's
objects outlive it: autograd hooks reference them from C++) leaves its workers running into interpreter
exit, where one still dropping a finished collective's tensor needs the GIL and aborts the rank
(SIGABRT: on CI a damaged-checkpoint resume exited 1, "rank 1 killed by a signal", instead of 2)."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch.distributed as dist

# Imported before the ranks' process group starts, as `pentatron train` does (see `init_distributed`).
from pentatron.checkpoint.errors import CheckpointError
from pentatron.config import load_config
from pentatron.train.trainer import Trainer
from tests.multiprocess import run_ranks


def _config(world: int, root: Path, *extra: str):
    return load_config(None, ["train.steps=2", "train.seq_len=32", "train.micro_batch=2", "train.global_batch=8",
                              "train.warmup=1", "train.peak_tflops=1.0", "parallel.dp=2", "log.progress=false",
                              "log.tensorboard=false", f"log.dir={json.dumps(str(root / 'runs'))}", *extra],
                       world_size=world)


def _groups_left() -> int:
    """Destroy the process groups as a rank leaves (`destroy_process_group`): how many are still alive."""
    refs = [weakref.ref(g) for g in dist.distributed_c10d._world.pg_map]
    dist.destroy_process_group()
    return sum(r() is not None for r in refs)


def _rank_fn(rank: int, world: int, dataset: str, root: str, fail: bool) -> dict[str, str | int]:
    if not fail:  # a step trained, then closed as `pentatron train` closes it
        trainer = Trainer(_config(world, Path(root)), dataset_dir=Path(dataset))
        trainer.train_step()
        trainer.close()
        return {"error": "", "left": _groups_left()}
    # Every rank raises at resume, inside Trainer(): `latest` names a step that is not there.
    ck = Path(root) / "ck"
    if rank == 0:
        ck.mkdir(parents=True)
        (ck / "latest").write_text("step_00000007")
    dist.barrier()
    try:
        Trainer(_config(world, Path(root), f"checkpoint.dir={json.dumps(str(ck))}"), dataset_dir=Path(dataset))
    except CheckpointError as e:
        return {"error": str(e), "left": _groups_left()}
    return {"error": "none raised", "left": _groups_left()}


@pytest.mark.parametrize("fail", [False, True], ids=["finished", "failed at resume"])
def test_no_process_group_outlives_the_run(default_dataset, tmp_path, fail):
    for out in run_ranks(_rank_fn, 2, args=(str(default_dataset), str(tmp_path), fail)):
        assert out["left"] == 0, out
        assert ("step_00000007: missing" in out["error"]) == fail, out
