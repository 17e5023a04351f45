"""research/nanotron_replay.py: the op-by-op allocation sequence of nanotron's step, and the planner's
per-tensor arithmetic for the same recipe (published_runs.toml's playbook source), are two readings of
the same code: their live peaks agree. Also: nothing a step allocates outlives it but the model states,
and the sweep's recipe follows each job's ZeRO stage and batch."""

from __future__ import annotations

from pathlib import Path

import nanotron_replay
import playbook_sweep
import pytest

RESEARCH = Path(__file__).resolve().parents[1]
BENCHMARKS = RESEARCH.parent / "benchmarks"  # published_runs.toml: the product's accuracy data


@pytest.fixture(scope="module")
def modules():
    return playbook_sweep, nanotron_replay


# 1B tp1 ZeRO-1 dp16; 1B tp4 ZeRO-0 dp32 (the first batch: gathered inputs kept; DDP); 3B tp2 ZeRO-1;
# 8B tp4 ZeRO-1 mb4; 8B tp4 pp2 stage 0 ZeRO-1
JOBS = {"14113489", "13502220", "14113499", "14113516", "14098634"}


def _sweep_jobs(sweep, directory: Path, ids: set[str]):
    """The sweep's jobs that trained with these SLURM ids, loaded as playbook_sweep loads them all."""
    lines = (RESEARCH / "playbook_sweep.csv").read_text().splitlines()
    picked = [ln for ln in lines[1:] if ln.split(",")[0] in ids and ",Success," in ln]
    path = directory / "few.csv"
    path.write_text("\n".join([lines[0], *picked]) + "\n")
    return sweep.load_jobs(path)[0]


@pytest.fixture(scope="module")
def jobs(modules, tmp_path_factory):
    return _sweep_jobs(modules[0], tmp_path_factory.mktemp("sweep"), JOBS)


def test_the_replay_and_the_planner_hold_the_same_live_peak(modules, jobs):
    _, nr = modules
    assert len(jobs) == len(JOBS)
    for job in jobs:
        alloc = nr.replay(nr.replay_job(job), capacity=1 << 50)
        tensors = job.result.memory.tensors
        assert alloc.high_water_allocated == pytest.approx(tensors, rel=0.015), job.id
        assert alloc.high_water_reserved >= alloc.high_water_allocated


