"""ParallelContext: degree validation, rank ↔ coordinates (tp innermost, pp outermost), and the real
process groups of each mesh dimension on 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pentatron.distributed.context import MESH_DIMS, Degrees, ParallelContext, resolve_degrees
from tests.multiprocess import run_ranks


def test_resolve_degrees_fills_dp_and_rejects_what_does_not_fit():
    assert resolve_degrees(8, dp=None, tp=2) == Degrees(pp=1, dp=4, cp=1, tp=2)
    with pytest.raises(ValueError, match="dp=3 does not divide the world size"):
        resolve_degrees(4, dp=3)
    with pytest.raises(ValueError, match="world size 6 is not divisible by tp×pp×cp = 4"):
        resolve_degrees(6, dp=None, tp=2, pp=2)
    with pytest.raises(ValueError, match="parallel.ep=3 must divide dp×cp"):
        resolve_degrees(4, dp=4, ep=3)
    with pytest.raises(ValueError, match="parallel.dp must be ≥ 1"):
        resolve_degrees(4, dp=0)


def test_rank_order_puts_tp_innermost_and_pp_outermost():
    deg = Degrees(pp=2, dp=2, cp=1, tp=2)
    ctx = ParallelContext(deg, rank=5, device=torch.device("cpu"), groups={})
    assert ctx.coords == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert ctx.group_ranks("tp") == [4, 5] and ctx.group_ranks("dp") == [5, 7]
    assert ctx.group_ranks("pp") == [1, 5] and ctx.group_ranks("cp") == [5]
    for r in range(deg.world_size):
        assert ctx.rank_of(**ctx.coords_of(r)) == r
    with pytest.raises(KeyError, match="unknown mesh dimensions"):
        ctx.rank_of(xp=0)


def test_single_process_context_needs_no_process_group():
    ctx = ParallelContext.single()
    assert ctx.world_size == 1 and ctx.dp_size == 1 and ctx.dp_rank == 0
    assert all(ctx.group(d) is None for d in (*MESH_DIMS, "dp_cp"))
    assert ParallelContext.from_degrees(Degrees(), "cpu").world_size == 1
    with pytest.raises(RuntimeError, match="no process group is initialised"):
        ParallelContext.from_degrees(Degrees(dp=2), "cpu")


def test_a_released_context_refuses_collectives_instead_of_running_them_alone():
    """After `release` a size-1 short-circuit would silently skip what is asked: it is an error instead."""
    ctx = ParallelContext.single()
    ctx.release()
    ctx.release()  # idempotent
    with pytest.raises(RuntimeError, match="released its process groups"):
        ctx.group("dp")
    with pytest.raises(RuntimeError, match="released its process groups"):
        ctx.comm.all_reduce(torch.ones(1), "dp")


_LAYOUTS = [Degrees(dp=4), Degrees(pp=2, dp=2), Degrees(dp=2, tp=2), Degrees(dp=2, cp=2)]


def _groups_on_ranks(rank: int, world: int) -> list[dict]:
    out = []
    for deg in _LAYOUTS:
        ctx = ParallelContext.from_degrees(deg, "cpu")
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
