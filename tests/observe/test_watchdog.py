"""The hang watchdog and check mode on real gloo ranks: a skipped all-reduce and a SIGSTOPped rank."""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path

import torch

from pentatron.lab.hang_scenarios import loop_until_stopped, skip_allreduce, stop_in_checkpoint_save
from pentatron.lab.ranks import RankGroup
from pentatron.observe.watchdog import HANG_EXIT_CODE

TIMEOUT_S = 2.0


def test_skipped_allreduce_is_caught_at_once_in_check_mode(tmp_path: Path):
    group = RankGroup(skip_allreduce, 2, tmp_path, args=(str(tmp_path), 60.0, True, 1, 2))
    codes = group.wait(timeout_s=120)
    assert codes == [1, 1], (codes, group.log(0), group.log(1))
    for r in (0, 1):
        log = group.log(r)
        assert "CollectiveMismatch" in log
        # Both sides named: rank 0 at its gradient all-reduce, rank 1 already at its loss all-reduce.
        assert "rank 0 calls dp all_reduce #3" in log and "rank 1 calls dp all_reduce #3" in log
        assert "at step 2" in log and "hang_scenarios.py" in log
    assert not (tmp_path / "flight" / "diagnosis.txt").exists()  # failed at once, no hang


def test_skipped_allreduce_is_caught_by_the_watchdog(tmp_path: Path):
    start = time.monotonic()
    group = RankGroup(skip_allreduce, 2, tmp_path, args=(str(tmp_path), TIMEOUT_S, False, 1, 2))
    codes = group.wait(timeout_s=120)
    elapsed = time.monotonic() - start
    assert codes == [HANG_EXIT_CODE, HANG_EXIT_CODE], (codes, group.log(0), group.log(1))
    diagnosis = (tmp_path / "flight" / "diagnosis.txt").read_text()
    # 4 steps × 2 all-reduces on rank 0; rank 1 skipped one, so it never enters #8.
    assert "rank 1 has not entered dp all_reduce #8; rank 0 waits there" in diagnosis, diagnosis
    assert "rank 1's last op: dp all_reduce #7" in diagnosis and "completed" in diagnosis
    assert "time.sleep" in diagnosis  # where rank 1's main thread is instead
    assert diagnosis.rstrip().endswith("stuck rank: 1")
    assert "stuck rank(s): 1" in group.log(0) and "stuck rank(s): 1" in group.log(1)
    assert "loss sums per step" in group.log(1)
    # PyTorch's own flight recorder, dumped by every rank before it exits (NCCL's timeout comes later).
    prefix = tmp_path / "flight" / "torch_trace_rank_"
    assert f"PyTorch flight recorder (gloo) dumps: {prefix}<rank>" in diagnosis, diagnosis
    if hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):
        assert "(written: ranks 0, 1)" in diagnosis, diagnosis
        trace = pickle.loads(Path(f"{prefix}0").read_bytes())
        assert any("all_reduce" in e["profiling_name"] for e in trace["entries"])
    assert elapsed < 60  # the watchdog, not the 300 s process-group timeout, ended the run


def test_sigstopped_rank_is_named(tmp_path: Path):
    group = RankGroup(loop_until_stopped, 2, tmp_path, args=(str(tmp_path), TIMEOUT_S, 100_000))
    try:
        deadline = time.monotonic() + 90
        # Stop it once it has written a heartbeat, which the diagnosis then shows instead of a dump.
        while not ((tmp_path / "rank1.step3").exists() and (tmp_path / "flight" / "rank1.heartbeat.json").exists()):
            assert time.monotonic() < deadline, group.log(1)
            time.sleep(0.05)
        os.kill(group.procs[1].pid, signal.SIGSTOP)
        group.procs[0].join(timeout=60)
        assert group.procs[0].exitcode == HANG_EXIT_CODE, group.log(0)
    finally:
        group.kill()
    diagnosis = (tmp_path / "flight" / "diagnosis.txt").read_text()
    assert "rank 1 did not answer the dump request" in diagnosis, diagnosis
    assert "rank 1 has not entered dp all_reduce #" in diagnosis and "rank 0 waits there" in diagnosis
    assert "last heartbeat" in diagnosis and "rank 1's last op: dp all_reduce #" in diagnosis
    assert diagnosis.rstrip().endswith("stuck rank: 1")
    assert "stuck rank(s): 1" in group.log(0)


def test_a_rank_stopped_during_a_checkpoint_save_is_named(tmp_path: Path):
    """A save's collectives are DCP's own, outside the comm layer: a rank stopped in one went unnamed until
    the process group's timeout (135 s with distributed.timeout_s=20) and the save failed with a gloo timeout.
    The save is one watched op now: named like a rank stopped mid-step."""
    start = time.monotonic()
    group = RankGroup(stop_in_checkpoint_save, 2, tmp_path, args=(str(tmp_path), TIMEOUT_S, 1))
    try:
        group.procs[0].join(timeout=60)
        assert group.procs[0].exitcode == HANG_EXIT_CODE, (group.procs[0].exitcode, group.log(0), group.log(1))
    finally:
        group.kill()
    assert (tmp_path / "rank1.stopping").exists()  # it stopped inside the save, not before
    diagnosis = (tmp_path / "flight" / "diagnosis.txt").read_text()
    assert "rank 1 did not answer the dump request" in diagnosis, diagnosis
    assert "rank 0: waits in world checkpoint_save #" in diagnosis and "store.py" in diagnosis, diagnosis
    assert diagnosis.rstrip().endswith("stuck rank: 1")
    assert "stuck rank(s): 1" in group.log(0)
    assert time.monotonic() - start < 60  # the watchdog, not the 300 s process-group timeout
