"""research/fp8_rowwise_ablation.py (issue 50): its torchao configs are the recipes they name or change only
what their name says, and its seed summary counts the paired comparisons it prints."""

from __future__ import annotations

import json

import fp8_rowwise_ablation as abl
import pytest


def _casts(config) -> dict:
    return {r: (c.scaling_type, c.scaling_granularity, c.target_dtype)
            for r in abl.ROLES for c in [getattr(config, f"cast_config_{r}")]}


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_rebuilt_recipes_are_torchaos(recipe):
    ours, theirs = abl.VARIANTS[recipe](), abl._torchao(recipe)
    assert _casts(ours) == _casts(theirs)
    assert ours.round_scales_to_power_of_2 == theirs.round_scales_to_power_of_2


def test_gemm_only_variants_keep_the_other_gemms_in_high_precision():
    from torchao.float8.config import ScalingType

    for recipe in ("rowwise", "tensorwise"):
        full = _casts(abl.VARIANTS[recipe]())
        for gemm, roles in abl.GEMMS.items():
            got = _casts(abl.VARIANTS[f"{recipe} {gemm} only"]())
            assert {r: got[r] for r in roles} == {r: full[r] for r in roles}, (recipe, gemm)
            assert all(got[r][0] is ScalingType.DISABLED for r in abl.ROLES if r not in roles), (recipe, gemm)
    with pytest.raises(ValueError, match="grad_weight: one operand in fp8"):
        abl._config(abl._casts("rowwise") | {"input_for_grad_weight": abl._hp()}, pow2=True)


def test_summary_counts_where_rowwise_is_above_tensorwise(tmp_path):
    ref = [5.0, 4.0, 3.0]
    seeds = [  # per seed: split, tensorwise, rowwise offsets from bf16 at each step
        ([0.01, 0.0, 0.0], [0.03, 0.0, 0.0], [0.04, 0.0, 0.0]),  # rowwise above on max and mean; both outside
        ([0.0, 0.05, 0.0], [0.03, 0.0, 0.0], [0.0, 0.0, 0.01]),  # rowwise below on both; both within
    ]
    paths = []
    for i, (split, tw, rw) in enumerate(seeds):
        curves = {"bf16": ref, **{k: [a + d for a, d in zip(ref, off)] for k, off in
                                  (("bf16 split", split), ("fp8 tensorwise", tw), ("fp8 rowwise", rw))}}
        paths.append(tmp_path / f"seed{i}.json")
        paths[-1].write_text(json.dumps({"debug": curves}))
    rows = abl.summary(paths)
    assert "| seed0 |" in rows[2] and rows[2].endswith("| outside / outside |")
    assert rows[3].endswith("| within / within |")
    assert rows[-1].startswith("rowwise's gap above tensorwise's in 1 of 2 (max) and 1 of 2 (mean)")
    assert "max gap tensorwise 0.0300, rowwise 0.0250" in rows[-1]
