"""A run from start to end: its own directory, a clean multi-process exit, logs that continue on resume
without repeating steps, the summary, and an MFU that is never above 1."""

from __future__ import annotations

import json
from pathlib import Path

from pentatron.cli import main
from pentatron.config import config_from_dict, load_config
from pentatron.observe.peak import cpu_peak_flops, machine_key
from pentatron.plan.flops import MFU_CONVENTION, DocumentLengths, model_flops_per_token
from tests.launchers import pentatron_nproc

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _flags(tmp: Path, dataset: Path, *extra: str) -> list[str]:
    return [f"--set=data.path={json.dumps(str(dataset))}", f"--set=log.dir={json.dumps(str(tmp / 'runs'))}",
            "--set=log.progress=false", *extra]


def test_finished_multiprocess_run_exits_0_in_its_own_directory(tmp_path, default_dataset):
    """A run on 2 ranks exits 0 (no abort at shutdown) and logs to a fresh directory with its summary;
    MFU ≤ 1 on every step. (benchmarks/teardown_stress.py repeats the run 30 times; two runs of one
    config getting two directories is checked below, on 1 process.)"""
    done = pentatron_nproc([CONFIG, *_flags(tmp_path, default_dataset, "--set=train.steps=2")], 2, tmp_path)
    assert done.codes == [0] and "terminate called" not in done.output, done.output[-3000:]
    assert "run summary" in done.output and "tokens/s for the whole job" in done.output
    runs = sorted(p for p in (tmp_path / "runs").iterdir() if not p.is_symlink())
    assert len(runs) == 1
    for run in runs:
        assert _steps(run) == [1, 2]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["layout"]["world"] == 2 and summary["paths"]["metrics"] == str(run / "metrics.jsonl")
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert all(0 < r["mfu"] <= 1 for r in records), [r["mfu"] for r in records]
    assert (tmp_path / "runs" / "latest").resolve() == runs[-1].resolve()


