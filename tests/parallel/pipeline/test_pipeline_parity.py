"""Parity: 10 training steps on real gloo pipeline ranks equal the 1-process run (fp64 on both sides, ≤ 1e-10
relative: losses, every step-1 gradient, final parameters),
for pp ∈ {2, 4} × AFAB, 1F1B, interleaved 1F1B (v=2) and ZB-H1, and explicit unequal splits at pp=2; plus
the engine's memory claims. The ranks run in strict comm mode (conftest.py): every p2p batch is waited
before the next operation, as NCCL's ordering would force.

One `run_ranks` call per world size runs every schedule (process start-up is most of the cost)."""

from __future__ import annotations

import pytest

from pentatron.schedules import make_schedule, peak_in_flight
from tests.multiprocess import run_ranks
from tests.parallel.pipeline.harness import Case, assert_close, pipeline_worker, reference_name, reference_run
from tests.reference_loop import EXACT_RTOL

# m > p everywhere, so AFAB's peak (m) and 1F1B's (≤ p) differ; interleaving needs m ≥ p and p·v chunks of
# whole layers, and runs m that p does not divide too (m = 3, 5 at p = 2; m = 6 at p = 4).
SIZES = {2: {"m": 4, "n_layers": 4}, 4: {"m": 8, "n_layers": 8}}  # (pp=2 also splits 6 layers unevenly)


def cases_for(p: int) -> list[Case]:
    kw = SIZES[p]
    cases = [Case("afab", **kw), Case("1f1b", **kw), Case("interleaved", v=2, **kw), Case("zb", **kw)]
    if p == 2:
        cases.append(Case("1f1b", tied=False, **kw))  # untied head: no tied-gradient exchange
        # explicit, unequal splits (parallel.pp_layers): a light first stage; interleaved chunks of 1, 2, 2, 1
        cases.append(Case("1f1b", layers=(1, 3), **kw))
        cases.append(Case("interleaved", v=2, m=kw["m"], n_layers=6, layers=(1, 2, 2, 1)))
    cases += [Case("interleaved", v=2, m=m, n_layers=kw["n_layers"]) for m in {2: (3, 5), 4: (6,)}[p]]
    return cases


def _ref_key(case: Case) -> tuple[bool, int, int]:
    return case.tied, case.n_layers, case.m


@pytest.fixture(scope="module")
def references(default_dataset):
    keys = {_ref_key(c) for p in SIZES for c in cases_for(p)}
    return {k: reference_run(Case("1f1b", tied=k[0], n_layers=k[1], m=k[2]), default_dataset) for k in keys}


@pytest.fixture(scope="module", params=[2, 4], ids=["pp2", "pp4"])
def pipelined(request, default_dataset):
    p = request.param
    cases = cases_for(p)
    per_rank = run_ranks(pipeline_worker, p, args=(cases, str(default_dataset)), timeout=240)
    return p, cases, per_rank


def test_parity_with_one_process(pipelined, references):
    p, cases, per_rank = pipelined
    for i, case in enumerate(cases):
        ref = references[_ref_key(case)]
        results = [r[i] for r in per_rank]
        assert all(res["strict"] for res in results)  # NCCL's p2p ordering (conftest.py)
        # The loss is known on the rank holding the last stage: rank p-1 for every schedule here.
        losses = results[p - 1]["losses"]
        assert len(losses) == case.steps
        for step, (got, want) in enumerate(zip(losses, ref["losses"], strict=True)):
            assert abs(got - want) <= EXACT_RTOL * abs(want), \
                f"{case.label} pp={p} step {step + 1}: loss {got} vs {want}"
        seen = set()
        for r, res in enumerate(results):
            for name, param in res["params"].items():
                want_name = reference_name(name, case.tied)
                seen.add(want_name)
                what = f"{case.label} pp={p} rank {r} {name}"
                # Step-1 gradients: checks the 1/m loss scaling (AdamW would hide a constant factor).
                assert_close(res["grads"][name], ref["grads"][want_name], f"{what} grad (step 1)")
                assert_close(param, ref["params"][want_name], f"{what} after {case.steps} steps")
        assert seen == set(ref["params"]), f"{case.label} pp={p}: parameters held by no rank: " \
                                           f"{sorted(set(ref['params']) - seen)}"


