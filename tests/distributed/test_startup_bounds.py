"""Start-up never waits unbounded and names who is missing: the preflight agreement of a job whose rank does
not arrive (stopped, crashed, never started) ends within distributed.timeout_s with one line naming it —
on the store the ranks really meet on, and end to end with a rank stopped by SIGSTOP during start-up."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from pentatron.distributed.launch import agree_on_preflight

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "debug.toml")


def test_rank_0_names_the_ranks_that_never_reported(capsys, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # rank 2 below never reads: don't wait for it
    store = dist.HashStore()
    dist.PrefixStore("pentatron/preflight", store).set("rank2", json.dumps([]))  # rank 2 arrived, 1 and 3 not
    start = time.monotonic()
    verdict = agree_on_preflight(store, 0, 4, [], dict, timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert "rank(s) 1, 3 of 4 did not reach the start-up check within 0.5 s" in verdict["startup_error"]
    assert capsys.readouterr().err.count("pentatron: error: rank(s) 1, 3") == 1


def test_the_others_stop_when_rank_0_never_answers(capsys):
    store = dist.HashStore()
    verdict = agree_on_preflight(store, 1, 2, [], dict, timeout_s=0.2, verdict_timeout_s=0.3)
    assert "rank 0 did not finish the start-up check" in verdict["startup_error"]
    assert capsys.readouterr().err.count("pentatron: error") == 1
    assert agree_on_preflight(store, 2, 3, [], dict, timeout_s=0.2, verdict_timeout_s=0.3)["startup_error"]
    assert capsys.readouterr().err == ""  # said once, by rank 1


def _rank_pid(root: int, rank: str) -> int | None:
    """The pid of a descendant of `root` whose environment says RANK=`rank` (a torchrun worker)."""
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and f"PENTATRON_TEST_ROOT={root}".encode() in env and "python" in stat:
            return pid
    return None


def test_a_rank_stopped_during_start_up_is_named_within_the_timeout(default_dataset, tmp_path):
    env = {**os.environ, "PENTATRON_TEST_ROOT": str(os.getpid()), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pentatron.cli", "train", CONFIG, "--nproc=2", "--set=distributed.timeout_s=3",
           f"--set=data.path={json.dumps(str(default_dataset))}", "--set=log.progress=false",
           f"--set=log.dir={json.dumps(str(tmp_path / 'runs'))}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stopped, deadline = None, time.monotonic() + 60
    while stopped is None and time.monotonic() < deadline and proc.poll() is None:
        stopped = _rank_pid(os.getpid(), "1")
        time.sleep(0.01)
    assert stopped is not None, "rank 1 never started"
    os.kill(stopped, signal.SIGSTOP)
    message = "rank(s) 1 of 2 did not reach the start-up check within 3 s"
    lines: list[str] = []
    try:
        for line in proc.stdout:  # the job says it while rank 1 is still stopped
            lines.append(line)
            if message in line:
                break
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGKILL)  # the launcher then ends at once
        rest, _ = proc.communicate(timeout=120)
    out = "".join(lines) + rest
    assert proc.returncode == 1, out[-3000:]
    assert out.count(message) == 1 and "Traceback" not in out, out[-3000:]
