"""Text → token shards: one tokenizer, flat numpy shards, and an index that says what they hold
(the on-disk layout is described in `data/index.py`; inputs are read by `data/readers.py`).

Documents are concatenated into one stream, each followed by the end-of-document token; shards
are fixed-size cuts of that stream (a document may span two shards). The directory is built
under a hidden temporary name and renamed into place only when complete, so a crash leaves no
directory that looks like a valid dataset.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from pentatron.data.corpus import DEFAULT_CORPUS_BYTES, default_corpus_files
from pentatron.data.errors import DataError
from pentatron.data.hf_sources import JSON_SUFFIXES, saved_dataset_files
from pentatron.data.index import (
    INDEX_FILE,
    INDEX_VERSION,
    DatasetIndex,
    ShardInfo,
    check_shards,
    read_index,
    token_dtype,
)
from pentatron.data.readers import JSONL_SUFFIXES, PARQUET_SUFFIXES, expand_inputs, iter_documents
from pentatron.data.tokenize_resume import PROGRESS_FILE, Progress, lock, partial_dir
from pentatron.writes import WriteError, created_dirs, staged_dir, write_error

TOKENIZER_FILE = "tokenizer.json"
EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens of common existing tokenizers (GPT-2/NeoX, Llama 3, Llama 2/Mistral, Gemma),
# tried in order when an existing tokenizer is used and no eos_token is given.
KNOWN_EOS_TOKENS = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>")
_BYTE_ALPHABET = 256


@dataclass
class TokenizeSettings:
    vocab_size: int = 4096
    """Vocabulary to train; with an existing tokenizer, the largest vocabulary accepted."""
    tokenizer_path: Path | None = None
    """An existing tokenizer.json (or a directory holding one); None trains a byte-level BPE."""
    text_field: str = "text"
    """JSONL key / Parquet column holding each document's text."""
    shard_tokens: int = 16_777_216
    batch_docs: int = 1024
    """Documents per `encode_batch` call (the Rust side parallelises within a batch)."""
    eos_token: str | None = None
    """End-of-document token; None means `<|endoftext|>` when training, auto-detected otherwise."""
    split: str = ""
    """The split to read from a saved DatasetDict (`save_to_disk` of several splits); empty: its only split."""

    def problems(self) -> list[str]:
        out = []
        for name in ("vocab_size", "shard_tokens", "batch_docs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                out.append(f"{name} must be a positive integer, got {v!r}")
        v = self.vocab_size
        if self.tokenizer_path is None and isinstance(v, int) and 0 < v <= _BYTE_ALPHABET:
            out.append(f"vocab_size={v} is too small for a byte-level BPE: it needs {_BYTE_ALPHABET} byte "
                       f"tokens + 1 end-of-document token; use at least {_BYTE_ALPHABET + 1}")
        if isinstance(self.vocab_size, int) and self.vocab_size > 2**32:
            out.append(f"vocab_size={self.vocab_size} does not fit in uint32 token ids")
        if not self.text_field:
            out.append("text_field must be a non-empty column/key name")
        if self.eos_token is not None and not self.eos_token:
            out.append("eos_token must be a non-empty string (or None for the default)")
        return out


# ---------------------------------------------------------------- tokenizer


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as e:
        raise DataError(f"cannot read input {path}: {e.strerror or e}") from e
    return h.hexdigest()


def _tokenizer_file(path: Path) -> Path:
    path = Path(path)
    if path.is_dir():  # a Hugging Face model directory
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"tokenizer {path} does not exist; pass the path of a tokenizer.json "
                        "(or omit --tokenizer to train one)")
    return path


def load_tokenizer(path: Path) -> Tokenizer:
    """Load a Hugging Face `tokenizers` tokenizer.json (or a directory that holds one)."""
    file = _tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:
        raise DataError(f"{file} is not a Hugging Face tokenizers tokenizer.json ({e})") from e


def _find_eos(tok: Tokenizer, settings: TokenizeSettings, source: Path) -> tuple[str, int]:
    names = (settings.eos_token,) if settings.eos_token else KNOWN_EOS_TOKENS
    for name in names:
        tid = tok.token_to_id(name)
        if tid is not None:
            return name, tid
    raise DataError(f"tokenizer {source} has no end-of-document token (looked for {', '.join(names)}); "
                    "pass --eos-token TOKEN naming one it has")


