"""Issue 9 item 6: the planner's activation memory is the runtime's formula, and both match the bytes
autograd really keeps for one decoder layer under real tensor parallelism (gloo ranks), tp in {1, 2, 4}
with and without sequence parallelism; and the loss's peak is the planner's, measured."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pentatron.distributed.context import Degrees, ParallelContext
from pentatron.models.llama import build_model
from pentatron.models.registry import get_model_config
from pentatron.parallel.activation_memory import SavedTensorMeter, layer_activation_bytes
from pentatron.parallel.tensor import apply_tensor_parallel
from pentatron.plan.memory import llama_layer_activation_bytes, stage_extras
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


class _PeakMeter(TorchDispatchMode):
    """Peak bytes of the tensor storages that ops create inside the `with` block (each freed storage
    leaves the count when it is deallocated): what a caching allocator would have to hold."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                storage = t.untyped_storage()
                key, n = storage.data_ptr(), storage.nbytes()
                self.live[key] = n
                self.current += n
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_loss_peak_is_the_planners(dtype):
    """`F.cross_entropy(logits.float())` as training runs it (the logits dropped before backward): the
    forward holds the logits, their fp32 copy and the saved log-softmax; the backward the saved
    log-softmax, the incoming fp32 gradient and the new one, 12 bytes per token and vocabulary entry,
    which is what the planner's last stage keeps and adds (saved + transient per vocabulary entry)."""
    n, v, h = 2048, 4096, 32
    x = torch.randn(n, h, dtype=dtype, requires_grad=True)
    w = torch.randn(v, h, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    with _PeakMeter() as meter:
        loss = torch.nn.functional.cross_entropy((x @ w.t()).float(), targets)
        loss.backward()
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    per_entry = []
    for vocab in (v, 2 * v):
        cfg = dataclasses.replace(get_model_config("debug"), vocab_size=vocab)
        per_entry.append(sum(stage_extras(cfg, n, first=False, last=True, precision=precision)))
    planner = (per_entry[1] - per_entry[0]) / (n * v)
    assert planner == 12
    assert meter.peak / (n * v) == pytest.approx(planner, rel=0.02)
