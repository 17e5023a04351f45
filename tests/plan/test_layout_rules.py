"""The planner refuses exactly what cannot exist (with the training validator's words), evaluates
layouts real runs used with a warning, and recommends only what `pentatron train` accepts."""

from __future__ import annotations

import dataclasses
import re

import pytest

from pentatron.config import ConfigError, config_from_dict
from pentatron.hardware.catalogue import get_gpu
from pentatron.models.registry import get_model_config
from pentatron.plan.layout import Layout, Workload, problems, trainable_problems, warnings
from pentatron.plan.memory import llama_layer_activation_bytes, memory_for_rank, rank_params
from pentatron.plan.recipes import RECIPE_FIELDS, TORCHTITAN
from pentatron.plan.search import predict

H100 = get_gpu("h100")
W70 = Workload(get_model_config("llama3-70b"), 4096, 1024)


def _lay(**kw: object) -> Layout:
    """A Layout whose recipe fields (given among the layout's) change the pentatron recipe."""
    over = {k: kw.pop(k) for k in RECIPE_FIELDS if k in kw}
    return Layout(**kw).with_recipe(**over)


@pytest.mark.parametrize(("kw", "match"), [
    ({"tp": 3}, r"parallel\.tp=3 does not divide model\.n_heads=64"),
    ({"sp": True}, r"parallel\.sp=true needs parallel\.tp > 1"),
    ({"dp": 3}, "does not equal the world size 256"),
    ({"ep": 2, "dp": 256}, "mixture-of-experts"),
    ({"cp": 3, "dp": 1}, "load-balanced ring|does not equal"),
    ({"precision": "fp4"}, "--precision must be one of"),
    ({"attention": "flash9"}, "--attention must be one of"),
    ({"precision": "fp8", "fp8_scaling": "blockwise"}, "--fp8-scaling must be one of 'tensorwise', 'rowwise'"),
    ({"fp8_scaling": "rowwise"}, "--fp8-scaling rowwise applies to --precision fp8, not bf16"),
    ({"cross_entropy": "loss_parallel"}, "recipe.cross_entropy='loss_parallel' splits the loss over the tp ranks"),
    ({"cross_entropy": "flash"}, "recipe.cross_entropy must be one of 'eager', 'fused', 'loss_parallel'"),
    ({"pp_p2p": "sync"}, "recipe.pp_p2p must be one of 'async', 'blocking', got 'sync'"),
])
def test_impossible_layouts_are_refused(kw, match):
    """Knob and recipe values are checked by the config loader's typed checker (its words)."""
    msgs = problems(W70, _lay(**{"dp": 256, **kw}), H100, 256)
    assert any(re.search(match, m) for m in msgs), msgs


def test_rowwise_fp8_needs_a_measured_gpu():
    lay = Layout(dp=256, precision="fp8", fp8_scaling="rowwise")
    assert not problems(W70, lay, H100, 256)
    msgs = problems(W70, lay, get_gpu("b200"), 256)
    assert any("no row-wise FP8 measurement for b200" in m and "--fp8-scaling tensorwise" in m for m in msgs), msgs


