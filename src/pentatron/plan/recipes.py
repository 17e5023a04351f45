"""Recipes: how a framework runs a given parallel layout, as far as time and memory are concerned.

The planner's layout is a `ParallelLayout` (the degrees), our knobs (recompute, precision, attention,
kernels) and a `Recipe`. `pentatron` is what `pentatron train` runs; the other presets imitate another
framework's choices for the same layout (which gradient dtype it reduces, what its sequence-parallel
linears save, how its pipeline sends, ...) so that the planner can predict a run of that framework
(`pentatron plan --recipe torchtitan ...`). Only the pentatron recipe is ever recommended or emitted as
a training config: that one rule replaces a refusal per knob.

Fields are typed with `Literal` and checked by the config loader's own typed checker
(`pentatron.config.field_problems`), so a bad value reads like a bad config value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Literal

from pentatron.config import TrainConfig, compile_enabled, field_problems
from pentatron.kept_hash import compared_fields, kept_hash, state_without_kept_hash

Kernels = Literal["eager", "fused"]


@dataclass(frozen=True)
class Recipe:
    """A framework's implementation choices that change the predicted time or memory of a layout.
    Defaults are ours (what `pentatron train` does)."""

    name: str = "pentatron"
    # dtype of the gradient buffer that is accumulated and reduced: ours keeps fp32; Megatron-Core with
    # a bf16 grad reduce and FSDP with a bf16 reduce dtype keep bf16 (2 bytes/param less); "fp16": the same
    # 2 bytes in fp16 (Megatron-LM --fp16 without --accumulate-allreduce-grads-in-fp32, DeepSpeed's fp16
    # engine: the .grad itself is reduced); "bf16+fp32": a bf16 copy of the gradients beside the fp32
    # accumulation that is reduced (2 bytes/param more: DeepSpeed's BF16_Optimizer keeps the .grad; torch
    # DDP under nanotron's fp32 accumulation keeps its bucket, gradient_as_bucket_view=False)
    grad_precision: Literal["fp32", "bf16", "fp16", "bf16+fp32"] = "fp32"
    # ZeRO-3's parameter shard: "both" (ours, DeepSpeed: a low-precision shard beside the fp32 master
    # shard) or "fp32" (FSDP2 with a bf16 param_dtype: the fp32 shard only, cast as it is all-gathered)
    param_shard: Literal["both", "fp32"] = "both"
    # Under SP, what the column-parallel linears (q/k/v, gate/up) keep for backward: "gathered" (ours: the
    # all-gathered block input) or "sharded" (Megatron-LM/-Core, nanotron: the sequence shard, gathered
    # again in backward, overlapped with the input-gradient GEMM)
    sp_inputs: Literal["gathered", "sharded"] = "gathered"
    # What attention keeps of the q/k/v projection: "separate" (ours, Megatron, torchtitan) or "packed"
    # (nanotron's Llama without GQA, models/llama.py L471 and L655-657 at 67c5ebb6a9: a packed q|k|v copy
    # whose q view FlashAttention keeps beside the contiguous k|v copy, 2 kv widths more per token)
    qkv_saved: Literal["separate", "packed"] = "separate"
    # the loss: "eager" (log-softmax in fp32, as training; under tp our vocab-parallel loss), "fused"
    # (flash-attn's cross-entropy kernel, llm-foundry's default, or a compiled loss: the low-precision
    # logits and a per-token logsumexp only), "loss_parallel" (torch's DTensor loss over the tp mesh,
    # torchtitan's at tp > 1: decomposed fp32 ops) or "nanotron" (its sharded loss on logits cast to fp32
    # first, keeping one shifted fp32 copy)
    cross_entropy: Literal["eager", "fused", "loss_parallel", "nanotron", "chunked"] = "eager"
    # rows per chunk of the "chunked" loss (ours: train.loss_chunk_tokens; its last chunk is kept, the
    # others' head GEMM replays in backward)
    loss_chunk_tokens: int = TrainConfig.loss_chunk_tokens
    # the stage output of each in-flight micro-batch until its backward: "kept" (our engine's
    # state.output, DeepSpeed's pipe buffers) or "freed" once sent (Megatron's deallocate_pipeline_outputs)
    pp_outputs: Literal["kept", "freed"] = "kept"
    # pipeline receive buffers: "per_message" (ours, Megatron: one per receive, held while needed) or
    # "per_microbatch" (torch.distributed.pipelining, torchtitan: an activation buffer per micro-batch on
    # every non-first stage and a gradient buffer per micro-batch on every non-last stage, kept;
    # measured: research/torch_pp_memory.py)
    pp_buffers: Literal["per_message", "per_microbatch"] = "per_message"
    # Under SP, each all-gather pipelined with the column-parallel GEMM it feeds and each reduce-scatter
    # with the row-parallel GEMM it follows (Transformer Engine's userbuffers, Megatron-Core
    # --tp-comm-overlap): only what exceeds its GEMM, and one of its tp chunks, is exposed
    tp_overlap: bool = False
    # Data-parallel traffic behind compute (ours, DDP/FSDP, Megatron). False: one blocking reduction after
    # the last backward and a blocking gather after the optimizer (nanotron's ZeRO-1, DeepSpeed's pipe)
    dp_overlap: bool = True
    # ZeRO-3's parameter traffic: "prefetch" (ours, FSDP: one collective per layer, the next layer's gather
    # behind this one's compute) or "per_param_sync" (DeepSpeed's ZeRO-3 of 2021, 0.3.13-0.5.0, read at v0.3.15:
    # stage3.py fetch_sub_module and partition_parameters.py _allgather_param/_reduce_scatter_gradient): one collective
    # per parameter tensor; each gather is launched after torch.cuda.synchronize() and waited with another
    # before the module runs, so none overlaps compute; each all-gather and reduce-scatter passes a list of
    # group-size tensors, which torch's ProcessGroupNCCL copies to or from its flat buffer one kernel each
    zero3_fetch: Literal["prefetch", "per_param_sync"] = "prefetch"
    # ZeRO-1's gradient collective: "reduce_scatter" or "all_reduce" (every rank receives all of it and
    # keeps its shard: nanotron, DeepSpeed's pipeline engine)
    zero1_reduce: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"
    # ZeRO-1's gather of the updated parameters: "in_place" (ours, Megatron) or "copies" (nanotron's
    # all_gather_coalesced: 2 + 1/dp transient copies of the parameters at the optimizer step)
    zero1_gather: Literal["in_place", "copies"] = "in_place"
    # pipeline sends and receives: "async" (ours, Megatron-Core, torch.distributed.pipelining) or
    # "blocking" (DeepSpeed's pipeline engine, nanotron, Megatron-LM before Megatron-Core)
    pp_p2p: Literal["async", "blocking"] = "async"
    # Without SP each tp rank holds the whole stage output: send it whole (ours), or 1/tp of it from each
    # rank, all-gathered by the receivers (Megatron-LM's scatter_gather_tensors_in_pipeline, DeepSpeed)
    pp_scatter_gather: bool = False
    # Interleaved with as many micro-batches as ranks: every forward first (ours, Megatron-LM), or the
    # counted warm-up 2(pp-1-r) + (v-1)pp as ever (torch.distributed.pipelining, torchtitan)
    pp_all_warmup: bool = True
    # Ring attention's K/V exchange: "p2p" (ours: blocks passed rank to rank) or "allgather" (torch's
    # context_parallel, Llama 3: all of K/V gathered per call, dK/dV passed in fp32), and which heads
    # travel: "kv" (ours) or "q" (torchtitan expands K/V to the query heads before attention)
    cp_rotate: Literal["p2p", "allgather"] = "p2p"
    cp_kv_heads: Literal["kv", "q"] = "kv"
    # Norms keep only their low-precision input ("fused": flash-attn/Triton RMSNorm) or, None, what
    # PyTorch's ops keep (ours)
    norm: Literal["fused"] | None = None
    # what "selective" recompute means: ours/Megatron's (attention core) or torchtitan's op-level SAC
    selective: Literal["selective", "selective-op"] = "selective"
    # the elementwise kernels this framework runs by default ("fused": torch.compile / Megatron kernels;
    # "eager": one PyTorch op each); None: what `pentatron train` runs by default (`training_kernels`).
    # A default only: `--kernels` chooses, and either value of ours is trainable (train.compile).
    kernels: Kernels | None = None
    # What fused kernels cover: "blocks" (ours: train.compile compiles each decoder block's compute; the loss,
    # the embedding's backward, the gradient accumulation into the fp32 buffer and the tied-gradient exchange
    # stay eager ops) or "everywhere" (Megatron/TE's fused wgrad accumulation, fused loss and embedding kernels)
    fused_scope: Literal["blocks", "everywhere"] = "blocks"
    # Tensor parallelism of an MoE layer (router, routed and shared experts): "sharded" over tp like a
    # dense MLP (Megatron-Core's expert tensor parallelism = tp, the other presets) or "replicated" (ours,
    # parallel/moe_tokens.py: whole on every tp rank, experts split over ep only)
    moe_tp: Literal["sharded", "replicated"] = "sharded"

    def __hash__(self) -> int:  # each memoised planner term hashes the layout's recipe: its fields' hash, kept
        return kept_hash(self, compared_fields)

    __getstate__ = state_without_kept_hash

    def problems(self) -> list[str]:
        """Each field checked against its type by the config loader's checker."""
        out = [p for f in dataclasses.fields(self) if f.name != "name"
               for p in field_problems(Recipe, f.name, getattr(self, f.name), f"recipe.{f.name}")]
        if not out and self.loss_chunk_tokens < 1:
            out.append(f"recipe.loss_chunk_tokens must be ≥ 1 (rows per chunk of the chunked loss; the loss from "
                       f"full logits is cross_entropy='eager'), got {self.loss_chunk_tokens}")
        return out

    def recompute_mode(self, mode: str) -> str:
        """The planner's recompute mode for a requested one: "selective" is this recipe's selective."""
        return self.selective if mode == "selective" else mode

    def recompute_order(self) -> tuple[str, ...]:
        """Recompute modes from lightest to heaviest, as the search tries them."""
        return ("none", self.selective, "full")

    def overrides(self) -> dict[str, Any]:
        """Fields that differ from this recipe's preset (what `--recipe-set` changed)."""
        base = RECIPES.get(self.name, PENTATRON)
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(base, f.name)}


