"""DDP (ZeRO-0): exact parity (float64, 1e-10) with a plain 1-process loop on real gloo ranks, exact
communication volume, no
communication during accumulation, overlap with backward, memory, checkpoints, bad input."""

from __future__ import annotations

import pytest

from pentatron.cli import main
from pentatron.config import ConfigError, load_config
from pentatron.distributed.comm import ring_bytes
from pentatron.parallel.memory import zero_formula
from tests.distributed.dp_harness import ELEMENT_BYTES, assert_parity, dp_runs, reference


@pytest.fixture(scope="module")
def ds(default_dataset) -> str:
    return str(default_dataset)


@pytest.mark.parametrize("accumulate", [False, True], ids=["no-accum", "accum"])
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_matches_one_process_every_step(ds, world, accumulate):
    ranks = dp_runs(world, ds)
    got, ref = ranks[0]["parity"][0, accumulate], reference(ds)
    assert_parity(got, ref)  # the clipped norm is the full gradient's
    assert len({r["parity"][0, accumulate]["digest"] for r in ranks}) == 1, "replicas diverged"


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_all_reduce_volume_is_the_ring_formula(ds, world):
    for accumulate in (False, True):
        run = dp_runs(world, ds)[0]["parity"][0, accumulate]
        psi = run["n_params"]
        b = ELEMENT_BYTES  # the parity runs are fp64
        grads = 2 * (world - 1) / world * psi * b  # playbook: 2(N−1)/N·Ψ elements
        got = run["comm"]["dp"]["all_reduce"]["bytes"]
        assert got == pytest.approx(grads, rel=0.01)
        # Exactly: the gradient buckets plus the one-element loss average, nothing else.
        assert got == ring_bytes("all_reduce", psi * b, world) + ring_bytes("all_reduce", b, world)
        assert set(run["comm"]) == {"dp"} and set(run["comm"]["dp"]) == {"all_reduce"}


def test_accumulation_micro_steps_do_not_communicate(ds):
    probe = dp_runs(2, ds)[0]["overlap"]
    assert probe["during_accumulation"] == 0
    one, two = (dp_runs(2, ds)[0]["parity"][0, a] for a in (False, True))
    assert one["comm"] == two["comm"] and one["calls"] == two["calls"]


def test_first_bucket_all_reduce_is_issued_before_backward_finishes(ds):
    """When backward reaches the embedding (its last module), the buckets of every other parameter
    have already launched their all-reduce; the embedding's bucket goes last."""
    probe = dp_runs(2, ds)[0]["overlap"]
    assert probe["buckets"] >= 3
    before = probe["before_embedding_backward"]
    assert before and set(before) == {"all_reduce"}
    assert len(before) == probe["buckets"] - 1 == probe["by_end_of_backward"] - 1


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_memory_is_the_formula(ds, world):
    run = dp_runs(world, ds)[0]["parity"][0, False]
    assert run["numel"] == run["n_params"]  # DDP needs no padding
    expected = zero_formula(0, run["n_params"], world, ELEMENT_BYTES, False, state_bytes=ELEMENT_BYTES)
    assert run["memory"] == {**run["memory"], **vars(expected)}


def test_ddp_memory_with_bf16_params_counts_fp32_master_and_grads(ds):
    mem = dp_runs(2, ds)[0]["bf16_memory"][0]
    expected = zero_formula(0, mem["numel"], 2, 2, True)
    assert {k: mem[k] for k in ("params", "grads", "optimizer", "master")} == {
        "params": expected.params, "grads": expected.grads, "optimizer": expected.optimizer,
        "master": expected.master}


def test_ddp_checkpoint_resume_is_exact_with_two_ranks(ds):
    ck = dp_runs(2, ds)[0]["checkpoint"][0]
    assert ck["steps"] == [1, 2, 3, 4]
    assert ck["resumed"] == ck["straight"]  # bitwise: the same operations in the same order


def test_metrics_log_comm_bytes_by_dimension_and_op_and_memory_per_rank(ds):
    first = dp_runs(2, ds)[0]["checkpoint"]["first_metrics"]  # rank 0's metrics.jsonl, ZeRO-0, dp=2
    assert first is not None and first["step"] == 1
    assert set(first["comm_bytes"]) == {"dp"} and first["comm_bytes"]["dp"]["all_reduce"] > 0
    assert first["comm_calls"]["dp"]["all_reduce"] >= 2
    assert {"params", "grads", "optimizer", "master", "total"} <= set(first["memory"])


# ---------------------------------------------------------------------- bad input, before launch


@pytest.mark.parametrize(("args", "expected"), [
    (["--nproc", "4", "--parallel.dp=3"], "does not equal the world size 4"),
    (["--nproc", "4", "--parallel.dp=3"], "dp=3 does not divide the world size"),
    (["--nproc", "2", "--train.global_batch=6", "--train.micro_batch=2"],
     "train.global_batch=6 is not divisible by train.micro_batch=2 × dp=2"),
    (["--nproc", "2", "--parallel.zero=4"], "parallel.zero must be 0, 1, 2 or 3, got 4"),
    (["--parallel.zero=-1"], "parallel.zero must be 0, 1, 2 or 3, got -1"),
])
def test_bad_parallel_input_exits_2_before_any_process_starts(capsys, args, expected):
    code = main(["train", "configs/debug.toml", *args])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err


def test_bad_degrees_are_config_errors_listing_every_problem():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["parallel.dp=3", "parallel.zero=7", "train.global_batch=8", "train.micro_batch=4"],
                    world_size=4)
    text = "\n".join(e.value.problems)
    assert "dp=3 does not divide the world size" in text and "parallel.zero must be 0, 1, 2 or 3" in text
    assert "not divisible by train.micro_batch=4 × dp=3" in text
