"""Our recipe's predictions on a GPU it has not run on say so and carry the published frameworks' range
(issue 48, item 3; plan/unmeasured.py): the range is computed from the prediction, covers the band the
tuning rows of benchmarks/published_runs.toml measured, and another framework's recipe or a measured
(CPU) profile carries none. Hopper is calibrated by the recorded gpu_check run and says so instead."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pentatron.hardware.catalogue import get_gpu
from pentatron.plan.unmeasured import AMPERE, HOPPER, unmeasured
from tests.plan.test_cli import run

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_llama3_8b_on_8_a100_is_labelled_with_the_published_range(capsys):
    assert run(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "a100-80gb", "--top", "1", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["predictions"][0]
    u = p["unmeasured"]
    assert u["gpu"] == "a100-80gb" and p["calibrated"] is None
    lo, hi = u["mfu_range"]
    # the model predicts more than any framework measured: the range is the band itself, below the prediction
    assert p["mfu"] > AMPERE.high and (lo, hi) == pytest.approx((AMPERE.low, AMPERE.high))
    per_mfu = p["tokens_per_s_per_gpu"] / p["mfu"]
    assert u["tokens_per_s_per_gpu_range"] == pytest.approx([lo * per_mfu, hi * per_mfu])


def test_the_text_output_says_unmeasured_and_below_the_band_the_range_follows_the_prediction(capsys):
    from dataclasses import replace

    from pentatron.hardware.profile import Profile
    from pentatron.models.registry import get_model_config
    from pentatron.plan.layout import Workload
    from pentatron.plan.recipes import get_recipe
    from pentatron.plan.search import search

    assert run(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "a100-80gb", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "unmeasured: Pentatron's recipe has not run on a100-80gb" in out and "expect MFU 32-60%" in out
    # a communication-bound layout predicted below the band: [mfu * low/high, mfu]
    a100 = get_gpu("a100-80gb")
    w = Workload(get_model_config("debug"), 256, 64)
    p = search(w, a100, 64, top=1).ranked[0]
    u = unmeasured(p, a100)
    assert u is not None and u.mfu is not None and p.rate.mfu < AMPERE.high
    assert u.mfu == pytest.approx((p.rate.mfu * AMPERE.low / AMPERE.high, p.rate.mfu))
    # measured ground: a `pentatron bench` profile of the machine, or another framework's recipe (not ours)
    assert unmeasured(p, replace(a100, profile=Profile())) is None
    assert unmeasured(replace(p, layout=replace(p.layout, recipe=get_recipe("megatron"))), a100) is None
    # --headroom is the plan's margin, not another GPU: the same band
    assert unmeasured(p, replace(a100, headroom=0.1)) == u
    # a B200 has no band: labelled, without a range
    b200 = get_gpu("b200")
    ub = unmeasured(search(w, b200, 8, top=1).ranked[0], b200)
    assert ub is not None and ub.mfu is None and "no published framework measurement" in ub.line(0.5)


def test_hopper_is_calibrated_by_the_recorded_gpu_check(capsys):
    """The H200 run of benchmarks/gpu_check.py (benchmarks/measured/) calibrates our recipe on Hopper: the model
    reproduces the two runs the constants come from, and the run that was not used for them within 10 %."""
    from pentatron.observe.report import planner_layout
    from pentatron.plan.search import predict

    spec = importlib.util.spec_from_file_location("gpu_check", BENCHMARKS / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gc = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gc
    spec.loader.exec_module(gc)
    parts = json.loads((BENCHMARKS / "measured" / "gpu_check_h200_2026-12-04.json").read_text())["parts"]
    h200 = get_gpu("h200")

    def ratio(size: object, kernels: str, tokens_per_s: float, *extra: str) -> float:
        lay, w = planner_layout(gc.run_config(size, "cuda", *extra), 1, "cuda")  # the part's own run
        return w.global_batch * w.seq_len / tokens_per_s / predict(w, lay, h200, kernels=kernels).step.step

    assert ratio(gc.GPU, "fused", parts["train"]["tokens_per_s"]) == pytest.approx(1.0, abs=0.005)
    assert ratio(gc.GPU, "eager", parts["compile"]["eager_tokens_per_s"]) == pytest.approx(1.0, abs=0.005)
    assert ratio(gc.FP8_GPU, "eager", parts["fp8"]["runs"]["bf16"]["tokens_per_s"]) == pytest.approx(1.0, abs=0.1)
    assert run(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "unmeasured" not in out
    assert "calibrated: Pentatron's own step was measured (benchmarks/gpu_check.py on one H200" in out


def test_the_bands_are_what_the_cited_tuning_rows_measured():
    """Each band end is a tuning row's published MFU against the catalogue's dense peak (plan/unmeasured.py)."""
    from pentatron.plan.flops import model_flops_per_token

    spec = importlib.util.spec_from_file_location("planner_accuracy", BENCHMARKS / "planner_accuracy.py")
    assert spec is not None and spec.loader is not None
    acc = importlib.util.module_from_spec(spec)
    sys.modules["planner_accuracy"] = acc
    spec.loader.exec_module(acc)
    rows = {r.id: r for r in acc.load_rows()}

    def mfu(rid: str) -> float:
        r = rows[rid]
        assert r.split == "tuning", rid  # the band is chosen on tuning rows only
        peak = get_gpu(r.gpu.name if r.gpu.name in ("h100-sxm", "a100-80gb") else "h100").flops("bf16")
        return r.published_tps * model_flops_per_token(r.workload.cfg, r.workload.seq_len) / peak

    assert mfu("torchtitan-h100-t1-8b-8-fsdp") == pytest.approx(HOPPER.low, abs=0.01)
    assert mfu("mcore-h100-weak-16b") == pytest.approx(HOPPER.high, abs=0.01)
    assert mfu("megatron2022-22b-full") == pytest.approx(AMPERE.low, abs=0.01)
    assert mfu("torchtitan-llama2-13b-none") == pytest.approx(AMPERE.high, abs=0.01)
