"""`pentatron plan --emit-config`: the planned layout as a training config that `pentatron train`
loads and runs on the right number of ranks."""

from __future__ import annotations

import json
import subprocess
import sys

from pentatron.config import load_config
from tests.plan.test_cli import run


def test_the_emitted_config_of_a_recommendation_trains_on_its_ranks(tmp_path, default_dataset, capsys):
    path = tmp_path / "run.toml"
    rc = run(["plan", "--model", "debug", "--gpus", "2", "--gpu", "h100", "--seq", "64", "--global-batch", "8",
              "--precision", "fp32", "--emit-config", str(path), "--json"])
    assert rc == 0
    best = json.loads(capsys.readouterr().out)["predictions"][0]["layout"]
    cfg = load_config(path, world_size=2)  # the trainer's own validation, for 2 processes
    lay = cfg.layout(2)
    want = (best["dp"], best["tp"], best["pp"], best["zero"], best["micro_batch"])
    assert (lay.dp, lay.tp, lay.pp, lay.zero, lay.micro_batch) == want
    cmd = [sys.executable, "-m", "pentatron.cli", "train", str(path), "--nproc", "2",
           "--set", "train.steps=2", "--set", "train.warmup=1",
           "--set", f"data.path={json.dumps(str(default_dataset))}",
           "--set", f"log.dir={json.dumps(str(tmp_path / 'log'))}", "--set", "log.progress=false"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "log" / "latest" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_an_untrainable_layout_is_not_emitted(tmp_path, capsys):
    path = tmp_path / "run.toml"
    rc = run(["plan", "--model", "llama3-8b", "--gpus", "16", "--precision", "fp8", "--emit-config", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and "train.precision='fp8' is not available" in err
    assert not path.exists()
