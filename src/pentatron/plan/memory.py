"""Memory per GPU: model states (parameters, gradients, master weights, optimizer) under ZeRO, and
activations under TP/SP/CP/PP/recompute, with the in-flight micro-batch count taken from the schedule.

Activations: `llama_layer_activation_bytes`, what *our* `models/llama.py` keeps for backward, tensor by
tensor (checked exactly against the real model on the meta device by `plan --verify`). The GPT-style
formula of Korthikanti et al. 2022 that the Ultra-Scale Playbook uses is a reference study in
research/korthikanti_activation.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from pentatron.config import ParallelConfig
from pentatron.hardware.catalogue import GiB, GPUSpec
from pentatron.models.config import ModelConfig
from pentatron.parallel.activation_memory import layer_activation_bytes
from pentatron.plan.context import comm_buffer_bytes as cp_comm_buffer_bytes
from pentatron.plan.context import cp_degrees, ulysses_kv_replication_bytes
from pentatron.plan.flops import (
    LOSS_CHUNK_TOKENS,
    MoESpec,
    block_matmuls,
    layer_params,
    moe_of,
    sac_op_replayed_matmuls,
)
from pentatron.plan.layout import Layout, Workload, chunk_layers, kv_heads_per_tp_rank
from pentatron.plan.loss_memory import DeviceType, chunked_loss_bytes, last_chunk_bytes
from pentatron.plan.memo import Without
from pentatron.schedules import (
    ScheduleError,
    last_stage_awaiting_backward_closed,
    make_schedule,
    peak_in_flight_closed,
    peak_in_flight_weighted,
)

MiB = 2**20


# ---------------------------------------------------------------- model states
@dataclass(frozen=True)
class StatePrecision:
    """Bytes per parameter held for training."""

    name: str
    param: float
    grad: float
    master: float
    optimizer: float  # Adam first and second moments

    @property
    def total(self) -> float:
        return self.param + self.grad + self.master + self.optimizer


# Our trainer (train/precision.py, grad_buffer.py): bf16 weights, fp32 gradient accumulation buffer,
# fp32 master weights, fp32 Adam moments -> 18 bytes/param. fp8 keeps the bf16 recipe's states (the fp8
# copies of weights are transient). fp32: no master copy -> 16.
# What train.fp8 (parallel/fp8.py, torchao's casts) keeps, measured (tests/plan/test_activation_parity.py):
# between forward and backward each FP8 GEMM saves only its bf16 input and weight, the very storages a bf16
# linear saves (the norm output, the attention output, the SwiGLU product, the parameter): the FP8 copies and
# their scales are made in forward, used by the GEMM and dropped, and made again from the saved bf16 tensors in
# backward (dynamic scaling: no amax history between steps). So --precision fp8 counts the bf16 activations,
# states and buffers. Kept across steps: the numerics log's amax and scale per operand (x, w, dy), six scalars
# per FP8 linear (18 bytes in bf16), not counted. Not modelled: each cast's transients (fp32 product with the
# scale, the clamp, the 1-byte copy), live only inside one GEMM; the loss's transient exceeds them on the last
# pipeline stage (measured on CPU, one debug-shaped layer: +5 MB forward peak at 512 tokens × 1024 ffn).
STATE_PRECISIONS: dict[str, StatePrecision] = {
    "bf16": StatePrecision("bf16", 2, 4, 4, 8),
    "fp8": StatePrecision("fp8", 2, 4, 4, 8),
    "fp32": StatePrecision("fp32", 4, 4, 0, 8),
    "fp16": StatePrecision("fp16", 2, 4, 4, 8),
}
# The playbook's accounting (mixed precision with bf16 gradients: 2+2+4+8 = 16 bytes/param; adding an
# fp32 gradient-accumulation copy: 2+(2+4)+4+8 = 20 bytes/param).
PLAYBOOK_16 = StatePrecision("playbook-bf16", 2, 2, 4, 8)
PLAYBOOK_20 = StatePrecision("playbook-bf16-fp32grads", 2, 6, 4, 8)


def state_precision(lay: Layout) -> StatePrecision:
    """Bytes per parameter held by this layout's training recipe (2-byte gradients when asked)."""
    return _state_precision(lay.precision, lay.recipe.grad_precision, lay.grad_bytes)


@lru_cache(maxsize=64)
def _state_precision(precision: str, grad_precision: str, grad_bytes: int) -> StatePrecision:
    prec = STATE_PRECISIONS[precision]
    if grad_precision == "bf16+fp32":  # a bf16 copy (DeepSpeed's .grad, torch DDP's bucket) beside the fp32 sum
        return replace(prec, grad=prec.grad + 2)
    return replace(prec, grad=grad_bytes)


@dataclass(frozen=True)
class ModelStates:
    parameters: float
    gradients: float
    master_weights: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.master_weights + self.optimizer


