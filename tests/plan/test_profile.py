"""The datasheet (`GPUSpec`), the measured profile (`Profile`, the file `pentatron bench` writes) and the one
interface the time model reads both through (`Speeds`): the split keeps every prediction, the profile file
has its own versioned schema, and collectives carry a typed kind (issue 39, item 2)."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from pentatron.calibrate.bench import BenchResult, profile_dict, to_toml
from pentatron.hardware.catalogue import GPUSpec, get_gpu, hardware_from_data, load_hardware_toml, with_profile
from pentatron.hardware.profile import PROFILE_SCHEMA, Profile
from pentatron.hardware.speeds import Measured, Roofline
from pentatron.models.registry import get_model_config
from pentatron.plan.comm import Traffic, step_collectives
from pentatron.plan.layout import Layout, Workload
from pentatron.plan.timing import layer_phase, step_time

H100 = get_gpu("h100")
SRC = Path(__file__).resolve().parents[2] / "src" / "pentatron"


def _cpu_result() -> BenchResult:
    """What a 2-process CPU bench measures, with round numbers."""
    return BenchResult(
        "cpu", "x86_64", 2, "gloo", {"fp32": 2e11, "bf16": 1e11}, 1e10, 16 * 2**30,
        busbw={"all_reduce": [(1024, 5e7), (2**20, 2e9)], "p2p": [(1024, 1e8), (2**20, 3e9)]},
        copy_curve=[(16384, 4e10), (2**26, 8e9)], matmul_curve=[(65536, 5e9), (2**31, 1.6e11)],
        host_overhead=(3e-4, 5e-4, 2e-4, 2.5e-4), host_optimizer_per_tensor=1.2e-5,
        cpu_kernels={"stream_curve": [(16384, 3e10), (2**24, 6e9)], "optimizer_per_element": 2.5e-9,
                     "head_curve": [(1e6, 3e10, 2.5e10, 2e10), (1e10, 1.2e11, 1.1e11, 1e11)],
                     "node_slowdown": {"matmul": 1.8, "stream": 2.2, "host": 1.3},
                     "attention_grid": [(s, d, 1e10 + s, 6e9 + d) for s in (16, 64, 256, 1024) for d in (32, 64, 128)]},
        tp_step={"layer_fwd_us": 700.0, "layer_bwd_us": 900.0, "ends_fwd_us": 400.0, "ends_bwd_us": 450.0,
                 "collective_bytes": [8192, 65536], "collective_us": [90.0, 150.0], "tp": 2,
                 "compiled_layer_fwd_us": 800.0, "compiled_layer_bwd_us": 1000.0},
        dp_step={"collective_bytes": [262144, 2**20], "collective_us": [400.0, 900.0], "scalar_us": 60.0},
        pp_step={"hop_bytes": [4096, 2**20], "hop_us": [200.0, 2500.0]},
        compiled={"host": (1e-4, 1.5e-4), "chain": [(32768, 4e9), (524288, 1.2e10)]})


def test_the_datasheet_is_small_and_holds_no_measured_curve():
    names = {f.name for f in dataclasses.fields(GPUSpec)}
    assert len(names) <= 15
    assert not names & {f.name for f in dataclasses.fields(Profile)}
    assert H100.profile is None and type(H100.speeds) is Roofline


def test_a_bench_profile_file_round_trips_in_its_schema(tmp_path):
    d = profile_dict(_cpu_result())
    assert d["schema"] == PROFILE_SCHEMA and set(d) == {"schema", "hardware", "profile", "measured"}
    (tmp_path / "p.toml").write_text(to_toml(d))
    (tmp_path / "p.json").write_text(json.dumps(d))
    gpu = load_hardware_toml(tmp_path / "p.toml")
    assert load_hardware_toml(tmp_path / "p.json") == gpu
    assert isinstance(gpu.speeds, Measured) and gpu.gpus_per_node == 2 and gpu.flops("fp32") == pytest.approx(2e11)
    p = gpu.profile
    assert p.busbw["p2p"] == ((1024.0, 1e8), (2.0**20, 3e9)) and p.copy_bw == ((16384.0, 4e10), (2.0**26, 8e9))
    assert p.host_layer_s == pytest.approx((3e-4, 5e-4)) and p.host_optimizer_per_tensor_s == pytest.approx(1.2e-5)
    assert [b for b, _ in p.tp_collective] == [8192, 65536] and p.tp_collective[1][1] == pytest.approx(1.5e-4)
    assert p.scalar_collective_s == pytest.approx(6e-5) and p.pp_hop[-1] == pytest.approx((2.0**20, 2.5e-3))
    assert p.optimizer_per_element_s == pytest.approx(2.5e-9) and p.node_slowdown["stream"] == 2.2
    assert p.attention_fp32 is not None and p.attention_fp32.fwd[0] == pytest.approx(1e10 + 16)
    assert p.host_compiled_layer_s == pytest.approx((1e-4, 1.5e-4))
    assert p.host_tp_compiled_layer_s == pytest.approx((8e-4, 1e-3))
    assert p.fused_bw == ((32768.0, pytest.approx(4e9)), (524288.0, pytest.approx(1.2e10)))
    # the older layout, every key under one [gpu] table, reads to the same device
    legacy = {"gpu": {**d["hardware"], **d["profile"], "measured": d["measured"]}}
    assert hardware_from_data(legacy, "legacy") == gpu


@pytest.mark.parametrize(("change", "match"), [
    ({"schema": "pentatron.profile/0"}, "is not 'pentatron.profile/1'"),
    ({"curves": {}}, "unknown key"),
    ({"profile": {"copy_bw": {"bytes": [1, 2], "gb_s": [1]}}}, "copy_bw needs equal-length lists"),
    ({"profile": {"busbw": {"all_reduce": {"bytes": [1]}}}}, "busbw.all_reduce needs"),
    ({"profile": {"peak_tflops": {"fp32": 1}}}, "unknown key.*peak_tflops"),
    ({"profile": {"compiled": {"layer_fwd_us": 1, "layer_bwd_us": 1, "chain_bytes": [1], "chain_gb_s": [0]}}},
     "compiled needs .*positive"),
])
def test_a_malformed_profile_names_its_problem(change, match):
    d = {**profile_dict(_cpu_result()), **change}
    with pytest.raises(ValueError, match=match):
        hardware_from_data(d, "p.toml")


def test_an_empty_profile_predicts_what_the_datasheet_does():
    """The measured speeds fall back to the roofline term by term: with nothing measured, the same step."""
    w = Workload(get_model_config("llama3-8b"), 4096, 64)
    for lay in (Layout(dp=4, tp=2, sp=True, micro_batch=1, zero=1), Layout(dp=2, pp=2, tp=2, micro_batch=1)):
        assert step_time(w, lay, with_profile(H100), kernels="eager") == step_time(w, lay, H100, kernels="eager")


def test_the_planners_compiled_layer_saves_what_bench_measured_compiling_saves():
    """calibrate/compiled_kernels.compiled_profile: from a measured saving per layer (forward, backward) at
    the tiny shape and at each measured token count, the profile's compiled host and fused rate make the
    planner's compiled layer cost its eager layer less that saving, at each measured shape (the debug
    model's layers are the ones bench times); a saving beyond the bounds is clamped."""
    from pentatron.calibrate.compiled_kernels import LAYER_TOKENS, TINY_TOKENS, compiled_profile

    stream = [(2**14, 30e9), (2**18, 20e9), (2**22, 12e9)]
    host = (2e-4, 3e-4)
    saving = {TINY_TOKENS: (5e-5, 1e-4), 64: (8e-5, 2e-4), 256: (1.5e-4, 3e-4), 1024: (5e-4, 1.5e-3)}
    compiled = compiled_profile(saving, host, stream)
    assert compiled["host"] == pytest.approx((1.5e-4, 2e-4))
    assert [n for n, _ in compiled["chain"]] == [t * 128 * 4 for t in LAYER_TOKENS]
    gpu = with_profile(H100, stream_bw=tuple(stream), host_layer_s=host, host_compiled_layer_s=compiled["host"],
                       fused_bw=tuple(compiled["chain"]))
    cfg = get_model_config("debug")
    for t in LAYER_TOKENS:
        w, lay = Workload(cfg, t, 8), Layout(dp=1, micro_batch=1, precision="fp32")
        eager, fused = layer_phase(w, lay, gpu, 1, "eager"), layer_phase(w, lay, gpu, 1, "fused")
        assert eager.total - fused.total == pytest.approx(sum(saving[t]), rel=1e-9)
    # a host saving beyond its bounds is clamped, the layer's total saving kept
    odd = compiled_profile({**saving, TINY_TOKENS: (-1e-5, 1.0)}, host, stream)
    assert odd["host"] == pytest.approx((2e-4, 3e-5))
    gpu = with_profile(gpu, host_compiled_layer_s=odd["host"], fused_bw=tuple(odd["chain"]))
    eager, fused = layer_phase(w, lay, gpu, 1, "eager"), layer_phase(w, lay, gpu, 1, "fused")
    assert eager.total - fused.total == pytest.approx(sum(saving[1024]), rel=1e-9)
    # a saving beyond the eager elementwise work keeps a tenth of it; a negative one at most doubles it
    from pentatron.calibrate.compiled_kernels import elementwise_bytes_per_token
    from pentatron.hardware.profile import interp_log

    clamped = compiled_profile({**saving, 64: (1.0, 1.0), 256: (-1.0, -1.0)}, host, stream)["chain"]
    ratio = elementwise_bytes_per_token("fused") / elementwise_bytes_per_token("eager")
    assert clamped[0][1] == pytest.approx(10 * ratio * interp_log(stream, 64 * 512))
    assert clamped[1][1] == pytest.approx(ratio / 2 * interp_log(stream, 256 * 512))


