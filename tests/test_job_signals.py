"""The job is one unit (real processes, real signals, checked by PID): SIGTERM to `pentatron train
--nproc 2` stops every rank and exits 143; a SIGKILLed launcher takes its ranks with it
(PR_SET_PDEATHSIG); while a job runs, a second job on its checkpoint directory is refused naming the
holder's pid; after the kill the directory can be used again (the lock died with rank 0)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.launchers import ROOT, _env, pentatron_nproc

CONFIG = str(ROOT / "configs" / "debug.toml")


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(p)
    return alive


def _flags(tmp: Path, dataset: Path, *extra: str) -> list[str]:
    return [CONFIG, *extra, f"--set=data.path={json.dumps(str(dataset))}",
            f"--set=log.dir={json.dumps(str(tmp / 'runs'))}",
            "--set=log.progress=false", "--set=log.tensorboard=false", "--set=train.steps=100000",
            "--set=checkpoint.every=1000", f"--set=checkpoint.dir={json.dumps(str(tmp / 'ck'))}"]


@contextmanager
def _training(tmp: Path, dataset: Path, *extra: str, session: bool = False
              ) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """The launcher and its 2 ranks once they are training (`session`: in a process group of their own, as a
    terminal's job is); whatever is left of them is killed on exit."""
    launcher, ranks = _start_training(tmp, dataset, *extra, session=session)
    try:
        yield launcher, ranks
    finally:
        for p in _alive(ranks):
            os.kill(p, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


def _start_training(tmp: Path, dataset: Path, *extra: str, session: bool = False
                    ) -> tuple[subprocess.Popen, list[int]]:
    """The launcher and its 2 ranks, once they are training (a step has been logged)."""
    tmp.mkdir(parents=True, exist_ok=True)
    launcher = subprocess.Popen([sys.executable, "-m", "pentatron.cli", "train", *_flags(tmp, dataset, *extra),
                                 "--nproc=2"],
                                cwd=tmp, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=session)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if list((tmp / "runs").rglob("metrics.jsonl")) and any(
                f.stat().st_size for f in (tmp / "runs").rglob("metrics.jsonl")):
            ranks = _children(launcher.pid)
            if len(ranks) == 2:
                return launcher, ranks
        if launcher.poll() is not None:
            break
        time.sleep(0.5)
    launcher.kill()
    raise AssertionError(f"the job did not start training: {launcher.communicate()[0][-3000:]}")


def _rank_pid(pids: list[int], rank: int) -> int:
    """The one of `pids` whose environment says RANK=`rank`."""
    (pid,) = [p for p in pids if f"RANK={rank}".encode() in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")]
    return pid


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux-only")
def test_sigterm_stops_every_rank_and_a_second_job_is_refused_meanwhile(tmp_path, default_dataset):
    with _training(tmp_path / "a", default_dataset) as (launcher, ranks):
        second = pentatron_nproc(_flags(tmp_path / "a", default_dataset), 2, tmp_path / "b", timeout=240)
        assert second.codes == [2] and "in use by another job" in second.output, second.output[-2000:]
        assert "pid " in second.output and "Traceback" not in second.output
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=60)
        assert launcher.returncode == 143, out[-2000:]
        assert "stopped by SIGTERM" in out
        assert _wait_gone(ranks, 10) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.parametrize("target", ["launcher", "rank 0", "ctrl-c"])
def test_sigterm_with_save_on_sigterm_saves_the_last_step_then_exits_143(tmp_path, default_dataset, target):
    """To the launcher (a scheduler's notice) or to one rank alone (a node's): the job saves and exits 143.
    Ctrl-C (SIGINT to the terminal's process group: the launcher and every rank, then the agent's own SIGINT to
    the ranks) saves too, and exits 130."""
    from pentatron.checkpoint import manifest

    ctrl_c = target == "ctrl-c"
    with _training(tmp_path / "a", default_dataset, "--set=checkpoint.save_on_sigterm=true",
                   session=ctrl_c) as (launcher, ranks):
        if ctrl_c:
            os.killpg(launcher.pid, signal.SIGINT)
        else:
            os.kill(launcher.pid if target == "launcher" else _rank_pid(ranks, int(target[-1])), signal.SIGTERM)
        out, _ = launcher.communicate(timeout=60)
        name = "SIGINT" if ctrl_c else "SIGTERM"
        assert launcher.returncode == (130 if ctrl_c else 143), out[-2000:]
        assert _wait_gone(ranks, 10) == []
        assert out.count(f"stopped by {name} after step") == 1, out[-2000:]
        step = int(out.split(f"stopped by {name} after step ")[1].split(",")[0])
        ck = tmp_path / "a" / "ck"
        latest = ck / (ck / "latest").read_text()
        manifest.verify(latest)  # complete and intact
        assert json.loads((latest / "meta.json").read_text())["step"] == step
        (metrics,) = [m for m in (tmp_path / "a" / "runs").rglob("metrics.jsonl") if m.parent.name != "latest"]
        assert json.loads(metrics.read_text().splitlines()[-1])["step"] == step  # the saved step is the last run


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux-only")
def test_a_killed_launcher_leaves_no_rank_behind_and_frees_the_directory(tmp_path, default_dataset):
    with _training(tmp_path / "a", default_dataset) as (launcher, ranks):
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert _wait_gone(ranks, 10) == [], "ranks outlived their SIGKILLed launcher"
        from pentatron.checkpoint.lock import probe

        # The kernel drops a dead process's flock when its file is finally released, which can trail the
        # process's exit by a moment on a loaded machine.
        deadline = time.monotonic() + 10
        while probe(tmp_path / "a" / "ck") is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert probe(tmp_path / "a" / "ck") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux-only")
def test_kill_9_of_rank_0_is_the_one_line_naming_it(tmp_path, default_dataset):
    """The survivor's collective fails on the lost connection: it printed gloo's traceback (and "rank 1
    failed: … Connection reset by peer") before the launcher's line naming rank 0. Only that line now."""
    with _training(tmp_path / "a", default_dataset) as (launcher, ranks):
        os.kill(_rank_pid(ranks, 0), signal.SIGKILL)
        out, _ = launcher.communicate(timeout=60)
        assert launcher.returncode == 1, out[-2000:]
        assert _wait_gone(ranks, 10) == []
    said = [line for line in out.splitlines() if line.startswith("pentatron: rank") or "Error" in line]
    assert said == ["pentatron: rank 0 exited with code -9 (killed by a signal)"], out[-3000:]
    assert "Traceback" not in out and "Connection" not in out, out[-3000:]
