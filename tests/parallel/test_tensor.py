"""Tensor/sequence parallelism, layer by layer: each parallel layer against its plain PyTorch
counterpart on the gathered weights (outputs, input and weight gradients; float64 on both sides, so the
bar is `EXACT_RTOL`, 1e-10), the comm ledger against the playbook's volumes, saved activations against
the derived formula, and bad configurations.

All the 2-rank checks run in one `run_ranks` call (module fixture) to pay process start-up once."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pentatron.config import ConfigError, load_config
from pentatron.distributed.context import ParallelContext
from pentatron.distributed.functional import copy_to_parallel, gather_sequence, reduce_from_parallel, scatter_sequence
from pentatron.layout import ParallelLayout, tensor_parallel_problems, tensor_parallel_warnings
from pentatron.models.llama import build_model
from pentatron.models.registry import get_model_config
from pentatron.parallel.activation_memory import SavedTensorMeter, layer_activation_bytes
from pentatron.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    sum_partial_grads,
    sum_partial_param_grads,
    vocab_parallel_cross_entropy,
)
from tests.multiprocess import run_ranks
from tests.reference_loop import EXACT_RTOL

B, S, H = 2, 32, 128
F64 = torch.float64  # the parity checks' dtype (the ledger and memory checks keep the model's fp32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _randn(*shape: int, seed: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ------------------------------------------------------------------------------------ 2-rank suite
def _layer_checks(ctx: ParallelContext, sp: bool) -> dict[str, float]:
    """Relative errors of every parallel layer against the unsharded reference (same on all ranks)."""
    comm, t, r = ctx.comm, ctx.size("tp"), ctx.local_rank("tp")
    out: dict[str, float] = {}
    tag = "sp" if sp else "tp"
    seq = slice(r * S // t, (r + 1) * S // t)

    def seq_part(x: torch.Tensor) -> torch.Tensor:
        return x[:, seq] if sp else x

    # Column-parallel: W split along the output features, input replicated (or sequence-sharded).
    x, w, dy = _randn(B, S, H, seed=1), _randn(3 * H, H, seed=2), _randn(B, S, 3 * H, seed=3)
    x.requires_grad_(), w.requires_grad_()
    (F.linear(x, w) * dy).sum().backward()
    cols = slice(r * 3 * H // t, (r + 1) * 3 * H // t)
    wl = torch.nn.Parameter(w.detach()[cols].clone())
    xl = seq_part(x.detach()).clone().requires_grad_()
    col = ColumnParallelLinear(wl, comm, sequence_parallel=sp, communicate_input=True)
    y = col(xl)
    (y * dy[..., cols]).sum().backward()
    out[f"column/{tag}/out"] = _rel(y, F.linear(x, w).detach()[..., cols])
    out[f"column/{tag}/dx"] = _rel(xl.grad, seq_part(x.grad))
    out[f"column/{tag}/dw"] = _rel(wl.grad, w.grad[cols])

    # Row-parallel: W split along the input features; output summed (or reduce-scattered).
    x, w, dy = _randn(B, S, 2 * H, seed=4), _randn(H, 2 * H, seed=5), _randn(B, S, H, seed=6)
    x.requires_grad_(), w.requires_grad_()
    ref = F.linear(x, w)
    (ref * dy).sum().backward()
    ins = slice(r * 2 * H // t, (r + 1) * 2 * H // t)
    wl = torch.nn.Parameter(w.detach()[:, ins].clone())
    xl = x.detach()[..., ins].clone().requires_grad_()
    y = RowParallelLinear(wl, comm, sequence_parallel=sp)(xl)
    (y * seq_part(dy)).sum().backward()
    out[f"row/{tag}/out"] = _rel(y, seq_part(ref.detach()))
    out[f"row/{tag}/dx"] = _rel(xl.grad, x.grad[..., ins])
    out[f"row/{tag}/dw"] = _rel(wl.grad, w.grad[:, ins])

    # Vocab-parallel embedding against nn.Embedding (ids from every rank's slice).
    vocab = 64
    emb = torch.nn.Embedding(vocab, H)
    with torch.no_grad():
        emb.weight.copy_(_randn(vocab, H, seed=7))
    tokens = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(8))
    dy = _randn(B, S, H, seed=9)
    ref = emb(tokens)
    (ref * dy).sum().backward()
    rows = slice(r * vocab // t, (r + 1) * vocab // t)
    wl = torch.nn.Parameter(emb.weight.detach()[rows].clone())
    y = VocabParallelEmbedding(wl, rows.start, comm, sequence_parallel=sp)(tokens)
    (y * seq_part(dy)).sum().backward()
    out[f"embedding/{tag}/out"] = _rel(y, seq_part(ref.detach()))
    out[f"embedding/{tag}/dw"] = _rel(wl.grad, emb.weight.grad[rows])

    # Vocab-parallel cross-entropy against F.cross_entropy, with ignored targets and large logits.
    logits = (_randn(B * S, vocab, seed=10) * 30).requires_grad_()
    targets = torch.randint(0, vocab, (B * S,), generator=torch.Generator().manual_seed(11))
    targets[::7] = -100
    ref = F.cross_entropy(logits, targets)
    ref.backward()
    ll = logits.detach()[:, rows].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(ll, targets, comm)
    loss.backward()
    out[f"cross_entropy/{tag}/loss"] = _rel(loss.detach(), ref.detach())
    out[f"cross_entropy/{tag}/dlogits"] = _rel(ll.grad, logits.grad[:, rows])
    none = vocab_parallel_cross_entropy(ll.detach(), targets, comm, reduction="none")
    out[f"cross_entropy/{tag}/none"] = _rel(none, F.cross_entropy(logits.detach(), targets, reduction="none"))
    return out


def _operator_checks(ctx: ParallelContext) -> dict[str, float]:
    """The conjugate pairs: forward values and backward grads of f, g and the sequence pair."""
    comm, t, r = ctx.comm, ctx.size("tp"), ctx.local_rank("tp")
    x = _randn(B, S, H, seed=20 + r).requires_grad_()  # a different tensor on each rank
    parts = [_randn(B, S, H, seed=20 + i) for i in range(t)]
    dys = [_randn(B, S, H, seed=40 + i) for i in range(t)]
    total = sum(parts)
    out = {}
    # f: identity forward; backward sums the grads of all ranks.
    (copy_to_parallel(x, comm) * dys[r]).sum().backward()
    out["f/backward"] = _rel(x.grad, sum(dys))
    x.grad = None
    # g: forward sums; backward identity.
    y = reduce_from_parallel(x, comm)
    (y * dys[r]).sum().backward()
    out["g/forward"], out["g/backward"] = _rel(y, total), _rel(x.grad, dys[r])
    x.grad = None
    # sequence gather: forward concatenates the ranks' chunks; backward reduce-scatters.
    dgs = [_randn(B, t * S, H, seed=60 + i) for i in range(t)]
    y = gather_sequence(x, comm)
    (y * dgs[r]).sum().backward()
    out["gather/forward"] = _rel(y, torch.cat(parts, dim=1))
    out["gather/backward"] = _rel(x.grad, sum(dgs)[:, r * S:(r + 1) * S])
    x.grad = None
    # sequence scatter: forward sums and keeps this rank's chunk; backward all-gathers.
    y = scatter_sequence(x, comm)
    seq = slice(r * S // t, (r + 1) * S // t)
    (y * dys[r][:, seq]).sum().backward()
    out["scatter/forward"] = _rel(y, total[:, seq])
    out["scatter/backward"] = _rel(x.grad, torch.cat([d[:, i * S // t:(i + 1) * S // t] for i, d in enumerate(dys)],
                                                     dim=1))
    return out


def _ledger_of(ctx: ParallelContext, fn: Any) -> dict[str, dict[str, int]]:
    ctx.comm.ledger.begin_step()
    fn()
    s = ctx.comm.ledger.summary()
    return {op: {"calls": v["calls"], "payload": v["payload_bytes"], "bytes": v["bytes"]}
            for op, v in s.by_dim.get("tp", {}).items()}


def _block_comm(ctx: ParallelContext, sp: bool) -> dict[str, Any]:
    """Ledger of one decoder layer, forward and backward separately, and of a whole model step."""
    cfg = get_model_config("debug")
    model = apply_tensor_parallel(build_model(cfg, seed=0), ctx, sp=sp)
    t = ctx.size("tp")
    cos, sin = model.rotary(torch.arange(S))
    x = _randn(B, S // t if sp else S, H, seed=30, dtype=torch.float32).requires_grad_()
    holder: dict[str, torch.Tensor] = {}
    fwd = _ledger_of(ctx, lambda: holder.update(y=model.layers[0](x, cos, sin)))
    bwd = _ledger_of(ctx, lambda: holder["y"].sum().backward())
    tokens = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(31))

    def step() -> None:  # one micro-batch's forward and backward, then the step's sum of partial gradients
        vocab_parallel_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], ctx.comm).backward()
        sum_partial_param_grads(model)

    step = _ledger_of(ctx, step)
    return {"fwd": fwd, "bwd": bwd, "step": step}


def _activation_bytes(ctx: ParallelContext, sp: bool) -> tuple[int, int]:
    cfg = get_model_config("debug")
    model = apply_tensor_parallel(build_model(cfg, seed=0), ctx, sp=sp)
    t = ctx.size("tp")
    return _measure_layer(model, cfg, S // t if sp else S), layer_activation_bytes(cfg, S, B, t, sp)


def _measure_layer(model: torch.nn.Module, cfg: Any, local_s: int, dtype: torch.dtype = torch.float32) -> int:
    cos, sin = model.rotary(torch.arange(S))
    x = _randn(B, local_s, cfg.hidden_size, seed=32, dtype=torch.float32).to(dtype).requires_grad_()
    with SavedTensorMeter(exclude=[*model.parameters(), cos, sin]) as meter:
        y = model.layers[0](x, cos, sin)
    del y
    return meter.bytes


def _partial_sums(ctx: ParallelContext) -> dict[str, Any]:
    """`sum_partial_grads` with a 2,000-byte buffer over float64 tensors of 10, 300, 20 and a transposed
    (non-contiguous) 4×5: [10] concatenated, [300] alone in place, [20, 4×5] concatenated: 3 all-reduces,
    each tensor the exact sum of both ranks' (a + b in float64)."""
    shapes = [(10,), (300,), (20,), (5, 4)]

    def tensors(rank: int) -> list[torch.Tensor]:
        out = [_randn(*s, seed=40 + 10 * rank + i, dtype=torch.float64) for i, s in enumerate(shapes)]
        out[-1] = out[-1].t()
        return out

    mine = tensors(ctx.local_rank("tp"))
    ledger = _ledger_of(ctx, lambda: sum_partial_grads(mine, ctx.comm, chunk_bytes=2000))
    exact = all(torch.equal(g, a + b) for g, a, b in zip(mine, tensors(0), tensors(1), strict=True))
    return {"calls": ledger["all_reduce"]["calls"], "payload": ledger["all_reduce"]["payload"], "exact": exact}


