from __future__ import annotations

import dataclasses

import pytest

from pentatron.distributed.comm import ring_bytes
from pentatron.hardware.catalogue import get_gpu, with_profile
from pentatron.models.registry import get_model_config
from pentatron.plan.comm import (
    LAYERS_WHERE,
    LOSS_WHERE,
    MOE_SP_WHERE,
    PARTIAL_GRADS_WHERE,
    SP_LAYERS_WHERE,
    STEP_SCALARS_WHERE,
    bus_bandwidth,
    bytes_by_dim,
    collective_time,
    group_of,
    step_collectives,
    wire_bytes,
)
from pentatron.plan.layout import Layout, Workload, layers_per_chunk, problems
from pentatron.plan.timing import Phase, gemm_time, pipeline_makespan, step_time, throughput
from pentatron.schedules import make_schedule, simulate

H100 = get_gpu("h100")


def test_wire_bytes_follow_the_ledger():
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for n in (2, 8, 64):
            assert wire_bytes(op, 2**20, n) == ring_bytes(op, 2**20, n)
    assert wire_bytes("all_to_all", 800, 8) == 700


def test_group_placement():
    lay = Layout(dp=4, tp=8, pp=8)
    tp, dp, pp = group_of(lay, "tp", H100), group_of(lay, "dp", H100), group_of(lay, "pp", H100)
    assert not tp.crosses_nodes and tp.per_node == 8
    assert dp.crosses_nodes and dp.per_node == 1 and dp.nodes == 4
    assert pp.crosses_nodes
    small = group_of(Layout(dp=16, tp=2), "dp", H100)
    assert small.per_node == 4 and small.nodes == 4  # 4 of the group per node share 4 NICs
    assert bus_bandwidth(H100, "all_reduce", 1e9, small) == pytest.approx(4 * 50e9 * 0.8)


def test_collective_time_alpha_beta():
    g = group_of(Layout(tp=8), "tp", H100)
    small, big = collective_time(H100, "all_reduce", 1024, g), collective_time(H100, "all_reduce", 2**30, g)
    assert small == pytest.approx(14 * H100.intra_node_latency, rel=0.01)  # latency-bound
    assert big == pytest.approx(14 * 2e-6 + 2 * 7 / 8 * 2**30 / (450e9 * 0.8))
    assert collective_time(H100, "all_reduce", 2**30, group_of(Layout(), "tp", H100)) == 0


def test_measured_busbw_replaces_link_model():
    prof = with_profile(H100, busbw={"all_reduce": ((1e3, 1e9), (1e9, 100e9))})
    g = group_of(Layout(tp=8), "tp", H100)
    assert bus_bandwidth(prof, "all_reduce", 1e9, g) == pytest.approx(100e9)
    assert bus_bandwidth(prof, "all_reduce", 1e6, g) == pytest.approx(1e9 + 0.5 * 99e9)  # log-interpolated


def test_dp_and_zero_volumes():
    w = Workload(get_model_config("llama3-8b"), 4096, 64)
    n = 1e9
    by = {z: bytes_by_dim(step_collectives(w, Layout(dp=8, zero=z), H100, n, 0, 32, 0, True, True))["dp"]
          for z in range(4)}
    ar = 2 * 7 / 8 * 4 * n  # fp32 gradients all-reduced
    assert by[0] == pytest.approx(ar)
    assert by[1] == pytest.approx(7 / 8 * 4 * n + 7 / 8 * 2 * n)  # reduce-scatter fp32 + all-gather bf16
    m = 8
    assert by[3] == pytest.approx(m * 7 / 8 * 4 * n + 2 * m * 7 / 8 * 2 * n)


def test_gemm_roofline():
    big = gemm_time(H100, 8192, 8192, 8192, H100.flops("bf16"), 2)
    waves = 4096 / (32 * 132)  # 4096 tiles of 128x128 in 32 waves over 132 SMs
    small_k = 8192 / (8192 + 244)  # Hopper bf16 GEMMs: k / (k + gemm_k0)
    assert big == pytest.approx(2 * 8192**3 / (989.4e12 * 0.8 * waves * small_k) + 3e-6, rel=1e-6)
    skinny = gemm_time(H100, 1, 8192, 8192, H100.flops("bf16"), 2)
    assert skinny > 8192 * 8192 * 2 / H100.hbm_bandwidth  # memory-bound
    # wave quantisation: 19 x 7 = 133 tiles need two waves on 132 SMs, one on 133
    two = gemm_time(H100, 128 * 19, 128 * 7, 16384, 1e15, 2) - 3e-6
    one = gemm_time(dataclasses.replace(H100, sm_count=133), 128 * 19, 128 * 7, 16384, 1e15, 2) - 3e-6
    assert two / one == pytest.approx(2 * 132 / 133)


