"""`pentatron plan` when nothing fits names the smallest GPU count that does and its best layout
(`plan/grow.py`), and `--headroom` (default: the held-out memory error) is a margin over every prediction it
recommends: predicted x (1 + headroom) <= the GPU's memory."""

from __future__ import annotations

import json
import re

from pentatron.hardware.catalogue import GiB, get_gpu, with_overrides
from pentatron.models.registry import get_model_config
from pentatron.plan.cli import DEFAULT_HEADROOM
from pentatron.plan.grow import candidate_counts, fits_on
from pentatron.plan.layout import Workload
from pentatron.plan.recipes import PENTATRON
from tests.plan.test_cli import run

SEVENTY_B = ["plan", "--model", "llama3-70b", "--seq", "4096", "--global-batch", "256"]


def test_candidate_counts_are_powers_of_two_and_whole_nodes():
    assert candidate_counts(2, 64, 8) == [4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert candidate_counts(64, 100, 8) == [72, 80, 88, 96]


def test_nothing_fits_names_the_smallest_count_that_does(capsys):
    assert run([*SEVENTY_B, "--gpus", "2", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    grown = out["smallest_fitting"]
    w, gpu = Workload(get_model_config("llama3-70b"), 4096, 256), with_overrides(get_gpu("h100"),
                                                                                  headroom=DEFAULT_HEADROOM)
    below = [c for c in candidate_counts(2, grown["gpus"], 8) if c < grown["gpus"]]
    assert below and not fits_on(w, gpu, below[-1], {"recipe": PENTATRON})  # the count just below does not fit
    lay = grown["prediction"]["layout"]
    assert lay["dp"] * lay["tp"] * lay["pp"] * lay["cp"] == grown["gpus"]
    assert run([*SEVENTY_B, "--gpus", "2"]) == 1
    text = capsys.readouterr().out
    assert f"fits from {grown['gpus']} x h100-sxm" in text and f"plan it with --gpus {grown['gpus']}" in text


def test_headroom_is_a_margin_over_every_recommended_prediction(capsys):
    assert run([*SEVENTY_B, "--gpus", "32", "--top", "1"]) == 0  # the default, said in the plan
    text = capsys.readouterr().out
    assert f"memory headroom {DEFAULT_HEADROOM:.0%}: a layout fits if predicted x {1 + DEFAULT_HEADROOM:g}" in text
    assert f"with the {DEFAULT_HEADROOM:.0%} headroom) -> fits" in text
    fitting = int(re.search(r"valid, ([\d,]+) fit in memory", text).group(1).replace(",", ""))
    assert run([*SEVENTY_B, "--gpus", "32", "--json", "--top", "3", "--headroom", "0.2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"]["memory_budget_bytes"] == 80 * GiB / 1.2 and out["hardware"]["hbm_bytes"] == 80 * GiB
    assert all(p["memory_bytes"]["total"] * 1.2 <= 80 * GiB for p in out["predictions"])
    assert out["search"]["fitting"] < fitting  # the larger margin changed what fits
    assert run([*SEVENTY_B, "--gpus", "32", "--headroom", "1.5"]) == 2
    assert "--headroom must be within [0, 1)" in capsys.readouterr().err
