"""Sharded initialisation: no rank materialises more than its share, and every share holds exactly the
1-process model's initial values.

One 4-rank gloo launch builds the model (`ModelState`, as training does) in several layouts — dp2×tp2+sp
ZeRO-3, tp2×pp2 (tied, both pipeline ends), dp2×pp2 ZeRO-3 untied, dp2×tp2 ep2 ZeRO-3 MoE — with the init
tiles cut to 8 × 64 values. A dispatch mode records every floating-point storage created while building;
apart from the rank's persistent state (its parameters and the engines' flat buffers) none may exceed
4096 values, so no full-size copy of a sharded parameter ever exists. Then each local tensor, or ZeRO-3
piece, is compared bit for bit with the same slice of `build_model` (the 1-process model).
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pentatron.models import param_init
from pentatron.models.param_init import ParamInit, fill_slice, param_seed
from tests.multiprocess import run_ranks

CHUNK = 4096  # fp32 values a transient may hold while building: well below a shard, above one tile
CASES = {
    "dp2×tp2+sp zero3": ["parallel.dp=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero=3"],
    "tp2×pp2 zero0 tied": ["parallel.tp=2", "parallel.pp=2"],
    "dp2×pp2 zero3 untied": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "model.name=debug-untied"],
    "dp2×tp2 ep2 zero3 moe": ["parallel.dp=2", "parallel.tp=2", "parallel.ep=2", "parallel.zero=3",
                              "model.name=debug-moe"],
    "dp2×tp2 zero1": ["parallel.dp=2", "parallel.tp=2", "parallel.zero=1"],
}


def test_any_slice_equals_that_part_of_the_whole_and_draws_only_its_tiles(monkeypatch) -> None:
    """Any box / range of the flattened box that `fill_slice` writes is exactly that part of the whole
    parameter's draw, and it draws only the tiles the box overlaps (counter-based: no tile before it)."""
    monkeypatch.setattr(param_init, "TILE_ROWS", 3)
    monkeypatch.setattr(param_init, "TILE_COLS", 5)
    monkeypatch.setattr(param_init, "TILE_1D", 7)
    drawn: list[tuple[int, ...]] = []
    real_draw = param_init.draw_tile
    monkeypatch.setattr(param_init, "draw_tile",
                        lambda i, s, index, d: drawn.append(tuple(index)) or real_draw(i, s, index, d))
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 24) for _ in range(rng.choice((1, 2, 3))))
        init = ParamInit(ones=False, std=0.5, seed=rng.randint(0, 99))
        full = torch.empty(shape, dtype=torch.float64)
        fill_slice(full, init, shape)
        box = []
        for n in shape:
            a = rng.randint(0, n - 1)
            box.append((a, rng.randint(1, n - a)))
        want = full[tuple(slice(a, a + n) for a, n in box)].flatten()
        lo = rng.randint(0, want.numel() - 1)
        hi = rng.randint(lo + 1, want.numel())
        out = torch.full((hi - lo,), float("nan"), dtype=torch.bfloat16)
        drawn.clear()
        fill_slice(out, init, shape, box, lo, hi)
        assert torch.equal(out, want[lo:hi].to(torch.bfloat16)), (shape, box, lo, hi)
        tile = param_init.tile_shape(shape)
        in_box = {tuple(i // t for i, t in zip(idx, tile, strict=True))
                  for idx in itertools.product(*(range(a, a + n) for a, n in box))}
        assert set(drawn) <= in_box, (shape, box, sorted(set(drawn) - in_box))
    # a [64, 64] matrix in 3x5 tiles: a tp shard of columns 40..47 draws 22 row tiles x 2 column tiles, of 13
    drawn.clear()
    fill_slice(torch.empty(64, 8), ParamInit(ones=False, std=1.0, seed=1), (64, 64), ((0, 64), (40, 8)))
    assert len(drawn) == 22 * 2


def test_the_draw_is_a_normal_sample_with_independent_tiles() -> None:
    """Tiles seeded from (parameter, index) hashes: the whole is N(0, std) and no two tiles repeat."""
    init = ParamInit(ones=False, std=0.02, seed=param_seed(0, "layers.0.mlp.up_proj.weight"))
    w = torch.empty(512, 4096)
    fill_slice(w, init, w.shape)
    assert abs(w.mean().item()) < 3 * 0.02 / math.sqrt(w.numel()) and abs(w.std().item() / 0.02 - 1) < 0.01
    tiles = w.unfold(0, param_init.TILE_ROWS, param_init.TILE_ROWS).unfold(1, param_init.TILE_COLS,
                                                                             param_init.TILE_COLS)
    firsts = tiles.reshape(-1, param_init.TILE_ROWS * param_init.TILE_COLS)[:, :4]
    assert len({tuple(r.tolist()) for r in firsts}) == firsts.shape[0]


class _Allocations(TorchDispatchMode):
    """Every floating-point storage an op returned: (bytes, storage pointer, op)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and t.dtype in (torch.float32, torch.bfloat16):
                s = t.untyped_storage()
                self.seen.append((s.nbytes(), s.data_ptr(), str(func)))
        return out


def _persistent_storages(state: Any) -> set[int]:
    """Storage pointers of what the rank keeps: parameters, buffers, the engines' flat buffers."""
    model = state.runner.model
    tensors = [*model.parameters(), *model.buffers()]
    for st in getattr(state.runner, "stages", None) or []:
        tensors += list(st.buffers())
    engine = state.engine
    for e in getattr(engine, "engines", [engine]):
        for obj in (e, getattr(e, "grads", None)):
            tensors += [v for v in vars(obj).values() if isinstance(v, torch.Tensor)] if obj is not None else []
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


def _box(pl: Any) -> tuple[slice, ...]:
    from pentatron.parallel.materialize import local_box

    return tuple(slice(a, a + n) for a, n in local_box(pl))


def _check(label: str, extra: list[str], log_dir: str) -> dict[str, Any]:
    from pentatron.config import load_config
    from pentatron.models.llama import build_model
    from pentatron.train.model_state import ModelState

    cfg = load_config(None, ["train.seq_len=32", "train.micro_batch=2", "train.global_batch=8",
                             "log.progress=false", "log.tensorboard=false", f"log.dir={log_dir!r}", *extra],
                      world_size=4)
    with _Allocations() as seen:
        state = ModelState(cfg, flight_recorder=False)
    keep = _persistent_storages(state)
    transient = max((b for b, ptr, _ in seen.seen if ptr not in keep), default=0)
    bound = 4 * CHUNK
    assert transient <= bound, f"{label}: a transient of {transient} B during build (bound {bound} B)"

    full = dict(build_model(cfg.model_config(), seed=cfg.train.seed).named_parameters(remove_duplicate=False))
    engine = state.engine
    held = 0
    for e in getattr(engine, "engines", [engine]):
        for p, pl in e.place.items():
            want = full[pl.name].detach()[_box(pl)]
            if e.stage == 3:
                for pc in (pc for pc in e.pieces if pc.param is p):
                    got = e.param_shard[pc.local: pc.local + pc.numel]
                    assert torch.equal(got, want.flatten()[pc.lo: pc.hi]), f"{label}: {pl.name}[{pc.lo}:{pc.hi}]"
            else:
                assert torch.equal(p.detach(), want), f"{label}: {pl.name}"
        held += e.param_shard.numel() if e.stage == 3 else sum(p.numel() for p in e.params)
    total = sum(p.numel() for p in build_model(cfg.model_config()).parameters())
    state.close()
    return {"held": held, "total": total, "transient": transient}


def _ranks(rank: int, world: int, log_dir: str) -> dict[str, dict[str, Any]]:
    param_init.TILE_ROWS, param_init.TILE_COLS, param_init.TILE_1D = 8, 64, 512  # this process only
    return {label: _check(label, extra, log_dir) for label, extra in CASES.items()}


def test_no_rank_materialises_more_than_its_share(tmp_path) -> None:
    runs = run_ranks(_ranks, 4, args=(str(tmp_path),), timeout=600)
    for label in CASES:
        held = [r[label]["held"] for r in runs]
        total = runs[0][label]["total"]
        # every layout here splits the parameters at least 2 ways on every rank
        assert max(held) <= total * 0.6, f"{label}: ranks hold {held} of {total} parameters"
