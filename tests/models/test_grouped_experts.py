"""Grouped experts (models/moe.py `Experts`): one grouped GEMM per projection, or the padded batched
matmul where `torch._grouped_mm` is unsupported, against the per-expert loop they replaced (kept here,
as the reference): outputs and every gradient <= 1e-5, empty experts and an empty input included; and
a whole MoE layer (capacity drops, shared expert) forward + backward against the same loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pentatron.models import moe as moe_module
from pentatron.models.config import ModelConfig, MoEConfig
from pentatron.models.moe import Experts, MoE, grouped_mm_supported


def loop_experts(ex: Experts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The reference: one SwiGLU matmul chain per expert, over its group of rows."""
    outs = []
    for j, xj in enumerate(x.split(counts)):
        h = F.silu(F.linear(xj, ex.gate_proj[j])) * F.linear(xj, ex.up_proj[j])
        outs.append(F.linear(h, ex.down_proj[j]))
    return torch.cat(outs)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.fixture(params=["grouped_mm", "padded_bmm"])
def path(request, monkeypatch):
    if request.param == "padded_bmm":
        monkeypatch.setattr(moe_module, "grouped_mm_supported", lambda *a: False)
    return request.param


def _experts(e: int = 6, h: int = 32, f: int = 16) -> Experts:
    ex = Experts(e, h, f)
    g = torch.Generator().manual_seed(0)
    for p in ex.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return ex


def test_the_platform_has_a_grouped_gemm_on_cpu():
    x, w = torch.randn(4, 32), torch.randn(2, 16, 32)
    assert grouped_mm_supported(x, w)  # torch 2.13 CPU: the grouped path is what the suite exercises


@pytest.mark.parametrize("counts", [[3, 0, 7, 1, 0, 9], [0, 0, 0, 0, 0, 0], [20, 0, 0, 0, 0, 0]])
def test_grouped_experts_equal_the_loop(path, counts):
    ex = _experts()
    x = torch.randn(sum(counts), 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(sum(counts), 32, generator=torch.Generator().manual_seed(2))
    got = ex(x, counts)
    got_grads = torch.autograd.grad(got, [x, *ex.parameters()], g)
    want = loop_experts(ex, x, counts)
    want_grads = torch.autograd.grad(want, [x, *ex.parameters()], g)
    assert got.shape == want.shape
    if sum(counts):
        assert _rel(got, want) <= 1e-5
    for a, b in zip(got_grads, want_grads, strict=True):
        assert a.shape == b.shape
        assert _rel(a, b) <= 1e-5 if b.norm() > 0 else not a.any()


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_a_moe_layer_with_grouped_experts_equals_the_loop(path, monkeypatch, capacity_factor):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden_size=64,
                      moe=MoEConfig(n_experts=8, top_k=2, expert_ffn_size=16, n_shared_experts=1,
                                    capacity_factor=capacity_factor))
    torch.manual_seed(0)
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3))

    def run() -> list[torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        layer(x).square().mean().backward()
        return [p.grad.clone() for p in layer.parameters()]

    got = run()
    monkeypatch.setattr(Experts, "forward", lambda self, xs, counts, offsets=None: loop_experts(self, xs, counts))
    want = run()
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) <= 1e-5