def test_ring_latency_and_bandwidth_reproduce_a_measured_sweep():
    """The playbook cluster's override (published_runs.toml: 35.5 us per ring step, 44.5 GB/s per GPU NIC)
    against the all-gather its authors measured (256 MB, 8 H100 per node, median bus GB/s): the planner's
    ring time is within 20 % of every node count; the catalogue's InfiniBand figures are 6x too fast at 64 nodes."""
    efa = dataclasses.replace(H100, inter_node_latency=35.5e-6, inter_node_bandwidth=44.5e9)
    for nodes, busbw in ((2, 184.6), (4, 119.0), (8, 69.0), (16, 55.0), (32, 28.0), (64, 11.0)):
        g = group_of(Layout(dp=8 * nodes), "dp", efa)
        assert g.nodes == nodes and g.per_node == 8
        measured = (g.size - 1) / g.size * 256e6 / (busbw * 1e9)
        assert collective_time(efa, "all_gather", 256e6, g) == pytest.approx(measured, rel=0.20)
    ib = collective_time(H100, "all_gather", 256e6, group_of(Layout(dp=512), "dp", H100))
    assert ib < (511 / 512 * 256e6 / 11e9) / 5


def test_a_measured_fabric_caps_cross_node_all_reduce():
    """allreduce_busbw_by_nodes (the playbook cluster's all-reduce over every GPU of 2..64 nodes) is a ceiling
    on any all-reduce spanning that many nodes, read log-linearly between node counts: it binds where the
    link model promises more (a node-full group), not where the link model is already lower, and it leaves
    all-gathers and groups inside a node alone."""
    fabric = ((2, 361.7e9), (4, 160.1e9), (64, 32.9e9))
    efa = with_profile(dataclasses.replace(H100, inter_node_bandwidth=44.5e9), allreduce_busbw_by_nodes=fabric)
    full = group_of(Layout(dp=64), "dp", efa)  # 8 nodes, all 8 GPUs of each: 8 x 44.5 x 0.8 = 284.8 GB/s
    assert full.nodes == 8
    assert bus_bandwidth(efa, "all_reduce", 1e9, full) == pytest.approx(160.1e9 + (32.9e9 - 160.1e9) / 4)
    assert bus_bandwidth(efa, "all_gather", 1e9, full) == pytest.approx(8 * 44.5e9 * 0.8)
    thin = group_of(Layout(dp=4, tp=8), "dp", efa)  # 4 nodes, one GPU of each: the link model's 35.6 GB/s
    assert bus_bandwidth(efa, "all_reduce", 1e9, thin) == pytest.approx(44.5e9 * 0.8)
    inside = group_of(Layout(tp=8), "tp", efa)
    assert bus_bandwidth(efa, "all_reduce", 1e9, inside) == bus_bandwidth(H100, "all_reduce", 1e9, inside)
    from pentatron.hardware.catalogue import hardware_from_dict

    toml = hardware_from_dict({"base": "h100", "allreduce_busbw_by_nodes": {"nodes": [2, 64], "gb_s": [361.7, 32.9]}})
    assert toml.profile.allreduce_busbw_by_nodes == ((2.0, 361.7e9), (64.0, 32.9e9))


@pytest.mark.parametrize(("name", "p", "m", "v"), [("1f1b", 4, 200, 1), ("zb", 4, 130, 1), ("afab", 2, 97, 1),
                                                   ("interleaved", 4, 64, 2)])
def test_extrapolated_makespan_matches_simulation(name, p, m, v):
    phases = [Phase(1.0 + 0.1 * s, 2.0, 0.7) for s in range(p * v)]
    phases[-1] = Phase(2.0, 3.0, 1.0)  # heavier last stage
    t, _ = pipeline_makespan(name, p, m, v, phases, 0.05)
    exact = simulate(make_schedule(name, p, m, v), [x.f for x in phases], [x.b for x in phases],
                     [x.w for x in phases], 0.05).makespan
    assert t == pytest.approx(exact, rel=1e-9)


