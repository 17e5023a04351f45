"""The on-disk description of a tokenized dataset (index.json) and the checks that its shards are intact.

    tokenizer.json        the Hugging Face `tokenizers` tokenizer that produced the ids
    shard_00000.bin ...   raw little-endian token ids (uint16 if vocab <= 65536, else uint32)
    index.json            format version, dtype, vocab, eos id, shard sizes, totals, fingerprint
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pentatron.data.errors import DataError

INDEX_VERSION = 1
INDEX_FILE = "index.json"


@dataclass(frozen=True)
class ShardInfo:
    file: str
    tokens: int


@dataclass(frozen=True)
class DatasetIndex:
    """The contents of index.json."""

    version: int
    dtype: str
    vocab_size: int
    eos_id: int
    eos_token: str
    shards: tuple[ShardInfo, ...]
    total_tokens: int
    num_documents: int
    max_token_id: int
    fingerprint: str

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["shards"] = [asdict(s) for s in self.shards]
        return d

    @classmethod
    def from_json(cls, data: Any, source: Path) -> DatasetIndex:
        redo = "re-create the dataset with `pentatron tokenize`"
        if not isinstance(data, dict):
            raise DataError(f"{source} is not a dataset index (expected a JSON object); {redo}")
        if data.get("version") != INDEX_VERSION:
            raise DataError(f"{source} has format version {data.get('version')!r}, this Pentatron reads "
                            f"version {INDEX_VERSION}; {redo}")
        try:
            shards = tuple(ShardInfo(file=str(s["file"]), tokens=int(s["tokens"])) for s in data["shards"])
            index = cls(version=int(data["version"]), dtype=str(data["dtype"]),
                        vocab_size=int(data["vocab_size"]),
                        eos_id=int(data["eos_id"]), eos_token=str(data["eos_token"]), shards=shards,
                        total_tokens=int(data["total_tokens"]), num_documents=int(data["num_documents"]),
                        max_token_id=int(data["max_token_id"]), fingerprint=str(data["fingerprint"]))
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{source} is malformed ({type(e).__name__}: {e}); {redo}") from e
        if index.dtype not in ("uint16", "uint32"):
            raise DataError(f"{source} has dtype {index.dtype!r}; expected uint16 or uint32; {redo}")
        if sum(s.tokens for s in shards) != index.total_tokens or any(s.tokens < 0 for s in shards):
            raise DataError(f"{source} is inconsistent: shard token counts do not add up to "
                            f"total_tokens={index.total_tokens}; {redo}")
        for s in shards:
            if Path(s.file).name != s.file:  # never follow an index outside its own directory
                raise DataError(f"{source} names shard {s.file!r}, which is not a plain file name; {redo}")
        return index


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def read_index(directory: Path) -> DatasetIndex:
    """Parse `directory/index.json`, raising DataError that says how to create it when absent."""
    directory = Path(directory)
    path = directory / INDEX_FILE
    if not path.is_file():
        raise DataError(f"no tokenized dataset in {directory}: {INDEX_FILE} is missing; create one with "
                        f"`pentatron tokenize INPUTS --out {directory}`")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not readable JSON ({e}); "
                        "re-create the dataset with `pentatron tokenize`") from e
    return DatasetIndex.from_json(data, path)


def check_shards(directory: Path, index: DatasetIndex) -> None:
    """Every shard exists with exactly the byte size the index promises."""
    itemsize = np.dtype(index.dtype).itemsize
    for s in index.shards:
        path = Path(directory) / s.file
        if not path.is_file():
            raise DataError(f"shard {path} is missing (listed in {INDEX_FILE}); the dataset is incomplete, "
                            "re-create it with `pentatron tokenize`")
        size, want = path.stat().st_size, s.tokens * itemsize
        if size != want:
            raise DataError(f"shard {path} has {size} bytes but {INDEX_FILE} expects {want} "
                            f"({s.tokens} {index.dtype} tokens); the file is truncated or replaced, "
                            "re-create the dataset with `pentatron tokenize`")