def model_state_bytes(n_params: float, prec: StatePrecision, zero: int = 0, dp: int = 1) -> ModelStates:
    """ZeRO (Rajbhandari et al. 2020, playbook section "ZeRO"): stage 1 shards optimizer state and
    master weights over dp, stage 2 also gradients, stage 3 also parameters."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0..3, got {zero}")
    def shard(stage: int) -> float:
        return dp if zero >= stage else 1
    return ModelStates(parameters=n_params * prec.param / shard(3), gradients=n_params * prec.grad / shard(2),
                       master_weights=n_params * prec.master / shard(1),
                       optimizer=n_params * prec.optimizer / shard(1))


# ---------------------------------------------------------------- activations
def act_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


@dataclass(frozen=True)
class LayerActivation:
    """Bytes one decoder layer keeps for backward, for one micro-batch on one GPU."""

    saved: float  # retained until this layer's backward
    working: float  # extra live only while the layer is recomputed (full recompute)


@lru_cache(maxsize=16384)
def llama_layer_activation_bytes(cfg: ModelConfig, tokens: int, seq_len: int, *, precision: str = "bf16",
                                 tp: int = 1, sp: bool = False, recompute: str = "none", layer: int = 0,
                                 moe: MoESpec | None = None, norm: str = "eager", swiglu: str = "eager",
                                 sp_inputs: str = "gathered", cp_ulysses_degree: int = 1,
                                 qkv_saved: str = "separate", moe_tp: str = "replicated",
                                 ep: int = 1) -> LayerActivation:
    """Saved tensors of one `DecoderBlock` of models/llama.py for `tokens` local tokens (micro_batch *
    seq/cp) of sequences `seq_len/cp` long. Per token, a = activation bytes:
      RMSNorm x2: fp32 copy of the input (4h), rstd (4), normalised a*h, gain product = next matmul's
      input a*h; attention: q and out a*h_q, k and v a*kv (FlashAttention keeps q, k, v, out and the
      fp32 logsumexp 4*heads; the o_proj input is a view of out); SwiGLU: gate, up, silu(gate) and the
      product, 4*a*f (GELU: 2*a*f); RoPE: per layer the cos/sin tables cast to the activation dtype,
      twice (q and k): 4 * s * head_dim * a per layer and micro-batch (none in fp32: no cast).
    TP shards heads and the MLP width; SP also the hidden-sized tensors (Megatron keeps the sharded
    input of each all-gather). Selective recompute checkpoints `attn.core`: its inputs q, k, v are kept,
    out is kept as o_proj's input, so only the logsumexp goes. Full recompute keeps the block input.
    norm="fused" (Apex/TE/Megatron fused norm kernels, MPT's low-precision LayerNorm): each norm keeps
    its a*h input and the fp32 rstd only, no fp32 copy and no separate normalised tensor.
    swiglu="fused" (Megatron-Core's SwiGLUFunction, megatron/core/fusions/fused_bias_swiglu.py: it saves
    only its input, gate and up, and recomputes silu in backward): 3*a*f instead of 4*a*f.
    sp_inputs="sharded" (Megatron's SP: the column-parallel linears keep the sequence shard of their
    input and all-gather it again in backward): the two block inputs a*h become a*h/tp.
    cp_ulysses_degree u > kv heads per tp rank: K and V are replicated to one head per rank (plan/context.py).
    qkv_saved="packed" (nanotron without GQA): the packed q|k|v copy stays whole, its k and v parts beside
    the k|v copy attention reads: 2*a*kv more (nothing with GQA, where the q copy is made apart).
    selective-op (torchtitan op-level SAC): the block input, the odd-numbered matmul outputs (q, v, gate,
    down; q, v, up for a 2-matmul MLP; MoE layers half of them), the attention output and logsumexp.
    full-alternate: every second block fully recomputed, so per layer the mean of none and full.
    An MoE layer with moe_tp="replicated" (ours: the layer whole on every tp rank, on the SP shard under
    SP) keeps the runtime's `moe_activation_bytes` (router, dispatch, grouped GEMMs, combine, shared
    experts; traced exactly by tests/plan/test_activation_parity.py); moe_tp="sharded" (Megatron-style
    expert tp) keeps the estimate of its routed rows and their MLPs."""
    h, a = cfg.hidden_size, act_bytes(precision)
    hd = cfg.head_dim
    hq = cfg.n_heads * hd / tp
    kv = kv_heads_per_tp_rank(cfg, tp) * hd
    heads = cfg.n_heads / tp
    hs = h / tp if sp else h  # hidden-sized tensors
    moe = moe_of(cfg, moe)
    lp = layer_params(cfg, layer, moe)
    mlp_mats = 3 if cfg.mlp == "swiglu" else 2
    per_f = 2 if cfg.mlp != "swiglu" else (3 if swiglu == "fused" else 4)
    # The dense layer without recompute is the runtime's own formula (tested against autograd at tp in
    # {1, 2, 4} with and without SP); the variants below are deltas on it. tokens = micro_batch * seq_len.
    ours_moe = bool(lp.expert_total) and moe_tp == "replicated" and cfg.is_moe_layer(layer)
    full_layer = float(layer_activation_bytes(cfg, seq_len, tokens // seq_len, tp=tp, sp=sp, act_bytes=a,
                                              layer=layer if ours_moe else 0, ep=ep))
    if norm == "fused":  # each of the two norms drops its fp32 copy of the input (4h) and keeps a*h
        full_layer -= tokens * 2 * 4 * hs
    if swiglu == "fused" and cfg.mlp == "swiglu":  # silu(gate) is not kept
        if ours_moe and moe is not None:  # the routed rows' and the shared experts' (tokens on this tp rank)
            full_layer -= tokens / (tp if sp else 1) * a * (moe.top_k * moe.expert_ffn_hidden_size
                                                             + moe.n_shared_experts * moe.shared_ffn)
        else:
            full_layer -= tokens * a * cfg.ffn_hidden_size / tp
    if sp and tp > 1 and sp_inputs == "sharded":
        full_layer -= tokens * 2 * a * h * (1 - 1 / tp)
    full_layer += ulysses_kv_replication_bytes(tokens, kv_heads_per_tp_rank(cfg, tp), hd, cp_ulysses_degree, a)
    if qkv_saved == "packed" and cfg.n_kv_heads == cfg.n_heads:
        full_layer += tokens * 2 * a * kv
    if ours_moe and moe is not None:
        mlp = (moe.top_k * moe.expert_ffn_hidden_size + moe.n_shared_experts * moe.shared_ffn) * per_f * a
    elif lp.expert_total and moe is not None:
        # Expert tp (others' MoE code): top_k copies of the input plus each expert's MLP internals; router
        # logits and probabilities in fp32 (an estimate: their routing's own tensors are not traced here).
        routed = moe.top_k * (a * h + per_f * a * moe.expert_ffn_hidden_size / tp)
        shared = moe.n_shared_experts * per_f * a * moe.shared_ffn / tp
        full_layer += tokens * (routed + shared + 8 * moe.num_experts - per_f * a * cfg.ffn_hidden_size / tp)
        mlp = routed + shared + 8 * moe.num_experts
    else:
        mlp = per_f * a * (lp.mlp_active / (mlp_mats * h)) / tp
    if recompute == "none":
        return LayerActivation(full_layer, 0.0)
    if recompute == "selective":
        return LayerActivation(full_layer - tokens * 4 * heads, tokens * 4 * heads)
    if recompute == "selective-op":
        f_local = (lp.mlp_active / (mlp_mats * h)) / tp if not lp.expert_total else mlp / (a * per_f)
        out = h / (tp if sp else 1)
        width = {"q": hq, "k": kv, "v": kv, "o": out, "gate": f_local, "up": f_local, "down": out}
        names = block_matmuls(cfg.mlp)
        replayed = sac_op_replayed_matmuls(cfg.mlp)
        mm_saved = (sum(width[n] for n in names if n not in replayed) if not lp.expert_total
                    else sum(width[n] for n in names) / 2)
        saved = tokens * (a * hs + a * mm_saved + a * hq + 4 * heads)
        return LayerActivation(saved, full_layer)
    if recompute == "full-alternate":
        return LayerActivation((full_layer + tokens * a * hs) / 2, full_layer)
    return LayerActivation(tokens * a * hs, full_layer)


def loss_transient_per_entry(cross_entropy: str, a: int, tp: int) -> float:
    """Bytes per token and (local) vocabulary entry the loss holds at its peak beside what it saves, each
    measured (tests/plan/test_activation_parity.py):
    * F.cross_entropy (tp 1): in forward the low-precision logits and their fp32 copy, (a + 4); in
      backward the incoming fp32 gradient and the one log-softmax's backward makes, 8.
    * ours under TP (parallel/tensor.py `vocab_parallel_cross_entropy`): in forward the low-precision
      logits (none in fp32, where `.float()` copies nothing), the fp32 logits and their shifted copy.
    * torch's `loss_parallel` (torch/distributed/tensor/parallel/loss.py): in backward the zero-filled
      gradient, the exponential of the saved log-softmax and their sum, 12, whatever the logits' dtype.
    * nanotron's `sharded_cross_entropy` (parallel/tensor_parallel/functional.py L31-107 at 67c5ebb6a9): the
      model casts the logits to fp32 and drops the low-precision ones before the loss (models/llama.py
      L876), which subtracts the max into the fp32 copy it keeps (exponentiated and normalised in place):
      in forward the fp32 input beside it, 4; backward works in place on it and casts the gradient, 2."""
    if cross_entropy == "loss_parallel":
        return 12
    if cross_entropy == "nanotron":
        return 4
    if tp > 1:
        return 8 + (a if a < 4 else 0)
    return max(a + 4, 8)




def loss_kept_bytes(cfg: ModelConfig, tokens: float, tp: int, cross_entropy: str,
                    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS) -> float:
    """What our chunked loss keeps from forward for backward beyond its per-token statistics: the last
    chunk's fp32 exp(logit − max) (its vocabulary slice under tp) and that chunk's row max. Backward
    takes it first and frees it, before any parameter's gradient exists."""
    if cross_entropy != "chunked":
        return 0.0
    return last_chunk_bytes(tokens, cfg.vocab_size / tp, loss_chunk_tokens)


