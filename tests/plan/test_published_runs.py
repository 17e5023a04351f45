"""The published-runs validation data stays loadable and self-describing (issue 10): every row parses
with its exact layout, names its source, which cites where its figures and recipe were read; and the
network fit behind the playbook rows' hardware recovers a known latency and bandwidth."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_every_published_row_loads_and_is_evaluated():
    acc = _load("planner_accuracy")
    import tomllib

    data = tomllib.loads((BENCHMARKS / "published_runs.toml").read_text())
    for name, src in data["sources"].items():
        assert src.get("cite") and src.get("url") and src.get("status"), name
    rows = acc.load_rows()
    assert len(rows) >= 40 and len({r.source for r in rows}) >= 5
    assert len({r.id for r in rows}) == len(rows)
    results = acc.evaluate(rows)
    assert all(r.pred.rate.tokens_per_s_per_gpu > 0 for r in results)
    summary = acc.summary(results)
    assert summary["all"]["n"] == len(rows)


def test_ring_fit_recovers_latency_and_bandwidth():
    fit = _load("fit_ring_alpha_beta")
    ranks = np.array([16.0, 32, 64, 128, 256, 512])
    alpha, busbw, size = 30e-6, 300e9, 256e6
    seconds = (ranks - 1) * alpha + (ranks - 1) / ranks * size / busbw
    a, b = fit.fit(ranks, seconds, size)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(busbw, rel=1e-9)
