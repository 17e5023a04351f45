"""The search's shortcuts change nothing: memoised terms shared between layouts (stage phases across
ZeRO and 1F1B/ZB, activation terms across ZeRO), memory breakdowns skipped above an exact floor and
estimates skipped below an exact ceiling give the
pool, the ranking and the reasons an exhaustive, uncached evaluation gives (exactly: floats compared ==)."""

from __future__ import annotations

import dataclasses

from pentatron.hardware.catalogue import get_gpu
from pentatron.hardware.chip_spread import slowest_chip
from pentatron.models.registry import get_model_config
from pentatron.plan import memory, timing
from pentatron.plan.layout import _PARALLEL_FIELDS as PARALLEL_FIELDS
from pentatron.plan.layout import Layout, Workload, problems, trainable_problems
from pentatron.plan.memo import Without
from pentatron.plan.memory import memory_floor, memory_per_gpu
from pentatron.plan.recipes import PENTATRON
from pentatron.plan.search import Scored, best_estimate, best_first, cp_handicapped, enumerate_layouts, predict, search
from pentatron.plan.timing import step_time, step_time_floor

H100 = get_gpu("h100")


def _fresh(f, *args, **kw):  # noqa: ANN001, ANN202 - evaluate with nothing shared with other layouts
    memory._activation_terms.cache_clear()
    memory.schedule_in_flight.cache_clear()
    timing._stage_phases.cache_clear()
    timing._layer_phase.cache_clear()
    return f(*args, **kw)


def test_search_equals_an_exhaustive_uncached_evaluation():
    w = Workload(get_model_config("smollm-135m"), 2048, 64)
    gpus, top = 8, 3
    res = search(w, H100, gpus, top=top)
    # the pool, entry by entry, against each layout evaluated alone (the recompute pruning as the search's)
    assert len(res.pool) == res.valid and res.enumerated >= res.valid
    for s in res.pool:
        mem = _fresh(memory_per_gpu, w, s.layout, H100, "fused").total
        est = w.tokens_per_step / _fresh(step_time, w, s.layout, H100, exact=False).step if s.fits else 0.0
        assert (s.memory_total, s.fits) == (mem, mem <= H100.hbm_bytes)
        assert s.ceiling >= est  # the bound the search skips by
        assert s.est_tokens_per_s == est, s.layout
    # the ranking, by the plain sort the search used to run
    fitting = sorted((s for s in res.pool if s.fits),
                     key=lambda s: (-cp_handicapped(s.layout, s.est_tokens_per_s), s.memory_total))
    k = max(3 * top, 24)
    chosen = [s.layout for s in fitting if not problems(w, s.layout, H100, gpus)
              and not trainable_problems(w, s.layout, gpus)][:k]
    ranked = sorted((_fresh(predict, w, lay, H100) for lay in chosen),
                    key=lambda p: (-cp_handicapped(p.layout, p.rate.tokens_per_s), p.memory.total))[:top]
    assert [p.layout for p in res.ranked] == [p.layout for p in ranked]
    assert [p.rate.tokens_per_s for p in res.ranked] == [p.rate.tokens_per_s for p in ranked]
    assert res.reasons and res.reasons == search(w, H100, gpus, top=top).reasons