RECIPE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Recipe) if f.name != "name")



def training_loss(loss_chunk_tokens: int) -> str:
    """train.loss_chunk_tokens -> the planner's loss: LM head + loss in chunks (models/loss.py), or 0: the
    loss from full fp32 logits."""
    return "chunked" if loss_chunk_tokens > 0 else "eager"


TRAINING_LOSSES = ("chunked", "eager")  # the two losses `pentatron train` runs (train.loss_chunk_tokens > 0, 0)


def loss_chunk_tokens_of(recipe: Recipe) -> int:
    """The train.loss_chunk_tokens that runs the recipe's loss: its chunk for "chunked", else 0 (full logits)."""
    return recipe.loss_chunk_tokens if recipe.cross_entropy == "chunked" else 0


# ours: the loss `pentatron train` runs by default (TrainConfig's loss_chunk_tokens)
PENTATRON = Recipe(cross_entropy=training_loss(TrainConfig.loss_chunk_tokens), moe_tp="replicated")


def training_recipe(loss_chunk_tokens: int) -> Recipe:
    """Ours with a run's train.loss_chunk_tokens (the run report's recipe)."""
    chunk = loss_chunk_tokens if loss_chunk_tokens > 0 else PENTATRON.loss_chunk_tokens  # unread when eager
    return replace(PENTATRON, cross_entropy=training_loss(loss_chunk_tokens), loss_chunk_tokens=chunk)