def stage_extras(cfg: ModelConfig, tokens: int, *, first: bool, last: bool, precision: str = "bf16",
                 tp: int = 1, sp: bool = False, cross_entropy: str = "eager",
                 loss_chunk_tokens: int = LOSS_CHUNK_TOKENS, sp_inputs: str = "gathered",
                 device: DeviceType = "cuda") -> tuple[float, float]:
    """(saved, transient) bytes outside the decoder layers for one micro-batch: the token ids the
    embedding keeps (and its 1-byte mask under tp: parallel/tensor.py `VocabParallelEmbedding`, first
    stage); the final RMSNorm, LM-head input and the loss's fp32 log-softmax (softmax, for our
    vocab-parallel loss, with its two target masks) plus targets (last stage), with the loss's transient peak of
    `loss_transient_per_entry`. Under SP the norm's tensors are sequence shards, but the head is a
    column-parallel linear: with sp_inputs="gathered" (ours: parallel/tensor.py `VocabParallelHead`
    all-gathers, then the matmul or the chunked loss keeps that gathered input, as `--verify --tp 2 --sp`
    traces) its saved input is a·h per token; "sharded" (Megatron) keeps the shard, a·h/tp.
    cross_entropy="fused" (flash-attn's kernel): the low-precision logits and an fp32 logsumexp per token
    are kept, and the logits' gradient (same dtype) is the transient.
    cross_entropy="chunked" (ours, models/loss.py, `loss_chunk_tokens` at a time): plan/loss_memory.py on
    `device` (the hardware planned for: its CUDA and CPU forms differ in dW's blocked accumulation)."""
    h, a, v = cfg.hidden_size, act_bytes(precision), cfg.vocab_size / tp
    hs = h / tp if sp else h
    head_in = h if sp_inputs == "gathered" else hs  # what the head keeps of its input
    saved = transient = 0.0
    if first:  # the ids the lookup keeps; under tp also the vocab-parallel embedding's out-of-slice mask
        saved += tokens * (8 + (1 if tp > 1 else 0))
    if last:
        saved += tokens * (4 * hs + 4 / (tp if sp else 1) + a * hs + a * head_in)
        if cross_entropy == "fused":
            saved += tokens * (a * v + 4 + 8)
            transient += tokens * a * v
        elif cross_entropy == "chunked":
            kept, peak = chunked_loss_bytes(tokens, v, h, loss_chunk_tokens, a, device)
            saved += kept
            transient += peak
        else:  # under tp ours (`vocab_parallel_cross_entropy`) keeps its two 1-byte target masks too
            saved += tokens * (4 * v + 8 + (2 if tp > 1 and cross_entropy == "eager" else 0))
            transient += tokens * loss_transient_per_entry(cross_entropy, a, tp) * v
    return saved, transient


