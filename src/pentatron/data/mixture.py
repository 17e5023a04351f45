"""A weighted mixture of tokenized datasets (data.sources): deterministic, resumable, sharded by DP rank.

Each source is read as `TokenLoader` reads data.path: packed samples of its own stream (without its held-out
tail), in its own per-epoch permutation (seeded `[seed, epoch, k]` for source k). What the mixture adds is
which source each training sample comes from:

- Global position p of the training order (optimizer step s holds positions [s·G, (s+1)·G), as for one
  source) draws its source from the uniform u(p): block b = p // BLOCK of positions takes its BLOCK
  uniforms from `default_rng([seed, MIX_SALT, b])`, and u(p) falls into source k's slice of [0, 1) (each
  slice's width its weight's share). A counter-based draw: a function of (seed, p) alone, so every rank and
  every layout, micro-batching or dp degree sees the same sources at the same positions.
- The sample at position p is the n-th of its source k, n = how many positions before p chose k. These
  counts at the global `consumed_samples` are the state (with consumed_samples), so a step only draws its
  own G positions; counts further on are the saved ones plus the draws in between.

DP rank r takes positions [s·G + r·G/dp, s·G + (r+1)·G/dp) of the step and cuts them into micro-batches,
exactly as `TokenLoader.next_step`; a dp=N run reads the samples of the dp=1 run. Sample ids handed out
(`sample_ids`, the loss-spike report) are global: source k's sample i is `base_k + i`, base_k the samples of
the sources before it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from pentatron.data.documents import find_documents
from pentatron.data.errors import DataError
from pentatron.data.loader import StepShape, TokenDataset, TokenLoader
from pentatron.models.documents import Documents

STATE_VERSION = 1
BLOCK = 4096  # positions per block of uniforms: a step draws one or two blocks, however large G is
MIX_SALT = 0x4D4958  # "MIX": the source draws never share a stream with an epoch permutation


class MixtureLoader(StepShape):
    """Yields, per optimizer step, this DP rank's micro-batches of (inputs, targets) drawn from the sources."""

    def __init__(self, datasets: list[TokenDataset], names: list[str], weights: list[float], seq_len: int,
                 micro_batch: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 train_tokens: list[int] | None = None) -> None:
        """`train_tokens[k]`: read only this prefix of source k (the rest is held out: data/eval_split.py)."""
        if not datasets or not len(datasets) == len(names) == len(weights):
            raise DataError(f"a mixture needs one name and one weight per dataset, got {len(datasets)} datasets, "
                            f"{len(names)} names, {len(weights)} weights")
        if not all(w > 0 for w in weights):
            raise DataError(f"mixture weights must be > 0, got {weights}")
        # The step's shape is checked by TokenLoader (its rank slicing is this one's): the same messages.
        TokenLoader(datasets[0], seq_len, micro_batch, global_batch, dp_rank, dp_size, seed,
                    train_tokens=None if train_tokens is None else train_tokens[0])
        self.sources = [TokenLoader(ds, seq_len, 1, 1, seed=seed, stream=k,
                                    train_tokens=None if train_tokens is None else train_tokens[k])
                        for k, ds in enumerate(datasets)]
        self.dataset = datasets[0]  # the tokenizer's (every source shares it: `mixture_problems`)
        self.source_names, self.weights = list(names), [float(w) for w in weights]
        total = sum(self.weights)
        self._edges = np.cumsum(self.weights)[:-1] / total  # u in [edge_{k-1}, edge_k) → source k
        self.source_num_samples = [s.num_samples for s in self.sources]
        self._bases = np.cumsum([0] + self.source_num_samples)
        self.seq_len, self.micro_batch, self.global_batch = seq_len, micro_batch, global_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.consumed_samples = 0
        self._blocks: dict[int, np.ndarray] = {}
        self._anchors: dict[int, np.ndarray] = {0: np.zeros(len(datasets), dtype=np.int64)}

    # ---------------------------------------------------------------- which source each position reads
    def _block(self, b: int) -> np.ndarray:
        if b not in self._blocks:
            while len(self._blocks) >= 4:  # a step reads one or two neighbouring blocks
                del self._blocks[min(self._blocks)]
            u = np.random.default_rng([self.seed, MIX_SALT, b]).random(BLOCK)
            self._blocks[b] = np.searchsorted(self._edges, u, side="right").astype(np.int64)
        return self._blocks[b]

    def choices(self, position: int, count: int) -> np.ndarray:
        """The source of each of the positions [position, position+count) of the global order."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            b, off = divmod(position + done, BLOCK)
            n = min(count - done, BLOCK - off)
            out[done:done + n] = self._block(b)[off:off + n]
            done += n
        return out

    def source_samples(self, position: int) -> np.ndarray:
        """Samples each source has given before global position `position` (from the nearest known count at or
        before it: the consumed position's normally; from 0 — exact, slower — for an earlier one)."""
        start = max((a for a in self._anchors if a <= position), default=0)
        counts = self._anchors.get(start, np.zeros(len(self.sources), dtype=np.int64))
        drawn = np.bincount(self.choices(start, position - start), minlength=len(self.sources))
        return counts + drawn

    def _advance(self, position: int) -> None:
        self._anchors[position] = self.source_samples(position)
        while len(self._anchors) > 3:  # the consumed position, the step before it (the observer's), and 0
            del self._anchors[min(a for a in self._anchors if a != 0)]

    # ---------------------------------------------------------------- the samples
    def sample_ids(self, position: int, count: int) -> np.ndarray:
        """Global sample ids (source k's sample i is base_k + i) at positions [position, position+count)."""
        src = self.choices(position, count)
        seen = self.source_samples(position)
        out = np.empty(count, dtype=np.int64)
        for k, loader in enumerate(self.sources):
            at = np.flatnonzero(src == k)
            if at.size:
                # consecutive samples of source k: its order from its count at `position` on
                out[at] = self._bases[k] + loader.sample_ids(int(seen[k]), at.size)
        return out

    def sample(self, index: int) -> np.ndarray:
        """The L+1 tokens of global sample `index`."""
        k = int(np.searchsorted(self._bases, index, side="right")) - 1
        return self.sources[k].sample(index - int(self._bases[k]))

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches for the next optimizer step; advances by one global batch."""
        first = self.consumed_samples + self.dp_rank * self.local_batch
        ids = self.sample_ids(first, self.local_batch)
        tokens = torch.from_numpy(np.stack([self.sample(int(i)) for i in ids]).astype(np.int64))
        self.consumed_samples += self.global_batch
        self._advance(self.consumed_samples)
        mb = self.micro_batch
        return [(tokens[j:j + mb, :-1].contiguous(), tokens[j:j + mb, 1:].contiguous())
                for j in range(0, self.local_batch, mb)]

    def documents(self, inputs: torch.Tensor) -> Documents:
        return find_documents(inputs, self.dataset.eos_id)

    def __iter__(self) -> MixtureLoader:
        return self

    def __next__(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.next_step()

    # ---------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """Rank-independent resume state: the position and each source's samples given by it."""
        counts = self.source_samples(self.consumed_samples)
        return {"version": STATE_VERSION, "consumed_samples": self.consumed_samples, "seed": self.seed,
                "seq_len": self.seq_len, "global_batch": self.global_batch,
                "sources": [{"name": n, "weight": w, "samples": int(c), "num_samples": s.num_samples,
                             "dataset_fingerprint": s.dataset.index.fingerprint}
                            for n, w, c, s in zip(self.source_names, self.weights, counts, self.sources, strict=True)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`. The same sources (names, datasets, sizes after the holdout), weights,
        seq_len and seed are required — any of them changes which sample each position reads; a different
        global_batch, dp or micro_batch is fine."""
        if "sources" not in state:
            raise DataError(f"the checkpoint was saved by a run on one dataset (data.path), this run reads a "
                            f"mixture of {len(self.sources)} data.sources: resume with the same data setting")
        try:
            consumed, seed, seq_len = int(state["consumed_samples"]), int(state["seed"]), int(state["seq_len"])
            saved = [(str(s["name"]), float(s["weight"]), int(s["samples"]), int(s["num_samples"]),
                      str(s["dataset_fingerprint"])) for s in state["sources"]]
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"data loader state is malformed ({type(e).__name__}: {e})") from e
        if seq_len != self.seq_len:
            raise DataError(f"data loader state was saved with seq_len={seq_len} but this run uses "
                            f"seq_len={self.seq_len}; the sample order would differ, so resuming is refused")
        now = [(n, w, s.num_samples, s.dataset.index.fingerprint)
               for n, w, s in zip(self.source_names, self.weights, self.sources, strict=True)]
        was = [(n, w, num, fp) for n, w, _, num, fp in saved]
        if was != now:
            def says(rows: list[tuple[str, float, int, str]]) -> str:
                return "; ".join(f"{n} weight {w:g}, {num} samples, dataset {fp}" for n, w, num, fp in rows)
            raise DataError(f"the checkpoint's data.sources ({says(was)}) differ from this run's ({says(now)}): "
                            "each position would read another sample, so resuming is refused; resume with the "
                            "same sources, weights, datasets and [eval] holdout")
        counts = [c for _, _, c, _, _ in saved]
        if consumed < 0 or min(counts) < 0 or sum(counts) != consumed:
            raise DataError(f"data loader state is inconsistent: per-source samples {counts} do not add up to "
                            f"consumed_samples={consumed}")
        if seed != self.seed:
            self.seed = seed
            self._blocks.clear()
            for s in self.sources:
                s.seed = seed
                s._orders.clear()
        self.consumed_samples = consumed
        self._anchors = {0: np.zeros(len(self.sources), dtype=np.int64),
                         consumed: np.array(counts, dtype=np.int64)}


def _tokenizer_digest(ds: TokenDataset) -> str | None:
    path = ds.path / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def mixture_problems(datasets: list[TokenDataset], names: list[str]) -> list[str]:
    """Sources that cannot be mixed: another end-of-document token (the document boundaries, data/documents.py)
    or another tokenizer.json (the same ids would mean other text)."""
    first, p = datasets[0], []
    digest = _tokenizer_digest(first)
    for ds, name in zip(datasets[1:], names[1:], strict=True):
        if (ds.eos_id, ds.index.eos_token) != (first.eos_id, first.index.eos_token):
            p.append(f"data.sources {name!r} ({ds.path}) ends documents with {ds.index.eos_token!r} = id {ds.eos_id}, "
                     f"{names[0]!r} ({first.path}) with {first.index.eos_token!r} = id {first.eos_id}: tokenize every "
                     f"source with one tokenizer (`pentatron tokenize --tokenizer {first.path}`)")
        elif (other := _tokenizer_digest(ds)) is not None and digest is not None and other != digest:
            p.append(f"data.sources {name!r} ({ds.path}) was tokenized with another tokenizer.json than {names[0]!r} "
                     f"({first.path}): the same ids would be other text; re-tokenize it with `pentatron tokenize "
                     f"--tokenizer {first.path}`")
    return p


def exhaustion(loader: Any, step: int, on_exhausted: str) -> tuple[list[str], bool]:
    """Before step `step` (1-based) of `loader` (a `MixtureLoader` or a data.path `TokenLoader`): one console
    line per source whose samples run out within it (the step would start its next epoch), and whether the run
    must stop there (data.on_exhausted = "stop"). The same on every rank: a function of the global position."""
    g = loader.global_batch
    before = loader.source_samples(loader.consumed_samples)
    after = loader.source_samples(loader.consumed_samples + g)
    lines = []
    for name, num, b, a in zip(loader.source_names, loader.source_num_samples, before, after, strict=True):
        if a > b and (a - 1) // num > max(b - 1, 0) // num:  # the step reads a sample of a later epoch
            epoch = int((a - 1) // num)  # epochs completed before it
            what = (f"data source {name!r} ran out at step {step}: its {num:,} samples ({num * loader.seq_len:,} "
                    f"tokens) were all trained {'once' if epoch == 1 else f'{epoch} times'}; ")
            lines.append(what + (f"data.on_exhausted = \"wrap\": epoch {epoch + 1} of it begins (a new shuffle)"
                                 if on_exhausted == "wrap" else
                                 f"data.on_exhausted = \"stop\": the run ends after step {step - 1}"))
    return lines, bool(lines) and on_exhausted == "stop"