def test_a_step_leaves_only_the_model_states_behind(modules, jobs):
    """After three steps only parameters, fp32 gradients and masters, Adam's moments, DDP's buckets and
    the all-gather buffers are allocated: every activation and gradient was freed."""
    _, nr = modules
    job = next(j for j in jobs if j.id.startswith("14113516"))  # 8B tp4 ZeRO-1 dp8 mb4
    rj = nr.replay_job(job)
    assert (rj.tp, rj.dp, rj.zero, rj.pp) == (4, 8, 1, 1)
    alloc = nr.replay(rj, capacity=1 << 50)
    cfg, h = rj.cfg, rj.cfg.hidden_size
    hq, f, v = cfg.n_heads * cfg.head_dim // 4, cfg.ffn_hidden_size // 4, cfg.vocab_size // 4
    per_tensor = ([v * h] + [x for _ in range(cfg.n_layers) for x in (3 * hq * h, h * hq, 2 * f * h, h * f, h, h)]
                  + [h] + ([] if cfg.tie_embeddings else [v * h]))
    n = sum(per_tensor)

    def block(nbytes: int) -> int:
        return -(-nbytes // 512) * 512

    params = sum(block(2 * x) for x in per_tensor)
    adam = sum(2 * block(4 * -(-x // 8)) for x in per_tensor)  # two fp32 moments of each dp shard
    gathers = 2 * block(2 * rj.micro_batch * rj.seq * h)  # the forward and backward all-gather buffers
    states = params + block(4 * n) + block(4 * -(-n // 8)) + adam + gathers
    # a block keeps a remainder of up to 1 MiB it was not split from (one per tensor at most)
    assert 0 <= alloc.allocated - states <= (3 * len(per_tensor) + 4) << 20
    assert nr.replay(rj, iterations=2, capacity=1 << 50).allocated == alloc.allocated  # nothing accumulates


def test_the_sweep_recipe_follows_the_zero_stage_and_the_batch(modules, jobs):
    sweep, _ = modules
    rc = {j.id.split("#")[0]: j.result.row.layout.recipe for j in jobs}
    assert rc["13502220"].sp_inputs == "gathered" and rc["13502220"].grad_precision == "bf16+fp32"  # ZeRO-0, DDP
    assert rc["14113516"].sp_inputs == "sharded" and rc["14113516"].grad_precision == "fp32"  # ZeRO-1: no DDP
    assert sweep.first_batch("13502220#1") and not sweep.first_batch("13803385#9")


def test_the_published_rows_keep_the_code_as_read(modules):
    """The playbook is a held-out source (published_runs.toml [split], 2026-12-03): its rows keep nanotron's
    code as read (sharded SP inputs) even in the sweep's first batch, whose gathered inputs are an inference
    from this source's own memory logs that only the sweep study applies (first_batch)."""
    sweep, _ = modules
    import re

    import tomllib

    runs = [r for r in tomllib.loads((BENCHMARKS / "published_runs.toml").read_text())["run"]
            if r["source"] == "playbook"]
    assert len(runs) == 21
    jobs = [re.search(r"job (\d+)", r["note"]).group(1) for r in runs]
    assert sum(sweep.first_batch(j) for j in jobs) == 7  # the rows the inference used to move
    for r in runs:
        assert "sp_inputs" not in r and "sp_inputs" not in r["inferred"], r["id"]
        assert (r.get("grad_precision") == "bf16+fp32") == (r["zero"] == 0 and r["dp"] > 1), r["id"]


def test_zero1_step_gathers_through_two_bf16_copies_of_the_stage(modules):
    """nanotron's all_gather_coalesced: this rank's shard flattened, then one flattened output per dp
    rank; torch's allgather gathers into a flat output of its own. With activations far smaller than the
    parameters, the peak is the optimizer step's: the model states plus (dp + 1) shards and the flat copy."""
    _, nr = modules
    from pentatron.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=32768, hidden_size=1024, n_layers=2, n_heads=8, n_kv_heads=8,
                      ffn_hidden_size=4096)
    dp = 4
    job = nr.ReplayJob(cfg, tp=1, dp=dp, zero=1, micro_batch=1, seq=64, accumulation=2)
    alloc = nr.replay(job, capacity=1 << 50)
    h, f, v = 1024, 4096, 32768
    n = 2 * v * h + cfg.n_layers * (4 * h * h + 3 * h * f + 2 * h) + h  # untied: embedding and LM head
    shard = 2 * -(-n // dp)
    gathers = (dp + 1) * shard + dp * shard
    states = alloc.allocated  # what three steps leave: parameters, fp32 gradients, master shard, moments
    # the peaks were reset after the last backward, as nanotron's log_memory does: what follows is the step's
    # each gather buffer is one block of its size rounded to 512 bytes, or a cached block up to 1 MiB larger
    assert gathers <= alloc.peak_allocated - states <= gathers + (2 * dp + 2) * (1 << 20)
    no_gather = nr.replay(nr.ReplayJob(cfg, tp=1, dp=1, zero=1, micro_batch=1, seq=64, accumulation=2),
                          capacity=1 << 50)
    # dp = 1: nanotron gathers nothing; what it logs after the step is the states alone
    assert no_gather.peak_allocated == no_gather.allocated


def test_the_replayed_step_meets_the_logged_step_peak(modules, jobs):
    """nanotron logs `Mem Alloc` at iteration 3 after log_memory reset the peaks behind the backward: the
    optimizer step's live peak. The replay, reset at the same points, meets it on the pinned jobs."""
    _, nr = modules
    for job in jobs:
        alloc = nr.replay(nr.replay_job(job), capacity=1 << 50)
        assert alloc.peak_allocated == pytest.approx(job.mem_alloc_gib * (1 << 30), rel=0.02), job.id
        assert alloc.peak_allocated < alloc.high_water_allocated  # the backward's peak lies before the reset


def test_the_planners_states_and_step_copies_meet_the_logged_step_peak_at_tp_1(modules, jobs):
    """With no TP buffers in the way, the planner's model states plus zero1_gather="copies" are what
    nanotron's optimizer step holds: within 1 % of `Mem Alloc` (the whole sweep's tp-1 jobs: a median 0.4 %)."""
    sweep, _ = modules
    tp1 = [j for j in jobs if j.result.row.layout.tp == 1]
    assert {j.result.row.layout.zero for j in tp1} == {1}
    for job in tp1:
        assert abs(sweep.step_live_error(job)) < 0.01, job.id


def test_a_device_too_small_for_the_steps_copies_releases_the_backwards_cache(modules, tmp_path):
    """8B, tp 1, pp 2 stage 0, ZeRO-1 dp 16 (the playbook's 8b-4n job): the optimizer step's copies (2 + 1/16
    of the stage's 9.2 GiB of bf16 parameters) cannot reuse the activations' cached blocks, so on a roomy
    device they take new segments. On a device that cannot hold those as well, cudaMalloc fails, the
    allocator releases its wholly free segments and retries: the same tensors, a lower reserved peak."""
    sweep, nr = modules
    (job,) = _sweep_jobs(sweep, tmp_path, {"14097157"})
    rj = nr.replay_job(job)
    roomy = nr.replay(rj, capacity=1 << 50)
    small = nr.replay(rj, capacity=74 << 30)
    assert small.peak_allocated == roomy.peak_allocated  # the step holds the same tensors
    assert roomy.peak_reserved > 74 << 30 >= small.high_water_reserved >= small.peak_allocated
    flat_copy = 2 * 4_920_000_000  # torch's flat all-gather output: the stage's parameters (CSV: rank-0 params) in bf16
    # on the roomy device the copies' segments stay reserved beside the backward's cached blocks
    assert roomy.peak_reserved - small.peak_reserved > flat_copy


def test_published_playbook_rows_are_matched_to_their_sweep_jobs(modules, tmp_path):
    sweep, nr = modules
    jobs = _sweep_jobs(sweep, tmp_path, {"14097157", "14098578", "14113489"})
    pairs = nr.published_jobs(nr.replay_sweep(jobs))
    assert sorted((row, r.job.id.split("#")[0]) for row, r in pairs) == [
        ("playbook-1b-2n", "14098578"), ("playbook-8b-4n", "14097157")]
