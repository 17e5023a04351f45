"""Beyond one machine, on one machine: two launchers with --nnodes 2 --node-rank 0|1 --rdzv-endpoint
(2 processes each), and the same 4 ranks started with srun's environment over 2 "nodes", train a
dp2×tp2 layout to the 1-process losses, in float64 to `EXACT_RTOL` (docs/testing.md). The srun run's
checkpoint, read back by `pentatron generate` (tp shards reassembled), holds the 1-process run's weights.
The 1-process run (and its checkpoint, which `pentatron generate` also reads) is trained once for the module."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pentatron.cli import main
from pentatron.generate import load_model
from tests.launchers import PY, _env, free_port, in_process, srun_tasks
from tests.reference_loop import EXACT_RTOL, FP64, relative_error

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")
STEPS = 3


def _losses(log_dir: Path) -> list[float]:
    (summary,) = [p for p in log_dir.glob("*/summary.json") if not p.parent.is_symlink()]
    return [json.loads(x)["loss"] for x in (summary.parent / "metrics.jsonl").read_text().splitlines()]


def _args(tmp: Path, name: str, dataset: Path, *extra: str) -> list[str]:
    return [CONFIG, f"--set=data.path={json.dumps(str(dataset))}", f"--set=train.steps={STEPS}",
            f"--set=log.dir={json.dumps(str(tmp / name))}", "--set=log.progress=false",
            f"--set=checkpoint.dir={json.dumps(str(tmp / name / 'ck'))}", f"--set={FP64}", *extra]


@pytest.fixture(scope="module")
def single(tmp_path_factory, default_dataset) -> Path:
    """The 1-process run's log directory (its checkpoint in `ck`)."""
    tmp = tmp_path_factory.mktemp("single")
    outcome = in_process(["train", *_args(tmp, "single", default_dataset)], tmp)
    assert outcome.codes == [0], outcome.output[-3000:]
    return tmp / "single"


def test_two_nodes_and_srun_match_one_process(tmp_path, default_dataset, single):
    reference = _losses(single)

    layout = ("--set=parallel.tp=2",)
    endpoint = f"localhost:{free_port()}"
    nodes = [subprocess.Popen([PY, "-m", "pentatron.cli", "train", *_args(tmp_path, "nodes", default_dataset, *layout),
                               "--nproc=2", "--nnodes=2", f"--node-rank={r}", f"--rdzv-endpoint={endpoint}"],
                              cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    outs = [p.communicate(timeout=400)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-2000:] for o in outs)
    assert "dp=2 tp=2" in outs[0]
    np.testing.assert_allclose(_losses(tmp_path / "nodes"), reference, rtol=EXACT_RTOL, atol=0)

    slurm = srun_tasks(_args(tmp_path, "srun", default_dataset, *layout), 4, tmp_path, timeout=400, nnodes=2)
    assert slurm.codes == [0] * 4, slurm.output[-3000:]
    np.testing.assert_allclose(_losses(tmp_path / "srun"), reference, rtol=EXACT_RTOL, atol=0)

    # `pentatron generate` reassembles the tp shards into the 1-process model.
    one, _, _ = load_model(single / "ck")
    sharded, _, _ = load_model(tmp_path / "srun" / "ck")
    want = dict(one.named_parameters())
    # generate loads the fp64 weights as fp32: two values equal to 1e-10 round to fp32 at most 1 unit of
    # roundoff (2**-24 relative) apart
    for name, p in sharded.named_parameters():
        err = relative_error(p.detach().numpy(), want[name].detach().numpy())
        assert err <= 2**-24, f"{name} off by {err:.2e}"


def test_generate_prints_text_from_a_checkpoint_and_refuses_what_is_not_one(tmp_path, single, capsys):
    assert main(["generate", str(single / "ck"), "--prompt", "import os", "--max-new-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("import os") and "greedy" in captured.err
    assert main(["generate", str(single / "ck"), "--prompt", "x", "--top-k", "5",
                 "--max-new-tokens", "3"]) == 0
    assert "top-5 sampling" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err
