"""A Mixture-of-Experts feed-forward layer in plain single-device PyTorch.

    x [T, h] → router: scores = softmax|sigmoid(x·Wrᵀ); top-k experts per token (selected on
               scores + the aux-free bias, weighted by the unbiased scores, renormalised)
             → (capacity: each expert keeps its highest-weighted assignments, the rest are dropped)
             → assignments sorted by expert → experts (one SwiGLU matmul chain per expert, weights
               stacked [E, …] so expert parallelism slices dim 0) → weighted sum back per token
             (+ shared experts on every token)

Load balancing, all three optional (`MoEConfig`):
- the Switch/GShard auxiliary loss E/k · Σᵢ fᵢ·Pᵢ (fᵢ: share of the batch's assignments that chose
  expert i, times k; Pᵢ: mean router probability of i) — 1.0 at a uniform load;
- the router z-loss mean(logsumexp(logits)²) (ST-MoE);
- DeepSeek-V3's auxiliary-loss-free bias: a per-expert bias added to the scores for *selection only*,
  moved by ±γ towards the mean load after each optimizer step (`finish_step`), not by gradient.

The two losses reach the gradient without touching the loss plumbing (pipeline stages, gradient
accumulation): `AuxLossAutoScaler` returns the layer output unchanged and, in backward, feeds the
loss's gradient (`loss_scale`, 1/micro-batches, as the main loss is scaled) into the router's graph —
the way Megatron-Core's MoEAuxLossAutoScaler does. Their values, the tokens routed to each expert and
the dropped assignments are accumulated per layer for the step's metrics.

Host synchronisations: a forward reads one thing on the host, once — each expert's row count, which
`Experts.forward` (or the expert-parallel all-to-all) needs as split sizes; everything else (losses,
loads, drops) stays on the device, and `finish_step` reduces all layers with one collective and reads
them back with one copy per optimizer step.

Capacity (`moe.capacity_factor` = c; unset: dropless) is defined over what one process's forward sees,
the whole micro-batch (b sequences × their full length, T = b·s tokens): each expert takes at most
cap = ceil(c·T·k/E) assignments of the micro-batch, its highest-weighted ones, equal weights going to
the earlier token (index b·s + position). So dropping does not depend on the layout: under dp, tp
(without sp), ep and pp a rank's forward sees whole micro-batches anyway; under context parallelism (a
rank holds a slice of every sequence) and sequence parallelism (a tp rank holds a slice of that) the
`capacity_scope` hook (`parallel/moe_capacity.py`) gives the micro-batch's T and keeps exactly the
local assignments that rank among their expert's cap best of the micro-batch.

The model knows nothing about parallelism: `expert_parallel` (None here) is the hook through which
`parallel/expert.py` sends each expert's tokens to the rank holding it and brings the outputs back;
`capacity_scope` (None here: the layer sees the whole micro-batch) the one above.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pentatron.models.config import ModelConfig, MoEConfig
from pentatron.precision import wide


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on `output`; backward also gives `aux` the gradient `scale` (so d(total)/d(aux) = scale)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux, ctx.scale), None


@dataclass
class Routing:
    experts: torch.Tensor  # [T, k] chosen expert ids
    weights: torch.Tensor  # [T, k] fp32 combine weights (differentiable)
    counts: torch.Tensor  # [E] assignments per expert (before any capacity drop)
    loss: torch.Tensor  # aux_loss_coef·aux + z_loss_coef·z (differentiable; 0 when both are off)
    aux: torch.Tensor  # the balancing loss's value (0-dim, detached, before its coefficient; 0 when off)
    z: torch.Tensor  # the z-loss's value (0-dim, detached; 0 when off)


class Router(nn.Module):
    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_experts, hidden))
        # Selection bias (aux-loss-free balancing): updated from observed loads, never by gradient.
        self.register_buffer("expert_bias", torch.zeros(moe.n_experts, dtype=torch.float32), persistent=False)
        # Context / sequence parallelism: each rank routes a share of the micro-batch's tokens; the balancing
        # loss must see the whole micro-batch's assignment counts (the hook sums them over the ranks
        # sharing it, `parallel/moe_tokens.py`). None: the tokens here are the micro-batch.
        self.count_sequences: Callable[[torch.Tensor], torch.Tensor] | None = None
        # The share of the routing losses' gradient this forward carries: 1/tp under sequence parallelism,
        # whose tp ranks' router gradients are summed (each saw 1/tp of the tokens), 1 otherwise.
        self.loss_share = 1.0

    def forward(self, x: torch.Tensor) -> Routing:
        m = self.moe
        logits = F.linear(wide(x), wide(self.weight))  # routing in (at least) fp32 whatever the compute dtype
        scores = logits.softmax(-1) if m.score == "softmax" else logits.sigmoid()
        experts = (scores.detach() + self.expert_bias).topk(m.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if m.score == "sigmoid" else 0.0))
        weights = weights * m.route_scale
        counts = expert_counts(experts.flatten(), m.n_experts)
        loss = aux = z = logits.new_zeros(())
        if m.aux_loss_coef > 0:
            probs = scores if m.score == "softmax" else scores / scores.sum(-1, keepdim=True)
            if self.count_sequences is None:
                aux_t = balancing_loss(probs, counts, m.top_k)
            else:
                # E/k · Σᵢ fᵢ·mean_here(Pᵢ), fᵢ from the whole micro-batch: the sharing ranks' terms average
                # to the whole micro-batch's loss, since they hold equal token counts.
                whole = self.count_sequences(counts.to(probs.dtype))
                aux_t = balancing_loss(probs, whole, m.top_k, tokens=whole.sum() / m.top_k)
            loss = loss + m.aux_loss_coef * aux_t
            aux = aux_t.detach()
        if m.z_loss_coef > 0:
            z_t = torch.logsumexp(logits, dim=-1).pow(2).mean()
            loss = loss + m.z_loss_coef * z_t
            z = z_t.detach()
        if self.loss_share != 1.0:
            loss = loss * self.loss_share
        return Routing(experts, weights, counts, loss, aux, z)


def balancing_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int,
                   tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """Switch/GShard: E/k · Σᵢ (countsᵢ/T)·mean(probsᵢ); probs [T, E] (rows sum to 1), counts [E] over
    `tokens` tokens (a number or a 0-dim tensor on the device; default: the T rows of probs)."""
    rows, n_experts = probs.shape
    return n_experts / top_k * (counts.to(probs.dtype) / (rows if tokens is None else tokens) * probs.mean(0)).sum()


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[E] int64 assignments per expert: `bincount` without its sync (on CUDA it reads the maximum on the
    host to size its output; the size is known here)."""
    return torch.zeros(n_experts, dtype=torch.int64, device=experts.device).scatter_add_(
        0, experts, torch.ones_like(experts))


def bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3: raise an underloaded expert's bias by `rate`, lower an overloaded one's (by sign)."""
    return bias + rate * torch.sign(load.mean() - load).to(bias.dtype)


def capacity(tokens: int, moe: MoEConfig) -> int | None:
    """Assignments an expert may take from a micro-batch of `tokens` (None: dropless)."""
    if moe.capacity_factor is None:
        return None
    return math.ceil(moe.capacity_factor * tokens * moe.top_k / moe.n_experts)


def rank_in_expert(experts: torch.Tensor, order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """For assignments `order` (indices into the flat `experts`, grouped by expert ascending), each one's
    place within its expert's group (0, 1, …); counts [E] the group sizes."""
    start = torch.cumsum(counts, 0) - counts
    return torch.arange(order.numel(), device=order.device) - start[experts[order]]


def sort_assignments(experts: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                     cap: int | None, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, kept): a permutation of the flattened [T·k] assignments whose first kept.sum() entries are
    the kept ones grouped by expert (ascending), and kept [E] per expert. Each expert keeps at most `cap`:
    its highest-weighted ones (ties: earlier tokens), as Megatron's "probs" policy; the dropped ones
    follow. `keep` [T·k] bool, when given (context parallelism: chosen over the whole micro-batch by the
    `capacity_scope`), says which ones are kept instead. No host sync: the caller cuts the order at the
    kept count it reads with the split sizes."""
    flat_e = experts.flatten()
    if cap is None:
        return torch.argsort(flat_e, stable=True), counts
    by_weight = torch.argsort(-weights.detach().flatten(), stable=True)
    order = by_weight[torch.argsort(flat_e[by_weight], stable=True)]
    if keep is None:
        dropped = (rank_in_expert(flat_e, order, counts) >= cap).to(torch.int8)
        kept = counts.clamp(max=cap)
    else:
        dropped = (~keep[order]).to(torch.int8)
        kept = torch.zeros_like(counts).scatter_add_(0, flat_e, keep.to(counts.dtype))
    return order[torch.argsort(dropped, stable=True)], kept


def dispatch_order(experts: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                   cap: int | None) -> torch.Tensor:
    """The kept assignments of `sort_assignments`, grouped by expert (reads their number on the host)."""
    order, kept = sort_assignments(experts, weights, counts, cap)
    return order if cap is None else order[: int(kept.sum())]


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs these operands (torch 2.13): on CPU any float dtype, on CUDA bf16
    from compute capability 9.0 (its CUTLASS kernel); every row stride a multiple of 16 bytes."""
    if x.device.type == "cpu":
        ok_dtype = x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    elif x.device.type == "cuda":
        ok_dtype = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    else:
        return False
    return ok_dtype and all(t.shape[-1] * t.element_size() % 16 == 0 for t in (x, *weights))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of `x` grouped by expert (group j: `counts[j]` rows ending at `offsets[j]`, int32) times their expert's
    weight [E, out, in]ᵀ, as ONE grouped GEMM (`torch._grouped_mm`); where it is unsupported, one batched
    matmul over the groups padded to the largest (its size comes from the host counts: no sync)."""
    if x.shape[0] and grouped_mm_supported(x, weight):  # (its backward rejects an empty operand)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    e, width = weight.shape[0], max(max(counts, default=0), 1)
    rows = torch.arange(x.shape[0], device=x.device)
    group = torch.searchsorted(offsets, rows, right=True)
    starts = F.pad(offsets[:-1], (1, 0))
    slot = group * width + rows - starts[group]
    padded = x.new_zeros(e * width, x.shape[-1]).index_copy(0, slot, x).view(e, width, -1)
    return torch.bmm(padded, weight.transpose(-2, -1)).reshape(e * width, -1)[slot]


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights (nn.Linear's [out, in] per expert): gate/up [E, f, h],
    down [E, h, f]. `forward` takes tokens grouped by expert and the count of each group."""

    def __init__(self, n_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, ffn, hidden))
        self.up_proj = nn.Parameter(torch.empty(n_experts, ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, ffn))

    def forward(self, x: torch.Tensor, counts: list[int], offsets: torch.Tensor | None = None) -> torch.Tensor:
        """One grouped GEMM per projection over all experts (no per-expert loop). `offsets` [E]: the groups'
        cumulative row counts on the device (computed there by the caller; built from `counts` if not
        given). Every expert weight gets a gradient each backward (zero for an expert without tokens)."""
        if offsets is None:
            offsets = torch.tensor(counts, device=x.device).cumsum(0)
        offsets = offsets.to(torch.int32)  # what _grouped_mm takes
        h = (F.silu(grouped_linear(x, self.gate_proj, offsets, counts))
             * grouped_linear(x, self.up_proj, offsets, counts))
        return grouped_linear(h, self.down_proj, offsets, counts)


