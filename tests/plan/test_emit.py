"""`pentatron plan --emit-config`: the planned layout as a training config that `pentatron train`
loads and runs on the right number of ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pentatron.config import ConfigError, load_config
from tests.plan.test_cli import run

# what the user fills in (the emitted placeholders): no dataset or checkpoints named
FILLED = ['data.path=""', 'checkpoint.dir=""']


def _load(path, world):
    return load_config(path, FILLED, world_size=world)


def test_the_emitted_config_of_a_recommendation_trains_on_its_ranks(tmp_path, default_dataset, capsys):
    path = tmp_path / "run.toml"
    rc = run(["plan", "--model", "debug", "--gpus", "2", "--gpu", "h100", "--seq", "64", "--global-batch", "8",
              "--precision", "fp32", "--emit-config", str(path), "--json"])
    assert rc == 0
    best = json.loads(capsys.readouterr().out)["predictions"][0]["layout"]
    cfg = _load(path, 2)  # the trainer's own validation, for 2 processes
    lay = cfg.layout(2)
    want = (best["dp"], best["tp"], best["pp"], best["zero"], best["micro_batch"])
    assert (lay.dp, lay.tp, lay.pp, lay.zero, lay.micro_batch) == want
    cmd = [sys.executable, "-m", "pentatron.cli", "train", str(path), "--nproc", "2",
           "--set", "train.steps=2", "--set", "train.warmup=1",
           "--set", f"data.path={json.dumps(str(default_dataset))}", "--set", 'checkpoint.dir=""',
           "--set", f"log.dir={json.dumps(str(tmp_path / 'log'))}", "--set", "log.progress=false"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "log" / "latest" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_an_untrainable_layout_is_not_emitted(tmp_path, capsys):
    path = tmp_path / "run.toml"
    # the smallest search that recommends an fp16 layout (llama3-8b on 16 GPUs searched 12 s CPU for the same refusal)
    rc = run(["plan", "--model", "debug", "--gpus", "2", "--precision", "fp16", "--emit-config", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and "train.precision must be one of 'auto', 'fp32', 'bf16', 'fp64', got 'fp16'" in err
    assert not path.exists()


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_an_fp8_plan_is_emitted_as_a_config_training_accepts_with_fp8_on(tmp_path, default_dataset, capsys, scaling):
    """--precision fp8 is trained as bf16 weights with train.fp8 = the plan's scaling, compiled (the plan's fused
    kernels on a GPU); the emitted file passes the trainer's config validation and the run's preflight for its 2
    ranks."""
    from pentatron.preflight import preflight_problems

    path = tmp_path / "run.toml"
    assert run(["plan", "--model", "debug", "--gpus", "2", "--gpu", "h100", "--seq", "64", "--global-batch", "8",
                "--precision", "fp8", "--fp8-scaling", scaling, "--emit-config", str(path)]) == 0, \
        capsys.readouterr().err
    cfg = load_config(path, [f"data.path={json.dumps(str(default_dataset))}", 'checkpoint.dir=""',
                             f"log.dir={json.dumps(str(tmp_path / 'log'))}"], world_size=2)
    assert (cfg.train.fp8, cfg.train.precision, cfg.train.compile) == (scaling, "bf16", True)
    assert preflight_problems(cfg, world_size=2, build_default_data=False) == []


def test_either_loss_training_runs_is_emitted_with_its_chunk(tmp_path, capsys):
    """The two losses `pentatron train` runs are ours: the chunked one at any chunk and the one from full logits
    (train.loss_chunk_tokens = 0); another framework's loss is evaluated, never emitted."""
    base = ["plan", "--model", "debug", "--gpus", "2", "--seq", "256", "--global-batch", "8"]
    cases = ((["--cross-entropy", "eager"], 0), (["--recipe-set", "loss_chunk_tokens=128"], 128), ([], 1024))
    for extra, chunk in cases:
        path = tmp_path / f"run{chunk}.toml"
        assert run([*base, *extra, "--emit-config", str(path)]) == 0, capsys.readouterr().err
        assert _load(path, 2).train.loss_chunk_tokens == chunk
    assert run([*base, "--cross-entropy", "fused", "--emit-config", str(tmp_path / "no.toml")]) == 2
    assert "evaluated, not what `pentatron train` runs" in capsys.readouterr().err


