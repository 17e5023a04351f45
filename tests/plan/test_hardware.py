from __future__ import annotations

import pytest

from pentatron.hardware.catalogue import (
    GiB,
    detect_gpu,
    get_gpu,
    gpu_names,
    hardware_from_dict,
    load_hardware_toml,
    with_profile,
)


def test_catalogue_entries_are_sane():
    assert set(gpu_names()) == {"a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200"}
    for n in gpu_names():
        g = get_gpu(n)
        assert g.problems() == []
        assert g.flops("bf16") > g.flops("fp32")
    h100 = get_gpu("H100")
    assert h100.name == "h100-sxm" and h100.peak_flops["bf16"] == pytest.approx(989.4e12)
    assert h100.hbm_bytes == 80 * GiB and get_gpu("h200").hbm_bytes == 141 * GiB
    assert "fp8" not in get_gpu("a100").peak_flops


def test_unknown_gpu_lists_known_names():
    with pytest.raises(KeyError, match="known GPUs: .*h100-sxm"):
        get_gpu("tpu-v5")
    with pytest.raises(KeyError, match="no 'fp8' peak"):
        get_gpu("a100-40gb").flops("fp8")


@pytest.mark.parametrize(("name", "expect"), [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA H100 PCIe", None),
    ("NVIDIA GH200 480GB", None),
    ("Tesla T4", None),
])
def test_detect_gpu(name, expect):
    g = detect_gpu(name)
    assert (g.name if g else None) == expect


def test_user_hardware_toml(tmp_path):
    p = tmp_path / "hw.toml"
    p.write_text('[gpu]\nname = "h100-4x"\nbase = "h100"\ngpus_per_node = 4\ninter_node_bandwidth_gb_s = 25\n'
                 '[gpu.peak_tflops]\nbf16 = 900\n')
    g = load_hardware_toml(p)
    assert g.name == "h100-4x" and g.gpus_per_node == 4 and g.peak_flops == {"bf16": 900e12}
    assert g.inter_node_bandwidth == 25e9 and g.hbm_bytes == 80 * GiB  # rest from the base


@pytest.mark.parametrize(("data", "match"), [
    ({"name": "x"}, "missing peak_flops"),
    ({"base": "nope"}, "unknown GPU"),
    ({"base": "h100", "hbm_gb": 80}, "unknown key"),
    ({"base": "h100", "hbm_gib": "lots"}, "must be a number"),
    ({"base": "h100", "matmul_efficiency": 1.5}, r"matmul_efficiency must be in \(0, 1\]"),
    ({"base": "h100", "chip_spread": 0.5}, r"chip_spread must be in \[0, 0.2\)"),
    ({"base": "h100", "busbw": {"all_reduce": {"bytes": [1, 2], "gb_s": [1]}}}, "equal-length"),
])
def test_bad_hardware_is_reported(data, match):
    with pytest.raises(ValueError, match=match):
        hardware_from_dict(data)