class SharedExperts(nn.Module):
    """The always-on experts: one SwiGLU of width n_shared·expert_ffn_size."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertParallel(Protocol):
    """How tokens reach experts held elsewhere (`parallel/expert.py`). `plan(counts)`, counts [E] per
    global expert on the device: exchanges them and reads every split size the layer needs on the host in
    one transfer; its `rows` is the number of rows this rank sends. `__call__(x, plan, experts)`: `x` (those
    rows, grouped by global expert) through the experts; returns their outputs in the same order."""

    def plan(self, counts: torch.Tensor) -> Any: ...

    def __call__(self, x: torch.Tensor, plan: Any, experts: Experts) -> torch.Tensor: ...


class CapacityScope(Protocol):
    """The capacity rule over a micro-batch of which this rank holds a slice of every sequence (context
    parallelism, `parallel/moe_capacity.py`). `tokens(local)`: the micro-batch's token count when this
    rank holds `local`; `keep(experts, weights, cap)`: [T·k] bool on the device, which of this rank's
    assignments are among their expert's `cap` best of the whole micro-batch (by weight, then earlier
    token), decided without a host sync and without gradient."""

    def tokens(self, local: int) -> int: ...

    def keep(self, experts: torch.Tensor, weights: torch.Tensor, cap: int) -> torch.Tensor: ...


class LoadStats:
    """What one layer saw since the last `finish_step`, summed over forwards (micro-batches), on the
    device: one float64 vector [assignments per expert chosen by the router (E, before drops) | dropped,
    tokens, aux, z, forwards] (aux, z: sums of the per-forward loss values), so that all layers are
    reduced with one collective and read back with one copy per step."""

    TOTALS = ("dropped", "tokens", "aux", "z", "forwards")

    def __init__(self, n_experts: int, device: torch.device) -> None:
        self.n_experts = n_experts
        self.vector = torch.zeros(n_experts + len(self.TOTALS), dtype=torch.float64, device=device)

    @property
    def counts(self) -> torch.Tensor:
        return self.vector[: self.n_experts]

    @torch.no_grad()
    def add(self, counts: torch.Tensor, dropped: torch.Tensor, tokens: int, aux: torch.Tensor,
            z: torch.Tensor) -> None:
        v, n = self.vector, self.n_experts
        v[:n] += counts
        v[n] += dropped
        v[n + 1] += tokens
        v[n + 2] += aux
        v[n + 3] += z
        v[n + 4] += 1


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.moe is not None
        m = self.cfg = cfg.moe
        self.router = Router(cfg.hidden_size, m)
        self.experts = Experts(m.n_experts, cfg.hidden_size, m.expert_ffn_size)
        self.shared = SharedExperts(cfg.hidden_size, m.n_shared_experts * m.expert_ffn_size) \
            if m.n_shared_experts else None
        self.loss_scale = 1.0  # d(step loss)/d(this forward's loss): 1/micro-batches (set by the runner)
        self.expert_parallel: ExpertParallel | None = None
        self.capacity_scope: CapacityScope | None = None  # None: this forward sees the whole micro-batch
        self.stats: LoadStats | None = None  # created on the device of the first forward (not on meta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens, k = x.shape[0], self.cfg.top_k
        r = self.router(x)
        scope = self.capacity_scope
        cap = capacity(tokens if scope is None else scope.tokens(tokens), self.cfg)
        keep = None if cap is None or scope is None else scope.keep(r.experts, r.weights, cap)
        order, kept = sort_assignments(r.experts, r.weights, r.counts, cap, keep)
        # The layer's one device→host transfer: the split sizes (here each expert's rows; under expert
        # parallelism also what every rank sends and receives), which also say how many rows are kept.
        ep = self.expert_parallel
        splits = kept.tolist() if ep is None else ep.plan(kept)
        if cap is not None:
            order = order[: sum(splits) if ep is None else splits.rows]
        token = order // k
        xs = x[token]
        ys = self.experts(xs, splits, kept.cumsum(0)) if ep is None else ep(xs, splits, self.experts)
        w = r.weights.flatten()[order].unsqueeze(-1).to(ys.dtype)
        out = torch.zeros_like(x).index_add_(0, token, ys * w)
        if self.shared is not None:
            out = out + self.shared(x)
        if torch.is_grad_enabled() and r.loss.requires_grad:
            out = AuxLossAutoScaler.apply(out, r.loss, self.loss_scale)
        if self.stats is None:
            self.stats = LoadStats(self.cfg.n_experts, r.counts.device)
        self.stats.add(r.counts, (r.counts - kept).sum(), tokens, r.aux, r.z)
        return out.view(shape)

    def take_stats(self) -> torch.Tensor:
        """The `LoadStats` vector since the last call (zeros when no forward ran), and a fresh start."""
        s, self.stats = self.stats, None
        return s.vector if s is not None else LoadStats(self.cfg.n_experts, self.router.weight.device).vector


# ---------------------------------------------------------------------------------------- the model's MoE layers
def moe_layers(model: nn.Module) -> dict[str, MoE]:
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The gradient the balancing losses get per forward: 1/micro-batches (the main loss's scaling)."""
    for m in moe_layers(model).values():
        m.loss_scale = scale