def rope_shared_bytes(cfg: ModelConfig, seq_len: int, precision: str, recompute: str) -> float:
    """The fp32 cos/sin rows indexed once per forward: kept when the layers save them directly (fp32
    activations: no cast) or as checkpoint inputs (full recompute); otherwise only their casts are."""
    return 2 * seq_len * cfg.head_dim * 4 if (act_bytes(precision) == 4 or recompute == "full") else 0.0


def stage_boundary_tensor_bytes(w: Workload, lay: Layout) -> float:
    """One micro-batch's hidden state as it crosses a pipeline boundary (sequence-sharded under SP)."""
    tokens = lay.micro_batch * w.seq_len // lay.cp
    return tokens * w.cfg.hidden_size * act_bytes(lay.precision) / (lay.tp if lay.sp else 1)


def pipeline_boundary_bytes(w: Workload, lay: Layout, rank: int, in_flight: int, norm: str = "eager") -> float:
    """What the pipeline engine holds per in-flight micro-batch besides the layers' saved tensors: the
    received input (the autograd leaf whose gradient is sent back: not on stage 0, where it is token
    ids, nor under full recompute, where it is the checkpointed block input already counted, nor with
    fused norms, whose first norm saves that very tensor as its input, counted with the layer) and the
    stage output the backward starts from (not the last stage's loss; freed after the send with
    Megatron's deallocate_pipeline_outputs). Interleaved chunks are counted like stages of rank `rank`."""
    if lay.pp <= 1:
        return 0.0
    one = stage_boundary_tensor_bytes(w, lay)
    v = lay.pp_virtual
    inputs = in_flight if (rank > 0 or v > 1) and lay.recompute != "full" and norm == "eager" else 0
    outputs = in_flight if lay.recipe.pp_outputs == "kept" and (rank < lay.pp - 1 or v > 1) else 0
    return (inputs + outputs) * one


