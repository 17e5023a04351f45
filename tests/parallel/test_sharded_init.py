"""Sharded initialisation: no rank materialises more than its share, and every share holds exactly the
1-process model's initial values.

One 4-rank gloo launch builds the model (`ModelState`, as training does) in several layouts — dp2×tp2+sp
ZeRO-3, tp2×pp2 (tied, both pipeline ends), dp2×pp2 ZeRO-3 untied, dp2×tp2 ep2 ZeRO-3 MoE — with the init
chunk cut to 4096 values. A dispatch mode records every floating-point storage created while building;
apart from the rank's persistent state (its parameters and the engines' flat buffers) none may exceed one
chunk (or one row of dim 0 when a row is larger), so no full-size copy of a sharded parameter ever
exists. Then each local tensor, or ZeRO-3 piece, is compared bit for bit with the same slice of
`build_model` (the 1-process model).
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pentatron.models import param_init
from pentatron.models.param_init import ParamInit, chunk_rows, fill_slice
from tests.multiprocess import run_ranks

CHUNK = 4096
CASES = {
    "dp2×tp2+sp zero3": ["parallel.dp=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero=3"],
    "tp2×pp2 zero0 tied": ["parallel.tp=2", "parallel.pp=2"],
    "dp2×pp2 zero3 untied": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "model.name=debug-untied"],
    "dp2×tp2 ep2 zero3 moe": ["parallel.dp=2", "parallel.tp=2", "parallel.ep=2", "parallel.zero=3",
                              "model.name=debug-moe"],
    "dp2×tp2 zero1": ["parallel.dp=2", "parallel.tp=2", "parallel.zero=1"],
}


def test_chunked_draws_equal_one_draw() -> None:
    """torch's CPU normal sampler is chunk-stable under `chunk_rows`' rule, and any box / range of the
    flattened box that `fill_slice` writes is exactly that part of one full draw."""
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 40) for _ in range(rng.choice((2, 3))))
        chunk = rng.choice((16, 48, 100, 1000))
        init = ParamInit(ones=False, std=0.5, seed=rng.randint(0, 99))
        g = torch.Generator().manual_seed(init.seed)
        full = torch.randn(shape, generator=g).mul(0.5)
        g = torch.Generator().manual_seed(init.seed)
        rows = [torch.randn((e - s, *shape[1:]), generator=g) for s, e in chunk_rows(shape[0], math.prod(shape[1:]),
                                                                                     chunk)]
        assert torch.equal(torch.cat(rows).mul(0.5), full), (shape, chunk)
        box = []
        for n in shape:
            a = rng.randint(0, n - 1)
            box.append((a, rng.randint(1, n - a)))
        want = full[tuple(slice(a, a + n) for a, n in box)].flatten()
        lo = rng.randint(0, want.numel() - 1)
        hi = rng.randint(lo + 1, want.numel())
        out = torch.empty(hi - lo, dtype=torch.bfloat16)
        fill_slice(out, init, shape, box, lo, hi, chunk_numel=chunk)
        assert torch.equal(out, want[lo:hi].to(torch.bfloat16)), (shape, box, lo, hi, chunk)


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
    rows = max(math.prod(p.shape[1:]) for p in build_model(cfg.model_config()).parameters())
    with _Allocations() as seen:
        state = ModelState(cfg, flight_recorder=False)
    keep = _persistent_storages(state)
    transient = max((b for b, ptr, _ in seen.seen if ptr not in keep), default=0)
    bound = 4 * max(CHUNK + 16, rows)
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
    param_init.CHUNK_NUMEL = CHUNK  # this process only
    return {label: _check(label, extra, log_dir) for label, extra in CASES.items()}


def test_no_rank_materialises_more_than_its_share(tmp_path) -> None:
    runs = run_ranks(_ranks, 4, args=(str(tmp_path),), timeout=600)
    for label in CASES:
        held = [r[label]["held"] for r in runs]
        total = runs[0][label]["total"]
        # every layout here splits the parameters at least 2 ways on every rank
        assert max(held) <= total * 0.6, f"{label}: ranks hold {held} of {total} parameters"
