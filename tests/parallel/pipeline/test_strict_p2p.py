"""Strict comm mode can fail: on 2 real gloo ranks the engine's own p2p plan runs a 1F1B step, then the
pre-issue-35 order (send at once, receive lazily; `legacy_plan`) deadlocks, as it would under NCCL, and
the hang watchdog names both ranks within its timeout."""

from __future__ import annotations

import time
from pathlib import Path

from pentatron.lab.ranks import RankGroup
from pentatron.observe.watchdog import HANG_EXIT_CODE
from tests.parallel.pipeline.strict_scenarios import new_then_legacy_order

TIMEOUT_S = 2.0


def test_the_old_issue_order_hangs_in_strict_mode_and_the_watchdog_names_the_ranks(tmp_path: Path):
    start = time.monotonic()
    group = RankGroup(new_then_legacy_order, 2, tmp_path, args=(str(tmp_path), TIMEOUT_S, "1f1b", 4))
    codes = group.wait(timeout_s=120)
    elapsed = time.monotonic() - start
    logs = [group.log(r) for r in (0, 1)]
    # the diagnosing rank exits with the watchdog's code; its peer too, or with 1 when its blocked send
    # fails first because the diagnosing rank has gone (a race on a loaded machine)
    assert HANG_EXIT_CODE in codes and set(codes) <= {HANG_EXIT_CODE, 1}, (codes, *logs)
    for r in (0, 1):
        assert f"rank {r}: step 1 (p2p_plan) done" in logs[r] and "step 2 (legacy order) done" not in logs[r]
    diagnosis = (tmp_path / "flight" / "diagnosis.txt").read_text()
    # each waits in its send for the other's receive, which it posts only after its own send: a cycle
    for me, peer in ((0, 1), (1, 0)):
        assert f"rank {me} has not entered pp recv from rank {peer} #" in diagnosis, diagnosis
        assert f"rank {me}: waits in pp send to rank {peer} #" in diagnosis, diagnosis
    assert diagnosis.rstrip().endswith("stuck ranks: 0, 1"), diagnosis
    assert any("stuck rank(s): 0, 1" in log for log, code in zip(logs, codes) if code == HANG_EXIT_CODE), logs
    assert elapsed < 60  # the watchdog, not the process-group timeout, ended the run
