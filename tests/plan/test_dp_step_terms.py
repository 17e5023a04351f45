"""The data-parallel step's synchronisations (calibrate/dp_step.py, issue 10 item 5): the per-step gradient
collectives at the in-step time bench measured after a backward's compute, the trainer's one-number
collectives per step (which training's ledger records byte for byte, tests/observe/test_report.py), and
the tied embedding's gradient swapped both ways at once. Hand-computed on the debug model (1,115,264
parameters: fp32 gradients of 4,461,056 B)."""

from __future__ import annotations

import pytest

from pentatron.hardware.catalogue import get_gpu, hardware_from_dict, with_profile
from pentatron.models.registry import get_model_config
from pentatron.plan.comm import STEP_SCALARS_WHERE, TIED_WHERE, Group, collective_time, p2p_time
from pentatron.plan.layout import Layout, Workload
from pentatron.plan.timing import step_time

H100 = get_gpu("h100")
W = Workload(get_model_config("debug"), 64, 8)
FLAT = ((4096.0, 1e9), (4.0 * 2**20, 1e9))  # 1 GB/s bus bandwidth at every size
BASE = with_profile(H100, busbw={"all_reduce": FLAT, "all_gather": FLAT, "reduce_scatter": FLAT})
# in-step gradient all-reduce: 1 ms at 256 KiB, 2 ms at 1 MiB, 5 ms at 4 MiB; a scalar 0.25 ms
DPS = with_profile(BASE, dp_collective=((2.0**18, 1e-3), (2.0**20, 2e-3), (2.0**22, 5e-3)), scalar_collective_s=2.5e-4)
DP = Group("dp_cp", 2, 2, 1)
GRADS = 1_115_264 * 4


def _scalars(lay: Layout, gpu=H100) -> list[tuple[str, str, float, float]]:
    st = step_time(W, lay, gpu)
    return sorted((c.dim, c.op, c.payload, c.count) for c in st.collectives if c.where == STEP_SCALARS_WHERE)


def test_the_trainers_scalars_per_layout():
    assert _scalars(Layout(dp=1, micro_batch=4)) == []  # one process: nothing to agree on
    assert _scalars(Layout(dp=2, micro_batch=4)) == [("dp_cp", "all_reduce", 4, 1)]  # the loss's mean
    # ZeRO: each rank's norm covers its shard, summed over dp as well
    assert _scalars(Layout(dp=2, zero=1, micro_batch=4)) == [("dp_cp", "all_reduce", 4, 2)]
    assert _scalars(Layout(dp=1, cp=2, micro_batch=4)) == [("dp_cp", "all_reduce", 4, 1)]
    assert _scalars(Layout(dp=1, tp=2, micro_batch=4)) == [("tp", "all_reduce", 4, 1)]  # the norm over tp
    # pp: the loss broadcast from the last stage, the norm over the stages, the bubble's 3 float64 figures
    # of every stage in one all-gather
    assert _scalars(Layout(dp=1, pp=2, micro_batch=1)) == [("pp", "all_gather", 48, 1), ("pp", "all_reduce", 4, 1),
                                                           ("pp", "broadcast", 4, 1)]


def test_the_moe_layers_add_their_loads_and_the_expert_norm():
    w = Workload(get_model_config("debug-moe"), 64, 8)  # 4 layers, the first dense: 3 MoE layers of 8 experts

    def scalars(lay: Layout) -> list[tuple[str, str, float, float]]:
        st = step_time(w, lay, H100)
        return sorted((c.dim, c.op, c.payload, c.count) for c in st.collectives if c.where == STEP_SCALARS_WHERE)

    loads = ("dp_cp", "all_reduce", 8 * (8 + 5), 3)  # per MoE layer: 8 counts + 5 totals, float64
    assert scalars(Layout(dp=2, micro_batch=4)) == [("dp_cp", "all_reduce", 4, 1), loads]
    # ep: the expert weights' squared norm summed over the ranks holding the other experts
    assert scalars(Layout(dp=2, ep=2, micro_batch=4)) == [("dp_cp", "all_reduce", 4, 1), loads,
                                                          ("ep", "all_reduce", 4, 1)]
    # ZeRO-1, dp 4 / ep 2: each expert engine's shard norm over its expert-data group (edp = 2) first
    assert scalars(Layout(dp=4, ep=2, zero=1, micro_batch=2)) == [("dp_cp", "all_reduce", 4, 2), loads,
                                                                  ("edp", "all_reduce", 4, 1),
                                                                  ("ep", "all_reduce", 4, 1)]


def test_scalars_cost_the_measured_in_step_latency_each():
    lay = Layout(dp=1, pp=2, micro_batch=1, precision="fp32")
    st = step_time(W, lay, DPS)
    assert st.scalars == pytest.approx(3 * 2.5e-4)  # 1 + 1 + 1 calls at 0.25 ms
    assert st.step == pytest.approx(st.pipeline + st.dp_exposed + st.optimizer + st.contention + st.tied_grads
                                    + st.scalars)
    # without the measurement: the collective's latency model (GPU: microseconds)
    h = step_time(W, lay, H100)
    pp = Group("pp", 2, 2, 1)
    assert h.scalars == pytest.approx(collective_time(H100, "broadcast", 4, pp)
                                      + collective_time(H100, "all_reduce", 4, pp)
                                      + collective_time(H100, "all_gather", 48, pp))
    assert h.scalars < 1e-4