def test_layers_per_chunk_follow_the_engine_partition():
    cfg = get_model_config("llama3-70b")
    assert layers_per_chunk(cfg, 4096, 8, 2) == (5,) * 16  # interleaved: equal chunks
    split = layers_per_chunk(cfg, 4096, 8)
    assert sum(split) == 80 and split[-1] < max(split)  # the LM head stage gets fewer layers
    small = layers_per_chunk(get_model_config("debug"), 256, 2)
    assert small[0] > small[1]  # a small model's LM head costs layers


def test_step_time_and_mfu():
    w = Workload(get_model_config("llama3-70b"), 4096, 1024)
    lay = Layout(dp=4, tp=8, pp=8, sp=True, zero=1, pp_schedule="interleaved", pp_virtual=5)
    assert problems(w, lay, H100, 256) == []
    st = step_time(w, lay, H100)
    rate = throughput(w, lay, H100, st)
    assert 0 < rate.mfu < 1
    # no layer recompute: only our chunked loss's head GEMM replays (hardware FLOPs, not model FLOPs), for
    # 3 of a micro-batch's 4 chunks of 1024 tokens; with the loss from full logits nothing replays
    cfg = w.cfg
    assert rate.hardware_flops_per_token - rate.model_flops_per_token == pytest.approx(
        2 * cfg.hidden_size * cfg.vocab_size * 3 / 4)
    eager = lay.with_recipe(cross_entropy="eager")
    r_eager = throughput(w, eager, H100, step_time(w, eager, H100))
    assert r_eager.hfu == pytest.approx(r_eager.mfu) and rate.hfu > rate.mfu
    assert st.step >= st.pipeline > 0 and 0 < st.bubble_fraction < 0.2
    assert st.exposed_by_dim["tp"] > 0
    # more recompute: same model FLOPs, more hardware FLOPs, longer step
    st2 = step_time(w, lay.with_(recompute="full"), H100)
    r2 = throughput(w, lay.with_(recompute="full"), H100, st2)
    assert st2.step > st.step and r2.hfu > r2.mfu


def test_the_embedding_gradient_is_reduced_after_the_backward():
    """The embedding's gradient is complete only when the backward ends, and being larger than a bucket
    it is a bucket by itself (DDP, Megatron): its all-reduce is exposed in full. A 2-layer model with a
    128k vocabulary, one micro-batch per step: the embedding is 44 % of the gradient (131.1M of 2 x 16.8M
    layer, 131.1M LM-head and 131.1M embedding parameters; the untied head's gradient is ready first)."""
    from pentatron.models.config import ModelConfig
    from pentatron.plan.memory import DP_BUCKET, rank_params

    cfg = ModelConfig(vocab_size=128000, hidden_size=1024, n_layers=2, n_heads=8, n_kv_heads=8,
                      ffn_hidden_size=4096)
    w = Workload(cfg, 2048, 64)
    lay = Layout(dp=8, micro_batch=8)
    st = step_time(w, lay, H100)
    (c,) = [c for c in st.collectives if c.dim == "dp_cp" and c.where == "gradients"]
    share = 128000 * 1024 / rank_params(w, lay, 0).dense
    assert share == pytest.approx(131.072 / 295.7, abs=1e-3) and share > DP_BUCKET / c.payload
    last_bwd = st.phases[0].b + st.phases[0].w
    assert st.dp_exposed == pytest.approx(max(0.0, c.time_per_step - last_bwd) + c.time * share)


def test_tensor_parallel_collectives_per_micro_batch():
    """What training's ledger records per micro-batch (tests/observe/test_report.py checks it byte for
    byte): without SP 4 all-reduces per layer, the embedding's forward and the head input's backward one;
    under SP each of those becomes an all-gather and a reduce-scatter, and the norm weights' gradients
    (2 per layer and the final norm, fp32) are summed over tp in one all-reduce per step."""
    w = Workload(get_model_config("llama3-8b"), 4096, 8)
    act = 4096 * 4096 * 2  # one micro-batch of 1 sequence, bf16
    counts = {}
    for sp in (False, True):
        for c in step_collectives(w, Layout(dp=1, tp=2, sp=sp), H100, 1e9, 0, 4, 0, first=True, last=True):
            counts[(sp, c.op, c.where)] = (c.count, c.payload)
    m = 8  # micro-batches
    assert counts[(False, "all_reduce", "layers fwd+bwd")] == (m * (4 * 4 + 1 + 1), act)
    assert counts[(True, "all_gather", "layers fwd+bwd (SP)")] == (m * 18, act)
    assert counts[(True, "reduce_scatter", "layers fwd+bwd (SP)")] == (m * 18, act)
    norms = PARTIAL_GRADS_WHERE
    assert counts[(True, "all_reduce", norms)] == (1, (2 * 4 + 1) * 4096 * 4)
    assert (False, "all_reduce", norms) not in counts  # no q/k norms: nothing partial without SP


