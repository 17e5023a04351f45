"""Attention of one block of queries on one block of keys/values, returning the log-sum-exp: the unit
ring attention computes per ring step and merges. Each kernel has a forward giving (out, lse) and a
backward that, given the *merged* output and log-sum-exp of the whole row, returns this block's share
of dQ, dK, dV — the flash-attention identities:

    P = exp(S − lse),  dV = Pᵀ·dO,  dP = dO·Vᵀ,  D = rowsum(dO ∘ O),  dS = P ∘ (dP − D),
    dQ = dS·K·scale,  dK = dSᵀ·Q·scale

Tensors are [b, heads, s, d]; k and v may have fewer heads than q (GQA: query head j reads kv head
j // (h / h_kv)), and dK, dV come back with k's heads. lse is [b, heads, s] in fp32 (fp64 for fp64). `causal`
means the top-left-aligned mask of two equally long blocks (query i sees keys 0..i), the only masked block
ring attention ever computes.

GQA never copies the travelling K/V per ring step. A kernel that takes fewer kv heads itself (the CPU flash
kernel, CUDA flash) gets them as they are. One that does not (CUDA memory-efficient, cuDNN) gets, for an
unmasked block, the group's queries stacked along the sequence — [b, h, s, d] read as [b, h_kv, g·s, d]: the g
query heads of a kv head are g·s rows against the same keys, and dK/dV come out summed over the group — and
only for the causal block (the rank's own K/V, once per pass) the K/V expanded to h heads.

- `MathKernel` ("math"): explicit matmuls in fp32 (fp64 kept), grouped rows: any device, the reference.
- `FusedKernel` ("fused", what training uses): on CPU the flash kernel; on CUDA flash where torch's own
  SDPA check accepts the inputs (fp16/bf16, sm80+, head dim ≤ 256), else the memory-efficient kernel
  (fp32 too). Both return the log-sum-exp, which the public SDPA does not.
- "flash", "efficient", "cudnn": one CUDA kernel each, for benchmarks and a forced choice (cuDNN is not in
  "fused"'s choice: its backward has not run against the reference on a GPU yet, benchmarks/gpu_check.py
  part (c) does that).
"""

from __future__ import annotations

from typing import Protocol

import torch

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Out = tuple[torch.Tensor, torch.Tensor]


class BlockKernel(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Out: ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float) -> Grads: ...


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def _lse(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp in fp32, or fp64 for fp64 inputs."""
    return lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def _rows(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, h, s, …] → [b, h_kv, g·s, …]: each kv head's g query heads stacked along the sequence (a view
    when t is contiguous)."""
    return t.unflatten(1, (kv_heads, -1)).flatten(2, 3)


def _heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of `_rows`: [b, h_kv, g·s, …] → [b, h, s, …]."""
    return t.unflatten(2, (groups, -1)).flatten(1, 2)


class MathKernel:
    name = "math"

    @staticmethod
    def _probabilities_input(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
        """Scores [b, h_kv, g·s, s_k] of the grouped query rows, the causal mask applied per query position."""
        s = _rows(_upcast(q), k.shape[1]) @ _upcast(k).transpose(-2, -1) * scale
        if causal:
            n = k.shape[2]
            mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1).repeat(q.shape[1] // k.shape[1], 1)
            s = s.masked_fill(mask, float("-inf"))
        return s

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Out:
        g = q.shape[1] // k.shape[1]
        s = self._probabilities_input(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.exp(s - lse.unsqueeze(-1)) @ _upcast(v)
        return _heads(out, g).to(q.dtype), _lse(_heads(lse, g), q)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float) -> Grads:
        g, hk = q.shape[1] // k.shape[1], k.shape[1]
        p = torch.exp(self._probabilities_input(q, k, causal, scale) - _rows(_upcast(lse), hk).unsqueeze(-1))
        do = _rows(_upcast(dout), hk)
        dv = p.transpose(-2, -1) @ do  # summed over the group's rows: dV of each kv head
        dp = do @ _upcast(v).transpose(-2, -1)
        ds = p * (dp - (do * _rows(_upcast(out), hk)).sum(-1, keepdim=True))
        dq = ds @ _upcast(k) * scale
        dk = ds.transpose(-2, -1) @ _rows(_upcast(q), hk) * scale
        return _heads(dq, g), dk, dv


class _CpuFlash:
    """torch's CPU flash kernel: fewer kv heads taken natively (dK/dV summed over the group)."""

    name = "cpu-flash"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Out:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, _lse(lse, q)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float) -> Grads:
        dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _uint64_zeros(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The dropout seed/offset arguments: unread at dropout 0, but typed like the forward's."""
    return torch.zeros(shape, dtype=torch.uint64, device=device)


class _CudaFlash:
    """CUDA flash attention (FlashAttention-2 in torch): fewer kv heads taken natively. The dense form is
    chosen by passing no cumulative sequence lengths (None = an undefined tensor, as its forward returns)."""

    name = "flash"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Out:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float) -> Grads:
        dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal,
            _uint64_zeros((2,), q.device), _uint64_zeros((), q.device), scale=scale)


