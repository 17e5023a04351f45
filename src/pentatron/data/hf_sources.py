"""Hugging Face `datasets` sources held locally, read through `datasets` itself: a directory written by
`Dataset.save_to_disk` / `DatasetDict.save_to_disk` (memory-mapped Arrow: rows stream from disk, a corpus larger
than memory is fine) and `.json` record files (`load_dataset("json", streaming=True)`: JSON Lines content is read
in chunks; a file holding one JSON array is parsed whole by `datasets`, so a corpus larger than memory belongs in
JSON Lines, Parquet or a saved dataset). Nothing is downloaded: offline mode is forced before `datasets` is imported."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pentatron.data.errors import DataError

JSON_SUFFIXES = (".json",)
_SAVED_DICT = "dataset_dict.json"
_SAVED_ONE = ("state.json", "dataset_info.json")


def is_saved_dataset(path: Path) -> bool:
    """A directory written by `save_to_disk` (one dataset, or a DatasetDict of splits)."""
    return path.is_dir() and ((path / _SAVED_DICT).is_file() or all((path / n).is_file() for n in _SAVED_ONE))


def saved_dataset_files(path: Path) -> list[Path]:
    """Its files in a fixed order (what its fingerprint hashes)."""
    return sorted((f for f in path.rglob("*") if f.is_file()), key=lambda f: f.relative_to(path).as_posix())


def _datasets() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local sources only: never reach for the Hub
    import datasets

    datasets.disable_progress_bars()  # ours is the progress bar; datasets' would interleave with it
    datasets.logging.set_verbosity_error()  # its own warnings would precede our one-line errors
    return datasets


def _text_column(features: Any, text_field: str, where: str) -> None:
    if text_field not in features:
        cols = ", ".join(features) or "none"
        raise DataError(f"{where} has no column {text_field!r} (columns: {cols}); pass --text-field NAME to read "
                        "another column")
    kind = getattr(features[text_field], "dtype", None)
    if kind not in ("string", "large_string"):
        raise DataError(f"column {text_field!r} of {where} holds {features[text_field]}, not text; pass "
                        "--text-field NAME for a string column")


def saved_dataset_documents(path: Path, text_field: str, split: str, batch: int,
                            advance: Callable[[int], None]) -> Iterator[str]:
    """Non-empty texts of a `save_to_disk` directory's rows, in order; `advance` reports its bytes pro rata."""
    ds_lib = _datasets()
    try:
        ds = ds_lib.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds for a damaged directory
        raise DataError(f"cannot read the saved dataset {path} ({type(e).__name__}: {e})") from e
    if isinstance(ds, ds_lib.DatasetDict):
        names = list(ds)
        if split:
            if split not in ds:
                raise DataError(f"saved dataset {path} has no split {split!r} (splits: {', '.join(names)}); "
                                "pass --split NAME")
            ds = ds[split]
        elif len(names) == 1:
            ds = ds[names[0]]
        else:
            raise DataError(f"saved dataset {path} holds the splits {', '.join(names)}: pass --split NAME to "
                            "choose one (run the command once per split)")
    _text_column(ds.features, text_field, f"saved dataset {path}")
    size, rows = sum(f.stat().st_size for f in saved_dataset_files(path)), max(ds.num_rows, 1)
    done = 0
    for part in ds.select_columns([text_field]).iter(batch_size=batch):
        texts = part[text_field]
        yield from (t for t in texts if t)
        new = size * (done + len(texts)) // rows - size * done // rows
        done += len(texts)
        advance(new)


def json_documents(path: Path, text_field: str, batch: int, advance: Callable[[int], None]) -> Iterator[str]:
    """Non-empty texts of a `.json` file's records (an array of objects, or one object per line), streamed."""
    ds_lib = _datasets()
    where = f"JSON file {path}"
    try:
        for part in ds_lib.load_dataset("json", data_files=str(path), split="train", streaming=True).iter(batch):
            if text_field not in part:
                raise DataError(f"{where} has no field {text_field!r} (fields: {', '.join(part) or 'none'}); pass "
                                "--text-field NAME to read another key")
            texts = part[text_field]
            if (bad := next((t for t in texts if t is not None and not isinstance(t, str)), None)) is not None:
                raise DataError(f"field {text_field!r} of {where} holds {type(bad).__name__}, not text; pass "
                                "--text-field NAME for the text key")
            yield from (t for t in texts if t)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow's JSON parser and datasets raise many kinds
        raise DataError(f"cannot read {where} as records ({type(e).__name__}: {e}); a .json input must hold "
                        f"an array of objects (or one object per line) with a {text_field!r} field") from e
    advance(path.stat().st_size)
