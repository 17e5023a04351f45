"""Search: every valid layout for a workload on N GPUs, filtered by memory, ranked by predicted
throughput. Candidates are first ranked with the closed-form bubble (fast), then the best few are
re-timed by simulating their actual pipeline schedule; the table shows the simulated numbers.

Pruning rules (each keeps the optimum of the model): recompute is the lightest mode that fits (more
recompute only adds time); sequence parallelism is on whenever tp > 1 (same bytes as TP's all-reduce,
1/tp of the hidden-sized activations); AFAB is only evaluated when asked for (1F1B has its bubble with
less memory).

Speed without changing the answer: a candidate whose `memory.memory_floor` exceeds the device does not
fit, its full breakdown computed only if read; a fitting one's closed-form step time is computed only where
it can change the ranking or the reasons (`best_first`, `best_estimate`), below an exact ceiling on its
rate from `timing.step_time_floor`.
"""

from __future__ import annotations

import gc
import heapq
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from pentatron.hardware.catalogue import GiB, GPUSpec
from pentatron.layout import ParallelLayout
from pentatron.plan.context import cp_mode_options
from pentatron.plan.layout import (
    Layout,
    Workload,
    knob_problems,
    problems,
    quick_parallel_problems,
    trainable_problems,
    warnings,
)
from pentatron.plan.memo import Without
from pentatron.plan.memory import FRAGMENTATION, MemoryBreakdown, memory_floor, memory_per_gpu
from pentatron.plan.recipes import PENTATRON, TRAINING_ATTENTION, resolve_kernels
from pentatron.plan.timing import StepTime, Throughput, step_time, step_time_floor, throughput

KNOBS = ("dp", "tp", "pp", "cp", "ep", "zero", "sp", "pp_schedule", "pp_virtual", "micro_batch", "recompute")
RECOMPUTE_ORDER = ("none", "selective", "full")


@dataclass(frozen=True)
class Prediction:
    """Everything predicted for one layout."""

    layout: Layout
    memory: MemoryBreakdown
    fits: bool
    step: StepTime
    rate: Throughput
    notes: tuple[str, ...] = ()
    tight: bool = False  # fits, but not with the allocator-fragmentation margin (memory.FRAGMENTATION)


class Scored:
    """One layout of the search: its memory and whether it fits, and `est_tokens_per_s`, the closed-form
    estimate (0 when it does not fit). The estimate may be given or computed on first read (`compute`):
    the search reads it only where it can change the outcome, bounded above by `ceiling` (the rate at
    `timing.step_time_floor`), so most layouts never pay for the full step-time model."""

    __slots__ = ("layout", "fits", "ceiling", "floor", "_est", "_compute", "_memory", "_compute_memory")

    def __init__(self, layout: Layout, memory_total: float | None, fits: bool, est_tokens_per_s: float | None = None,
                 *, ceiling: float | None = None, compute: Callable[[], float] | None = None,
                 compute_memory: Callable[[], float] | None = None, floor: float | None = None) -> None:
        if (est_tokens_per_s is None and compute is None) or (memory_total is None and compute_memory is None):
            raise ValueError("Scored needs est_tokens_per_s and memory_total, or ways to compute them")
        self.layout, self.fits = layout, fits
        self._est, self._compute = est_tokens_per_s, compute
        self._memory, self._compute_memory = memory_total, compute_memory
        self.ceiling = est_tokens_per_s if ceiling is None else ceiling
        # a lower bound on memory_total (`memory.memory_floor`), known without computing it; the total itself
        # when given
        self.floor = memory_total if memory_total is not None else (0.0 if floor is None else floor)

    @property
    def memory_total(self) -> float:
        """`memory_per_gpu(...).total`; for a layout the search ruled out by `memory_floor`, computed when read."""
        if self._memory is None:
            assert self._compute_memory is not None
            self._memory, self._compute_memory = self._compute_memory(), None
        return self._memory

    @property
    def est_tokens_per_s(self) -> float:
        if self._est is None:
            assert self._compute is not None
            self._est, self._compute = self._compute(), None
        return self._est

    def __repr__(self) -> str:
        return (f"Scored({self.layout.short()}, memory_total={self._memory}, fits={self.fits}, "
                f"est_tokens_per_s={self._est if self._est is not None else '...'})")


def _rank_key(s: Scored) -> float:
    return -cp_handicapped(s.layout, s.est_tokens_per_s)


