"""Input documents for tokenization: plain text files (one document each), JSONL (one document per line),
local Parquet files (one document per row) and, through `datasets` (data/hf_sources.py), `save_to_disk`
directories and `.json` record files; errors say which file (and line) is wrong. Every reader streams."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from pentatron.data.errors import DataError
from pentatron.data.hf_sources import JSON_SUFFIXES, is_saved_dataset, json_documents, saved_dataset_documents

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


def expand_inputs(inputs: Sequence[Path], exclude: Path | None = None) -> list[Path]:
    """Files in the given order; directories expanded recursively, sorted, hidden entries skipped; a directory
    written by `save_to_disk` is one input (its Arrow files are not text).

    `exclude` (the output directory) is never read back as input, so tokenizing `data/` into
    `data/tok` twice does not swallow the first run's shards.
    """
    excluded = exclude.resolve() if exclude is not None else None
    files: list[Path] = []
    for p in map(Path, inputs):
        if is_saved_dataset(p):
            files.append(p)
        elif p.is_dir():
            found = []
            for f in p.rglob("*"):
                rel = f.relative_to(p)
                if any(part.startswith(".") for part in rel.parts) or not (f.is_file() or is_saved_dataset(f)):
                    continue
                if excluded is not None and f.resolve().is_relative_to(excluded):
                    continue
                if any(is_saved_dataset(d) for d in list(f.parents)[:len(rel.parts) - 1]):
                    continue  # inside a saved dataset: read whole, through `datasets`
                found.append(f)
            files.extend(sorted(found, key=lambda f: f.relative_to(p).as_posix()))
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"input {p} does not exist; check the path (inputs are files or directories)")
    return files


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not UTF-8 text (bad byte at offset {e.start}); convert it to UTF-8 or "
                        "leave it out of the inputs (compressed files are not read)") from e


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read input {path}: {e.strerror or e}") from e


def _jsonl_documents(path: Path, text_field: str, advance: Callable[[int], None]) -> Iterator[str]:
    try:
        f = path.open("rb")
    except OSError as e:
        raise DataError(f"cannot read input {path}: {e.strerror or e}") from e
    with f:
        for lineno, raw in enumerate(f, start=1):
            advance(len(raw))
            line = _decode(raw, f"{path}:{lineno}").strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e}); "
                                "each line must be one JSON object") from e
            if not isinstance(record, dict) or text_field not in record:
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{path}:{lineno}: no {text_field!r} field (found: {keys}); "
                                "pass --text-field NAME to read another key")
            text = record[text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: field {text_field!r} holds {type(text).__name__}, "
                                "not text; pass --text-field NAME for the text key")
            if text:
                yield text


def _parquet_documents(path: Path, text_field: str, batch: int) -> Iterator[str]:
    # pyarrow directly, not `datasets`: its Parquet builder logs its own "Failed to read schema" line before
    # raising, a stray line ahead of ours; and a local file needs neither its cache nor its streaming.
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
        schema = reader.schema_arrow
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read Parquet file {path} ({type(e).__name__}: {e})") from e
    if text_field not in schema.names:
        cols = ", ".join(schema.names) or "none"
        raise DataError(f"Parquet file {path} has no column {text_field!r} (columns: {cols}); "
                        "pass --text-field NAME to read another column")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"Parquet column {text_field!r} in {path} holds {kind}, not text; "
                        "pass --text-field NAME for a string column")
    try:
        for rows in reader.iter_batches(batch_size=batch, columns=[text_field]):
            yield from (t for t in rows.column(0).to_pylist() if t)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read column {text_field!r} of Parquet file {path} "
                        f"({type(e).__name__}: {e})") from e


def iter_documents(files: Sequence[Path], text_field: str = "text", batch_docs: int = 1024,
                   advance: Callable[[int], None] = lambda n: None, split: str = "") -> Iterator[str]:
    """Non-empty documents of every input, in order; `advance(n)` reports n input bytes consumed; `split`: the
    split of a saved DatasetDict."""
    for path in files:
        suffix = path.suffix.lower()
        if path.is_dir():
            yield from saved_dataset_documents(path, text_field, split, batch_docs, advance)
        elif suffix in JSON_SUFFIXES:
            yield from json_documents(path, text_field, batch_docs, advance)
        elif suffix in JSONL_SUFFIXES:
            yield from _jsonl_documents(path, text_field, advance)
        elif suffix in PARQUET_SUFFIXES:
            yield from _parquet_documents(path, text_field, batch_docs)
            advance(path.stat().st_size)
        else:
            raw = _read_bytes(path)
            advance(len(raw))
            if raw:
                yield _decode(raw, str(path))