def test_missing_or_invalid_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_hardware_toml(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_hardware_toml(bad)


def test_stream_bandwidth_reads_the_measured_copy_curve_by_size():

    from pentatron.hardware.catalogue import get_gpu
    h100 = get_gpu("h100")
    assert h100.speeds.stream_bandwidth(1e6) == 3350e9 * 0.90  # no curve: nominal HBM x efficiency
    assert h100.speeds.stream_bandwidth(1e6, efficiency=False) == 3350e9
    cpu = with_profile(h100, copy_bw=((2**16, 20e9), (2**20, 10e9), (2**26, 2e9)))
    assert cpu.speeds.stream_bandwidth(2**16) == 20e9 and cpu.speeds.stream_bandwidth(2**30) == 2e9  # clamped
    assert cpu.speeds.stream_bandwidth(2**18) == 20e9 - (10e9 * 2 / 4)  # halfway in log(size): 15 GB/s
    assert cpu.speeds.stream_bandwidth(2**18, efficiency=False) == 15e9  # measured: no extra efficiency


def test_copy_curve_round_trips_through_a_profile(tmp_path):
    from pentatron.hardware.catalogue import load_hardware_toml
    p = tmp_path / "cpu.toml"
    p.write_text('[gpu]\nname = "c"\npeak_tflops = { fp32 = 0.1 }\nhbm_gib = 8\nhbm_bandwidth_gb_s = 3\n'
                 'intra_node_bandwidth_gb_s = 1\ninter_node_bandwidth_gb_s = 1\n'
                 '[gpu.copy_bw]\nbytes = [1048576, 16384]\ngb_s = [10, 20]\n')
    assert load_hardware_toml(p).profile.copy_bw == ((16384.0, 20e9), (1048576.0, 10e9))


@pytest.mark.parametrize(("dtype", "a", "k0", "sweep"), [
    ("fp8", 1, 409, ((1024, 1129e12), (4096, 1467e12), (16384, 1541e12))),
    ("bf16", 2, 244, ((1024, 628e12), (2048, 705e12), (4096, 736e12), (8192, 758e12), (16384, 766e12))),
])
def test_gemm_small_k_efficiency(dtype, a, k0, sweep):
    """H800 sweeps (tile-lang benchmark/matmul{_fp8,}/README.md, M = N = 8192): k/(k + k0) at 80% of peak."""
    from pentatron.hardware.catalogue import get_gpu
    from pentatron.plan.timing import KERNEL_OVERHEAD, gemm_time
    h100 = get_gpu("h100")
    peak = h100.flops(dtype)
    for k, published in sweep:
        t = gemm_time(h100, 8192, 8192, k, peak, a) - KERNEL_OVERHEAD
        model = 2 * 8192 * 8192 * k / t
        waves = 4096 / (32 * 132)  # 64 x 64 output tiles over 132 SMs: 32 waves, the last one partial
        assert model == pytest.approx(peak * 0.80 * waves * k / (k + k0), rel=1e-12)
        assert model == pytest.approx(published, rel=0.07)  # our 80% ceiling sits within 7% of the sweep's
    a100 = get_gpu("a100")  # no sweep cited for Ampere: no small-k term
    rates = [2 * 8192 * 8192 * k / (gemm_time(a100, 8192, 8192, k, a100.flops("bf16"), 2) - KERNEL_OVERHEAD)
             for k in (1024, 16384)]
    assert rates[0] == pytest.approx(rates[1], rel=1e-12)


def test_gpu_bench_profile_reproduces_its_own_gemm():
    """A GPU bench profile keeps the datasheet peak and sets matmul_efficiency so that the planner's GEMM
    at bench's shape runs at the measured rate (the shape's waves and small-k loss are not charged twice)."""
    from pentatron.calibrate.bench import GPU_GEMM_N, BenchResult, profile_dict
    from pentatron.hardware.catalogue import hardware_from_data
    from pentatron.plan.timing import KERNEL_OVERHEAD, gemm_time
    measured = 700e12
    r = BenchResult("cuda", "NVIDIA H100 80GB HBM3", 8, "nccl", {"bf16": measured, "tf32": 350e12}, 3.0e12, 80 * 2**30)
    prof = hardware_from_data(profile_dict(r), "bench")
    n = GPU_GEMM_N
    t = gemm_time(prof, n, n, n, prof.flops("bf16"), 2) - KERNEL_OVERHEAD
    assert prof.peak_flops["bf16"] == pytest.approx(989.4e12)
    assert 2 * n**3 / t == pytest.approx(measured, rel=1e-3)


def test_a_step_on_n_chips_computes_at_the_expected_slowest_of_them():
    """hardware/chip_spread.py: sigma from Sinha et al.'s 8 % whisker spread, the expected maximum of n normal
    draws (Blom) against a sampled one, and the planner's stage phases scaled by it on n GPUs only; a hardware
    file's chip_spread = 0 turns it off."""
    import random
    import statistics

    from pentatron.hardware.chip_spread import CHIP_SPREAD, slowest_chip
    from pentatron.models.registry import get_model_config
    from pentatron.plan.layout import Layout, Workload
    from pentatron.plan.timing import stage_phases

    # Tukey's whiskers of a large normal sample sit at Q3 + 1.5 IQR = 2.698 sigma: 8 % whisker to whisker
    whisker = statistics.NormalDist().inv_cdf(0.75) * 4
    assert pytest.approx(0.08 / (2 * whisker), rel=1e-3) == CHIP_SPREAD and 0.0147 < CHIP_SPREAD < 0.0149
    assert slowest_chip(1, CHIP_SPREAD) == 1.0 and slowest_chip(256, 0.0) == 1.0
    rng = random.Random(0)
    for n, expect in ((8, 1.021), (256, 1.042), (12288, 1.058)):
        assert slowest_chip(n, CHIP_SPREAD) == pytest.approx(expect, abs=6e-4)
        if n <= 256:  # the order statistic sampled: 4,000 jobs of n chips (standard error ~1e-4 here)
            sampled = statistics.fmean(max(rng.gauss(0, 1) for _ in range(n)) for _ in range(4000))
            assert 1 + CHIP_SPREAD * sampled == pytest.approx(slowest_chip(n, CHIP_SPREAD), abs=4e-4)
    h100 = get_gpu("h100-sxm")
    alike = hardware_from_dict({"base": "h100-sxm", "name": "h100-alike", "chip_spread": 0})
    assert h100.efficiency.chip_spread == CHIP_SPREAD and alike.efficiency.chip_spread == 0.0
    assert get_gpu("a100-80gb").efficiency.chip_spread == CHIP_SPREAD
    w = Workload(get_model_config("llama3-8b"), 4096, 64)
    for lay in (Layout(dp=8, micro_batch=1), Layout(dp=1, micro_batch=1)):
        with_spread, without = stage_phases(w, lay, h100, "eager"), stage_phases(w, lay, alike, "eager")
        k = slowest_chip(lay.world, CHIP_SPREAD)
        assert [x.total for x in with_spread] == pytest.approx([x.total * k for x in without], rel=1e-12)