def _tp2_suite(rank: int, world_size: int) -> dict[str, Any]:
    ctx = ParallelContext.from_layout(ParallelLayout(tp=world_size), "cpu")
    errors = {**_layer_checks(ctx, sp=False), **_layer_checks(ctx, sp=True), **_operator_checks(ctx)}
    comm = {sp: _block_comm(ctx, sp) for sp in (False, True)}
    memory = {sp: _activation_bytes(ctx, sp) for sp in (False, True)}
    return {"errors": errors, "comm": comm, "memory": memory, "partial": _partial_sums(ctx)}


@pytest.fixture(scope="module")
def tp2() -> list[dict[str, Any]]:
    return run_ranks(_tp2_suite, 2)


# ------------------------------------------------------------------------------------ layer parity
@pytest.mark.parametrize("layer", ["column", "row", "embedding", "cross_entropy"])
@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_parallel_layer_matches_unsharded(tp2, layer, mode):
    for rank, res in enumerate(tp2):
        checks = {k: v for k, v in res["errors"].items() if k.startswith(f"{layer}/{mode}/")}
        assert len(checks) >= 2, checks
        bad = {k: v for k, v in checks.items() if not v <= EXACT_RTOL}
        assert not bad, f"rank {rank}: {bad}"


def test_conjugate_operators(tp2):
    for rank, res in enumerate(tp2):
        checks = {k: v for k, v in res["errors"].items() if "/forward" in k or "/backward" in k}
        assert len(checks) == 7
        assert all(v <= EXACT_RTOL for v in checks.values()), f"rank {rank}: {checks}"