def best_first(scored: list[Scored]) -> Iterator[Scored]:
    """`scored` in the order of sorted(scored, key=(-cp_handicapped estimate, memory_total)) (stable),
    computing estimates only as far as the order is read: a layout is yielded once its estimate beats the
    ceiling of every layout not yet estimated (estimates never exceed their ceilings)."""
    order = sorted(range(len(scored)), key=lambda i: -cp_handicapped(scored[i].layout, scored[i].ceiling))
    heap: list[tuple[float, float, int]] = []
    for i in order:
        bound = -cp_handicapped(scored[i].layout, scored[i].ceiling)
        while heap and heap[0][0] < bound:  # strictly better than anything not yet estimated
            yield scored[heapq.heappop(heap)[2]]
        heapq.heappush(heap, (_rank_key(scored[i]), scored[i].memory_total, i))
    while heap:
        yield scored[heapq.heappop(heap)[2]]


def least_memory(scored: list[Scored]) -> float:
    """min(s.memory_total for s in scored), computing totals only while a floor could beat the least so far
    (most of a pool that does not fit was ruled out by its floor: its totals, each a pipeline simulation for
    the activations, would otherwise all be computed to print one "needs >= X GiB")."""
    least = float("inf")
    for s in sorted(scored, key=attrgetter("floor")):
        if s.floor >= least:
            break
        least = min(least, s.memory_total)
    return least


def best_estimate(scored: list[Scored]) -> float:
    """max(s.est_tokens_per_s for s in scored), computing estimates only while a ceiling could beat it."""
    best = 0.0
    for s in sorted(scored, key=lambda s: -s.ceiling):
        if s.ceiling <= best:
            break
        best = max(best, s.est_tokens_per_s)
    return best


@dataclass
class SearchResult:
    workload: Workload
    gpu: GPUSpec
    gpus: int
    ranked: list[Prediction]  # simulated, best first
    enumerated: int
    valid: int
    fitting: int
    seconds: float
    reasons: list[str] = field(default_factory=list)
    pool: list[Scored] = field(default_factory=list)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pow2_upto(n: int) -> list[int]:
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    return out


# Context parallelism is ranked above a layout without it only when predicted faster by more than this:
# its attention runs as many short kernels (2·cp zigzag chunks, one launch per ring step) whose lower
# FlashAttention efficiency the model does not have, so a near-tie is not evidence that CP helps. Where
# nothing without CP fits (long sequences), CP is all there is and ranks as predicted.
CP_MARGIN = 0.05


def cp_handicapped(lay: Layout, tokens_per_s: float) -> float:
    """The throughput the search ranks by: CP layouts must beat the others by CP_MARGIN."""
    return tokens_per_s / (1 + CP_MARGIN) if lay.cp > 1 else tokens_per_s


def memory_budget(gpu: GPUSpec) -> float:
    """The most predicted memory a layout may need to fit: hbm / (1 + headroom), i.e. predicted x (1 +
    headroom) <= hbm (`GPUSpec.headroom`, `--headroom`). Every fit, recommendation and suggestion reads it."""
    return gpu.hbm_bytes / (1 + gpu.headroom)


def predict(w: Workload, lay: Layout, gpu: GPUSpec, *, kernels: str | None = None, exact: bool = True,
            norm: str | None = None) -> Prediction:
    """`kernels` None: the recipe's (ours: what `pentatron train` runs by default); `norm` None: the
    recipe's."""
    kernels = resolve_kernels(lay.recipe, kernels)
    norm = norm if norm is not None else lay.recipe.norm
    mem = memory_per_gpu(w, lay, gpu, kernels, norm)
    st = step_time(w, lay, gpu, kernels=kernels, exact=exact)
    notes = warnings(w, lay, gpu)
    budget = memory_budget(gpu)
    if mem.required <= budget < mem.total:
        notes.append(f"tight: {mem.required / GiB:.1f} GiB of tensors fit in {budget / GiB:.1f} GiB, but not with "
                     f"the {100 * FRAGMENTATION:.0f}% allocator-fragmentation margin ({mem.total / GiB:.1f} GiB); "
                     "the search recommends only layouts that fit with it")
    if lay.pp > 1 and lay.pp <= lay.microbatches(w) < 2 * lay.pp:
        notes.append(f"only {lay.microbatches(w)} micro-batches for pp={lay.pp}: bubble "
                     f"{100 * st.bubble_fraction:.0f}% of the pipeline's time")
    notes += [f"training cannot run this yet: {x}" for x in trainable_problems(w, lay, lay.world)]
    return Prediction(lay, mem, mem.required <= budget, st, throughput(w, lay, gpu, st), tuple(notes),
                      tight=mem.required <= budget < mem.total)