def test_resumed_run_continues_its_logs_without_repeating_steps(tmp_path, default_dataset, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ck = tmp_path / "ck"
    flags = _flags(tmp_path, default_dataset, "--set=train.steps=4", "--set=checkpoint.every=2",
                   f"--set=checkpoint.dir={json.dumps(str(ck))}")
    assert main(["train", CONFIG, *flags]) == 0
    # A crash after step 4 was logged but before its checkpoint was published: `latest` is step 2.
    (ck / "latest").write_text("step_00000002")
    assert main(["train", CONFIG, *flags]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "resumed after step 2" in out
    runs = [p for p in (tmp_path / "runs").iterdir() if not p.is_symlink()]
    assert len(runs) == 1  # the resumed run continued in the directory of the run it resumed
    assert _steps(runs[0]) == [1, 2, 3, 4]
    events = EventAccumulator(str(runs[0] / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    # A new run of the same config without resume gets its own directory.
    assert main(["train", CONFIG, *flags, "--force-new"]) == 0
    assert len([p for p in (tmp_path / "runs").iterdir() if not p.is_symlink()]) == 2


def test_summary_on_console_and_in_summary_json(tmp_path, default_dataset, capsys):
    """(With document masking on: the summary and the report state the MFU numerator's convention, in the
    planner's words, and its numerator follows the documents each step trained.)"""
    assert main(["train", CONFIG, *_flags(tmp_path, default_dataset, "--set=train.steps=3",
                                          "--set=data.document_mask=true")]) == 0
    out = capsys.readouterr().out
    for label in ("run summary", "loss", "final", "min", "tokens/s for the whole job", "per rank", "MFU",
                  "peak memory", "process peak resident set", "wall clock", "metrics", "TensorBoard",
                  "dataset", "payload = bytes", "tokens/s all"):
        assert label in out, label
    (run,) = [p for p in (tmp_path / "runs").iterdir() if not p.is_symlink()]
    s = json.loads((run / "summary.json").read_text())
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert s["loss"]["final"] == losses[-1] and s["loss"]["min"] == min(losses)
    assert s["steps"] == {"first": 1, "last": 3, "resumed_from": None}
    assert 0 < s["mfu"]["mean"] <= s["mfu"]["max"] <= 1
    assert s["memory"]["peak_bytes_max_over_ranks"] > 0 and s["time"]["wall_s"] > 0
    assert s["compile"] is None and "off (train.compile)" in out  # "auto": compiled on CUDA only
    assert s["paths"]["dataset"] == str(default_dataset) and (run / "config.json").is_file()
    # the resolved config: the model's shape written in (was null), and it loads back as the same run
    resolved = json.loads((run / "config.json").read_text())
    assert None not in resolved["model"].values() and resolved["parallel"]["dp"] == 1
    assert config_from_dict(resolved).model_config() == load_config(CONFIG).model_config()
    assert {k: s["layout"][k] for k in ("dp", "tp", "pp", "cp", "ep")} == dict(dp=1, tp=1, pp=1, cp=1, ep=1)
    assert "tp=1 pp=1 cp=1 ep=1 zero=0" in out  # the banner and the summary name all five degrees
    # the report takes the run's directory or log.dir (its newest run)
    assert main(["report", str(tmp_path / "runs")]) == 0 and (run / "report.md").is_file()
    # the MFU numerator's convention, in the same words in the summary, the report and the planner
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert s["mfu"]["convention"] == MFU_CONVENTION and MFU_CONVENTION in out
    report = (run / "report.md").read_text()
    assert MFU_CONVENTION in report and "the prediction uses them" in report
    loaded = load_config(CONFIG)
    cfg, s_len = loaded.model_config(), loaded.train.seq_len
    for r in records:  # each step's numerator: attention over the squares of the documents it trained
        docs = DocumentLengths(r["documents"]["mean_tokens"], r["documents"]["mean_sq_tokens"])
        assert r["model_flops_per_token"] == model_flops_per_token(cfg, s_len, documents=docs) and r["mfu"] <= 1
    assert any(r["documents"]["attention_pairs"] < 1 for r in records)  # the data holds several documents


def test_the_cpu_peak_is_a_fixed_calibration_remeasured_only_after_a_busy_one(tmp_path, monkeypatch):
    """Two runs' MFU compare: a calibration taken on a quiet machine is never re-measured; one taken on a
    busy machine (it undershoots) yields to a quieter one, keeping the higher value; an old float entry
    counts as of unknown load."""
    import torch

    from pentatron.observe import peak

    dtype, cache = torch.float32, tmp_path / "peak.json"
    measures = iter([1e12, 3e12, 2e12])
    monkeypatch.setattr(peak, "measure_cpu_peak", lambda dtype: next(measures))
    monkeypatch.setattr(peak, "current_load", lambda: 0.9)  # busy
    first = peak.cpu_calibration(dtype, refresh=True, path=cache)
    assert (first.flops, first.load) == (1e12, 0.9) and "busy" in first.describe()
    assert json.loads(cache.read_text())[machine_key(dtype)]["flops"] == 1e12
    assert peak.cpu_calibration(dtype, refresh=True, path=cache).flops == 1e12  # not quieter: kept
    monkeypatch.setattr(peak, "current_load", lambda: 0.1)  # quiet now: re-measured
    second = peak.cpu_calibration(dtype, refresh=True, path=cache)
    assert (second.flops, second.load) == (3e12, 0.1) and "busy" not in second.describe()
    assert peak.cpu_calibration(dtype, refresh=True, path=cache) == second  # quiet: never again
    assert cpu_peak_flops(dtype, refresh=False, path=cache) == 3e12
    cache.write_text(json.dumps({machine_key(dtype): 5e12}))  # the format before calibrations
    assert peak.cpu_calibration(dtype, refresh=True, path=cache).flops == 5e12  # kept: 2e12 < 5e12
    assert next(measures, None) is None
