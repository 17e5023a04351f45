"""Validation data: a held-out tail of the training token stream, or another tokenized directory.

The held-out split is the last `held` tokens of data.path's stream (`eval.holdout` × its length, rounded,
or `eval.holdout_tokens`), cut at token `split = len - held`. Training keeps samples whose window
[i·L, i·L + L + 1) ends at or before `split` (`training_tokens` → the loader's `train_tokens`), so no
held-out token is ever an input or a target of a training step. Without a holdout `split = len`: the
loader's samples are exactly those of a run without [eval].

Validation samples pack the held-out tokens from `split` on, in order, without shuffling: sample j is
[split + j·L, split + j·L + L + 1). An evaluation reads the first `batches` × global_batch of them, each
global batch cut over data-parallel ranks and micro-batches as a training step is — the same sequences at
every evaluation, in every layout, after any resume (nothing about them is state).

A mixture (data.sources) is held out per source: each source's stream keeps its own tail (`holdout` of its
length, or `holdout_tokens` of it) and is validated on it apart — a loss per source, and their weighted mean
as the run's validation loss (the mixture's expected loss). eval.path is one set for the whole mixture.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from pentatron.data.errors import DataError
from pentatron.data.loader import TokenDataset
from pentatron.data.vocab_check import check_sample

if TYPE_CHECKING:
    from pentatron.config import EvalConfig

Batch = tuple[torch.Tensor, torch.Tensor]


def held_out_tokens(ev: EvalConfig, total: int) -> int:
    """Tokens held out at the end of a `total`-token training stream (0: none; eval.path needs none)."""
    if ev.path:
        return 0
    if ev.holdout_tokens:
        return ev.holdout_tokens
    return round(ev.holdout * total)


def training_tokens(ev: EvalConfig, total: int) -> int:
    """The prefix of the training stream that training may read: all of it without a holdout."""
    return total - held_out_tokens(ev, total)


class EvalSet:
    """The validation samples: tokens [start, len) of `dataset`, packed in order (see the module doc)."""

    def __init__(self, dataset: TokenDataset, start: int, seq_len: int) -> None:
        self.dataset, self.start, self.seq_len = dataset, start, seq_len
        self.num_samples = max(0, (len(dataset) - start - 1) // seq_len)

    @property
    def tokens(self) -> int:
        return len(self.dataset) - self.start

    def sample(self, j: int) -> np.ndarray:
        """The L+1 tokens of validation sample j (inputs = [:-1], targets = [1:])."""
        first = self.start + j * self.seq_len
        tokens = self.dataset.read(first, first + self.seq_len + 1)
        ds = self.dataset
        if ds.vocab_limit is not None:
            check_sample(tokens, first, ds.path, ds.index, ds._starts, ds.vocab_limit)
        return tokens

    def steps(self, batches: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int
              ) -> Iterator[list[Batch]]:
        """Per global batch, this data-parallel rank's micro-batches, as `TokenLoader.next_step` cuts a step."""
        local = global_batch // dp_size
        for b in range(batches):
            first = b * global_batch + dp_rank * local
            tokens = torch.from_numpy(np.stack([self.sample(first + k) for k in range(local)]).astype(np.int64))
            yield [(tokens[j:j + micro_batch, :-1].contiguous(), tokens[j:j + micro_batch, 1:].contiguous())
                   for j in range(0, local, micro_batch)]


def eval_set(ev: EvalConfig, train: TokenDataset, seq_len: int, vocab_size: int) -> EvalSet:
    """The run's validation samples (eval.path's dataset, or the training stream's held-out tail)."""
    if ev.path:
        other = TokenDataset(ev.path)
        other.check_vocab(vocab_size)
        return EvalSet(other, 0, seq_len)
    return EvalSet(train, training_tokens(ev, len(train)), seq_len)


def eval_sets(ev: EvalConfig, train: list[TokenDataset], names: list[str], weights: list[float], seq_len: int,
              vocab_size: int) -> list[tuple[str, float, EvalSet]]:
    """(name, weight, samples) per validation set: each source's held-out tail, or eval.path's one set."""
    if ev.path or len(train) == 1:
        return [(names[0] if not ev.path else "eval.path", 1.0, eval_set(ev, train[0], seq_len, vocab_size))]
    return [(n, w, eval_set(ev, ds, seq_len, vocab_size)) for ds, n, w in zip(train, names, weights, strict=True)]


def mixture_eval_problems(ev: EvalConfig, train: list[TokenDataset], names: list[str], seq_len: int,
                          global_batch: int, vocab_size: int) -> list[str]:
    """`eval_data_problems` for each source of a mixture, each named (said once when they are eval.path's)."""
    out: list[str] = []
    for ds, name in zip(train, names, strict=True):
        for p in eval_data_problems(ev, ds, seq_len, global_batch, vocab_size):
            said = p if p.startswith("eval.path") or len(train) == 1 else f"data source {name!r}: {p}"
            if said not in out:
                out.append(said)
    return out


def eval_data_problems(ev: EvalConfig, train: TokenDataset, seq_len: int, global_batch: int, vocab_size: int
                       ) -> list[str]:
    """Sizes that cannot work, said before any rank starts: a holdout that leaves no training sample, or
    held-out data shorter than eval.batches global batches."""
    if ev.every == 0 and held_out_tokens(ev, len(train)) == 0:
        return []
    p = []
    kept = training_tokens(ev, len(train))
    if kept - 1 < seq_len:
        p.append(f"eval.holdout leaves {kept:,} of {len(train):,} training tokens, fewer than one sample of "
                 f"train.seq_len+1 = {seq_len + 1}; hold out less")
    if ev.every == 0:
        return p
    try:
        held = eval_set(ev, train, seq_len, vocab_size)
    except DataError as e:
        return [*p, f"eval.path: {e}"]
    need = ev.batches * global_batch
    if held.num_samples < need:
        what = f"eval.path {ev.path!r}" if ev.path else "the held-out split"
        p.append(f"{what} holds {held.tokens:,} tokens = {held.num_samples} validation sequences of "
                 f"train.seq_len={seq_len}, fewer than eval.batches × train.global_batch = {ev.batches} × "
                 f"{global_batch} = {need}; lower eval.batches or hold out at least "
                 f"{need * seq_len + 1:,} tokens")
    return p
