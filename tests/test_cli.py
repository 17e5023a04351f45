import json
import subprocess
import sys

from pentatron.cli import _split_dotted, main


def test_config_error_exits_2_with_field_names_and_no_traceback(capsys):
    code = main(["train", "configs/debug.toml", "--set", "train.lr=0", "--train.micro_batch=3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "train.lr must be > 0" in err and "micro_batch=3" in err and "Traceback" not in err
    # one bad value: the one-line contract (it was "invalid configuration:" and the value on a second line)
    assert main(["train", "configs/debug.toml", "--set", "train.lr=-1"]) == 2
    assert capsys.readouterr().err == "pentatron: error: invalid configuration: train.lr must be > 0, got -1.0\n"


def test_nproc_must_divide_batch_before_anything_launches(capsys):
    code = main(["train", "configs/debug.toml", "--nproc", "3"])
    assert code == 2 and "not divisible by train.micro_batch=4 × dp=3" in capsys.readouterr().err


def test_dotted_flags_become_overrides():
    rest, dotted = _split_dotted(["train", "c.toml", "--train.steps=5", "--log.dir", "x", "--nproc", "2"])
    assert rest == ["train", "c.toml", "--nproc", "2"] and dotted == ["train.steps=5", "log.dir=x"]


def test_token_ids_beyond_model_vocab_is_a_clear_data_error(tmp_path, default_dataset, capsys):
    code = main(["train", "configs/debug.toml", f"--data.path={json.dumps(str(default_dataset))}",
                 "--model.vocab_size=1000", f"--log.dir={json.dumps(str(tmp_path))}"])
    err = capsys.readouterr().err
    assert code == 2 and "vocab_size=1000" in err and "Traceback" not in err


def test_train_with_nproc_2_runs_under_torchrun(tmp_path, default_dataset):
    """`pentatron train --nproc 2` launches two ranks through torchrun and finishes cleanly."""
    cmd = [sys.executable, "-m", "pentatron.cli", "train", "configs/debug.toml", "--nproc", "2",
           "--set", "train.steps=2", "--set", f"data.path={json.dumps(str(default_dataset))}",
           "--set", f"log.dir={json.dumps(str(tmp_path / 'log'))}", "--set", "log.progress=false"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / "log" / "latest" / "metrics.jsonl").read_text().splitlines()  # the run's own directory
    assert [json.loads(x)["step"] for x in lines] == [1, 2]


def test_config_path_that_is_a_directory_says_so(tmp_path, capsys):
    assert main(["train", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_multinode_flags_are_checked_before_launch(capsys):
    assert main(["train", "configs/debug.toml", "--nproc", "2", "--nnodes", "2"]) == 2
    assert "--rdzv-endpoint" in capsys.readouterr().err
    assert main(["train", "configs/debug.toml", "--nnodes", "2", "--node-rank", "2",
                 "--rdzv-endpoint", "h:1"]) == 2
    assert "--node-rank must be within" in capsys.readouterr().err



def test_multinode_srun_without_master_addr_says_what_to_export(monkeypatch):
    import os

    from pentatron.distributed.launch import adopt_slurm_env
    from pentatron.preflight import environment_problems

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(SLURM_PROCID="1", SLURM_NTASKS="4", SLURM_LOCALID="1", SLURM_NNODES="2")
    monkeypatch.setattr(os, "environ", env)
    adopt_slurm_env()
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "4", "1", "2")
    problems = environment_problems()
    assert len(problems) == 2 and all("scontrol show hostnames" in p for p in problems)
    assert problems[0].startswith("MASTER_ADDR is not set")