def _train_tokenizer(documents: Iterator[str], vocab_size: int, eos_token: str) -> Tokenizer:
    """Byte-level BPE: every byte is in the base alphabet, so no input is ever unrepresentable.

    The trainer is deterministic for identical input (ties between equally frequent pairs are broken
    by pair order), which the tests check across processes.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


# ---------------------------------------------------------------- writing


class _ShardWriter:
    """Cuts the token stream into fixed-size shard files, fsynced, and tracks the index totals."""

    def __init__(self, directory: Path, dtype: np.dtype, shard_tokens: int, progress: Progress,
                 tail: np.ndarray) -> None:
        """Continues from `progress` (its shards, and `tail`: the tokens after them)."""
        self.directory = directory
        self.buf = np.empty(shard_tokens, dtype=dtype)
        self.fill = tail.size
        self.buf[:tail.size] = tail
        self.shards: list[ShardInfo] = list(progress.shards)
        self.total = sum(s.tokens for s in self.shards)
        self.max_id = progress.max_id

    def add(self, ids: np.ndarray) -> None:
        if ids.size:
            self.max_id = max(self.max_id, int(ids.max()))
        ids = ids.astype(self.buf.dtype, copy=False)
        pos = 0
        while pos < ids.size:
            n = min(ids.size - pos, self.buf.size - self.fill)
            self.buf[self.fill:self.fill + n] = ids[pos:pos + n]
            self.fill += n
            pos += n
            if self.fill == self.buf.size:
                self.flush()

    def flush(self) -> None:
        if not self.fill:
            return
        name = f"shard_{len(self.shards):05d}.bin"
        with (self.directory / name).open("wb") as f:
            self.buf[:self.fill].tofile(f)
            f.flush()
            os.fsync(f.fileno())
        self.shards.append(ShardInfo(name, self.fill))
        self.total += self.fill
        self.fill = 0


def _write_json(path: Path, data: Any) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every platform/filesystem can open a directory; durability is best-effort there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def dataset_fingerprint(files: Sequence[Path], settings: TokenizeSettings) -> str:
    """16 hex digits over the input bytes (in order) and every setting that changes the output.

    File names are left out on purpose: the same text at another path is the same dataset (a saved dataset's
    names inside its directory are kept: they order its Arrow files).
    `batch_docs` is left out because it does not change a single token.
    """
    h = hashlib.sha256()
    tok_hash = _sha256_file(_tokenizer_file(settings.tokenizer_path)) if settings.tokenizer_path else None
    fields = {"version": INDEX_VERSION, "vocab_size": settings.vocab_size, "tokenizer": tok_hash,
              "text_field": settings.text_field, "shard_tokens": settings.shard_tokens, "eos_token": settings.eos_token}
    if settings.split:  # (only when set: the fingerprints of datasets made before it existed stay the same)
        fields["split"] = settings.split
    h.update(json.dumps(fields, sort_keys=True).encode())
    for f in map(Path, files):
        if f.is_dir():  # a saved dataset: every file of it, by relative path
            for part in saved_dataset_files(f):
                h.update(f"\n{part.relative_to(f).as_posix()}:{_sha256_file(part)}".encode())
        else:
            h.update(f"\n{f.suffix.lower()}:{_sha256_file(f)}".encode())
    return h.hexdigest()[:16]


def _existing_dataset(out_dir: Path, fingerprint: str) -> DatasetIndex | None:
    """The index at `out_dir` if it is a complete dataset with this fingerprint, else None."""
    try:
        index = read_index(out_dir)
        if index.fingerprint != fingerprint:
            return None
        check_shards(out_dir, index)
    except DataError:
        return None
    return index


def _publish(tmp: Path, out_dir: Path, fingerprint: str) -> DatasetIndex | None:
    """Rename the finished temp dir into place; if another process got there first with the same
    dataset (e.g. several ranks building the default corpus), keep theirs and return its index."""
    try:
        os.rename(tmp, out_dir)  # atomic; replaces an empty directory on POSIX
    except OSError as e:
        theirs = _existing_dataset(out_dir, fingerprint)
        if theirs is None:
            hint = ("it appeared meanwhile with other contents; remove it or choose another --out"
                    if out_dir.exists() else "check that its parent directory is writable")
            raise DataError(f"cannot move the finished dataset to {out_dir} ({e.strerror or e}); {hint}") from e
        shutil.rmtree(tmp, ignore_errors=True)
        return theirs
    _fsync_dir(out_dir.parent)
    return None


def tokenize_to_shards(inputs: list[Path], out_dir: Path, settings: TokenizeSettings,
                       progress: bool = True, stats: dict[str, Any] | None = None) -> DatasetIndex:
    """Tokenize `inputs` into a dataset directory at `out_dir` and return its index.

    If `out_dir` already holds the same dataset (same fingerprint, shards intact) it is returned
    as is; any other existing, non-empty `out_dir` is an error rather than silently replaced. An
    interrupted job is continued (data/tokenize_resume.py). `stats`, if given, receives what this call
    did: `tokens` and `documents` it tokenized, `seconds`, `resumed_documents` (skipped: already in).
    """
    if problems := settings.problems():
        raise DataError("; ".join(problems))
    out_dir = Path(out_dir)
    files = expand_inputs(inputs, exclude=out_dir)
    if not files:
        raise DataError(f"no text found in inputs: {', '.join(map(str, inputs)) or '(none given)'}; "
                        "give plain-text, .jsonl, .json or .parquet files, saved datasets (save_to_disk) or "
                        "directories holding them")
    fingerprint = dataset_fingerprint(files, settings)
    if out_dir.exists():
        if (same := _existing_dataset(out_dir, fingerprint)) is not None:
            return same
        if not out_dir.is_dir() or any(out_dir.iterdir()):
            raise DataError(f"output directory {out_dir} already exists and holds something else; "
                            "remove it or choose another --out")
    work = partial_dir(out_dir, fingerprint)
    # The parents made here are removed again if even the work directory cannot be made (one line, nothing left).
    with created_dirs(out_dir.parent, "the dataset", report_as=out_dir):
        work.mkdir(exist_ok=True)
        held = lock(work)
    if held is None:  # another process is building this very dataset: build privately, keep the first to finish
        with staged_dir(out_dir, "the dataset") as tmp:
            index = _build(files, tmp, settings, fingerprint, progress, inputs, stats)
            theirs = _publish(tmp, out_dir, fingerprint)
        return theirs or index
    try:
        index = _build(files, work, settings, fingerprint, progress, inputs, stats)
        theirs = _publish(work, out_dir, fingerprint)
    except DataError:
        shutil.rmtree(work, ignore_errors=True)  # the input is wrong: nothing worth resuming
        raise
    except OSError as e:  # e.g. a full disk: the work done is kept for the rerun
        first = write_error(e, out_dir, "the dataset")
        raise WriteError(f"{first}; the work done is kept in {work}: run the same command again to continue",
                         first.code) from None
    finally:
        held.close()
    return theirs or index


def _build(files: list[Path], work: Path, settings: TokenizeSettings, fingerprint: str, progress: bool,
           inputs: Sequence[Path], stats: dict[str, Any] | None = None) -> DatasetIndex:
    """Tokenize into `work`, continuing from its last checkpoint if it has one."""
    total_bytes = sum(sum(f.stat().st_size for f in (saved_dataset_files(p) if p.is_dir() else [p])) for p in files)
    records = any(p.is_dir() or p.suffix.lower() in JSONL_SUFFIXES + PARQUET_SUFFIXES + JSON_SUFFIXES
                  for p in files)
    empty = DataError(f"no text found in inputs: {', '.join(map(str, inputs))}; every document is empty"
                      + (f" (records read from field {settings.text_field!r})" if records else ""))

    def bar(desc: str) -> tqdm:  # drawn on a terminal only: in a log, its redraws are lines of noise
        return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True,
                    disable=not (progress and sys.stderr.isatty()), file=sys.stderr, dynamic_ncols=True)

    def documents(advance: Callable[[int], None]) -> Iterator[str]:
        return iter_documents(files, settings.text_field, settings.batch_docs, advance, settings.split)

    resumed = (work / PROGRESS_FILE).is_file()  # written once the tokenizer is in place
    if settings.tokenizer_path is not None:
        tok = load_tokenizer(settings.tokenizer_path)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        if vocab > settings.vocab_size:
            raise DataError(f"tokenizer {settings.tokenizer_path} has {vocab} tokens, more than the "
                            f"requested vocab_size={settings.vocab_size}; pass --vocab-size {vocab} (and use "
                            f"model.vocab_size >= {vocab}) or a smaller tokenizer")
        eos_token, eos_id = _find_eos(tok, settings, settings.tokenizer_path)
        shutil.copyfile(_tokenizer_file(settings.tokenizer_path), work / TOKENIZER_FILE)
    elif resumed:  # trained before the interruption (training is deterministic: the same one, without the cost)
        eos_token = settings.eos_token or EOS_TOKEN
        tok = load_tokenizer(work / TOKENIZER_FILE)
        eos_id = tok.token_to_id(eos_token)
        vocab = tok.get_vocab_size(with_added_tokens=True)
    else:
        eos_token = settings.eos_token or EOS_TOKEN
        seen = 0
        with bar("training tokenizer") as pb:
            def counted() -> Iterator[str]:
                nonlocal seen
                for doc in documents(pb.update):
                    seen += 1
                    yield doc
            tok = _train_tokenizer(counted(), settings.vocab_size, eos_token)
        if not seen:
            raise empty
        eos_id = tok.token_to_id(eos_token)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        tok.save(str(work / TOKENIZER_FILE))

    dtype = token_dtype(vocab)
    loaded = Progress.load(work, dtype) if resumed else None
    state, tail = loaded if loaded is not None else (Progress(), np.empty(0, dtype=dtype))
    if loaded is None:
        state.save(work, tail)  # the tokenizer is in place: a rerun need not train it again
    writer = _ShardWriter(work, dtype, settings.shard_tokens, state, tail)
    eos = np.array([eos_id], dtype=np.uint32)
    skip, num_docs, new_tokens = state.documents, state.documents, 0
    start = time.perf_counter()

    def write(n_docs: int, encoded: list[Any]) -> None:
        nonlocal num_docs, new_tokens
        parts: list[np.ndarray] = []
        for enc in encoded:
            parts += (np.asarray(enc.ids, dtype=np.uint32), eos)
        ids = np.concatenate(parts)
        shards = len(writer.shards)
        writer.add(ids)
        num_docs += n_docs
        new_tokens += ids.size
        if len(writer.shards) > shards:  # a shard completed: checkpoint (tokenize_resume.py)
            state.documents, state.shards, state.max_id = num_docs, writer.shards, writer.max_id
            state.save(work, writer.buf[:writer.fill])
        pb.set_postfix_str(f"{new_tokens / (time.perf_counter() - start):,.0f} tokens/s")

    def batches() -> Iterator[list[str]]:
        docs = itertools.islice(documents(pb.update), skip, None)  # the first `skip` are in already
        while batch := list(itertools.islice(docs, settings.batch_docs)):
            yield batch

    # One batch encodes (in Rust, on every core, without the GIL) while this thread reads the next batch and
    # writes the previous one; batches are written in order, so checkpoints and bytes are as without overlap.
    with bar("tokenizing") as pb, ThreadPoolExecutor(1, thread_name_prefix="encode") as pool:
        pending: tuple[int, Future] | None = None
        for batch in batches():
            ahead = (len(batch), pool.submit(tok.encode_batch, batch, add_special_tokens=False))
            if pending is not None:
                write(pending[0], pending[1].result())
            pending = ahead
        if pending is not None:
            write(pending[0], pending[1].result())
    writer.flush()
    if stats is not None:
        stats.update(tokens=new_tokens, documents=num_docs - skip, seconds=time.perf_counter() - start,
                     resumed_documents=skip)
    if not num_docs:
        raise empty
    if writer.max_id >= vocab:  # a tokenizer whose ids exceed its own vocab size would corrupt training
        raise DataError(f"tokenizer produced token id {writer.max_id} but reports vocab size {vocab}")
    index = DatasetIndex(version=INDEX_VERSION, dtype=dtype.name, vocab_size=vocab, eos_id=eos_id,
                         eos_token=eos_token, shards=tuple(writer.shards), total_tokens=writer.total,
                         num_documents=num_docs, max_token_id=writer.max_id, fingerprint=fingerprint)
    Progress.clear(work)  # the finished directory holds the dataset only
    _write_json(work / INDEX_FILE, index.to_json())  # last: its presence marks a complete dataset
    _fsync_dir(work)
    return index


def ensure_default_dataset(cache_dir: Path, vocab_size: int = 4096, max_bytes: int = DEFAULT_CORPUS_BYTES,
                           progress: bool = True) -> Path:
    """The built-in corpus (Python stdlib source) tokenized once into `cache_dir/<fingerprint>/`.

    Later calls find the finished directory and return at once (cost: hashing the ~6 MB corpus).
    """
    files = default_corpus_files(max_bytes)
    settings = TokenizeSettings(vocab_size=vocab_size)
    out = Path(cache_dir) / dataset_fingerprint(files, settings)
    if _existing_dataset(out, out.name) is None:
        tokenize_to_shards(files, out, settings, progress=progress)
    return out


# ---------------------------------------------------------------- CLI


def add_tokenize_parser(subparsers: Any) -> None:
    """Register `pentatron tokenize` on an argparse sub-parsers object."""
    defaults = TokenizeSettings()
    p = subparsers.add_parser(
        "tokenize", help="turn text into token shards for training",
        description="Tokenize plain-text files (one document each), JSONL (one document per line), JSON "
                    "records, Parquet files and Hugging Face datasets saved with save_to_disk into a dataset "
                    "directory for training, streaming (a corpus larger than memory is fine) on all cores. "
                    "An interrupted job continues where it stopped when the same command is run again. With "
                    "no inputs, the built-in corpus (this Python's standard-library source) is used.")
    p.add_argument("inputs", nargs="*", type=Path, metavar="INPUT",
                   help="files or directories (searched recursively); .jsonl/.ndjson, .json and .parquet are "
                        "read as records, a save_to_disk directory as a dataset's rows, anything else as one "
                        "text document")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="dataset directory to create")
    p.add_argument("--tokenizer", type=Path, metavar="PATH",
                   help="existing tokenizer.json (or a directory holding one); "
                        "default: train a byte-level BPE")
    p.add_argument("--vocab-size", type=int, metavar="N",
                   help=f"vocabulary to train (default {defaults.vocab_size}); with --tokenizer, the "
                        "largest accepted (default: the tokenizer's own)")
    p.add_argument("--text-field", default=defaults.text_field, metavar="NAME",
                   help="JSON key / Parquet or dataset column with the text (default %(default)s)")
    p.add_argument("--split", default=defaults.split, metavar="NAME",
                   help="the split of a saved DatasetDict to read (default: its only split)")
    p.add_argument("--shard-tokens", type=int, default=defaults.shard_tokens, metavar="N",
                   help="tokens per shard file (default %(default)s)")
    p.add_argument("--eos-token", metavar="TOKEN",
                   help=f"end-of-document token (default {EOS_TOKEN}; auto-detected for --tokenizer)")
    p.add_argument("--default-corpus", action="store_true", help="tokenize the built-in corpus")
    p.add_argument("--corpus-bytes", type=int, default=DEFAULT_CORPUS_BYTES, metavar="N",
                   help="size budget of the built-in corpus (default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_tokenize)


def run_tokenize(args: argparse.Namespace) -> int:
    """Entry point of `pentatron tokenize`: 0 on success, 2 on an input error (one line on stderr)."""
    try:
        if args.default_corpus and args.inputs:
            raise DataError("give INPUT files or --default-corpus, not both")
        inputs = list(args.inputs) or default_corpus_files(args.corpus_bytes)
        vocab = args.vocab_size
        if vocab is None:
            vocab = (load_tokenizer(args.tokenizer).get_vocab_size(with_added_tokens=True)
                     if args.tokenizer is not None else TokenizeSettings.vocab_size)
        settings = TokenizeSettings(vocab_size=vocab, tokenizer_path=args.tokenizer,
                                    text_field=args.text_field, shard_tokens=args.shard_tokens,
                                    eos_token=args.eos_token, split=args.split)
        stats: dict[str, Any] = {}
        index = tokenize_to_shards(inputs, args.out, settings, progress=not args.no_progress, stats=stats)
    except (DataError, WriteError) as e:
        print(f"pentatron tokenize: error: {e}", file=sys.stderr)
        return e.code if isinstance(e, WriteError) else 2
    except KeyboardInterrupt:
        print("pentatron tokenize: interrupted; run the same command again to continue where it stopped",
              file=sys.stderr)
        return 130
    print(f"{args.out}: {index.total_tokens:,} tokens, {index.num_documents:,} documents, "
          f"{len(index.shards)} shard(s), vocab {index.vocab_size}, fingerprint {index.fingerprint}")
    if stats:  # (empty: the dataset existed already)
        resumed = (f", continuing after the {stats['resumed_documents']:,} documents of the interrupted job"
                   if stats["resumed_documents"] else "")
        print(f"tokenized {stats['tokens']:,} tokens of {stats['documents']:,} documents in {stats['seconds']:.1f} s: "
              f"{stats['tokens'] / max(stats['seconds'], 1e-9):,.0f} tokens/s{resumed}")
    print(f"train on it: pentatron train CONFIG --set data.path={json.dumps(str(args.out))} "
          f"--set model.vocab_size={index.vocab_size}\n"
          f"(model.vocab_size must be at least {index.max_token_id + 1}, the largest token id + 1; the tokenizer's "
          f"vocabulary is {index.vocab_size}, and with tensor parallelism it must divide by parallel.tp)")
    return 0