def test_explicit_splits_place_the_layers_they_list(pipelined):
    """Rank r holds stages r, r + p, ... of the split, each stage the next `layers[s]` decoder layers."""
    p, cases, per_rank = pipelined
    for i, case in enumerate(cases):
        if case.layers is None:
            continue
        starts = [sum(case.layers[:s]) for s in range(len(case.layers))]
        for r in range(p):
            want = [list(range(starts[s], starts[s] + case.layers[s])) for s in range(r, len(case.layers), p)]
            assert [list(ids) for ids in per_rank[r][i]["layers"]] == want, f"{case.label} rank {r}"


def test_tied_embedding_copies_stay_identical(pipelined):
    p, cases, per_rank = pipelined
    for i, case in enumerate(cases):
        if case.tied:
            first, last = per_rank[0][i]["params"], per_rank[p - 1][i]["params"]
            assert "lm_head.weight" not in first and "embed.weight" not in last
            assert (first["embed.weight"] == last["lm_head.weight"]).all(), case.label  # bitwise


def test_peak_in_flight_activations(pipelined):
    """AFAB holds all m micro-batches; 1F1B and ZB-H1 at most p; each equals the schedule's own count."""
    p, cases, per_rank = pipelined
    for i, case in enumerate(cases):
        planned = peak_in_flight(make_schedule(case.schedule, p, case.m, case.v))
        for r in range(p):
            peaks = per_rank[r][i]["peaks"]
            assert set(peaks) == {planned[r]}, f"{case.label} rank {r}: engine counted {peaks}, plan {planned[r]}"
            if case.schedule == "afab":
                assert planned[r] == case.m
            elif case.schedule in ("1f1b", "zb"):
                assert planned[r] <= p


def test_every_action_timestamped_in_order(pipelined):
    p, cases, per_rank = pipelined
    for i, case in enumerate(cases):
        schedule = make_schedule(case.schedule, p, case.m, case.v)
        for r in range(p):
            slots = per_rank[r][i]["slots"]
            assert [sl.action for sl in slots] == schedule.actions[r]
            assert all(sl.start <= sl.end for sl in slots)
            assert all(a.end <= b.start for a, b in zip(slots, slots[1:]))


def test_p2p_volume_matches_schedule(pipelined):
    """Each boundary crossing moves one [micro_batch, seq, hidden] tensor (the parameters' dtype, fp64 here)
    each way per micro-batch."""
    from tests.parallel.pipeline.harness import DTYPE, MICRO, SEQ, model_config

    p, cases, per_rank = pipelined
    size = DTYPE.itemsize
    for i, case in enumerate(cases):
        act = MICRO * SEQ * model_config(case).hidden_size * size
        n_stages = p * case.v
        for r in range(p):
            comm = per_rank[r][i]["comm"]
            sends = comm.get("pp", {}).get("send", 0)
            # Stages on rank r that send forward (not the last) and backward (not the first).
            stages = [c * p + r for c in range(case.v)]
            n_msgs = sum((s < n_stages - 1) + (s > 0) for s in stages) * case.m
            tied = 0
            if case.tied and r in (0, p - 1):
                tied = model_config(case).vocab_size * model_config(case).hidden_size * size
            assert sends == n_msgs * act + tied, f"{case.label} rank {r}: sent {sends} bytes"


def test_recorded_step_merges_across_ranks(pipelined):
    """The ranks' timestamps share one clock: merged, each rank's actions fit inside the step, ranks
    start staggered as the schedule says (a later stage cannot start before its input exists), and the
    measured bubble is a proper fraction (BENCHMARKS.md compares it with the prediction)."""
    from pentatron.parallel.pipeline.trace import recorded_timeline

    p, cases, per_rank = pipelined
    for i, case in enumerate(cases):
        tl = recorded_timeline([per_rank[r][i]["slots"] for r in range(p)], case.schedule)
        assert tl.p == p and all(b > 0 for b in tl.busy)
        assert all(s.start >= 0 and s.end <= tl.makespan + 1e-9 for slots in tl.slots for s in slots)
        firsts = [slots[0].start for slots in tl.slots]
        assert firsts == sorted(firsts), f"{case.label}: rank r+1 started before rank r: {firsts}"
        # The idle share of the step (issue 46: it was idle / busy, which with 4 strict-mode ranks on a
        # loaded 2-core CI box reached ~14): bounded by construction, and never exactly 0 or 1 here.
        assert 0 < tl.bubble_fraction < 1
        # The engine's collective version (what the trainer logs) agrees with the merged timeline.
        assert all(abs(res[i]["bubble"] - tl.bubble_fraction) < 1e-9 for res in per_rank)
