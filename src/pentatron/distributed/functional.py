"""Autograd-aware collectives: the conjugate operator pairs of Megatron-style tensor/sequence parallelism.

Each operator is a `torch.autograd.Function` whose forward and backward both go through `Comm`, so
the comm ledger counts the backward traffic too. With N ranks along `dim` (normally "tp"):

    copy_to_parallel       f   forward: identity              backward: all-reduce (sum)
    reduce_from_parallel   g   forward: all-reduce (sum)      backward: identity
    gather_sequence        ḡ   forward: all-gather along seq   backward: reduce-scatter along seq
    scatter_sequence       ḡ*  forward: reduce-scatter on seq  backward: all-gather along seq
    all_to_all                 forward: rows to their ranks    backward: the reverse all-to-all

    seq_to_heads           forward: all-to-all [b, s/N, H] → [b, s, H/N]   backward: heads_to_seq
    heads_to_seq           forward: all-to-all [b, s, H/N] → [b, s/N, H]   backward: seq_to_heads

f/g bracket a tensor-parallel region (column-parallel in, row-parallel out); the sequence pair does
the same with the activations outside the region sharded along the sequence (Korthikanti et al.,
2022): an all-reduce is a reduce-scatter followed by an all-gather, so the bytes on the wire are the
same. The all-to-all pair is Ulysses' (Jacobs et al., 2023): sequence-sharded activations become
head-sharded for attention and back. Tensors are batch-first ([b, s, …]); `seq_dim` names the
sequence axis. A group of size 1
degenerates to the identity (Comm records nothing).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function

from pentatron.distributed.comm import Comm


def _all_reduce(x: torch.Tensor, comm: Comm, dim: str) -> torch.Tensor:
    out = x.contiguous().clone()  # gradients may be shared between branches: never reduce them in place
    comm.all_reduce(out, dim)
    return out


def _all_gather(x: torch.Tensor, comm: Comm, dim: str, seq_dim: int) -> torch.Tensor:
    # all_gather_into_tensor concatenates along the flat leading axis, so move the sequence axis first.
    n = comm.ctx.size(dim)
    if n == 1:
        return x
    local = x.movedim(seq_dim, 0).contiguous()
    out = torch.empty((n * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, local, dim)
    return out.movedim(0, seq_dim).contiguous()


def _reduce_scatter(x: torch.Tensor, comm: Comm, dim: str, seq_dim: int) -> torch.Tensor:
    n = comm.ctx.size(dim)
    if n == 1:
        return x
    full = x.movedim(seq_dim, 0).contiguous()
    if full.shape[0] % n:
        raise ValueError(f"sequence length {full.shape[0]} is not divisible by the {dim} size {n}")
    out = torch.empty((full.shape[0] // n, *full.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, full, dim)
    return out.movedim(0, seq_dim).contiguous()


class _CopyToParallel(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, dim: str) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad, ctx.comm, ctx.dim), None, None


class _ReduceFromParallel(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, dim: str) -> torch.Tensor:
        return _all_reduce(x, comm, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _GatherSequence(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, dim: str, seq_dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.seq_dim = comm, dim, seq_dim
        return _all_gather(x, comm, dim, seq_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _reduce_scatter(grad, ctx.comm, ctx.dim, ctx.seq_dim), None, None, None


class _ScatterSequence(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, dim: str, seq_dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.seq_dim = comm, dim, seq_dim
        return _reduce_scatter(x, comm, dim, seq_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_gather(grad, ctx.comm, ctx.dim, seq_dim=ctx.seq_dim), None, None, None


class _AllToAll(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], comm: Comm,
                dim: str) -> torch.Tensor:
        ctx.splits, ctx.comm, ctx.dim = (out_splits, in_splits), comm, dim
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), dim, out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        ctx.comm.all_to_all(back, grad.contiguous(), ctx.dim, in_splits, out_splits)
        return back, None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], comm: Comm, dim: str) -> torch.Tensor:
    """Rows of `x` (`in_splits[r]` for group rank r, in rank order) to their ranks; returns the rows
    received (`out_splits[r]` from rank r). Its backward sends the gradients back the same way."""
    return _AllToAll.apply(x, out_splits, in_splits, comm, dim)


def copy_to_parallel(x: torch.Tensor, comm: Comm, dim: str = "tp") -> torch.Tensor:
    """f: enter a tensor-parallel region with a replicated input (grads summed over `dim`)."""
    return _CopyToParallel.apply(x, comm, dim)


def reduce_from_parallel(x: torch.Tensor, comm: Comm, dim: str = "tp") -> torch.Tensor:
    """g: leave a tensor-parallel region by summing partial outputs over `dim`."""
    return _ReduceFromParallel.apply(x, comm, dim)


def gather_sequence(x: torch.Tensor, comm: Comm, dim: str = "tp", seq_dim: int = 1) -> torch.Tensor:
    """Enter a tensor-parallel region from a sequence-sharded input: all-gather along `seq_dim`."""
    return _GatherSequence.apply(x, comm, dim, seq_dim)


def scatter_sequence(x: torch.Tensor, comm: Comm, dim: str = "tp", seq_dim: int = 1) -> torch.Tensor:
    """Leave a tensor-parallel region into a sequence-sharded output: reduce-scatter along `seq_dim`."""
    return _ScatterSequence.apply(x, comm, dim, seq_dim)


def _exchange_chunks(x: torch.Tensor, comm: Comm, dim: str, split: int, concat: int) -> torch.Tensor:
    """Split `x` into N chunks along axis `split`, send chunk r to group rank r, and concatenate what
    arrives along axis `concat` in rank order: `all_to_all` with one equal row per rank, between two
    rearrangements that autograd reverses."""
    n = comm.ctx.size(dim)
    if n == 1:
        return x
    if x.shape[split] % n:
        raise ValueError(f"all-to-all over {dim} (size {n}): axis {split} has {x.shape[split]} entries, "
                         f"not divisible by {n}")
    chunks = x.unflatten(split, (n, x.shape[split] // n)).movedim(split, 0)
    out = all_to_all(chunks.reshape(n, -1), [1] * n, [1] * n, comm, dim).view(chunks.shape)
    return out.movedim(0, concat).flatten(concat, concat + 1)


def seq_to_heads(x: torch.Tensor, comm: Comm, dim: str) -> torch.Tensor:
    """[b, s/N, H, d] sequence-sharded → [b, s, H/N, d] head-sharded (rank r keeps heads chunk r; the
    sequence is the group's chunks in rank order)."""
    return _exchange_chunks(x, comm, dim, split=2, concat=1)


def heads_to_seq(x: torch.Tensor, comm: Comm, dim: str) -> torch.Tensor:
    """The inverse of `seq_to_heads`: [b, s, H/N, d] → [b, s/N, H, d]."""
    return _exchange_chunks(x, comm, dim, split=1, concat=2)