# ------------------------------------------------------------------------------------ communication
def test_tp_layer_moves_two_all_reduces_each_way(tp2):
    """Per layer and micro-batch: 2 all-reduces of s·b·h forward (o_proj, down_proj) and 2 backward
    (the inputs of the attention and MLP regions), nothing else."""
    sbh, t = S * B * H * 4, 2
    for res in tp2:
        fwd, bwd = res["comm"][False]["fwd"], res["comm"][False]["bwd"]
        for ledger in (fwd, bwd):
            assert set(ledger) == {"all_reduce"}
            assert ledger["all_reduce"]["calls"] == 2
            assert ledger["all_reduce"]["payload"] == 2 * sbh
            assert ledger["all_reduce"]["bytes"] == 2 * 2 * (t - 1) * sbh // t


def test_sp_layer_moves_the_same_volume_as_gathers_and_scatters(tp2):
    """Under SP each all-reduce becomes an all-gather plus a reduce-scatter of the full s·b·h: the
    same wire bytes, and nothing else: the norm weights' partial gradients are summed over tp once per
    step, not in the layer's backward (the whole-model step below)."""
    sbh, t = S * B * H * 4, 2
    for res in tp2:
        tp_fwd, tp_bwd = res["comm"][False]["fwd"], res["comm"][False]["bwd"]
        fwd, bwd = res["comm"][True]["fwd"], res["comm"][True]["bwd"]
        for ledger in (fwd, bwd):
            for op in ("all_gather", "reduce_scatter"):
                assert ledger[op]["calls"] == 2 and ledger[op]["payload"] == 2 * sbh
                assert ledger[op]["bytes"] == 2 * (t - 1) * sbh // t
        assert set(fwd) == set(bwd) == {"all_gather", "reduce_scatter"}
        for tp_l, sp_l in ((tp_fwd, fwd), (tp_bwd, bwd)):
            sp_bytes = sp_l["all_gather"]["bytes"] + sp_l["reduce_scatter"]["bytes"]
            assert sp_bytes == tp_l["all_reduce"]["bytes"]


