"""The planner's formulas against the real model, built on the meta device."""

from __future__ import annotations

import pytest

from pentatron.models.registry import get_model_config
from pentatron.plan.verify import TOLERANCE, verify_model


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_debug_model_matches(recompute):
    checks = verify_model(get_model_config("debug"), 256, micro_batch=2, recompute=recompute)
    assert len(checks) == 4
    for c in checks:
        assert c.traced > 0 and c.rel_error <= TOLERANCE, c


def test_qwen3_matches():
    """Qwen3's q/k norm gains and saved tensors, and its head_dim decoupled from hidden/heads (48 × 4 ≠ 128)."""
    cfg = get_model_config("debug-qwen3")
    assert cfg.qk_norm and cfg.n_heads * cfg.head_dim != cfg.hidden_size
    for kw in ({"micro_batch": 2}, {"precision": "fp32"}):  # recompute variants are deltas the norms do not touch
        checks = verify_model(cfg, 128, **kw)
        assert len(checks) == 4
        for c in checks:
            assert c.traced > 0 and c.ok, (kw, c)


def test_fp32_untied():
    for c in verify_model(get_model_config("debug-untied"), 128, precision="fp32"):
        assert c.ok, c


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b"])
def test_llama3_matches(name):
    checks = verify_model(get_model_config(name), 4096, micro_batch=1)
    for c in checks:
        assert c.ok, c
    saved = checks[-1].traced
    assert saved > 10 * 2**30  # tens of GiB of activations per 4k sequence: really traced, not zero


def test_disagreement_is_detected(monkeypatch):
    import pentatron.plan.verify as v

    real = v.llama_layer_activation_bytes

    def off_by_five_percent(*a, **k):
        r = real(*a, **k)
        return type(r)(r.saved * 1.05, r.working)

    monkeypatch.setattr(v, "llama_layer_activation_bytes", off_by_five_percent)
    checks = v.verify_model(get_model_config("debug"), 128)
    assert not checks[-1].ok and all(c.ok for c in checks[:-1])


def test_verify_traces_the_given_layout():
    """Issue 39: --verify traces the rank of the layout it is given (tp +- SP through the real tensor-parallel
    block, the last stage for pp > 1), not tp = 1: the bytes differ from tp 1's and agree with the formula."""
    cfg = get_model_config("debug")
    saved = {}
    for kw in ({}, {"tp": 2}, {"tp": 2, "sp": True}, {"pp": 2}):
        checks = verify_model(cfg, 128, **kw)
        for c in checks:
            assert c.traced > 0 and c.ok, (kw, c)
        assert (len(checks) == 5) == bool(kw)  # + the traced rank's parameters
        saved[tuple(kw.items())] = checks[-1].traced
    assert len(set(saved.values())) == 4, saved
    assert max(saved.values()) == saved[()]


@pytest.mark.parametrize("kw", [{}, {"tp": 2}, {"tp": 2, "sp": True}, {"tp": 4, "sp": True}, {"pp": 2},
                                {"pp": 2, "tp": 2, "sp": True}, {"recompute": "full"}, {"precision": "fp32"}],
                         ids=["tp1", "tp2", "tp2sp", "tp4sp", "pp2", "pp2tp2sp", "full", "fp32"])
@pytest.mark.parametrize("chunk", [0, 64], ids=["full-logits", "chunked"])
def test_the_traced_loss_is_the_trainers_and_the_formulas_are_exact(kw, chunk):
    """--verify traces the loss training runs (train.loss_chunk_tokens: the chunked LM head + loss by
    default, or full logits) and the planner's parameters, FLOPs and saved bytes equal the trace exactly
    on every layout: the chunked loss's backward replays the head GEMM (hardware FLOPs), and under SP the
    LM head keeps its all-gathered input (a·h per token, not a·h/tp)."""
    checks = verify_model(get_model_config("debug"), 128, loss_chunk_tokens=chunk, **kw)
    for c in checks:
        assert c.traced > 0 and c.analytic == c.traced, (kw, chunk, c)


def test_the_chunked_loss_replays_the_head_gemm_of_all_chunks_but_the_last_in_the_trace():
    cfg = get_model_config("debug")
    tokens = 2 * 128
    flops = {chunk: verify_model(cfg, 128, micro_batch=2, loss_chunk_tokens=chunk)[2].traced
             for chunk in (0, 64, 1024)}
    assert flops[64] - flops[0] == 2 * cfg.hidden_size * cfg.vocab_size * (tokens - 64)
    assert flops[1024] == flops[0]  # the tokens in one chunk: forward keeps it, nothing replays


def test_sp_head_input_is_the_gathered_one():
    """Issue 36: under SP our head all-gathers the sequence shards and keeps the gathered input for its
    backward; Megatron's (sp_inputs="sharded") keeps the shard."""
    from pentatron.plan.memory import stage_extras

    cfg, n, a = get_model_config("debug"), 128, 2
    h = cfg.hidden_size
    for loss in ("eager", "chunked"):
        no_sp, _ = stage_extras(cfg, n, first=False, last=True, tp=2, sp=False, cross_entropy=loss)
        ours, _ = stage_extras(cfg, n, first=False, last=True, tp=2, sp=True, cross_entropy=loss)
        megatron, _ = stage_extras(cfg, n, first=False, last=True, tp=2, sp=True, cross_entropy=loss,
                                   sp_inputs="sharded")
        assert ours - megatron == n * a * h / 2
        # the norm's tensors are sharded (fp32 copy 4h, rstd 4, normalised a·h), the head input is not
        assert no_sp - ours == n * (4 * h / 2 + 4 / 2 + a * h / 2)
