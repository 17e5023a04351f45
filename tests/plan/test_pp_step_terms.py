"""The pipeline's hop between stages as a step meets it (calibrate/pp_step.py, issue 10 item 5): on a CPU
profile that measured it, a pipeline send inside the node costs bench's in-step swap time by message
bytes instead of the ping-pong curve's one-way time. Hand-computed on the debug model (hidden 128, fp32:
a micro-batch of 64 tokens sends 32,768 B)."""

from __future__ import annotations

import dataclasses

import pytest

from pentatron.hardware.catalogue import get_gpu, hardware_from_dict, with_profile
from pentatron.models.registry import get_model_config
from pentatron.plan.comm import p2p_time, pp_hop_time
from pentatron.plan.layout import Layout, Workload
from pentatron.plan.timing import pipeline_makespan, step_time

H100 = get_gpu("h100")
W = Workload(get_model_config("debug"), 64, 8)
FLAT = ((4096.0, 1e9), (4.0 * 2**20, 1e9))  # the ping-pong: 1 GB/s one way at every size
BASE = with_profile(H100, busbw={"p2p": FLAT})
# in-step hop: 0.4 ms at 4 KiB, 0.9 ms at 32 KiB, 1.2 ms at 256 KiB, 1.5 ms at 1 MiB
PPS = with_profile(BASE, pp_hop=((4096.0, 4e-4), (32768.0, 9e-4), (262144.0, 1.2e-3), (2.0**20, 1.5e-3)))
PP2 = Layout(dp=1, pp=2, micro_batch=1, precision="fp32")


def test_the_hop_reads_the_in_step_swap_by_message_bytes():
    assert pp_hop_time(W, PP2, PPS) == pytest.approx(9e-4)  # 64 x 128 x 4 B = 32 KiB: a measured point
    # 2 x 64 tokens = 64 KiB: log2(2) of the log2(8) between 32 and 256 KiB -> 0.9 + 0.3 / 3 ms
    assert pp_hop_time(W, dataclasses.replace(PP2, micro_batch=2), PPS) == pytest.approx(1.0e-3)
    # below the smallest point: the smallest's time (latency-bound)
    small = Workload(get_model_config("debug"), 4, 8)  # 4 tokens x 128 x 4 B = 2 KiB
    assert pp_hop_time(small, PP2, PPS) == pytest.approx(4e-4)
    # beyond the largest: 1.5 ms + what the ping-pong adds from 1 MiB to 2 MiB (1 MiB at 1 GB/s)
    long = Workload(get_model_config("debug"), 4096, 8)  # 4096 x 128 x 4 B = 2 MiB
    assert pp_hop_time(long, PP2, PPS) == pytest.approx(1.5e-3 + 2**20 / 1e9)
    # not measured: the ping-pong's one-way time, as before
    assert pp_hop_time(W, PP2, BASE) == pytest.approx(p2p_time(BASE, 32768, False)) == pytest.approx(32768 / 1e9)


def test_a_hop_across_nodes_keeps_the_link_model():
    # 2 GPUs per node, pp 2 over 2 nodes: the in-node measurement says nothing about the network
    two = dataclasses.replace(PPS, gpus_per_node=1)
    assert pp_hop_time(W, PP2, two) == pytest.approx(p2p_time(two, 32768, True))


def test_the_pipeline_pays_the_measured_hop_between_its_stages():
    st = step_time(W, PP2, PPS)
    m = PP2.microbatches(W)
    assert m == 8
    expect, _ = pipeline_makespan("1f1b", 2, m, 1, list(st.phases), 9e-4)
    assert st.pipeline == pytest.approx(expect)
    # a slower hop can only lengthen the step (here: 0.9 ms per hop against the ping-pong's 33 us)
    assert st.pipeline > step_time(W, PP2, BASE).pipeline


def test_profile_table_parses_and_names_what_is_missing():
    g = hardware_from_dict({"name": "x", "base": "h100",
                            "pp_step": {"hop_bytes": [262144, 4096], "hop_us": [1200, 400], "compute_us": 5000}})
    assert [b for b, _ in g.profile.pp_hop] == [4096, 262144]  # sorted by size
    assert [t for _, t in g.profile.pp_hop] == pytest.approx([4e-4, 1.2e-3])
    with pytest.raises(ValueError, match="pp_step needs"):
        hardware_from_dict({"name": "x", "base": "h100", "pp_step": {"hop_bytes": [4096], "hop_us": [0]}})
    with pytest.raises(ValueError, match="pp_step needs"):
        hardware_from_dict({"name": "x", "base": "h100", "pp_step": {"hop_bytes": [4096, 8192], "hop_us": [5]}})
