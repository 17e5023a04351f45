"""How fast kernels and collectives run: the one interface the time model reads (`Speeds`).

`Roofline` derives every speed from the datasheet (`catalogue.GPUSpec`: peaks times efficiencies, the link
model of NVLink and the NICs); `Measured` reads a `pentatron bench` profile (`profile.Profile`) where it
has a curve and falls back to the roofline where it has none. `GPUSpec.speeds` picks one: the roofline
for a datasheet, the measured speeds for a GPUSpec loaded with a profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from pentatron.distributed.ring import ring_bytes
from pentatron.hardware.fabric import FabricCurve
from pentatron.hardware.kernel_tables import attention_rate
from pentatron.hardware.profile import Curve, Profile, interp_log, measured_then_curve

KERNEL_OVERHEAD = 3e-6  # per GEMM launch/tail on the GPU (seconds)
Seconds3 = tuple[float, float, float]  # forward, input gradient, weight gradient


@dataclass(frozen=True)
class Group:
    """Where one communication group's ranks sit: `per_node` of them on each of `nodes` nodes."""

    dim: str
    size: int
    per_node: int  # ranks of this group inside one node
    nodes: int

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


def wire_bytes(op: str, payload: float, n: int) -> float:
    """Bytes one rank sends for `op` of `payload` over `n` ranks (the ledger's ring convention)."""
    if op == "all_to_all":
        return payload * (n - 1) / n if n > 1 else 0.0
    return float(ring_bytes(op, int(payload), n))


class _Efficiencies(Protocol):
    matmul: float
    collective: float
    hbm: float
    fabric: FabricCurve | None


class Datasheet(Protocol):
    """What the roofline reads of a device (`catalogue.GPUSpec`, which also picks the speeds: this module
    does not import it)."""

    hbm_bandwidth: float
    gpus_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float
    inter_node_latency: float
    efficiency: _Efficiencies
    profile: Profile | None

    @property
    def nics(self) -> int: ...
    def gemm_shape_efficiency(self, m: float, n: float, k: float, operand_bytes: int) -> float: ...
    def attention(self, kernel: str) -> tuple[float, float]: ...


class Speeds(Protocol):
    """Seconds (or rates) of the kernels and collectives one step runs, on one device."""

    def gemm(self, m: float, n: float, k: float, peak: float, a: int) -> float: ...
    def linear(self, tokens: float, n_out: float, n_in: float, peak: float, a: int) -> Seconds3: ...
    def head_linear(self, tokens: float, vocab: float, hidden: float, peak: float, a: int) -> Seconds3: ...
    def attention(self, flops: float, seq: float, head_dim: float, prec: str, kernel: str, peak: float,
                  launches: float) -> tuple[float, float]: ...
    def stream_bandwidth(self, nbytes: float, efficiency: bool = True) -> float: ...
    def op_bandwidth(self, operand_bytes: float, working_set: float, efficiency: bool = True) -> float: ...
    def fused_bandwidth(self, operand_bytes: float, working_set: float) -> float: ...
    def host_layer(self, tp: int, kernels: str = "eager") -> tuple[float, float]: ...
    def host_ends(self, tp: int) -> tuple[float, float]: ...
    def optimizer(self, params: float, bytes_per_param: float, working_set: float, tensors: int) -> float: ...
    def bus_bandwidth(self, op: str, payload: float, g: Group) -> float: ...
    def collective(self, op: str, payload: float, g: Group) -> float: ...
    def dp_collective(self, op: str, payload: float, g: Group) -> float: ...
    def scalar(self, op: str, nbytes: float, g: Group) -> float: ...
    def p2p(self, nbytes: float, inter_node: bool, both_ways: bool = False) -> float: ...
    def pp_hop(self, nbytes: float, inter_node: bool) -> float: ...


