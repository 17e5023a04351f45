"""Packed documents: where they start (data/documents.py), their RoPE positions, and the one-process masked
attention (models/documents.py) against each document run alone, in float64."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pentatron.data.documents import find_documents
from pentatron.models.documents import Documents, documents_record
from pentatron.models.llama import build_model
from pentatron.models.registry import get_model_config

EOS = 0


def test_a_document_starts_at_the_sample_start_and_at_each_eos():
    x = torch.tensor([[7, 8, EOS, 9, EOS, EOS, 5], [EOS, 1, 2, 3, 4, 5, 6]])
    docs = find_documents(x, EOS)
    assert docs.starts == ((0, 2, 4, 5), (0,))
    assert docs.spans(0) == [(0, 2), (2, 4), (4, 5), (5, 7)]
    assert docs.positions().tolist() == [[0, 1, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6]]
    assert docs.ids.tolist()[0] == [0, 0, 1, 1, 2, 3, 3]
    assert not docs.single and find_documents(x[1:], EOS).single
    with pytest.raises(ValueError, match="begin at 0"):
        Documents(((1, 3),), 7)
    # lengths 2, 2, 1, 2 and 7: the step record's figures; pairs 3+3+1+3 + 28 of the dense 2·28
    assert documents_record([docs]) == {"mean_tokens": 14 / 5, "mean_sq_tokens": 62 / 5, "attention_pairs": 38 / 56}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(replace(get_model_config("debug"), n_layers=2), seed=0, dtype=torch.float64)


def test_masked_forward_and_backward_equal_each_document_alone(model):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, 4096, (2, 32), generator=g)
    x[0, [1, 2, 9, 30]] = EOS  # a one-token document, a two-token one at the end
    x[1, 17] = EOS
    docs = find_documents(x, EOS)
    out = model(x, docs.positions(), None, docs)
    out.square().sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = torch.cat([torch.cat([model(x[i:i + 1, s:e]) for s, e in docs.spans(i)], dim=1) for i in range(2)])
    ref.square().sum().backward()
    assert torch.allclose(out, ref, rtol=1e-10, atol=0)
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-10, atol=1e-13), n
    model.zero_grad()


def test_a_sample_holding_one_document_is_the_unmasked_causal_run(model):
    x = torch.randint(1, 4096, (2, 32), generator=torch.Generator().manual_seed(1))
    docs = find_documents(x, EOS)
    assert docs.single
    assert torch.equal(model(x, docs.positions(), None, docs), model(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's varlen flash path; on CPU the loop is the kernel")
def test_the_cuda_varlen_kernel_equals_the_segment_loop():
    """On CUDA in bf16, document masking's attention is one varlen flash call: it must equal the
    per-segment loop (fp64) to bf16's flash tolerance, output and gradients."""
    from pentatron.models.documents import _varlen_applies, document_attention, segment_loop_attention

    docs = Documents(((0, 5, 40, 41, 100), (0, 77)), 128)
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(2, heads, 128, 64, generator=g).cuda().bfloat16() for heads in (4, 2, 2, 4))  # GQA
    assert _varlen_applies(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    document_attention(*leaves, docs).backward(dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = segment_loop_attention(*ref_leaves, docs)
    ref.backward(dout.double())
    got = document_attention(q, k, v, docs)
    for a, b in [(got, ref), *((x.grad, y.grad) for x, y in zip(leaves, ref_leaves))]:
        assert (a.double() - b).abs().max() <= 3e-2 * b.abs().max()
