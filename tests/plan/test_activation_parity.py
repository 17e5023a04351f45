"""Issue 9 item 6: the planner's activation memory is the runtime's formula, and both match the bytes
autograd really keeps for one decoder layer under real tensor parallelism (gloo ranks), tp in {1, 2, 4}
with and without sequence parallelism (an MoE layer: tp 1 in fp32 and bf16, tp 2 ± SP), also in bf16
with FP8 GEMMs (train.fp8 tensorwise / rowwise: the planner's --precision fp8); and the loss's peak is
the planner's, measured (F.cross_entropy, our vocab-parallel loss, torch's loss_parallel)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import ProfilerActivity, profile

from pentatron.distributed.comm import Comm
from pentatron.distributed.context import ParallelContext
from pentatron.layout import ParallelLayout
from pentatron.models.llama import build_model
from pentatron.models.registry import get_model_config
from pentatron.observe.profiler import peak_allocation_growth
from pentatron.parallel.activation_memory import SavedTensorMeter, layer_activation_bytes
from pentatron.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy
from pentatron.plan.memory import llama_layer_activation_bytes, stage_extras
from tests.multiprocess import run_ranks

B, S = 2, 32


def _traced(model: torch.nn.Module, local_s: int, hidden: int, dtype: torch.dtype = torch.float32,
            layer: int = 0) -> int:
    cos, sin = model.rotary(torch.arange(S))  # fp32 tables in every precision, as the trainer keeps them
    x = torch.randn(B, local_s, hidden, generator=torch.Generator().manual_seed(3)).to(dtype).requires_grad_()
    with SavedTensorMeter(exclude=[*model.parameters(), cos, sin]) as meter:
        y = model.layers[layer](x, cos, sin)
    del y
    return meter.bytes


MODELS = ("debug", "debug-qwen3")  # Qwen3: q/k norms per local head, head_dim decoupled from hidden/heads
# one MoE layer (replicated over tp, on the SP shard under SP): debug-moe's shared expert, aux and z losses;
# Qwen3-MoE's q/k norms, no shared expert (so in bf16 nothing keeps the layer's bf16 input)
MOE_MODELS = ("debug-moe", "debug-qwen3-moe")
RECIPES = ("off", "tensorwise", "rowwise")  # train.fp8, traced in bf16


def _moe_layer(name: str) -> int:
    moe = get_model_config(name).moe
    assert moe is not None
    return moe.first_dense_layers


def _traced_ep(name: str, world: int) -> tuple[int, int]:
    """(bytes, rows received) of one MoE layer under ep = world (experts split, tokens sent by all-to-all):
    the planner takes the received rows as T·k (balanced); the rows each rank really got are read here."""
    from pentatron.parallel.expert import apply_expert_parallel

    ctx = ParallelContext.from_layout(ParallelLayout(dp=world, ep=world), "cpu")
    model = build_model(get_model_config(name), seed=0)
    apply_expert_parallel(model, ctx)
    layer = model.layers[_moe_layer(name)]
    hook, received = layer.moe.expert_parallel, []

    def plan(counts: torch.Tensor):
        splits = type(hook).plan(hook, counts)
        received.append(sum(splits.out_splits))
        return splits

    hook.plan = plan
    return _traced(model, S, model.cfg.hidden_size, layer=_moe_layer(name)), received[0]


def _rank(rank: int, world: int) -> dict[tuple[str, bool], int]:
    from pentatron.parallel.fp8 import apply_fp8

    out = {}
    for name in MOE_MODELS if world == 2 else ():
        out[f"{name}/ep2", False], out[f"{name}/ep2 rows", False] = _traced_ep(name, world)
    for name in MOE_MODELS if world <= 2 else ():
        cfg = get_model_config(name)
        for sp in ((False, True) if world > 1 else (False,)):
            ctx = ParallelContext.from_layout(ParallelLayout(tp=world), "cpu")
            for dtype in (torch.float32, torch.bfloat16) if world == 1 else (torch.float32,):
                model = apply_tensor_parallel(build_model(cfg, seed=0), ctx, sp=sp)
                for p in model.parameters():
                    p.data = p.data.to(dtype)
                out[f"{name}/{dtype}", sp] = _traced(model, S // world if sp else S, cfg.hidden_size, dtype,
                                                     _moe_layer(name))
    for name in MODELS:
        cfg = get_model_config(name)
        for sp in ((False, True) if world > 1 else (False,)):
            ctx = ParallelContext.from_layout(ParallelLayout(tp=world), "cpu")
            model = apply_tensor_parallel(build_model(cfg, seed=0), ctx, sp=sp)
            out[name, sp] = _traced(model, S // world if sp else S, cfg.hidden_size)
            if name != "debug":
                continue
            for recipe in RECIPES:  # bf16 weights (the rotary tables stay fp32), FP8 GEMMs as the trainer applies them
                model = apply_tensor_parallel(build_model(cfg, seed=0), ctx, sp=sp)
                for p in model.parameters():
                    p.data = p.data.to(torch.bfloat16)
                if recipe != "off":
                    apply_fp8(model, recipe, ctx.comm)
                out[recipe, sp] = _traced(model, S // world if sp else S, cfg.hidden_size, torch.bfloat16)
    return out


@pytest.fixture(scope="module")
def traced() -> dict[int, dict[tuple[str, bool], int]]:
    """Bytes one layer saves, per tp degree, model and SP (rank 0; the ranks are symmetric)."""
    res = {1: _rank(0, 1)}
    for tp in (2, 4):
        res[tp] = run_ranks(_rank, world_size=tp)[0]
    return res


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True), (4, False), (4, True)])
def test_planner_activation_memory_is_the_runtime_formula_and_the_traced_bytes(traced, tp, sp, name):
    cfg = get_model_config(name)
    runtime = layer_activation_bytes(cfg, S, B, tp, sp, act_bytes=4)
    planner = llama_layer_activation_bytes(cfg, B * S, S, precision="fp32", tp=tp, sp=sp).saved
    assert planner == runtime
    assert traced[tp][name, sp] == planner, (name, tp, sp, traced[tp][name, sp], planner)


@pytest.mark.parametrize("name", MOE_MODELS)
@pytest.mark.parametrize(("tp", "sp", "dtype"), [(1, False, torch.float32), (1, False, torch.bfloat16),
                                                 (2, False, torch.float32), (2, True, torch.float32)])
def test_an_moe_layer_keeps_what_the_planner_counts(traced, tp, sp, dtype, name):
    """The router's scores, ids and weights, the dispatch's indices and gathered rows, the grouped GEMMs'
    SwiGLU, the combine's outputs and weights and the shared experts (parallel/activation_memory.py
    `moe_activation_bytes`), byte for byte."""
    cfg = get_model_config(name)
    precision, a = ("fp32", 4) if dtype == torch.float32 else ("bf16", 2)
    layer = _moe_layer(name)
    planner = llama_layer_activation_bytes(cfg, B * S, S, precision=precision, tp=tp, sp=sp, layer=layer).saved
    assert planner == layer_activation_bytes(cfg, S, B, tp, sp, act_bytes=a, layer=layer)
    assert traced[tp][f"{name}/{dtype}", sp] == planner, (name, tp, sp, dtype, traced[tp][f"{name}/{dtype}", sp])


@pytest.mark.parametrize("name", MOE_MODELS)
def test_an_moe_layer_under_expert_parallelism_keeps_what_the_planner_counts_per_row(traced, name):
    """ep 2 (rank 0): the local experts' grouped GEMMs keep the rows received, regrouped by expert, and the
    regrouping and its inverse their int64 indices (+16 bytes per row). The planner takes the rows received as
    T·k; with the rows this rank really received in their place the count is exact."""
    cfg = get_model_config(name)
    assert cfg.moe is not None
    per_row = 4 * cfg.hidden_size + 4 * 4 * cfg.moe.expert_ffn_size + 16  # fp32: rows, SwiGLU, two indices
    rows = traced[2][f"{name}/ep2 rows", False]
    planner = llama_layer_activation_bytes(cfg, B * S, S, precision="fp32", layer=_moe_layer(name), ep=2).saved
    assert traced[2][f"{name}/ep2", False] == planner + (rows - B * S * cfg.moe.top_k) * per_row


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True), (4, True)])
def test_fp8_keeps_what_the_planner_counts(traced, tp, sp, recipe):
    """FP8 GEMMs keep for backward their high-precision input and weight (the same storages a bf16 linear
    keeps: the FP8 copies are cast again in backward), so --precision fp8 counts bf16's bytes, measured."""
    cfg = get_model_config("debug")
    planner = llama_layer_activation_bytes(cfg, B * S, S, precision="bf16" if recipe == "off" else "fp8", tp=tp,
                                           sp=sp).saved
    assert planner == layer_activation_bytes(cfg, S, B, tp, sp, act_bytes=2)
    assert traced[tp][recipe, sp] == planner, (recipe, tp, sp, traced[tp][recipe, sp], planner)


