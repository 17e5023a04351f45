"""The multi-process helper every parity test builds on: real gloo ranks, errors and hangs reported."""

import time

import pytest
import torch
import torch.distributed as dist

from pentatron.distributed.comm import STRICT_ENV, Comm, CommLedger
from pentatron.distributed.context import ParallelContext
from tests.multiprocess import RankFailed, oversubscription, run_ranks


def _all_reduce_rank(rank: int, world_size: int, scale: float) -> float:
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return float(t)


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def _strict(rank: int, world_size: int) -> bool:
    return Comm(ParallelContext.single(), CommLedger()).strict


def _hang(rank: int, world_size: int) -> None:
    time.sleep(30)


def test_ranks_really_communicate():
    assert run_ranks(_all_reduce_rank, 4, args=(2.0,)) == [12.0] * 4


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(RankFailed, match=r"rank 1 failed:(.|\n)*boom on purpose"):
        run_ranks(_fail_on_rank_1, 2, timeout=60)


def test_a_hang_fails_instead_of_blocking():
    bound = 3 * oversubscription(2)  # the bound of a quiet machine, scaled as run_ranks scales it
    with pytest.raises(RankFailed, match=f"did not finish within {bound:.0f}s"):
        run_ranks(_hang, 2, timeout=3)


def test_ranks_run_in_strict_comm_mode_unless_the_caller_opts_out(monkeypatch):
    monkeypatch.delenv(STRICT_ENV, raising=False)
    assert run_ranks(_strict, 2) == [True, True]  # NCCL's contract on gloo, by default
    monkeypatch.setenv(STRICT_ENV, "0")
    assert run_ranks(_strict, 2) == [False, False]


def test_the_hang_bound_scales_with_how_far_the_cores_are_oversubscribed(monkeypatch):
    from tests import multiprocess

    monkeypatch.setattr(multiprocess.os, "cpu_count", lambda: 2)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.setenv(multiprocess.RANK_THREADS_ENV, "2")
    assert multiprocess.oversubscription(4) == 8.0  # 4 ranks x 2 threads x 2 workers on 2 cores
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    monkeypatch.setenv(multiprocess.RANK_THREADS_ENV, "1")
    assert multiprocess.oversubscription(2) == 1.0 and multiprocess.oversubscription(1) == 1.0
