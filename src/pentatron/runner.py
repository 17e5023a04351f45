"""How `pentatron train` runs, after the config is loaded: the launcher (`launch`), each rank's checks
agreed with the others, the run, its summary and a clean exit (`train_in_this_process`, over
`run_in_this_process`, which `checkpoint convert` shares), and the all-ranks stop on a user error
(`stop_all_ranks`). docs/running.md walks through it.

Exit codes: 0 done; 2 a user-fixable problem (reported once, no traceback); 3 stopped on a non-finite
loss, gradient norm or state (train.nonfinite='stop'); 143 stopped after a step by SIGTERM with
checkpoint.save_on_sigterm (else the signal's own 143); 1 any other failure, with a message naming the rank.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pentatron.config import Config

if TYPE_CHECKING:
    from pentatron.checkpoint.lock import CheckpointDirLock


def launch(cfg: Config, argv: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0,
           rdzv_endpoint: str | None = None) -> int:
    """The launcher: every check before any worker starts (so no process group ever starts on a bad
    input), then `nproc` local ranks running `pentatron <argv>`, which find the default dataset and
    the CPU peak cached, and node 0's run directory chosen."""
    from pentatron.distributed.launch import launch_local_ranks
    from pentatron.observe.rundir import resolve_run_dir
    from pentatron.preflight import preflight_problems

    problems = preflight_problems(cfg, world_size=nproc * nnodes, build_default_data=True, local_ranks=nproc)
    if cfg.checkpoint.dir and node_rank == 0:
        from pentatron.checkpoint.lock import probe

        problems += [p for p in [probe(Path(cfg.checkpoint.dir))] if p]
    if problems:
        return problems_error(problems)
    refresh_cpu_peak(cfg)
    argv = [*argv, "--preflight-done"]
    if node_rank == 0:
        argv.append(f"--run-dir={resolve_run_dir(cfg).path}")
    return launch_local_ranks(nproc, argv, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint)


def refresh_cpu_peak(cfg: Config) -> None:
    """Measure this machine's CPU peak (for MFU) while no rank competes for its threads."""
    from pentatron.distributed.launch import local_device
    from pentatron.observe.peak import cpu_peak_flops
    from pentatron.precision import resolve_precision

    device = local_device(cfg.train.device)
    if device.type == "cpu" and cfg.train.peak_tflops is None:
        cpu_peak_flops(resolve_precision(cfg.train.precision, device).param_dtype, refresh=True)


def train_in_this_process(cfg: Config, run_dir: str | None = None, preflight_done: bool = False) -> int:
    """One rank (or the only process) of `pentatron train`. `run_dir` and `preflight_done` come from
    `launch` (node 0's choice; the launcher measured the CPU peak)."""
    from pentatron.observe.rundir import RunDir, record_run, resolve_run_dir
    from pentatron.observe.summary import finish_run
    from pentatron.preflight import preflight_problems
    from pentatron.train.trainer import Trainer

    started = time.time()

    def leader() -> dict[str, str]:
        return {"run_dir": run_dir or str(resolve_run_dir(cfg).path)}

    def train(rank: int, verdict: dict[str, str]) -> None:
        chosen = RunDir(Path(verdict["run_dir"]), resumed=False)
        cfg.log.dir = str(chosen.path)
        trainer = Trainer(cfg)
        try:
            if rank == 0:
                record_run(cfg, chosen, trainer.dataset.path, trainer.world_size)
            records = trainer.fit()
            finish_run(trainer, records, wall_s=time.time() - started)
        finally:
            trainer.close()

    def problems(rank: int, world: int) -> list[str]:
        return preflight_problems(cfg, world_size=world, build_default_data=rank == 0)

    return run_in_this_process(cfg, problems, train, leader, measure_peak=not preflight_done)