def test_moe_gradients_under_sp_join_the_one_partial_sum_per_step():
    """Under SP each tp rank routes its sequence shard, so every MoE parameter's gradient is partial over tp:
    it joins the norms' one all-reduce per step (parallel/moe_tokens.py), of the fp32 pieces this rank owns
    (dense: 1/(dp×cp) under ZeRO; experts: this ep rank's E/ep, 1/edp under ZeRO), not one per parameter and
    micro-batch. Per micro-batch only the router's E counts are summed (fp32). debug-moe: h 128, E 8, expert
    ffn 64, one shared expert of 64, layer 0 dense (tests/observe/test_report.py meets the ledger with it).
    A larger model's go in several all-reduces of at most a DP bucket (the runtime's concatenation buffer)."""
    w = Workload(get_model_config("debug-moe"), 32, 16)
    h, moe_layers, layers = 128, 3, 4
    dense = (2 * layers + 1) * h + moe_layers * (8 * h + 3 * h * 64)  # norms; routers, shared experts
    experts = moe_layers * 3 * h * 64 * 8
    for lay, owned in ((Layout(dp=1, tp=2, sp=True, micro_batch=2), dense + experts),
                       (Layout(dp=4, tp=2, sp=True, ep=2, zero=1, micro_batch=2), dense / 4 + experts / 2 / 2)):
        m = lay.microbatches(w)
        colls = step_collectives(w, lay, H100, 1e6, experts / lay.ep, layers, moe_layers, first=True, last=True)
        tp = [(c.op, c.count, c.payload, c.where) for c in colls if c.dim == "tp" and c.op == "all_reduce"]
        assert (("all_reduce", 1, owned * 4, PARTIAL_GRADS_WHERE)) in tp, tp
        assert ("all_reduce", m * moe_layers, 4 * 8, MOE_SP_WHERE) in tp, tp
        # nothing else: the loss's and the step's scalars (no gradient all-reduce per parameter and micro-batch)
        assert {c[3] for c in tp} == {PARTIAL_GRADS_WHERE, MOE_SP_WHERE, LOSS_WHERE, STEP_SCALARS_WHERE}, tp
        off = step_collectives(w, lay.with_(sp=False), H100, 1e6, experts / lay.ep, layers, moe_layers, True, True)
        assert not [c for c in off if c.where == PARTIAL_GRADS_WHERE]  # without SP each rank routes all tokens
        # the MoE block runs outside the tp regions: an MoE layer's attention's collectives only (1 each way),
        # the dense layer's 2, the embedding's and the head's: 12 all-gathers (SP) or all-reduces per micro-batch
        per_mb = {(c.op, c.where): c.count / m for c in [*colls, *off] if c.dim == "tp"}
        assert per_mb[("all_gather", SP_LAYERS_WHERE)] == per_mb[("reduce_scatter", SP_LAYERS_WHERE)] == 12
        assert per_mb[("all_reduce", LAYERS_WHERE)] == 12

    from pentatron.parallel.tensor import PARTIAL_CHUNK_BYTES
    from pentatron.plan.memory import DP_BUCKET

    assert PARTIAL_CHUNK_BYTES == DP_BUCKET
    big = Workload(get_model_config("qwen3-moe-30b-a3b"), 4096, 64)
    lay = Layout(dp=8, tp=2, sp=True, ep=8, zero=1)
    (c,) = [c for c in step_time(big, lay, H100).collectives if c.where == PARTIAL_GRADS_WHERE]
    assert c.count > 1 and c.payload <= DP_BUCKET and c.count == -(-c.payload * c.count // DP_BUCKET)

def test_hsdp_shards_over_a_node_and_all_reduces_one_shard_across_nodes():
    """dp16 = 2 replicas × 8-rank shard groups (ZeRO-3): the model states of dp8 ZeRO-3 (sharded 8 ways), the
    reduce-scatters and all-gathers inside a node, and one all-reduce of 1/8 of the fp32 gradients per step over
    2 ranks on 2 nodes, fully exposed (training issues it after the last reduce-scatter)."""
    from pentatron.plan.memory import memory_per_gpu

    w = Workload(get_model_config("llama3-8b"), 4096, 64)
    hsdp, plain8 = Layout(dp=16, zero=3, dp_shard=8), Layout(dp=8, zero=3)
    mh, m8 = memory_per_gpu(w, hsdp, H100), memory_per_gpu(w, plain8, H100)
    for part in ("parameters", "gradients", "master_weights", "optimizer"):
        assert getattr(mh, part) == getattr(m8, part), part
    assert memory_per_gpu(w, Layout(dp=16, zero=3), H100).optimizer == pytest.approx(m8.optimizer / 2)
    assert (group_of(hsdp, "dp_shard", H100).nodes, group_of(hsdp, "dp_replicate", H100).nodes) == (1, 2)
    st = step_time(w, hsdp, H100)
    dp = [c for c in st.collectives if c.dim == "dp_cp" and c.kind.name.startswith("ZERO3")]
    assert {c.op for c in dp} == {"reduce_scatter", "all_gather"}
    assert all(c.wire == pytest.approx(c.payload * 7 / 8) for c in dp)  # 8 ranks, inside one node
    (rep,) = [c for c in st.collectives if c.dim == "dp_replicate"]
    # the reduce-scatters: every micro-batch's fp32 gradients of all the rank's parameters
    n_params = sum(c.payload * c.count for c in dp if c.op == "reduce_scatter") / 4 / hsdp.microbatches(w)
    assert (rep.op, rep.count) == ("all_reduce", 1) and rep.payload == pytest.approx(n_params * 4 / 8)
    assert st.dp_exposed >= rep.time


def test_h100_fabric_is_the_measured_all_reduce_where_it_was_measured():
    """The H100 default network (hardware/fabric.py: NVIDIA's nccl-tests all-reduce over 4..1024 full nodes)
    gives a node-full cross-node all-reduce its measured bus bandwidth, read on log scales between the
    readings; groups with fewer GPUs per node, other collectives, messages under 1 MiB, other NICs and files
    that set their own network keep the link model (the A100 has no curve)."""
    from pentatron.hardware.catalogue import hardware_from_dict

    link = dataclasses.replace(H100, efficiency=dataclasses.replace(H100.efficiency, fabric=None))
    full = group_of(Layout(dp=32), "dp", H100)  # 4 nodes x 8 GPUs
    gib = 2**30
    assert bus_bandwidth(H100, "all_reduce", gib, full) == pytest.approx(352e9)
    assert collective_time(H100, "all_reduce", gib, full) == pytest.approx(2 * 31 / 32 * gib / 352e9)
    big = group_of(Layout(dp=8192), "dp", H100)  # 1024 nodes: 157 GB/s at 128 MiB, 217 at 256 MiB
    assert bus_bandwidth(H100, "all_reduce", 2**27, big) == pytest.approx(157e9)
    assert bus_bandwidth(H100, "all_reduce", 2**27 * 2**0.5, big) == pytest.approx((157e9 * 217e9) ** 0.5)
    mid = group_of(Layout(dp=256), "dp", H100)  # 32 nodes: between the 16- and 128-node readings at 4 GiB
    assert bus_bandwidth(H100, "all_reduce", 4 * gib, mid) == pytest.approx(372e9 ** (2 / 3) * 359e9 ** (1 / 3))
    for other in ((Layout(dp=32, tp=8), "dp", "all_reduce", gib), (Layout(dp=32), "dp", "all_gather", gib),
                  (Layout(dp=32), "dp", "all_reduce", 2**19), (Layout(tp=8), "tp", "all_reduce", gib)):
        g = group_of(other[0], other[1], H100)
        assert collective_time(H100, other[2], other[3], g) == collective_time(link, other[2], other[3], g)
    fab = H100.efficiency.fabric
    assert get_gpu("h200").efficiency.fabric is fab and get_gpu("a100").efficiency.fabric is None
    slower = dataclasses.replace(H100, inter_node_bandwidth=25e9)
    assert bus_bandwidth(slower, "all_reduce", gib, full) == pytest.approx(8 * 25e9 * 0.8)
    assert hardware_from_dict({"base": "h100", "inter_node_latency_us": 35.5}).efficiency.fabric is None
    assert hardware_from_dict({"base": "h100", "hbm_gib": 96}).efficiency.fabric is fab
