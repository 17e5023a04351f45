"""ZeRO-1/2/3: exact parity (float64, 1e-10) with a plain 1-process loop on real gloo ranks (every step,
final parameters), communication
volume against the playbook formulas, per-rank memory against the ZeRO formulas, ZeRO-3 prefetch and
freeing, sharded checkpoints, and the flat layout's sharding arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pentatron.distributed.comm import ring_bytes
from pentatron.models.llama import build_model
from pentatron.models.registry import get_model_config
from pentatron.parallel.grad_buffer import FlatLayout
from pentatron.parallel.memory import zero_formula
from pentatron.parallel.zero import zero3_units
from tests.distributed.dp_harness import ELEMENT_BYTES, assert_parity, dp_runs, reference


@pytest.fixture(scope="module")
def ds(default_dataset) -> str:
    return str(default_dataset)


@pytest.mark.parametrize("accumulate", [False, True], ids=["no-accum", "accum"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_zero_matches_one_process_every_step(ds, world, stage, accumulate):
    ranks = dp_runs(world, ds)
    got, ref = ranks[0]["parity"][stage, accumulate], reference(ds)
    assert_parity(got, ref)  # global norm over the full gradient; final parameters gathered from the shards
    assert len({r["parity"][stage, accumulate]["digest"] for r in ranks}) == 1, "ranks disagree"


def test_zero3_with_full_activation_recompute_matches_one_process(ds):
    assert_parity(dp_runs(2, ds)[0]["recompute"], reference(ds))


@pytest.mark.parametrize("world", [2, 4])
def test_zero_communication_volume_is_the_playbook_formula(ds, world):
    """Per rank per step, ring volumes: ZeRO-1/2 reduce-scatter + all-gather = 2(N−1)/N·Ψ, ZeRO-3
    3(N−1)/N·Ψ (elements of ELEMENT_BYTES: the runs are fp64); the reduce-scatters of ZeRO-2/3 and the
    gathers of ZeRO-3 run on every micro-step, ZeRO-1's on the last only."""
    ring = (world - 1) / world
    for accumulate in (False, True):
        micro = 2 if accumulate else 1
        for stage in (1, 2, 3):
            run = dp_runs(world, ds)[0]["parity"][stage, accumulate]
            psi = run["n_params"]
            dp = run["comm"]["dp"]
            rs, ag = dp["reduce_scatter"]["bytes"], dp["all_gather"]["bytes"]
            per_micro = {1: 0, 2: 1, 3: 1}[stage]
            b = ELEMENT_BYTES
            expected_rs = ring * psi * b * (micro if per_micro else 1)
            expected_ag = ring * psi * b * (2 * micro if stage == 3 else 1)
            assert rs == pytest.approx(expected_rs, rel=0.01), (stage, accumulate)
            assert ag == pytest.approx(expected_ag, rel=0.01), (stage, accumulate)
            if not accumulate:
                assert rs + ag == pytest.approx((3 if stage == 3 else 2) * ring * psi * b, rel=0.01)
            # Exactly: the padded flat layout, plus two scalars (loss average, squared grad norm).
            assert rs == ring_bytes("reduce_scatter", run["numel"] * b, world) * (micro if stage > 1 else 1)
            assert dp["all_reduce"]["bytes"] == 2 * ring_bytes("all_reduce", b, world)
            assert dp["all_reduce"]["calls"] == 2


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_memory_per_rank_is_the_formula(ds, world, stage):
    """fp64 parameters and state (the parity runs): P = 8 bytes, state 8, no separate master. Measured after
    training (Adam state exists); the bf16 test below checks the fp32 state a user's run keeps."""
    run = dp_runs(world, ds)[0]["parity"][stage, False]
    assert run["numel"] >= run["n_params"] and run["numel"] - run["n_params"] < 0.01 * run["n_params"]
    expected = zero_formula(stage, run["numel"], world, ELEMENT_BYTES, False, state_bytes=ELEMENT_BYTES)
    got = run["memory"]
    assert (got["params"], got["grads"], got["optimizer"], got["master"]) == (
        expected.params, expected.grads, expected.optimizer, expected.master)
    ddp = dp_runs(world, ds)[0]["parity"][0, False]["memory"]
    assert got["total"] < ddp["total"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_memory_with_bf16_params_and_fp32_master(ds, stage):
    mem = dp_runs(2, ds)[0]["bf16_memory"][stage]
    expected = zero_formula(stage, mem["numel"], 2, 2, True)
    assert (mem["params"], mem["grads"], mem["optimizer"], mem["master"]) == (
        expected.params, expected.grads, expected.optimizer, expected.master)


def test_zero3_prefetches_the_next_layer_and_frees_the_previous(ds):
    """When layers[1] starts computing, the all-gathers of the embedding unit, layers[0], layers[1] and
    (prefetched, still in flight) layers[2] have been issued, layers[0] has been freed again, and after
    backward no unit is held. "Held" counts the distinct storages the parameters point at."""
    probe = dp_runs(2, ds)[0]["prefetch"]
    assert probe["all_gathers"] == 4
    assert probe["held"] == 2  # tied embedding/head (used again by the head) and layers[1]
    assert probe["held_after_backward"] == 0
    assert probe["units"] == 6  # embedding(+tied head), 4 layers, final norm


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_checkpoint_resume_is_exact(ds, stage):
    """2 steps + save + resume + 2 steps (mid-cosine) = 4 straight steps: losses, parameters and optimizer
    state bitwise equal."""
    ck = dp_runs(2, ds)[0]["checkpoint"][stage]
    assert ck["steps"] == [1, 2, 3, 4]
    assert ck["resumed"] == ck["straight"]
    straight, resumed = ck["state"]
    assert straight.keys() == resumed.keys() and any(k.endswith("exp_avg") for k in straight)
    for key, value in straight.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)


