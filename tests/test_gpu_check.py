"""benchmarks/gpu_check.py, the prepared device check, at toy size on CPU: every part runs and reports
real numbers, so the command a GPU host will run cannot rot unseen."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "gpu_check", Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py")
assert _spec is not None and _spec.loader is not None
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check
_spec.loader.exec_module(gpu_check)

PARTS = {"kernel_rates", "train", "sdpa_backend", "ring_kernel", "documents", "stage_startup", "syncs", "fp8",
         "compile"}


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_every_part_runs_at_toy_size_with_real_numbers(tmp_path: Path, capsys):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--toy", "--out", str(out)]) == 0, capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["toy"] is True and set(r["parts"]) == PARTS
    p = r["parts"]
    # on a CPU train.compile "auto" is eager: the compiled-vs-eager part is CUDA's (compile_speed.py is the CPU's)
    assert p.pop("compile")["status"].startswith("skipped: train.compile 'auto' is eager on a CPU")
    assert all(q["status"] == "ok" for q in p.values()), {k: q["status"] for k, q in p.items()}
    t = p["train"]
    assert t["steps"] == gpu_check.TOY.steps and all(_number(t[k]) and t[k] > 0 for k in (
        "tokens_per_s", "mfu", "step_time_s", "peak_allocated_gib", "setup_peak_gib", "model_parameters"))
    assert "since training began" in t["memory_kind"] and t["peak_reserved_gib"] is None  # CPU: no reserved
    assert _number(t["planner"]["tensors_gib"]) and t["planner"]["total_gib"] > t["planner"]["tensors_gib"]
    assert t["planner"]["kernels"] == "eager" and t["compiled"] is None  # predicted as run: eager on a CPU
    assert p["sdpa_backend"]["backend"] == "flash" and p["sdpa_backend"]["sdpa_ops"]
    ring = p["ring_kernel"]
    assert ring["all_ok"] and len(ring["cases"]) == 4
    assert all(_number(e) and e < c["tolerance"] for c in ring["cases"] for e in c["max_rel_err"].values())
    docs = p["documents"]  # CPU: the per-segment loop in fp32 against itself in fp64
    assert docs["all_ok"] and docs["kernel"] == "per-segment SDPA loop" and docs["documents"] > 1
    assert all(_number(e) and e < docs["tolerance"] for e in docs["max_rel_err"].values())
    st = p["stage_startup"]
    assert st["weights_finite"] and _number(st["startup_s"]) and st["stage_parameters"] > 0
    # Only the stage is materialised: its peak is about its own parameters, far from the whole model's.
    assert 0.5 < st["peak_over_stage_params"] < 3 and st["stage_param_gib"] < st["full_model_fp32_gib"]
    assert _number(p["syncs"]["syncs_per_step"]) and p["syncs"]["syncs_per_step"] > 0
    fp8 = p["fp8"]  # the same stack, data and seed in bf16 and through train.fp8: real speeds, the same training
    assert set(fp8["runs"]) == {"bf16", "tensorwise", "rowwise"} and set(fp8["speedup"]) == {"tensorwise", "rowwise"}
    for run in fp8["runs"].values():
        assert run["steps"] == gpu_check.FP8_TOY.steps and _number(run["tokens_per_s"]) and run["tokens_per_s"] > 0
        assert abs(run["final_loss"] - fp8["runs"]["bf16"]["final_loss"]) < 0.05
    rates = p["kernel_rates"]  # CPU: measured only (a datasheet GPU's prediction is not about this machine)
    assert rates["planner_gpu"] is None and rates["copy"]["gb_s"] > 0 and rates["gemms"] and rates["attention"]
    assert all(_number(x) and x > 0 for g in rates["gemms"] for x in g["ms"] + g["tflop_s"])
    assert all(_number(a["backends"]["default"][k]) and a["backends"]["default"][k] > 0 for a in rates["attention"]
               for k in ("forward_ms", "backward_ms"))
    printed = capsys.readouterr().out
    for label in ("(a) training", "(b) SDPA backend", "(c) ring block kernel", "(c2) document masking",
                  "(d) stage start-up",
                  "(e) syncs per step", "(f) compiled vs eager", "(g) FP8 vs bf16", "(h) kernel rates", "toy sizes"):
        assert label in printed, label


def test_the_backend_is_read_from_kernel_names():
    assert gpu_check.attention_backend(["void pytorch_flash::flash_fwd_kernel<...>"]) == "flash"
    assert gpu_check.attention_backend(["fmha_cutlassF_bf16_aligned_64x64_rf_sm80"]) == "mem_efficient"
    assert gpu_check.attention_backend(["cudnn_generated_fort_native_sdpa_sm90_flash_fprop"]) == "cudnn"
    assert gpu_check.attention_backend(["aten::bmm", "aten::softmax"]) == "math"


def test_some_parts_only_and_the_json_after_each(tmp_path: Path, capsys):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--toy", "--out", str(out), "--parts", "kernel_rates,documents"]) == 0
    assert set(json.loads(out.read_text())["parts"]) == {"kernel_rates", "documents"}
    assert capsys.readouterr().out.count("gpu_check: ") >= 3  # a line per part as it ends, then the JSON's
    assert gpu_check.main(["--toy", "--out", str(out), "--parts", "kernel_rate"]) == 2
    assert "unknown part(s) kernel_rate" in capsys.readouterr().err
