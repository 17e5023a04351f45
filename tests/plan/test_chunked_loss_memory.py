"""The planner's loss term for our chunked loss (plan/memory.py `stage_extras`, cross_entropy="chunked") is
what `models/loss.py` allocates: the peak grows with one chunk's logits and the weight's gradient, not with
the tokens' logits (measured with the profiler's allocation events, fp32 and bf16)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pentatron.models.loss import linear_cross_entropy
from pentatron.models.registry import get_model_config
from pentatron.observe.profiler import peak_allocation_growth
from pentatron.plan.memory import stage_extras

N, H, CHUNK = 1024, 32, 128


def _measured_peak(dtype: torch.dtype, vocab: int) -> int:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w = torch.randn(vocab, H, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (N,), generator=g)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        linear_cross_entropy(x, w, t, CHUNK).backward()
    return peak_allocation_growth(prof, torch.device("cpu"))


def _planned(precision: str, vocab: int, tokens: int = N, chunk: int = CHUNK) -> float:
    cfg = dataclasses.replace(get_model_config("debug"), vocab_size=vocab, hidden_size=H)
    return sum(stage_extras(cfg, tokens, first=False, last=True, precision=precision, cross_entropy="chunked",
                            loss_chunk_tokens=chunk))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_loss_peak_per_vocabulary_entry_is_the_planners(dtype):
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    v1, v2 = 4096, 8192  # the per-token terms cancel in the difference
    measured = (_measured_peak(dtype, v2) - _measured_peak(dtype, v1)) / (v2 - v1)
    planned = (_planned(precision, v2) - _planned(precision, v1)) / (v2 - v1)
    assert planned == CHUNK * (4 + (2 if precision == "bf16" else 0)) + H * 4
    assert measured == pytest.approx(planned, rel=0.03)


def test_the_term_grows_with_the_chunk_not_the_tokens():
    per_vocab = [(_planned("bf16", 16384, tokens=n) - _planned("bf16", 8192, tokens=n)) / 8192 for n in (4096, 8192)]
    assert per_vocab[0] == per_vocab[1]  # more tokens: same logits peak (the per-token terms cancel)
    eager = dataclasses.replace(get_model_config("debug"), vocab_size=128256)
    full = sum(stage_extras(eager, 4096, first=False, last=True, precision="bf16"))
    chunked = sum(stage_extras(eager, 4096, first=False, last=True, precision="bf16", cross_entropy="chunked"))
    assert chunked < full / 3