def test_a_sharded_checkpoint_resumes_in_another_zero_stage(ds):
    """A ZeRO-1 checkpoint opened by a ZeRO-2 run is re-sharded (checkpoint/reshard.py; the numbers are
    checked in tests/checkpoint/test_reshard.py)."""
    assert dp_runs(2, ds)[0]["checkpoint"]["layout_error"] is None


# ---------------------------------------------------------------------- layout arithmetic (no processes)


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_flat_layout_pieces_cover_every_element_exactly_once(shards):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 7, 1, 12, 3)]
    layout = FlatLayout.by_size(params, bucket_numel=10, shards=shards)
    assert all(b.padded % shards == 0 and b.padded - b.numel < shards for b in layout.buckets)
    assert layout.total == sum(b.padded for b in layout.buckets)
    seen = {id(p): torch.zeros(p.numel(), dtype=torch.int64) for p in params}
    local_used = []
    for rank in range(shards):
        for pc in layout.pieces(rank):
            seen[id(pc.param)][pc.lo: pc.hi] += 1
            lo, hi = layout.shard_range(layout.bucket_of[pc.param], rank)
            assert lo <= pc.glob and pc.glob + pc.numel <= hi
            assert layout.offset(pc.param) + pc.lo == pc.glob
            local_used.append((rank, pc.local, pc.local + pc.numel))
    assert all(bool((c == 1).all()) for c in seen.values())
    for rank in range(shards):  # local offsets within a rank's shard never overlap
        spans = sorted((a, b) for r, a, b in local_used if r == rank)
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))
        assert all(b <= layout.shard_numel for _, b in spans)


