"""Zero-bubble's split backward: B (input grads) then W (weight grads) gives exactly the unsplit gradients
(float64: the input gradient bitwise, the weight gradients to `EXACT_RTOL` relative, as W may sum a
weight's contributions in another order), and W computes only weight gradients (B + W = unsplit backward
in FLOPs; wall time is measured in BENCHMARKS.md, never asserted)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pentatron.models.llama import build_model
from pentatron.models.registry import get_model_config
from pentatron.parallel.pipeline.split_backward import SplitBackward
from pentatron.parallel.pipeline.stages import PipelineStage
from tests.reference_loop import EXACT_RTOL, relative_error

DTYPE = torch.float64


def _stages(hidden: int = 64, n_layers: int = 3):
    cfg = dataclasses.replace(get_model_config("debug"), hidden_size=hidden, n_heads=2, n_kv_heads=1,
                              ffn_hidden_size=2 * hidden, n_layers=n_layers)
    model = build_model(cfg, seed=1, dtype=DTYPE)
    return cfg, [PipelineStage(model, i, 3, range(i, i + 1)) for i in range(3)]


def _run(stage: PipelineStage, x: torch.Tensor, grad: torch.Tensor | None, targets: torch.Tensor, split: bool):
    """Forward then backward (split or not); returns (input grad, {param: grad}, (flops B, flops W))."""
    stage.zero_grad(set_to_none=True)
    inp = x.clone().requires_grad_() if x.is_floating_point() else x
    out = stage(inp)
    if stage.is_last:
        out = nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten())
    if not split:
        with FlopCounterMode(display=False) as fc:
            torch.autograd.backward([out], [grad] if grad is not None else None)
        dx = inp.grad if inp.is_floating_point() else None
        flops = (fc.get_total_flops(), 0)
    else:
        sb = SplitBackward([out], [grad], [inp] if inp.is_floating_point() else [])
        with FlopCounterMode(display=False) as fb:
            dxs = sb.backward_input()
        assert all(p.grad is None for p in stage.parameters()), "B must not touch weight gradients"
        with FlopCounterMode(display=False) as fw:
            sb.backward_weight()
        assert sb.split
        dx = dxs[0] if dxs else None
        flops = (fb.get_total_flops(), fw.get_total_flops())
    return dx, {n: p.grad.clone() for n, p in stage.named_parameters()}, flops


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_split_equals_unsplit_and_costs_the_same_flops(which):
    torch.manual_seed(0)
    cfg, stages = _stages()
    stage = stages[{"first": 0, "middle": 1, "last": 2}[which]]
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    x = tokens if stage.is_first else torch.randn(2, 16, cfg.hidden_size, dtype=DTYPE)
    grad = None if stage.is_last else torch.randn(2, 16, cfg.hidden_size, dtype=DTYPE)
    dx0, g0, (unsplit, _) = _run(stage, x, grad, tokens, split=False)
    dx1, g1, (fb, fw) = _run(stage, x, grad, tokens, split=True)
    if dx0 is not None:
        torch.testing.assert_close(dx1, dx0, rtol=0, atol=0)
    assert g1.keys() == g0.keys()
    for n in g0:
        assert g1[n].dtype == DTYPE and relative_error(g1[n].numpy(), g0[n].numpy()) <= EXACT_RTOL, n
    # W re-enters at the split points with saved gradients: it never redoes B's work.
    assert fb + fw == unsplit > 0
    if stage.is_first:
        assert fb == 0  # token ids have no gradient: the whole backward is weight gradients
    else:
        assert 0 < fw < unsplit and 0 < fb < unsplit


class _SharedAlongPath(nn.Module):
    """A weight used twice along the activation path: splitting at one use would double count the other."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def test_weight_shared_along_path_falls_back_to_exact_unsplit():
    torch.manual_seed(0)
    mod, x, g = _SharedAlongPath().to(DTYPE), torch.randn(4, 8, dtype=DTYPE), torch.randn(4, 8, dtype=DTYPE)
    inp = x.clone().requires_grad_()
    mod(inp).backward(g)
    want = {n: p.grad.clone() for n, p in mod.named_parameters()}
    mod.zero_grad(set_to_none=True)
    inp2 = x.clone().requires_grad_()
    sb = SplitBackward([mod(inp2)], [g], [inp2])
    (dx,) = sb.backward_input()
    sb.backward_weight()
    assert not sb.split
    torch.testing.assert_close(dx, inp.grad, rtol=0, atol=0)  # the unsplit backward itself: bitwise
    for n, p in mod.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=0)


def test_order_is_enforced():
    lin, x = nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True)
    sb = SplitBackward([lin(x)], [torch.ones(2, 4)], [x])
    with pytest.raises(RuntimeError, match="before backward_input"):
        sb.backward_weight()
    sb.backward_input()
    with pytest.raises(RuntimeError, match="twice"):
        sb.backward_input()