def test_gradient_collectives_read_the_in_step_measurement():
    # the 4,461,056 B all-reduce: log2(4461056 / 2^20) = 2.0889 of the 2 doublings to 4 MiB -> 2 ms +
    # 1.0445 x 3 ms ... beyond 4 MiB: 5 ms + the curve's (4461056 - 4194304) B at 1 GB/s = 266.752 us
    from pentatron.plan.comm import dp_in_step_time

    assert dp_in_step_time(DPS, "all_reduce", GRADS, DP) == pytest.approx(5e-3 + 266.752e-6)
    assert dp_in_step_time(DPS, "all_reduce", 2**21, DP) == pytest.approx(3.5e-3)  # halfway 1 -> 4 MiB
    # a reduce-scatter of 2 MiB sends what an all-reduce of 1 MiB does
    assert dp_in_step_time(DPS, "reduce_scatter", 2**21, DP) == pytest.approx(2e-3)
    assert dp_in_step_time(BASE, "all_reduce", 2**21, DP) == pytest.approx(2**21 / 1e9)  # not measured
    st = step_time(W, Layout(dp=2, micro_batch=4, precision="fp32"), DPS)
    (g,) = [c for c in st.collectives if c.where == "gradients"]
    assert g.time == pytest.approx(5e-3 + 266.752e-6)
    # one bucket (the model is < 25 MiB): reduced after the backward, all of it exposed, once (on this
    # profile the backward is shorter than the all-reduce: the last bucket is not also counted as the
    # part that outlasts the backward)
    assert st.dp_exposed == pytest.approx(g.time) and st.scalars == pytest.approx(2.5e-4)
    # ZeRO-2, 2 micro-batches of 2: the first micro-batch's reduce-scatter hides behind the second's
    # compute as far as it can, the last one is the last bucket
    z2 = step_time(W, Layout(dp=2, zero=2, micro_batch=2, precision="fp32"), DPS)
    (rs,) = [c for c in z2.collectives if c.where == "gradients per micro-batch"]
    assert rs.count == 2 and rs.time == pytest.approx(dp_in_step_time(DPS, "reduce_scatter", GRADS, DP))
    (ag,) = [c for c in z2.collectives if c.where == "updated parameters"]
    window = z2.phases[0].total
    # the parameter all-gather: one bucket (the model is < 25 MiB of parameters), waited before the first
    # layer: all of it exposed (parallel.overlap_param_gather hides only the buckets after the first)
    assert z2.dp_exposed == pytest.approx(max(0.0, rs.time - window) + rs.time + ag.time)
    # tp collectives keep their own measurement (none here: the curve)
    assert collective_time(DPS, "all_reduce", 2**21, Group("tp", 2, 2, 1)) == pytest.approx(2**21 / 1e9)


def test_the_tied_gradient_swap_reads_the_measured_exchange():
    ex = with_profile(H100, busbw={"p2p": ((1024.0, 2e9), (2.0**22, 2e9)),
                                                   "exchange": ((1024.0, 1e9), (2.0**22, 1e9))})
    assert p2p_time(ex, 2**21, False) == pytest.approx(2**21 / 2e9)
    assert p2p_time(ex, 2**21, False, both_ways=True) == pytest.approx(2**21 / 1e9)
    assert p2p_time(H100, 2**21, False, both_ways=True) == p2p_time(H100, 2**21, False)  # full duplex
    pp2 = Layout(dp=1, pp=2, micro_batch=1, precision="fp32")
    fused = pp2.with_recipe(fused_scope="everywhere")  # a framework that reduces the tied gradient in place
    st = step_time(W, fused, ex)
    (t,) = [c for c in st.collectives if c.where == TIED_WHERE]
    assert t.payload == 4096 * 128 * 4 and st.tied_grads == pytest.approx(4096 * 128 * 4 / 1e9)
    # our swap (eager ops, outside the compiled blocks whatever the kernels) also packs the 2 MiB piece and adds
    # the peer's back: 5 passes at the in-step rate
    cpu = with_profile(ex, stream_bw=((2.0**20, 5e9), (2.0**22, 5e9)))
    for kernels in ("eager", "fused"):
        assert step_time(W, pp2, cpu, kernels=kernels).tied_grads == pytest.approx(2**21 / 1e9 + 5 * 2**21 / 5e9)


def test_profile_table_parses_and_names_what_is_missing():
    d = {"name": "x", "base": "h100", "dp_step": {"collective_bytes": [4194304, 262144],
                                                 "collective_us": [5000, 1000], "scalar_us": 250,
                                                 "compute_us": 10000}}
    g = hardware_from_dict(d)
    assert [b for b, _ in g.profile.dp_collective] == [262144, 4194304]  # sorted by size
    assert [t for _, t in g.profile.dp_collective] == pytest.approx([1e-3, 5e-3])
    assert g.profile.scalar_collective_s == pytest.approx(2.5e-4)
    with pytest.raises(ValueError, match="dp_step needs"):
        hardware_from_dict({"name": "x", "base": "h100", "dp_step": {"collective_bytes": [1]}})