def pipeline_receive_bytes(w: Workload, lay: Layout, rank: int, in_flight: int, m: int) -> float:
    """Receive buffers of pipeline rank `rank` beyond the in-flight inputs counted with the layers.
    pp_buffers="per_message": the activation arriving for the next micro-batch and the gradient arriving
    for the next backward. "per_microbatch" (torch.distributed.pipelining): an activation buffer for each
    of the m micro-batches of every chunk that is not stage 0 (those of the in-flight ones are the layer
    inputs already counted; in-flight chunks taken as spread evenly over the rank's chunks) and a gradient
    buffer for each of the m micro-batches of every chunk that is not the last stage."""
    if lay.pp <= 1:
        return 0.0
    one = stage_boundary_tensor_bytes(w, lay)
    if lay.recipe.pp_buffers == "per_message":
        return 2 * one
    v = lay.pp_virtual
    stages = [c * lay.pp + rank for c in range(v)]
    receiving = sum(s > 0 for s in stages)
    sending_back = sum(s < lay.pp * v - 1 for s in stages)
    activations = max(0.0, m * receiving - in_flight * receiving / v)
    return (activations + m * sending_back) * one


# ---------------------------------------------------------------- per-GPU breakdown
@dataclass(frozen=True)
class MemoryBreakdown:
    rank: int  # pipeline rank this breakdown is for (the worst one)
    parameters: float
    gradients: float
    master_weights: float
    optimizer: float
    activations: float
    logits_loss: float
    recompute_working: float
    comm_buffers: float
    optimizer_step: float  # what the optimizer step's transient buffers hold beyond the forward/backward peak
    reserved: float  # CUDA context, cuBLAS workspace, NCCL, allocator fragmentation
    in_flight: int  # micro-batches (chunks for interleaved) holding activations at the peak

    @property
    def total(self) -> float:
        return (self.model_state + self.activations + self.logits_loss + self.recompute_working
                + self.comm_buffers + self.optimizer_step + self.reserved)

    @property
    def model_state(self) -> float:
        """Parameters, gradients, fp32 masters and optimizer state: what the trainer's per-rank accounting
        reports."""
        return self.parameters + self.gradients + self.master_weights + self.optimizer

    @property
    def tensors(self) -> float:
        """The live tensors alone: the total without the CUDA context and the fragmentation margin (what a
        profiler's allocation events or torch.cuda.max_memory_allocated measure)."""
        return self.total - self.reserved

    @property
    def required(self) -> float:
        """The total without the allocator-fragmentation margin: live tensors + the CUDA context. A run
        whose `required` exceeds the device cannot exist; one between `required` and `total` is tight."""
        return self.total - (self.reserved - RUNTIME_RESERVED)

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["total"] = self.total
        return d


COMPONENTS = ("parameters", "gradients", "master_weights", "optimizer", "activations", "logits_loss",
              "recompute_working", "comm_buffers", "optimizer_step", "reserved")

RUNTIME_RESERVED = 1 * GiB  # CUDA context + cuBLAS workspace + NCCL channels (typical, nvidia-smi)
FRAGMENTATION = 0.05  # caching-allocator slack on top of live tensors
DP_BUCKET = int(ParallelConfig.bucket_mb * MiB)  # the default gradient bucket: ZeRO-2 keeps two in flight


@dataclass(frozen=True)
class RankParams:
    dense: float  # sharded over tp only (replicated over dp*cp)
    expert: float  # sharded over tp*ep (replicated over dp*cp/ep)
    largest_unit: float  # full (dp-unsharded) parameters of the biggest ZeRO-3 unit: a layer, or the
    # embedding (with a tied LM head) or the LM head, which zero3_units makes units of their own


@lru_cache(maxsize=64)
def _layer_shards(cfg: ModelConfig, moe: MoESpec | None, tp: int, ep: int,
                  moe_tp: str = "sharded") -> tuple[tuple[float, float], ...]:
    """Per layer: (dense params per GPU after TP, expert params per GPU after TP x EP). moe_tp="replicated"
    (ours, `Recipe.moe_tp`): an MoE layer's router, shared and routed experts are whole on every tp rank
    (the routed ones split over ep only), as training holds them. Cached: the search asks for the same
    model many times."""
    kv_rep = kv_heads_per_tp_rank(cfg, tp) * tp / cfg.n_kv_heads  # >1 when KV heads are replicated
    kv_w = 2 * cfg.hidden_size * cfg.kv_dim
    out = []
    for i in range(cfg.n_layers):
        lpi = layer_params(cfg, i, moe)
        attn = (lpi.attn - kv_w + kv_w * kv_rep) / tp
        mlp_tp = 1 if lpi.expert_total and moe_tp == "replicated" else tp
        out.append((attn + (lpi.mlp_total - lpi.expert_total) / mlp_tp + lpi.norms,
                    lpi.expert_total / (mlp_tp * ep)))
    return tuple(out)


