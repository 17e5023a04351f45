"""Run a function on N real processes joined by a gloo process group (the basis of every parity test).

    results = run_ranks(fn, world_size=4, args=(cfg,))   # fn(rank, world_size, *args) on each rank

`fn` must be importable (defined at module level). Each rank gets a gloo process group initialised
through a FileStore in a fresh temporary directory (no ports to race for), one intra-op thread (the
CI machine has 2 cores; PENTATRON_TEST_RANK_THREADS=N for N, to run the suite under other kernel
blockings: docs/testing.md), the caller's environment as it is at the call, in strict comm mode unless
that environment says PENTATRON_STRICT_COMM=0 (NCCL's contract emulated on gloo: distributed/nccl_contract.py),
and its return value is sent back to the caller. A failure on any rank is re-raised here with that rank's
traceback; a rank that does not finish within `timeout` seconds fails the test instead of hanging it.

Ranks are forked from multiprocessing's fork server, which imports torch and the trainer once per test
session: a spawned rank spent ~3 s of CPU importing them, 8 ranks ~12 s of wall time on 2 cores, in every
launch. A forked rank is as fresh as a spawned one (the server only imported; it never ran torch code
or started a thread) and runs `fn` as spawn would.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pentatron.distributed.comm import STRICT_ENV
from pentatron.distributed.launch import file_init_method, shutdown_distributed

# Imported once by the fork server (torch.distributed.nn before any process group, as init_distributed
# wants); everything else a rank needs is imported on first use, as under spawn. torch._dynamo: the
# train.compile cases import it (~1.4 s CPU per rank; nothing else does, tests/test_imports.py); DCP: the
# trainer imports it only to save or load.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.nn", "torch._dynamo", "torch.distributed.checkpoint",
           "numpy", "pentatron.train.trainer", "tests.reference_loop"]


RANK_THREADS_ENV = "PENTATRON_TEST_RANK_THREADS"


class RankFailed(RuntimeError):
    pass


def rank_threads() -> int:
    """Intra-op threads of each rank and of the 1-process references (1 unless the environment says)."""
    return int(os.environ.get(RANK_THREADS_ENV, "1"))


def oversubscription(world_size: int) -> float:
    """How many times over the machine's cores this launch's threads ask for: its ranks × their threads ×
    the test workers running launches side by side (pytest-xdist), over the cores (at least 1)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1.0, world_size * rank_threads() * workers / (os.cpu_count() or 1))


def _entry(fn: Callable[..., Any], rank: int, world_size: int, store_path: str, args: tuple,
           results: mp.Queue, environ: dict[str, str]) -> None:
    # The fork server's environment is the one it started with: take the caller's, as spawn would.
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(rank_threads())
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    finished = False
    try:
        dist.init_process_group("gloo", init_method=file_init_method(store_path), rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
        finished = True
    except BaseException:  # noqa: BLE001 - everything must reach the parent, or it would wait forever
        results.put((rank, False, traceback.format_exc()))
    finally:
        # as training leaves (distributed/launch.py): a barrier first when every rank finished, so that
        # none tears its connections down while a peer still uses them
        shutdown_distributed(finished)


def _states(procs: list[Any]) -> str:
    """What every rank's process is doing: a peer that died (a signal, an exit) is often the cause of the
    error another rank reports (gloo's "Connection reset by peer")."""
    def state(code: int | None) -> str:
        return "running" if code is None else f"killed by signal {-code}" if code < 0 else f"exited {code}"

    return ", ".join(f"rank {r} {state(p.exitcode)}" for r, p in enumerate(procs))


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 180.0) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` processes; return results by rank. `timeout` bounds a
    launch (a hang guard) with a core per rank thread; oversubscribed, every rank runs that much slower, so
    the bound scales with `oversubscription` (a pp4 launch of 2 threads per rank on 2 cores: 4×)."""
    timeout *= oversubscription(world_size)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results: mp.Queue = ctx.Queue()
    # Strict by default: every multi-process test holds gloo to NCCL's contract unless it opts out.
    environ = {STRICT_ENV: "1", **os.environ}
    with tempfile.TemporaryDirectory(prefix="pentatron-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, store, args, results, environ),
                             daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outs: dict[int, Any] = {}
        ok = False
        try:
            while len(outs) < world_size:
                try:
                    rank, ok, payload = results.get(timeout=timeout)
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - set(outs))
                    raise RankFailed(f"ranks {missing} did not finish within {timeout:.0f}s (hang?)") from None
                if not ok:
                    raise RankFailed(f"rank {rank} failed:\n{payload}\nevery rank then: {_states(procs)}")
                outs[rank] = payload
            ok = True
        finally:
            # After a failure the other ranks are usually blocked in a collective: stop them now.
            for p in procs:
                p.join(timeout=30 if ok else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [outs[r] for r in range(world_size)]