def _peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of the CPU allocator's live bytes while `fn` runs (torch.profiler's memory events: every
    allocation, also those inside DTensor's loss handlers that a dispatch mode never sees): what a
    caching allocator would have to hold on top of what existed before."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return peak_allocation_growth(prof, torch.device("cpu"))


def _planner_peak_per_entry(precision: str, tp: int, cross_entropy: str = "eager") -> float:
    """The last stage's loss bytes per token and local vocabulary entry, saved + transient, as the
    planner has them (the difference between two vocabulary sizes: the per-token terms cancel)."""
    n, per = 2048, []
    for vocab in (8192, 16384):
        cfg = dataclasses.replace(get_model_config("debug"), vocab_size=vocab)
        per.append(sum(stage_extras(cfg, n, first=False, last=True, precision=precision, tp=tp,
                                    cross_entropy=cross_entropy)))
    return (per[1] - per[0]) / (n * 8192 / tp)


N, H, V = 2048, 32, 8192  # tokens, hidden size, vocabulary (the logits dominate every other allocation)


def _loss_inputs(dtype: torch.dtype, v_local: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, dtype=dtype, generator=g).requires_grad_()
    w = torch.randn(v_local, H, dtype=dtype, generator=g).requires_grad_()
    return x, w, torch.randint(0, V, (N,), generator=g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_loss_peak_is_the_planners(dtype):
    """`F.cross_entropy(logits.float())` as training runs it (the logits dropped before backward): the
    forward holds the logits, their fp32 copy and the saved log-softmax; the backward the saved
    log-softmax, the incoming fp32 gradient and the new one, 12 bytes per token and vocabulary entry,
    which is what the planner's last stage keeps and adds (saved + transient per vocabulary entry)."""
    x, w, targets = _loss_inputs(dtype, V)

    def step() -> None:
        logits = x @ w.t()
        loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        del logits
        loss.backward()

    planner = _planner_peak_per_entry("bf16" if dtype == torch.bfloat16 else "fp32", tp=1)
    assert planner == 12
    assert _peak_bytes(step) / (N * V) == pytest.approx(planner, rel=0.02)


def _ours_step(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, comm: Comm) -> None:
    logits = x @ w.t()
    loss = vocab_parallel_cross_entropy(logits.float(), targets, comm)
    del logits
    loss.backward()


def _torch_loss_parallel_step(x: DTensor, w: DTensor, targets: torch.Tensor) -> None:
    logits = torch.nn.functional.linear(x, w)  # vocabulary-sharded, as torchtitan's LM head leaves them
    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        del logits
        loss.backward()


def _tp_loss_peaks(rank: int, world: int) -> dict[str, float]:
    """Per dtype, the peak bytes per token and local vocabulary entry of ours (`vocab_parallel_cross_entropy`)
    and of torch's `loss_parallel`, each run as torchtitan's step does: logits.float(), the loss, the
    logits dropped, backward."""
    ctx = ParallelContext.from_layout(ParallelLayout(tp=world), "cpu")
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        x, w, targets = _loss_inputs(dtype, V // world)
        xd = DTensor.from_local(x.detach(), mesh, [Replicate()]).requires_grad_()
        wd = DTensor.from_local(w.detach(), mesh, [Shard(0)]).requires_grad_()
        steps = {"eager": functools.partial(_ours_step, x, w, targets, ctx.comm),
                 "loss_parallel": functools.partial(_torch_loss_parallel_step, xd, wd, targets)}
        for name, step in steps.items():
            out[f"{name}/{dtype}"] = _peak_bytes(step) / (N * V / world)
    return out


@pytest.fixture(scope="module")
def tp_loss_peaks() -> dict[str, float]:
    return run_ranks(_tp_loss_peaks, world_size=2)[0]


@pytest.mark.parametrize("cross_entropy", ["eager", "loss_parallel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_vocab_parallel_loss_peaks_are_the_planners(tp_loss_peaks, cross_entropy, dtype):
    """Under TP (2 gloo ranks) the loss holds more than F.cross_entropy's 12 bytes per entry: ours 14 in
    bf16 (the bf16 logits, the fp32 copy, its shifted copy and the exponential that becomes the saved
    softmax) and 12 in fp32; torch's loss_parallel 16 in both (its fused nll + log-softmax backward makes
    a zero-filled gradient, the exponential of the saved log-softmax and their sum beside it)."""
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    planner = _planner_peak_per_entry(precision, tp=2, cross_entropy=cross_entropy)
    expected = {("eager", "bf16"): 14, ("eager", "fp32"): 12}.get((cross_entropy, precision), 16)
    assert planner == expected
    assert tp_loss_peaks[f"{cross_entropy}/{dtype}"] == pytest.approx(planner, rel=0.02)


class _NanotronStyleLoss(torch.autograd.Function):
    """The tensors nanotron's `_ShardedCrossEntropy` (parallel/tensor_parallel/functional.py L31-107 at
    67c5ebb6a9) makes, at one TP rank: the max subtracted into a new fp32 tensor that is exponentiated,
    normalised and kept in place; backward edits the kept softmax in place and returns it."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        shifted = logits - logits.max(dim=-1, keepdim=True).values
        picked = shifted.gather(-1, targets[:, None]).squeeze(-1)
        torch.exp(shifted, out=shifted)
        total = shifted.sum(dim=-1)
        loss = torch.log(total) - picked
        shifted.div_(total[:, None])
        ctx.save_for_backward(shifted, targets)
        return loss.mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        softmax, targets = ctx.saved_tensors
        softmax[torch.arange(len(targets)), targets] -= 1.0
        softmax.mul_(grad / len(targets))
        return softmax, None


def test_nanotrons_loss_peak_is_the_planners():
    """nanotron casts the bf16 logits to fp32 in the model and drops them before its loss (models/llama.py
    L876): forward holds the fp32 logits and the shifted copy it keeps, 8 bytes per token and entry; the
    backward works in place and casts the gradient to bf16 (4 + 2). The planner's cross_entropy="nanotron"."""
    x, w, targets = _loss_inputs(torch.bfloat16, V)

    def step() -> None:
        logits = (x @ w.t()).float()  # the bf16 logits die here: the model returns the fp32 copy
        loss = _NanotronStyleLoss.apply(logits, targets)
        del logits
        loss.backward()

    for tp in (1, 2):
        assert _planner_peak_per_entry("bf16", tp=tp, cross_entropy="nanotron") == 8
    assert _peak_bytes(step) / (N * V) == pytest.approx(8, rel=0.02)