def test_zero3_units_are_layers_plus_embedding_norm_and_a_tied_head_joins_the_embedding():
    tied = build_model(get_model_config("debug"), device="meta")
    units = zero3_units(tied)
    assert len(units) == tied.cfg.n_layers + 2
    (embed_mods, embed_params), *_, (norm_mods, _) = units
    assert embed_mods == [tied.embed, tied.lm_head] and embed_params == [tied.embed.weight]
    assert norm_mods == [tied.norm]
    untied = build_model(get_model_config("debug-untied"), device="meta")
    assert len(zero3_units(untied)) == untied.cfg.n_layers + 3
    all_params = [p for _, ps in zero3_units(untied) for p in ps]
    assert len(all_params) == len(list(untied.parameters()))


def test_zero12_parity_with_the_parameter_gather_waited_after_the_step(ds):
    """parallel.overlap_param_gather=false (ZeRO-1, two micro-batches): the same float64 numbers."""
    assert_parity(dp_runs(2, ds)[0]["gather_off"], reference(ds))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_parameter_gather_overlaps_the_next_forward(ds, stage):
    """After a step every gather bucket's all-gather is issued (in forward order) before the next forward
    starts, and each is waited in the forward pre-hook of the first module using it, just before that
    module runs — once per step, in the first of its two micro-batches; the last step's are still in
    flight until `wait_param_gather`."""
    probe = dp_runs(2, ds)[0]["param_gather"][stage]
    events, uses = probe["events"], probe["uses"]
    n = len(probe["groups"])
    assert n > 3 and sum(map(len, probe["groups"])) == len(probe["grad_buckets"])
    ends = [i for i, e in enumerate(events) if e[0] == "step"]
    first, second = events[:ends[0]], events[ends[0] + 1: ends[1]]
    for step in (first, second):  # the step's issues: all of them, in order, after its last forward
        assert step[-n:] == [("issue", g) for g in range(n)]
        assert not any(e[0] == "issue" for e in step[:-n])
    assert not any(e[0] == "wait" for e in first)  # nothing was in flight before the first step
    forward = second[:-n]
    assert sorted(g for kind, g in forward if kind == "wait") == list(range(n)), "each bucket waited once"
    modules = [m for kind, m in forward if kind == "module"]
    per_micro = len(modules) // 2
    assert modules[:per_micro] == modules[per_micro:], "two micro-batches, the same module order"
    waited: set[int] = set()
    for i, e in enumerate(forward):
        if e[0] != "module":
            continue
        due = sorted(set(uses[e[1]]) - waited)  # this module's buckets not waited yet: waited just before it
        before = []
        j = i - 1
        while j >= 0 and forward[j][0] == "wait":
            before.append(forward[j][1])
            j -= 1
        assert sorted(before) == due, (e[1], before, due)
        waited |= set(due)
    last_wait = max(i for i, e in enumerate(forward) if e[0] == "wait")
    second_micro = [i for i, e in enumerate(forward) if e == ("module", modules[0])][1]
    assert last_wait < second_micro, "all waits in the first micro-batch"
    assert len({g for m in modules for g in uses[m]}) == n  # every bucket has a module that waits it
    # only the first bucket is waited before the first module with parameters (exposed); the others were
    # issued before the forward started and are waited modules later
    first = next(i for i, e in enumerate(forward) if e[0] == "module" and uses[e[1]])
    assert [e for e in forward[:first] if e[0] == "wait"] == [("wait", 0)]
    assert probe["in_flight_at_end"] == n


def test_gather_buckets_hold_bucket_mb_of_parameters():
    """bf16 parameters, 1 MiB buckets: a gradient bucket holds 256 Ki fp32 elements, a gather bucket 512 Ki
    bf16 elements, i.e. two gradient buckets, in forward order (the gradient layout is in backward order)."""
    from pentatron.parallel.zero import _gather_buckets

    params = [torch.nn.Parameter(torch.zeros(2**18)) for _ in range(6)]
    layout = FlatLayout.by_size(list(reversed(params)), 2**18, shards=2)
    groups = _gather_buckets(layout.buckets, 2**20 // 2)
    assert [[b.params[0] for b in g] for g in groups] == [[params[0], params[1]], [params[2], params[3]],
                                                          [params[4], params[5]]]
