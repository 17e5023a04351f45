"""A tokenized dataset of short packed documents, for the document-masking tests: random token ids with the
end-of-document token (id 0) after every document, lengths cycling through `LENGTHS` — documents of 1–3
tokens (shorter than a cp4 ring chunk at seq 32), ones that cross sample boundaries, and ones of 70 tokens,
which hold whole samples (one document in the sample)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pentatron.data.index import INDEX_VERSION, DatasetIndex, ShardInfo, token_dtype

EOS = 0
VOCAB = 4096  # the debug model's
LENGTHS = (3, 1, 9, 40, 5, 17, 70, 2, 12, 33, 6, 70, 4, 25)


def write_documents_dataset(directory: Path, total_tokens: int = 32 * 40 + 1, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    stream: list[int] = []
    k = 0
    while len(stream) < total_tokens:
        stream += [*rng.integers(1, VOCAB, size=LENGTHS[k % len(LENGTHS)]).tolist(), EOS]
        k += 1
    tokens = np.asarray(stream[:total_tokens], dtype=token_dtype(VOCAB))
    directory.mkdir(parents=True)
    tokens.tofile(directory / "shard_00000.bin")
    index = DatasetIndex(version=INDEX_VERSION, dtype=tokens.dtype.name, vocab_size=VOCAB, eos_id=EOS,
                         eos_token="<|endoftext|>", shards=(ShardInfo("shard_00000.bin", len(tokens)),),
                         total_tokens=len(tokens), num_documents=k, max_token_id=int(tokens.max()),
                         fingerprint=f"documents{seed:07d}")
    (directory / "index.json").write_text(json.dumps(index.to_json()))
    return directory
