"""Start `pentatron train` the three ways users do — our launcher (`--nproc N`), an outer torchrun, and
srun (its environment variables set on plain processes, as srun sets them) — and collect what came out;
and `in_process`, the CLI's `main` called by the test's own process, for what needs no fresh interpreter
(a 1-process run, a refusal): the same code as `python -m pentatron.cli` without ~3 s of importing torch."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


@dataclass
class Outcome:
    codes: list[int]  # the launcher's exit code, or each srun task's
    output: str  # stdout and stderr of everything started
    stdout: str = ""  # stdout alone (in_process)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                          "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **(extra or {})}


def pentatron(args: list[str], cwd: Path, timeout: float = 300) -> Outcome:
    """`pentatron <args>` as a user runs it, in `cwd`."""
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([PY, "-m", "pentatron.cli", *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    return Outcome([done.returncode], done.stdout + done.stderr)


def in_process(args: list[str], cwd: Path) -> Outcome:
    """`pentatron <args>` run by this process in `cwd`: its exit code and what it printed."""
    from pentatron.cli import main

    cwd.mkdir(parents=True, exist_ok=True)
    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    finally:
        os.chdir(before)
    return Outcome([code], out.getvalue() + err.getvalue(), out.getvalue())


def pentatron_nproc(args: list[str], nproc: int, cwd: Path, timeout: float = 300) -> Outcome:
    return pentatron(["train", *args, f"--nproc={nproc}"], cwd, timeout)


def outer_torchrun(args: list[str], nproc: int, cwd: Path, timeout: float = 300) -> Outcome:
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "pentatron.cli",
           "train", *args]
    done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    return Outcome([done.returncode], done.stdout + done.stderr)


def srun_tasks(args: list[str], ntasks: int, cwd: Path, timeout: float = 300, nnodes: int = 1) -> Outcome:
    """`ntasks` plain processes with the variables srun sets (tasks spread evenly over `nnodes` nodes,
    all on this machine); the job script's MASTER_ADDR/MASTER_PORT as a multi-node sbatch sets them."""
    cwd.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    per_node = ntasks // nnodes
    procs = []
    for rank in range(ntasks):
        env = _env({"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(ntasks), "SLURM_LOCALID": str(rank % per_node),
                    "SLURM_NNODES": str(nnodes), "SLURM_NODEID": str(rank // per_node), "SLURM_JOB_ID": "4242",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        procs.append(subprocess.Popen([PY, "-m", "pentatron.cli", "train", *args], cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs, codes = [], []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
            codes.append(p.returncode)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return Outcome(codes, "".join(outs))
