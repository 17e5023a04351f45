"""Reading a DCP checkpoint without executing anything from it.

`torch.distributed.checkpoint` keeps its index (`.metadata`: which tensor lies in which file, at which
offset) as a pickle and reads it with `pickle.load`, so a crafted `.metadata` whose `__reduce__` names
`os.system` runs that code in whoever opens the checkpoint. Everything Pentatron reads from a
checkpoint goes through `SafeReader` instead:

- `.metadata` is unpickled by `_MetadataUnpickler`, which resolves only the classes DCP writes there
  (its metadata dataclasses, `torch.Size`, dtypes, layouts, paths); any other global is refused before
  it is looked up, so nothing is ever called that DCP did not write;
- the result is then checked as data: only tensor entries (DCP would hand a "bytes" entry to a full
  `torch.load`, which can run code: Pentatron never writes one), each chunk inside its tensor, and each
  file a plain name inside the checkpoint directory;
- the tensors themselves are read by DCP with `torch.load(weights_only=True)`, which admits tensors only.

What a checkpoint may hold is therefore: DCP files (tensors + this index), `meta.json`, the manifest and
the pieces (all JSON). Any violation is a `CheckpointError`: one line naming the file, exit 2.
"""

from __future__ import annotations

import os
import pathlib
import pickle
from pathlib import Path, PurePath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

from pentatron.checkpoint.errors import CheckpointError

METADATA_FILE = ".metadata"

# (module, name) of every global a DCP `.metadata` written by torch 2.11–2.14 refers to.
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(dcp_md.__name__, n): getattr(dcp_md, n) for n in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
        "MetadataIndex", "_MEM_FORMAT_ENCODING")},
    (dcp_fs.__name__, "_StorageInfo"): dcp_fs._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a lookup in torch's layouts
    **{("pathlib", n): getattr(pathlib, n) for n in (
        "Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self._path}: refused: it refers to {module}.{name}, which a checkpoint's "
                              "index never holds (a crafted file? nothing from it was run)")


def read_metadata(directory: Path) -> dcp_md.Metadata:
    """The checked index of the DCP checkpoint in `directory`."""
    path = Path(directory) / METADATA_FILE
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - any malformed pickle is one line, not a traceback
        raise CheckpointError(f"{path}: not a checkpoint index ({type(e).__name__}: {e})".splitlines()[0]) from None
    problem = _problem(md)
    if problem:
        raise CheckpointError(f"{path}: refused: {problem}")
    return md


def _problem(md: Any) -> str | None:
    """Why `md` is not an index Pentatron wrote (None when it is one)."""
    if type(md) is not dcp_md.Metadata:
        return f"it holds a {type(md).__name__}, not DCP metadata"
    if not isinstance(md.state_dict_metadata, dict):
        return "its state_dict_metadata is not a mapping"
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            return f"a key of type {type(key).__name__}"
        if type(entry) is not dcp_md.TensorStorageMetadata:
            return (f"{key!r} is a {type(entry).__name__} entry; a checkpoint holds tensors only "
                    "(DCP would unpickle a non-tensor entry with torch.load, which can run code)")
        if (type(entry.properties) is not dcp_md.TensorProperties or not isinstance(entry.properties.dtype, torch.dtype)
                or not _is_shape(entry.size)):
            return f"{key!r} has malformed tensor properties"
        for c in entry.chunks:
            if (type(c) is not dcp_md.ChunkStorageMetadata or not (_is_shape(c.offsets) and _is_shape(c.sizes))
                    or len(c.offsets) != len(entry.size) or len(c.sizes) != len(entry.size)
                    or any(o + s > n for o, s, n in zip(c.offsets, c.sizes, entry.size))):
                return f"{key!r} has a chunk outside its tensor"
    other = _fields_problem(md)
    if other:
        return other
    if not isinstance(md.storage_data, dict):
        return "its storage_data is not a mapping"
    for index, info in md.storage_data.items():
        if type(index) is not dcp_md.MetadataIndex or type(info) is not dcp_fs._StorageInfo:
            return "malformed storage entries"
        rel = info.relative_path
        if not isinstance(rel, str) or PurePath(rel).name != rel or rel in ("", ".", "..") or os.sep in rel:
            return f"{index.fqn!r} points at {rel!r}, which is not a file inside the checkpoint"
        if not all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length)):
            return f"{index.fqn!r} has a malformed offset/length"
        if info.transform_descriptors:
            return (f"{index.fqn!r} asks for load transforms {list(info.transform_descriptors)}, which Pentatron "
                    "never writes")
    return None


def _fields_problem(md: dcp_md.Metadata) -> str | None:
    """The index's other fields, as DCP writes them: a re-pickled index with, say, a path where its storage
    record belongs reached DCP's loader, which failed on it with a traceback (AttributeError)."""
    sm = md.storage_meta
    if sm is not None:
        if type(sm) is not dcp_md.StorageMeta:
            return f"its storage_meta is a {type(sm).__name__}, not DCP's storage record"
        if not (all(v is None or isinstance(v, (str, PurePath)) for v in (sm.checkpoint_id, sm.save_id, sm.load_id))
                and isinstance(sm.modules, list) and all(isinstance(m, str) for m in sm.modules)):
            return "its storage_meta holds fields of the wrong types"
    if md.version is not None and not isinstance(md.version, str):
        return f"its version is a {type(md.version).__name__}, not text"
    pd = md.planner_data
    if pd is not None and not (isinstance(pd, dict) and all(
            isinstance(k, str) and isinstance(v, (list, tuple)) and all(isinstance(x, (str, int)) for x in v)
            for k, v in pd.items())):
        return "its planner_data is not a mapping of key paths"
    return None


def _is_shape(t: Any) -> bool:
    return isinstance(t, torch.Size) and all(isinstance(v, int) and v >= 0 for v in t)


class SafeReader(FileSystemReader):
    """DCP's file-system reader with the checked index: `dcp.load(state, storage_reader=SafeReader(d))`.

    The index is read and checked here, before DCP starts (DCP catches a failing `read_metadata`, logs it
    with a traceback and falls back to per-rank files; this one takes no arguments, so it never does)."""

    def __init__(self, directory: Path | str) -> None:
        super().__init__(str(directory))
        self._metadata = read_metadata(Path(directory))

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and Path(checkpoint_id) != Path(self.path):
            raise ValueError("SafeReader reads the directory it was made for: pass no checkpoint_id to dcp.load")
        super().reset()

    def read_metadata(self) -> dcp_md.Metadata:  # type: ignore[override]
        md = self._metadata
        if md.storage_meta is None:
            md.storage_meta = dcp_md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
