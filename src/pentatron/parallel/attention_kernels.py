"""Attention of one block of queries on one block of keys/values, returning the log-sum-exp: the unit
ring attention computes per ring step and merges. Each kernel has a forward giving (out, lse) and a
backward that, given the *merged* output and log-sum-exp of the whole row, returns this block's share
of dQ, dK, dV — the flash-attention identities:

    P = exp(S − lse),  dV = Pᵀ·dO,  dP = dO·Vᵀ,  D = rowsum(dO ∘ O),  dS = P ∘ (dP − D),
    dQ = dS·K·scale,  dK = dSᵀ·Q·scale

Tensors are [b, heads, s, d] with as many kv heads as query heads (the caller expands GQA), lse is
[b, heads, s] in fp32. `causal` means the top-left-aligned mask of two equally long blocks (query i
sees keys 0..i), the only masked block ring attention ever computes.

- `MathKernel`: explicit matmuls in fp32 (fp64 kept): any device, the reference.
- `FusedKernel`: the fused kernels behind SDPA that expose their log-sum-exp — the flash kernel for
  CPU, and the memory-efficient kernel on CUDA (it works in fp32 too).
"""

from __future__ import annotations

from typing import Protocol

import torch

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class BlockKernel(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float) -> Grads: ...


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def _lse(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp in fp32, or fp64 for fp64 inputs."""
    return lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


class MathKernel:
    name = "math"

    @staticmethod
    def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
        s = _upcast(q) @ _upcast(k).transpose(-2, -1) * scale
        if causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return s

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        s = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.exp(s - lse.unsqueeze(-1)) @ _upcast(v)
        return out.to(q.dtype), _lse(lse, q)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float) -> Grads:
        p = torch.exp(self._scores(q, k, causal, scale) - _upcast(lse).unsqueeze(-1))
        do = _upcast(dout)
        dv = p.transpose(-2, -1) @ do
        dp = do @ _upcast(v).transpose(-2, -1)
        ds = p * (dp - (do * _upcast(out)).sum(-1, keepdim=True))
        dq = ds @ _upcast(k) * scale
        dk = ds.transpose(-2, -1) @ _upcast(q) * scale
        return dq, dk, dv


class FusedKernel:
    """SDPA's fused kernels, called through their ATen entry points (the public SDPA does not return
    the log-sum-exp). The CUDA path uses the memory-efficient kernel, whose log-sum-exp is padded to a
    multiple of 32 queries: it is sliced on the way out and re-padded for the backward."""

    name = "fused"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if q.device.type == "cuda":
            out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, causal, scale=scale)
            return out, _lse(lse[..., : q.shape[-2]], q)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, _lse(lse, q)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float) -> Grads:
        dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        if q.device.type == "cuda":
            s = q.shape[-2]
            padded = lse.new_zeros((*lse.shape[:-1], -(-s // 32) * 32))
            padded[..., :s] = lse
            zero = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dout, q, k, v, None, out, padded, zero, zero, 0.0, [True, True, True, False], causal, scale=scale)
            return dq, dk, dv
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)


KERNELS: dict[str, type[MathKernel] | type[FusedKernel]] = {"math": MathKernel, "fused": FusedKernel}


def block_kernel(name: str) -> BlockKernel:
    if name not in KERNELS:
        raise ValueError(f"attention kernel must be one of {', '.join(KERNELS)}, got {name!r}")
    return KERNELS[name]()
