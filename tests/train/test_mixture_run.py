"""A mixture run end to end in one process (data.sources with data.on_exhausted = "stop"): the console says
each source's tokens at log steps and the source that runs out, the run ends before the step that would
reuse a sample, with its checkpoint saved (per-source counts in it), the summary and metrics.jsonl saying the
same counts; a resume of it says at once that no step can be trained. Preflight names a mixture's problems.
(Shares, order and layouts: tests/data/test_mixture.py; the resumed parity: tests/checkpoint/test_reshard.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pentatron.config import load_config
from pentatron.data.errors import DataError
from pentatron.observe.summary import finish_run
from pentatron.preflight import data_problems
from pentatron.train.trainer import Trainer
from tests.documents_data import write_documents_dataset
from tests.reference_loop import FP64


def _cfg(root: Path, *extra: str):
    sources = (f"data.sources=[{{path='{root}/web', weight=3}}, {{path='{root}/code', weight=1, name='py'}}]")
    return load_config(None, [FP64, sources, "data.on_exhausted='stop'", "eval.every=50",
                              "eval.holdout_tokens=257", "train.steps=20", "train.warmup=0", "train.seq_len=32",
                              "train.micro_batch=4", "train.global_batch=8",
                              "train.peak_tflops=1.0", "log.progress=false", "log.tensorboard=false",
                              f"log.dir='{root}/log'", f"checkpoint.dir='{root}/ck'", *extra], world_size=1)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixrun")
    # 257 tokens of each held out (8 validation sequences): 31 and 5 training samples; code runs out first
    write_documents_dataset(root / "web", total_tokens=32 * 40 + 1, seed=0)
    write_documents_dataset(root / "code", total_tokens=32 * 14 + 1, seed=1)
    return root


def test_a_stop_ends_the_run_before_a_source_is_reused_saved_and_said(stopped, capsys):
    trainer = Trainer(_cfg(stopped))
    records = trainer.fit()
    summary = finish_run(trainer, records, wall_s=1.0)
    out = capsys.readouterr().out
    last = records[-1]["step"]
    assert 1 < last < 20 and trainer.step == last
    tokens = records[-1]["data_tokens"]
    assert tokens["py"] <= 5 * 32 < tokens["py"] + 8 * 32 and sum(tokens.values()) == last * 8 * 32
    said = [line for line in out.splitlines() if line.startswith("pentatron: data source")]
    assert said == [f"pentatron: data source 'py' ran out at step {last + 1}: its 5 samples (160 tokens) were all "
                    f"trained once; data.on_exhausted = \"stop\": the run ends after step {last}"]
    assert f"pentatron: data by step {last}: web {tokens['web']:,} tokens" in out
    # the last step is validated as a run's last is (eval.every = 50 never came), per source
    val = records[-1]["val"]
    assert [r["step"] for r in records if "val" in r] == [last] and set(val["sources"]) == {"web", "py"}
    assert val["loss"] == pytest.approx((3 * val["sources"]["web"] + val["sources"]["py"]) / 4, rel=1e-15)
    assert out.index(f"validation at step {last}") < out.index(said[0])
    # the checkpoint of the last step holds the counts; the summary and metrics.jsonl say them
    (ck,) = sorted((stopped / "ck").glob("step_*"))
    assert ck.name == f"step_{last:08d}"
    assert summary["data"]["stopped"] == [said[0].removeprefix("pentatron: ")]
    assert {n: v["tokens"] for n, v in summary["data"]["sources"].items()} == tokens
    assert summary["data"]["sources"]["py"]["weight_share"] == 0.25
    logged = [json.loads(line) for line in (stopped / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["data_tokens"] for r in logged] == [r["data_tokens"] for r in records]
    trainer.close()
    # resumed: the counts come back from the checkpoint, and the next step still needs a reused sample
    again = Trainer(_cfg(stopped))
    assert again.data_tokens() == tokens
    with pytest.raises(DataError, match="'py' ran out at step .*no step can be trained; add data"):
        again.fit()
    again.close()


def test_preflight_names_a_mixtures_data_problems(stopped, tmp_path):
    write_documents_dataset(tmp_path / "wide", total_tokens=32 * 6 + 1, seed=2)
    index = json.loads((tmp_path / "wide" / "index.json").read_text())
    (tmp_path / "wide" / "index.json").write_text(json.dumps({**index, "eos_id": 7}))
    cfg = load_config(None, [f"data.sources=[{{path='{stopped}/web'}}, {{path='{tmp_path}/wide'}}]"], world_size=1)
    (p,) = data_problems(cfg, build_default_data=False)
    assert "data.sources 'wide'" in p and "id 7" in p
    held = load_config(None, [f"data.sources=[{{path='{stopped}/web'}}, {{path='{stopped}/code'}}]",
                              "train.seq_len=32", "train.global_batch=8", "train.micro_batch=4", "eval.every=2",
                              "eval.holdout=0.5"], world_size=1)
    (p,) = data_problems(held, build_default_data=True)
    assert p.startswith("data source 'code': the held-out split holds 224 tokens")
