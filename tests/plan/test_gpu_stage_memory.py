"""benchmarks/gpu_stage_memory.py, the prepared GPU check of the 405B pipeline rows' memory, runs end to
end at toy size on a CPU (real FSDP2 on a 1-rank gloo mesh, the stage-0 schedule), so that a session
lent a GPU only has to run it; and its planner side accounts for the run's own state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_stage_memory.py"


def test_toy_stage_trains_and_reports_its_parameters():
    done = subprocess.run([sys.executable, str(SCRIPT), "--shape", "toy", "--one"], capture_output=True,
                          text=True, timeout=300, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # per layer: 2 norms (2 x 256) + wq 256x64 + wk, wv 256x16 + wo 64x256 + w1, w3 256x128 + w2 128x256
    per_layer = 512 + 16384 + 2 * 4096 + 16384 + 3 * 32768
    assert out["fp32_params_bytes"] == 4 * (3 * per_layer + 64 * 256)  # + the embedding's 64 rows


def test_planner_side_swaps_the_sharded_state_for_the_runs_own():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_stage_memory as g
    finally:
        sys.path.remove(str(SCRIPT.parent))
    shape = g.SHAPES["405b"]
    without, with_params = g.planner_live_bytes(shape, 0), g.planner_live_bytes(shape, 10 * g.GiB)
    assert with_params["live"] - without["live"] == 10 * g.GiB
    # no pipeline neighbour: only the all-gathered block input is left of the communication buffers
    assert without["comm_buffers"] == 4 * 8192 * 16384 * 2  # [4 x 8192 x 16384] bf16
