"""Process launch and lifecycle.

- `pentatron train --nproc N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT]` runs torchrun's
  launcher in this process (`launch_local_ranks`), so that a rank's user error comes back as exit
  code 2 with its one message instead of torchrun's ChildFailedError traceback.
- A process started by torchrun or by SLURM's srun joins from the environment those launchers set
  (`adopt_slurm_env` maps srun's variables onto torchrun's).
- Before the process group exists, the ranks pool their preflight findings through the rendezvous
  store (`agree_on_preflight`): rank 0 prints them once and every rank exits 2, or rank 0 hands out
  what must be decided once (the run directory) and the group starts on that same store.
- `torch_flight_recorder_env`: before an NCCL process group is created, PyTorch's own (c10d) flight
  recorder is switched on with a dump on timeout into the run's `flight/` directory, unless the user
  set those variables.
- `shutdown_distributed`: a barrier, then the process group's destruction, so that no rank tears its
  connections down while another still uses them (the cause of rare 'terminate called without an
  active exception' aborts of finished runs).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, MutableMapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def adopt_slurm_env() -> None:
    """Map srun's variables onto torchrun's, so `srun pentatron train …` works without torchrun.
    MASTER_ADDR/MASTER_PORT come from the job script on a multi-node allocation (see README);
    a one-node job defaults to this host."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    nodes = int(env.get("SLURM_NNODES", "1"))
    tasks = int(env["SLURM_NTASKS"])
    env.setdefault("LOCAL_WORLD_SIZE", str(max(1, tasks // max(nodes, 1))))
    if nodes <= 1:
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29500")


def rank_env_problem() -> str | None:
    """What is wrong with the rank variables an outer launcher set (None: absent or sane): integers, and
    each rank inside its world — a RANK ≥ WORLD_SIZE would wait for ranks that can never come."""
    env = os.environ
    values: dict[str, int] = {}
    for name, least in (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_WORLD_SIZE", 1), ("LOCAL_RANK", 0)):
        raw = env.get(name)
        if raw is None:
            continue
        if not raw.strip().isdigit() or int(raw) < least:
            return f"{name}={raw!r} must be an integer ≥ {least} (set by torchrun/srun; unset it to run one process)"
        values[name] = int(raw)
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if rank in values and size in values and values[rank] >= values[size]:
            return (f"{rank}={values[rank]} is outside {size}={values[size]} (ranks are 0 … {values[size] - 1}); "
                    "the job would wait forever for the missing ranks")
    return None


def launched_world_size() -> int | None:
    """The world size set by an outer launcher (torchrun, srun), or None for a plain process."""
    adopt_slurm_env()
    ws = os.environ.get("WORLD_SIZE")
    return int(ws) if ws is not None else None


# ---------------------------------------------------------------------------- the local launcher


def launch_local_ranks(nproc: int, argv: list[str], nnodes: int = 1, node_rank: int = 0,
                       rdzv_endpoint: str | None = None) -> int:
    """Start `nproc` local copies of `pentatron <argv>` with torchrun's launcher (elastic agent) and
    return 0, 2 when the ranks stopped on a user error (they printed it), else 1 naming the ranks."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    # torchrun would set 1 thread per process and say so; share the cores out instead, quietly.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if nnodes == 1:
        # What `torchrun --standalone` does: a private c10d rendezvous on a free local port.
        launcher = ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={uuid.uuid4()}"]
    else:
        # The static rendezvous: node ranks are given; node 0's agent hosts the store at HOST:PORT.
        launcher = [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--rdzv-endpoint={rdzv_endpoint}"]
    args = parse_args([*launcher, f"--nproc-per-node={nproc}", "-m", "pentatron.cli", *argv])
    if args.master_port is None:
        args.master_port = 29500  # as torchrun's run(); only the static backend reads it
    config, cmd, cmd_args = config_from_args(args)
    _quiet_torchelastic()
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        # 2: a user error, 3: stopped on a non-finite loss/norm/state, 143 / 130: stopped after a step by SIGTERM /
        # SIGINT (checkpoint.save_on_sigterm) — every rank agreed and rank 0 has said it; the agent stopped the rest
        for agreed in (2, 3, 143, 130):
            if any(c == agreed for c in codes.values()) and all(c == agreed or c < 0 for c in codes.values()):
                return agreed
        # A rank killed by a signal other than the agent's SIGTERM (kill -9, the OOM killer, a crash) is the cause;
        # the others failed because it was gone (quietly: runner.peer_lost) or were stopped by the agent after it.
        killed = {rank: code for rank, code in codes.items() if code < 0 and code != -signal.SIGTERM}
        for rank, code in sorted((killed or codes).items()):
            print(f"pentatron: rank {rank} exited with code {code}" +
                  (" (killed by a signal)" if code < 0 else ""), file=sys.stderr)
        return 1
    except SignalException as e:  # Ctrl-C or a scheduler's SIGTERM: the agent has stopped the ranks
        print(f"pentatron: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


def _quiet_torchelastic() -> None:
    """The agent logs every rank's exit and its own traceback-like report at WARNING/ERROR; the ranks
    report their own failures (naming the rank), so keep the agent to critical messages."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)


# ---------------------------------------------------------------------------- joining a launched world


class StartupTimeout(RuntimeError):
    """Ranks that did not meet at start-up within the bound: one line naming them (exit 1)."""


def rendezvous(timeout_s: float = 600.0) -> tuple[dist.Store, int, int]:
    """The store, rank and world size from the launcher's environment (env://: torchrun's agent store,
    or under srun a store hosted by rank 0, which waits for every rank to connect). The same store then
    starts the process group. Ranks that do not connect within `timeout_s`: `StartupTimeout`."""
    try:
        store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    except (RuntimeError, ValueError) as e:  # DistStoreError: "… 1/2 clients joined"
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise StartupTimeout(f"rank {os.environ.get('RANK')}: the ranks did not all meet at {where} within "
                             f"{timeout_s:.0f} s ({str(e).splitlines()[0][:200]}); start every rank, or check "
                             "MASTER_ADDR/MASTER_PORT") from None
    store.set_timeout(timedelta(seconds=timeout_s))
    return store, rank, world


def _missing(store: dist.Store, keys: list[str], timeout_s: float) -> list[str]:
    """Wait up to `timeout_s` for every key; the ones still missing then ([]: all there)."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [k for k in keys if not store.check([k])]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.05)


def agree_on_preflight(store: dist.Store, rank: int, world: int, problems: list[str],
                       leader: Callable[[], dict[str, Any]],
                       report: Callable[[list[str]], object] = lambda problems: None,
                       timeout_s: float = 180.0, verdict_timeout_s: float | None = None) -> dict[str, Any]:
    """Pool every rank's preflight problems; returns {"problems": [...], **leader()} on every rank
    (`leader` runs on rank 0, only when nothing is wrong). When something is wrong rank 0 `report`s
    it before any rank returns, so no launcher stops rank 0 before it has spoken. Nothing here needs
    a process group. Rank 0 waits `timeout_s` for the others' checks (they build nothing); the others
    wait twice that + 60 s for the verdict (rank 0 may tokenize the default corpus first). A rank that
    does not arrive is named: the verdict then holds "startup_error" (rank 0 says it; rank 1 when rank 0
    is the one missing)."""
    pre = dist.PrefixStore("pentatron/preflight", store)
    pre.set(f"rank{rank}", json.dumps(problems))
    arriving = world
    if rank == 0:
        missing = _missing(pre, [f"rank{r}" for r in range(world)], timeout_s)
        if missing:
            ranks = ", ".join(k.removeprefix("rank") for k in missing)
            error = (f"rank(s) {ranks} of {world} did not reach the start-up check within {timeout_s:g} s "
                     "(stopped, crashed or still starting: see their output; distributed.timeout_s bounds this)")
            print(f"pentatron: error: {error}", file=sys.stderr, flush=True)
            verdict: dict[str, Any] = {"problems": [], "startup_error": error}
            arriving -= len(missing)
        else:
            merged = merge_problems([json.loads(pre.get(f"rank{r}")) for r in range(world)])
            verdict = {"problems": merged, **({} if merged else leader())}
            if merged:
                report(merged)
        pre.set("verdict", json.dumps(verdict))
    else:
        wait = 2 * timeout_s + 60.0 if verdict_timeout_s is None else verdict_timeout_s
        try:
            late = _missing(pre, ["verdict"], wait)
        except RuntimeError:  # the store went away with rank 0 (srun: it hosts it)
            late = ["verdict"]
        if late:
            error = f"rank 0 did not finish the start-up check within {wait:g} s (stopped or crashed?)"
            if rank == 1:
                print(f"pentatron: error: {error}", file=sys.stderr, flush=True)
            return {"problems": [], "startup_error": error}
        verdict = json.loads(pre.get("verdict"))
    pre.add("read", 1)
    stopping = verdict["problems"] or "startup_error" in verdict
    if rank == 0 and stopping and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # Under srun rank 0 hosts the store: stay until every arriving rank has the verdict, then all exit.
        deadline = time.monotonic() + 60
        while pre.add("read", 0) < arriving and time.monotonic() < deadline:
            time.sleep(0.05)
    return verdict


def merge_problems(per_rank: list[list[str]]) -> list[str]:
    """Each distinct problem once; one that only some ranks see names them."""
    world = len(per_rank)
    order: list[str] = []
    seen: dict[str, list[int]] = {}
    for rank, problems in enumerate(per_rank):
        for p in problems:
            if p not in seen:
                order.append(p)
                seen[p] = []
            seen[p].append(rank)
    return [p if len(seen[p]) == world else f"rank {', '.join(map(str, seen[p]))}: {p}" for p in order]


# PyTorch's c10d flight recorder. Each setting has an older TORCH_NCCL_* name (read by torch 2.11–2.13
# alike) and, in newer releases, a TORCH_FR_* alias; the user's value under either name is kept.
TRACE_BUFFER_ENV = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")
DUMP_FILE_ENV = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")
DUMP_ON_TIMEOUT_ENV = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)
TRACE_BUFFER_ENTRIES = 20000  # ops kept per process (torch's default is 2000; an entry is a few hundred bytes)
TORCH_TRACE_PREFIX = "torch_trace_rank_"  # + global rank: the dump file of each rank
DEFAULT_DUMP_PREFIX = "/tmp/nccl_trace_rank_"  # torch's own default


def torch_flight_recorder_env(flight_dir: Path, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the variables that make PyTorch's flight recorder trace every collective and dump it on a
    timeout into `flight_dir` (`<flight_dir>/torch_trace_rank_<r>`), each only where the user set it
    under neither of its names. Must run before the process group is created. Returns what it set."""
    env = os.environ if env is None else env
    wanted = {TRACE_BUFFER_ENV: str(TRACE_BUFFER_ENTRIES), DUMP_ON_TIMEOUT_ENV: "1",
              DUMP_FILE_ENV: str(Path(flight_dir) / TORCH_TRACE_PREFIX)}
    set_now = {}
    for names, value in wanted.items():
        if not any(n in env for n in names):
            env[names[0]] = set_now[names[0]] = value
    if DUMP_FILE_ENV[0] in set_now:
        Path(flight_dir).mkdir(parents=True, exist_ok=True)  # the dump is written by torch's watchdog thread
    return set_now


def torch_trace_dump_prefix(env: MutableMapping[str, str] | None = None) -> str:
    """Where PyTorch's flight recorder writes its per-rank dumps (the prefix; the rank is appended)."""
    env = os.environ if env is None else env
    return next((env[n] for n in DUMP_FILE_ENV if env.get(n)), DEFAULT_DUMP_PREFIX)


def init_distributed(device: torch.device, store: dist.Store | None = None, timeout_s: float = 600.0,
                     flight_dir: Path | None = None) -> None:
    """Join the default process group when launched with more than one process (NCCL on GPU, gloo on
    CPU), on `store` when the ranks already met through `rendezvous`. On NCCL, `flight_dir` (the run's
    `flight/`) receives PyTorch's flight-recorder dumps (`torch_flight_recorder_env`)."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and flight_dir is not None:
        torch_flight_recorder_env(flight_dir)
    # Its functions take the default group as a default argument, captured at import (torch.distributed
    # .checkpoint imports it): imported after this, they would keep that group and its worker threads
    # alive past `destroy_process_group`, into interpreter exit (see `ParallelContext.release`).
    import torch.distributed.nn  # noqa: F401
    if device.type == "cuda":
        torch.cuda.set_device(device)
    bound = process_group_device(device)
    if store is None:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **bound)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=timeout_s),
                                **bound)


def process_group_device(device: torch.device) -> dict[str, torch.device]:
    """`init_process_group`'s device binding: on CUDA `device_id`, so NCCL creates the world communicator
    at once (eagerly, where a hang or a bad network shows at start-up, not in the first training
    collective) and later groups can be split from it (`ncclCommSplit`, cheaper than a new
    communicator each); the CPU (gloo) path binds nothing, as before."""
    if device.type != "cuda":
        return {}
    return {"device_id": device if device.index is not None else torch.device("cuda", torch.cuda.current_device())}


def file_init_method(store: str | Path) -> str:
    """The `file://` init URL of a FileStore at `store`. The path is made absolute first: in
    `file://runs/lab/store` a relative path's first part would be read as a host name, and every rank
    would poll a file that no one creates until its timeout."""
    return Path(store).resolve().as_uri()


def shutdown_distributed(finished: bool) -> None:
    """Leave the process group. After a finished run every rank first meets at a barrier, so none
    destroys its connections while a peer still sends on them; after a failure the peers may never
    arrive, so the group is destroyed at once (the launcher stops the others)."""
    if not dist.is_initialized():
        return
    if finished and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def local_device(kind: str) -> torch.device:
    """The device for this process: LOCAL_RANK picks the GPU when CUDA is used."""
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device='cuda' but no CUDA device is available")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")
