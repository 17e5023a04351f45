"""The flat layout of parameters/gradients, and contiguous fp32 gradient storage over it.

`FlatLayout` places every parameter at a global offset in one flat index space, cut into buckets.
Each bucket is padded to a multiple of the number of shards, so that it splits into equal shards:
rank r owns `[start + r·padded/n, start + (r+1)·padded/n)` of every bucket. The same layout serves
data parallelism (a bucket is one all-reduce), ZeRO-1/2 (one reduce-scatter per bucket) and ZeRO-3
(a bucket is one layer: one all-gather, one reduce-scatter), and shards are described by global
offsets, which is what a re-sharding checkpoint needs.

`GradBuffer` gives every parameter `param.main_grad`, a view into its bucket; a post-accumulate-grad
hook adds the freshly computed `param.grad` (compute dtype) into it and frees `param.grad`. Gradients
of all micro-batches therefore accumulate in fp32 whatever the compute dtype. Bucket storage is either
persistent (one flat tensor) or transient (allocated when a bucket's first gradient arrives and
released after it has been reduce-scattered, for ZeRO-2/3).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(eq=False)
class Bucket:
    index: int
    params: list[nn.Parameter]
    start: int  # global offset of the bucket
    numel: int  # elements used by parameters
    padded: int  # numel rounded up to a multiple of the shard count
    offsets: dict[nn.Parameter, int] = field(default_factory=dict)  # global offset of each parameter

    @property
    def end(self) -> int:
        return self.start + self.padded


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside one rank's shard: flattened-parameter range [lo, hi), stored at
    `local` in that rank's contiguous shard (and at global offset `glob` in the flat space)."""

    param: nn.Parameter
    lo: int
    hi: int
    glob: int
    local: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


class FlatLayout:
    def __init__(self, groups: Sequence[Sequence[nn.Parameter]], shards: int = 1) -> None:
        """`groups`: the parameters of each bucket, in flat order; `shards`: the padding multiple."""
        self.shards = shards
        self.buckets: list[Bucket] = []
        self.shapes: dict[nn.Parameter, torch.Size] = {}
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        start = 0
        for i, group in enumerate(g for g in groups if g):
            b = Bucket(i, list(group), start, 0, 0)
            for p in group:
                if p in self.shapes:
                    raise ValueError("a parameter appears twice in the flat layout (tied weights must be "
                                     "listed once)")
                self.shapes[p] = p.shape
                b.offsets[p] = start + b.numel
                b.numel += p.numel()
                self.bucket_of[p] = b
            b.padded = -(-b.numel // shards) * shards
            start += b.padded
            self.buckets.append(b)
        self.total = start
        self.params = [p for b in self.buckets for p in b.params]

    @classmethod
    def by_size(cls, params: Sequence[nn.Parameter], bucket_numel: int, shards: int = 1,
                isolate: Collection[nn.Parameter] = ()) -> FlatLayout:
        """Consecutive parameters fill a bucket until it holds at least `bucket_numel` elements; each
        parameter in `isolate` gets a bucket of its own."""
        groups: list[list[nn.Parameter]] = [[]]
        filled = 0
        for p in params:
            if p in isolate:
                groups += [[p], []]
                filled = 0
                continue
            if filled >= bucket_numel:
                groups.append([])
                filled = 0
            groups[-1].append(p)
            filled += p.numel()
        return cls(groups, shards)

    def offset(self, p: nn.Parameter) -> int:
        return self.bucket_of[p].offsets[p]

    def shard_range(self, b: Bucket, rank: int) -> tuple[int, int]:
        """Global [lo, hi) of `rank`'s shard of bucket `b`."""
        size = b.padded // self.shards
        return b.start + rank * size, b.start + (rank + 1) * size

    def local_range(self, b: Bucket) -> tuple[int, int]:
        """Where bucket `b`'s shard sits in a rank's contiguous shard storage (the same on every rank)."""
        return b.start // self.shards, b.end // self.shards

    @property
    def shard_numel(self) -> int:
        return self.total // self.shards

    def pieces(self, rank: int) -> list[Piece]:
        """The parameter pieces `rank` owns, in flat order."""
        out = []
        for b in self.buckets:
            lo, hi = self.shard_range(b, rank)
            local0 = self.local_range(b)[0]
            for p in b.params:
                p_lo, p_hi = b.offsets[p], b.offsets[p] + self.shapes[p].numel()
                a, z = max(lo, p_lo), min(hi, p_hi)
                if a < z:
                    out.append(Piece(p, a - p_lo, z - p_lo, a, local0 + a - lo))
        return out


class GradBuffer:
    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype = torch.float32,
                 on_grad_ready: Callable[[nn.Parameter], None] | None = None,
                 layout: FlatLayout | None = None, persistent: bool = True) -> None:
        self.layout = layout or FlatLayout([params])
        self.params = self.layout.params
        self.numel = self.layout.total
        self.dtype = dtype
        self.device = params[0].device if params else torch.device("cpu")
        self.persistent = persistent
        self.data: torch.Tensor | None = None
        self._transient: dict[int, torch.Tensor] = {}
        self._on_grad_ready = on_grad_ready
        self._handles = []
        if persistent:
            self.data = torch.zeros(self.numel, dtype=dtype, device=self.device)
            for b in self.layout.buckets:
                self._bind(b, self.data[b.start: b.end])
        else:
            for p in self.params:
                p.main_grad = None
        for p in self.params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._accumulate))

    @property
    def offsets(self) -> dict[nn.Parameter, int]:
        return {p: self.layout.offset(p) for p in self.params}

    def _bind(self, b: Bucket, storage: torch.Tensor) -> None:
        for p in b.params:
            off = b.offsets[p] - b.start
            p.main_grad = storage[off: off + p.numel()].view(self.layout.shapes[p])

    def bucket_data(self, b: Bucket) -> torch.Tensor:
        """The flat gradient storage of bucket `b` (allocated, zeroed, if transient and not yet there)."""
        if self.data is not None:
            return self.data[b.start: b.end]
        if b.index not in self._transient:
            storage = torch.zeros(b.padded, dtype=self.dtype, device=self.device)
            self._transient[b.index] = storage
            self._bind(b, storage)
        return self._transient[b.index]

    def release(self, b: Bucket) -> None:
        """Drop a transient bucket's storage (its gradients have been reduce-scattered away)."""
        if self.data is None and self._transient.pop(b.index, None) is not None:
            for p in b.params:
                p.main_grad = None

    @property
    def transient_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._transient.values())

    def _accumulate(self, p: nn.Parameter) -> None:
        if p.main_grad is None:
            self.bucket_data(self.layout.bucket_of[p])
        p.main_grad.add_(p.grad)
        p.grad = None
        if self._on_grad_ready is not None:
            self._on_grad_ready(p)

    def zero(self) -> None:
        if self.data is not None:
            self.data.zero_()
        for t in self._transient.values():
            t.zero_()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
