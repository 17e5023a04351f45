"""Start N real processes joined by a gloo process group, each with its own log file, and collect
their exit codes: the failure lab's (and the hang tests') way to run a distributed scenario that is
*meant* to hang, crash or be stopped.

Unlike tests/multiprocess.run_ranks, a rank's outcome is its exit code (a watchdog ends a hung rank
with os._exit), its output goes to `<dir>/rank<r>.log`, and the caller gets the live processes
(e.g. to SIGSTOP one).

Ranks are forked from multiprocessing's fork server, which imports torch once per Python process (a
spawned rank imported it itself: ~3 s of CPU each); the caller's environment at start is each rank's,
as under spawn.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pentatron.distributed.launch import file_init_method

# What the fork server imports before forking ranks (torch.distributed.nn before any process group, as
# distributed/launch.init_distributed wants).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.nn"]


def _entry(fn: Callable[..., Any], rank: int, world: int, store: str, log: str, pg_timeout_s: float,
           args: tuple, environ: dict[str, str]) -> None:
    os.environ.clear()  # the fork server's environment is the one it started with
    os.environ.update(environ)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    code = 0
    try:
        dist.init_process_group("gloo", init_method=file_init_method(store), rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout_s))
        fn(rank, world, *args)
    except BaseException as e:  # noqa: BLE001 - the exit code and the log are the outcome
        traceback.print_exc()
        print(f"rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no destroy_process_group: peers may be gone or stuck


class RankGroup:
    """`world` processes running fn(rank, world, *args); logs and the FileStore live in `workdir`."""

    def __init__(self, fn: Callable[..., Any], world: int, workdir: Path, args: tuple = (),
                 pg_timeout_s: float = 300.0) -> None:
        self.world = world
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        store = self.dir / "store"
        store.unlink(missing_ok=True)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self.procs = [ctx.Process(target=_entry, args=(fn, r, world, str(store), str(self.log_path(r)),
                                                       pg_timeout_s, args, dict(os.environ)), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def log_path(self, rank: int) -> Path:
        return self.dir / f"rank{rank}.log"

    def log(self, rank: int) -> str:
        p = self.log_path(rank)
        return p.read_text(errors="replace") if p.exists() else ""

    def wait(self, timeout_s: float) -> list[int | None]:
        """Exit codes by rank; a rank still running after `timeout_s` is killed and reported as None."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        codes: list[int | None] = []
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
                codes.append(None)
            else:
                codes.append(p.exitcode)
        return codes

    def failure(self, codes: list[int | None]) -> str:
        """One line on ranks that did not exit 0: each one's exit code (or that it was still running)
        and the last line its log names, and where the logs are."""
        parts = []
        for r, code in enumerate(codes):
            if code == 0:
                continue
            lines = [ln for ln in self.log(r).splitlines() if ln.strip()]
            state = "still running at the deadline" if code is None else f"exit code {code}"
            parts.append(f"rank {r} {state}" + (f" ({lines[-1].strip()})" if lines else ""))
        return f"{'; '.join(parts)}; logs in {self.dir}"

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