class Roofline:
    """Speeds from the datasheet alone."""

    def __init__(self, gpu: Datasheet) -> None:
        self.gpu = gpu

    # ---- kernels
    def gemm(self, m: float, n: float, k: float, peak: float, a: int) -> float:
        """C[m,n] = A[m,k] B[k,n]: max(compute at peak x matmul efficiency x the shape's efficiency (wave
        quantisation, small k: `GPUSpec.gemm_shape_efficiency`), HBM traffic) + the launch/tail."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        gpu = self.gpu
        compute = 2 * m * n * k / (peak * gpu.efficiency.matmul * gpu.gemm_shape_efficiency(m, n, k, a))
        traffic = (m * k + k * n + m * n) * a
        memory = traffic / self.stream_bandwidth(traffic, efficiency=False)
        return max(compute, memory) + KERNEL_OVERHEAD

    def linear(self, tokens: float, n_out: float, n_in: float, peak: float, a: int) -> Seconds3:
        """y = x W for `tokens` rows: forward, dX = dY W^T, dW = dY^T X (which is [n_out, n_in])."""
        return (self.gemm(tokens, n_out, n_in, peak, a), self.gemm(tokens, n_in, n_out, peak, a),
                self.gemm(n_out, n_in, tokens, peak, a))

    def head_linear(self, tokens: float, vocab: float, hidden: float, peak: float, a: int) -> Seconds3:
        return self.linear(tokens, vocab, hidden, peak, a)

    def attention(self, flops: float, seq: float, head_dim: float, prec: str, kernel: str, peak: float,
                  launches: float) -> tuple[float, float]:
        """A fused causal attention kernel of `flops` (forward) at its fraction of peak; backward does
        2.5x the forward's FLOPs (dQ, dK, dV, dP, QK^T again)."""
        eff_f, eff_b = self.gpu.attention(kernel, seq)
        return flops / (peak * eff_f) + launches, 2.5 * flops / (peak * eff_b) + launches

    def stream_bandwidth(self, nbytes: float, efficiency: bool = True) -> float:
        """Bytes/s a memory-bound kernel reaches: nominal HBM bandwidth (x its streaming efficiency)."""
        return self.gpu.hbm_bandwidth * (self.gpu.efficiency.hbm if efficiency else 1.0)

    def op_bandwidth(self, operand_bytes: float, working_set: float, efficiency: bool = True) -> float:
        """Bytes/s of an eager elementwise op on operands of `operand_bytes` inside a step."""
        return self.stream_bandwidth(working_set, efficiency)

    def fused_bandwidth(self, operand_bytes: float, working_set: float) -> float:
        """Bytes/s of a fused (compiled, or a framework's hand-fused) elementwise chain, counted in the
        bytes the fused model charges: one read and one write per chain, at the elementwise ops' speed."""
        return self.op_bandwidth(operand_bytes, working_set)

    def host_layer(self, tp: int, kernels: str = "eager") -> tuple[float, float]:
        """Host seconds per decoder layer outside the kernels: GPU launches overlap them (none)."""
        return (0.0, 0.0)

    def host_ends(self, tp: int) -> tuple[float, float]:
        return (0.0, 0.0)

    def optimizer(self, params: float, bytes_per_param: float, working_set: float, tensors: int) -> float:
        """The optimizer step as memory traffic: `bytes_per_param` per parameter, a working set of
        about one layer's parameters at a time."""
        return params * bytes_per_param / self.stream_bandwidth(working_set)

    # ---- communication
    def fabric_busbw(self, op: str, payload: float, g: Group) -> float | None:
        """The measured fabric's all-reduce bus bandwidth (its latency included) where it applies
        (hardware/fabric.py: node-full groups across nodes, on the fabric it was measured on), else None."""
        gpu, fab = self.gpu, self.gpu.efficiency.fabric
        if fab is None or op != "all_reduce" or not g.crosses_nodes:
            return None
        if not fab.applies(gpu.gpus_per_node, gpu.nics, gpu.inter_node_bandwidth, g.per_node, payload):
            return None
        return fab.bus_bandwidth(g.nodes, payload)

    def bus_bandwidth(self, op: str, payload: float, g: Group) -> float:
        """Bus bandwidth (bytes/s): NVLink inside a node; across nodes the measured fabric's where it applies,
        else the group's ranks on a node share that node's NICs; times the collective efficiency."""
        gpu = self.gpu
        if (measured := self.fabric_busbw(op, payload, g)) is not None:
            return measured
        if g.crosses_nodes:
            nic = gpu.inter_node_bandwidth * gpu.gpus_per_node / gpu.nics
            link = min(gpu.intra_node_bandwidth, min(g.per_node, gpu.nics) * nic)
        else:
            link = gpu.intra_node_bandwidth
        return link * gpu.efficiency.collective

    def collective(self, op: str, payload: float, g: Group) -> float:
        """Ring alpha-beta: steps x latency + wire bytes / bus bandwidth; an all-reduce across nodes takes
        NCCL's tree when its latency is lower; the measured fabric's curve where it applies."""
        gpu = self.gpu
        if (measured := self.fabric_busbw(op, payload, g)) is not None:  # its latency included
            return wire_bytes(op, payload, g.size) / measured
        steps = 2 * (g.size - 1) if op == "all_reduce" else g.size - 1
        alpha = gpu.inter_node_latency if g.crosses_nodes else gpu.intra_node_latency
        beta = wire_bytes(op, payload, g.size) / self.bus_bandwidth(op, payload, g)
        ring = steps * alpha + beta
        if op == "all_reduce" and g.crosses_nodes:
            return min(ring, self.tree_latency(g) + beta)
        return ring

    def tree_latency(self, g: Group) -> float:
        """NCCL's tree all-reduce (chosen for small messages across nodes): a chain inside each node and a
        binary tree across nodes, up (reduce) then down (broadcast): 2 (per_node - 1) intra-node hops and
        2 ceil(log2 nodes) inter-node hops; at large sizes it moves the same bytes per link as the ring."""
        return (2 * (g.per_node - 1) * self.gpu.intra_node_latency
                + 2 * math.ceil(math.log2(g.nodes)) * self.gpu.inter_node_latency)

    def dp_collective(self, op: str, payload: float, g: Group) -> float:
        """A per-step gradient collective (or the parameters' all-gather after the optimizer)."""
        return self.collective(op, payload, g)

    def scalar(self, op: str, nbytes: float, g: Group) -> float:
        """One of the step's one-number collectives: its latency."""
        return self.collective(op, nbytes, g) if nbytes > 0 else 0.0

    def p2p(self, nbytes: float, inter_node: bool, both_ways: bool = False) -> float:
        """One send/recv: latency + bytes / link bandwidth; links are full duplex, so a swap of `nbytes`
        both ways (`both_ways`) takes the one-way time."""
        gpu = self.gpu
        if inter_node:
            return gpu.inter_node_latency + nbytes / (gpu.inter_node_bandwidth * gpu.efficiency.collective)
        return gpu.intra_node_latency + nbytes / (gpu.intra_node_bandwidth * gpu.efficiency.collective)

    def pp_hop(self, nbytes: float, inter_node: bool) -> float:
        """A pipeline stage's send until the neighbour can start: one p2p transfer."""
        return self.p2p(nbytes, inter_node)


