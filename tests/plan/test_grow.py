"""`pentatron plan` when nothing fits names the smallest GPU count that does and its best layout
(`plan/grow.py`), and `--headroom` keeps that share of each GPU's memory out of every recommendation."""

from __future__ import annotations

import json

from pentatron.hardware.catalogue import GiB, get_gpu
from pentatron.models.registry import get_model_config
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
    w, gpu = Workload(get_model_config("llama3-70b"), 4096, 256), get_gpu("h100")
    below = [c for c in candidate_counts(2, grown["gpus"], 8) if c < grown["gpus"]]
    assert below and not fits_on(w, gpu, below[-1], {"recipe": PENTATRON})  # the count just below does not fit
    lay = grown["prediction"]["layout"]
    assert lay["dp"] * lay["tp"] * lay["pp"] * lay["cp"] == grown["gpus"]
    assert run([*SEVENTY_B, "--gpus", "2"]) == 1
    text = capsys.readouterr().out
    assert f"fits from {grown['gpus']} x h100-sxm" in text and f"plan it with --gpus {grown['gpus']}" in text


def test_headroom_keeps_memory_free_in_every_recommendation(capsys):
    assert run([*SEVENTY_B, "--gpus", "32", "--json", "--top", "3"]) == 0
    plain = json.loads(capsys.readouterr().out)["predictions"]
    assert run([*SEVENTY_B, "--gpus", "32", "--json", "--top", "3", "--headroom", "0.2"]) == 0
    kept = json.loads(capsys.readouterr().out)["predictions"]
    budget = 0.8 * 80 * GiB
    assert all(p["memory_bytes"]["total"] <= budget for p in kept)
    assert any(p["memory_bytes"]["total"] > budget for p in plain)  # the headroom changed the advice
    assert run([*SEVENTY_B, "--gpus", "32", "--headroom", "1.5"]) == 2
    assert "--headroom must be within [0, 1)" in capsys.readouterr().err
