"""Packed documents inside the samples of a micro-batch, and attention that stays inside each of them.

A training sample is a window of the packed token stream, so it may hold the tail of one document, whole
short ones and the head of the next. `Documents` says where each starts (host-side offsets, computed once per
micro-batch from the tokens, `data/documents.py`); with document masking every layer's attention is causal
*within* a document and sees nothing across, and RoPE positions may restart at 0 at each start.

`document_attention` is the one-process kernel: per sample, one causal SDPA call per document (a varlen
loop over segments). It never builds a seq×seq mask, it computes only the pairs a document holds (Σ nᵢ²/2
instead of s²/2), it is exact in float64 (each segment is the very SDPA call an unpacked run of that document
makes), and a micro-batch whose samples are each one document is the unmasked causal call itself. The same
code runs on every device; on CUDA a varlen/flex kernel would avoid the per-segment launches (not built).
Context parallelism cuts the same segments at its block boundaries (`parallel/ring_attention.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F


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
    rows = []
    for i in range(q.shape[0]):
        rows.append(torch.cat([F.scaled_dot_product_attention(q[i:i + 1, :, s:e], k[i:i + 1, :, s:e],
                                                              v[i:i + 1, :, s:e], is_causal=True, enable_gqa=gqa)
                               for s, e in documents.spans(i)], dim=2))
    return torch.cat(rows)