@pytest.mark.parametrize(("kw", "warning", "untrainable"), [
    ({"tp": 16, "dp": 16, "sp": True}, "larger than the node size", None),  # tp across nodes: slow, allowed
    ({"pp": 8, "dp": 32, "micro_batch": 16}, "micro-batches < pp", None),  # m=2 < pp=8: the pipeline never fills
    ({"pp": 8, "dp": 32, "pp_schedule": "interleaved", "pp_virtual": 3}, "unequal layer counts",
     "does not divide model.n_layers=80"),  # 80 layers over 24 chunks, as Llama 3 405B's 126 on pp16
    ({"zero": 3, "pp": 2, "dp": 128}, "re-gathers each stage", None),  # trainable since ZeRO-3 x pp landed
    ({"cp": 8, "dp": 32}, None, None),  # trainable since context parallelism landed
    ({"precision": "fp8"}, None, None),  # trainable since train.fp8 landed (bf16 weights + FP8 GEMMs)
    ({"precision": "fp8", "micro_batch": 1, "dp": 256}, None, None),
    ({"precision": "fp16"}, None, "train.precision must be one of 'auto', 'fp32', 'bf16', 'fp64', got 'fp16'"),
    ({"recompute": "selective-op"}, None, "train.recompute must be one of 'none', 'selective', 'full', got "
                                          "'selective-op'"),
    ({"tp": 8, "dp": 32, "sp": True, "cross_entropy": "loss_parallel"}, None,
     "the pentatron recipe with cross_entropy='loss_parallel' changed is evaluated"),
    ({"recipe": TORCHTITAN, "zero": 3}, None, "recipe 'torchtitan' predicts a torchtitan run"),
])
def test_layouts_real_runs_used_are_evaluated_with_a_warning(kw, warning, untrainable):
    lay = _lay(**{"dp": 256, **kw})
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
    """Issue 15: what the planner models but training cannot run (fp16 today) is never ranked by the
    search; pinning it still evaluates it, with a note."""
    from pentatron.plan.search import search

    w = Workload(get_model_config("llama3-8b"), 8192, 64)
    res = search(w, H100, 16, top=5)
    assert res.ranked and all(not trainable_problems(w, p.layout, 16) for p in res.ranked)
    pinned = search(w, H100, 16, fixed={"precision": "fp16"}, top=2)
    assert pinned.ranked and pinned.ranked[0].layout.precision == "fp16"
    assert any("training cannot run this yet" in n for n in pinned.ranked[0].notes)


LLAMA3_SPLIT = (0,) + (1,) * 126 + (0,)  # Llama 3 405B, sec. 3.3.2: embedding-only and head-only end chunks


def test_an_explicit_split_with_empty_end_chunks_is_evaluated_not_trained():
    w = Workload(get_model_config("llama3.1-405b"), 8192, 2048)
    lay = Layout(dp=64, tp=8, sp=True, pp=16, pp_schedule="interleaved", pp_virtual=8, pp_layers=LLAMA3_SPLIT)
    assert problems(w, lay, H100, 8192) == []
    assert not any("unequal layer counts" in x for x in warnings(w, lay, H100))
    assert any("parallel.pp_layers entries must be integers ≥ 1" in x for x in trainable_problems(w, lay, 8192))
    short = dataclasses.replace(lay, pp_layers=(0,) + (1,) * 125 + (0, 0))
    assert any("sums to 125, but the model has 126 layers" in x for x in problems(w, short, H100, 8192))
    # pp = 1 is refused once, by the validator training shares
    assert [x for x in problems(w, Layout(dp=8192, pp_layers=(126,)), H100, 8192) if "pp_layers" in x] == [
        "parallel.pp_layers=[126] needs parallel.pp > 1"]
    # an explicit split with a layer or more per chunk is what training takes as parallel.pp_layers
    ok = Layout(dp=32, pp=8, micro_batch=1, pp_layers=(9, 10, 10, 10, 10, 10, 10, 11))
    assert problems(W70, ok, H100, 256) == [] and trainable_problems(W70, ok, 256) == []


def test_memory_follows_the_explicit_split_in_schedule_order():
    """Rank 0 of Llama 3's split holds 16 micro-batches x 7 one-layer chunks at its peak (the schedule's
    own order, tests/parallel/pipeline/test_schedules.py), where the default split gives it eight
    one-layer chunks and its closed-form 143 in flight."""
    w = Workload(get_model_config("llama3.1-405b"), 8192, 2048)
    lay = Layout(dp=64, tp=8, sp=True, pp=16, pp_schedule="interleaved", pp_virtual=8, zero=1)
    split = dataclasses.replace(lay, pp_layers=LLAMA3_SPLIT)
    layer = llama_layer_activation_bytes(w.cfg, 8192, 8192, tp=8, sp=True).saved
    default0, split0 = memory_for_rank(w, lay, H100, 0), memory_for_rank(w, split, H100, 0)
    assert default0.in_flight == split0.in_flight == 143
    assert default0.activations - split0.activations == pytest.approx((143 - 112) * layer)
    assert rank_params(w, split, 0).dense < rank_params(w, lay, 0).dense  # one layer fewer