# Megatron-Core with Transformer Engine (fused kernels): SP linears keep the sequence shard, stage
# outputs freed once sent. Older Megatron-LM (blocking p2p, scatter-gather) and --tp-comm-overlap are
# overrides (`--recipe-set pp_p2p=blocking`, `tp_overlap=true`).
MEGATRON = Recipe(name="megatron", sp_inputs="sharded", pp_outputs="freed", kernels="fused", fused_scope="everywhere")
# nanotron (the Ultra-Scale Playbook's runs): FlashAttention-2, eager PyTorch ops, Triton RMSNorm; packed
# q|k|v, its sharded loss on fp32 logits, blocking pipeline p2p, ZeRO-1 by all-reduce into copies.
NANOTRON = Recipe(name="nanotron", sp_inputs="sharded", qkv_saved="packed", cross_entropy="nanotron",
                  pp_p2p="blocking", zero1_reduce="all_reduce", zero1_gather="copies", norm="fused",
                  kernels="eager", fused_scope="everywhere")
# torchtitan: FSDP2 (fp32 shard only), torch.distributed.pipelining's buffers and warm-up, torch's
# context_parallel (all-gathered K/V expanded to the query heads), op-level SAC for "selective",
# torch.compile. Its loss_parallel at tp > 1 is `--cross-entropy loss_parallel`.
TORCHTITAN = Recipe(name="torchtitan", param_shard="fp32", pp_buffers="per_microbatch", pp_all_warmup=False,
                    cp_rotate="allgather", cp_kv_heads="q", selective="selective-op", kernels="fused",
                    fused_scope="everywhere")