def run_in_this_process(cfg: Config, problems_of: Callable[[int, int], list[str]],
                        job: Callable[[int, dict[str, str]], None],
                        leader: Callable[[], dict[str, str]] = dict, measure_peak: bool = True) -> int:
    """One rank of a job (`train`, `checkpoint convert`): its checks (`problems_of(rank, world)`) agreed
    with the other ranks, the checkpoint directory locked, then `job(rank, verdict)` — `verdict` is what
    rank 0's `leader()` chose for everyone — and a clean exit with the job's exit code."""
    from pentatron.checkpoint.errors import CheckpointError, CheckpointWriteError, dcp_failure_types
    from pentatron.data.errors import DataError
    from pentatron.distributed.launch import (
        agree_on_preflight,
        init_distributed,
        local_device,
        rendezvous,
        shutdown_distributed,
    )
    from pentatron.distributed.lifeline import die_with_parent
    from pentatron.observe.wandb_log import WandbSetupError
    from pentatron.parallel.compile import CompileError
    from pentatron.preflight import environment_problems
    from pentatron.train.nonfinite import EXIT_CODE as NONFINITE_EXIT
    from pentatron.train.nonfinite import NonFiniteStop
    from pentatron.train.sigterm import Terminated

    die_with_parent()  # no rank outlives the launcher (or torchrun) that started it
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1 and environment_problems():
        # Without a complete environment the ranks cannot meet to agree: each says it (once per host).
        return problems_error(environment_problems()) if local_rank == 0 else 2
    problems = problems_of(rank, world)
    lock = hold_checkpoint_lock(cfg, problems) if rank == 0 and not problems else None

    store = None
    if world > 1:
        from pentatron.distributed.launch import StartupTimeout
        from pentatron.observe.watchdog import process_group_timeout

        bound = cfg.distributed.timeout_s
        try:
            store, rank, world = rendezvous(process_group_timeout(bound))
        except StartupTimeout as e:
            print(f"pentatron: error: {e}", file=sys.stderr, flush=True)
            return 1
        if local_rank == 0 and not problems and measure_peak:
            refresh_cpu_peak(cfg)  # the host's other ranks wait for the verdict meanwhile
        verdict = agree_on_preflight(store, rank, world, problems, leader, report=problems_error, timeout_s=bound)
        if "startup_error" in verdict:
            if lock is not None:
                lock.release()
            return 1
    else:
        if not problems and measure_peak:
            refresh_cpu_peak(cfg)
        verdict = {"problems": problems, **({} if problems else leader())}
    if verdict["problems"]:
        if lock is not None:
            lock.release()
        return 2 if world > 1 else problems_error(verdict["problems"])

    finished = False
    try:
        from pentatron.observe.watchdog import process_group_timeout

        # The watchdog names a stuck rank after distributed.timeout_s; the process group's own timeout
        # is only the fallback behind it.
        init_distributed(local_device(cfg.train.device), store, process_group_timeout(cfg.distributed.timeout_s),
                         flight_dir=Path(verdict.get("run_dir") or cfg.log.dir) / "flight")
        job(rank, verdict)
        finished = True
    except CheckpointError as e:  # every rank raises it; rank 0's names the file
        code = input_error(str(e)) if rank == 0 else 2
        _leave_after_rank_0(store, rank, cfg.distributed.timeout_s)
        return code
    except (CheckpointWriteError, *dcp_failure_types()) as e:  # DCP's is a BaseException: named here
        if rank == 0 or not isinstance(e, CheckpointWriteError):
            print(f"pentatron: error: {e}".splitlines()[0], file=sys.stderr, flush=True)
        return 1
    except DataError as e:
        return input_error(f"rank {rank}: {e}")
    except WandbSetupError as e:  # rank 0 only (the others stop when it leaves)
        return input_error(str(e))
    except CompileError as e:  # one line, not torch's pages of logging hints; the user sets train.compile
        if _first_to_say(store, "compile_error"):  # every rank compiling the same region fails alike
            print(f"pentatron: rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except NonFiniteStop as e:
        if rank == 0:  # every rank stops on the same (all-reduced) numbers: say it once
            print(f"pentatron: stopped: {e}", file=sys.stderr, flush=True)
        _leave_after_rank_0(store, rank, cfg.distributed.timeout_s)
        return NONFINITE_EXIT
    except Terminated as e:  # every rank stopped after the same step (checkpoint.save_on_sigterm)
        if rank == 0:
            print(f"pentatron: {e}", file=sys.stderr, flush=True)
        finished = True
        return e.exit_code
    except KeyboardInterrupt:
        print(f"pentatron: rank {rank} interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - report which rank failed, with the traceback for debugging
        if world > 1 and peer_lost(e):  # another rank died first: its own line (or the launcher's) is the cause
            return 1
        traceback.print_exc()
        print(f"pentatron: rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        shutdown_distributed(finished)
        if lock is not None:
            lock.release()
    return 0


# What the backends say when the other end of a connection is gone (gloo; NCCL): a consequence, not a cause.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "remote process exited or there was a network error")


def peer_lost(e: BaseException) -> bool:
    """Whether `e` is this rank's collective failing because another rank exited or was killed (kill -9 of
    rank 0: the survivor printed gloo's traceback before the launcher's line naming the killed rank)."""
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_LOST)


def hold_checkpoint_lock(cfg: Config, problems: list[str]) -> CheckpointDirLock | None:
    """Rank 0 locks checkpoint.dir for the job's lifetime (the kernel frees it if the process dies); a
    directory held by another job becomes a preflight problem, reported like the others."""
    from pentatron.checkpoint.lock import CheckpointDirLock, CheckpointDirLocked

    if not cfg.checkpoint.dir:
        return None
    lock = CheckpointDirLock(Path(cfg.checkpoint.dir))
    try:
        lock.acquire()
    except CheckpointDirLocked as e:
        problems.append(str(e))
        return None
    except OSError as e:  # name the lock file: a `.lock` directory was "cannot be locked (Is a directory)"
        why = (f"{lock.path} is a directory, not its lock file; remove it" if lock.path.is_dir()
               else f"{e.strerror} at {e.filename or lock.path}; check its permissions")
        problems.append(f"checkpoint.dir {cfg.checkpoint.dir!r} cannot be locked: {why}")
        return None
    return lock


def nproc_problem(nproc: int | None, outer: int | None, nnodes: int = 1) -> str | None:
    """--nproc/--nnodes against an outer launcher's WORLD_SIZE (`outer`; None: none)."""
    if outer is not None and (nproc not in (None, outer) or nnodes != 1):
        return (f"--nproc/--nnodes conflict with the outer launcher's WORLD_SIZE={outer}; "
                "drop them under torchrun/srun")
    if nproc is not None and nproc < 1:
        return f"--nproc must be ≥ 1, got {nproc}"
    return None


def stop_all_ranks(problems: list[str]) -> int:
    """Under an outer launcher: the ranks meet on the rendezvous store, rank 0 reports every rank's
    problems once, and all exit 2."""
    from pentatron.distributed.launch import agree_on_preflight, rendezvous
    from pentatron.preflight import environment_problems

    if environment_problems():
        problems = environment_problems() + problems
        return problems_error(problems) if os.environ.get("LOCAL_RANK", "0") == "0" else 2
    store, rank, world = rendezvous()
    agree_on_preflight(store, rank, world, problems, dict, report=problems_error)
    return 2


def problems_error(problems: list[str]) -> int:
    if len(problems) == 1:
        return input_error(problems[0])
    return input_error("cannot start the run:\n" + "\n".join(f"  - {p}" for p in problems))


def _leave_after_rank_0(store: Any, rank: int, timeout_s: float) -> None:
    """A stop every rank agreed on and rank 0 reports (a non-finite step, a damaged checkpoint): rank 0 marks
    it reported, the others wait for the mark (at most `timeout_s`) before they exit. torchrun's agent stops
    every rank as soon as one exits with an error, so a rank leaving first could kill rank 0 while it wrote
    the run report, before it said why (`--nproc 2`, train.lr=1e6: exit 3 and no line, one run in three)."""
    if store is None:
        return
    key = "pentatron/rank0_reported"
    try:
        if rank == 0:
            store.set(key, "1")
        else:
            store.wait([key], timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - timed out, or the store left with rank 0 (srun: it hosts it): go
        pass


def _first_to_say(store: Any, key: str) -> bool:
    """Whether this rank is the first of the group to report `key` (the rendezvous store counts them):
    so an error every rank hits is printed once. Without a store (1 process), or when the store is gone,
    the rank says it."""
    if store is None:
        return True
    try:
        return int(store.add(f"pentatron/said/{key}", 1)) == 1
    except Exception:  # the store's host has exited: better said twice than not at all
        return True


def input_error(message: str) -> int:
    print(f"pentatron: error: {message}", file=sys.stderr)
    return 2