class Measured(Roofline):
    """Speeds from a measured profile, each curve replacing the roofline's term where present (inside the
    node for communication: bench measures one machine)."""

    def __init__(self, gpu: Datasheet, profile: Profile) -> None:
        super().__init__(gpu)
        self.profile = profile

    def gemm(self, m: float, n: float, k: float, peak: float, a: int) -> float:
        """fp32 GEMMs at bench's rate for a call of this many FLOPs (its per-call cost included)."""
        curve = self.profile.matmul_fp32
        if a != 4 or not curve or m <= 0 or n <= 0 or k <= 0:
            return super().gemm(m, n, k, peak, a)
        return 2 * m * n * k / interp_log(curve, 2 * m * n * k)

    def head_linear(self, tokens: float, vocab: float, hidden: float, peak: float, a: int) -> Seconds3:
        """The LM head's GEMMs at the rates measured for its shape (a wide output off a narrow input runs
        below the square curve)."""
        rows = self.profile.head_fp32
        if a != 4 or not rows:
            return super().head_linear(tokens, vocab, hidden, peak, a)
        flops = 2 * tokens * vocab * hidden
        f, b, w = (flops / interp_log(tuple((r[0], r[i]) for r in rows), flops) for i in (1, 2, 3))
        return f, b, w

    def attention(self, flops: float, seq: float, head_dim: float, prec: str, kernel: str, peak: float,
                  launches: float) -> tuple[float, float]:
        """fp32 attention at the rate bench measured for this (sequence, head dim)."""
        grid = self.profile.attention_fp32
        if grid is None or prec != "fp32":
            return super().attention(flops, seq, head_dim, prec, kernel, peak, launches)
        rate_f, rate_b = attention_rate(grid, seq, head_dim)
        return flops / rate_f, flops / rate_b

    def stream_bandwidth(self, nbytes: float, efficiency: bool = True) -> float:
        """The measured copy curve at this working set (small buffers stay in the caches)."""
        if not self.profile.copy_bw:
            return super().stream_bandwidth(nbytes, efficiency)
        return interp_log(self.profile.copy_bw, nbytes)

    def op_bandwidth(self, operand_bytes: float, working_set: float, efficiency: bool = True) -> float:
        """The in-step elementwise curve at this operand size."""
        if not self.profile.stream_bw:
            return super().op_bandwidth(operand_bytes, working_set, efficiency)
        return interp_log(self.profile.stream_bw, operand_bytes)

    def fused_bandwidth(self, operand_bytes: float, working_set: float) -> float:
        """The compiled elementwise rate bench measured (calibrate/compiled_kernels.py) at this operand
        size; the eager elementwise curve where the profile has none."""
        if not self.profile.fused_bw:
            return super().fused_bandwidth(operand_bytes, working_set)
        return interp_log(self.profile.fused_bw, operand_bytes)

    def host_layer(self, tp: int, kernels: str = "eager") -> tuple[float, float]:
        """Measured host seconds per layer (serial with the arithmetic on a CPU): the tensor-parallel
        layer's as bench ran it when tp > 1 and measured (compiled, with fused kernels, when bench compiled
        it too); else, with fused kernels, the compiled layer's when measured (a compiled block is one call
        forward, one autograd node backward); else the eager layer's."""
        p = self.profile
        if tp > 1 and p.tp_collective:
            fused = kernels == "fused" and any(p.host_tp_compiled_layer_s)
            return p.host_tp_compiled_layer_s if fused else p.host_tp_layer_s
        if kernels == "fused" and any(p.host_compiled_layer_s):
            return p.host_compiled_layer_s
        return p.host_layer_s

    def host_ends(self, tp: int) -> tuple[float, float]:
        p = self.profile
        return p.host_tp_ends_s if tp > 1 and p.tp_collective else p.host_ends_s

    def optimizer(self, params: float, bytes_per_param: float, working_set: float, tensors: int) -> float:
        """The step as bench measured it per parameter element (fp32), plus host work per tensor."""
        p = self.profile
        if p.optimizer_per_element_s:
            base = params * p.optimizer_per_element_s
        else:
            base = super().optimizer(params, bytes_per_param, working_set, tensors)
        return base + p.host_optimizer_per_tensor_s * tensors

    def _curve(self, op: str, g: Group) -> Curve | None:
        """The measured bus-bandwidth curve for `op` in `g`: inside the node only (all-to-all reads the
        all-reduce's)."""
        key = "all_reduce" if op == "all_to_all" else op
        return None if g.crosses_nodes else self.profile.busbw.get(key)

    def bus_bandwidth(self, op: str, payload: float, g: Group) -> float:
        curve = self._curve(op, g)
        if curve is not None:
            return interp_log(curve, payload)
        busbw = super().bus_bandwidth(op, payload, g)
        fabric = self.profile.allreduce_busbw_by_nodes
        if op == "all_reduce" and g.crosses_nodes and fabric:
            busbw = min(busbw, interp_log(fabric, g.nodes))  # what the fabric carried
        return busbw

    def collective(self, op: str, payload: float, g: Group) -> float:
        """A measured curve's bus bandwidth includes the latency; tp collectives as the step meets them
        (calibrate/tp_step.py) when measured."""
        if self._curve(op, g) is None:
            return super().collective(op, payload, g)
        if g.dim == "tp" and self.profile.tp_collective:
            return self.in_step(self.profile.tp_collective, op, payload, g)
        return wire_bytes(op, payload, g.size) / self.bus_bandwidth(op, payload, g)

    def dp_collective(self, op: str, payload: float, g: Group) -> float:
        """After a backward's compute, as bench's dp step measured it (calibrate/dp_step.py)."""
        if not self.profile.dp_collective or g.crosses_nodes:
            return super().dp_collective(op, payload, g)
        return self.in_step(self.profile.dp_collective, op, payload, g)

    def in_step(self, pts: Curve, op: str, payload: float, g: Group) -> float:
        """A collective as a step experiences it: bench's in-step all-reduce seconds `pts` (by bytes) read
        for `op` at the same bytes on the wire (an all-gather or reduce-scatter of P sends what an
        all-reduce of P/2 does), log-linear between its sizes and the smallest's below them; beyond the
        largest, that plus what the measured curve adds from there."""
        per_size = 1 if op == "all_reduce" else 2  # payload per all-reduce byte sending the same

        def curve(size: float) -> float:
            p = size * per_size
            return wire_bytes(op, p, g.size) / self.bus_bandwidth(op, p, g)

        return measured_then_curve(pts, payload / per_size, curve)

    def scalar(self, op: str, nbytes: float, g: Group) -> float:
        """bench's scalar all-reduce inside a step (calibrate/dp_step.py) when measured."""
        if self.profile.scalar_collective_s and not g.crosses_nodes:
            return self.profile.scalar_collective_s
        return super().scalar(op, nbytes, g)

    def p2p(self, nbytes: float, inter_node: bool, both_ways: bool = False) -> float:
        """Inside the node the one-way time bench measured by ping-pong (busbw "p2p": bytes / one-way
        seconds); a swap both ways its "exchange" (on a CPU both directions share the cores)."""
        busbw = self.profile.busbw
        if both_ways and not inter_node and "exchange" in busbw:
            return nbytes / interp_log(busbw["exchange"], nbytes)
        if not inter_node and "p2p" in busbw:
            return nbytes / interp_log(busbw["p2p"], nbytes)
        return super().p2p(nbytes, inter_node, both_ways)

    def pp_hop(self, nbytes: float, inter_node: bool) -> float:
        """Inside the node, the swap after a micro-batch's compute bench measured (calibrate/pp_step.py),
        log-linear between its sizes; beyond the largest, that plus what the ping-pong curve adds."""
        if not self.profile.pp_hop or inter_node:
            return super().pp_hop(nbytes, inter_node)
        return measured_then_curve(self.profile.pp_hop, nbytes, lambda b: self.p2p(b, False))


def speeds_for(gpu: Datasheet) -> Speeds:
    """The measured speeds when `gpu` carries a profile, else the datasheet roofline."""
    return Roofline(gpu) if gpu.profile is None else Measured(gpu, gpu.profile)
