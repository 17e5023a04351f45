"""Step time from first principles: GEMM roofline with wave quantisation, fused-attention efficiency,
memory-bound elementwise traffic, exposed communication, and the pipeline bubble of the *actual*
schedule (simulated by `schedules.py`).

Overlap rules (what hides behind what):
* TP/SP collectives and MoE all-to-alls sit on the critical path (exposed); with `tp_overlap` each SP
  collective hides behind its GEMM but for one of its tp chunks (`tp_overlap_split`).
* Ring-attention (CP) KV exchange overlaps the attention kernel of the same step: exposed = excess.
* Pipeline p2p delays only the dependent action on the next rank (asynchronous sends), as simulated;
  `pp_p2p="blocking"` (DeepSpeed's pipeline engine, nanotron) also holds the sender for the transfer.
* DP gradient reduction overlaps the last micro-batch's backward (bucketed); the last bucket never
  hides. ZeRO-2 reduce-scatters each micro-batch behind that micro-batch's backward. ZeRO-1/2
  parameter all-gathers after the optimizer hide behind the next step's first forward, but for the first
  bucket (waited before the first layer). ZeRO-3 gathers
  each layer behind the previous layer's compute (prefetch). With `dp_overlap=False` the gradient
  reduction and the ZeRO-1/2 gathers are all exposed.
* The optimizer step is memory-bound and exposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from pentatron.hardware.catalogue import GPUSpec
from pentatron.hardware.chip_spread import slowest_chip
from pentatron.hardware.fp8_rowwise import LN_SIGMOID_BYTES_PER_ELEMENT, rowwise_seconds
from pentatron.hardware.speeds import KERNEL_OVERHEAD
from pentatron.plan.comm import (
    Collective,
    LayerComm,
    Traffic,
    collective_time,
    cp_forward_passes,
    cp_layer_cost,
    group_of,
    layer_comm,
    loss_all_reduces,
    pp_hop_time,
    report_dim,
    step_collectives,
    zero3_calls_per_layer,
)
from pentatron.plan.context import cp_degrees
from pentatron.plan.flops import (
    hardware_flops_per_token,
    layer_params,
    layer_tensors,
    loss_replayed_tokens,
    model_flops_per_token,
    sac_op_replayed_matmuls,
)
from pentatron.plan.layout import Layout, Workload, chunk_layers, compute_dtype, kv_heads_per_tp_rank
from pentatron.plan.memo import Same, Without
from pentatron.plan.memory import DP_BUCKET, STATE_PRECISIONS, RankParams, act_bytes, rank_layers, rank_params
from pentatron.plan.recipes import not_ours
from pentatron.schedules import Schedule, idle_share, make_schedule, simulate

OPTIMIZER_BYTES_PER_PARAM = 34  # AdamW step: read grad 4, r/w master 8, r/w moments 16, write param 2, norm 4
KERNELS = ("fused", "eager")
# A collective overlapped with compute still occupies SMs: NCCL runs one CTA per channel (16 channels is
# its usual choice on NVLink/IB systems), so compute slows by channels/SMs while it runs.
NCCL_CHANNELS = 16
FP8_CAST_BYTES_PER_ELEMENT = 6  # see `_linear`
# Unfused ("math") attention: the fused scale-mask-softmax kernel reads the scores and writes the
# probabilities (Megatron's FusedScaleMaskSoftmax), backward reads probabilities and their gradient
# and writes the score gradient: bytes per score element, forward and backward.
MATH_SOFTMAX_BYTES = (2, 3)


@dataclass(frozen=True)
class Phase:
    """Seconds one micro-batch spends in a chunk: forward, backward-input, backward-weight."""

    f: float
    b: float
    w: float

    def __add__(self, o: Phase) -> Phase:
        return Phase(self.f + o.f, self.b + o.b, self.w + o.w)

    def scale(self, k: float) -> Phase:
        return Phase(self.f * k, self.b * k, self.w * k)

    @property
    def total(self) -> float:
        return self.f + self.b + self.w


ZERO = Phase(0.0, 0.0, 0.0)


def gemm_time(gpu: GPUSpec, m: float, n: float, k: float, peak: float, a: int) -> float:
    """C[m,n] = A[m,k] B[k,n] with `a`-byte operands at `peak` FLOP/s (`Speeds.gemm`)."""
    return gpu.speeds.gemm(m, n, k, peak, a)


def _linear(gpu: GPUSpec, tokens: float, n_out: float, n_in: float, peak: float, a: int,
            fp8: str = "") -> Phase:
    """y = x W for `tokens` rows: forward, dX = dY W^T, dW = X^T dY. `fp8`: "" (16/32-bit GEMMs), or the
    FP8 scaling, "tensorwise" or "rowwise".
    tensorwise (Transformer Engine, torchao's default): the GEMMs read 1-byte operands at the fp8 peak,
    and every operand is first cast by a memory-bound kernel that reads the bf16 tensor (plus an amax
    pass) and writes the fp8 copy and, for Hopper's TN-only fp8 GEMMs, its transpose: forward casts x and
    W (W once per micro-batch), backward casts dY (and x^T / W^T come from the forward casts).
    rowwise: the bf16 linear scaled by the GPU's measured row-wise speedup for this shape
    (hardware/fp8_rowwise.py), each phase alike."""
    if not fp8:
        return Phase(*gpu.speeds.linear(tokens, n_out, n_in, peak, a))
    bw = gpu.hbm_bandwidth * gpu.efficiency.hbm
    cast = FP8_CAST_BYTES_PER_ELEMENT  # read bf16 (2) + amax read (2) + write fp8 and its transpose (1 + 1)
    fwd_cast = (tokens * n_in + n_in * n_out) * cast / bw
    bwd_cast = tokens * n_out * cast / bw
    tensorwise = Phase(gemm_time(gpu, tokens, n_out, n_in, peak, 1) + fwd_cast,
                       gemm_time(gpu, tokens, n_in, n_out, peak, 1) + bwd_cast,
                       gemm_time(gpu, n_out, n_in, tokens, peak, 1))
    rowwise = gpu.efficiency.fp8_rowwise
    if fp8 != "rowwise" or rowwise is None or tensorwise.total <= 0:
        return tensorwise
    bf16 = _linear(gpu, tokens, n_out, n_in, gpu.flops("bf16"), 2)
    ln_sigmoid = LN_SIGMOID_BYTES_PER_ELEMENT * tokens * (n_in + n_out) / bw
    t = rowwise_seconds(rowwise, tokens, n_in, n_out, bf16.total, ln_sigmoid, tensorwise.total)
    return bf16.scale(t / bf16.total)


def _head_linear(gpu: GPUSpec, tokens: float, vocab: float, hidden: float, peak: float, a: int) -> Phase:
    """The LM head's three GEMMs (`Speeds.head_linear`: a profile may have measured this shape)."""
    return Phase(*gpu.speeds.head_linear(tokens, vocab, hidden, peak, a))


def fp8_of(lay: Layout) -> str:
    """`_linear`'s fp8 argument for this layout: its scaling under precision fp8, else ""."""
    return lay.fp8_scaling if lay.precision == "fp8" else ""


def _elementwise_bytes(w: Workload, lay: Layout, kernels: str) -> float:
    """HBM bytes per token of one layer's forward outside GEMMs and attention (backward ~2x).
    eager = our plain-PyTorch ops one by one (RMSNorm in fp32: ~(28 + 4a) per element; RoPE ~10a;
    residual add 3a; SwiGLU 5a per MLP element); fused = one read + one write per op chain."""
    cfg, a = w.cfg, act_bytes(lay.precision)
    hs = cfg.hidden_size / (lay.tp if lay.sp else 1)
    rope = cfg.n_heads * cfg.head_dim / lay.tp + kv_heads_per_tp_rank(cfg, lay.tp) * cfg.head_dim
    f = cfg.ffn_hidden_size / lay.tp
    if kernels == "eager":
        return 2 * (28 + 4 * a) * hs + 10 * a * rope + 2 * 3 * a * hs + (5 if cfg.mlp == "swiglu" else 2) * a * f
    return 2 * 2 * a * hs + 2 * a * rope + 2 * 3 * a * hs + (3 if cfg.mlp == "swiglu" else 2) * a * f


def attention_times(w: Workload, lay: Layout, gpu: GPUSpec) -> tuple[float, float]:
    """Causal attention over the whole sequence (within its packed documents: `Workload.documents`), this
    GPU's share (1/cp of the query-key pairs with load balancing, 1/tp of the heads): forward and backward
    seconds per layer and micro-batch.
    Fused kernels (flash2/flash3/cudnn) skip the masked half at the kernel's fraction of peak
    (`GPUSpec.attention`); the math path runs QK^T and PV as batched GEMMs over the full square and
    the softmax as memory traffic over the scores. fp8 runs attention in bf16."""
    cfg = w.cfg
    prec = "bf16" if lay.precision == "fp8" else lay.precision
    peak = gpu.flops(compute_dtype(prec))
    heads = cfg.n_heads / lay.tp
    s_q = w.seq_len / lay.cp
    if lay.attention == "math":
        a = act_bytes(prec)
        batch = heads * lay.micro_batch
        # scores [s_q, s]; within packed documents each document's own square, E[L²]/E[L] keys per query
        kv = w.seq_len if w.documents is None else w.documents.square_keys(w.seq_len)
        qk = batch * gemm_time(gpu, s_q, kv, cfg.head_dim, peak, a)
        pv = batch * gemm_time(gpu, s_q, cfg.head_dim, kv, peak, a)
        scores = batch * s_q * kv
        bw = gpu.hbm_bandwidth * gpu.efficiency.hbm
        fwd = qk + pv + scores * a * MATH_SOFTMAX_BYTES[0] / bw
        return fwd, 2 * (qk + pv) + scores * a * MATH_SOFTMAX_BYTES[1] / bw
    # causal pairs of a sample: s(s+1)/2, or within its packed documents s·(E[L²]/E[L] + 1)/2
    keys = (w.seq_len + 1) / 2 if w.documents is None else w.documents.causal_keys(w.seq_len)
    flops = 4 * heads * cfg.head_dim * lay.micro_batch * w.seq_len * keys / lay.cp
    # ring attention calls the kernel per step and per zigzag half-chunk: 2 launches per ring step
    # instead of one call
    _, ring = cp_degrees(lay.cp, lay.cp_mode, lay.cp_ulysses)
    launches = (2 * ring - 1) * KERNEL_OVERHEAD if ring > 1 else 0.0
    return gpu.speeds.attention(flops, w.seq_len, cfg.head_dim, prec, lay.attention, peak, launches)


def layer_phase(w: Workload, lay: Layout, gpu: GPUSpec, index: int, kernels: str = "fused") -> Phase:
    """One decoder layer, one micro-batch, one GPU: GEMMs + attention + elementwise + exposed comm,
    with recomputation charged to the backward-input pass."""
    cfg, moe = w.cfg, w.moe_spec
    a = act_bytes(lay.precision)
    peak = gpu.flops(compute_dtype(lay.precision))
    tokens = lay.micro_batch * w.seq_len / lay.cp
    h, tp = cfg.hidden_size, lay.tp
    fp8 = fp8_of(lay)
    lin = dense_linears(w, lay, gpu)
    qkv, proj = lin.qkv, lin.o
    ph = qkv + proj
    up = down = ZERO
    lp = layer_params(cfg, index, moe)
    mats = 3 if cfg.mlp == "swiglu" else 2
    if lp.expert_total and moe is not None:
        # Experts sharded over tp (Megatron-style): every token, 1/tp of each expert's width. Replicated (ours,
        # parallel/moe_tokens.py): whole experts on the rank's tokens — its SP shard, or all of them without SP.
        whole = lay.recipe.moe_tp == "replicated"
        moe_tokens = tokens / (tp if lay.sp else 1) if whole else tokens
        width = 1 if whole else tp
        local_experts = moe.num_experts / lay.ep
        per_expert = moe_tokens * moe.top_k / local_experts  # balanced routing
        fe = moe.expert_ffn_hidden_size / width
        ex = _linear(gpu, per_expert, fe, h, peak, a, fp8).scale(mats - 1)
        ex = ex + _linear(gpu, per_expert, h, fe, peak, a, fp8)
        ph = ph + ex.scale(local_experts) + _linear(gpu, moe_tokens, moe.num_experts, h, peak, a, fp8)
        if moe.n_shared_experts:
            fs = moe.shared_ffn / width
            sh = (_linear(gpu, moe_tokens, fs, h, peak, a, fp8).scale(mats - 1)
                  + _linear(gpu, moe_tokens, h, fs, peak, a, fp8))
            ph = ph + sh.scale(moe.n_shared_experts)
    else:
        up, down = lin.up, lin.down
        ph = ph + up + down
    attn_f, attn_b = attention_times(w, lay, gpu)
    # each elementwise op streams about one hidden-sized tensor in and one out
    hs = h / (tp if lay.sp else 1)
    bw = gpu.speeds.op_bandwidth if kernels == "eager" else gpu.speeds.fused_bandwidth  # a profile may measure each
    elem = tokens * _elementwise_bytes(w, lay, kernels) / bw(tokens * hs * a, 2 * tokens * h * a)
    lc = layer_comm(w, lay, gpu, bool(lp.expert_total))
    cp = cp_layer_cost(w, lay, gpu, attn_f, attn_b)
    tp_f, tp_b = lc.tp_fwd, lc.tp_bwd
    if lay.recipe.tp_overlap and not lp.expert_total:
        (tp_f, tp_b), _ = tp_overlap_split(lc, tp, qkv, proj, up, down)
    f = ph.f + attn_f + elem + tp_f + lc.ep_fwd + cp.fwd_exposed
    b = ph.b + attn_b + 2 * elem + tp_b + lc.ep_bwd + cp.bwd_exposed
    b += sum(sp_regather_split(lc, qkv, up)[0])
    if lay.recompute == "selective":  # the attention core replays, its context-parallel exchange included
        b += attn_f + cp.fwd_exposed
    elif lay.recompute == "selective-op":  # torchtitan's op SAC: every elementwise op and some matmuls replay
        if fp8 or lp.expert_total:  # Float8 saves no matmul output (_scaled_mm is not in the save list)
            b += (ph.f if fp8 else ph.f / 2) + elem
        else:  # the even-numbered matmuls: k, o and w3 (SwiGLU) or down
            b += sum(lin.named(n).f for n in sac_op_replayed_matmuls(cfg.mlp)) + elem
    elif lay.recompute == "full":  # the whole block replays, its TP collectives included
        b += f
    elif lay.recompute == "full-alternate":  # every second block
        b += f / 2
    hf, hb = gpu.speeds.host_layer(tp, kernels)  # measured host work (CPU profiles), serial with the arithmetic there
    acc = grad_accumulation(gpu, lay, layer_local_params(w, lay, index), kernels)
    return Phase(f + hf, b + hb + (hf if lay.recompute == "full" else 0.0), ph.w + acc)


def layer_local_params(w: Workload, lay: Layout, index: int) -> float:
    """Parameters of layer `index` one rank holds (tp shards the linears, ep the experts)."""
    lp = layer_params(w.cfg, index, w.moe_spec)
    dense = lp.attn + lp.mlp_total - lp.expert_total
    return dense / lay.tp + lp.expert_total / (lay.tp * lay.ep) + lp.norms


def outside_blocks(lay: Layout, kernels: str) -> str:
    """The kernels of the work outside the decoder blocks (loss, embedding backward, gradient accumulation,
    tied-gradient exchange): eager under a recipe whose fused kernels are compiled blocks only (ours)."""
    return "eager" if lay.recipe.fused_scope == "blocks" else kernels


def grad_accumulation(gpu: GPUSpec, lay: Layout, params: float, kernels: str) -> float:
    """Eager engines (ours, Megatron's DDP before its fused wgrad accumulation) add each micro-batch's
    fresh gradient into the fp32 main_grad buffer: read the gradient, read and write main_grad."""
    if outside_blocks(lay, kernels) != "eager" or params <= 0:
        return 0.0
    per = act_bytes(lay.precision) + 8
    return params * per / gpu.speeds.op_bandwidth(params * 4, params * per)


def tied_pack_add(gpu: GPUSpec, nbytes: float, kernels: str) -> float:
    """Our swap of the tied gradient (parallel/data.sync_tied_grads, eager) packs the owned pieces into one
    buffer (read + write) and adds the peer's copy back (two reads, one write): 5 passes over its bytes.
    Fused frameworks reduce the gradient in place (Megatron's embedding-group all-reduce): none."""
    if kernels != "eager" or nbytes <= 0:
        return 0.0
    return 5 * nbytes / gpu.speeds.op_bandwidth(nbytes, 3 * nbytes)


def sp_regather_split(lc: LayerComm, qkv: Phase, up: Phase) -> tuple[tuple[float, float], float]:
    """Megatron's SP backward all-gathers each column-parallel linear's input again while it computes
    that linear's input gradient (async, then waits): ((exposed before q/k/v, before gate/up), hidden)
    seconds, the all-gather exposed by what exceeds the GEMM it overlaps."""
    ag = lc.sp_regather
    if not ag:
        return (0.0, 0.0), 0.0
    exposed = (max(0.0, ag - qkv.b), max(0.0, ag - up.b) if up.b else ag)
    return exposed, 2 * ag - sum(exposed)


def tp_overlap_split(lc: LayerComm, tp: int, qkv: Phase, proj: Phase, up: Phase, down: Phase
                     ) -> tuple[tuple[float, float], tuple[float, float]]:
    """SP collectives pipelined with their GEMMs (`Layout.tp_overlap`): ((forward, backward) exposed,
    (forward, backward) hidden) seconds per layer and micro-batch. Forward, each all-gather feeds a
    column-parallel GEMM (q/k/v, gate/up) and each reduce-scatter follows a row-parallel one (output
    projection, down); backward, the all-gather of the output gradient feeds the row-parallel GEMMs'
    backward and the reduce-scatter of the input gradient follows the column-parallel ones'. A collective
    split into tp chunks hides behind its GEMM but for one chunk, and is exposed by what exceeds it."""
    ag, rs = lc.sp_all_gather, lc.sp_reduce_scatter
    fwd = ((ag, qkv.f), (rs, proj.f), (ag, up.f), (rs, down.f))
    bwd = ((ag, proj.b + proj.w), (rs, qkv.b + qkv.w), (ag, down.b + down.w), (rs, up.b + up.w))

    def exposed(pairs: tuple[tuple[float, float], ...]) -> float:
        return sum(max(c / tp, c - gemm) for c, gemm in pairs)

    ef, eb = exposed(fwd), exposed(bwd)
    return (ef, eb), (2 * (ag + rs) - ef, 2 * (ag + rs) - eb)


# Bytes per logit moved by torch's loss_parallel besides reading the low-precision logits once
# (torch/distributed/tensor/parallel/loss.py), forward: .float() writes 4, amax reads 4, the shift reads
# and writes 8, exp 8, its sum reads 4, the log-softmax 8; backward: zeros 4, exp 8, the add 12, the
# scale by the loss gradient 8, the cast back reads 4 (and writes the low-precision gradient).
LOSS_PARALLEL_BYTES = 36


def head_phase(w: Workload, lay: Layout, gpu: GPUSpec, kernels: str = "fused") -> Phase:
    """Final norm, LM head and the cross-entropy loss (vocab-parallel under TP)."""
    a = act_bytes(lay.precision)
    tokens = lay.micro_batch * w.seq_len / lay.cp
    v = w.cfg.vocab_size / lay.tp
    ph = head_gemm(w, lay, gpu)
    # logits: bf16 write, fp32 copy, log-softmax write; backward reads them back and writes grads
    per_logit = (a + 4 + 4 + 4) if outside_blocks(lay, kernels) == "eager" else (a + 4)
    bw = gpu.speeds.op_bandwidth(tokens * v * 4, 2 * tokens * v * 4, efficiency=False)  # fp32 logits in and out
    loss = tokens * v * per_logit / bw
    tp_f, tp_b = _head_tp(w, lay, gpu)
    if lay.recipe.cross_entropy == "fused":  # flash-attn's kernel: reads the logits; backward reads, writes grads
        loss = tokens * v * a / bw
        return Phase(ph.f + loss + tp_f, ph.b + 2 * loss + tp_b, ph.w)
    loss_b = 1.5 * loss
    if lay.recipe.cross_entropy == "loss_parallel":  # torch's decomposed ops, each a pass over the fp32 logits
        loss = loss_b = tokens * v * (a + LOSS_PARALLEL_BYTES) / bw
    ce_comm = 0.0
    if lay.tp > 1:  # the vocab-parallel loss's small all-reduces (latency-bound), forward only
        g = group_of(lay, "tp", gpu)
        ce_comm = sum(collective_time(gpu, "all_reduce", x, g)
                      for x in loss_all_reduces(tokens, lay.recipe.cross_entropy))
    # our chunked loss keeps no logits but its last chunk's: backward recomputes the head's forward GEMM
    # for the chunks before it (zero bubble's W replays all of them again: `stage_phases`)
    chunked = lay.recipe.cross_entropy == "chunked"
    replay = ph.f * loss_replayed_tokens(tokens, lay.recipe.loss_chunk_tokens) / tokens if chunked else 0.0
    return Phase(ph.f + loss + tp_f + ce_comm, ph.b + loss_b + tp_b + replay, ph.w)


def split_backward(lay: Layout) -> bool:
    """Whether the pipeline splits each backward into B and W (zero bubble's schedule)."""
    return lay.pp > 1 and lay.pp_schedule == "zb"


def _head_tp(w: Workload, lay: Layout, gpu: GPUSpec) -> tuple[float, float]:
    """The LM head's TP collectives, forward and backward: under SP the all-gather of the sequence shards
    and its reduce-scatter; without, the f operator's all-reduce of the input gradient, backward only."""
    if lay.tp == 1:
        return 0.0, 0.0
    g = group_of(lay, "tp", gpu)
    act = lay.micro_batch * w.seq_len / lay.cp * w.cfg.hidden_size * act_bytes(lay.precision)
    if not lay.sp:
        return 0.0, collective_time(gpu, "all_reduce", act, g)
    return collective_time(gpu, "all_gather", act, g), collective_time(gpu, "reduce_scatter", act, g)


def embed_phase(w: Workload, lay: Layout, gpu: GPUSpec, kernels: str = "fused") -> Phase:
    a = act_bytes(lay.precision)
    tokens = lay.micro_batch * w.seq_len / lay.cp
    act = tokens * w.cfg.hidden_size * a
    tp_f = tp_b = 0.0  # the g operator's all-reduce forward; under SP a reduce-scatter, its all-gather backward
    if lay.tp > 1:
        g = group_of(lay, "tp", gpu)
        tp_f = collective_time(gpu, "reduce_scatter" if lay.sp else "all_reduce", act, g)
        tp_b = collective_time(gpu, "all_gather", act, g) if lay.sp else 0.0
    # gather rows forward; scatter-add fp32 gradient rows backward (memory-bound)
    bw = gpu.speeds.op_bandwidth(act, 2 * act, efficiency=False)
    wgrad = tokens * w.cfg.hidden_size * 8 / bw
    if outside_blocks(lay, kernels) == "eager":
        # torch's dense embedding backward zero-fills a [vocab/tp, h] fp32 gradient before the scatter;
        # a tied head on the same rank has its gradient summed with it by autograd (read 2, write 1)
        table = w.cfg.vocab_size * w.cfg.hidden_size / lay.tp
        dense = table * 4 * (1 + (3 if w.cfg.tie_embeddings and lay.pp == 1 else 0))
        wgrad += dense / gpu.speeds.op_bandwidth(table * 4, table * 4) + grad_accumulation(gpu, lay, table, kernels)
    return Phase(2 * act / bw + tp_f, tp_b, wgrad)


def stage_phases(w: Workload, lay: Layout, gpu: GPUSpec, kernels: str = "fused") -> list[Phase]:
    """Per global pipeline stage (chunk), the F/B/W seconds of one micro-batch. They depend neither on
    the ZeRO stage nor on the schedule (beyond its chunks): memoised on the layout without them, so the
    search's ZeRO and 1F1B/ZB variants of a layout share them; zero bubble's one difference is added
    here: its W re-enters the chunked loss and replays the head's forward GEMM for every chunk. Last, they
    are scaled by our recipe's measured step factor and by the expected slowest of the layout's chips."""
    phases = list(_stage_phases(w, Without(lay, _NOT_IN_PHASES), Same(gpu), kernels))
    if split_backward(lay) and lay.recipe.cross_entropy == "chunked":
        last = phases[-1]
        phases[-1] = Phase(last.f, last.b, last.w + head_gemm(w, lay, gpu).f)
    if (k := our_step_factor(lay, gpu, kernels) * slowest_chip(lay.world, gpu.efficiency.chip_spread)) != 1.0:
        phases = [ph.scale(k) for ph in phases]
    return phases


def our_step_factor(lay: Layout, gpu: GPUSpec, kernels: str) -> float:
    """Our recipe's per-GPU work on a GPU where its step was measured against this model (`Efficiency.our_step`,
    from gpu_check): measured / modelled; 1 for other frameworks' recipes and unmeasured GPUs."""
    return gpu.efficiency.our_step.get(kernels, 1.0) if not_ours(lay.recipe) is None else 1.0


def head_gemm(w: Workload, lay: Layout, gpu: GPUSpec) -> Phase:
    """The LM head's GEMMs (forward, input and weight gradients) for one micro-batch, its vocabulary slice
    under tp: `head_phase`'s linear, and what zero bubble's W replays (its forward)."""
    tokens = lay.micro_batch * w.seq_len / lay.cp
    return _head_linear(gpu, tokens, w.cfg.vocab_size / lay.tp, w.cfg.hidden_size,
                        gpu.flops(compute_dtype(lay.precision)), act_bytes(lay.precision))


_NOT_IN_PHASES = frozenset({"zero", "pp_schedule"})


@lru_cache(maxsize=4096)
def _stage_phases(w: Workload, key: Without, same_gpu: Same, kernels: str) -> tuple[Phase, ...]:
    lay: Layout = key.obj
    gpu: GPUSpec = same_gpu.obj
    cfg = w.cfg
    chunks = lay.pp * lay.pp_virtual
    per_chunk = chunk_layers(w, lay)
    cache: dict[bool, Phase] = {}
    moe = w.moe_spec
    out, start = [], 0
    for s in range(chunks):
        ph = ZERO
        n_moe = sum(1 for i in range(start, start + per_chunk[s]) if i >= moe.first_dense_layers) if moe else 0
        for key, count in ((False, per_chunk[s] - n_moe), (True, n_moe)):
            if count:
                if key not in cache:
                    first = moe.first_dense_layers if key and moe else 0
                    cache[key] = _layer_phase(w, Without(lay, _NOT_IN_LAYER), same_gpu, first, kernels)
                ph = ph + cache[key].scale(count)
        start += per_chunk[s]
        if s == 0:
            ph = ph + embed_phase(w, lay, gpu, kernels)
        if s == chunks - 1:
            # the final norm's gradient and an untied (or other-stage) head's are accumulated here
            head = cfg.hidden_size + (cfg.vocab_size * cfg.hidden_size / lay.tp
                                      if not cfg.tie_embeddings or lay.pp > 1 else 0)
            ph = ph + head_phase(w, lay, gpu, kernels) + Phase(*gpu.speeds.host_ends(lay.tp), 0.0)
            ph = ph + Phase(0.0, 0.0, grad_accumulation(gpu, lay, head, kernels))
        out.append(ph)
    if lay.recipe.pp_p2p == "blocking" and chunks > 1:  # the sender waits for its transfer
        hop = pp_hop_time(w, lay, gpu)
        out = [Phase(ph.f + (hop if s < chunks - 1 else 0.0), ph.b + (hop if s > 0 else 0.0), ph.w)
               for s, ph in enumerate(out)]
    return tuple(out)


# What one decoder layer's phase does not read: the pipeline (its depth, chunks and schedule), ZeRO, and dp
# (its groups are tp, cp and ep, placed tp-innermost whatever dp and pp are). Memoised without them, the
# search's pipeline variants of a layout share it (its GEMM, attention and collective models are the cost).
_NOT_IN_LAYER = frozenset({"zero", "pp_schedule", "pp", "pp_virtual", "pp_layers", "dp", "zero3_gather"})


@lru_cache(maxsize=4096)
def _layer_phase(w: Workload, key: Without, same_gpu: Same, index: int, kernels: str) -> Phase:
    return layer_phase(w, key.obj, same_gpu.obj, index, kernels)


# ---------------------------------------------------------------- pipeline
SIM_MAX_MICROBATCHES = 48  # beyond this the makespan is extrapolated (it is affine in m)


@lru_cache(maxsize=2048)
def _simulate_cached(name: str, p: int, m: int, v: int, f: tuple[float, ...], b: tuple[float, ...],
                     w: tuple[float, ...], comm: float, all_warmup: bool) -> tuple[float, float]:
    # BW actions cost b + w, so the same costs serve split and unsplit schedules
    tl = simulate(_schedule(name, p, m, v, all_warmup), list(f), list(b), list(w), comm, record=False)
    return tl.makespan, tl.bubble_fraction


@lru_cache(maxsize=256)
def _schedule(name: str, p: int, m: int, v: int, all_warmup: bool) -> Schedule:
    """`make_schedule`, memoised: the search simulates its candidates on a few schedules (simulate only
    reads the schedule; building one is a good part of a simulation's cost)."""
    return make_schedule(name, p, m, v, all_warmup)


def pipeline_makespan(name: str, p: int, m: int, v: int, phases: list[Phase], comm: float,
                      all_warmup: bool = True) -> tuple[float, float]:
    """(makespan, bubble: the ranks' idle share of it) of one step's micro-batches through the pipeline, by
    simulating the schedule. For many micro-batches the steady state is periodic, so the makespan is affine
    in m: it is simulated at two sizes m1 < m2 (same divisibility) and extrapolated."""
    if p == 1:
        t = m * phases[0].total
        return t, 0.0
    f = tuple(x.f for x in phases)
    b = tuple(x.b for x in phases)
    w = tuple(x.w for x in phases)
    busy = m * sum(x.total for x in phases) / p
    cap = max(SIM_MAX_MICROBATCHES, 4 * p)
    if m <= cap:
        return _simulate_cached(name, p, m, v, f, b, w, comm, all_warmup)
    m1 = (cap // (2 * p)) * p if name == "interleaved" else cap // 2
    m2 = 2 * m1
    t1, _ = _simulate_cached(name, p, m1, v, f, b, w, comm, all_warmup)
    t2, _ = _simulate_cached(name, p, m2, v, f, b, w, comm, all_warmup)
    t = t1 + (m - m1) * (t2 - t1) / (m2 - m1)
    return t, idle_share([busy] * p, t)  # every rank at the mean busy time: the same total


def closed_form_makespan(name: str, p: int, m: int, v: int, phases: list[Phase], comm: float) -> float:
    """Fast estimate for ranking many candidates: the busiest rank's work plus the textbook bubble."""
    if p == 1:
        return m * phases[0].total
    per_rank = [sum(phases[c * p + r].total for c in range(v)) for r in range(p)]
    avg = sum(x.total for x in phases) / len(phases)
    if name == "zb":
        ff = sum(x.f for x in phases) / len(phases)
        bb = sum(x.b for x in phases) / len(phases)
        ww = sum(x.w for x in phases) / len(phases)
        bubble = (p - 1) * max(ff + bb - ww, 0.0)
    else:
        bubble = (p - 1) * avg
    return m * max(per_rank) + bubble + 2 * (p - 1) * comm


# ---------------------------------------------------------------- the step
@dataclass(frozen=True)
class StepTime:
    step: float
    pipeline: float  # F/B/W of all micro-batches through the pipeline incl. bubble and p2p
    bubble_fraction: float  # the pipeline's idle share, in [0, 1] (`schedules.Timeline.bubble_fraction`)
    dp_exposed: float  # gradient reduction and ZeRO gathers not hidden behind compute
    optimizer: float
    contention: float  # compute slowed by SMs that overlapped collectives occupy
    phases: tuple[Phase, ...]  # per stage, one micro-batch
    collectives: tuple[Collective, ...]
    exposed_by_dim: dict[str, float]
    tied_grads: float = 0.0  # the tied embedding's gradient swapped between first and last stage
    partial_grads: float = 0.0  # partial gradients (norms; MoE layers under SP) summed over tp: one all-reduce/step
    scalars: float = 0.0  # the step's one-number collectives (loss, gradient norm, pipeline statistics)


def step_time_floor(w: Workload, lay: Layout, gpu: GPUSpec, *, kernels: str = "fused") -> float:
    """The closed-form pipeline time alone: `step_time(..., exact=False).step` is this plus terms that are
    all >= 0 (exposed DP traffic, optimizer, SM contention, tied and norm gradients, step scalars), so never
    less.
    The search skips the full estimate of a layout whose floor already ranks it out."""
    gpu = gpu.sharing(lay.world)
    phases = stage_phases(w, lay, gpu, kernels)
    return closed_form_makespan(lay.pp_schedule, lay.pp, lay.microbatches(w), lay.pp_virtual, phases,
                                pp_hop_time(w, lay, gpu))


def step_time(w: Workload, lay: Layout, gpu: GPUSpec, *, kernels: str = "fused", exact: bool = True) -> StepTime:
    """One optimizer step on the busiest rank: the pipeline of all micro-batches, then what the data
    parallel traffic leaves exposed, the optimizer, SM contention, the tied gradient swap, the sum over tp of
    the partial gradients (norms; the MoE layers' under SP) and the scalars."""
    gpu = gpu.sharing(lay.world)  # CPU profiles: ranks on one node share its cores (no-op on datasheets)
    m = lay.microbatches(w)
    phases = stage_phases(w, lay, gpu, kernels)
    hop = pp_hop_time(w, lay, gpu)
    if exact:
        pipe, bubble = pipeline_makespan(lay.pp_schedule, lay.pp, m, lay.pp_virtual, phases, hop,
                                         lay.recipe.pp_all_warmup)
    else:
        pipe = closed_form_makespan(lay.pp_schedule, lay.pp, m, lay.pp_virtual, phases, hop)
        busy = m * sum(x.total for x in phases) / lay.pp
        bubble = idle_share([busy] * lay.pp, pipe)
    # the busiest pipeline rank for DP/optimizer purposes: rank 0 (embedding; finishes last in 1F1B)
    rank = _busiest_rank(w, lay)
    colls = step_collectives(w, lay, gpu, rank.params.dense, rank.params.expert, rank.layers, rank.moe_layers,
                             first=True, last=lay.pp == 1)
    scalars = [c for c in colls if c.kind is Traffic.SCALARS]  # the step's one-number collectives
    traffic = [c for c in colls if c.kind is not Traffic.SCALARS]
    acc = _Exposure()
    dp_exposed = _dp_exposed(w, lay, traffic, phases, rank, m, acc)
    optimizer = _optimizer_time(w, lay, gpu, rank)
    tied = _pipeline_exposed(w, lay, gpu, traffic, rank, m, hop, kernels, acc)
    contention = acc.hidden * min(1.0, NCCL_CHANNELS / gpu.sm_count)
    # after the dp reduction, before the norm: nothing left to hide it behind (its tp exposure: above)
    partial_grads = sum(c.time_per_step for c in traffic if c.kind is Traffic.PARTIAL_GRADS)
    sync = sum(c.time_per_step for c in scalars)
    for c in scalars:
        acc.add(report_dim(c.dim), c.time_per_step)
    step = pipe + dp_exposed + optimizer + contention + tied + partial_grads + sync
    return StepTime(step, pipe, bubble, dp_exposed, optimizer, contention, tuple(phases), tuple(colls), acc.by_dim,
                    tied, partial_grads, sync)


@dataclass(frozen=True)
class _Rank:
    """Pipeline rank 0's share: its parameters and its decoder layers (MoE ones among them)."""

    params: RankParams
    layers: int
    moe_layers: int


def _busiest_rank(w: Workload, lay: Layout) -> _Rank:
    ranges = rank_layers(chunk_layers(w, lay), lay.pp, lay.pp_virtual, 0)
    moe = w.moe_spec
    n_moe = sum(1 for r in ranges for i in r if moe and i >= moe.first_dense_layers)
    return _Rank(rank_params(w, lay, 0), sum(len(r) for r in ranges), n_moe)


@dataclass
class _Exposure:
    """A step's communication as it accumulates: exposed seconds per reported dimension, and the seconds
    hidden behind compute (which still cost SMs, see NCCL_CHANNELS)."""

    by_dim: dict[str, float] = field(default_factory=dict)
    hidden: float = 0.0

    def add(self, dim: str, seconds: float) -> None:
        self.by_dim[dim] = self.by_dim.get(dim, 0.0) + seconds


def _dp_exposed(w: Workload, lay: Layout, traffic: list[Collective], phases: list[Phase], rank: _Rank, m: int,
                acc: _Exposure) -> float:
    """Seconds of the gradient reductions and ZeRO gathers not hidden behind compute (see the module's
    overlap rules); what they hide goes to `acc.hidden`."""
    dense = rank.params.dense
    last_bwd = phases[0].b + phases[0].w  # rank 0's last action: backward of chunk 0
    first_fwd = phases[0].f
    emb_share = w.cfg.vocab_size * w.cfg.hidden_size / lay.tp / dense if dense else 0.0
    dp_exposed = 0.0
    for c in traffic:
        if c.dim == "dp_replicate":
            # HSDP: the gradient shard's all-reduce across the replicas, issued once after the last
            # reduce-scatter (parallel/zero.py `_reduce_replicas`): nothing left to hide it behind
            dp_exposed += c.time_per_step
            acc.add("dp", c.time_per_step)
            continue
        if c.dim not in ("dp_cp", "edp"):
            continue
        total = c.time_per_step
        grad_bytes = c.payload
        # the last bucket, reduced after the backward: at least the embedding's gradient, which is ready
        # only when the backward ends and, larger than a bucket, is one by itself (DDP, Megatron)
        last_bucket = max(DP_BUCKET / grad_bytes, emb_share if c.dim == "dp_cp" else 0.0) if grad_bytes else 0.0
        tail = c.time * min(1.0, last_bucket)
        if lay.zero == 3 and c.op in ("reduce_scatter", "all_gather"):
            e = 0.0  # exposure of the per-layer ZeRO-3 traffic is computed below, together
        elif not lay.recipe.dp_overlap:  # blocking: after the last backward, after the optimizer
            e = total
        elif c.op == "reduce_scatter" and c.count > 1:
            # ZeRO-2: a micro-batch's reduce-scatter runs while the rank computes the next micro-batch
            # (all of its chunks: f + b + w); only the last one has just its own backward to hide behind
            window = sum(phases[ch * lay.pp].total for ch in range(lay.pp_virtual))
            e = (c.count - 1) * max(0.0, c.time - window) + max(0.0, c.time - tail - last_bwd) + tail
        elif c.op == "all_gather":  # updated parameters, bucket by bucket behind the next step's first forward
            # (parallel.overlap_param_gather): the first bucket (DP_BUCKET of parameters) is waited before
            # the first layer runs, exposed; the rest hide behind that forward up to its duration
            head = c.time * min(1.0, DP_BUCKET / c.payload) if c.payload else 0.0
            e = head + max(0.0, total - head - first_fwd)
        else:  # gradient all-reduce / reduce-scatter: all but the last bucket behind the last backward
            e = max(0.0, total - tail - last_bwd) + tail
        dp_exposed += e
        acc.hidden += max(0.0, total - e)
        acc.add("dp", e)
    z3 = zero3_exposed(lay, traffic, phases[0], rank.layers, m, zero3_calls_per_layer(w.cfg, lay))
    dp_exposed += z3
    acc.hidden += max(0.0, sum(c.time_per_step for c in traffic if lay.zero == 3 and c.dim in ("dp_cp", "edp")) - z3)
    if z3:
        acc.add("dp", z3)
    return dp_exposed


def _optimizer_time(w: Workload, lay: Layout, gpu: GPUSpec, rank: _Rank) -> float:
    """The optimizer step over the rank's (ZeRO-sharded) parameters, exposed."""
    prec = STATE_PRECISIONS[lay.precision]
    shard = lay.zero_group if lay.zero >= 1 else 1
    rp = rank.params
    local = rp.dense / shard + rp.expert / (max(1, lay.dp * lay.cp // lay.ep) if lay.zero >= 1 else 1)
    per_param = OPTIMIZER_BYTES_PER_PARAM * (prec.param / 2 if lay.precision == "fp32" else 1)
    if lay.precision == "fp16":  # dynamic loss scaling: one more read of the fp32 gradients (inf/nan check)
        per_param += 4
    # the step runs tensor by tensor: its working set is about one layer's parameters at a time; its
    # parameter tensors: `layer_tensors` per decoder layer and, on rank 0, the embedding
    # (+ the final norm and an untied head when it is also the last stage)
    ends = 1 + ((2 if not w.cfg.tie_embeddings else 1) if lay.pp == 1 else 0)
    n = rank.layers
    return gpu.speeds.optimizer(local, per_param, per_param * local / max(1, n), layer_tensors(w.cfg) * n + ends)


def _pipeline_exposed(w: Workload, lay: Layout, gpu: GPUSpec, traffic: list[Collective], rank: _Rank, m: int,
                      hop: float, kernels: str, acc: _Exposure) -> float:
    """Report the exposure of the traffic inside the pipeline (tp, ep, pp, cp; already in the phases) per
    dimension and add what overlaps compute to `acc.hidden`; returns the tied gradient's swap seconds,
    which run after the pipeline."""
    n_layers = rank.layers
    tied = 0.0
    sp_overlaps = lay.sp and lay.tp > 1 and (lay.recipe.tp_overlap or lay.recipe.sp_inputs == "sharded")
    if sp_overlaps:  # a dense layer's GEMMs and TP collectives: what overlaps what
        lin, lc = dense_linears(w, lay, gpu), layer_comm(w, lay, gpu, False)
    tp_hidden = 0.0  # tp_overlap: SP collectives of the dense layers hidden under their GEMMs, per step
    if lay.recipe.tp_overlap and sp_overlaps:
        _, (hf, hb) = tp_overlap_split(lc, lay.tp, lin.qkv, lin.o, lin.up, lin.down)
        tp_hidden = m * (n_layers - rank.moe_layers) * (hf * (2 if lay.recompute == "full" else 1) + hb)
        acc.hidden += tp_hidden
    for c in traffic:
        if c.kind is Traffic.SP_REGATHER:  # partly hidden under the input-gradient GEMMs
            acc.add("tp", m * n_layers * sum(sp_regather_split(lc, lin.qkv, lin.up)[0]))
        elif c.dim in ("tp", "ep"):
            acc.add(c.dim, c.time_per_step)
            if c.kind is Traffic.SP_LAYERS:  # tp_overlap: the dense layers' share hides under their GEMMs
                acc.by_dim["tp"] -= tp_hidden / 2  # half on the all-gathers, half on the reduce-scatters
        elif c.kind is Traffic.TIED:
            tied += c.time_per_step + tied_pack_add(gpu, c.payload, outside_blocks(lay, kernels))
            acc.add("pp", c.time_per_step)
        elif c.kind is Traffic.STAGE:
            acc.add("pp", 2 * (lay.pp - 1) * hop)
    if sp_overlaps and lay.recipe.sp_inputs == "sharded":  # the backward re-gathers under GEMMs
        acc.hidden += m * n_layers * sp_regather_split(lc, lin.qkv, lin.up)[1]
    if lay.cp > 1:
        cp = cp_layer_cost(w, lay, gpu, *attention_times(w, lay, gpu))
        fwd_passes = cp_forward_passes(lay.recompute)
        acc.by_dim["cp"] = m * n_layers * (cp.fwd_exposed * fwd_passes + cp.bwd_exposed)
        acc.hidden += m * n_layers * (cp.fwd_hidden * fwd_passes + cp.bwd_hidden)
    return tied


@dataclass(frozen=True)
class DenseLinears:
    """A dense layer's GEMM phases for one micro-batch on one GPU: q, one of k/v, the output projection,
    the MLP's column-parallel part (gate + up for SwiGLU) and down. What the SP collectives and re-gathers
    hide behind, and what op-level SAC replays."""

    q: Phase
    k: Phase
    o: Phase
    up: Phase  # gate and up together for SwiGLU
    down: Phase
    mats: int  # MLP matmuls (3 for SwiGLU)

    @property
    def qkv(self) -> Phase:
        return self.q + self.k.scale(2)

    def named(self, name: str) -> Phase:
        """One linear by its name in `flops.sac_op_replayed_matmuls` (gate and up are each half of `up`)."""
        if name in ("gate", "up") and self.mats == 3:
            return self.up.scale(0.5)
        return {"q": self.q, "k": self.k, "v": self.k, "o": self.o, "up": self.up, "down": self.down}[name]


def dense_linears(w: Workload, lay: Layout, gpu: GPUSpec) -> DenseLinears:
    cfg, a, fp8 = w.cfg, act_bytes(lay.precision), fp8_of(lay)
    peak = gpu.flops(compute_dtype(lay.precision))
    tokens, h, tp = lay.micro_batch * w.seq_len / lay.cp, cfg.hidden_size, lay.tp
    hq, kvl = cfg.n_heads * cfg.head_dim / tp, kv_heads_per_tp_rank(cfg, tp) * cfg.head_dim
    f = cfg.ffn_hidden_size / tp
    mats = 3 if cfg.mlp == "swiglu" else 2

    def linear(n_out: float, n_in: float) -> Phase:
        return _linear(gpu, tokens, n_out, n_in, peak, a, fp8)

    return DenseLinears(linear(hq, h), linear(kvl, h), linear(h, hq), linear(f, h).scale(mats - 1), linear(h, f), mats)


def zero3_exposed(lay: Layout, colls: tuple[Collective, ...] | list[Collective], ph: Phase, n_layers: int,
                  m: int, calls: int) -> float:
    """ZeRO-3 per micro-batch: forward gathers each layer while the previous one computes (prefetch of
    one layer), so a layer's gather is exposed by what exceeds one layer's forward, plus the first
    layer's gather; backward runs the next layer's gather and this layer's gradient reduce-scatter
    together behind one layer's backward, plus the last reduce-scatter. With pp and
    zero3_gather="step" the stage is gathered and reduced once per step instead.
    `zero3_fetch="per_param_sync"` (DeepSpeed's ZeRO-3 of 2021): `calls` collectives of each kind per layer, one
    per parameter tensor (`comm.zero3_calls_per_layer`), each gather exposed, and each collective costs a copy
    kernel per rank of the group besides; the reduce-scatters (with their copies) still run behind the backward."""
    if lay.zero != 3:
        return 0.0
    tg = sum(c.time for c in colls if c.dim in ("dp_cp", "edp") and c.op == "all_gather")
    trs = sum(c.time for c in colls if c.dim in ("dp_cp", "edp") and c.op == "reduce_scatter")
    if not tg and not trs:
        return 0.0
    n = max(1, n_layers)
    f_l, b_l = ph.f / n, (ph.b + ph.w) / n
    if lay.recipe.zero3_fetch == "per_param_sync":  # tg, trs: one tensor's; a layer issues `calls` of each
        copies = lay.zero_group * KERNEL_OVERHEAD
        gather, rs = calls * (tg + copies if tg else 0.0), calls * (trs + copies if trs else 0.0)
        return m * (2 * n * gather + n * max(0.0, rs - b_l) + rs)
    fwd = n * max(0.0, tg - f_l) + tg
    bwd = n * max(0.0, tg + trs - b_l) + trs
    if lay.pp > 1 and lay.zero3_gather == "step":
        # gathered layer by layer during the first micro-batch's forward, reduce-scattered layer by
        # layer during the last one's backward: once per step
        return fwd + n * max(0.0, trs - b_l) + trs
    return m * (fwd + bwd)


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    hfu: float
    model_flops_per_token: float
    hardware_flops_per_token: float


def throughput(w: Workload, lay: Layout, gpu: GPUSpec, st: StepTime) -> Throughput:
    tps = w.tokens_per_step / st.step
    peak = gpu.flops(compute_dtype(lay.precision))
    mf = model_flops_per_token(w.cfg, w.seq_len, moe=w.moe_spec, documents=w.documents)
    hf = hardware_flops_per_token(w.cfg, w.seq_len, lay.recompute, moe=w.moe_spec, documents=w.documents,
                                  cross_entropy=lay.recipe.cross_entropy, split_backward=split_backward(lay),
                                  loss_tokens=lay.micro_batch * w.seq_len / lay.cp,
                                  chunk_tokens=lay.recipe.loss_chunk_tokens)
    return Throughput(tps, tps / lay.world, tps * mf / (lay.world * peak), tps * hf / (lay.world * peak), mf, hf)
