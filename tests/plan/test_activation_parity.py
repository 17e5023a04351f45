"""Issue 9 item 6: the planner's activation memory is the runtime's formula, and both match the bytes
autograd really keeps for one decoder layer under real tensor parallelism (gloo ranks), tp in {1, 2, 4}
with and without sequence parallelism."""

from __future__ import annotations

import pytest
import torch

from pentatron.distributed.context import Degrees, ParallelContext
from pentatron.models.llama import build_model
from pentatron.models.registry import get_model_config
from pentatron.parallel.activation_memory import SavedTensorMeter, layer_activation_bytes
from pentatron.parallel.tensor import apply_tensor_parallel
from pentatron.plan.memory import llama_layer_activation_bytes
from tests.multiprocess import run_ranks

B, S = 2, 32


def _traced(model: torch.nn.Module, local_s: int, hidden: int) -> int:
    cos, sin = model.rotary(torch.arange(S))
    x = torch.randn(B, local_s, hidden, generator=torch.Generator().manual_seed(3)).requires_grad_()
    with SavedTensorMeter(exclude=[*model.parameters(), cos, sin]) as meter:
        y = model.layers[0](x, cos, sin)
    del y
    return meter.bytes


def _rank(rank: int, world: int) -> dict[bool, int]:
    cfg = get_model_config("debug")
    out = {}
    for sp in ((False, True) if world > 1 else (False,)):
        ctx = ParallelContext.from_degrees(Degrees(tp=world), "cpu")
        model = apply_tensor_parallel(build_model(cfg, seed=0), ctx, sp=sp)
        out[sp] = _traced(model, S // world if sp else S, cfg.hidden_size)
    return out


@pytest.fixture(scope="module")
def traced() -> dict[int, dict[bool, int]]:
    """Bytes one layer saves, per tp degree and SP (rank 0; the ranks are symmetric)."""
    res = {1: _rank(0, 1)}
    for tp in (2, 4):
        res[tp] = run_ranks(_rank, world_size=tp)[0]
    return res


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True), (4, False), (4, True)])
def test_planner_activation_memory_is_the_runtime_formula_and_the_traced_bytes(traced, tp, sp):
    cfg = get_model_config("debug")
    runtime = layer_activation_bytes(cfg, S, B, tp, sp, act_bytes=4)
    planner = llama_layer_activation_bytes(cfg, B * S, S, precision="fp32", tp=tp, sp=sp).saved
    assert planner == runtime
    assert traced[tp][sp] == planner, (tp, sp, traced[tp][sp], planner)
