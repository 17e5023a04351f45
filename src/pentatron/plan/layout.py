"""What the planner plans: a workload (model, sequence, batch) and a layout (mesh + training knobs).

Rank order follows `distributed/context.py`: mesh dims ("pp", "dp", "cp", "tp") outermost first, so
a tensor-parallel group is consecutive ranks (one node) and pipeline neighbours are dp*cp*tp apart.
Expert parallelism borrows its ranks from dp x cp.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import cached_property, lru_cache
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Literal

from pentatron.hardware.catalogue import GPUSpec
from pentatron.kept_hash import kept_hash, state_without_kept_hash
from pentatron.layout import ParallelLayout, tensor_parallel_problems
from pentatron.models.config import ModelConfig
from pentatron.plan.flops import DocumentLengths, MoESpec, Recompute, moe_of
from pentatron.plan.recipes import PENTATRON, TRAINING_ATTENTION, Recipe, not_ours

# Our knobs are typed on `Layout` and the recipe's on `Recipe`: both are checked by the config loader's
# typed checker (`pentatron.config.field_problems`). Precisions: fp16 runs like bf16 (same tensor-core
# peak on A100/H100) plus dynamic loss scaling (one extra pass over the gradients for the inf/nan check,
# modelled with the optimizer); fp8: Transformer-Engine style GEMMs, scaled per tensor (TE's delayed
# scaling, torchao's default) or per row (torchao's "rowwise": its CUTLASS GEMM, hardware/fp8_rowwise.py).
# Attention kernels: FlashAttention-2 (what torch SDPA runs), FlashAttention-3 (Hopper), cuDNN fused
# attention, or the unfused math path (scores materialised: Megatron before 2022, BLOOM).
KNOBS: tuple[str, ...] = ("recompute", "precision", "fp8_scaling", "attention")


_WORKLOAD_FIELDS = attrgetter("cfg", "seq_len", "global_batch", "moe", "documents")  # its compared fields, in order


@dataclass(frozen=True)
class Workload:
    cfg: ModelConfig
    seq_len: int
    global_batch: int  # sequences per optimizer step
    moe: MoESpec | None = None
    # packed documents under document masking: attention's FLOPs and time follow their lengths (None: each
    # sample is one sequence, attention over the whole of it)
    documents: DocumentLengths | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch

    @cached_property
    def moe_spec(self) -> MoESpec | None:
        """Computed once (a plain attribute after the first read): the search reads it ~10^5 times, and
        for an MoE model `moe_of` builds a new spec each call."""
        return moe_of(self.cfg, self.moe)

    def __hash__(self) -> int:  # every memoised planner term takes the workload: its fields' hash, kept
        return kept_hash(self, _WORKLOAD_FIELDS)

    __getstate__ = state_without_kept_hash


_PARALLEL_FIELDS: tuple[str, ...] = ("dp", "tp", "pp", "cp", "ep", "zero", "sp", "pp_schedule", "pp_virtual",
                                     "zero3_gather", "cp_mode", "cp_ulysses", "micro_batch", "pp_layers", "dp_shard")


_DEGREES = attrgetter(*_PARALLEL_FIELDS)


@dataclass(frozen=True, init=False)
class Layout:
    """One layout the planner evaluates: the training side's `ParallelLayout` (held, the one holder of
    the degrees; its batch geometry comes from the `Workload`, see `parallel_layout`), our knobs, and
    the `Recipe` that runs it (`plan/recipes.py`: ours by default, or another framework's).

    `Layout(dp=8, zero=1, recompute="full")` builds the held `ParallelLayout` from its field names;
    `dataclasses.replace(lay, tp=2)` and `lay.with_(tp=2)` work the same way. The degrees read through
    (`lay.dp` is `lay.par.dp`: a copy set at construction, not a field, so equality, hashing, `replace` and
    `asdict` see `par` alone); the recipe's fields are read from `lay.recipe`."""

    par: ParallelLayout
    # the planner's recompute mode: ours (train.recompute) or another recipe's (selective-op, full-alternate)
    recompute: Recompute
    precision: Literal["bf16", "fp32", "fp8", "fp16"]  # ours: train.precision's bf16 / fp32
    fp8_scaling: Literal["tensorwise", "rowwise"]  # with precision="fp8"
    attention: Literal["sdpa", "flash2", "flash3", "cudnn", "math"]  # ours: torch SDPA's pick on the GPU
    recipe: Recipe

    def __init__(self, par: ParallelLayout | None = None, recompute: str = "none", precision: str = "bf16",
                 fp8_scaling: str = "tensorwise", attention: str = TRAINING_ATTENTION, recipe: Recipe = PENTATRON,
                 **parallel: Any) -> None:
        if parallel:
            unknown = sorted(set(parallel) - set(_PARALLEL_FIELDS))
            if unknown:
                raise TypeError(f"Layout: unknown field(s) {', '.join(unknown)} (recipe fields go in recipe=...)")
            par = ParallelLayout(**parallel) if par is None else replace(par, **parallel)
        elif par is None:
            par = ParallelLayout()
        d = self.__dict__  # frozen: fields are written past __setattr__
        d["par"], d["recompute"], d["precision"], d["fp8_scaling"] = par, recompute, precision, fp8_scaling
        d["attention"], d["recipe"] = attention, recipe
        # The degrees as plain attributes: the search reads them ~10^6 times, and a property forwarding
        # to `par` costs twice a plain read. `par` is frozen, so the copies cannot go stale.
        d.update(zip(_PARALLEL_FIELDS, _DEGREES(par)))

    if TYPE_CHECKING:  # the copies of `par`'s fields set by __init__ (not dataclass fields)
        dp: int
        tp: int
        pp: int
        cp: int
        ep: int
        zero: int
        sp: bool
        pp_schedule: str
        pp_virtual: int
        zero3_gather: str
        cp_mode: str
        cp_ulysses: int
        micro_batch: int
        pp_layers: tuple[int, ...] | None
        dp_shard: int

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def zero_group(self) -> int:
        """The ranks ZeRO shards the dense model states over: dp × cp, or HSDP's shard group (dp_shard)."""
        return self.par.shard_degree * self.cp

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of the gradient buffer that is reduced: 2 for bf16/fp16 buffers, 4 for fp32
        and for "bf16+fp32" (the fp32 sum is reduced; the bf16 copy beside it is memory only)."""
        return 2 if self.recipe.grad_precision in ("bf16", "fp16") else 4

    def microbatches(self, w: Workload) -> int:
        """Micro-batches per step on each pipeline (gradient-accumulation steps)."""
        return w.global_batch // (self.dp * self.micro_batch)

    def short(self) -> str:
        s = f"dp{self.dp} tp{self.tp}{'+sp' if self.sp else ''} pp{self.pp} cp{self.cp}"
        if self.cp > 1:
            s += {"ulysses": ":uly", "hybrid": f":uly{self.cp_ulysses}xring"}.get(self.cp_mode, "")
        if self.ep > 1:
            s += f" ep{self.ep}"
        if self.pp > 1:
            s += f" {self.pp_schedule}" + (f"/v{self.pp_virtual}" if self.pp_schedule == "interleaved" else "")
        s += f" z{self.zero}" + (f"/hsdp{self.par.replicate_degree}x{self.dp_shard}" if self.par.hsdp else "")
        s += f" mb{self.micro_batch} rc:{self.recompute}"
        return s + (f" layers:{_run_length(self.pp_layers)}" if self.pp_layers is not None else "")

    def to_dict(self) -> dict[str, Any]:
        """Flat: the parallel fields, our knobs, the recipe's name and its fields."""
        recipe = asdict(self.recipe)
        return ({k: getattr(self, k) for k in _PARALLEL_FIELDS}
                | {k: getattr(self, k) for k in ("recompute", "precision", "fp8_scaling", "attention")}
                | {"recipe": recipe.pop("name")} | recipe)

    def with_(self, **kw: Any) -> Layout:
        return replace(self, **kw)

    def with_recipe(self, **kw: Any) -> Layout:
        """This layout under its recipe with some fields changed (`Recipe` field names)."""
        return replace(self, recipe=replace(self.recipe, **kw))


def kv_heads_per_tp_rank(cfg: ModelConfig, tp: int) -> int:
    """KV heads each TP rank holds: n_kv/tp, or 1 (replicated) when tp > n_kv (Megatron's GQA rule)."""
    return max(1, cfg.n_kv_heads // tp)


def parallel_layout(w: Workload, lay: Layout) -> ParallelLayout:
    """The training side's layout for this plan, the one `pentatron train` would validate: the held
    `ParallelLayout` with the workload's batch geometry."""
    return replace(lay.par, global_batch=w.global_batch, seq_len=w.seq_len)


@lru_cache(maxsize=16384)
def _training_rules(pl: ParallelLayout, cfg: ModelConfig, gpus: int | None) -> tuple[str, ...]:
    """`ParallelLayout.problems`, memoised: it builds the pipeline schedule to validate it, which is
    the dominant cost of checking a layout (the search asks for the same one several times)."""
    return tuple(pl.problems(cfg, gpus))


def quick_problems(w: Workload, lay: Layout, gpu: GPUSpec, gpus: int | None = None) -> list[str]:
    """The cheap part of `problems` for the search's inner loop: the planner's knobs, the degrees and
    batch arithmetic, and the tensor-parallel split, without building the pipeline schedule. The search
    runs the full `problems` (and `trainable_problems`) on the candidates it ranks."""
    return knob_problems(w, lay, gpu) + quick_parallel_problems(w, lay.par, gpus)


def quick_parallel_problems(w: Workload, par: ParallelLayout, gpus: int | None = None) -> list[str]:
    """The part of `quick_problems` that depends on the held `ParallelLayout` alone (the degrees, the batch
    arithmetic, the tensor-parallel split): the search checks it once for all knob variants of a layout."""
    pl = replace(par, global_batch=w.global_batch, seq_len=w.seq_len)  # = parallel_layout
    return list(_training_rules(pl, None, gpus)) + list(_tp_problems(w.cfg, par.tp, par.sp, w.seq_len))


@lru_cache(maxsize=1024)
def _tp_problems(cfg: ModelConfig, tp: int, sp: bool, seq_len: int) -> tuple[str, ...]:
    return tuple(tensor_parallel_problems(cfg, tp, sp, seq_len))


def knob_problems(w: Workload, lay: Layout, gpu: GPUSpec) -> list[str]:
    """Planner inputs the training layout does not know: our knobs and the recipe (each value by the
    config's typed checker), the combinations the model evaluates, and MoE."""
    out = list(_value_problems(lay.recompute, lay.precision, lay.fp8_scaling, lay.attention, lay.recipe))
    if out:
        return out
    rc, moe = lay.recipe, w.moe_spec
    if lay.precision != "fp32" and _dtype_key(lay.precision) not in gpu.peak_flops:
        out.append(f"--precision {lay.precision}: {gpu.name} has no {lay.precision} tensor cores")
    if lay.fp8_scaling == "rowwise" and lay.precision != "fp8":
        out.append(f"--fp8-scaling rowwise applies to --precision fp8, not {lay.precision}")
    elif lay.fp8_scaling == "rowwise" and gpu.fp8_rowwise is None:
        out.append(f"--fp8-scaling rowwise: no row-wise FP8 measurement for {gpu.name} (H100 and H200 have one); "
                   "use --fp8-scaling tensorwise")
    if rc.cross_entropy == "loss_parallel" and lay.tp == 1:
        out.append("recipe.cross_entropy='loss_parallel' splits the loss over the tp ranks' vocabulary slices; "
                   "with tp=1 use 'eager'")
    if rc.tp_overlap and not (lay.sp and lay.tp > 1):
        out.append("recipe.tp_overlap pipelines the sequence-parallel all-gathers and reduce-scatters with their "
                   "GEMMs: it needs tp > 1 with sp")
    if not rc.dp_overlap and lay.zero == 3 and rc.zero3_fetch == "prefetch":
        out.append("recipe.dp_overlap=false is modelled for ZeRO 0-2; ZeRO-3's overlap is recipe.zero3_fetch: "
                   "'prefetch' (ours, FSDP) gathers layer by layer behind compute, so set dp_overlap=true, or "
                   "zero3_fetch='per_param_sync' for DeepSpeed's ZeRO-3 of 2021 (0.3.13-0.5.0), which waits for "
                   "every gather")
    if rc.cp_rotate == "allgather" and lay.cp > 1 and lay.cp_mode != "ring":
        out.append("recipe.cp_rotate='allgather' is torch's ring attention: it needs cp_mode='ring'")
    if lay.ep > 1 and moe is None:
        out.append(f"ep={lay.ep} needs a mixture-of-experts model")
    if moe is not None and moe.num_experts % lay.ep:
        out.append(f"ep={lay.ep} does not divide the {moe.num_experts} experts")
    if moe is not None and lay.tp > 0 and moe.expert_ffn_hidden_size % lay.tp:
        out.append(f"tp={lay.tp} does not divide the expert MLP width {moe.expert_ffn_hidden_size}")
    return out


@lru_cache(maxsize=256)
def _value_problems(recompute: str, precision: str, fp8_scaling: str, attention: str,
                    recipe: Recipe) -> tuple[str, ...]:
    """Our knobs' and the recipe's values by the config's typed checker (memoised: the search asks for
    the same few combinations for every layout)."""
    from pentatron.config import field_problems

    values = {"recompute": recompute, "precision": precision, "fp8_scaling": fp8_scaling, "attention": attention}
    out = [p for k, v in values.items() for p in field_problems(Layout, k, v, f"--{k.replace('_', '-')}")]
    return (*out, *recipe.problems())


def problems(w: Workload, lay: Layout, gpu: GPUSpec, gpus: int | None = None) -> list[str]:
    """Every reason the planner cannot evaluate this layout (empty when it can): the training rules
    (`ParallelLayout.problems`, the one validator config, runtime and planner share) plus the planner's
    own inputs. Interleaved chunks that do not divide the layers evenly are evaluated (the planner
    spreads the remainder, as `parallel.pp_layers` lets training do); what is merely slow or not yet
    trainable is in `warnings` and `trainable_problems`, not here."""
    out = knob_problems(w, lay, gpu)
    pl = parallel_layout(w, lay)
    found = list(_training_rules(pl, w.cfg, gpus))
    if lay.pp_layers is not None or (pl.virtual > 1 and pl.n_stages <= w.cfg.n_layers
                                     and w.cfg.n_layers % pl.n_stages):
        # the pipeline rules again, for the split the planner evaluates: the explicit one (a chunk may
        # hold no layer) or the remainder spread over the interleaved chunks
        found = _with_split(found, pl, w.cfg, chunk_layers(w, lay))
    return out + found


def _run_length(counts: tuple[int, ...]) -> str:
    """(0, 1, 1, 1, 0) -> '0,1x3,0'."""
    runs: list[list[int]] = []
    for c in counts:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return ",".join(f"{c}x{n}" if n > 1 else str(c) for c, n in runs)


def _with_split(found: list[str], pl: ParallelLayout, cfg: ModelConfig, layers: tuple[int, ...]) -> list[str]:
    """`found` (the training rules) with the pipeline problems of training's split replaced by those of
    the split the planner evaluates, `layers`, where a chunk may hold no layer (only the embedding or
    only the head: evaluated, not trainable)."""
    default = set(pl.pipeline_problems(cfg))
    return [x for x in found if x not in default] + pl.pipeline_problems(cfg, layers=layers, min_layers=0)


def trainable_problems(w: Workload, lay: Layout, gpus: int | None = None) -> list[str]:
    """Why `pentatron train` would refuse this layout today (empty when it accepts it): the training
    config's own validation (`ParallelLayout.problems`), the one recipe rule (only
    ours is trained: `recipes.not_ours`), and our knobs' values checked by the config's typed checker
    against the `train` fields they set. The one place the planner asks "can we train this?"; the
    search recommends only layouts for which it is empty."""
    from pentatron.config import TrainConfig, field_problems, fp8_problems

    pl = parallel_layout(w, lay)
    out = [*_training_rules(pl, w.cfg, gpus)]
    why = not_ours(lay.recipe)
    if why:  # another framework's run: that is the one reason (its knob values are its own)
        out.append(why)
    else:
        for knob in ("precision", "recompute"):  # the train fields our knobs set
            if knob == "precision" and lay.precision == "fp8":  # trained as bf16 weights + train.fp8 = scaling
                out += fp8_problems(TrainConfig(seq_len=w.seq_len, micro_batch=lay.micro_batch, fp8=lay.fp8_scaling,
                                                compile=False), w.cfg, pl)
                continue
            out += [f"{p} (`pentatron train` has no {getattr(lay, knob)!r})"
                    for p in field_problems(TrainConfig, knob, getattr(lay, knob), f"train.{knob}")]
    if w.moe_spec is not None and w.cfg.moe is None:
        out.append("an MoE shape given by --experts/--top-k is no model config training can build (use an MoE "
                   "registry model, or set the [moe] fields of the training config)")
    return out


def warnings(w: Workload, lay: Layout, gpu: GPUSpec) -> list[str]:
    """Layouts real runs use that are valid but slow or unusual: said, not refused."""
    out = parallel_layout(w, lay).warnings(gpu.gpus_per_node)
    m = lay.microbatches(w) if lay.dp * lay.micro_batch else 0
    if lay.pp > 1 and 0 < m < lay.pp:
        out.append(f"{m} micro-batches < pp={lay.pp}: the pipeline never fills (bubble >= "
                   f"{(lay.pp - 1) / (m + lay.pp - 1):.0%} of its time)")
    if (lay.pp_layers is None and lay.pp_virtual > 1 and lay.pp * lay.pp_virtual <= w.cfg.n_layers
            and w.cfg.n_layers % (lay.pp * lay.pp_virtual)):
        out.append(f"interleaved chunks hold unequal layer counts ({w.cfg.n_layers} layers over "
                   f"{lay.pp * lay.pp_virtual} chunks): training runs this split with parallel.pp_layers = "
                   f"{list(chunk_layers(w, lay))}")
    if lay.cp > 1 and lay.cp_mode == "hybrid" and lay.tp * lay.cp_ulysses > gpu.gpus_per_node:
        out.append(f"cp_ulysses={lay.cp_ulysses} × tp={lay.tp} ranks exceed a node ({gpu.gpus_per_node}): the "
                   "Ulysses all-to-alls cross the inter-node network")
    if lay.zero == 3 and lay.pp > 1 and lay.zero3_gather == "micro_batch":
        out.append(f"zero=3 with pp={lay.pp} re-gathers each stage's parameters for every micro-batch "
                   f"({2 * max(1, m)} gathers per step); zero3_gather='step' keeps them gathered")
    return out


def _dtype_key(precision: str) -> str:
    return {"fp32": "tf32"}.get(precision, precision)


def compute_dtype(precision: str) -> str:
    """Which peak the matmuls run at: fp32 training uses TF32 tensor cores."""
    return _dtype_key(precision)


def chunk_layers(w: Workload, lay: Layout) -> tuple[int, ...]:
    """Decoder layers of each pipeline chunk (global stage order): the layout's explicit split, or the
    engine's default."""
    if lay.pp_layers is not None:
        return lay.pp_layers
    return layers_per_chunk(w.cfg, w.seq_len, lay.pp, lay.pp_virtual)


@lru_cache(maxsize=1024)
def layers_per_chunk(cfg: ModelConfig, seq_len: int, pp: int, v: int = 1) -> tuple[int, ...]:
    """Decoder layers of each pipeline chunk (global stage order), exactly as the pipeline engine will
    partition them (`parallel/pipeline/stages.py`): equal chunks for interleaving, otherwise balanced by
    its cost estimate, in which the embedding and the LM head count like layers."""
    chunks = pp * v
    if chunks <= 1:
        return (cfg.n_layers,)
    if v > 1 or cfg.n_layers < chunks:
        base, extra = divmod(cfg.n_layers, chunks)  # interleaved: equal chunks, the remainder spread
        return tuple(base + (1 if i < extra else 0) for i in range(chunks))
    # the engine's own partition (torch-free, as the planner must start fast)
    from pentatron.parallel.pipeline.partition import StageCosts, partition

    return tuple(len(r) for r in partition(cfg.n_layers, chunks, costs=StageCosts.of(cfg, seq_len)))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def nodes_spanned(size: int, stride: int, gpus_per_node: int) -> tuple[int, int]:
    """(ranks per node, nodes) for a group of `size` ranks `stride` apart in the global rank order."""
    if size <= 1:
        return 1, 1
    per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
    return per_node, math.ceil(size / per_node)