@torch.no_grad()
def finish_step(model: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> dict[str, dict[str, Any]]:
    """After the optimizer step: sum every layer's load over the data-parallel replicas (`reduce`: the
    sum of a float64 device vector over them, one collective for all layers; None in one process), move
    the aux-free biases (on the device), reset the counters; returns the step's metrics per MoE layer
    (name → tokens per expert, max/mean imbalance, dropped fraction, aux and z losses averaged over
    forwards and replicas), read with one device→host copy."""
    layers = moe_layers(model)
    if not layers:
        return {}
    vectors = [m.take_stats() for m in layers.values()]
    stacked = torch.cat(vectors)
    if reduce is not None:
        stacked = reduce(stacked)
    pieces = stacked.split([v.numel() for v in vectors])
    for m, vec in zip(layers.values(), pieces, strict=True):
        if m.cfg.bias_update_rate > 0:
            n, bias = m.cfg.n_experts, m.router.expert_bias
            moved = bias_update(bias, vec[:n].to(bias.device, bias.dtype), m.cfg.bias_update_rate)
            bias.copy_(torch.where(vec[n + 4] > 0, moved, bias))  # only after forwards (no host branch)
    host = stacked.tolist()  # the step's one copy of all layers' statistics
    out, at = {}, 0
    for (name, m), vec in zip(layers.items(), vectors, strict=True):
        n = m.cfg.n_experts
        counts, (dropped, tokens, aux, z, forwards) = host[at: at + n], host[at + n: at + vec.numel()]
        at += vec.numel()
        mean = sum(counts) / n
        out[name] = {"tokens_per_expert": [int(c) for c in counts],
                     "imbalance": max(counts) / mean if mean > 0 else 0.0,
                     # part / whole: each forward drops Σ(counts − kept) of its tokens·k assignments, kept <= counts
                     "dropped_frac": dropped / (tokens * m.cfg.top_k) if tokens else 0.0,
                     "aux_loss": aux / forwards if forwards else 0.0,
                     "z_loss": z / forwards if forwards else 0.0}
    return out
