"""benchmarks/gpu_check.py, the prepared device check, at toy size on CPU: every part runs and reports
real numbers, so the command a GPU host will run cannot rot unseen."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

_spec = importlib.util.spec_from_file_location(
    "gpu_check", Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py")
assert _spec is not None and _spec.loader is not None
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check
_spec.loader.exec_module(gpu_check)

PARTS = {"kernel_rates", "train", "sdpa_backend", "step_profile", "ring_kernel", "documents", "stage_startup", "syncs",
         "fp8", "compile", "multi_gpu", "chip_spread"}


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _toy_gemm_seconds() -> float:
    """The planner's GEMM seconds of a toy step from `Speeds.linear` shape by shape (q, k, v, o, gate, up,
    down per layer, the head; bf16 on the reference GPU; the chunked loss's one chunk replays nothing)."""
    from pentatron.hardware.catalogue import get_gpu
    from pentatron.observe.report import REFERENCE_GPU

    m, toy = gpu_check.TOY.model, gpu_check.TOY
    gpu, tokens = get_gpu(REFERENCE_GPU), toy.micro_batch * toy.seq_len
    h, hd, f = m["hidden_size"], m["hidden_size"] // m["n_heads"], m["ffn_hidden_size"]
    shapes = [(m["n_heads"] * hd, h), (m["n_kv_heads"] * hd, h), (m["n_kv_heads"] * hd, h), (h, m["n_heads"] * hd),
              (f, h), (f, h), (h, f)]
    layer = sum(sum(gpu.speeds.linear(tokens, o, i, gpu.flops("bf16"), 2)) for o, i in shapes)
    head = sum(gpu.speeds.head_linear(tokens, m["vocab_size"], h, gpu.flops("bf16"), 2))
    return toy.global_batch // toy.micro_batch * (m["n_layers"] * layer + head)