# Megatron-DeepSpeed of 2021-22 (MT-NLG, BLOOM): its pipeline engine's blocking p2p, stage outputs partitioned
# over the tp ranks, the gradients all-reduced after the last backward; ZeRO-3 as DeepSpeed ran it in 2021.
DEEPSPEED = Recipe(name="deepspeed", pp_p2p="blocking", pp_scatter_gather=True, dp_overlap=False,
                   zero1_reduce="all_reduce", zero3_fetch="per_param_sync", kernels="fused",
                   fused_scope="everywhere")
# llm-foundry (MPT): eager PyTorch ops, low-precision LayerNorm, flash-attn's fused cross-entropy.
LLM_FOUNDRY = Recipe(name="llm-foundry", cross_entropy="fused", norm="fused", kernels="eager",
                     fused_scope="everywhere")

RECIPES: dict[str, Recipe] = {r.name: r for r in (PENTATRON, MEGATRON, NANOTRON, TORCHTITAN, DEEPSPEED, LLM_FOUNDRY)}


class RecipeError(ValueError):
    """An unknown recipe or a bad override (the message names it)."""


def get_recipe(name: str, overrides: dict[str, Any] | None = None) -> Recipe:
    """A preset by name, with fields overridden (checked by the config's typed checker)."""
    if name not in RECIPES:
        raise RecipeError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}")
    over = dict(overrides or {})
    unknown = sorted(set(over) - set(RECIPE_FIELDS))
    if unknown:
        raise RecipeError(f"unknown recipe field(s) {', '.join(unknown)}; known: {', '.join(RECIPE_FIELDS)}")
    recipe = replace(RECIPES[name], **over)
    probs = recipe.problems()
    if probs:
        raise RecipeError("; ".join(probs))
    return recipe


def not_ours(recipe: Recipe) -> str | None:
    """Why a layout under `recipe` is not what `pentatron train` runs (None when it is): the one rule
    that keeps other frameworks' recipes evaluated, never recommended or emitted."""
    if recipe == PENTATRON:
        return None
    if (recipe.cross_entropy in TRAINING_LOSSES  # either loss, any chunk: train.loss_chunk_tokens runs it
            and replace(recipe, cross_entropy=PENTATRON.cross_entropy, loss_chunk_tokens=PENTATRON.loss_chunk_tokens)
            == PENTATRON):
        return None
    if recipe.name == PENTATRON.name:
        changed = ", ".join(f"{k}={v!r}" for k, v in recipe.overrides().items())
        return f"the pentatron recipe with {changed} changed is evaluated, not what `pentatron train` runs"
    return (f"recipe {recipe.name!r} predicts a {recipe.name} run; `pentatron train` runs the pentatron "
            "recipe (evaluated, never emitted as a training config)")


# ---------------------------------------------------------------- defaults shared with training
def training_default(name: str) -> Any:
    """The default of `train.<name>` as `pentatron train` reads it (TrainConfig's field, looked up at
    call time so the planner cannot drift from it)."""
    f = {f.name: f for f in dataclasses.fields(TrainConfig)}[name]
    return f.default


def kernels_for_compile(compile_: bool | str, device_type: str = "cuda") -> str:
    """train.compile on a device type -> the planner's kernels: compiled blocks fuse their elementwise
    chains. The planner's devices are GPUs unless told "cpu" (a CPU run's report, preflight)."""
    return "fused" if compile_enabled(compile_, device_type) else "eager"


def compile_for_kernels(kernels: str) -> bool:
    """The planner's kernels -> the train.compile value that runs them."""
    return kernels == "fused"


def training_kernels(device_type: str = "cuda") -> str:
    """The kernels `pentatron train` runs by default on that device type (its train.compile default)."""
    return kernels_for_compile(training_default("compile"), device_type)


# `pentatron train`'s loss is the chunked LM head + fp32 cross-entropy (vocab-parallel under tp; PENTATRON's
# cross_entropy above) and its attention is torch SDPA, whichever kernel SDPA picks on the GPU ("sdpa":
# `Efficiency.sdpa_kernel`, cuDNN on Hopper, FlashAttention-2 before it; not a config knob: the layout's
# attention default below); the optimizer (AdamW over fp32 masters) is the one the time model
# costs (plan/timing.py OPTIMIZER_BYTES_PER_PARAM).
TRAINING_ATTENTION = "sdpa"


def resolve_kernels(recipe: Recipe, kernels: str | None = None, device_type: str = "cuda") -> str:
    """`kernels` if given, else the recipe's default (ours: the training default on that device type)."""
    if kernels is not None:
        return kernels
    return recipe.kernels if recipe.kernels is not None else training_kernels(device_type)