def enumerate_layouts(w: Workload, gpu: GPUSpec, gpus: int, fixed: dict[str, Any]) -> Iterator[Layout]:
    """All layouts (before memory) passing `quick_problems`, with `fixed` knobs pinned."""
    cfg, moe = w.cfg, w.moe_spec

    def opts(name: str, values: list[Any]) -> list[Any]:
        return [fixed[name]] if fixed.get(name) is not None else values

    precision = fixed.get("precision") or "bf16"
    split = fixed.get("pp_layers")  # an explicit split fixes pp x pp_virtual = its length
    for tp in opts("tp", [t for t in _pow2_upto(min(gpu.gpus_per_node, gpus)) if gpus % t == 0]):
        for cp in opts("cp", [c for c in _pow2_upto(16) if gpus % (tp * c) == 0]):
            if gpus % (tp * cp):
                continue
            for pp in opts("pp", [p for p in _divisors(gpus // (tp * cp)) if p <= cfg.n_layers]):
                if gpus % (tp * cp * pp) or (split is not None and (pp == 1 or len(split) % pp)):
                    continue
                dp = gpus // (tp * cp * pp)
                if fixed.get("dp") is not None and fixed["dp"] != dp:
                    continue
                if w.global_batch % dp:
                    continue
                eps = [e for e in _divisors(moe.num_experts) if (dp * cp) % e == 0] if moe else [1]
                for ep in opts("ep", eps):
                    per_dp = w.global_batch // dp
                    mbs = [b for b in _pow2_upto(min(per_dp, 32)) if per_dp % b == 0]
                    for mb in opts("micro_batch", mbs):
                        yield from _knob_variants(w, gpu, gpus, fixed, precision, dp, tp, pp, cp, ep, mb)


def _knob_variants(w: Workload, gpu: GPUSpec, gpus: int, fixed: dict[str, Any], precision: str, dp: int,
                   tp: int, pp: int, cp: int, ep: int, mb: int) -> Iterator[Layout]:
    cfg = w.cfg
    zeros = [0, 1, 2, 3] if dp * cp > 1 else [0]
    if fixed.get("zero") is not None:
        zeros = [fixed["zero"]]
    sps = [fixed["sp"]] if fixed.get("sp") is not None else [tp > 1]
    if pp == 1:
        scheds = [("1f1b", 1)]
    else:
        scheds = [("1f1b", 1), ("zb", 1)]
        per_stage = cfg.n_layers // pp
        scheds += [("interleaved", v) for v in range(2, min(per_stage, 8) + 1) if cfg.n_layers % (pp * v) == 0]
    if fixed.get("pp_schedule") is not None:
        want_v = fixed.get("pp_virtual")
        scheds = [(s, v) for s, v in scheds if s == fixed["pp_schedule"]] or [(fixed["pp_schedule"], want_v or 1)]
        if want_v is not None:
            scheds = [(s, want_v) for s, _ in scheds[:1]]
    elif fixed.get("pp_virtual") is not None:
        scheds = [("interleaved", fixed["pp_virtual"])] if fixed["pp_virtual"] > 1 else scheds
    split = fixed.get("pp_layers")
    if split is not None:  # the chunks per rank follow from the split's length
        v = len(split) // pp
        scheds = [(sc, vv) for sc, vv in scheds if vv == v] or ([("interleaved", v)] if v > 1 else [])
    recipe = fixed.get("recipe", PENTATRON)
    recs = [fixed["recompute"]] if fixed.get("recompute") is not None else list(recipe.recompute_order())
    modes = cp_mode_options(cp, tp, gpu.gpus_per_node)
    if fixed.get("cp_mode") is not None or fixed.get("cp_ulysses") is not None:
        mode = fixed.get("cp_mode") or "hybrid"
        want_u = fixed.get("cp_ulysses")
        modes = [(m, u) for m, u in modes if m == mode and want_u in (None, u)] or [(mode, want_u or 1)]
    attention = fixed.get("attention") or TRAINING_ATTENTION
    fp8_scaling = fixed.get("fp8_scaling") or "tensorwise"
    for zero in zeros:
        for sp in sps:
            for sched, v in scheds:
                for cp_mode, cp_u in modes:
                    shards = hsdp_shards(zero, dp, tp, cp, ep, gpu.gpus_per_node)
                    for shard in shards if fixed.get("dp_shard") is None else (fixed["dp_shard"],):
                        par = ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, sp=sp, pp_schedule=sched,
                                             pp_virtual=v, micro_batch=mb, cp_mode=cp_mode, cp_ulysses=cp_u,
                                             pp_layers=split, dp_shard=shard)
                        # `quick_problems` in two parts: the held layout's rules once for its recompute variants
                        if quick_parallel_problems(w, par, gpus):
                            continue
                        for rc in recs:
                            lay = Layout(par, recompute=rc, precision=precision, attention=attention,
                                         fp8_scaling=fp8_scaling, recipe=recipe)
                            if not knob_problems(w, lay, gpu):
                                yield lay


def hsdp_shards(zero: int, dp: int, tp: int, cp: int, ep: int, gpus_per_node: int) -> tuple[int, ...]:
    """`dp_shard` values the search evaluates: 0 (ZeRO over all of dp) and, for a ZeRO stage whose dp group
    spans nodes, HSDP with one node's dp ranks as the shard group (the one shard degree that keeps ZeRO's
    gathers and reduce-scatters on NVLink while sharding as widely as that allows; smaller ones shard less
    over the same link, larger ones cross nodes)."""
    s = gpus_per_node // tp
    if zero >= 1 and cp == 1 and ep == 1 and 1 < s < dp and dp % s == 0:
        return (0, s)
    return (0,)


def search(w: Workload, gpu: GPUSpec, gpus: int, *, fixed: dict[str, Any] | None = None, top: int = 10,
           kernels: str | None = None, exact_pool: int | None = None) -> SearchResult:
    # Without the cyclic garbage collector: the search keeps ~10^5 live objects (its pool) while making
    # many more, so each automatic full collection re-walks the pool; that was ~1/3 of the search's time.
    # Its objects hold no reference cycles (reference counting frees what it drops); the collector is
    # restored as it was.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _search(w, gpu, gpus, fixed=fixed, top=top, kernels=kernels, exact_pool=exact_pool)
    finally:
        if enabled:
            gc.enable()


def _search(w: Workload, gpu: GPUSpec, gpus: int, *, fixed: dict[str, Any] | None, top: int,
            kernels: str | None, exact_pool: int | None) -> SearchResult:
    t0 = time.perf_counter()
    fixed = dict(fixed or {})
    kernels = resolve_kernels(fixed.get("recipe", PENTATRON), kernels)
    budget = memory_budget(gpu)
    pool: list[Scored] = []
    n_enum = n_valid = 0
    stop_rc: set[tuple] = set()  # (layout without recompute) that already fit with lighter recompute
    floors: dict[Without, float] = {}  # step_time_floor by layout without ZeRO stage (see _NOT_IN_FLOOR)
    for lay in enumerate_layouts(w, gpu, gpus, fixed):
        n_enum += 1
        key = (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.zero, lay.sp, lay.pp_schedule, lay.pp_virtual,
               lay.micro_batch, lay.cp_mode, lay.cp_ulysses, lay.dp_shard)
        if key in stop_rc and fixed.get("recompute") is None:
            continue
        n_valid += 1
        floor_mem = memory_floor(w, lay, gpu, kernels)
        if floor_mem > budget * (1 + 1e-9):  # cannot fit (margin: rounding)
            pool.append(Scored(lay, None, False, 0.0, compute_memory=_memory_total(w, lay, gpu, kernels),
                               floor=floor_mem))
            continue
        mem = memory_per_gpu(w, lay, gpu, kernels)
        fits = mem.total <= budget
        if fits:
            stop_rc.add(key)
            fkey = Without(lay, _NOT_IN_FLOOR)
            floor = floors.get(fkey)
            if floor is None:
                floor = floors[fkey] = step_time_floor(w, lay, gpu, kernels=kernels)
            pool.append(Scored(lay, mem.total, fits, ceiling=w.tokens_per_step / floor,
                               compute=_estimate(w, lay, gpu, kernels)))
        else:
            pool.append(Scored(lay, mem.total, fits, 0.0))
    fitting = [s for s in pool if s.fits]
    k = exact_pool if exact_pool is not None else max(3 * top, 24)
    # Recommend only what `pentatron train` accepts (checked best-first, the full validator being the
    # costly part); when the pinned knobs leave nothing trainable (e.g. --cp 8, --precision fp8),
    # evaluate what was asked for, its notes saying why training cannot run it.
    chosen: list[Scored] = []
    evaluable: list[Scored] = []
    for s in best_first(fitting):  # = sorted by (-cp_handicapped estimate, memory), estimated as read
        if len(chosen) >= k:
            break
        if problems(w, s.layout, gpu, gpus):
            continue
        if len(evaluable) < k:
            evaluable.append(s)
        if not trainable_problems(w, s.layout, gpus):
            chosen.append(s)
    pinned = ({kk for kk in fixed if kk not in ("precision", "attention", "fp8_scaling", "recipe")}
              or fixed.get("precision", "bf16") != "bf16" or fixed.get("recipe", PENTATRON) != PENTATRON)
    if not chosen and pinned:
        chosen = evaluable[:k]
    ranked = [predict(w, s.layout, gpu, kernels=kernels) for s in chosen]
    ranked.sort(key=lambda p: (-cp_handicapped(p.layout, p.rate.tokens_per_s), p.memory.total))
    res = SearchResult(w, gpu, gpus, ranked[:top], n_enum, n_valid, len(fitting), 0.0, pool=pool)
    if ranked:
        res.reasons = reasons_for(ranked[0].layout, pool, gpu, fixed, w=w, gpus=gpus, kernels=kernels)
    res.seconds = time.perf_counter() - t0
    return res


# `timing.step_time_floor` reads no ZeRO stage (the stage phases, the closed-form pipeline and the p2p hop
# do not; tests/plan/test_search_equivalence.py checks it): a layout's ZeRO variants share one.
_NOT_IN_FLOOR = frozenset({"zero"})


def _memory_total(w: Workload, lay: Layout, gpu: GPUSpec, kernels: str) -> Callable[[], float]:
    return lambda: memory_per_gpu(w, lay, gpu, kernels).total


def _estimate(w: Workload, lay: Layout, gpu: GPUSpec, kernels: str) -> Callable[[], float]:
    return lambda: w.tokens_per_step / step_time(w, lay, gpu, kernels=kernels, exact=False).step


LOCAL_KNOBS = {"zero": (0, 1, 2, 3), "micro_batch": (1, 2, 4, 8, 16, 32), "recompute": RECOMPUTE_ORDER,
               "sp": (False, True)}


def _score(w: Workload, lay: Layout, gpu: GPUSpec, kernels: str) -> Scored:
    mem = memory_per_gpu(w, lay, gpu, kernels).total
    fits = mem <= memory_budget(gpu)
    est = w.tokens_per_step / step_time(w, lay, gpu, kernels=kernels, exact=False).step if fits else 0.0
    return Scored(lay, mem, fits, est)


def reasons_for(best: Layout, pool: list[Scored], gpu: GPUSpec, fixed: dict[str, Any], *,
                w: Workload | None = None, gpus: int | None = None, kernels: str = "fused") -> list[str]:
    """Why each knob of `best` has its value: for knobs that change alone (ZeRO, micro-batch, recompute,
    SP) the best layout with that knob changed; for mesh knobs (whose product is fixed) the best layout
    in the search with another value. Each with its cost: slower by x%, or the memory it would need."""
    ref = max((s.est_tokens_per_s for s in pool if s.layout == best), default=0.0)
    if not ref:
        ref = best_estimate(pool)
    local: dict[str, dict[Any, list[Scored]]] = {}
    if w is not None:
        for knob, values in LOCAL_KNOBS.items():
            for v in (best.recipe.recompute_order() if knob == "recompute" else values):
                alt = best.with_(**{knob: v})
                if v != getattr(best, knob) and not problems(w, alt, gpu, gpus):
                    local.setdefault(knob, {})[v] = [_score(w, alt, gpu, kernels)]
    knobs = ("tp", "sp", "pp", "pp_schedule", "dp", "cp", "ep", "zero", "micro_batch", "recompute")
    # the pool's layouts by each mesh knob's other values, in pool order (one pass over the pool for all)
    mesh = [k for k in knobs if fixed.get(k) is None and not (k in LOCAL_KNOBS and w is not None)]
    by_value: dict[str, dict[Any, list[Scored]]] = {k: {} for k in mesh}
    if mesh:
        get = attrgetter(*mesh)

        def read(lay: Layout) -> tuple:  # attrgetter returns a bare value for one name
            return get(lay) if len(mesh) > 1 else (get(lay),)

        best_values = read(best)
        for s in pool:
            for k, val, other in zip(mesh, best_values, read(s.layout)):
                if other != val:
                    by_value[k].setdefault(other, []).append(s)
    out = []
    for knob in knobs:
        val = getattr(best, knob)
        if fixed.get(knob) is not None:
            out.append(f"{knob}={val}: fixed on the command line")
            continue
        alts = local.get(knob, {}) if knob in LOCAL_KNOBS and w is not None else by_value[knob]
        if not alts:
            out.append(f"{knob}={val}: the only valid value")
            continue
        parts = []
        for other, group in sorted(alts.items(), key=lambda kv: (isinstance(kv[0], str), str(kv[0]).zfill(8))):
            fit = [s for s in group if s.fits]
            if fit:
                b = best_estimate(fit)
                slower = 100 * (1 - b / ref) if ref else 0.0
                parts.append(f"{other}: {slower:.1f}% slower" if slower >= 0 else
                             f"{other}: {-slower:.1f}% faster by the closed-form estimate, slower when simulated")
            else:
                need = least_memory(group)
                parts.append(f"{other}: needs >= {need / GiB:.1f} GiB > {memory_budget(gpu) / GiB:.1f} GiB")
        out.append(f"{knob}={val}: vs " + "; ".join(parts[:4]) + ("; ..." if len(parts) > 4 else ""))
    if w is not None:
        line = _hsdp_reason(w, best, gpu, gpus, kernels, ref)
        if line:
            out.append(line)
    return out


def _hsdp_reason(w: Workload, best: Layout, gpu: GPUSpec, gpus: int | None, kernels: str, ref: float) -> str | None:
    """Why HSDP (parallel.dp_shard) is on or off in a ZeRO layout: the same layout the other way, timed."""
    if best.zero == 0:
        return None
    if best.par.hsdp:
        alt, what = best.with_(dp_shard=0), f"ZeRO-{best.zero} over all {best.dp} dp ranks"
    else:
        shards = [s for s in hsdp_shards(best.zero, best.dp, best.tp, best.cp, best.ep, gpu.gpus_per_node) if s]
        if not shards:
            return None
        alt, what = best.with_(dp_shard=shards[0]), f"HSDP with {shards[0]}-rank shard groups"
    if problems(w, alt, gpu, gpus):
        return None
    s = _score(w, alt, gpu, kernels)
    if best.par.hsdp:
        head = (f"dp_shard={best.dp_shard}: HSDP, {best.par.replicate_degree} replicas × {best.dp_shard}-rank shard "
                f"groups inside a node (ZeRO-{best.zero}'s reduce-scatters and all-gathers inside the node, one "
                f"all-reduce of 1/{best.dp_shard} of the gradients across nodes)")
    else:
        head = f"dp_shard=0: ZeRO-{best.zero} over all {best.dp} dp ranks"
    if not s.fits:
        return f"{head}; vs {what}: needs {s.memory_total / GiB:.1f} GiB > {memory_budget(gpu) / GiB:.1f} GiB"
    slower = 100 * (1 - s.est_tokens_per_s / ref) if ref else 0.0
    return f"{head}; vs {what}: {slower:.1f}% slower"


def suggest_fixes(w: Workload, lay: Layout, gpu: GPUSpec, gpus: int) -> list[str]:
    """Single-knob changes that make a layout that does not fit, fit (with the memory they need)."""
    budget = memory_budget(gpu)
    trials: list[tuple[str, Layout]] = []
    for z in range(lay.zero + 1, 4):
        trials.append((f"zero={z}", lay.with_(zero=z)))
    order = lay.recipe.recompute_order()
    for i, rc in enumerate(order):
        if lay.recompute in order and i > order.index(lay.recompute):
            trials.append((f"recompute={rc}", lay.with_(recompute=rc)))
    if lay.tp > 1 and not lay.sp:
        trials.append(("sp", lay.with_(sp=True)))
    if lay.micro_batch > 1:
        trials.append((f"micro_batch={lay.micro_batch // 2}", lay.with_(micro_batch=lay.micro_batch // 2)))
    if lay.dp % 2 == 0:
        trials.append((f"tp={2 * lay.tp}", lay.with_(tp=2 * lay.tp, dp=lay.dp // 2, sp=lay.sp or lay.tp == 1)))
        trials.append((f"pp={2 * lay.pp}", lay.with_(pp=2 * lay.pp, dp=lay.dp // 2)))
        trials.append((f"cp={2 * lay.cp}", lay.with_(cp=2 * lay.cp, dp=lay.dp // 2)))
    out = []
    for label, t in trials:
        if problems(w, t, gpu, gpus):
            continue
        need = memory_per_gpu(w, t, gpu).total
        if need <= budget:
            out.append(f"{label} ({need / GiB:.1f} GiB)")
    return out