def rank_layers(per_chunk: tuple[int, ...], pp: int, v: int, rank: int) -> list[range]:
    """Decoder-layer index ranges of each chunk pipeline rank `rank` holds (chunk c = stage c*pp+rank)."""
    starts = [sum(per_chunk[:i]) for i in range(pp * v)]
    return [range(starts[c * pp + rank], starts[c * pp + rank] + per_chunk[c * pp + rank]) for c in range(v)]


def rank_params(w: Workload, lay: Layout, rank: int) -> RankParams:
    """Parameters pipeline rank `rank` holds per GPU (TP/EP-sharded, before ZeRO)."""
    per_chunk = chunk_layers(w, lay)
    return _rank_params(w.cfg, w.moe_spec, lay.tp, lay.ep, lay.pp, lay.pp_virtual, rank, per_chunk,
                        lay.recipe.moe_tp)


@lru_cache(maxsize=8192)
def _rank_params(cfg: ModelConfig, moe: MoESpec | None, tp: int, ep: int, pp: int, v: int, rank: int,
                 per_chunk: tuple[int, ...], moe_tp: str = "sharded") -> RankParams:
    shards = _layer_shards(cfg, moe, tp, ep, moe_tp)
    dense = expert = largest = 0.0
    for r in rank_layers(per_chunk, pp, v, rank):
        for i in r:
            d, e = shards[i]
            dense += d
            expert += e
            largest = max(largest, d + e)
    emb = cfg.vocab_size * cfg.hidden_size / tp
    if rank == 0 or rank == pp - 1:  # the embedding's or the LM head's unit, gathered for the loss
        largest = max(largest, emb)
    if rank == 0:
        dense += emb
    if rank == pp - 1:
        dense += cfg.hidden_size  # final norm
        if not cfg.tie_embeddings or pp > 1:  # tied across stages: the last stage keeps a copy
            dense += emb
    return RankParams(dense, expert, largest)


@lru_cache(maxsize=4096)
def _layers_in_flight(name: str, p: int, m: int, v: int, rank: int, layers: tuple[int, ...], in_flight: int,
                      all_warmup: bool = True) -> float:
    """Most decoder layers' activations rank `rank` holds at once (`layers`: its chunks' layer counts,
    `in_flight`: the schedule's peak count of chunks). Equal chunks: the count times the chunk; unequal
    ones (an embedding-only chunk): walked in the schedule's own order, or, for a schedule that cannot
    be built, bounded by the heaviest chunks in turn."""
    if len(set(layers)) == 1:
        return in_flight * layers[0]
    try:
        return peak_in_flight_weighted(make_schedule(name, p, m, v, all_warmup), rank, layers)
    except ScheduleError:
        full_sets, rest = divmod(in_flight, v)
        return full_sets * sum(layers) + sum(sorted(layers, reverse=True)[:rest])


@lru_cache(maxsize=4096)  # the search asks once per pipeline rank of each layout, for the same few schedules
def schedule_in_flight(name: str, p: int, m: int, v: int, all_warmup: bool = True) -> tuple[int, ...]:
    """Peak in-flight (chunk, micro-batch) pairs per rank of the schedule (closed forms that the tests
    check against the generated schedules)."""
    if p == 1:
        return (1,)
    return tuple(peak_in_flight_closed(name, p, m, v, all_warmup))


