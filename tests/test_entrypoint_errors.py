"""Every user-fixable problem: one message, exit code 2, no traceback — under `pentatron train --nproc 2`,
an outer torchrun and srun alike, found before any process group or model exists.

Every case runs under our launcher; the outer launchers (every rank checks, the first says it) run one case
of each stage that finds a problem — the arguments, the configuration, the dataset, the checkpoint — as
the cases of one stage go through the same code under any launcher (each outer launch starts 2-3 fresh
interpreters: ~5 s of CPU)."""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.launchers import outer_torchrun, pentatron_nproc, srun_tasks

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")


def _case(name: str, tmp: Path, dataset: Path) -> tuple[list[str], str]:
    """(train arguments, the message fragment that must appear once) for each problem."""
    data = f"--set=data.path={json.dumps(str(dataset))}"
    if name == "corrupt index.json":
        broken = tmp / "broken-data"
        shutil.copytree(dataset, broken)
        (broken / "index.json").write_text("{ not json")
        return [CONFIG, f"--set=data.path={json.dumps(str(broken))}"], "index.json is not readable JSON"
    if name == "dataset vocab > model vocab":
        return [CONFIG, data, "--set=model.vocab_size=1000"], "model.vocab_size=1000"
    if name == "global_batch not divisible":
        return [CONFIG, data, "--set=train.global_batch=12"], "not divisible by train.micro_batch=4 × dp=2"
    if name == "cp does not split the sequence":
        return [CONFIG, data, "--set=parallel.cp=2", "--set=train.seq_len=62"], "divisible by 2·cp = 4"
    if name == "device cuda on a CPU host":
        return [CONFIG, data, "--set=train.device=\"cuda\""], "train.device='cuda' but this host has no usable CUDA"
    if name == "config path is a directory":
        return [str(tmp)], "is a directory"
    if name == "dangling checkpoint pointer":
        ck = tmp / "ck"
        ck.mkdir()
        (ck / "latest").write_text("step_00000007")
        return [CONFIG, data, f"--set=checkpoint.dir={json.dumps(str(ck))}"], "is not a complete checkpoint"
    raise KeyError(name)


CASES = ["corrupt index.json", "dataset vocab > model vocab", "global_batch not divisible",
         "config path is a directory", "dangling checkpoint pointer", "cp does not split the sequence"]
if not torch.cuda.is_available():  # on a GPU host train.device=cuda is no error
    CASES.append("device cuda on a CPU host")
OUTER = {"config path is a directory", "global_batch not divisible", "corrupt index.json",
         "dangling checkpoint pointer"}  # one case of each stage


def _pentatron_tracebacks(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip().startswith("File ") and "pentatron" in line]


@pytest.mark.parametrize("case", CASES)
def test_user_error_is_reported_once_with_exit_2_under_every_launcher(case, tmp_path, default_dataset):
    args, fragment = _case(case, tmp_path, default_dataset)
    common = [*args, "--set=log.progress=false", f"--set=log.dir={json.dumps(str(tmp_path / 'runs'))}"]
    if case == "config path is a directory":
        common = [args[0], "--set=log.progress=false"]

    if case not in OUTER:
        ours = pentatron_nproc(common, 2, tmp_path / "a", 180)
        assert ours.codes == [2], ours.output[-3000:]
        assert ours.output.count(fragment) == 1 and "Traceback" not in ours.output, ours.output[-3000:]
        assert not (tmp_path / "runs").exists()
        return
    with ThreadPoolExecutor(3) as pool:  # the three launches at once: most of their time is start-up
        ours, slurm, torchrun = (f.result() for f in [
            pool.submit(pentatron_nproc, common, 2, tmp_path / "a", 180),
            pool.submit(srun_tasks, common, 2, tmp_path / "b", 180),
            pool.submit(outer_torchrun, common, 2, tmp_path / "c", 180)])

    assert ours.codes == [2], ours.output[-3000:]
    assert ours.output.count(fragment) == 1 and "Traceback" not in ours.output, ours.output[-3000:]

    assert slurm.codes == [2, 2], slurm.output[-3000:]
    assert slurm.output.count(fragment) == 1 and "Traceback" not in slurm.output, slurm.output[-3000:]

    # torchrun's own exit code is 1 whenever a worker fails, and it appends its failure report (with
    # a traceback of its own); what Pentatron controls: one message, ranks exiting 2 (rank 0 may be
    # stopped by the agent once the others have exited), no traceback from Pentatron's code.
    assert torchrun.output.count(fragment) == 1, torchrun.output[-3000:]
    codes = [int(c) for c in re.findall(r"exitcode\s*: (-?\d+)", torchrun.output)]
    assert codes and 2 in codes and set(codes) <= {2, -15}, torchrun.output[-3000:]
    assert not _pentatron_tracebacks(torchrun.output), torchrun.output[-3000:]
    assert not (tmp_path / "runs").exists()  # nothing started: no run directory either


def test_an_error_every_rank_hits_is_said_by_the_first_rank_only():
    """A compile failure hits every rank compiling the region: the rendezvous store lets the first say it."""
    import torch.distributed as dist

    from pentatron.runner import _first_to_say

    store = dist.HashStore()
    assert _first_to_say(store, "compile_error") and not _first_to_say(store, "compile_error")
    assert _first_to_say(store, "other") and _first_to_say(None, "compile_error")