def test_every_part_runs_at_toy_size_with_real_numbers(tmp_path: Path, capsys):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--toy", "--out", str(out)]) == 0, capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["toy"] is True and set(r["parts"]) == PARTS
    p = r["parts"]
    # on a CPU train.compile "auto" is eager: the compiled-vs-eager part is CUDA's (compile_speed.py is the CPU's)
    assert p.pop("compile")["status"].startswith("skipped: train.compile 'auto' is eager on a CPU")
    assert p.pop("chip_spread")["status"] == "skipped: needs 2 or more CUDA GPUs (found 0)"  # chips of a host
    assert r["calibration"]["status"].startswith("skipped: no catalogue GPU")
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
    sp = p["step_profile"]  # CPU: ATen ops' self time; the toy step runs mm, SDPA's flash op and fused AdamW
    cats, busy, wall = sp["categories_s"], sp["busy_s"], sp["wall_s"]
    assert set(cats) == set(gpu_check.CATEGORY_NAMES) and all(_number(v) and v >= 0 for v in cats.values())
    assert all(cats[k] > 0 for k in ("gemm", "attention", "optimizer", "other")), cats
    assert abs(sum(cats.values()) - busy) <= 0.01 * busy and 0 < busy <= 1.05 * wall
    assert math.isclose(sp["idle_fraction"], 1 - busy / wall) and sp["steps"] == gpu_check.STEP_PROFILE[1]
    assert sp["top_kernels"] and all(len(k["name"]) <= 120 and k["calls_per_step"] > 0 and k["s_per_step"] > 0
                                     for k in sp["top_kernels"])
    assert sp["top_kernels"][0]["s_per_step"] >= sp["top_kernels"][-1]["s_per_step"]
    split = sp["planner_split"]  # the reference GPU's split of the same step
    assert split is not None and all(_number(v) and v > 0 for v in split.values())
    assert split["optimizer_s"] == sp["planner"]["optimizer_s"] and split["rest_s"] < sp["planner"]["step_s"]
    assert math.isclose(split["gemm_s"], _toy_gemm_seconds(), rel_tol=1e-12)
    assert "measured_over_predicted" not in sp  # a datasheet GPU's prediction is not about this CPU
    fp8 = p["fp8"]  # the same stack, data and seed in bf16 and through train.fp8: real speeds, the same training
    assert set(fp8["runs"]) == {"bf16", "tensorwise", "rowwise"} and set(fp8["speedup"]) == {"tensorwise", "rowwise"}
    for run in fp8["runs"].values():
        assert run["steps"] == gpu_check.FP8_TOY.steps and _number(run["tokens_per_s"]) and run["tokens_per_s"] > 0
        assert abs(run["final_loss"] - fp8["runs"]["bf16"]["final_loss"]) < 0.05
    # the compiled FP8 runs are CUDA's ("auto" is eager on a CPU: they would repeat the eager ones)
    assert fp8["compiled"]["status"].startswith("skipped: train.compile 'auto' is eager on a CPU")
    rates = p["kernel_rates"]  # CPU: measured only (a datasheet GPU's prediction is not about this machine)
    assert rates["planner_gpu"] is None and rates["copy"]["gb_s"] > 0 and rates["gemms"] and rates["attention"]
    assert all(_number(x) and x > 0 for g in rates["gemms"] for x in g["ms"] + g["tflop_s"])
    assert all(_number(a["backends"]["default"][k]) and a["backends"]["default"][k] > 0 for a in rates["attention"]
               for k in ("forward_ms", "backward_ms"))
    mg = p["multi_gpu"]  # CPU: `pentatron train --nproc 2` on gloo, one layout, measured only (no planner GPU)
    assert (mg["world"], mg["backend"], mg["planner_gpu"]) == (2, "gloo", None) and set(mg["runs"]) == {"dp2 zero1"}
    dp = mg["runs"]["dp2 zero1"]
    assert dp["status"] == "ok" and dp["world"] == 2 and dp["layout"].startswith("dp2 tp1 pp1 cp1 z1 ")
    assert dp["steps"] == gpu_check.TOY_MULTI_STEPS and dp["global_batch"] == 2 * gpu_check.TOY.global_batch
    assert all(_number(dp[k]) and dp[k] > 0 for k in ("tokens_per_s", "step_time_s", "final_loss", "peak_gib_rank0"))
    # the ledger's bytes: ZeRO-1's gradient reduce-scatter and parameter all-gather, all of it over dp
    assert set(dp["comm_sent_per_step"]) == {"dp"} and dp["comm_sent_per_step"]["dp"] > t["model_parameters"]
    assert "planner" not in dp and "skipped_layouts" not in mg
    printed = capsys.readouterr().out
    for label in ("(a) training", "(b) SDPA backend", "(c) ring block kernel", "(c2) document masking",
                  "(d) stage start-up",
                  "(e) syncs per step", "(f) compiled vs eager", "(g) FP8 vs bf16", "(h) kernel rates",
                  "(i) step profile", "(j) multi-GPU", "toy sizes"):
        assert label in printed, label
    row = next(line for line in printed.splitlines() if line.lstrip().startswith("(j) multi-GPU"))
    assert "2 gloo ranks: dp2 zero1 " in row and "tokens/s, sent " in row and row.endswith("no catalogue GPU)")


def test_the_backend_is_read_from_kernel_names():
    assert gpu_check.attention_backend(["void pytorch_flash::flash_fwd_kernel<...>"]) == "flash"
    assert gpu_check.attention_backend(["fmha_cutlassF_bf16_aligned_64x64_rf_sm80"]) == "mem_efficient"
    assert gpu_check.attention_backend(["cudnn_generated_fort_native_sdpa_sm90_flash_fprop"]) == "cudnn"
    assert gpu_check.attention_backend(["aten::bmm", "aten::softmax"]) == "math"


def test_kernel_names_fall_into_categories():
    names = {
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "gemm",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>": "gemm",
        "aten::addmm": "gemm",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>": "attention",
        "fmha_cutlassB_bf16_aligned_64x64_k128_sm80": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128": "attention",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "compiled",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<4>, "
        "FusedAdamMathFunctor<float, 4>>": "optimizer",
        "aten::_fused_adamw_": "optimizer",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "nccl",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": "other",
        "Memcpy HtoD (Pageable -> Device)": "other",
        "aten::cumsum": "other",
    }
    assert {n: gpu_check.kernel_category(n) for n in names} == names


