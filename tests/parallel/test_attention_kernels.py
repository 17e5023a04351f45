"""Ring attention's block kernels (parallel/attention_kernels.py), one process: GQA without copying the K/V.

Every kernel takes k/v with fewer heads than q and returns dK/dV with k's heads. The math kernel (grouped
query rows, fp64) is checked against autograd through `scaled_dot_product_attention`; the scheme the CUDA
memory-efficient and cuDNN kernels use (`_EqualHeads`: grouped rows unmasked, K/V expanded causal) is checked
on CPU with the CPU flash kernel standing in (held to equal heads), on the strided slices ring attention
passes. The CUDA kernels' op bindings are checked on the meta device here, and against the math kernel
wherever CUDA exists (and by benchmarks/gpu_check.py part (c) on a GPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pentatron.parallel.attention_kernels import (
    CUDA_ONLY,
    FusedKernel,
    MathKernel,
    _CpuFlash,
    _EqualHeads,
    block_kernel,
)

B, H, HK, S, D = 2, 8, 2, 12, 16
SCALE = D ** -0.5


class _EqualHeadsOnCpu(_EqualHeads):
    """The equal-heads scheme around the CPU flash kernel, which must never see fewer kv heads."""

    name = "equal-heads-cpu"

    def _forward(self, q, k, v, causal, scale):
        assert k.shape[1] == q.shape[1], "the scheme passed fewer kv heads"
        return _CpuFlash().forward(q, k, v, causal, scale)

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        assert k.shape[1] == q.shape[1], "the scheme passed fewer kv heads"
        return _CpuFlash().backward(dout, q, k, v, out, lse, causal, scale)


def _inputs(seed: int, dtype: torch.dtype = torch.float64, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """q, k, v, dout as ring attention passes them: [b, s, h, d] storage seen as [b, h, s, d], then a piece
    (one sample, a row range) of it."""
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, 2 * S, H, D, generator=g, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(B, 2 * S, HK, D, generator=g, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    rows = slice(S // 2, S // 2 + S)
    return tuple(t[1:, :, rows].to(device, dtype) for t in (q, k, v, dout))


def _reference(q, k, v, dout, causal):
    """Autograd through SDPA on copies; lse from the scores."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=SCALE, enable_gqa=True)
    out.backward(dout)
    scores = q @ k.repeat_interleave(H // HK, 1).transpose(-2, -1) * SCALE
    if causal:
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return out.detach(), torch.logsumexp(scores, -1), *(t.grad for t in leaves)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("causal", [False, True], ids=["block", "causal"])
def test_every_cpu_kernel_takes_fewer_kv_heads(causal: bool) -> None:
    q, k, v, dout = _inputs(3 + causal)
    ref = _reference(q, k, v, dout, causal)
    for kernel in (MathKernel(), FusedKernel(), _EqualHeadsOnCpu()):
        out, lse = kernel.forward(q, k, v, causal, SCALE)
        got = (out, lse, *kernel.backward(dout, q, k, v, out, lse, causal, SCALE))
        assert [t.shape for t in got] == [t.shape for t in ref], kernel.name
        errs = {n: _rel(a, r) for n, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref)}
        assert max(errs.values()) < 1e-12, (kernel.name, errs)


@pytest.mark.parametrize("name", CUDA_ONLY)
def test_the_cuda_kernels_bind_their_ops(name: str) -> None:
    """On the meta device: each op accepts the arguments as passed (None for the undefined cumulative lengths,
    typed dropout seeds), and GQA comes back with q's heads for dQ and k's for dK/dV."""
    q, k, v, dout = (torch.empty(t.shape, device="meta", dtype=torch.bfloat16) for t in _inputs(0))
    for causal in (False, True):
        kernel = block_kernel(name)
        out, lse = kernel.forward(q, k, v, causal, SCALE)
        assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, SCALE)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_fused_picks_cpu_flash_off_cuda() -> None:
    q, k, _, _ = _inputs(0, torch.float32)
    assert FusedKernel().choose(q, k, True).name == "cpu-flash"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels: needs a GPU (gpu_check part (c) too)")
def test_the_cuda_kernels_match_the_math_kernel() -> None:
    for name, dtype, tolerance in [(n, d, t) for n in ("fused", *CUDA_ONLY)
                                   for d, t in ((torch.bfloat16, 3e-2), (torch.float32, 1e-4))]:
        if name in ("flash", "cudnn") and dtype == torch.float32:
            continue  # fp16/bf16 kernels
        for causal in (False, True):
            q, k, v, dout = _inputs(5 + causal, dtype, "cuda")
            ref = _reference(*(t.cpu().double() for t in (q, k, v, dout)), causal)
            kernel = block_kernel(name)
            out, lse = kernel.forward(q, k, v, causal, SCALE)
            got = (out, lse, *kernel.backward(dout, q, k, v, out, lse, causal, SCALE))
            errs = {n: _rel(a.cpu(), r) for n, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref)}
            assert max(errs.values()) < tolerance, (name, dtype, causal, errs)
