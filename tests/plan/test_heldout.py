"""The planner's quoted accuracy is out of sample (issue 48, item 1): benchmarks/published_runs.toml splits
its sources into tuning and held-out ones, fixed on 2026-12-03, and the figure `pentatron plan` prints is
recomputed here from the held-out rows of the file, so it cannot drift from the planner or the data."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import tomllib

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def acc():
    spec = importlib.util.spec_from_file_location("planner_accuracy", BENCHMARKS / "planner_accuracy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["planner_accuracy"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_the_split_is_fixed_by_whole_sources_with_every_framework_held_out(acc):
    data = tomllib.loads((BENCHMARKS / "published_runs.toml").read_text())
    assert data["split"]["date"] == "2026-12-03"
    rows = acc.load_rows()  # check_split: every source names its split, [split] lists the held-out ones
    held = [r for r in rows if r.split == "heldout"]
    assert 3 * len(held) >= len(rows)
    # every framework recipe a source is evaluated with has a held-out source (whole sources: the split is
    # the source's), and the playbook (its DP-scaling cells among them) is held out
    recipes = {name: src["recipe"] for name, src in data["sources"].items()}
    assert {recipes[r.source] for r in held} == set(recipes.values())
    assert data["sources"]["playbook"]["split"] == "heldout"


def test_a_source_without_a_split_is_refused(acc, tmp_path):
    text = (BENCHMARKS / "published_runs.toml").read_text().replace('split = "tuning"\n', "", 1)
    (tmp_path / "runs.toml").write_text(text)
    with pytest.raises(ValueError, match="without split"):
        acc.load_rows(tmp_path / "runs.toml")


def test_the_printed_accuracy_is_the_held_out_one_recomputed_from_the_file(acc):
    """plan/report.py's line equals what planner_accuracy computes on the held-out rows now; after a
    planner or data change, rerun `python benchmarks/planner_accuracy.py --split heldout` and copy its
    last line into MEASURED_ACCURACY."""
    from pentatron.plan.report import ACCURACY_COMMAND, MEASURED_ACCURACY, table_notes

    held = [r for r in acc.load_rows() if r.split == "heldout"]
    results = acc.evaluate(held)
    assert acc.heldout_accuracy(results) == MEASURED_ACCURACY
    notes = table_notes(0.05)
    assert MEASURED_ACCURACY in notes and ACCURACY_COMMAND in notes
    assert "--split heldout" in ACCURACY_COMMAND
