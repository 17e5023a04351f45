"""Packed training samples from a tokenized dataset: deterministic, resumable, sharded by DP rank.

The whole dataset is one token stream (shards concatenated, documents separated by EOS). Sample i
is the window stream[i*L : i*L + L + 1]: inputs are its first L tokens, targets the same window
shifted by one. Windows overlap by exactly one token, so every token but the first is a target
exactly once per epoch.

The order is a global one, identical on every rank: epoch e visits the samples in the permutation
drawn from `default_rng([seed, e])`, and epochs follow each other without a seam. Optimizer step s
consumes positions [s*G, (s+1)*G) of that order; DP rank r takes the contiguous slice
[r*G/dp, (r+1)*G/dp) and cuts it into micro-batches. So a dp=N run sees exactly the samples of
the dp=1 run, and the only resume state is `consumed_samples` (independent of dp and micro_batch).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from pentatron.data.documents import find_documents
from pentatron.data.errors import DataError
from pentatron.data.index import DatasetIndex, check_shards, read_index
from pentatron.data.vocab_check import check_sample
from pentatron.models.documents import Documents

STATE_VERSION = 1


class TokenDataset:
    """A tokenized dataset directory (see `tokenize.py`), read as one logical token stream."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.index: DatasetIndex = read_index(self.path)
        check_shards(self.path, self.index)
        # Shards are read with pread on descriptors opened now, not memory-mapped: a mapped shard that
        # shrinks on disk (truncated while training) kills the process with SIGBUS at the first read past
        # its new end, and a size check before each read left a window between the check and the read (a
        # SIGBUS, exit 135, once in ~50 truncations). A short pread cannot fault: it is the check. The
        # descriptors also keep the run reading when a shard or the dataset directory is made unreadable
        # meanwhile (what was opened stays readable, as it was under the mapping). Empty shards hold nothing.
        kept = [s for s in self.index.shards if s.tokens]
        self._dtype = np.dtype(self.index.dtype)
        self._files = [self.path / s.file for s in kept]
        self._handles: list[BinaryIO] = []
        try:
            for f in self._files:
                self._handles.append(open(f, "rb", buffering=0))  # noqa: SIM115 - held until close()
        except OSError as e:  # e.g. a shard of mode 000: one line naming it
            self.close()
            raise DataError(f"shard {e.filename} cannot be read ({e.strerror or e}); make the dataset readable "
                            f"(chmod -R u+r {self.path}) or re-create it with `pentatron tokenize`") from None
        self._lengths = [s.tokens for s in kept]
        self._starts = np.cumsum([0] + self._lengths)
        self.vocab_limit: int | None = None  # set by check_vocab: every sample read is checked against it

    def close(self) -> None:
        """Close the shards' descriptors (also when the dataset is garbage-collected)."""
        handles, self._handles = getattr(self, "_handles", []), []
        for h in handles:
            h.close()

    def __del__(self) -> None:
        self.close()

    def __len__(self) -> int:
        return self.index.total_tokens

    @property
    def vocab_size(self) -> int:
        return self.index.vocab_size

    @property
    def eos_id(self) -> int:
        return self.index.eos_id

    @property
    def max_token_id(self) -> int:
        return self.index.max_token_id

    def check_vocab(self, model_vocab_size: int) -> None:
        """Every token id must index the model's embedding table (the index's maximum now; each sample's
        ids as the loader reads them, see data/vocab_check.py)."""
        self.vocab_limit = model_vocab_size
        if self.max_token_id >= model_vocab_size:
            raise DataError(f"dataset {self.path} has token ids up to {self.max_token_id} but "
                            f"model.vocab_size={model_vocab_size}; set model.vocab_size to at least "
                            f"{self.max_token_id + 1} (the tokenizer's vocabulary is {self.vocab_size}) "
                            "or tokenize with a smaller --vocab-size")

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, read across shard boundaries (a fresh array)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"token range [{start}, {stop}) outside a stream of {len(self)} tokens")
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        parts = []
        while start < stop:
            off = start - int(self._starts[i])
            n = min(stop - start, self._lengths[i] - off)
            parts.append(self._pread(i, off, n))
            start += n
            i += 1
        if not parts:
            return np.empty(0, dtype=self._dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _pread(self, i: int, offset: int, count: int) -> np.ndarray:
        """`count` tokens of shard i from token `offset`; a shard that no longer holds them (truncated or
        emptied while training) is named, in one line, instead of a fault."""
        size = self._dtype.itemsize
        want = count * size
        try:
            data = os.pread(self._handles[i].fileno(), want, offset * size)
        except OSError as e:  # an I/O error of the device under it
            raise DataError(f"dataset shard {self._files[i]} cannot be read while training ({e.strerror or e}); "
                            "check the storage and restore the dataset (the run resumes from its last checkpoint)"
                            ) from None
        if len(data) < want:
            now = os.fstat(self._handles[i].fileno()).st_size
            raise DataError(f"dataset shard {self._files[i]} shrank to {now:,} bytes while training (it holds "
                            f"{self._lengths[i] * size:,}): it was truncated or replaced; restore the dataset "
                            "(the run resumes from its last checkpoint)")
        return np.frombuffer(data, dtype=self._dtype)


def too_short_problem(dataset: TokenDataset, seq_len: int) -> str | None:
    """A dataset that holds not even one sample of seq_len + 1 tokens (also asked by preflight)."""
    if len(dataset) - 1 >= seq_len:
        return None
    return (f"dataset {dataset.path} has {len(dataset)} tokens, fewer than seq_len+1 = {seq_len + 1} needed for "
            "one sample; use a shorter train.seq_len or more data")


class StepShape:
    """A loader's step in samples: its `global_batch`, `dp_size` and `micro_batch` attributes."""

    global_batch: int
    dp_size: int
    micro_batch: int

    @property
    def local_batch(self) -> int:
        """Samples per step on this rank."""
        return self.global_batch // self.dp_size

    @property
    def micro_batches_per_step(self) -> int:
        return self.local_batch // self.micro_batch


class TokenLoader(StepShape):
    """Yields, per optimizer step, this DP rank's micro-batches of (inputs, targets) int64 tensors."""

    def __init__(self, dataset: TokenDataset, seq_len: int, micro_batch: int, global_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, consumed_samples: int = 0,
                 train_tokens: int | None = None, stream: int | None = None) -> None:
        """`train_tokens`: read only this prefix of the stream (the rest is held out: data/eval_split.py).
        `stream`: a mixture's source number, mixed into the epoch permutations' seed (data/mixture.py) so two
        sources of the same size are not shuffled alike; None (data.path) keeps the order `[seed, epoch]`."""
        problems = [f"{name} must be a positive integer, got {v!r}"
                    for name, v in (("seq_len", seq_len), ("micro_batch", micro_batch),
                                    ("global_batch", global_batch), ("dp_size", dp_size))
                    if not isinstance(v, int) or isinstance(v, bool) or v <= 0]
        if not problems and not 0 <= dp_rank < dp_size:
            problems.append(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        if not problems and global_batch % (dp_size * micro_batch):
            problems.append(f"global_batch={global_batch} must be divisible by dp*micro_batch = "
                            f"{dp_size}*{micro_batch} = {dp_size * micro_batch}, so every DP rank runs the "
                            "same whole number of micro-batches per step")
        if not isinstance(seed, int) or seed < 0:
            problems.append(f"seed must be a non-negative integer, got {seed!r}")
        if not isinstance(consumed_samples, int) or consumed_samples < 0:
            problems.append(f"consumed_samples must be a non-negative integer, got {consumed_samples!r}")
        if problems:
            raise DataError("; ".join(problems))
        self.dataset = dataset
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.consumed_samples = consumed_samples
        self.stream = stream
        self.num_samples = ((len(dataset) if train_tokens is None else train_tokens) - 1) // seq_len
        short = too_short_problem(dataset, seq_len) or (None if self.num_samples > 0 else
                                                        f"a holdout leaves {train_tokens} training tokens, "
                                                        f"fewer than seq_len+1 = {seq_len + 1}")
        if short:
            raise DataError(short)
        self._orders: dict[int, np.ndarray] = {}

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from."""
        return self.consumed_samples // self.num_samples

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            # A step straddles at most a few epochs and reads them in increasing order: keep the newest two.
            while len(self._orders) >= 2:
                del self._orders[min(self._orders)]
            key = [self.seed, epoch] if self.stream is None else [self.seed, epoch, self.stream]
            self._orders[epoch] = np.random.default_rng(key).permutation(self.num_samples)
        return self._orders[epoch]

    def sample_ids(self, position: int, count: int) -> np.ndarray:
        """Sample indices at positions [position, position+count) of the global order."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            epoch, pos = divmod(position + done, self.num_samples)
            n = min(count - done, self.num_samples - pos)
            out[done:done + n] = self._order(epoch)[pos:pos + n]
            done += n
        return out

    def sample(self, index: int) -> np.ndarray:
        """The L+1 tokens of packed sample `index` (inputs = [:-1], targets = [1:])."""
        start = index * self.seq_len
        tokens = self.dataset.read(start, start + self.seq_len + 1)
        ds = self.dataset
        if ds.vocab_limit is not None:
            check_sample(tokens, start, ds.path, ds.index, ds._starts, ds.vocab_limit)
        return tokens

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches for the next optimizer step; advances by one global batch."""
        first = self.consumed_samples + self.dp_rank * self.local_batch
        ids = self.sample_ids(first, self.local_batch)
        tokens = torch.from_numpy(np.stack([self.sample(int(i)) for i in ids]).astype(np.int64))
        self.consumed_samples += self.global_batch
        mb = self.micro_batch
        return [(tokens[j:j + mb, :-1].contiguous(), tokens[j:j + mb, 1:].contiguous())
                for j in range(0, self.local_batch, mb)]

    def documents(self, inputs: torch.Tensor) -> Documents:
        """Where the documents of a micro-batch's samples start (its inputs; data/documents.py)."""
        return find_documents(inputs, self.dataset.eos_id)

    # The one-source case of data/mixture.py's interface (the trainer's exhaustion and accounting read it).
    @property
    def source_names(self) -> list[str]:
        return [self.dataset.path.name]

    @property
    def source_num_samples(self) -> list[int]:
        return [self.num_samples]

    def source_samples(self, position: int) -> np.ndarray:
        """Samples each source has given by global position `position`: all of them are this one's."""
        return np.array([position], dtype=np.int64)

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.next_step()  # endless: epochs continue seamlessly

    def state_dict(self) -> dict[str, Any]:
        """Rank-independent resume state (the same on every DP rank)."""
        return {"version": STATE_VERSION, "consumed_samples": self.consumed_samples, "seed": self.seed,
                "seq_len": self.seq_len, "global_batch": self.global_batch, "num_samples": self.num_samples,
                "dataset_fingerprint": self.dataset.index.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`. The data order depends on the dataset, seq_len and seed, so a
        different dataset or seq_len is refused (it would silently replay a different order); a
        different global_batch, dp_size or micro_batch is fine."""
        try:
            consumed, seed = int(state["consumed_samples"]), int(state["seed"])
            seq_len = int(state["seq_len"])
            fingerprint = state.get("dataset_fingerprint")
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"data loader state is malformed ({type(e).__name__}: {e})") from e
        if "sources" in state:
            raise DataError(f"the checkpoint was saved by a run on a mixture of {len(state['sources'])} data.sources, "
                            f"this run reads data.path {str(self.dataset.path)!r}: resume with the same data.sources")
        if seq_len != self.seq_len:
            raise DataError(f"data loader state was saved with seq_len={seq_len} but this run uses "
                            f"seq_len={self.seq_len}; the sample order would differ, so resuming is refused")
        if fingerprint is not None and fingerprint != self.dataset.index.fingerprint:
            raise DataError(f"data loader state was saved for dataset fingerprint {fingerprint} but "
                            f"{self.dataset.path} has {self.dataset.index.fingerprint}; resume with the "
                            "same dataset")
        if consumed < 0:
            raise DataError(f"data loader state has consumed_samples={consumed} < 0")
        saved_samples = state.get("num_samples", self.num_samples)
        if saved_samples != self.num_samples:  # same dataset and seq_len: the held-out split changed
            raise DataError(f"data loader state was saved with {saved_samples} training samples but this run has "
                            f"{self.num_samples} (eval.holdout or eval.holdout_tokens changed); the sample order "
                            "would differ, so resuming is refused: use the run's [eval] holdout")
        self.consumed_samples = consumed
        if seed != self.seed:
            self.seed = seed
            self._orders.clear()