def test_device_busy_counts_overlapping_kernels_once_and_only_device_work():
    assert gpu_check.busy_seconds([]) == 0
    assert gpu_check.busy_seconds([(5, 6), (0, 2), (1, 3), (5.5, 5.6), (3, 4)]) == 5  # [0, 4] and [5, 6]
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, start_us, end_us, device=cuda, **kw):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start_us, end=end_us),
                               **kw)

    # a torch whose events carry kineto's activity type: a GPU-side annotation spans its kernels and a gap
    events = [ev("Optimizer.step#AdamW.step", 0, 1e6, activity_type="gpu_user_annotation"),
              ev("nvjet_a", 0, 4e5, activity_type="kernel"), ev("triton_b", 2e5, 5e5, activity_type="kernel"),
              ev("Memset (Device)", 8e5, 9e5, activity_type="gpu_memset")]
    rows, busy = gpu_check.profile_seconds(events, cuda=True)
    assert [r[0] for r in rows] == ["nvjet_a", "triton_b", "Memset (Device)"] and math.isclose(busy, 0.6)
    assert math.isclose(sum(secs for _, secs in rows), 0.8)  # the categories' sum: the overlap is counted twice
    # one without it: the host annotations' names and CUPTI's sync records are what is left out
    events = [ev("Optimizer.step#AdamW.step", 0, 1e6, cpu, is_user_annotation=True),
              ev("Optimizer.step#AdamW.step", 0, 1e6, is_user_annotation=False),
              ev("Context Sync", 4e5, 1e6, is_user_annotation=False), ev("nvjet_a", 0, 4e5, is_user_annotation=False)]
    rows, busy = gpu_check.profile_seconds(events, cuda=True)
    assert [r[0] for r in rows] == ["nvjet_a"] and math.isclose(busy, 0.4)


def test_some_parts_only_and_the_json_after_each(tmp_path: Path, capsys):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--toy", "--out", str(out), "--parts", "kernel_rates,documents"]) == 0
    assert set(json.loads(out.read_text())["parts"]) == {"kernel_rates", "documents"}
    assert capsys.readouterr().out.count("gpu_check: ") >= 3  # a line per part as it ends, then the JSON's
    assert gpu_check.main(["--toy", "--out", str(out), "--parts", "kernel_rate"]) == 2
    assert "unknown part(s) kernel_rate" in capsys.readouterr().err


def test_the_catalogue_holds_what_the_stored_h200_run_calibrates(tmp_path: Path, capsys):
    """H100/H200's measured attention, SDPA kernel and our step (hardware/catalogue.py) are exactly what
    `--from-json` derives from the stored H200 run, and its hardware file loads to the same efficiencies."""
    from pentatron.hardware.catalogue import get_gpu, load_hardware_toml

    stored = Path(__file__).resolve().parents[1] / "benchmarks" / "measured" / "gpu_check_h200_2026-12-04.json"
    out = tmp_path / "h200.toml"
    assert gpu_check.main(["--from-json", str(stored), "--calibration-out", str(out)]) == 0
    assert "calibration ok" in capsys.readouterr().out
    got, h200 = load_hardware_toml(out), get_gpu("h200")
    for field in ("attention_by_seq", "sdpa_kernel", "our_step"):
        assert getattr(got.efficiency, field) == getattr(h200.efficiency, field), field
    assert got.name == "h200-measured" and got.peak_flops == h200.peak_flops


def test_the_chip_spread_is_read_against_the_planners_model():
    """Part chip_spread's arithmetic on 8 known rates: median, range, sigma and the slowest chip's time over the
    median chip's, beside hardware/chip_spread.py's sigma and expected slowest of 8."""
    from pentatron.hardware.chip_spread import CHIP_SPREAD, slowest_chip

    rates = [700.0, 710.0, 690.0, 705.0, 695.0, 702.0, 698.0, 660.0]
    r = gpu_check.chip_spread_stats(rates)
    assert r["median_tflop_s"] == 699.0 and r["range_over_median"] == round(50 / 699, 4)
    assert r["sigma_over_median"] == round(15.3902 / 699, 4)  # sample standard deviation of the rates
    assert r["slowest_time_over_median"] == round(699 / 660, 4)
    assert r["planner_sigma"] == round(CHIP_SPREAD, 4)
    assert r["planner_slowest"] == round(slowest_chip(8, CHIP_SPREAD), 4)
    table = gpu_check.table({"device": "x", "torch": "t", "toy": False, "wall_s": 1.0, "parts": {"chip_spread": {
        "status": "ok", "gpus": 8, "gemm": 8192, "seconds_each": 10.0, **r}}})
    assert "(k) chip spread" in table and "sigma 2.20 % (planner 1.48 %)" in table