def test_floors_are_below_every_estimate_and_breakdown():
    w = Workload(get_model_config("debug"), 256, 64)
    lays = list(enumerate_layouts(w, H100, 8, {}))
    assert len({(lay.zero, lay.pp_schedule) for lay in lays}) > 4
    for lay in lays:
        assert step_time_floor(w, lay, H100) <= step_time(w, lay, H100, exact=False).step
        # the search shares one floor between a layout's ZeRO variants (search._NOT_IN_FLOOR)
        assert _fresh(step_time_floor, w, lay, H100) == _fresh(step_time_floor, w, lay.with_(zero=0), H100)
        assert memory_floor(w, lay, H100, "fused") <= memory_per_gpu(w, lay, H100, "fused").total
        fresh = list(timing._stage_phases.__wrapped__(w, timing.Without(lay, frozenset()), timing.Same(H100), "fused"))
        if timing.split_backward(lay):  # zero bubble's W replays the chunked loss's head: added outside the memo
            fresh[-1] = timing.Phase(fresh[-1].f, fresh[-1].b, fresh[-1].w + timing.head_gemm(w, lay, H100).f)
        # our step's calibration on this GPU and the slowest of the layout's chips: outside too
        measured = timing.our_step_factor(lay, H100, "fused") * slowest_chip(lay.world, H100.efficiency.chip_spread)
        assert timing.stage_phases(w, lay, H100) == [ph.scale(measured) for ph in fresh]


def test_best_first_is_the_stable_sort_and_reads_few_estimates():
    reads: list[int] = []

    def entry(i: int, est: float, mem: float, ceiling: float) -> Scored:
        def compute() -> float:
            reads.append(i)
            return est
        return Scored(Layout(dp=i + 1), mem, True, ceiling=ceiling, compute=compute)

    # ties on the estimate (then memory, then pool order), ceilings loose
    specs = [(5.0, 2.0, 9.0), (5.0, 1.0, 5.0), (7.0, 3.0, 7.5), (5.0, 1.0, 6.0), (1.0, 1.0, 1.5), (0.5, 1.0, 0.6)]
    plain = [Scored(Layout(dp=i + 1), m, True, e) for i, (e, m, _) in enumerate(specs)]
    want = [s.layout for s in sorted(plain, key=lambda s: (-s.est_tokens_per_s, s.memory_total))]
    lazy = [entry(i, *spec) for i, spec in enumerate(specs)]
    got = best_first(lazy)
    assert [next(got).layout for _ in range(3)] == want[:3]
    assert 4 not in reads and 5 not in reads  # their ceilings are below the first three's estimates
    assert [s.layout for s in got] == want[3:]
    assert best_estimate([entry(i, *spec) for i, spec in enumerate(specs)]) == 7.0


def test_cache_keys_see_every_field_but_the_dropped_ones():
    lay = Layout(dp=4, tp=2, pp=2, zero=1, sp=True, pp_schedule="zb")
    drop = frozenset({"zero"})
    assert Without(lay, drop) == Without(lay.with_(zero=3), drop)
    assert hash(Without(lay, drop)) == hash(Without(lay.with_(zero=3), drop))
    for other in (lay.with_(tp=1, dp=8), lay.with_(pp_schedule="1f1b"), lay.with_(recompute="full"),
                  lay.with_recipe(grad_precision="bf16"), lay.with_(precision="fp32")):
        assert Without(lay, drop) != Without(other, drop)
    # the degrees are plain copies of the held ParallelLayout's: equality, hashing and replace see `par`
    assert all(getattr(lay, k) == getattr(lay.par, k) for k in PARALLEL_FIELDS)
    alt = lay.with_(zero=2)
    assert (alt.zero, alt.par.zero, lay.zero) == (2, 2, 1) and alt != lay
    assert lay == Layout(lay.par) and hash(lay) == hash(Layout(lay.par))
    assert [f.name for f in dataclasses.fields(Layout)] == ["par", "recompute", "precision", "fp8_scaling",
                                                           "attention", "recipe"]
    # kept hashes are those of the fields: equal values, equal hashes
    cfg = get_model_config("llama3-8b")
    twin = dataclasses.replace(cfg, name="renamed")  # the name is not compared
    assert hash(cfg) == hash(twin) and cfg == twin and hash(dataclasses.replace(cfg, n_layers=31)) != hash(cfg)
    assert hash(Workload(cfg, 4096, 8)) == hash(Workload(twin, 4096, 8))
    assert hash(PENTATRON) == hash(dataclasses.replace(PENTATRON)) and dataclasses.replace(PENTATRON) == PENTATRON
