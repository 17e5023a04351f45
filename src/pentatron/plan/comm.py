"""Communication: which collectives a layout issues, how many bytes each GPU moves per step per mesh
dimension, and how long each takes on the hardware (alpha-beta model on ring algorithms).

Byte counts use the same convention as the trainer's ledger (`distributed/ring.ring_bytes`): what one
rank sends on the wire under NCCL's bandwidth-optimal ring, all-reduce 2(n-1)/n S, all-gather and
reduce-scatter (n-1)/n S, all-to-all (n-1)/n S, send S. Time = steps * alpha + wire bytes / bus
bandwidth, where bus bandwidth is NVLink inside a node or, for a group spread over nodes with k of
its ranks per node, min(NVLink, k * per-GPU NIC) (rail-optimised nodes: one NIC per GPU), both times
`collective_efficiency`; a `pentatron bench` profile replaces the link model by measured curves. The
seconds come from the hardware's speeds (`GPUSpec.speeds`, hardware/speeds.py); each collective carries a
typed `Traffic` kind that the time model dispatches on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from functools import lru_cache

from pentatron.hardware.catalogue import GPUSpec
from pentatron.hardware.speeds import Group, wire_bytes
from pentatron.models.config import ModelConfig
from pentatron.plan.context import (
    CpLayerCost,
    allgather_exposure,
    allgather_kv_elements,
    cp_degrees,
    kv_block_bytes,
    kv_heads_after_ulysses,
    layer_cost,
)
from pentatron.plan.flops import MoESpec, layer_tensors
from pentatron.plan.layout import Layout, Workload, kv_heads_per_tp_rank, nodes_spanned
from pentatron.plan.memory import DP_BUCKET, act_bytes

__all__ = ["Collective", "Group", "LayerComm", "Traffic", "collective_time", "dp_in_step_time", "group_of",
           "layer_comm", "p2p_time", "pp_hop_time", "scalar_time", "step_collectives", "wire_bytes"]


def group_of(lay: Layout, dim: str, gpu: GPUSpec) -> Group:
    """Placement of one group of `dim` in the (pp, dp, cp, tp) rank order (tp innermost)."""
    return _group(dim, lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.cp_mode, lay.cp_ulysses, gpu.gpus_per_node,
                  lay.par.shard_degree)


@lru_cache(maxsize=4096)  # the search asks for the same few groups ~10^5 times
def _group(dim: str, dp: int, tp: int, pp: int, cp: int, ep: int, cp_mode: str, cp_ulysses: int,
           gpus_per_node: int, shard: int) -> Group:
    u, r = cp_degrees(cp, cp_mode, cp_ulysses)
    size, stride = {
        "tp": (tp, 1),
        "cp": (cp, tp),
        "cp_ulysses": (u, tp),  # hybrid: Ulysses over consecutive cp ranks (inside a node) ...
        "cp_ring": (r, tp * u),  # ... and the ring over those groups
        "dp": (dp, tp * cp),
        "dp_cp": (dp * cp, tp),  # dense gradients reduce over dp x cp
        "dp_shard": (shard, tp * cp),  # HSDP: ZeRO's shard group, consecutive dp ranks ...
        "dp_replicate": (max(1, dp // shard), tp * cp * shard),  # ... and the replicas of a shard
        "ep": (ep, tp),  # experts borrow consecutive ranks of dp x cp
        "edp": (max(1, dp * cp // ep), tp * ep),  # expert gradients
        "pp": (pp, dp * cp * tp),
    }[dim]
    per_node, nodes = nodes_spanned(size, stride, gpus_per_node)
    return Group(dim, size, per_node, nodes)


def bus_bandwidth(gpu: GPUSpec, op: str, payload: float, g: Group) -> float:
    """Achievable bus bandwidth (bytes/s) for `op` on group `g`."""
    return gpu.speeds.bus_bandwidth(op, payload, g)


def collective_time(gpu: GPUSpec, op: str, payload: float, g: Group) -> float:
    """Seconds for one collective of `payload` bytes (the logical buffer, as in the ledger)."""
    if g.size <= 1 or payload <= 0:
        return 0.0
    return gpu.speeds.collective(op, payload, g)


def dp_in_step_time(gpu: GPUSpec, op: str, payload: float, g: Group) -> float:
    """A per-step gradient collective (or the parameters' all-gather after the optimizer) as the step
    meets it, after a backward's compute (measured on CPU profiles, calibrate/dp_step.py)."""
    if g.size <= 1 or payload <= 0:
        return 0.0
    return gpu.speeds.dp_collective(op, payload, g)


def scalar_time(gpu: GPUSpec, op: str, nbytes: float, g: Group) -> float:
    """One of the step's scalar collectives (`step_scalars`): its latency, or the scalar all-reduce a
    CPU profile measured inside a step."""
    if g.size <= 1:
        return 0.0
    return gpu.speeds.scalar(op, nbytes, g)


def p2p_time(gpu: GPUSpec, nbytes: float, inter_node: bool, both_ways: bool = False) -> float:
    """One send/recv of `nbytes` (`both_ways`: two ranks swap `nbytes` at once)."""
    if nbytes <= 0:
        return 0.0
    return gpu.speeds.p2p(nbytes, inter_node, both_ways)


# ---------------------------------------------------------------- what a layout communicates
class Traffic(Enum):
    """What a collective carries, for the time model's overlap rules; the value is the report's text."""

    LAYERS = "layers fwd+bwd"  # TP all-reduces of the f/g operators
    SP_LAYERS = "layers fwd+bwd (SP)"
    SP_REGATHER = "block inputs again in bwd (SP, sharded inputs)"
    # replicated weights' partial gradients: the norms', and under SP the MoE layers'
    PARTIAL_GRADS = "partial gradients summed over tp, once per step (SP norms and MoE layers, Qwen3 q/k norms)"
    LOSS = "vocab-parallel loss"
    CP_KV_GATHER = "ring attention K/V (all-gather)"
    CP_KV = "ring attention K/V"
    CP_DKV = "ring attention dK/dV (fp32)"
    ULYSSES_Q = "Ulysses q in, output back"
    ULYSSES_KV = "Ulysses k, v in"
    MOE = "MoE dispatch/combine"
    MOE_SP = "MoE under SP: router counts summed over tp"
    STAGE = "stage boundary"
    TIED = "tied embedding gradient"
    GRADIENTS = "gradients"
    GRADIENTS_REPLICAS = "gradient shards across HSDP replicas"
    PARAMETERS = "updated parameters"
    GRADIENTS_PER_MICROBATCH = "gradients per micro-batch"
    ZERO3_GRADIENTS_PER_STEP = "gradients per layer, once per step"
    ZERO3_PARAMETERS_PER_STEP = "parameters per layer, once per step"
    ZERO3_GRADIENTS = "gradients per layer and micro-batch"
    ZERO3_PARAMETERS = "parameters per layer, fwd+bwd per micro-batch"
    SCALARS = "step scalars (loss, gradient norm, pipeline statistics)"


@dataclass(frozen=True)
class Collective:
    """One kind of collective issued `count` times per step by one GPU."""

    dim: str
    op: str
    payload: float  # bytes per call (the logical buffer, as in the ledger)
    count: float  # calls per step on the busiest rank
    time: float  # seconds per call
    kind: Traffic  # what it carries (and which phase issues it)
    wire: float  # bytes this GPU sends per call (ledger convention)

    @property
    def where(self) -> str:
        """The report's text for `kind`."""
        return self.kind.value

    @property
    def bytes_per_step(self) -> float:
        return self.wire * self.count

    @property
    def time_per_step(self) -> float:
        return self.time * self.count


def _coll(gpu: GPUSpec, g: Group, op: str, payload: float, count: float, kind: Traffic,
          timed: Callable[[GPUSpec, str, float, Group], float] | None = None) -> Collective:
    """`timed`: seconds per call (default `collective_time`; the in-step and scalar readings otherwise)."""
    return Collective(g.dim, op, payload, count, (timed or collective_time)(gpu, op, payload, g), kind,
                      wire_bytes(op, payload, g.size))


@dataclass(frozen=True)
class LayerComm:
    """Per decoder layer and micro-batch, the communication on the critical path of compute."""

    tp_fwd: float  # seconds, exposed (TP/SP collectives are on the critical path)
    tp_bwd: float
    ep_fwd: float  # seconds of MoE all-to-all (exposed)
    ep_bwd: float
    sp_regather: float = 0.0  # one backward all-gather of a block input (sp_inputs="sharded"), x2 per layer
    sp_all_gather: float = 0.0  # one SP all-gather of a block input (2 per layer forward, 2 backward)
    sp_reduce_scatter: float = 0.0  # one SP reduce-scatter of a block output (likewise)


def layer_comm(w: Workload, lay: Layout, gpu: GPUSpec, layer_is_moe: bool) -> LayerComm:
    cfg = w.cfg
    a = act_bytes(lay.precision)
    tokens = lay.micro_batch * w.seq_len // lay.cp
    act = tokens * cfg.hidden_size * a  # one full [b, s/cp, h] activation
    tp_g = group_of(lay, "tp", gpu)
    ag = rs = 0.0
    if lay.sp:  # all-gather before, reduce-scatter after attention and MLP
        ag, rs = collective_time(gpu, "all_gather", act, tp_g), collective_time(gpu, "reduce_scatter", act, tp_g)
        tp_one = ag + rs
    else:  # the f/g operators: one all-reduce after attention and one after the MLP
        tp_one = collective_time(gpu, "all_reduce", act, tp_g)
    # ours runs an MoE layer's MoE block outside the tp regions (whole on every tp rank; under SP on its
    # sequence shard, parallel/moe_tokens.py): only the attention's collective each way
    blocks = 1 if layer_is_moe and lay.recipe.moe_tp == "replicated" else 2
    tp_fwd = blocks * tp_one if lay.tp > 1 else 0.0
    ep_fwd = ep_bwd = 0.0
    moe: MoESpec | None = w.moe_spec
    if layer_is_moe and moe is not None and lay.ep > 1:
        g = group_of(lay, "ep", gpu)
        routed = moe_tokens(tokens, lay) * moe.top_k * cfg.hidden_size * a
        ep_fwd = 2 * collective_time(gpu, "all_to_all", routed, g)  # dispatch + combine
        ep_bwd = ep_fwd
    regather = 0.0
    if lay.tp > 1 and lay.sp and lay.recipe.sp_inputs == "sharded":
        regather = collective_time(gpu, "all_gather", act, tp_g)
    return LayerComm(tp_fwd, tp_fwd, ep_fwd, ep_bwd, regather, ag, rs)


def moe_tokens(tokens: int, lay: Layout) -> int:
    """Tokens an MoE layer of a rank routes per micro-batch: under SP its sequence shard (the layer runs
    outside the tp regions, parallel/moe_tokens.py), else all `tokens` it holds."""
    return tokens // lay.tp if lay.sp and lay.tp > 1 else tokens


def moe_sp_collectives(w: Workload, lay: Layout, gpu: GPUSpec, m: int, moe_layers: int) -> list[Collective]:
    """Under SP each tp rank's MoE layers route its sequence shard (parallel/moe_tokens.py): per layer and
    micro-batch the router's E counts are summed over tp (fp32). (The layers' gradients, partial per tp
    rank, join the step's one sum of partial gradients: `partial_grad_bytes`.)"""
    g = group_of(lay, "tp", gpu)
    return [_coll(gpu, g, "all_reduce", 4 * w.moe_spec.num_experts, m * moe_layers, Traffic.MOE_SP)]


def partial_grad_bytes(w: Workload, lay: Layout, layers: int, moe_layers: int, last: bool) -> float:
    """The gradients a rank sums over tp once per step, in ONE all-reduce after the data-parallel reduction
    (parallel/step_runner.py `sum_partial_grads`): replicated weights whose gradient each tp rank computed
    from its share of the work. Under SP every norm (2 per layer, the final norm on the last stage; each
    rank's gradient covers its sequence shard) and, our MoE layers being replicated over tp
    (`Recipe.moe_tp`), every parameter of its `moe_layers` (router, this ep rank's experts, shared experts:
    each rank routed its sequence shard); with Qwen3's q/k norms the two head_dim gains per layer (each
    rank's covers its heads), SP or not. The gradient buffer's dtype, and under ZeRO >= 1 only the pieces
    this rank owns: 1/(dp×cp) of the dense ones on average, 1/edp of the experts (their engine shards over
    the expert-data group)."""
    if lay.tp == 1:
        return 0.0
    cfg, moe = w.cfg, w.moe_spec
    dense = experts = 0.0
    if lay.sp:
        dense = (2 * layers + (1 if last else 0)) * cfg.hidden_size
        if moe is not None and moe_layers and lay.recipe.moe_tp == "replicated":  # others shard experts over tp
            h = cfg.hidden_size
            shared = 3 * h * moe.shared_ffn * moe.n_shared_experts
            dense += moe_layers * (moe.num_experts * h + shared)
            experts = moe_layers * 3 * h * moe.expert_ffn_hidden_size * moe.num_experts / lay.ep
    if cfg.qk_norm:
        dense += 2 * layers * cfg.head_dim
    if lay.zero >= 1:
        dense, experts = dense / lay.zero_group, experts / max(1, lay.dp * lay.cp // lay.ep)
    return (dense + experts) * lay.grad_bytes


def _ulysses_payloads(w: Workload, lay: Layout) -> tuple[float, float]:
    """Bytes one rank holds of q (or the attention output) and of k (or v) for one Ulysses all-to-all."""
    cfg, a = w.cfg, act_bytes(lay.precision)
    tokens = lay.micro_batch * w.seq_len // lay.cp
    u, _ = cp_degrees(lay.cp, lay.cp_mode, lay.cp_ulysses)
    kv = kv_heads_after_ulysses(kv_heads_per_tp_rank(cfg, lay.tp), u)
    return tokens * cfg.n_heads / lay.tp * cfg.head_dim * a, tokens * kv * cfg.head_dim * a


def _ring_block(w: Workload, lay: Layout) -> float:
    u, _ = cp_degrees(lay.cp, lay.cp_mode, lay.cp_ulysses)
    return kv_block_bytes(lay.micro_batch * w.seq_len // lay.cp, kv_heads_per_tp_rank(w.cfg, lay.tp),
                          w.cfg.head_dim, u, act_bytes(lay.precision))


def _ring_dkv_block(w: Workload, lay: Layout) -> float:
    """The dK/dV accumulator that travels beside a K/V block in backward: the same elements, in fp32."""
    return _ring_block(w, lay) * 4 / act_bytes(lay.precision)


def cp_allgather_payloads(w: Workload, lay: Layout) -> tuple[float, float]:
    """torch's all-gather ring attention, per layer and micro-batch: (the gathered K/V of all ranks, one
    pass of the rank's fp32 dK/dV accumulator) in bytes."""
    local = allgather_kv_elements(lay.micro_batch * w.seq_len // lay.cp, w.cfg.n_heads / lay.tp,
                                  kv_heads_per_tp_rank(w.cfg, lay.tp), w.cfg.head_dim, lay.recipe.cp_kv_heads)
    return local * lay.cp * act_bytes(lay.precision), local * 4


def cp_layer_cost(w: Workload, lay: Layout, gpu: GPUSpec, attn_f: float, attn_b: float) -> CpLayerCost:
    """Context parallelism's seconds per layer and micro-batch (plan/context.py), on this hardware."""
    u, r = cp_degrees(lay.cp, lay.cp_mode, lay.cp_ulysses)
    if r > 1 and lay.recipe.cp_rotate == "allgather":
        g = group_of(lay, "cp_ring", gpu)
        kv_all, dkv = cp_allgather_payloads(w, lay)
        gather, dkv_pass = collective_time(gpu, "all_gather", kv_all, g), p2p_time(gpu, dkv, g.crosses_nodes)
        fe, be, fh, bh = allgather_exposure(r, gather, dkv_pass, attn_f, attn_b)
        return CpLayerCost(fe, be, fh, bh, dkv_pass, (0.0, 0.0))
    hop = dkv_hop = 0.0
    if r > 1:
        inter = group_of(lay, "cp_ring", gpu).crosses_nodes
        hop, dkv_hop = p2p_time(gpu, _ring_block(w, lay), inter), p2p_time(gpu, _ring_dkv_block(w, lay), inter)
    tq = tkv = 0.0
    if u > 1:
        g = group_of(lay, "cp_ulysses", gpu)
        q, kv = _ulysses_payloads(w, lay)
        tq, tkv = collective_time(gpu, "all_to_all", q, g), collective_time(gpu, "all_to_all", kv, g)
    return layer_cost(u, r, hop, dkv_hop, tq, tkv, attn_f, attn_b)


def cp_forward_passes(recompute: str) -> float:
    """Forwards of the attention core per step: recompute that replays it (selective: the core; full:
    the block) runs its communication again; torchtitan's op-level SAC saves the attention output."""
    return {"selective": 2.0, "full": 2.0, "full-alternate": 1.5}.get(recompute, 1.0)


def pp_message_bytes(w: Workload, lay: Layout) -> float:
    """One activation (or gradient) sent between pipeline stages for one micro-batch, by each rank: its
    sequence shard under SP, a 1/tp slice of the replicated tensor with `pp_scatter_gather`."""
    tokens = lay.micro_batch * w.seq_len // lay.cp
    split = lay.tp if lay.sp or lay.recipe.pp_scatter_gather else 1
    return tokens * w.cfg.hidden_size * act_bytes(lay.precision) / split


def pp_regather_time(w: Workload, lay: Layout, gpu: GPUSpec) -> float:
    """`pp_scatter_gather` without SP: the receiving stage all-gathers the tp slices (inside the node)."""
    if not lay.recipe.pp_scatter_gather or lay.sp or lay.tp == 1:
        return 0.0
    tokens = lay.micro_batch * w.seq_len // lay.cp
    return collective_time(gpu, "all_gather", tokens * w.cfg.hidden_size * act_bytes(lay.precision),
                           group_of(lay, "tp", gpu))


LOSS_WHERE = Traffic.LOSS.value


def loss_all_reduces(tokens: float, cross_entropy: str = "eager") -> tuple[float, ...]:
    """Payloads of the vocab-parallel cross-entropy's all-reduces per micro-batch: ours (parallel/tensor.py)
    reduces the max of each token's logits (fp32), then each token's sum of exponentials and target logit
    together (Megatron's splits the second in two: its 3 calls move the same bytes); torch's
    loss_parallel reduces the max, the sum of exponentials and the target's log-probability apart."""
    if cross_entropy == "loss_parallel":
        return (4 * tokens, 4 * tokens, 4 * tokens)
    return (4 * tokens, 8 * tokens)


def pp_hop_time(w: Workload, lay: Layout, gpu: GPUSpec) -> float:
    """Seconds from a stage's send to the dependent action on the neighbour being able to start."""
    if lay.pp == 1:
        return 0.0
    nbytes = pp_message_bytes(w, lay)
    inter = group_of(lay, "pp", gpu).crosses_nodes
    hop = gpu.speeds.pp_hop(nbytes, inter) if nbytes > 0 else 0.0
    return hop + pp_regather_time(w, lay, gpu)


def step_collectives(w: Workload, lay: Layout, gpu: GPUSpec, dense_params: float, expert_params: float,
                     layers_on_rank: int, moe_layers_on_rank: int, first: bool, last: bool
                     ) -> list[Collective]:
    """Every collective one GPU of the busiest pipeline rank issues in one optimizer step."""
    cfg = w.cfg
    a = act_bytes(lay.precision)
    m = lay.microbatches(w)
    tokens = lay.micro_batch * w.seq_len // lay.cp
    act = tokens * cfg.hidden_size * a
    out: list[Collective] = []
    recompute_fwd = 1 if lay.recompute == "full" else 0  # full recompute replays the forward's TP comm
    if lay.tp > 1:
        g = group_of(lay, "tp", gpu)
        # all-reduces per micro-batch without SP: 2 per layer forward and 2 backward (and the forward's
        # again under full recompute), the embedding's forward and the LM head input's backward; SP
        # turns each into an all-gather and a reduce-scatter (one forward, the other backward). Ours runs
        # an MoE layer's MoE block outside the tp regions: its attention's half of them only.
        outside = moe_layers_on_rank if lay.recipe.moe_tp == "replicated" else 0
        per_mb = ((2 + 2 + 2 * recompute_fwd) * layers_on_rank - (1 + 1 + recompute_fwd) * outside
                  + (1 if first else 0) + (1 if last else 0))
        if lay.sp:
            out.append(_coll(gpu, g, "all_gather", act, m * per_mb, Traffic.SP_LAYERS))
            if lay.recipe.sp_inputs == "sharded":
                out.append(_coll(gpu, g, "all_gather", act, m * 2 * layers_on_rank, Traffic.SP_REGATHER))
            out.append(_coll(gpu, g, "reduce_scatter", act, m * per_mb, Traffic.SP_LAYERS))
        else:
            out.append(_coll(gpu, g, "all_reduce", act, m * per_mb, Traffic.LAYERS))
        partial = partial_grad_bytes(w, lay, layers_on_rank, moe_layers_on_rank, last)
        if partial:  # once per step, after the dp reduction: exposed before the optimizer; in buffers of at
            # most a DP bucket (tensor.PARTIAL_CHUNK_BYTES: the MoE layers' can be many)
            calls = math.ceil(partial / DP_BUCKET)
            out.append(_coll(gpu, g, "all_reduce", partial / calls, calls, Traffic.PARTIAL_GRADS))
        if last and lay.recipe.cross_entropy != "fused":
            loss = loss_all_reduces(tokens, lay.recipe.cross_entropy)
            out.append(_coll(gpu, g, "all_reduce", sum(loss) / len(loss), m * len(loss), Traffic.LOSS))
    if lay.cp > 1:
        u, r = cp_degrees(lay.cp, lay.cp_mode, lay.cp_ulysses)
        fwd = cp_forward_passes(lay.recompute)
        if r > 1 and lay.recipe.cp_rotate == "allgather":  # a K/V all-gather per call; backward r fp32 dK/dV passes
            g = group_of(lay, "cp_ring", gpu)
            kv_all, dkv = cp_allgather_payloads(w, lay)
            out.append(replace(_coll(gpu, g, "all_gather", kv_all, m * layers_on_rank * (fwd + 1),
                                     Traffic.CP_KV_GATHER), dim="cp"))
            out.append(Collective("cp", "send", dkv, m * layers_on_rank * r, p2p_time(gpu, dkv, g.crosses_nodes),
                                  Traffic.CP_DKV, dkv))
        elif r > 1:  # forward r-1 K/V blocks; backward r-1 K/V blocks and r passes of the fp32 dK/dV
            kv, dkv = _ring_block(w, lay), _ring_dkv_block(w, lay)
            g = group_of(lay, "cp_ring", gpu)
            calls = m * layers_on_rank * (r - 1) * (fwd + 1)
            out.append(Collective("cp", "send", kv, calls, p2p_time(gpu, kv, g.crosses_nodes), Traffic.CP_KV,
                                  kv))
            out.append(Collective("cp", "send", dkv, m * layers_on_rank * r, p2p_time(gpu, dkv, g.crosses_nodes),
                                  Traffic.CP_DKV, dkv))
        if u > 1:  # 4 all-to-alls per layer forward (q, k, v in; out back) and 4 backward
            g = group_of(lay, "cp_ulysses", gpu)
            q, kv = _ulysses_payloads(w, lay)
            per = m * layers_on_rank * (fwd + 1)
            out.append(replace(_coll(gpu, g, "all_to_all", q, 2 * per, Traffic.ULYSSES_Q), dim="cp"))
            out.append(replace(_coll(gpu, g, "all_to_all", kv, 2 * per, Traffic.ULYSSES_KV), dim="cp"))
    moe = w.moe_spec
    if lay.ep > 1 and moe is not None and moe_layers_on_rank:
        g = group_of(lay, "ep", gpu)
        routed = moe_tokens(tokens, lay) * moe.top_k * cfg.hidden_size * a
        out.append(_coll(gpu, g, "all_to_all", routed, m * moe_layers_on_rank * 4, Traffic.MOE))
    if lay.tp > 1 and lay.sp and moe is not None and moe_layers_on_rank:
        out += moe_sp_collectives(w, lay, gpu, m, moe_layers_on_rank)
    if lay.pp > 1:
        msg = pp_message_bytes(w, lay)
        g = group_of(lay, "pp", gpu)
        sends = m * lay.pp_virtual * 2 - (m if first else 0) - (m if last else 0)
        out.append(Collective("pp", "send", msg, sends, p2p_time(gpu, msg, g.crosses_nodes), Traffic.STAGE, msg))
    if lay.pp > 1 and cfg.tie_embeddings and (first or last):
        # the first and the last stage hold a copy of the tied embedding: after the DP reduction they
        # swap its (ZeRO-owned piece of the) gradient and add (parallel/data.sync_tied_grads; Megatron
        # all-reduces it over its embedding group: the same bytes), exposed before the optimizer
        tied = tied_grad_bytes(cfg.vocab_size * cfg.hidden_size / lay.tp, lay)
        g = group_of(lay, "pp", gpu)
        out.append(Collective("pp", "send", tied, 1, p2p_time(gpu, tied, g.crosses_nodes, both_ways=True),
                              Traffic.TIED, tied))
    out += dp_collectives(lay, gpu, dense_params, "dp_cp", m, a, layers_on_rank * zero3_calls_per_layer(cfg, lay))
    if expert_params:
        out += dp_collectives(lay, gpu, expert_params, "edp", m, a, max(1, moe_layers_on_rank))
    n_experts = w.moe_spec.num_experts if w.moe_spec is not None else 0
    return out + step_scalars(lay, gpu, moe_layers_on_rank, n_experts)


STEP_SCALARS_WHERE = Traffic.SCALARS.value


def step_scalars(lay: Layout, gpu: GPUSpec, moe_layers: int = 0, n_experts: int = 0) -> list[Collective]:
    """The trainer's one-number collectives of a step, each on the critical path (its result is needed
    at once): the loss's mean over dp x cp (parallel/step_runner.py); the squared gradient norm's sum
    over the ZeRO shards, over tp and over the pipeline stages (parallel/data.py); under pp the loss's
    broadcast from the last stage and the measured bubble's three statistics per stage, gathered in one
    all-gather (pipeline/engine.py).
    With MoE (`moe_layers` on this rank, of `n_experts`): each layer's loads summed over the dense
    replicas, one float64 vector of the expert counts and 5 totals (models/moe.py `finish_step`), and
    under ep the expert gradients' squared norm over their ZeRO shards (edp) and over ep, whose ranks
    hold the other experts (parallel/grouped.py). Latency only: `scalar_time`."""
    out: list[Collective] = []

    def add(dim: str, op: str, nbytes: float, count: int) -> None:
        g = group_of(lay, dim, gpu)
        if g.size > 1:
            out.append(_coll(gpu, g, op, nbytes, count, Traffic.SCALARS, scalar_time))

    add("dp_cp", "all_reduce", 4, 2 if lay.zero >= 1 else 1)  # the loss; the norm of the shards
    if moe_layers:
        add("dp_cp", "all_reduce", 8 * (n_experts + 5), moe_layers)  # the MoE layers' loads
        if lay.sp and lay.tp > 1:  # each tp rank's layers saw its sequence shard: loads summed over tp too
            add("tp", "all_reduce", 8 * (n_experts + 5), moe_layers)
        if lay.ep > 1:  # the expert engine's norm: its shards, then the other experts
            if lay.zero >= 1:
                add("edp", "all_reduce", 4, 1)
            add("ep", "all_reduce", 4, 1)
    add("tp", "all_reduce", 4, 1)
    if lay.pp > 1:
        add("pp", "broadcast", 4, 1)
        add("pp", "all_reduce", 4, 1)
        add("pp", "all_gather", 24 * lay.pp, 1)  # every stage's busy time, first start, last end (float64)
    return out


# the report's texts of some kinds (what tests and readers of `Collective.where` compare against)
TIED_WHERE = Traffic.TIED.value
SP_REGATHER_WHERE = Traffic.SP_REGATHER.value
SP_LAYERS_WHERE = Traffic.SP_LAYERS.value
LAYERS_WHERE = Traffic.LAYERS.value
PARTIAL_GRADS_WHERE = Traffic.PARTIAL_GRADS.value
MOE_SP_WHERE = Traffic.MOE_SP.value


def tied_grad_bytes(params: float, lay: Layout) -> float:
    """Bytes of the tied weight's gradient one rank sends its peer stage: the gradient buffer's dtype,
    only the piece it owns under ZeRO >= 1 (sharded over dp x cp)."""
    shard = lay.zero_group if lay.zero >= 1 else 1
    return params * lay.grad_bytes / shard


def zero3_calls_per_layer(cfg: ModelConfig, lay: Layout) -> int:
    """ZeRO-3's collectives of each kind per layer: one, or one per parameter tensor (`Recipe.zero3_fetch`
    "per_param_sync", DeepSpeed's ZeRO-3 of 2021)."""
    return layer_tensors(cfg) if lay.zero == 3 and lay.recipe.zero3_fetch == "per_param_sync" else 1


def dp_collectives(lay: Layout, gpu: GPUSpec, params: float, dim: str, m: int, a: int,
                   layers: int = 1) -> list[Collective]:
    """Gradient reduction (fp32, as the trainer's grad buffer) and ZeRO parameter gathers.
    ZeRO-0: one all-reduce per step; ZeRO-1: reduce-scatter (or all-reduce, `zero1_reduce`) + all-gather
    per step;
    ZeRO-2: gradients are sharded, so each micro-batch's are reduce-scattered; ZeRO-3: parameters are
    all-gathered layer by layer for forward and again for backward of every micro-batch, and gradients
    reduce-scattered layer by layer: one call per layer, so its latency is paid `layers` times.
    HSDP (dense gradients, dp_shard < dp): all of it within the shard group (consecutive ranks, inside a
    node when it fits), plus one all-reduce per step of the 1/shard of the gradients this rank holds,
    over the replicas (across nodes)."""
    g = group_of(lay, dim, gpu)
    if params <= 0:
        return []
    replicas: list[Collective] = []
    if dim == "dp_cp" and lay.par.hsdp:
        g = replace(group_of(lay, "dp_shard", gpu), dim=dim)  # reported and overlapped as the dp traffic
        r = group_of(lay, "dp_replicate", gpu)
        replicas = [_coll(gpu, r, "all_reduce", params * lay.grad_bytes / g.size, 1, Traffic.GRADIENTS_REPLICAS,
                          dp_in_step_time)] if r.size > 1 else []
        if g.size <= 1:
            return replicas
    if g.size <= 1:
        return []
    return _zero_collectives(lay, gpu, g, params, m, a, layers) + replicas


def _zero_collectives(lay: Layout, gpu: GPUSpec, g: Group, params: float, m: int, a: int,
                      layers: int) -> list[Collective]:
    grads, weights = params * lay.grad_bytes, params * a

    def after_compute(op: str, payload: float, count: float, kind: Traffic) -> Collective:
        """Issued after a backward (or the optimizer): as the step meets it (`dp_in_step_time`)."""
        return _coll(gpu, g, op, payload, count, kind, dp_in_step_time)

    if lay.zero == 0:
        return [after_compute("all_reduce", grads, 1, Traffic.GRADIENTS)]
    if lay.zero == 1:
        return [after_compute(lay.recipe.zero1_reduce, grads, 1, Traffic.GRADIENTS),
                after_compute("all_gather", weights, 1, Traffic.PARAMETERS)]
    if lay.zero == 2:
        return [after_compute("reduce_scatter", grads, m, Traffic.GRADIENTS_PER_MICROBATCH),
                after_compute("all_gather", weights, 1, Traffic.PARAMETERS)]
    n = max(1, layers)
    if lay.pp > 1 and lay.zero3_gather == "step":  # the stage stays gathered for the whole step
        return [_coll(gpu, g, "reduce_scatter", grads / n, n, Traffic.ZERO3_GRADIENTS_PER_STEP),
                _coll(gpu, g, "all_gather", weights / n, n, Traffic.ZERO3_PARAMETERS_PER_STEP)]
    return [_coll(gpu, g, "reduce_scatter", grads / n, m * n, Traffic.ZERO3_GRADIENTS),
            _coll(gpu, g, "all_gather", weights / n, 2 * m * n, Traffic.ZERO3_PARAMETERS)]


def report_dim(dim: str) -> str:
    """The dimension traffic is reported under: gradient reductions over dp x cp or the expert groups
    count as dp, context parallelism's ring and Ulysses groups as cp (training's ledger uses both names)."""
    return {"dp_cp": "dp", "edp": "dp", "dp_shard": "dp", "dp_replicate": "dp", "cp_ring": "cp",
            "cp_ulysses": "cp"}.get(dim, dim)


def bytes_by_dim(colls: list[Collective]) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in colls:
        key = report_dim(c.dim)
        out[key] = out.get(key, 0.0) + c.wire * c.count
    return out
