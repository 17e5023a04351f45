"""The tensor-parallel step terms of a `pentatron bench` CPU profile (calibrate/tp_step.py, issue 10 item 5):
host work per TP layer and per vocab-parallel ends, and each tp collective at the in-step all-reduce
time bench measured by size (log-linear between sizes, the curve's increment beyond the largest).
Hand-computed on the debug model at seq 64, micro-batch 4, fp32: one activation is 256 tokens x 128 x
4 B = 131,072 B."""

from __future__ import annotations

import dataclasses

import pytest

from pentatron.hardware.catalogue import get_gpu, hardware_from_dict, with_profile
from pentatron.models.registry import get_model_config
from pentatron.plan.comm import Group, collective_time
from pentatron.plan.layout import Layout, Workload
from pentatron.plan.timing import layer_phase, stage_phases
from tests.plan.conftest import uncalibrated

W = Workload(get_model_config("debug"), 64, 8)
TP2 = Layout(dp=1, tp=2, micro_batch=4, precision="fp32")
FLAT = ((4096.0, 1e9), (4.0 * 2**20, 1e9))  # 1 GB/s bus bandwidth at every size
BASE = with_profile(uncalibrated(get_gpu("h100")), busbw={"all_reduce": FLAT, "all_gather": FLAT},
                    host_layer_s=(1e-4, 2e-4), host_ends_s=(3e-4, 4e-4))
# in-step all-reduce: 1 ms at 4 KiB, 2 ms at 256 KiB (log-linear: 128 KiB is 5/6 of the way, 1.8333 ms)
TPS = with_profile(BASE, host_tp_layer_s=(5e-4, 6e-4), host_tp_ends_s=(7e-4, 8e-4),
                   tp_collective=((4096.0, 1e-3), (262144.0, 2e-3)))
AR = 1e-3 + 5 / 6 * 1e-3  # the 131,072 B activation all-reduce in the step
TP_GROUP, DP_GROUP = Group("tp", 2, 2, 1), Group("dp", 2, 2, 1)


def test_tp_collective_is_the_in_step_time_by_size():
    # log2(131072 / 4096) = 5 of log2(262144 / 4096) = 6
    assert collective_time(TPS, "all_reduce", 131072, TP_GROUP) == pytest.approx(AR)
    assert collective_time(TPS, "all_reduce", 64, TP_GROUP) == pytest.approx(1e-3)  # below the sizes
    # an all-gather of 131,072 B sends (n-1)/n of it, what an all-reduce of 65,536 B sends: 4/6 of the way
    assert collective_time(TPS, "all_gather", 131072, TP_GROUP) == pytest.approx(1e-3 + 4 / 6 * 1e-3)
    # beyond 256 KiB: 2 ms + the curve's increment: (1 MiB - 256 KiB) at 1 GB/s = 786.432 us
    assert collective_time(TPS, "all_reduce", 2**20, TP_GROUP) == pytest.approx(2e-3 + 786.432e-6)
    # other dimensions, and profiles without the measurement, keep the curve
    assert collective_time(TPS, "all_reduce", 131072, DP_GROUP) == pytest.approx(131.072e-6)
    assert collective_time(BASE, "all_reduce", 131072, TP_GROUP) == pytest.approx(131.072e-6)


def test_host_terms_switch_to_the_tp_measurement_only_under_tp():
    assert TPS.speeds.host_layer(1) == (1e-4, 2e-4) and TPS.speeds.host_ends(1) == (3e-4, 4e-4)
    assert TPS.speeds.host_layer(2) == (5e-4, 6e-4) and TPS.speeds.host_ends(2) == (7e-4, 8e-4)
    assert BASE.speeds.host_layer(2) == (1e-4, 2e-4)  # not measured: the plain layer's


def test_tp_layer_and_ends_carry_the_measured_terms():
    # a layer: forward + (5e-4 - 1e-4) host + 2 all-reduces x (AR - 131.072 us on the curve) more;
    # backward the same with (6e-4 - 2e-4); the weight-gradient pass has neither
    old, new = layer_phase(W, TP2, BASE, 0, "eager"), layer_phase(W, TP2, TPS, 0, "eager")
    comm = 2 * (AR - 131.072e-6)
    assert new.f - old.f == pytest.approx(4e-4 + comm)
    assert new.b - old.b == pytest.approx(4e-4 + comm)
    assert new.w == pytest.approx(old.w)
    # the ends (one stage holds all 4 layers): host (7e-4 - 3e-4, 8e-4 - 4e-4); the embedding's
    # all-reduce (AR - 131.072 us more) and the loss's two small ones (1 ms - 1.024 us and 1 ms - 2.048 us:
    # 1,024 B and 2,048 B at 1 GB/s) in forward, the head's input gradient in backward (the head's input
    # is replicated: its f operator communicates in backward only, as training's ledger counts)
    (o,), (n,) = stage_phases(W, TP2, BASE, "eager"), stage_phases(W, TP2, TPS, "eager")
    ends_f = 4e-4 + (AR - 131.072e-6) + (1e-3 - 1.024e-6) + (1e-3 - 2.048e-6)
    assert n.f - o.f == pytest.approx(4 * (4e-4 + comm) + ends_f)
    assert n.b - o.b == pytest.approx(4 * (4e-4 + comm) + 4e-4 + (AR - 131.072e-6))


def test_sharing_leaves_the_tp_step_alone():
    # measured with every process busy: the node's sharing is already in it
    shared = with_profile(dataclasses.replace(TPS, gpus_per_node=2), node_slowdown={"host": 2.0}).sharing(2)
    assert shared.speeds.host_layer(1) == pytest.approx((2e-4, 4e-4))
    assert shared.speeds.host_layer(2) == (5e-4, 6e-4) and shared.profile.tp_collective == TPS.profile.tp_collective


def test_profile_table_parses_and_names_what_is_missing():
    d = {"name": "x", "base": "h100", "tp_step": {"layer_fwd_us": 500, "layer_bwd_us": 600, "ends_fwd_us": 700,
                                                 "ends_bwd_us": 800, "collective_bytes": [262144, 4096],
                                                 "collective_us": [2000, 1000]}}
    g = hardware_from_dict(d)
    assert g.profile.host_tp_layer_s == pytest.approx((5e-4, 6e-4))
    assert g.profile.host_tp_ends_s == pytest.approx((7e-4, 8e-4))
    assert [b for b, _ in g.profile.tp_collective] == [4096, 262144]  # sorted by size
    assert [t for _, t in g.profile.tp_collective] == pytest.approx([1e-3, 2e-3])
    with pytest.raises(ValueError, match="tp_step needs"):
        hardware_from_dict({"name": "x", "base": "h100", "tp_step": {"layer_fwd_us": 1}})
