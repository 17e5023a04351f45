"""A run whose config cannot fit in memory is refused before any worker starts, with the planner's predicted
breakdown and what to change (exit 2, one line); `train.allow_overcommit=true` lets it try, and a run that
fits is never refused by the check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pentatron.cli import main
from pentatron.config import load_config
from pentatron.preflight_memory import available_ram_bytes, memory_problems
from pentatron.rank_memory import rope_table_bytes
from tests.launchers import pentatron_nproc

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")
DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.toml")
CASES = {"RoPE tables of model.max_seq_len=1e9": (["--set=model.max_seq_len=1000000000"], "RoPE tables"),
         "micro-batch of 65536 sequences": (["--set=train.micro_batch=65536", "--set=train.global_batch=65536"],
                                           "activations")}


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_that_cannot_fit_is_refused_with_its_breakdown(case, default_dataset, tmp_path, capsys):
    extra, part = CASES[case]
    argv = ["train", CONFIG, *extra, f"--set=data.path={json.dumps(str(default_dataset))}",
            f"--set=log.dir={json.dumps(str(tmp_path / 'runs'))}", "--set=log.progress=false"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "GiB available" in err and part in err and "train.allow_overcommit=true" in err, err
    assert not (tmp_path / "runs").exists()


def test_eight_local_ranks_are_refused_by_the_launcher_before_they_start(default_dataset, tmp_path):
    args = [CONFIG, "--set=train.micro_batch=4096", "--set=train.global_batch=32768",
            f"--set=data.path={json.dumps(str(default_dataset))}",
            f"--set=log.dir={json.dumps(str(tmp_path / 'runs'))}", "--set=log.progress=false"]
    out = pentatron_nproc(args, 8, tmp_path / "cwd", timeout=120)
    assert out.codes == [2], out.output[-2000:]
    assert out.output.count("for 8 local rank(s)") == 1 and "Traceback" not in out.output, out.output[-2000:]
    assert not (tmp_path / "runs").exists()


def test_what_fits_is_never_refused_and_overcommit_is_the_users_call():
    assert memory_problems(load_config(DEMO, world_size=8), 8, 8) == []
    assert memory_problems(load_config(CONFIG, world_size=1), 1, 1) == []
    huge = ["model.max_seq_len=1000000000"]
    assert memory_problems(load_config(CONFIG, huge, world_size=1), 1, 1)
    assert memory_problems(load_config(CONFIG, [*huge, "train.allow_overcommit=true"], world_size=1), 1, 1) == []
    cfg = load_config(CONFIG, huge, world_size=1)
    assert rope_table_bytes(cfg) == 2 * 10**9 * cfg.model_config().head_dim * 4


def test_available_ram_is_read_from_meminfo(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemAvailable:   1000 kB\n")
    assert available_ram_bytes(f) == 1000 * 1024
    assert available_ram_bytes(tmp_path / "none") is None