class _EqualHeads:
    """A kernel that needs as many kv heads as query heads, given fewer: grouped rows for an unmasked block,
    the K/V expanded (and dK/dV summed back) for the causal one."""

    name = "equal-heads"

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Out:
        raise NotImplementedError

    def _backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float) -> Grads:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Out:
        g, hk = q.shape[1] // k.shape[1], k.shape[1]
        if g == 1:
            return self._forward(q, k, v, causal, scale)
        if causal:
            return self._forward(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), True, scale)
        out, lse = self._forward(_rows(q, hk).contiguous(), k, v, False, scale)
        return _heads(out, g), _heads(lse, g)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float) -> Grads:
        g, hk = q.shape[1] // k.shape[1], k.shape[1]
        if g == 1:
            return self._backward(dout, q, k, v, out, lse, causal, scale)
        if causal:
            dq, dk, dv = self._backward(dout, q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), out, lse,
                                        True, scale)
            return dq, *(t.unflatten(1, (hk, g)).sum(2) for t in (dk, dv))
        dq, dk, dv = self._backward(*(_rows(t, hk).contiguous() for t in (dout, q)), k, v,
                                    _rows(out, hk).contiguous(), _rows(lse, hk).contiguous(), False, scale)
        return _heads(dq, g), dk, dv


class _CudaEfficient(_EqualHeads):
    """CUDA memory-efficient attention (fp32 too). Its log-sum-exp is padded to a multiple of 32 queries:
    sliced on the way out, re-padded for the backward. Its 16-bit backward computes rowsum(dO∘O) in the kernel,
    which reads O as [b, s, h, d] in memory whatever its strides say (what its forward returns): O and dO are
    handed over in that layout (in [b, h, s, d] order, O was read wrong and dQ/dK came out wrong, on an H200)."""

    name = "efficient"

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Out:
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                               scale=scale)
        return out, _lse(lse[..., : q.shape[-2]], q)

    def _backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float) -> Grads:
        dout, out = (t.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2) for t in (dout, out))
        s = q.shape[-2]
        padded = lse.new_zeros((*lse.shape[:-1], -(-s // 32) * 32), dtype=torch.float32)
        padded[..., :s] = lse
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, padded, zero, zero, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv


class _CudaCudnn(_EqualHeads):
    """cuDNN attention: its log-sum-exp is [b, h, s, 1]; inputs made contiguous, so that the backward sees
    dO and O in one layout."""

    name = "cudnn"

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Out:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, False, scale=scale)
        return out, lse.reshape(lse.shape[:3]).float()

    def _backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float) -> Grads:
        q, k, v = (t.contiguous() for t in (q, k, v))
        dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.float().unsqueeze(-1).contiguous(), zero, zero, None, None, None,
            q.shape[2], k.shape[2], 0.0, causal, scale=scale)


def flash_applies(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """Whether CUDA flash attention takes these inputs: torch's own SDPA check (dtype, GPU generation, head
    dim, strides, runtime switches), with k standing in for v (same shape)."""
    params = torch.backends.cuda.SDPAParams(q, k, k, None, 0.0, causal, k.shape[1] != q.shape[1])
    return bool(torch.backends.cuda.can_use_flash_attention(params, False))


class FusedKernel:
    """The fastest kernel with a log-sum-exp for the inputs' device and dtype (module docstring)."""

    name = "fused"

    def __init__(self) -> None:
        self.cpu, self.flash, self.efficient = _CpuFlash(), _CudaFlash(), _CudaEfficient()

    def choose(self, q: torch.Tensor, k: torch.Tensor, causal: bool) -> BlockKernel:
        if q.device.type != "cuda":
            return self.cpu
        return self.flash if flash_applies(q, k, causal) else self.efficient

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Out:
        return self.choose(q, k, causal).forward(q, k, v, causal, scale)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float) -> Grads:
        return self.choose(q, k, causal).backward(dout, q, k, v, out, lse, causal, scale)


KERNELS: dict[str, type[BlockKernel]] = {"math": MathKernel, "fused": FusedKernel, "flash": _CudaFlash,
                                         "efficient": _CudaEfficient, "cudnn": _CudaCudnn}
CUDA_ONLY = ("flash", "efficient", "cudnn")


def block_kernel(name: str) -> BlockKernel:
    if name not in KERNELS:
        raise ValueError(f"attention kernel must be one of {', '.join(KERNELS)}, got {name!r}")
    return KERNELS[name]()
