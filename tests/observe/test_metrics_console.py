"""The console's step table (observe/metrics.py) as a log file shows it: an ETA column from this start's step
times, the first step's start-up and compile time left out once later steps exist."""

from __future__ import annotations

from pathlib import Path

from pentatron.observe.metrics import MetricsLogger, eta


def test_eta_is_steps_left_times_the_mean_recent_step_time():
    assert eta([], 10) == "-"
    assert eta([3.0], 10) == "0:00:30"  # only the first step so far
    assert eta([60.0, 1.0, 3.0], 90) == "0:03:00"  # the first step (start-up, compile) left out
    assert eta([100.0] + [2.0] * 20, 5400) == "3:00:00"  # the last 20
    assert eta([1.0, 1.0], 0) == "0:00:00"


def test_a_piped_log_has_the_eta_column(tmp_path: Path, capsys):
    log = MetricsLogger(tmp_path, total_steps=4, tensorboard=False, progress=False)
    for step, t in ((1, 9.0), (2, 1.0), (3, 1.0)):
        log.log({"step": step, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0, "mfu": 0.1,
                 "peak_mem_bytes": 2**20, "step_time_s": t}, console=True)
    log.close()
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "tokens/s all" in line)
    assert header.split()[-1] == "ETA"
    rows = [line.split() for line in lines if line.split() and line.split()[0] in {"1", "2", "3"}]
    assert [r[-1] for r in rows] == ["0:00:27", "0:00:02", "0:00:01"]