def test_partial_gradients_are_summed_in_bounded_buffers(tp2):
    """The step's tp sum of partial gradients (the MoE layers' under SP can be large) concatenates at most
    `chunk_bytes` at a time; a larger tensor goes alone, in place; the sums are exact."""
    for res in tp2:
        assert res["partial"] == {"calls": 3, "payload": (10 + 300 + 20 + 20) * 8, "exact": True}


def test_whole_model_step_ledger_is_exact(tp2):
    """A full forward/backward of the debug model: L layers, plus the vocab-parallel embedding
    (sum of partial lookups), the LM head's input (f, or its sequence gather) and the loss's two
    all-reduces of b·s numbers (max; target logit and sum of exps together); under SP the 2L + 1 norm
    weights' partial gradients summed over tp in one all-reduce."""
    cfg = get_model_config("debug")
    L, sbh, bs, t = cfg.n_layers, S * B * H * 4, B * S * 4, 2
    tp_step, sp_step = (tp2[0]["comm"][sp]["step"] for sp in (False, True))
    assert tp_step["all_reduce"]["calls"] == 4 * L + 2 + 2
    assert tp_step["all_reduce"]["payload"] == (4 * L + 2) * sbh + bs + 2 * bs
    assert set(tp_step) == {"all_reduce"}
    for op in ("all_gather", "reduce_scatter"):
        assert sp_step[op]["calls"] == 4 * L + 2
        assert sp_step[op]["payload"] == (4 * L + 2) * sbh
    assert sp_step["all_reduce"]["calls"] == 2 + 1  # loss; the 2L + 1 norm weights' gradients in one call
    assert sp_step["all_reduce"]["payload"] == 3 * bs + (2 * L + 1) * H * 4
    assert sp_step["all_gather"]["bytes"] + sp_step["reduce_scatter"]["bytes"] == \
        tp_step["all_reduce"]["bytes"] - 2 * (t - 1) * 3 * bs // t


# ------------------------------------------------------------------------------------ activation memory
def test_activation_memory_matches_derived_formula(tp2):
    for res in tp2:
        for sp in (False, True):
            measured, derived = res["memory"][sp]
            assert abs(measured / derived - 1) < 0.05, (sp, measured, derived)
    tp_only, with_sp = tp2[0]["memory"][False][0], tp2[0]["memory"][True][0]
    # SP shards the two norms (8·sbh of fp32 per norm pair) across the 2 ranks.
    assert tp_only - with_sp == pytest.approx(2 * (8 * S * B * H + 4 * S * B) / 2, rel=1e-9)


@pytest.mark.parametrize(("mlp", "dtype"), [("swiglu", torch.float32), ("gelu", torch.float32),
                                            ("swiglu", torch.bfloat16)])
