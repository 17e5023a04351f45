"""Bad launch environments and unusable log directories: one line, exit 2, before any process group is formed
(a RANK outside WORLD_SIZE would otherwise wait forever for ranks that cannot come)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pentatron.cli import main

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")

ENVIRONMENTS = {
    "WORLD_SIZE not an integer": ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' must be an integer"),
    "RANK outside WORLD_SIZE": ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5 is outside WORLD_SIZE=2"),
    "LOCAL_RANK outside LOCAL_WORLD_SIZE": ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2",
                                             "LOCAL_RANK": "2"}, "LOCAL_RANK=2 is outside LOCAL_WORLD_SIZE=2"),
    "negative RANK": ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK='-1' must be an integer ≥ 0"),
}


@pytest.mark.parametrize("command", ["train", "convert"])
@pytest.mark.parametrize("case", list(ENVIRONMENTS))
def test_a_bad_rank_environment_is_one_line_exit_2(monkeypatch, capsys, tmp_path, case, command):
    env, fragment = ENVIRONMENTS[case]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = (["train", CONFIG] if command == "train"
            else ["checkpoint", "convert", str(tmp_path / "src"), str(tmp_path / "dst"), CONFIG])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_an_unwritable_log_dir_is_found_before_the_run(default_dataset, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    argv = ["train", CONFIG, f"--set=data.path={json.dumps(str(default_dataset))}",
            f"--set=log.dir={json.dumps(str(blocker / 'runs'))}", "--set=log.progress=false"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "log.dir" in err and "not writable" in err and len(err.splitlines()) == 1, err


def test_a_dataset_shorter_than_one_sample_is_found_before_the_ranks_start(tmp_path):
    import numpy as np

    from tests.data.test_loader import write_dataset
    from tests.launchers import pentatron_nproc

    tiny = write_dataset(tmp_path / "tiny", np.arange(1, 21), shard_tokens=100, vocab_size=4096)
    args = [CONFIG, f"--set=data.path={json.dumps(str(tiny))}", "--set=log.progress=false",
            f"--set=log.dir={json.dumps(str(tmp_path / 'runs'))}"]
    out = pentatron_nproc(args, 2, tmp_path / "cwd", timeout=120)
    assert out.codes == [2], out.output[-2000:]
    assert out.output.count("fewer than seq_len+1") == 1 and "Traceback" not in out.output, out.output[-2000:]
    assert not (tmp_path / "runs").exists()
