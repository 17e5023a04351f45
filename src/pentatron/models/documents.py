"""Packed documents inside the samples of a micro-batch, and attention that stays inside each of them.

A training sample is a window of the packed token stream, so it may hold the tail of one document, whole
short ones and the head of the next. `Documents` says where each starts (host-side offsets, computed once per
micro-batch from the tokens, `data/documents.py`); with document masking every layer's attention is causal
*within* a document and sees nothing across, and RoPE positions may restart at 0 at each start.

`document_attention` is the one-process kernel: per sample, one causal SDPA call per document (a varlen
loop over segments). It never builds a seq×seq mask, it computes only the pairs a document holds (Σ nᵢ²/2
instead of s²/2), it is exact in float64 (each segment is the very SDPA call an unpacked run of that document
makes), and a micro-batch whose samples are each one document is the unmasked causal call itself. On CUDA
in bf16/fp16, where torch has it, the whole micro-batch is one `torch.nn.attention.varlen.varlen_attn` call
instead (flash attention over the documents as variable-length sequences: one launch, no per-segment loop);
its numerics are flash attention's, checked against the loop by `benchmarks/gpu_check.py` (part documents).
Context parallelism cuts the same segments at its block boundaries (`parallel/ring_attention.py`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cache, cached_property

import numpy as np
import torch
import torch.nn.functional as F

from pentatron.host_copy import to_device


@dataclass(frozen=True)
class Documents:
    """`starts[i]`: the offsets (0 first, increasing, < seq_len) where sample i's documents begin."""

    starts: tuple[tuple[int, ...], ...]
    seq_len: int

    def __post_init__(self) -> None:
        for row in self.starts:
            if not row or row[0] != 0 or any(b <= a for a, b in zip(row, row[1:], strict=False)) \
                    or row[-1] >= self.seq_len:
                raise ValueError(f"document starts must begin at 0 and increase below {self.seq_len}: {row}")

    @property
    def single(self) -> bool:
        """Every sample is one document: attention is the plain causal one."""
        return all(len(row) == 1 for row in self.starts)

    def spans(self, i: int) -> list[tuple[int, int]]:
        """Sample i's documents as [start, end) offsets."""
        row = self.starts[i]
        return list(zip(row, (*row[1:], self.seq_len), strict=True))

    @cached_property
    def ids(self) -> np.ndarray:
        """[b, seq_len] int64: each token's document number within its sample (non-decreasing)."""
        out = np.zeros((len(self.starts), self.seq_len), dtype=np.int64)
        for i, row in enumerate(self.starts):
            out[i, list(row[1:])] = 1
        return out.cumsum(1)

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """[n_documents + 1] int32 on the host: where each document starts in the micro-batch's tokens laid
        end to end (sample i at i·seq_len), then the total — varlen attention's cumulative lengths."""
        starts = [i * self.seq_len + s for i, row in enumerate(self.starts) for s in row]
        return torch.tensor([*starts, len(self.starts) * self.seq_len], dtype=torch.int32)

    @cached_property
    def longest(self) -> int:
        return max(e - s for i in range(len(self.starts)) for s, e in self.spans(i))

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[b, seq_len] int64: each token's position inside its document (RoPE restarting at each start)."""
        index = np.arange(self.seq_len)
        first = np.stack([_first_of(r, self.seq_len) for r in self.starts])
        return torch.from_numpy(index - first).to(device)

    def pairs(self) -> int:
        """Query·key pairs causal attention within the documents holds, per head (Σ n(n+1)/2)."""
        return sum((e - s) * (e - s + 1) // 2 for i in range(len(self.starts)) for s, e in self.spans(i))


def documents_record(micro_batches: list[Documents]) -> dict[str, float]:
    """A step's documents (this rank's micro-batches), for metrics: their mean length in tokens (a document cut
    by a sample's edge counts once per sample), the mean of their squared lengths, and the query·key pairs
    masked attention computes as a share of the dense causal pairs the MFU convention counts."""
    lengths = [e - s for d in micro_batches for i in range(len(d.starts)) for s, e in d.spans(i)]
    dense = sum(len(d.starts) * d.seq_len * (d.seq_len + 1) // 2 for d in micro_batches)
    return {"mean_tokens": sum(lengths) / len(lengths), "mean_sq_tokens": sum(n * n for n in lengths) / len(lengths),
            "attention_pairs": sum(d.pairs() for d in micro_batches) / dense}


def _first_of(row: tuple[int, ...], seq_len: int) -> np.ndarray:
    """[seq_len]: the start offset of the document each token belongs to."""
    out = np.zeros(seq_len, dtype=np.int64)
    for s in row:
        out[s:] = s
    return out


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None
                       ) -> torch.Tensor:
    """Causal attention within each document. q: [b, h, s, d], k/v: [b, h_kv, s, d] → [b, h, s, d]."""
    gqa = k.shape[1] != q.shape[1]
    if documents is None or documents.single:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if q.shape[0] != len(documents.starts) or q.shape[2] != documents.seq_len:
        raise ValueError(f"documents describe {len(documents.starts)}×{documents.seq_len} tokens, attention "
                         f"got {q.shape[0]}×{q.shape[2]}")
    if _varlen_applies(q):
        return _varlen_documents(q, k, v, documents, gqa)
    return segment_loop_attention(q, k, v, documents)


def segment_loop_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents
                           ) -> torch.Tensor:
    """One causal SDPA call per document of each sample (any device and dtype)."""
    gqa = k.shape[1] != q.shape[1]
    rows = []
    for i in range(q.shape[0]):
        rows.append(torch.cat([F.scaled_dot_product_attention(q[i:i + 1, :, s:e], k[i:i + 1, :, s:e],
                                                              v[i:i + 1, :, s:e], is_causal=True, enable_gqa=gqa)
                               for s, e in documents.spans(i)], dim=2))
    return torch.cat(rows)


@cache
def _varlen_causal_kwargs() -> dict[str, object] | None:
    """How this torch's `varlen_attn` is asked for causal attention (`is_causal` in its first release, a
    (-1, 0) window later), or None where it has neither (then the per-segment loop runs)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        return {"is_causal": True}
    if "window_size" in params:
        return {"window_size": (-1, 0)}
    return None


@cache
def _varlen_takes_gqa() -> bool:
    """Whether this torch's `varlen_attn` takes fewer kv heads (`enable_gqa`; torch 2.11's does not)."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _varlen_applies(q: torch.Tensor) -> bool:
    """Flash varlen runs on CUDA in half precision only."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _varlen_causal_kwargs() is not None


def _varlen_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents, gqa: bool
                      ) -> torch.Tensor:
    """Every document of the micro-batch as one variable-length sequence of one varlen flash call."""
    from torch.nn.attention.varlen import varlen_attn

    b, h, s, d = q.shape
    cu = to_device(documents.cu_seqlens, q.device)
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]  # [tokens, heads, d]
    kwargs = dict(_varlen_causal_kwargs() or {})
    if gqa and _varlen_takes_gqa():
        kwargs["enable_gqa"] = True
    elif gqa:  # each kv head repeated for its query heads; autograd sums their gradients back
        flat[1:] = [t.repeat_interleave(h // t.shape[1], dim=1) for t in flat[1:]]
    out = varlen_attn(*flat, cu, cu, documents.longest, documents.longest, **kwargs)
    return out.reshape(b, s, h, d).transpose(1, 2)
