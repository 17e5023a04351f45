"""ParallelContext: degree validation, rank ↔ coordinates (tp innermost, pp outermost), and the real
process groups of each mesh dimension on 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pentatron.distributed.context import MESH_DIMS, ParallelContext
from pentatron.layout import ParallelLayout
from tests.multiprocess import run_ranks


def test_the_layout_fills_dp_and_its_degree_rules_reject_what_does_not_fit():
    """The config resolves dp from the world; `degree_problems` (what `from_layout` checks) judges the
    degrees alone, whatever the batch."""
    from pentatron.config import load_config

    assert load_config(None, ["parallel.tp=2", "train.micro_batch=2"], world_size=8).layout(8).dp == 4
    assert ParallelLayout(dp=4, tp=2, global_batch=1).degree_problems(8) == []
    assert any("does not equal the world size 4" in p for p in ParallelLayout(dp=3).degree_problems(4))
    assert any("parallel.ep=3 must divide dp×cp" in p for p in ParallelLayout(dp=4, ep=3).degree_problems(4))
    assert any("parallel.dp must be an integer ≥ 1" in p for p in ParallelLayout(dp=0).degree_problems(4))
    with pytest.raises(ValueError, match="invalid parallel degrees: .*does not equal the world size 1"):
        ParallelContext.from_layout(ParallelLayout(dp=2), "cpu")


def test_rank_order_puts_tp_innermost_and_pp_outermost():
    layout = ParallelLayout(pp=2, dp=2, cp=1, tp=2)
    ctx = ParallelContext(layout, rank=5, device=torch.device("cpu"), groups={})
    assert ctx.coords == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert ctx.group_ranks("tp") == [4, 5] and ctx.group_ranks("dp") == [5, 7]
    assert ctx.group_ranks("pp") == [1, 5] and ctx.group_ranks("cp") == [5]
    for r in range(layout.world):
        assert ctx.rank_of(**ctx.coords_of(r)) == r
    with pytest.raises(KeyError, match="unknown mesh dimensions"):
        ctx.rank_of(xp=0)


def test_single_process_context_needs_no_process_group():
    ctx = ParallelContext.single()
    assert ctx.world_size == 1 and ctx.dp_size == 1 and ctx.dp_rank == 0
    assert all(ctx.group(d) is None for d in (*MESH_DIMS, "dp_cp"))
    assert ParallelContext.from_layout(ParallelLayout(), "cpu").world_size == 1


def test_a_released_context_refuses_collectives_instead_of_running_them_alone():
    """After `release` a size-1 short-circuit would silently skip what is asked: it is an error instead."""
    ctx = ParallelContext.single()
    ctx.release()
    ctx.release()  # idempotent
    with pytest.raises(RuntimeError, match="released its process groups"):
        ctx.group("dp")
    with pytest.raises(RuntimeError, match="released its process groups"):
        ctx.comm.all_reduce(torch.ones(1), "dp")


_LAYOUTS = [ParallelLayout(dp=4), ParallelLayout(pp=2, dp=2), ParallelLayout(dp=2, tp=2), ParallelLayout(dp=2, cp=2)]


def _groups_on_ranks(rank: int, world: int) -> list[dict]:
    out = []
    for layout in _LAYOUTS:
        ctx = ParallelContext.from_layout(layout, "cpu")
        info = {"coords": ctx.coords, "ranks": {}, "sums": {}}
        for dim in (*MESH_DIMS, "dp_cp"):
            group = ctx.group(dim)
            info["ranks"][dim] = dist.get_process_group_ranks(group) if group is not None else [rank]
            t = torch.tensor([float(rank)])
            ctx.comm.all_reduce(t, dim)
            info["sums"][dim] = float(t)
        info["expected"] = {d: ctx.group_ranks(d) for d in MESH_DIMS}
        out.append(info)
    return out


def test_mesh_groups_match_the_coordinate_arithmetic_on_real_ranks():
    results = run_ranks(_groups_on_ranks, 4)
    for rank, per_layout in enumerate(results):
        for deg, info in zip(_LAYOUTS, per_layout):
            for dim in MESH_DIMS:
                assert info["ranks"][dim] == info["expected"][dim], (deg, dim)
                assert info["sums"][dim] == sum(info["expected"][dim])  # the group really is that set
            dp_cp = sorted(info["ranks"]["dp_cp"])
            assert len(dp_cp) == deg.dp * deg.cp and rank in dp_cp
            assert info["sums"]["dp_cp"] == sum(dp_cp)