def test_fused_kernels_read_the_compiled_chain_and_layer_when_measured():
    """train.compile's kernels (calibrate/compiled_kernels.py): `--kernels fused` prices a layer's
    elementwise bytes at the measured compiled chain and its host work at the compiled layer's; eager keeps
    the eager curve and host; without the measurement fused kernels fall back to the eager curve and host."""
    w = Workload(get_model_config("debug"), 64, 8)
    lay = Layout(dp=1, micro_batch=4, precision="fp32")
    base = dict(stream_bw=((1.0, 5e9),), host_layer_s=(4e-4, 6e-4))
    eager_only = with_profile(H100, **base)
    measured = with_profile(H100, **base, fused_bw=((1.0, 20e9),), host_compiled_layer_s=(1e-4, 2e-4))
    assert layer_phase(w, lay, measured, 0, "eager") == layer_phase(w, lay, eager_only, 0, "eager")
    # fused fp32 bytes per token of one layer's forward: 2 RMSNorms 2·2·4·128, RoPE 2·4·(128 + 64),
    # 2 residual adds 2·3·4·128, SwiGLU 3·4·256 = 9,728; x 256 tokens, forward once and backward twice
    elem = 256 * 9728
    a, b = layer_phase(w, lay, eager_only, 0, "fused"), layer_phase(w, lay, measured, 0, "fused")
    assert a.f - b.f == pytest.approx(elem / 5e9 - elem / 20e9 + 4e-4 - 1e-4)
    assert a.b - b.b == pytest.approx(2 * (elem / 5e9 - elem / 20e9) + 6e-4 - 2e-4)
    assert measured.speeds.host_layer(1, "fused") == (1e-4, 2e-4)
    assert measured.speeds.host_layer(1, "eager") == eager_only.speeds.host_layer(1, "fused") == (4e-4, 6e-4)
    # tensor parallelism: the TP layer as bench ran it, compiled when it compiled it too
    tp = dict(tp_collective=((1.0, 1e-4),), host_tp_layer_s=(7e-4, 9e-4))
    assert with_profile(measured, **tp).speeds.host_layer(2, "fused") == (7e-4, 9e-4)
    tp_compiled = with_profile(measured, **tp, host_tp_compiled_layer_s=(8e-4, 1e-3))
    assert tp_compiled.speeds.host_layer(2, "fused") == (8e-4, 1e-3)
    assert tp_compiled.speeds.host_layer(2, "eager") == (7e-4, 9e-4)
    # the bench's compiled rate is stated in these bytes
    from pentatron.calibrate.compiled_kernels import elementwise_bytes_per_token

    assert elementwise_bytes_per_token("fused") == 3 * 9728
    # ranks sharing the node: the compiled chain is memory traffic, the compiled layer host work
    shared = measured.profile.shared(matmul=2.0, stream=4.0, host=3.0)
    assert shared.fused_bw == ((1.0, 5e9),) and shared.host_compiled_layer_s == pytest.approx((3e-4, 6e-4))


def test_every_collective_has_a_typed_kind():
    w = Workload(get_model_config("debug"), 64, 16)
    lay = Layout(dp=2, tp=2, pp=2, sp=True, micro_batch=1, zero=1)
    colls = step_collectives(w, lay, H100, 1e6, 0.0, 2, 0, first=True, last=True)
    kinds = {c.kind for c in colls}
    assert {Traffic.SP_LAYERS, Traffic.SCALARS, Traffic.STAGE, Traffic.TIED, Traffic.GRADIENTS} <= kinds
    assert all(c.where == c.kind.value for c in colls)


def _imports(package: str) -> set[str]:
    out = set()
    for f in (SRC / package).glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                out.add(node.module)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
    return out


def test_the_planner_does_not_import_the_calibration():
    assert not any(m.startswith("pentatron.calibrate") for m in _imports("plan"))
    assert {"pentatron.hardware.profile", "pentatron.hardware.catalogue"} <= _imports("calibrate")
