"""The MoE layer on one process: routing (top-k selection, renormalisation, capacity drops), the
balancing losses' gradient against an explicit `loss + coef·aux` reference, the aux-free bias update's
direction, parameter counts, and that a dense-equivalent MoE (one expert, top-1) is the dense MLP.
The comparisons with an explicit reference run in float64 on both sides, to `EXACT_RTOL` (1e-10):
rounding sits near 1e-15 whatever kernels the CPU picks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from pentatron.models.config import ModelConfig, MoEConfig
from pentatron.models.llama import build_model
from pentatron.models.moe import (
    MoE,
    Router,
    balancing_loss,
    bias_update,
    capacity,
    dispatch_order,
    finish_step,
    set_aux_loss_scale,
    sort_assignments,
)
from pentatron.models.registry import MODELS
from tests.reference_loop import EXACT_RTOL

H = 16


def _cfg(**moe: object) -> ModelConfig:
    m = MoEConfig(**{"n_experts": 4, "top_k": 2, "expert_ffn_size": 8, **moe})
    return ModelConfig(vocab_size=64, hidden_size=H, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden_size=32, moe=m)


def _layer(seed: int = 0, dtype: torch.dtype = torch.float32, **moe: object) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(_cfg(**moe))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer.to(dtype)


def _x(tokens: int = 24, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _exact(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """float64 on both sides: ‖got − want‖/‖want‖ within EXACT_RTOL."""
    assert got.dtype == want.dtype == torch.float64, what
    got, want = got.detach(), want.detach()
    err = float((got - want).norm() / want.norm()) if want.norm() else float(got.norm())
    assert err <= EXACT_RTOL, f"{what} off by {err:.2e}"


def test_topk_selection_and_weights() -> None:
    router = Router(H, _cfg().moe).double()
    with torch.no_grad():
        router.weight.copy_(torch.randn(4, H))
    x = _x(dtype=torch.float64)
    r = router(x)
    probs = F.softmax(x @ router.weight.T, dim=-1)
    want = probs.topk(2, dim=-1)
    assert torch.equal(r.experts, want.indices)
    _exact(r.weights, want.values / want.values.sum(-1, keepdim=True), "softmax weights")
    assert torch.equal(r.counts, torch.bincount(want.indices.flatten(), minlength=4))
    # sigmoid scores, unnormalised, scaled: the weights are the raw sigmoids times route_scale
    sig = Router(H, _cfg(score="sigmoid", norm_topk_prob=False, route_scale=2.5).moe).double()
    sig.weight.data.copy_(router.weight)
    rs = sig(x)
    s = torch.sigmoid(x @ router.weight.T)
    _exact(rs.weights, 2.5 * s.gather(1, rs.experts), "sigmoid weights")
    assert torch.equal(rs.experts, s.topk(2, dim=-1).indices)


def test_bias_changes_selection_not_weights() -> None:
    router = Router(H, _cfg(score="sigmoid").moe).double()
    router.weight.data.normal_()
    x = _x(dtype=torch.float64)
    base = router(x)
    router.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # expert 0 always chosen
    r = router(x)
    assert bool((r.experts == 0).any(-1).all())
    s = torch.sigmoid(x @ router.weight.T).gather(1, r.experts)
    _exact(r.weights, s / s.sum(-1, keepdim=True), "biased selection's weights")  # from unbiased scores
    assert not torch.equal(r.experts, base.experts)


def test_bias_update_direction() -> None:
    bias = torch.zeros(4)
    load = torch.tensor([10.0, 2.0, 4.0, 4.0])  # mean 5: expert 0 over, 1-3 under
    assert bias_update(bias, load, 0.1).tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    # through the layer: after a step, the overloaded expert's bias went down, the idle ones' up
    layer = _layer(bias_update_rate=0.01)
    layer(_x(64))
    counts = layer.stats.counts.clone()
    finish_step(layer)
    bias = layer.router.expert_bias
    mean = counts.mean()
    assert all((b < 0) == (c > mean) and (b > 0) == (c < mean) for b, c in zip(bias.tolist(), counts.tolist()))


def test_capacity_drops_lowest_weights() -> None:
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.7, 0.3]])
    counts = torch.bincount(experts.flatten(), minlength=4)  # [4, 2, 1, 1]
    order = dispatch_order(experts, weights, counts, cap=2)
    flat_e, flat_w = experts.flatten()[order], weights.flatten()[order]
    # expert 0 keeps its two highest weights (0.9 from token 1, 0.6 from token 0); the others keep all
    assert flat_e.tolist() == [0, 0, 1, 1, 2, 3]
    assert flat_w.tolist() == pytest.approx([0.9, 0.6, 0.5, 0.4, 0.1, 0.7])  # by weight within an expert
    assert capacity(24, MoEConfig(n_experts=4, top_k=2, expert_ffn_size=8, capacity_factor=1.0)) == 12
    assert capacity(24, MoEConfig(n_experts=4, top_k=2, expert_ffn_size=8)) is None


def test_a_given_keep_mask_decides_the_drops() -> None:
    """Under cp the kept assignments are chosen over the micro-batch (parallel/moe_capacity.py) and handed
    in as a mask: the order starts with exactly those, grouped by expert, and kept counts them."""
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.7, 0.3]])
    counts = torch.bincount(experts.flatten(), minlength=4)
    keep = torch.tensor([True, False, False, True, True, True, True, False])
    order, kept = sort_assignments(experts, weights, counts, 2, keep)
    assert kept.tolist() == [2, 1, 1, 1]
    n = int(kept.sum())
    assert sorted(order[:n].tolist()) == keep.nonzero().flatten().tolist()
    assert experts.flatten()[order[:n]].tolist() == [0, 0, 1, 2, 3]
    assert sorted(order.tolist()) == list(range(8))


def test_dropped_counts_in_metrics() -> None:
    layer = _layer(capacity_factor=0.5)
    x = _x(40)
    layer(x)
    r = layer.router(x)
    cap = capacity(40, layer.cfg)
    want = int((r.counts - cap).clamp(min=0).sum())
    assert want > 0
    m = finish_step(layer)[""]
    assert m["dropped_frac"] == pytest.approx(want / 80)
    assert sum(m["tokens_per_expert"]) == 80 and m["imbalance"] >= 1.0


class _KeepNone:
    """A capacity scope (as context parallelism's) that keeps no assignment: every one is dropped."""

    def tokens(self, local: int) -> int:
        return local

    def keep(self, experts: torch.Tensor, weights: torch.Tensor, cap: int) -> torch.Tensor:
        return torch.zeros(experts.numel(), dtype=torch.bool)


def test_the_dropped_share_is_0_dropless_and_1_when_all_are_dropped() -> None:
    """dropped assignments / routed assignments, summed over the step's forwards: a part of its whole."""
    dropless = _layer()
    dropless(_x(40))
    dropless(_x(8, seed=2))
    assert finish_step(dropless)[""]["dropped_frac"] == 0.0
    layer = _layer(capacity_factor=1.0)
    layer.capacity_scope = _KeepNone()
    out = layer(_x(40))
    assert torch.equal(out, torch.zeros_like(out))  # no expert ran: the layer adds nothing
    m = finish_step(layer)[""]
    assert m["dropped_frac"] == 1.0 and sum(m["tokens_per_expert"]) == 80


def test_forward_matches_a_per_token_loop() -> None:
    layer = _layer(n_shared_experts=1, dtype=torch.float64)
    x = _x(10, dtype=torch.float64)
    out = layer(x)
    r = layer.router(x)
    e = layer.experts
    want = layer.shared(x)
    for t in range(10):
        for j, w in zip(r.experts[t].tolist(), r.weights[t]):
            h = F.silu(e.gate_proj[j] @ x[t]) * (e.up_proj[j] @ x[t])
            want[t] += w * (e.down_proj[j] @ h)
    _exact(out.detach(), want.detach(), "forward vs per-token loop")


def test_aux_loss_gradient_equals_explicit_reference() -> None:
    """The autograd scaler gives every parameter (and the input) the gradient of
    loss + scale·(aux_coef·aux + z_coef·z), computed here explicitly from the router's output."""
    kw = dict(aux_loss_coef=0.3, z_loss_coef=0.05, dtype=torch.float64)
    layer, ref = _layer(**kw), _layer(**kw)
    set_aux_loss_scale(layer, 0.5)  # as with 2 micro-batches
    x1 = _x(dtype=torch.float64).requires_grad_()
    x2 = _x(dtype=torch.float64).requires_grad_()
    target = torch.randn(24, H, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ((layer(x1) - target) ** 2).mean().backward()

    # The reference: the same forward written out, with the balancing losses added to the loss.
    r = ref.router(x2)
    order = dispatch_order(r.experts, r.weights, r.counts, None)
    token = order // 2
    kept = torch.bincount(r.experts.flatten()[order], minlength=4)
    ys = ref.experts(x2[token], kept.tolist()) * r.weights.flatten()[order].unsqueeze(-1)
    out = torch.zeros_like(x2).index_add_(0, token, ys)
    probs = F.softmax(x2 @ ref.router.weight.T, dim=-1)
    aux = balancing_loss(probs, r.counts, 2)
    z = torch.logsumexp(x2 @ ref.router.weight.T, dim=-1).pow(2).mean()
    assert r.aux == pytest.approx(float(aux.detach())) and r.z == pytest.approx(float(z.detach()))
    (((out - target) ** 2).mean() + 0.5 * (0.3 * aux + 0.05 * z)).backward()

    assert layer.router.weight.grad.abs().max() > 0
    for (name, p), q in zip(layer.named_parameters(), ref.parameters()):
        _exact(p.grad, q.grad, name)
    _exact(x1.grad, x2.grad, "input gradient")
    # and the aux term really contributes: without it the router gradient differs
    plain = _layer(**kw)
    set_aux_loss_scale(plain, 0.0)
    ((plain(_x(dtype=torch.float64)) - target) ** 2).mean().backward()
    assert not torch.allclose(plain.router.weight.grad, layer.router.weight.grad, rtol=1e-3)


def test_balancing_loss_is_one_when_uniform() -> None:
    probs = torch.full((8, 4), 0.25)
    counts = torch.tensor([4, 4, 4, 4])  # 8 tokens × top-2 spread evenly
    assert float(balancing_loss(probs, counts, 2)) == pytest.approx(1.0)


def test_one_expert_top1_is_the_dense_mlp() -> None:
    cfg = _cfg(n_experts=1, top_k=1, expert_ffn_size=32)
    dense = replace(cfg, moe=None)
    a, b = build_model(cfg, seed=3, dtype=torch.float64), build_model(dense, seed=3, dtype=torch.float64)
    with torch.no_grad():
        for i in range(2):
            mlp, ex = b.layers[i].mlp, a.layers[i].moe.experts
            ex.gate_proj.copy_(mlp.gate_proj.weight[None])
            ex.up_proj.copy_(mlp.up_proj.weight[None])
            ex.down_proj.copy_(mlp.down_proj.weight[None])
        tokens = torch.randint(0, 64, (2, 12))
        _exact(a(tokens), b(tokens), "one-expert MoE vs dense MLP")


def test_param_counts() -> None:
    for name in ("debug-moe", "mixtral-8x7b"):
        cfg = MODELS[name]
        with torch.device("meta"):
            from pentatron.models.llama import Llama

            model = Llama(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    mixtral = MODELS["mixtral-8x7b"]
    # Mistral's announcement: 46.7B total, 12.9B active parameters per token
    assert round(mixtral.num_params() / 1e9, 1) == 46.7 and round(mixtral.num_params(active=True) / 1e9, 1) == 12.9


@pytest.mark.parametrize("change,match", [
    ({"top_k": 5}, "top_k=5 is larger than moe.n_experts=4"),
    ({"score": "relu"}, "score"),
    ({"capacity_factor": 0.0}, "capacity_factor"),
    ({"first_dense_layers": 2}, "first_dense_layers=2 leaves no MoE layer"),
])
def test_config_problems(change: dict, match: str) -> None:
    assert any(match in p for p in _cfg(**change).problems())
