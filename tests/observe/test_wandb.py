"""log.wandb: a real run logs to a real (offline) W&B run what it writes to TensorBoard — the config, every
step's metrics, validation and the summary — read back from W&B's own files; without the package, one clear
error before anything starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pentatron.cli import main
from tests.observe import wandb_files

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "debug.toml")


def _flags(tmp: Path, dataset: Path, *extra: str) -> list[str]:
    return [f"--set=data.path={json.dumps(str(dataset))}", f"--set=log.dir={json.dumps(str(tmp / 'runs'))}",
            "--set=log.progress=false", "--set=log.wandb=true", *extra]


def test_offline_run_holds_the_config_metrics_validation_and_summary(tmp_path, default_dataset, monkeypatch):
    # offline twice over (the environment and the config), and W&B's own settings kept inside the test
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")  # no crash reports sent anywhere either
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    flags = _flags(tmp_path, default_dataset, "--set=train.steps=4", "--set=eval.every=2", "--set=eval.holdout=0.1",
                   '--set=log.wandb_mode="offline"', '--set=log.wandb_name="tiny"')
    assert main(["train", CONFIG, *flags]) == 0
    (run,) = [p for p in (tmp_path / "runs").iterdir() if not p.is_symlink()]
    (log,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    history = wandb_files.history(log)
    assert sorted(history) == [1, 2, 3, 4]
    for r in records:  # the values themselves, as metrics.jsonl and TensorBoard have them
        row = history[r["step"]]
        assert row["train/loss"] == r["loss"] and row["train/grad_norm"] == r["grad_norm"]
        assert row["train/lr"] == r["lr"] and row["train/tokens_per_s"] == r["tokens_per_s"]
    assert [s for s, row in history.items() if "val/loss" in row] == [2, 4]
    assert history[4]["val/loss"] == records[3]["val"]["loss"]
    assert history[4]["val/perplexity"] == records[3]["val"]["perplexity"]
    config = wandb_files.config(log)
    assert config["train"]["steps"] == 4 and config["eval"]["every"] == 2
    assert config["model"]["name"] == "debug" and config["model"]["hidden_size"] == 128  # resolved, as config.json
    summary, written = wandb_files.summary(log), json.loads((run / "summary.json").read_text())
    assert summary["summary/loss/final"] == written["loss"]["final"] == records[-1]["loss"]
    assert summary["summary/validation/final"] == written["validation"]["final"]
    assert summary["summary/tokens_per_s/mean_all_ranks"] == written["tokens_per_s"]["mean_all_ranks"]
    assert written["paths"]["wandb"] == str(run / "wandb")


def test_missing_package_is_one_clear_error(tmp_path, default_dataset, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable, as when it is not installed
    assert main(["train", CONFIG, *_flags(tmp_path, default_dataset)]) == 2
    err = capsys.readouterr().err
    assert "log.wandb = true but the wandb package is not installed: pip install 'pentatron[wandb]'" in err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


def test_online_without_a_login_is_one_clear_error(tmp_path, default_dataset, monkeypatch, capsys):
    """No key anywhere W&B looks (an empty home; a local address that refuses, were one found): W&B refuses to
    start an online run before any upload, and the run says what to do, exit 2."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / "wandb"))
    assert main(["train", CONFIG, *_flags(tmp_path, default_dataset, "--set=train.steps=2",
                                          '--set=log.wandb_mode="online"')]) == 2
    err = capsys.readouterr().err
    assert "log.wandb: W&B could not start the run (UsageError: No API key configured" in err, err
    assert "run `wandb login` or set WANDB_API_KEY, or log offline" in err and "Traceback" not in err