def test_activation_memory_formula_single_rank(mlp, dtype):
    cfg = dataclasses.replace(get_model_config("debug"), mlp=mlp)
    model = build_model(cfg, seed=0, dtype=dtype)
    measured = _measure_layer(model, cfg, S, dtype)
    assert measured == layer_activation_bytes(cfg, S, B, act_bytes=dtype.itemsize)


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(("shape", "tp", "sp", "expected"), [
    ({}, 3, False, "parallel.tp=3 does not divide model.n_heads=4"),
    ({"n_heads": 8, "n_kv_heads": 4, "hidden_size": 256}, 8, False, ""),  # kv replicated ×2: allowed
    ({"n_heads": 6, "n_kv_heads": 4, "hidden_size": 96}, 6, False, "must divide model.n_kv_heads=4"),
    ({"n_heads": 8, "n_kv_heads": 8, "ffn_hidden_size": 100}, 8, False, "does not divide model.ffn_hidden_size"),
    ({"vocab_size": 4098}, 4, False, "does not divide model.vocab_size=4098"),
    ({}, 1, True, "parallel.sp=true needs parallel.tp > 1"),
])
def test_tensor_parallel_problems(shape, tp, sp, expected):
    cfg = dataclasses.replace(get_model_config("debug"), **shape)
    problems = tensor_parallel_problems(cfg, tp, sp, seq_len=64)
    if expected:
        assert any(expected in p for p in problems), problems
    else:
        assert problems == []


def test_sp_needs_sequence_divisible_by_tp():
    problems = tensor_parallel_problems(get_model_config("debug"), 4, True, seq_len=30)
    assert problems == ["parallel.sp=true needs train.seq_len=30 to be divisible by parallel.tp=4"]


def test_config_reports_tp_problems_before_any_process_group(tmp_path):
    (tmp_path / "c.toml").write_text("[parallel]\ntp = 3\nsp = true\n[train]\nseq_len = 64\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "c.toml", world_size=3)
    assert any("does not divide model.n_heads=4" in p for p in e.value.problems)
    assert any("seq_len=64 to be divisible by parallel.tp=3" in p for p in e.value.problems)
    # Tensor-parallel checkpoints are supported (tests/checkpoint/test_parallel_checkpoint.py).
    assert load_config(None, ["parallel.tp=2", "checkpoint.dir=/tmp/x", "train.micro_batch=4"],
                       world_size=2).checkpoint.dir == "/tmp/x"
    ok = load_config(None, ["parallel.tp=2", "parallel.sp=true", "train.seq_len=64", "train.micro_batch=4"],
                     world_size=4)
    assert ok.parallel.tp == 2 and ok.parallel.sp


_NO_GROUPS = {d: None for d in ("pp", "dp", "cp", "tp", "dp_cp")}


def test_apply_rejects_a_bad_split_and_warns_beyond_a_node():
    ctx = ParallelContext(ParallelLayout(tp=3), 0, torch.device("cpu"), _NO_GROUPS)
    with pytest.raises(ValueError, match="tp=3 does not divide model.n_heads=4"):
        apply_tensor_parallel(build_model(get_model_config("debug"), seed=0), ctx)
    assert tensor_parallel_warnings(8, 8) == []
    assert "larger than the node size (4 devices)" in tensor_parallel_warnings(8, 4)[0]
    ctx2 = ParallelContext(ParallelLayout(tp=2), 0, torch.device("cpu"), _NO_GROUPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_tensor_parallel(build_model(get_model_config("debug"), seed=0), ctx2, node_size=1)
    assert any("larger than the node size (1 devices)" in str(w.message) for w in caught)


def test_sharding_keeps_names_tie_and_slices():
    """Without any communication (a group-less tp=2 context): rank 1's parameters are exactly its
    slices of the full model, names unchanged, the embedding/LM-head tie intact."""
    cfg = get_model_config("debug")
    full = dict(build_model(cfg, seed=0).named_parameters())
    ctx = ParallelContext(ParallelLayout(tp=2), 1, torch.device("cpu"), _NO_GROUPS)
    model = apply_tensor_parallel(build_model(cfg, seed=0), ctx)
    local = dict(model.named_parameters())
    assert local.keys() == full.keys()
    assert model.lm_head.weight is model.embed.weight
    d = cfg.head_dim
    assert torch.equal(local["layers.0.attn.q_proj.weight"], full["layers.0.attn.q_proj.weight"][2 * d:])
    assert torch.equal(local["layers.0.attn.k_proj.weight"], full["layers.0.attn.k_proj.weight"][d:])
    assert torch.equal(local["layers.0.attn.o_proj.weight"], full["layers.0.attn.o_proj.weight"][:, 2 * d:])
    assert torch.equal(local["layers.1.mlp.down_proj.weight"], full["layers.1.mlp.down_proj.weight"][:, 128:])
    assert torch.equal(local["embed.weight"], full["embed.weight"][2048:])
    assert torch.equal(local["norm.weight"], full["norm.weight"])