@lru_cache(maxsize=16384)
def _states(rp: RankParams, prec: StatePrecision, zero: int, dpcp: int, ep: int) -> tuple[ModelStates, ModelStates]:
    return (model_state_bytes(rp.dense, prec, zero, dpcp),
            model_state_bytes(rp.expert, prec, zero, max(1, dpcp // ep)))


def optimizer_step_bytes(lay: Layout, rp: RankParams, prec: StatePrecision, dpcp: int) -> float:
    """Transient buffers of the optimizer step beside the model states. ZeRO-1 with zero1_gather="copies"
    (nanotron, optim/zero.py `_all_gather_params` at 67c5ebb6a9): `all_gather_coalesced` flattens this
    rank's shard into one input and each rank's shards into an output of their own, and torch's
    ProcessGroupNCCL::allgather gathers same-sized outputs into a flat buffer it allocates and copies out
    of: 2 + 1/dp copies of the parameters. Checked against the step's logged live peak by
    research/nanotron_replay.py. In place (ours, Megatron): nothing."""
    if lay.zero != 1 or lay.recipe.zero1_gather != "copies" or dpcp == 1:
        return 0.0
    expert_dp = max(1, dpcp // lay.ep)
    return prec.param * (rp.dense * (2 + 1 / dpcp) + rp.expert * (2 + 1 / expert_dp))


def memory_for_rank(w: Workload, lay: Layout, gpu: GPUSpec, rank: int, kernels: str = "eager",
                    norm: str | None = None) -> MemoryBreakdown:
    """`norm` ("eager" | "fused"): how the norms keep their inputs; by default as `kernels` says."""
    cfg, moe = w.cfg, w.moe_spec
    prec = state_precision(lay)
    a = act_bytes(lay.precision)
    tokens = lay.micro_batch * (w.seq_len // lay.cp)
    rp = rank_params(w, lay, rank)
    dpcp = lay.zero_group  # HSDP: the shard group
    dense, expert = _states(rp, prec, lay.zero, dpcp, lay.ep)
    if lay.zero == 3 and lay.recipe.param_shard == "fp32" and prec.master:  # FSDP2: the master is the parameter
        dense, expert = replace(dense, parameters=0.0), replace(expert, parameters=0.0)
    act = _activation_terms(w, Without(lay, _NOT_IN_ACTIVATIONS), rank, kernels, norm, gpu.device_type)
    extra_transient = act.extra_transient
    comm = act.comm
    buckets = 0.0
    if dpcp > 1 and lay.zero == 2:  # transient gradient buckets, two in flight, none bigger than the gradients
        buckets = 2 * min(DP_BUCKET, (rp.dense + rp.expert) * prec.grad)
    elif dpcp > 1 and lay.zero == 3:  # two in flight, none bigger than the unit whose gradients it holds
        buckets = 2 * min(DP_BUCKET, rp.largest_unit * prec.grad)
    # they fill from the first parameter gradient on, after the loss's backward has made and dropped its
    # transient peak and its kept chunk (measured: predict_vs_measure.py --memory-layouts, zero2 on the
    # debug model): only what exceeds that peak adds to it
    if rank == lay.pp - 1:
        extra_transient += loss_kept_bytes(w.cfg, tokens, lay.tp, lay.recipe.cross_entropy,
                                           lay.recipe.loss_chunk_tokens)
    comm += max(0.0, buckets - extra_transient)
    # ZeRO-0/1: each bucket is a slice of the persistent gradient buffer, reduced where it lies (ours,
    # Megatron's contiguous buffer; measured: benchmarks/predict_vs_measure.py, dp2): nothing more
    if lay.zero == 3 and dpcp > 1 and lay.pp > 1 and lay.zero3_gather == "step":
        comm += (rp.dense + rp.expert) * a * (1 - 1 / dpcp)  # the whole stage stays gathered for the step
    elif lay.zero == 3 and dpcp > 1:
        comm += 2 * rp.largest_unit * a  # current + prefetched gathered unit
    if lay.ep > 1 and moe is not None:
        comm += 2 * tokens * moe.top_k * cfg.hidden_size * a  # all-to-all send/recv buffers
    if lay.cp > 1:  # ring blocks in hand and arriving (or all of them, gathered); Ulysses receive buffers
        comm += act.cp_buffers
    acts, logits_loss, working = act.activations, act.logits_loss, act.working
    live = (dense.total + expert.total + acts + logits_loss + working + comm)
    step = max(0.0, optimizer_step_bytes(lay, rp, prec, dpcp) + dense.total + expert.total - live)
    return MemoryBreakdown(
        rank=rank, parameters=dense.parameters + expert.parameters, gradients=dense.gradients + expert.gradients,
        master_weights=dense.master_weights + expert.master_weights, optimizer=dense.optimizer + expert.optimizer,
        activations=acts, logits_loss=logits_loss, recompute_working=working, comm_buffers=comm,
        optimizer_step=step, reserved=RUNTIME_RESERVED + FRAGMENTATION * (live + step), in_flight=act.in_flight)


@dataclass(frozen=True)
class _ActivationTerms:
    """What `memory_for_rank` takes from the activations, the same for every ZeRO stage."""

    activations: float
    logits_loss: float
    working: float
    comm: float  # pipeline receive buffers and the SP all-gathered input (before the ZeRO buffers)
    cp_buffers: float  # context parallelism's receive buffers (added after the ZeRO and EP buffers)
    extra_transient: float
    in_flight: int


_NOT_IN_ACTIVATIONS = frozenset({"zero"})


@lru_cache(maxsize=16384)
def _activation_terms(w: Workload, key: Without, rank: int, kernels: str, norm: str | None,
                      device: DeviceType) -> _ActivationTerms:
    """Activations, loss and activation-sized buffers of pipeline rank `rank` of the layout `key` stands
    for: they do not depend on the ZeRO stage, so the search's four ZeRO variants of a layout share them.
    `device`: the planned hardware's device type (the loss's form)."""
    lay: Layout = key.obj
    cfg, moe = w.cfg, w.moe_spec
    a = act_bytes(lay.precision)
    seq_local = w.seq_len // lay.cp
    tokens = lay.micro_batch * seq_local

    # activations: layers on this rank x micro-batches in flight (weighted per chunk for interleaved)
    m = lay.microbatches(w)
    per_chunk = chunk_layers(w, lay)
    sched = (lay.pp_schedule, lay.pp, m, lay.pp_virtual)
    in_flight = schedule_in_flight(*sched, lay.recipe.pp_all_warmup)[rank] if lay.pp > 1 else 1
    norm_kind = norm or lay.recipe.norm or ("fused" if kernels == "fused" else "eager")

    def one_layer(i: int) -> LayerActivation:
        return llama_layer_activation_bytes(cfg, tokens, seq_local, precision=lay.precision, tp=lay.tp,
                                            sp=lay.sp, recompute=lay.recompute, layer=i, moe=moe, norm=norm_kind,
                                            swiglu="fused" if kernels == "fused" else "eager",
                                            sp_inputs=lay.recipe.sp_inputs, qkv_saved=lay.recipe.qkv_saved,
                                            cp_ulysses_degree=cp_degrees(lay.cp, lay.cp_mode, lay.cp_ulysses)[0],
                                            moe_tp=lay.recipe.moe_tp, ep=lay.ep)

    # dense and MoE layers (first_dense_layers) keep different bytes: the mean over this rank's layers
    # (exact when its chunks are equally in flight), the larger recompute working space
    held = [i for r in rank_layers(per_chunk, lay.pp, lay.pp_virtual, rank) for i in r] or [0]
    dense = sum(1 for i in held if moe is None or i < moe.first_dense_layers)
    kinds = [(one_layer(0), dense)] if dense else []
    if dense < len(held):
        kinds.append((one_layer(held[-1]), len(held) - dense))
    layer_act = LayerActivation(sum(k.saved * n for k, n in kinds) / len(held), max(k.working for k, _ in kinds))
    first, last = rank == 0, rank == lay.pp - 1
    extra_saved, extra_transient = stage_extras(cfg, tokens, first=first, last=last, precision=lay.precision,
                                                tp=lay.tp, sp=lay.sp, cross_entropy=lay.recipe.cross_entropy,
                                                loss_chunk_tokens=lay.recipe.loss_chunk_tokens,
                                                sp_inputs=lay.recipe.sp_inputs, device=device)
    n_rank_layers = [per_chunk[c * lay.pp + rank] for c in range(lay.pp_virtual)]
    acts = _layers_in_flight(*sched, rank, tuple(n_rank_layers), in_flight, lay.recipe.pp_all_warmup)
    acts *= layer_act.saved
    acts += rope_shared_bytes(cfg, seq_local, lay.precision, lay.recompute) * min(in_flight, m)
    acts += pipeline_boundary_bytes(w, lay, rank, in_flight, norm_kind)
    # logits/loss: the last stage keeps the loss state of each micro-batch until its backward (B) runs
    loss_sets = last_stage_awaiting_backward_closed(*sched, lay.recipe.pp_all_warmup) if last else 1
    logits_loss = extra_saved * loss_sets + extra_transient

    comm = pipeline_receive_bytes(w, lay, rank, in_flight, m)
    if lay.tp > 1 and lay.sp:
        comm += tokens * cfg.hidden_size * a  # all-gathered layer input
    cp_buffers = 0.0
    if lay.cp > 1:
        cp_buffers = cp_comm_buffer_bytes(tokens, cfg.n_heads / lay.tp * cfg.head_dim,
                                          kv_heads_per_tp_rank(cfg, lay.tp), cfg.head_dim, lay.cp, lay.cp_mode,
                                          lay.cp_ulysses, a, lay.recipe.cp_rotate, lay.recipe.cp_kv_heads)
    return _ActivationTerms(acts, logits_loss, layer_act.working, comm, cp_buffers, extra_transient, in_flight)


def memory_floor(w: Workload, lay: Layout, gpu: GPUSpec, kernels: str = "eager", norm: str | None = None) -> float:
    """A bound `memory_per_gpu(...).total` never goes below: pipeline rank 0's model states and activations
    with the fragmentation margin on them, and the runtime's reserve (every other term is >= 0). The search
    decides "does not fit" by it for most layouts, without their full breakdown."""
    prec = state_precision(lay)
    dense, expert = _states(rank_params(w, lay, 0), prec, lay.zero, lay.zero_group, lay.ep)
    states = dense.total + expert.total
    if lay.zero == 3 and lay.recipe.param_shard == "fp32" and prec.master:  # FSDP2: the master is the parameter
        states -= dense.parameters + expert.parameters
    acts = _activation_terms(w, Without(lay, _NOT_IN_ACTIVATIONS), 0, kernels, norm, gpu.device_type).activations
    return RUNTIME_RESERVED + (states + acts) * (1 + FRAGMENTATION)


def memory_per_gpu(w: Workload, lay: Layout, gpu: GPUSpec, kernels: str = "eager",
                   norm: str | None = None) -> MemoryBreakdown:
    """The breakdown of the pipeline rank that needs the most memory: the first (embedding, most
    micro-batches in flight), the last (LM head and loss) or one holding the most layers."""
    if lay.pp <= 3:
        ranks: list[int] | range = range(lay.pp)
    else:
        per_chunk = chunk_layers(w, lay)
        per_rank = [sum(per_chunk[c * lay.pp + r] for c in range(lay.pp_virtual)) for r in range(lay.pp)]
        heavy = per_rank.index(max(per_rank))
        ranks = sorted({0, 1, heavy, lay.pp - 1})
    return max((memory_for_rank(w, lay, gpu, r, kernels, norm) for r in ranks), key=lambda mb: mb.total)
