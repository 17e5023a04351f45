"""The planner refuses exactly what cannot exist (with the training validator's words), evaluates
layouts real runs used with a warning, and recommends only what `pentatron train` accepts."""

from __future__ import annotations

import re

import pytest

from pentatron.config import ConfigError, config_from_dict
from pentatron.models.registry import get_model_config
from pentatron.plan.hardware import get_gpu
from pentatron.plan.layout import Layout, Workload, problems, trainable_problems, warnings
from pentatron.plan.search import predict

H100 = get_gpu("h100")
W70 = Workload(get_model_config("llama3-70b"), 4096, 1024)


@pytest.mark.parametrize(("kw", "match"), [
    ({"tp": 3}, r"parallel\.tp=3 does not divide model\.n_heads=64"),
    ({"sp": True}, r"parallel\.sp=true needs parallel\.tp > 1"),
    ({"dp": 3}, "does not equal the world size 256"),
    ({"ep": 2, "dp": 256}, "mixture-of-experts"),
    ({"cp": 3, "dp": 1}, "load-balanced ring|does not equal"),
    ({"precision": "fp4"}, "--precision must be one of"),
    ({"attention": "flash9"}, "--attention must be one of"),
])
def test_impossible_layouts_are_refused(kw, match):
    msgs = problems(W70, Layout(**{"dp": 256, **kw}), H100, 256)
    assert any(re.search(match, m) for m in msgs), msgs


@pytest.mark.parametrize(("kw", "warning", "untrainable"), [
    ({"tp": 16, "dp": 16, "sp": True}, "larger than the node size", None),  # tp across nodes: slow, allowed
    ({"pp": 8, "dp": 32, "micro_batch": 16}, "micro-batches < pp", None),  # m=2 < pp=8: the pipeline never fills
    ({"pp": 8, "dp": 32, "pp_schedule": "interleaved", "pp_virtual": 3}, "unequal layer counts",
     "does not divide model.n_layers=80"),  # 80 layers over 24 chunks, as Llama 3 405B's 126 on pp16
    ({"zero": 3, "pp": 2, "dp": 128}, "re-gathers each stage", None),  # trainable since ZeRO-3 x pp landed
    ({"cp": 8, "dp": 32}, None, None),  # trainable since context parallelism landed
    ({"precision": "fp8"}, None, "train.precision='fp8' is not available"),
    ({"recompute": "selective-op"}, None, "recompute 'selective-op' is not available"),
])
def test_layouts_real_runs_used_are_evaluated_with_a_warning(kw, warning, untrainable):
    lay = Layout(**{"dp": 256, **kw})
    assert problems(W70, lay, H100, 256) == []
    pred = predict(W70, lay, H100)
    assert pred.rate.tokens_per_s_per_gpu > 0
    if warning:
        assert any(warning in x for x in warnings(W70, lay, H100)) and any(warning in n for n in pred.notes)
    why = trainable_problems(W70, lay, 256)
    if untrainable:
        assert any(untrainable in x for x in why), why
        assert any("training cannot run this yet" in n for n in pred.notes)
    else:
        assert why == []


def test_the_planner_refuses_with_the_training_validators_words():
    """Same layout, same message: `pentatron train`'s config validation and the planner's problems."""
    cfg = get_model_config("debug")  # 4 heads
    w = Workload(cfg, 64, 8)
    lay = Layout(dp=1, tp=3, micro_batch=4)
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"name": "debug"}, "parallel": {"tp": 3},
                          "train": {"seq_len": 64, "micro_batch": 4, "global_batch": 8}}, world_size=3)
    planner = problems(w, lay, H100, 3)
    shared = [m for m in planner if m in str(e.value)]
    assert any("parallel.tp=3 does not divide model.n_heads=4" in m for m in shared), (planner, str(e.value))


def test_the_search_recommends_only_trainable_layouts():
    """Issue 15: what the planner models but training cannot run (fp8 today) is never ranked by the
    search; pinning it still evaluates it, with a note."""
    from pentatron.plan.search import search

    w = Workload(get_model_config("llama3-8b"), 8192, 64)
    res = search(w, H100, 16, top=5)
    assert res.ranked and all(not trainable_problems(w, p.layout, 16) for p in res.ranked)
    pinned = search(w, H100, 16, fixed={"precision": "fp8"}, top=2)
    assert pinned.ranked and pinned.ranked[0].layout.precision == "fp8"
    assert any("training cannot run this yet" in n for n in pinned.ranked[0].notes)
