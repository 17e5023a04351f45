"""Where the packed documents of a sample begin, from the end-of-document token `pentatron tokenize` writes
after every document (data/tokenize.py).

The stream is  d₁ EOS d₂ EOS d₃ …  and a sample's inputs are a window of it. A document starts at the
sample's first token and at every input EOS: the EOS that closes document k opens document k+1, as its
beginning-of-sequence token. So every target is predicted from its own document: the last token of d_k
predicts the EOS (inside d_k), and the EOS predicts d_{k+1}'s first token with only itself in view — the
unpacked run of "EOS d_{k+1}" from position 0 makes exactly these predictions. A document cut by the sample's
edge is a document of its own in each sample (its tail in the next sample starts at offset 0).

The boundaries are a function of the sample's tokens alone: deterministic, the same on every rank and after a
resume (the loader's state is only `consumed_samples`), and nothing is stored beside the shards.
"""

from __future__ import annotations

import torch

from pentatron.models.documents import Documents


def find_documents(inputs: torch.Tensor, eos_id: int) -> Documents:
    """inputs: [b, s] token ids (a micro-batch's, on the host) → where each sample's documents start."""
    if inputs.ndim != 2:
        raise ValueError(f"find_documents takes [batch, seq] token ids, got shape {tuple(inputs.shape)}")
    eos = (inputs.detach().cpu() == eos_id)
    eos[:, 0] = True  # the sample's first token always starts a document
    starts = tuple(tuple(int(j) for j in row.nonzero().flatten()) for row in eos)
    return Documents(starts, inputs.shape[1])
