"""research/gpu_stage_memory.py, the prepared GPU check of the 405B pipeline rows' memory, runs end to
end at toy size on a CPU (real FSDP2 on a 1-rank gloo mesh, rank 0's schedule for 1F1B and for
interleaved stages), so that a session lent a GPU only has to run it; and its planner side accounts for
the run's own state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gpu_stage_memory as g
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "gpu_stage_memory.py"


TOY = ("toy", "toy-interleaved")


@pytest.fixture(scope="module")
def toy_runs() -> dict[str, dict]:
    """Both toy patterns in one fresh process, as `--one` runs each (one interpreter and torch start-up for
    the two; each measure() opens and destroys its own 1-rank gloo group)."""
    code = ("import json, sys, torch; sys.path.insert(0, sys.argv[1]); import gpu_stage_memory as g; "
            "print(json.dumps({s: g.measure(g.SHAPES[s], torch.device('cpu')) for s in sys.argv[2:]}))")
    done = subprocess.run([sys.executable, "-c", code, str(SCRIPT.parent), *TOY], capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shape", TOY)
def test_toy_rank_trains_and_reports_its_parameters(toy_runs, shape):
    out = toy_runs[shape]
    # per layer: 2 norms (2 x 256) + wq 256x64 + wk, wv 256x16 + wo 64x256 + w1, w3 256x128 + w2 128x256
    per_layer = 512 + 16384 + 2 * 4096 + 16384 + 3 * 32768
    assert out["fp32_params_bytes"] == 4 * (3 * per_layer + 64 * 256)  # + the embedding's 64 rows
    assert out["gradients_reduced"]  # each stage's post-backward by hand left sharded gradients


def _planner(name: str, fp32_params: int) -> dict:
    return g.planner_live_bytes(g.SHAPES[name], fp32_params)


def test_planner_side_swaps_the_sharded_state_for_the_runs_own():
    without, with_params = _planner("405b", 0), _planner("405b", 10 * 2**30)
    assert with_params["live"] - without["live"] == 10 * 2**30


def test_planner_side_counts_torchs_receive_buffers_as_the_run_makes_them():
    gathered = 4 * 8192 * 16384 * 2  # the all-gathered block input, [4 x 8192 x 16384] bf16
    shard = 4 * 1024 * 16384 * 2  # one micro-batch's sequence shard at a stage boundary
    # 1F1B stage 0: a gradient buffer per micro-batch, no activation buffers
    assert _planner("405b", 0)["comm_buffers"] == gathered + 8 * shard
    # interleaved rank 0: gradient buffers for both stages; stage 8's 8 activation buffers are the
    # checkpointed inputs of its 8 micro-batches in flight, counted with the activations
    assert _planner("405b-interleaved", 0)["comm_buffers"] == gathered + 16 * shard
