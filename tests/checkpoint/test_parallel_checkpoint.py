"""Checkpoints of tensor- and pipeline-parallel runs: 3 steps + save, then a fresh Trainer resumes to step 6
in the middle of the cosine decay, and its losses, final parameters and optimizer state (moments, step
counts, fp32 masters) are bitwise equal to an uninterrupted 6-step run in the same layout — for tp=2 (kv
heads replicated over the two tp ranks), pp=2 (1F1B, tied embedding held by both stages), an MoE model with
its experts sharded over ep=2 (and its aux-free selection biases), tp=2 × dp=2 with ZeRO-1 and pp=2 × dp=2
with ZeRO-3. Another layout re-shards it; a checkpoint written before the pieces were described cannot be
re-sharded and is a clear error naming both layouts.

One `run_ranks` call per world size runs its cases in sequence (process start-up dominates on CI).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from pentatron.checkpoint.errors import CheckpointError
from pentatron.config import Config, load_config
from tests.multiprocess import run_ranks

SEQ, MICRO, GLOBAL = 32, 2, 8

# (label, overrides, overrides of a different layout that must refuse the checkpoint)
CASES: dict[int, list[tuple[str, list[str], list[str]]]] = {
    2: [("tp=2 replicated kv", ["parallel.tp=2", "model.n_kv_heads=1"], ["parallel.dp=2", "model.n_kv_heads=1"]),
        ("pp=2 1f1b", ["parallel.pp=2"], ["parallel.tp=2"]),
        # experts sharded over ep=2 and the aux-free selection biases (saved beside the parameters)
        ("ep=2 moe aux-free", ["parallel.dp=2", "parallel.ep=2", "model.name='debug-moe-auxfree'"],
         ["parallel.dp=2", "model.name='debug-moe-auxfree'"])],
    4: [("tp=2 dp=2 zero=1", ["parallel.tp=2", "parallel.dp=2", "parallel.zero=1"],
         ["parallel.dp=4", "parallel.zero=1"]),
        ("pp=2 dp=2 zero=3", ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3"],
         ["parallel.dp=4", "parallel.zero=3"])],
}


def _config(world: int, root: Path, label: str, steps: int, extra: list[str], ckpt: bool) -> Config:
    tag = "".join(c if c.isalnum() else "_" for c in label)
    over = [f"train.steps={steps}", f"train.seq_len={SEQ}", f"train.micro_batch={MICRO}",
            f"train.global_batch={GLOBAL}", "train.schedule='cosine'", "train.warmup=2",
            "train.peak_tflops=1.0", "parallel.bucket_mb=1.0", "log.progress=false", "log.tensorboard=false",
            f"log.dir={json.dumps(str(root / 'log' / tag))}", *extra]
    if ckpt:
        over.append(f"checkpoint.dir={json.dumps(str(root / 'ckpt' / tag))}")
    return load_config(None, over, world_size=world)


def _make_legacy(root: Path, label: str) -> None:
    """Turn the latest checkpoint into one written before manifests and piece descriptions existed."""
    ck = root / "ckpt" / "".join(c if c.isalnum() else "_" for c in label)
    latest = ck / (ck / "latest").read_text()
    shutil.rmtree(latest / "pieces")
    (latest / "manifest.json").unlink()
    meta = json.loads((latest / "meta.json").read_text())
    meta.pop("manifest")
    (latest / "meta.json").write_text(json.dumps(meta))


def _rank_fn(rank: int, world: int, dataset: str, root: str) -> dict[str, Any]:
    from pentatron.train.trainer import Trainer

    out: dict[str, Any] = {}
    for label, extra, other in CASES[world]:
        def fit(steps: int, ckpt: bool, label: str = label, over: list[str] = extra
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
            trainer = Trainer(_config(world, Path(root), label, steps, over, ckpt), dataset_dir=Path(dataset))
            records = trainer.fit()
            state = {f"{part}/{k}": t.detach().clone().numpy() for part, tensors in trainer.state_dict().items()
                     for k, t in tensors.items()}
            trainer.engine.close()
            return records, state

        straight, straight_state = fit(6, False)
        first, _ = fit(3, True)
        resumed, resumed_state = fit(6, True)
        # Another layout re-shards the checkpoint (tests/checkpoint/test_reshard.py checks the numbers)...
        try:
            Trainer(_config(world, Path(root), label, 6, other, True), dataset_dir=Path(dataset)).engine.close()
            reshard_error = None
        except CheckpointError as e:
            reshard_error = str(e)
        # ...unless it was written before pieces were described: then it is refused, naming both layouts.
        dist.barrier()  # every rank is done reading the checkpoint (a refusal returns without a collective)
        if rank == 0:
            _make_legacy(Path(root), label)
        dist.barrier()
        try:
            Trainer(_config(world, Path(root), label, 6, other, True), dataset_dir=Path(dataset))
            error = None
        except CheckpointError as e:
            error = str(e)
        out[label] = {"straight": [r["loss"] for r in straight], "resumed": [r["loss"] for r in first + resumed],
                      "steps": [r["step"] for r in first + resumed], "error": error,
                      "reshard_error": reshard_error,
                      "state": (straight_state, resumed_state)}
    return out


@pytest.fixture(scope="module")
def results(default_dataset, tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for world in CASES:
        root = tmp_path_factory.mktemp(f"ckpt-world{world}")
        ranks = run_ranks(_rank_fn, world, args=(str(default_dataset), str(root)))
        for label in ranks[0]:
            out[label] = [r[label] for r in ranks]
    return out


LABELS = [label for cases in CASES.values() for label, _, _ in cases]


@pytest.mark.parametrize("label", LABELS)
def test_resume_in_the_same_layout_is_exact(results, label):
    for r in results[label]:  # every rank logs the same (dp-averaged, pp-broadcast) loss
        assert r["steps"] == [1, 2, 3, 4, 5, 6]
        assert r["resumed"] == r["straight"]
        straight, resumed = r["state"]
        assert straight.keys() == resumed.keys() and any(k.endswith("exp_avg_sq") for k in straight)
        for key, value in straight.items():
            np.testing.assert_array_equal(resumed[key], value, err_msg=f"{label}: {key}")


@pytest.mark.parametrize("label", LABELS)
def test_another_layout_re_shards(results, label):
    for r in results[label]:
        assert r["reshard_error"] is None, r["reshard_error"]


@pytest.mark.parametrize("label", LABELS)
def test_an_old_checkpoint_in_another_layout_is_a_clear_error(results, label):
    for r in results[label]:  # every rank refuses (none is left waiting in a collective)
        msg = r["error"]
        assert msg is not None and "layout" in msg and "cannot be re-sharded" in msg, msg
        assert "'tp':" in msg and "'pp':" in msg and msg.count("'zero':") == 2, msg
