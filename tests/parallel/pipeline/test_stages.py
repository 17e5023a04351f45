"""Partitioning a Llama into pipeline stages: balance, explicit lists, errors before launch, and stages that
compose back into the full model with the full model's parameter names."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pentatron.layout import ParallelLayout
from pentatron.models.llama import build_model
from pentatron.models.registry import get_model_config
from pentatron.parallel.pipeline.stages import (
    PartitionError,
    StageCosts,
    build_stages,
    partition,
    stage_layers,
    tied_parameter,
)


def _cfg(n_layers: int = 8, tied: bool = True):
    return dataclasses.replace(get_model_config("debug" if tied else "debug-untied"), n_layers=n_layers)


def test_costs_count_embedding_and_head():
    c = StageCosts.of(get_model_config("debug"), seq_len=32)
    # debug: h=128, V=4096: the LM head costs several layers' FLOPs; the embedding lookup almost none.
    assert c.head > 3 * c.layer > 0
    assert 0 < c.embed < c.layer / 100


def test_balanced_partition_gives_the_head_stage_fewer_layers():
    cfg = _cfg(8)
    costs = StageCosts.of(cfg, 32)
    ranges = partition(8, 2, costs=costs)
    assert [len(r) for r in ranges] == [6, 2]
    assert ranges[0].start == 0 and ranges[-1].stop == 8
    # The bottleneck is no worse than any other contiguous split's (exhaustive check for 4 stages).
    def worst(counts):
        lo, out = 0, []
        for s, c in enumerate(counts):
            out.append(c * costs.layer + (costs.embed if s == 0 else 0) + (costs.head if s == 3 else 0))
            lo += c
        return max(out)
    got = worst([len(r) for r in partition(8, 4, costs=costs)])
    import itertools
    best = min(worst(c) for c in itertools.product(range(1, 6), repeat=4) if sum(c) == 8)
    assert got == best


def test_uniform_explicit_and_interleaved_partitions():
    assert partition(8, 4, uniform=True) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert partition(8, 3, layers=[4, 3, 1]) == [range(0, 4), range(4, 7), range(7, 8)]
    # Interleaving uses equal chunks whatever the costs.
    assert [len(r) for r in stage_layers(_cfg(8), pp=2, virtual=2, seq_len=32)] == [2, 2, 2, 2]


@pytest.mark.parametrize("kwargs, message", [
    ({"n_layers": 6, "n_stages": 4, "uniform": True}, "not divisible"),
    ({"n_layers": 3, "n_stages": 4}, "fewer than the 4"),
    ({"n_layers": 8, "n_stages": 2, "layers": [4, 3]}, "sums to 7"),
    ({"n_layers": 8, "n_stages": 3, "layers": [4, 4]}, "lists 2 stages"),
    ({"n_layers": 8, "n_stages": 2, "layers": [8, 0]}, "≥ 1"),
])
def test_partition_errors(kwargs, message):
    with pytest.raises(PartitionError, match=message):
        partition(**kwargs)


def pipeline_problems(cfg, *, pp, schedule, virtual, microbatches):
    layout = ParallelLayout(pp=pp, pp_schedule=schedule, pp_virtual=virtual, micro_batch=1, global_batch=microbatches)
    return layout.pipeline_problems(cfg)


def test_config_problems_are_all_reported_before_launch():
    cfg = _cfg(6)
    probs = pipeline_problems(cfg, pp=4, schedule="interleaved", virtual=2, microbatches=3)
    assert any("must be at least the pipeline ranks p=4" in p for p in probs)  # m < p
    assert any("not divisible by pp × pp_virtual = 4 × 2 = 8" in p for p in probs)
    assert any("pp_virtual=4 does not divide model.n_layers=6" in p
               for p in pipeline_problems(cfg, pp=2, schedule="interleaved", virtual=4, microbatches=4))
    assert any("needs parallel.pp_schedule='interleaved'" in p
               for p in pipeline_problems(cfg, pp=2, schedule="1f1b", virtual=2, microbatches=4))
    assert any("unknown" in p for p in pipeline_problems(cfg, pp=2, schedule="gpipe2", virtual=1, microbatches=4))
    assert any("fewer than the 8" in p for p in pipeline_problems(cfg, pp=8, schedule="1f1b", virtual=1,
                                                                  microbatches=8))
    assert pipeline_problems(cfg, pp=2, schedule="1f1b", virtual=1, microbatches=1) == []  # 1F1B: any m
    assert pipeline_problems(cfg, pp=1, schedule="interleaved", virtual=5, microbatches=1) == [
        "parallel.pp_virtual=5 needs parallel.pp > 1"]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("pp, v", [(2, 1), (4, 1), (2, 2)])
def test_stages_compose_to_the_full_model(pp, v, tied):
    cfg = _cfg(8, tied)
    model = build_model(cfg, seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        want = model(tokens)
    ranges = stage_layers(cfg, pp, v, 16)
    per_rank = [build_stages(build_model(cfg, seed=3), pp, r, ranges) for r in range(pp)]
    by_index = sorted((s for stages in per_rank for s in stages), key=lambda s: s.index)
    assert [s.index for s in by_index] == list(range(pp * v))
    x = tokens
    with torch.no_grad():
        for s in by_index:
            x = s(x)
    torch.testing.assert_close(x, want, rtol=0, atol=0)
    # Names are the full model's; together the ranks hold every parameter exactly once (plus the
    # LM head's copy of the tied embedding on the last stage's rank).
    names = [n for stages in per_rank for s in stages for n, _ in s.named_parameters()]
    full = {n for n, _ in model.named_parameters()}
    assert len(names) == len(set(names))
    assert set(names) == (full | {"lm_head.weight"} if tied else full)
    held = [tied_parameter(stages) for stages in per_rank]
    if tied:
        assert held[0] is per_rank[0][0].embed.weight and held[-1] is by_index[-1].lm_head.weight
        assert all(h is None for h in held[1:-1])
    else:
        assert all(h is None for h in held)


def test_single_stage_keeps_one_tied_parameter():
    model = build_model(_cfg(4), seed=0)
    (stage,) = build_stages(model, 1, 0, stage_layers(model.cfg, 1, 1, 16))
    assert stage.embed.weight is stage.lm_head.weight
    assert tied_parameter([stage]) is None


def _scan_partition(n_layers: int, n_stages: int, costs: StageCosts) -> list[int]:
    """The reference: the dynamic programme over every cut (O(stages · layers²)); the smallest cut wins ties."""
    def cost(s: int, lo: int, hi: int) -> float:
        return (hi - lo) * costs.layer + (costs.embed if s == 0 else 0) + (costs.head if s == n_stages - 1 else 0)
    best = [[float("inf")] * (n_layers + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n_layers - (n_stages - s) + 1):
            for j in range(s - 1, i):
                if (val := max(best[s - 1][j], cost(s - 1, j, i))) < best[s][i]:
                    best[s][i], cut[s][i] = val, j
    counts, i = [], n_layers
    for s in range(n_stages, 0, -1):
        counts.append(i - cut[s][i])
        i = cut[s][i]
    return counts[::-1]


@pytest.mark.parametrize("name", ["llama3.1-405b", "qwen3-moe-30b-a3b", "debug"])
def test_bisected_partition_equals_the_scan_over_every_cut(name):
    """`_balanced` bisects for each stage's cut (the planner partitions 126 layers over up to 126 stages);
    it must split exactly as the full scan does."""
    cfg = get_model_config(name)
    for seq in (2048, 8192):
        costs = StageCosts.of(cfg, seq)
        for stages in sorted({2, 3, 7, 13, 21, cfg.n_layers} & set(range(2, cfg.n_layers + 1))):
            want = _scan_partition(cfg.n_layers, stages, costs)
            assert [len(r) for r in partition(cfg.n_layers, stages, costs=costs)] == want, (seq, stages)
