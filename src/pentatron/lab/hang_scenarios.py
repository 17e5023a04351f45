"""Distributed bugs on real gloo ranks, each run through the real `Comm` with the flight recorder:
a rank that skips an all-reduce, a rank that stops (SIGSTOP) mid-step, and one that stops inside a
checkpoint save (DCP's collectives, outside the comm layer). Used by `pentatron lab collective` and by
tests/observe.

Each scenario function runs on every rank (see lab/ranks.RankGroup) and mimics a training loop:
per step a "gradient" all-reduce then a "loss" all-reduce, both of 8 floats, from two lines.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from pentatron.distributed.context import ParallelContext
from pentatron.layout import ParallelLayout
from pentatron.observe.flight_recorder import note_step
from pentatron.observe.watchdog import attach_flight_recorder

STEPS = 4


def skip_allreduce(rank: int, world: int, run_dir: str, timeout_s: float, check: bool, skip_rank: int,
                   skip_step: int) -> None:
    """`skip_rank` skips its gradient all-reduce at `skip_step`. Its later all-reduces silently pair
    with the other ranks' earlier ones (every sum is wrong from then on); at the end the others wait
    in one all-reduce more than it ever enters, while it does something else."""
    ctx = ParallelContext.from_layout(ParallelLayout(dp=world), "cpu")
    dog = attach_flight_recorder(ctx, Path(run_dir) / "flight", timeout_s, check)
    sums = []
    for step in range(1, STEPS + 1):
        note_step(ctx.comm, step)
        grad = torch.full((8,), float(rank + 1))
        if not (rank == skip_rank and step == skip_step):
            ctx.comm.all_reduce(grad, "dp")  # the gradient all-reduce
        loss = torch.full((8,), 100.0 * (rank + 1))
        ctx.comm.all_reduce(loss, "dp")  # the loss all-reduce
        sums.append(float(loss[0]))
    print(f"rank {rank}: loss sums per step {sums}", flush=True)
    if rank == skip_rank:
        time.sleep(10 * timeout_s + 30)  # e.g. loading data: it never enters the missing all-reduce
    ctx.comm.barrier()
    if dog is not None:
        dog.stop()


def loop_until_stopped(rank: int, world: int, run_dir: str, timeout_s: float, steps: int) -> None:
    """All-reduces in a loop; after step 3 each rank writes `rank<r>.step3` (the test then SIGSTOPs one)."""
    ctx = ParallelContext.from_layout(ParallelLayout(dp=world), "cpu")
    dog = attach_flight_recorder(ctx, Path(run_dir) / "flight", timeout_s, check=False)
    for step in range(1, steps + 1):
        note_step(ctx.comm, step)
        ctx.comm.all_reduce(torch.ones(8), "dp")
        if step == 3:
            (Path(run_dir) / f"rank{rank}.step3").write_text("")
        time.sleep(0.02)
    if dog is not None:
        dog.stop()


def stop_in_checkpoint_save(rank: int, world: int, run_dir: str, timeout_s: float, stop_rank: int) -> None:
    """A step, then a checkpoint save through the trainer's `CheckpointStore` (watched as the trainer watches
    it); `stop_rank` SIGSTOPs itself in the save once the `.tmp` directory is there, so the other ranks wait in
    DCP's own collectives, which the comm layer never sees (they stalled until the process group's timeout)."""
    import os
    import signal

    import pentatron.checkpoint.store as store_module
    from pentatron.checkpoint.store import CheckpointStore

    ctx = ParallelContext.from_layout(ParallelLayout(dp=world), "cpu")
    flight = Path(run_dir) / "flight"
    dog = attach_flight_recorder(ctx, flight, timeout_s, check=False)
    while not (flight / f"rank{rank}.heartbeat.json").exists():  # the watched rank's heartbeat is known
        time.sleep(0.05)
    note_step(ctx.comm, 1)
    ctx.comm.all_reduce(torch.ones(8), "dp")
    if rank == stop_rank:
        def write_pieces_then_stop(*args: object) -> None:
            (Path(run_dir) / f"rank{rank}.stopping").write_text("")
            os.kill(os.getpid(), signal.SIGSTOP)

        store_module.write_pieces = write_pieces_then_stop
    store = CheckpointStore(Path(run_dir) / "ck", barrier=ctx.comm.barrier, watch=ctx.comm.outside)
    store.save(1, {"model": {"w": torch.full((64,), float(rank))}}, {"step": 1}, pieces={})
    if dog is not None:
        dog.stop()
