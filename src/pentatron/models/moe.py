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

The model knows nothing about parallelism: `expert_parallel` (None here) is the hook through which
`parallel/expert.py` sends each expert's tokens to the rank holding it and brings the outputs back.
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
    aux: float  # the balancing loss's value (before its coefficient; 0 when off)
    z: float  # the z-loss's value (0 when off)


class Router(nn.Module):
    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_experts, hidden))
        # Selection bias (aux-loss-free balancing): updated from observed loads, never by gradient.
        self.register_buffer("expert_bias", torch.zeros(moe.n_experts, dtype=torch.float32), persistent=False)
        # Context parallelism: each rank routes a slice of every sequence; the balancing loss must see the
        # whole sequences' assignment counts (the hook sums them over the cp ranks). None: the tokens here.
        self.count_sequences: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> Routing:
        m = self.moe
        logits = F.linear(x.float(), self.weight.float())  # routing in fp32 whatever the compute dtype
        scores = logits.softmax(-1) if m.score == "softmax" else logits.sigmoid()
        experts = (scores.detach() + self.expert_bias).topk(m.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if m.score == "sigmoid" else 0.0))
        weights = weights * m.route_scale
        counts = torch.bincount(experts.flatten(), minlength=m.n_experts)
        loss = logits.new_zeros(())
        aux = z = 0.0
        if m.aux_loss_coef > 0:
            probs = scores if m.score == "softmax" else scores / scores.sum(-1, keepdim=True)
            if self.count_sequences is None:
                aux_t = balancing_loss(probs, counts, m.top_k)
            else:
                # E/k · Σᵢ fᵢ·mean_here(Pᵢ), fᵢ from the whole sequences: the cp ranks' terms average (as
                # their gradients do) to the whole sequences' loss, since they hold equal token counts.
                whole = self.count_sequences(counts.to(probs.dtype))
                aux_t = balancing_loss(probs, whole, m.top_k, tokens=float(whole.sum()) / m.top_k)
            loss = loss + m.aux_loss_coef * aux_t
            aux = float(aux_t.detach())
        if m.z_loss_coef > 0:
            z_t = torch.logsumexp(logits, dim=-1).pow(2).mean()
            loss = loss + m.z_loss_coef * z_t
            z = float(z_t.detach())
        return Routing(experts, weights, counts, loss, aux, z)


def balancing_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int, tokens: float | None = None
                   ) -> torch.Tensor:
    """Switch/GShard: E/k · Σᵢ (countsᵢ/T)·mean(probsᵢ); probs [T, E] (rows sum to 1), counts [E] over
    `tokens` tokens (default: the T rows of probs)."""
    rows, n_experts = probs.shape
    return n_experts / top_k * (counts.to(probs.dtype) / (tokens or rows) * probs.mean(0)).sum()


def bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3: raise an underloaded expert's bias by `rate`, lower an overloaded one's (by sign)."""
    return bias + rate * torch.sign(load.mean() - load).to(bias.dtype)


def capacity(tokens: int, moe: MoEConfig) -> int | None:
    """Assignments an expert may take from a batch of `tokens` (None: dropless)."""
    if moe.capacity_factor is None:
        return None
    return math.ceil(moe.capacity_factor * tokens * moe.top_k / moe.n_experts)


def dispatch_order(experts: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                   cap: int | None) -> torch.Tensor:
    """Indices into the flattened [T·k] assignments, grouped by expert (ascending), keeping at most
    `cap` per expert: its highest-weighted ones (ties: earlier tokens), as Megatron's "probs" policy."""
    flat_e = experts.flatten()
    if cap is None:
        return torch.argsort(flat_e, stable=True)
    by_weight = torch.argsort(-weights.detach().flatten(), stable=True)
    order = by_weight[torch.argsort(flat_e[by_weight], stable=True)]
    start = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=order.device) - start[flat_e[order]]
    return order[rank_in_expert < cap]


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights (nn.Linear's [out, in] per expert): gate/up [E, f, h],
    down [E, h, f]. `forward` takes tokens grouped by expert and the count of each group."""

    def __init__(self, n_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, ffn, hidden))
        self.up_proj = nn.Parameter(torch.empty(n_experts, ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, ffn))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # One matmul chain per expert (torch offers no CPU grouped GEMM). An expert with no tokens
        # still joins the graph, so every expert weight gets a (zero) gradient each backward.
        outs = []
        for j, xj in enumerate(x.split(counts)):
            h = F.silu(F.linear(xj, self.gate_proj[j])) * F.linear(xj, self.up_proj[j])
            outs.append(F.linear(h, self.down_proj[j]))
        return torch.cat(outs)


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
    """How tokens reach experts held elsewhere (`parallel/expert.py`): `x` grouped by global expert,
    `counts` [E] per expert; returns the experts' outputs in the same order."""

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor: ...


@dataclass
class LoadStats:
    """What one layer saw since the last `finish_step`: summed over forwards (micro-batches)."""

    counts: torch.Tensor  # [E] float64 assignments chosen by the router (before drops)
    dropped: float = 0.0  # assignments over capacity
    tokens: float = 0.0
    aux: float = 0.0  # sums of the per-forward loss values
    z: float = 0.0
    forwards: float = 0.0

    def vector(self) -> torch.Tensor:
        """One float64 vector (so a data-parallel run sums it with one all-reduce)."""
        extra = torch.tensor([self.dropped, self.tokens, self.aux, self.z, self.forwards], dtype=torch.float64)
        return torch.cat([self.counts, extra])


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
        self.stats = LoadStats(torch.zeros(m.n_experts, dtype=torch.float64, device="cpu"))  # not meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens, k = x.shape[0], self.cfg.top_k
        r = self.router(x)
        order = dispatch_order(r.experts, r.weights, r.counts, capacity(tokens, self.cfg))
        flat_e = r.experts.flatten()[order]
        token = order // k
        kept = torch.bincount(flat_e, minlength=self.cfg.n_experts)
        xs = x[token]
        if self.expert_parallel is None:
            ys = self.experts(xs, kept.tolist())
        else:
            ys = self.expert_parallel(xs, kept, self.experts)
        w = r.weights.flatten()[order].unsqueeze(-1).to(ys.dtype)
        out = torch.zeros_like(x).index_add_(0, token, ys * w)
        if self.shared is not None:
            out = out + self.shared(x)
        if torch.is_grad_enabled() and r.loss.requires_grad:
            out = AuxLossAutoScaler.apply(out, r.loss, self.loss_scale)
        self._record(r, tokens, tokens * k - order.numel())
        return out.view(shape)

    @torch.no_grad()
    def _record(self, r: Routing, tokens: int, dropped: int) -> None:
        s = self.stats
        s.counts += r.counts.to(device="cpu", dtype=torch.float64)
        s.dropped += dropped
        s.tokens += tokens
        s.aux += r.aux
        s.z += r.z
        s.forwards += 1

    def take_stats(self) -> LoadStats:
        s = self.stats
        self.stats = LoadStats(torch.zeros_like(s.counts))
        return s


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
    """After the optimizer step: sum each layer's load over the data-parallel replicas (`reduce`: the
    sum of a float64 CPU vector over them, None in one process), move the aux-free biases, reset the
    counters; returns the step's metrics per MoE layer (name → tokens per expert, max/mean imbalance, dropped fraction,
    aux and z losses averaged over forwards and replicas)."""
    out = {}
    for name, m in moe_layers(model).items():
        vec = m.take_stats().vector()
        if reduce is not None:
            vec = reduce(vec)
        n = m.cfg.n_experts
        counts, (dropped, tokens, aux, z, forwards) = vec[:n], vec[n:].tolist()
        if m.cfg.bias_update_rate > 0 and forwards > 0:
            bias = m.router.expert_bias
            bias.copy_(bias_update(bias, counts.to(bias.device, torch.float32), m.cfg.bias_update_rate))
        mean = float(counts.mean())
        out[name] = {"tokens_per_expert": [int(c) for c in counts.tolist()],
                     "imbalance": float(counts.max()) / mean if mean > 0 else 0.0,
                     "dropped_frac": dropped / (tokens * m.cfg.top_k) if tokens else 0.0,
                     "aux_loss": aux / forwards if forwards else 0.0,
                     "z_loss": z / forwards if forwards else 0.0}
    return out
