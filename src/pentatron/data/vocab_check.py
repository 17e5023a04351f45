"""Token ids against the model's vocabulary, checked on the data itself (index.json's `max_token_id`
can disagree with edited or mixed-up shards).

Two checks, so that no layout ever sees an id ≥ vocab_size (the vocabulary-parallel embedding would
silently embed it as zeros, the plain embedding raise a bare IndexError):
- `scan_problem`: preflight (the launcher or rank 0) scans every shard in chunks, before step 1;
- `check_sample`: the loader checks each sample it reads (a max over seq_len + 1 ids), so a shard that
  changes after the scan is caught too.
Both name the shard file and the offset within it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pentatron.data.errors import DataError
from pentatron.data.index import DatasetIndex

_CHUNK = 1 << 24  # tokens per scanned chunk


def _message(directory: Path, file: str, offset: int, token: int, vocab: int) -> str:
    return (f"dataset shard {Path(directory) / file} holds token id {token} at offset {offset} (token index "
            f"within the shard), but model.vocab_size={vocab}; re-tokenize with a vocabulary of at most {vocab} "
            f"or set model.vocab_size to at least {token + 1}")


def scan_problem(directory: Path, index: DatasetIndex, vocab: int) -> str | None:
    """The first id ≥ `vocab` in any shard, named; None when every id fits."""
    for s in index.shards:
        if not s.tokens:
            continue
        # Read in chunks, not memory-mapped: a shard truncated during the scan is then a short read, not a SIGBUS.
        dtype = np.dtype(index.dtype)
        with open(Path(directory) / s.file, "rb") as f:
            for start in range(0, s.tokens, _CHUNK):
                chunk = np.frombuffer(f.read(min(_CHUNK, s.tokens - start) * dtype.itemsize), dtype=dtype)
                if not chunk.size:
                    break  # shorter than the index says: the loader names it at its read
                if int(chunk.max()) >= vocab:
                    at = int(np.argmax(chunk >= vocab))
                    return _message(directory, s.file, start + at, int(chunk[at]), vocab)
    return None


def check_sample(tokens: np.ndarray, stream_start: int, directory: Path, index: DatasetIndex,
                 starts: np.ndarray, vocab: int) -> None:
    """Raise `DataError` if a sample read from stream position `stream_start` holds an id ≥ `vocab`
    (`starts`: each non-empty shard's first stream position)."""
    if not tokens.size or int(tokens.max()) < vocab:
        return
    at = int(np.argmax(tokens >= vocab))
    pos = stream_start + at
    shards = [s for s in index.shards if s.tokens]
    i = int(np.searchsorted(starts, pos, side="right")) - 1
    raise DataError(_message(directory, shards[i].file, pos - int(starts[i]), int(tokens[at]), vocab))
