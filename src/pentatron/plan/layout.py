"""What the planner plans: a workload (model, sequence, batch) and a layout (mesh + training knobs).

Rank order follows `distributed/context.py`: mesh dims ("pp", "dp", "cp", "tp") outermost first, so
a tensor-parallel group is consecutive ranks (one node) and pipeline neighbours are dp*cp*tp apart.
Expert parallelism borrows its ranks from dp x cp.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Any

from pentatron.layout import ParallelLayout, tensor_parallel_problems
from pentatron.models.config import ModelConfig
from pentatron.plan.flops import RECOMPUTE_MODES, TRAINABLE_RECOMPUTE, MoESpec, moe_of
from pentatron.plan.hardware import GPUSpec

# fp16 runs like bf16 (same tensor-core peak on A100/H100) plus dynamic loss scaling (one extra pass over
# the gradients for the inf/nan check, modelled with the optimizer); fp8: Transformer-Engine style GEMMs.
PRECISIONS: tuple[str, ...] = ("bf16", "fp32", "fp8", "fp16")
# attention kernels: FlashAttention-2 (what torch SDPA runs), FlashAttention-3 (Hopper), cuDNN fused
# attention, or the unfused math path (scores materialised: Megatron before 2022, BLOOM).
ATTENTION_KERNELS: tuple[str, ...] = ("flash2", "flash3", "cudnn", "math")
TRAIN_PRECISIONS: tuple[str, ...] = ("bf16", "fp32")  # train.precision (besides "auto")
PP_SCHEDULES: tuple[str, ...] = ("afab", "1f1b", "interleaved", "zb")
SP_INPUTS: tuple[str, ...] = ("gathered", "sharded")
GRAD_PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "bf16+fp32")
# the loss: "eager" (fp32 PyTorch ops: F.cross_entropy, or under TP our vocab-parallel loss), "fused"
# (flash-attn's kernel), "loss_parallel" (torch's DTensor loss_parallel over the tp mesh: torchtitan at tp > 1)
# or "nanotron" (its sharded cross-entropy on logits cast to fp32 first, at any tp)
CROSS_ENTROPY: tuple[str, ...] = ("eager", "fused", "loss_parallel", "nanotron")
# fp8 scaling: one scale per tensor (Transformer Engine's delayed scaling, torchao's default recipe) or per
# row (torchao's "rowwise": its own CUTLASS GEMM, costed from a measured table in plan/fp8_rowwise.py)
FP8_SCALINGS: tuple[str, ...] = ("tensorwise", "rowwise")


@dataclass(frozen=True)
class Workload:
    cfg: ModelConfig
    seq_len: int
    global_batch: int  # sequences per optimizer step
    moe: MoESpec | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch

    @property
    def moe_spec(self) -> MoESpec | None:
        return moe_of(self.cfg, self.moe)


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sp: bool = False
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    precision: str = "bf16"
    fp8_scaling: str = "tensorwise"  # with precision="fp8": FP8_SCALINGS
    attention: str = "flash2"
    # dtype of the gradient buffer that is accumulated and reduced: our trainer keeps fp32; Megatron's
    # default distributed optimizer and FSDP with a bf16 reduce dtype keep bf16 (2 bytes/param less);
    # "fp16": the same 2 bytes in fp16 (Megatron-LM with --fp16 and without
    # --accumulate-allreduce-grads-in-fp32, DeepSpeed's fp16 engine: the .grad itself is reduced);
    # "bf16+fp32": a bf16 copy of the gradients is kept beside the fp32 accumulation that is reduced
    # (2 bytes/param more: the playbook's 20 bytes/param recipe): DeepSpeed's BF16_Optimizer keeps the
    # .grad (clear_lp_grads=False); torch DDP under nanotron's fp32 accumulation keeps its bucket
    # (gradient_as_bucket_view=False, the default: "the saved memory size will be equal to the total
    # gradients size" when it is True)
    grad_precision: str = "fp32"
    zero3_gather: str = "micro_batch"  # ZeRO-3 with pp: re-gather per micro-batch, or once per "step"
    # ZeRO-3's parameter shard: "both" (ours, DeepSpeed: a low-precision shard beside the fp32 master shard)
    # or "fp32" (FSDP2 with a bf16 param_dtype: the fp32 shard only, cast as it is all-gathered)
    param_shard: str = "both"
    cp_mode: str = "ring"  # context parallelism: "ring" | "ulysses" | "hybrid" (plan/context.py)
    cp_ulysses: int = 1  # hybrid: the Ulysses degree inside a node (ring degree = cp // cp_ulysses)
    # Under SP, what the column-parallel linears (q/k/v, gate/up) keep for backward: "gathered" (ours:
    # the all-gathered block input) or "sharded" (Megatron-LM/-Core: the sequence shard, all-gathered
    # again in backward, overlapped with the input-gradient GEMM)
    sp_inputs: str = "gathered"
    # What attention keeps of the q/k/v projection: "separate" (q, k and v: ours, Megatron, torchtitan) or
    # "packed" (nanotron's Llama without GQA, models/llama.py L471 and L655-657 at 67c5ebb6a9: a packed
    # q|k|v copy whose q view FlashAttention keeps, so its k and v parts stay beside the contiguous k|v
    # copy attention reads, 2 kv widths more per token; with GQA nanotron copies q apart: no more)
    qkv_saved: str = "separate"
    # the loss: "eager" (log-softmax in fp32, as training), "fused" (flash-attn's cross-entropy kernel,
    # llm-foundry's default: keeps the low-precision logits and a per-token logsumexp only),
    # "loss_parallel" (torch's DTensor loss over the tp mesh, torchtitan's at tp > 1: decomposed fp32 ops)
    # or "nanotron" (its sharded loss on logits cast to fp32 first, keeping one shifted fp32 copy)
    cross_entropy: str = "eager"
    # the stage output of each in-flight micro-batch until its backward: "kept" (our engine's
    # state.output, DeepSpeed's pipe buffers) or "freed" once sent (Megatron's deallocate_pipeline_outputs)
    pp_outputs: str = "kept"
    # Pipeline receive buffers: "per_message" (ours, Megatron: one allocated per receive, held while it is
    # needed) or "per_microbatch" (torch.distributed.pipelining, torchtitan: an activation buffer per
    # micro-batch on every non-first stage and a gradient buffer per micro-batch on every non-last stage,
    # allocated at the first step and kept; measured: benchmarks/torch_pp_memory.py)
    pp_buffers: str = "per_message"
    # Under SP, each all-gather pipelined with the column-parallel GEMM it feeds and each reduce-scatter
    # with the row-parallel GEMM it follows, forward and backward (Transformer Engine's userbuffers:
    # Megatron-Core --tp-comm-overlap): only what exceeds its GEMM, and one of its tp chunks, is exposed
    tp_overlap: bool = False
    # Data-parallel traffic behind compute (ours, DDP/FSDP, Megatron): gradient buckets reduced during the
    # backward, ZeRO-1/2 parameter gathers behind the next forward. False: one blocking reduction after the
    # last backward and a blocking gather after the optimizer (nanotron's ZeRO-1)
    dp_overlap: bool = True
    # ZeRO-1's gradient collective: "reduce_scatter" (each rank receives its shard) or "all_reduce" (every
    # rank receives all of it and keeps its shard: nanotron, which avoids a second buffer)
    zero1_reduce: str = "reduce_scatter"
    # ZeRO-1's gather of the updated parameters after the optimizer: "in_place" (ours, Megatron: straight
    # into the persistent parameter buffer) or "copies" (nanotron: all_gather_coalesced flattens the local
    # shard and each rank's shard into buffers of their own, and torch's allgather gathers into a flat
    # output of its own: 2 + 1/dp transient copies of the parameters at the optimizer step)
    zero1_gather: str = "in_place"
    # pipeline sends and receives: "async" (ours, Megatron, torch.distributed.pipelining: isend/irecv, the
    # sender goes on computing) or "blocking" (DeepSpeed's pipeline engine, nanotron: the sender waits for
    # the transfer)
    pp_p2p: str = "async"
    # Without SP each tp rank holds the whole stage output: send it whole (ours), or each rank 1/tp of it,
    # all-gathered by the receivers over NVLink (Megatron-LM's scatter_gather_tensors_in_pipeline, on by
    # default since 2021; DeepSpeed's pipeline engine partitions the same way when model-parallel)
    pp_scatter_gather: bool = False
    # Interleaved with as many micro-batches as ranks (m == pp): every forward first (Megatron-LM, ours), or
    # False, the counted warm-up 2(pp-1-r) + (v-1)pp as ever (torch.distributed.pipelining's
    # ScheduleInterleaved1F1B, torchtitan): the later ranks then hold fewer micro-batches
    pp_all_warmup: bool = True
    # Ring attention's K/V exchange: "p2p" (ours: blocks passed rank to rank behind each block's attention)
    # or "allgather" (torch's context_parallel: all of K/V gathered per call, dK/dV passed in fp32), and which
    # heads travel: "kv" (ours) or "q" (torchtitan expands K/V to the query heads before attention)
    cp_rotate: str = "p2p"
    cp_kv_heads: str = "kv"
    # Decoder layers of each pipeline chunk in global stage order (training's parallel.pp_layers); None:
    # the engine's default split. 0 is evaluated: a chunk with only the embedding or only the LM head and
    # loss (Llama 3's balanced pipeline, sec. 3.3.2), which training cannot build
    pp_layers: tuple[int, ...] | None = None

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of the gradient buffer that is reduced: 2 for bf16/fp16 buffers, 4 for fp32
        and for "bf16+fp32" (the fp32 sum is reduced; the bf16 copy beside it is memory only)."""
        return 2 if self.grad_precision in ("bf16", "fp16") else 4

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
        s += f" z{self.zero} mb{self.micro_batch} rc:{self.recompute}"
        return s + (f" layers:{_run_length(self.pp_layers)}" if self.pp_layers is not None else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_(self, **kw: Any) -> Layout:
        return replace(self, **kw)


def kv_heads_per_tp_rank(cfg: ModelConfig, tp: int) -> int:
    """KV heads each TP rank holds: n_kv/tp, or 1 (replicated) when tp > n_kv (Megatron's GQA rule)."""
    return max(1, cfg.n_kv_heads // tp)


def parallel_layout(w: Workload, lay: Layout) -> ParallelLayout:
    """The training side's layout for this plan: the one `pentatron train` would validate."""
    return ParallelLayout(dp=lay.dp, tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep, zero=lay.zero, sp=lay.sp,
                          pp_schedule=lay.pp_schedule, pp_virtual=lay.pp_virtual, zero3_gather=lay.zero3_gather,
                          cp_mode=lay.cp_mode, cp_ulysses=lay.cp_ulysses, micro_batch=lay.micro_batch,
                          global_batch=w.global_batch, seq_len=w.seq_len, pp_layers=lay.pp_layers)


@lru_cache(maxsize=16384)
def _training_rules(pl: ParallelLayout, cfg: ModelConfig, gpus: int | None) -> tuple[str, ...]:
    """`ParallelLayout.problems`, memoised: it builds the pipeline schedule to validate it, which is
    the dominant cost of checking a layout (the search asks for the same one several times)."""
    return tuple(pl.problems(cfg, gpus))


def quick_problems(w: Workload, lay: Layout, gpu: GPUSpec, gpus: int | None = None) -> list[str]:
    """The cheap part of `problems` for the search's inner loop: the planner's knobs, the degrees and
    batch arithmetic, and the tensor-parallel split, without building the pipeline schedule. The search
    runs the full `problems` (and `trainable_problems`) on the candidates it ranks."""
    pl = parallel_layout(w, lay)
    return (_knob_problems(w, lay, gpu) + list(_training_rules(pl, None, gpus))  # shared by recompute variants
            + list(_tp_problems(w.cfg, lay.tp, lay.sp, w.seq_len)))


@lru_cache(maxsize=1024)
def _tp_problems(cfg: ModelConfig, tp: int, sp: bool, seq_len: int) -> tuple[str, ...]:
    return tuple(tensor_parallel_problems(cfg, tp, sp, seq_len))


def _knob_problems(w: Workload, lay: Layout, gpu: GPUSpec) -> list[str]:
    """Planner inputs the training layout does not know: precision, recompute mode, kernels, MoE."""
    out: list[str] = []
    moe = w.moe_spec
    if lay.recompute not in RECOMPUTE_MODES:
        out.append(f"--recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {lay.recompute!r}")
    if lay.precision not in PRECISIONS:
        out.append(f"--precision must be one of {', '.join(PRECISIONS)}, got {lay.precision!r}")
    elif lay.precision != "fp32" and _dtype_key(lay.precision) not in gpu.peak_flops:
        out.append(f"--precision {lay.precision}: {gpu.name} has no {lay.precision} tensor cores")
    if lay.fp8_scaling not in FP8_SCALINGS:
        out.append(f"--fp8-scaling must be one of {', '.join(FP8_SCALINGS)}, got {lay.fp8_scaling!r}")
    elif lay.fp8_scaling == "rowwise" and lay.precision != "fp8":
        out.append(f"--fp8-scaling rowwise applies to --precision fp8, not {lay.precision}")
    elif lay.fp8_scaling == "rowwise" and gpu.fp8_rowwise is None:
        out.append(f"--fp8-scaling rowwise: no row-wise FP8 measurement for {gpu.name} (H100 and H200 have one); "
                   "use --fp8-scaling tensorwise")
    if lay.attention not in ATTENTION_KERNELS:
        out.append(f"--attention must be one of {', '.join(ATTENTION_KERNELS)}, got {lay.attention!r}")
    if lay.sp_inputs not in SP_INPUTS:
        out.append(f"sp_inputs must be one of {', '.join(SP_INPUTS)}, got {lay.sp_inputs!r}")
    if lay.qkv_saved not in ("separate", "packed"):
        out.append(f"qkv_saved must be 'separate' or 'packed', got {lay.qkv_saved!r}")
    if lay.param_shard not in ("both", "fp32"):
        out.append(f"param_shard must be 'both' or 'fp32', got {lay.param_shard!r}")
    if lay.pp_outputs not in ("kept", "freed"):
        out.append(f"pp_outputs must be 'kept' or 'freed', got {lay.pp_outputs!r}")
    if lay.pp_buffers not in ("per_message", "per_microbatch"):
        out.append(f"pp_buffers must be 'per_message' or 'per_microbatch', got {lay.pp_buffers!r}")
    if lay.cross_entropy not in CROSS_ENTROPY:
        out.append(f"cross_entropy must be one of {', '.join(CROSS_ENTROPY)}, got {lay.cross_entropy!r}")
    elif lay.cross_entropy == "loss_parallel" and lay.tp == 1:
        out.append("cross_entropy='loss_parallel' splits the loss over the tp ranks' vocabulary slices; with tp=1 "
                   "use 'eager'")
    if lay.grad_precision not in GRAD_PRECISIONS:
        out.append(f"grad_precision must be one of {', '.join(GRAD_PRECISIONS)}, got {lay.grad_precision!r}")
    if lay.tp_overlap and not (lay.sp and lay.tp > 1):
        out.append("tp_overlap pipelines the sequence-parallel all-gathers and reduce-scatters with their GEMMs: "
                   "it needs tp > 1 with sp")
    if not lay.dp_overlap and lay.zero == 3:
        out.append("dp_overlap=false is modelled for ZeRO 0-2 (ZeRO-3 gathers layer by layer behind compute)")
    if lay.cp_rotate not in ("p2p", "allgather"):
        out.append(f"cp_rotate must be 'p2p' or 'allgather', got {lay.cp_rotate!r}")
    elif lay.cp_rotate == "allgather" and lay.cp > 1 and lay.cp_mode != "ring":
        out.append("cp_rotate='allgather' is torch's ring attention: it needs cp_mode='ring'")
    if lay.cp_kv_heads not in ("kv", "q"):
        out.append(f"cp_kv_heads must be 'kv' or 'q', got {lay.cp_kv_heads!r}")
    if lay.pp_p2p not in ("async", "blocking"):
        out.append(f"pp_p2p must be 'async' or 'blocking', got {lay.pp_p2p!r}")
    if lay.zero1_reduce not in ("reduce_scatter", "all_reduce"):
        out.append(f"zero1_reduce must be 'reduce_scatter' or 'all_reduce', got {lay.zero1_reduce!r}")
    if lay.zero1_gather not in ("in_place", "copies"):
        out.append(f"zero1_gather must be 'in_place' or 'copies', got {lay.zero1_gather!r}")
    if lay.ep > 1 and moe is None:
        out.append(f"ep={lay.ep} needs a mixture-of-experts model")
    if moe is not None and moe.num_experts % lay.ep:
        out.append(f"ep={lay.ep} does not divide the {moe.num_experts} experts")
    if moe is not None and lay.tp > 0 and moe.expert_ffn_hidden_size % lay.tp:
        out.append(f"tp={lay.tp} does not divide the expert MLP width {moe.expert_ffn_hidden_size}")
    return out


def problems(w: Workload, lay: Layout, gpu: GPUSpec, gpus: int | None = None) -> list[str]:
    """Every reason the planner cannot evaluate this layout (empty when it can): the training rules
    (`ParallelLayout.problems`, the one validator config, runtime and planner share) plus the planner's
    own inputs. Interleaved chunks that do not divide the layers evenly are evaluated (the planner
    spreads the remainder, as `parallel.pp_layers` lets training do); what is merely slow or not yet
    trainable is in `warnings` and `trainable_problems`, not here."""
    out = _knob_problems(w, lay, gpu)
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
    config's own validation (`ParallelLayout.problems` and `.unsupported`) plus the recipe knobs training
    lacks. The one place the planner asks "can we train this?"; the search recommends only layouts
    for which it is empty."""
    pl = parallel_layout(w, lay)
    out = [*_training_rules(pl, w.cfg, gpus), *pl.unsupported(w.cfg)]
    if lay.precision not in TRAIN_PRECISIONS:
        out.append(f"train.precision={lay.precision!r} is not available in training (use one of "
                   f"{', '.join(TRAIN_PRECISIONS)})")
    if lay.recompute not in TRAINABLE_RECOMPUTE:
        out.append(f"recompute {lay.recompute!r} is not available in training (use one of "
                   f"{', '.join(TRAINABLE_RECOMPUTE)})")
    if lay.grad_precision != "fp32":
        out.append(f"training accumulates gradients in fp32 (grad_precision={lay.grad_precision!r} is not "
                   "available)")
    if lay.sp_inputs != "gathered" and lay.sp:
        out.append("training's column-parallel layers keep the all-gathered input (sp_inputs='sharded' is "
                   "Megatron's recipe, not available)")
    if lay.qkv_saved != "separate":
        out.append("training's attention keeps q, k and v apart (qkv_saved='packed' is nanotron's, not available)")
    if lay.pp_scatter_gather and lay.pp > 1 and lay.tp > 1 and not lay.sp:
        out.append("training's pipeline sends each stage output whole (pp_scatter_gather is not available)")
    if lay.cp > 1 and (lay.cp_rotate != "p2p" or lay.cp_kv_heads != "kv"):
        out.append("training's ring attention passes K/V blocks of the kv heads rank to rank (cp_rotate="
                   f"{lay.cp_rotate!r}, cp_kv_heads={lay.cp_kv_heads!r} is torch's / torchtitan's, not available)")
    if lay.pp_p2p != "async" and lay.pp > 1:
        out.append("training's pipeline sends asynchronously (pp_p2p='blocking' is not available)")
    if not lay.dp_overlap:
        out.append("training reduces gradients during the backward (dp_overlap=false is not available)")
    if lay.zero1_reduce != "reduce_scatter" and lay.zero == 1:
        out.append("training's ZeRO-1 reduce-scatters the gradients (zero1_reduce='all_reduce' is not available)")
    if lay.zero1_gather != "in_place" and lay.zero == 1:
        out.append("training's ZeRO-1 gathers the parameters in place (zero1_gather='copies' is nanotron's, "
                   "not available)")
    if lay.tp_overlap:
        out.append("training runs each tensor-parallel collective before or after its GEMM (tp_overlap is "
                   "Transformer Engine's recipe, not available)")
    if not lay.pp_all_warmup and lay.pp_schedule == "interleaved" and lay.pp_virtual > 1:
        out.append("training's interleaved schedule runs every forward first when micro-batches == pp "
                   "(pp_all_warmup=False is not available)")
    if lay.param_shard != "both" and lay.zero == 3:
        out.append("training's ZeRO-3 keeps a bf16 parameter shard beside the fp32 master shard (param_shard="
                   "'fp32' is FSDP2's storage, not available)")
    if lay.cross_entropy != "eager":
        out.append(f"training computes the loss in fp32 PyTorch ops (cross_entropy={lay.cross_entropy!r} is not "
                   "available; use 'eager')")
    if lay.pp_outputs != "kept":
        out.append("training's pipeline engine keeps each in-flight stage output (pp_outputs='freed' is not "
                   "available)")
    if lay.pp_buffers != "per_message" and lay.pp > 1:
        out.append("training's pipeline engine allocates a buffer per receive (pp_buffers='per_microbatch' is "
                   "torch.distributed.pipelining's, not available)")
    if w.moe_spec is not None and w.cfg.moe is None:
        out.append("an MoE shape given by --experts/--top-k is no model config training can build (use an MoE "
                   "registry model, or set the [moe] fields of the training config)")
    elif w.moe_spec is not None and lay.tp > 1:
        out.append(f"tp={lay.tp}: training replicates the MoE layers over tp (the planner's memory and compute "
                   "assume tp-sharded experts), so it does not recommend tp > 1 for an MoE model")
    return out


def warnings(w: Workload, lay: Layout, gpu: GPUSpec) -> list[str]:
    """Layouts real runs use that are valid but slow or unusual: said, not refused."""
    out = parallel_layout(w, lay).warnings(gpu.gpus_per_node)
    m = lay.microbatches(w) if lay.dp * lay.micro_batch else 0
    if lay.pp > 1 and 0 < m < lay.pp:
        out.append(f"{m} micro-batches < pp={lay.pp}: the pipeline never fills (bubble >= {(lay.pp - 1) / m:.0%})")
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