def test_an_explicit_split_is_planned_emitted_and_loaded(tmp_path, capsys):
    """--pp-layers pins the split: the search keeps pp x pp_virtual = its length, the prediction and the
    emitted config carry it, and training's validation loads it as parallel.pp_layers."""
    path = tmp_path / "run.toml"
    rc = run(["plan", "--model", "llama3-8b", "--gpus", "16", "--seq", "8192", "--global-batch", "64", "--tp", "4",
              "--pp-layers", "7,9,9,7", "--json", "--top", "3", "--emit-config", str(path)])
    assert rc == 0
    preds = json.loads(capsys.readouterr().out)["predictions"]
    assert preds and all(p["layout"]["pp_layers"] == [7, 9, 9, 7] and p["layout"]["pp"] in (2, 4) for p in preds)
    assert all(p["layout"]["pp"] * p["layout"]["pp_virtual"] == 4 for p in preds)
    assert _load(path, 16).layout(16).pp_layers == (7, 9, 9, 7)
    # an embedding-only and a head-only stage are evaluated but not trainable: nothing is emitted
    empty_ends = tmp_path / "ends.toml"
    rc = run(["plan", "--model", "llama3-8b", "--gpus", "16", "--seq", "8192", "--global-batch", "64", "--tp", "4",
              "--pp", "4", "--pp-layers", "0,16,16,0", "--emit-config", str(empty_ends)])
    out = capsys.readouterr()
    assert rc == 2 and "parallel.pp_layers entries must be integers ≥ 1" in out.out + out.err
    assert not empty_ends.exists()
    rc = run(["plan", "--model", "llama3-8b", "--gpus", "16", "--pp", "4", "--pp-layers", "7,9,9"])
    err = capsys.readouterr().err
    assert rc == 2 and "parallel.pp_layers=[7, 9, 9] sums to 25, but the model has 32 layers" in err


def test_the_emitted_config_is_a_job_to_run(tmp_path, capsys):
    """Issue 52: the emitted config had no data or checkpoint, the default schedule (100 steps) whatever
    the plan's tokens, and `--nproc 64` for 64 GPUs. Now: placeholders the loader refuses until set, the
    schedule from --train-tokens, a checkpoint every predicted hour, and the launch lines per node."""
    path = tmp_path / "run.toml"
    rc = run(["plan", "--model", "debug", "--gpus", "16", "--gpus-per-node", "8", "--seq", "64",
              "--global-batch", "64", "--train-tokens", "1G", "--emit-config", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    text = path.read_text()
    for where in (out, text):
        assert "--nproc 8 --nnodes 2 --node-rank $NODE_RANK --rdzv-endpoint $NODE0:29400" in where
        assert "--nproc 16" not in where and "srun pentatron train" in where and "--nodes=2" in where
    with pytest.raises(ConfigError) as left_unset:
        load_config(path, world_size=16)
    assert [q.split(" is still")[0] for q in left_unset.value.problems] == ["data.path", "checkpoint.dir"]
    assert "`pentatron tokenize`" in left_unset.value.problems[0]
    cfg = _load(path, 16)
    assert cfg.train.steps == -(-10**9 // (64 * 64)) and 1 <= cfg.train.warmup <= min(2000, cfg.train.steps // 100)
    assert 1e-4 <= cfg.train.lr <= 3e-3 and cfg.checkpoint.every >= 1 and "about 1 h" in text
    one_node = tmp_path / "one.toml"
    assert run(["plan", "--model", "debug", "--gpus", "2", "--seq", "64", "--global-batch", "8",
                "--emit-config", str(one_node)]) == 0
    assert f"pentatron train {one_node} --nproc 2" in capsys.readouterr().out
    assert _load(one_node, 2).train.steps == -(-20 * load_config(None).model_config().num_params() // (8 * 64))
