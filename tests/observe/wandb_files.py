"""Reads an offline W&B run's transaction log (`run-<id>.wandb`) back, independently of the code that wrote it:
W&B keeps no Python reader of it. The file is W&B's header (":W&B", a 2-byte magic, a version byte) and then the
LevelDB log format: 32 KiB blocks of chunks (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last)
that join into serialized `wandb_internal_pb2.Record` messages."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending, out = _HEADER, b"", []
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # a block's tail too short for a chunk header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        pos += _HEADER
        chunk, pos = data[pos:pos + length], pos + length
        if kind == 0:  # zero fill at the end of a block
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _value(item: Any) -> Any:
    kind = item.WhichOneof("value") if "value" in item.DESCRIPTOR.oneofs_by_name else None
    if kind is None or kind == "value_json":
        return json.loads(item.value_json)
    return getattr(item, kind)


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def history(path: Path) -> dict[int, dict[str, Any]]:
    """step → {key: value} of every logged history row."""
    rows = {}
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            row = {_key(i): _value(i) for i in r.history.item}
            rows[int(row["_step"])] = row
    return rows


def config(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind in ("run", "config"):  # the config passed to init rides on the run record
            items = r.run.config.update if kind == "run" else r.config.update
            out.update({_key(i): json.loads(i.value_json) for i in items})
    return out


def summary(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in records(path):
        if r.WhichOneof("record_type") == "summary":
            out.update({_key(i): json.loads(i.value_json) for i in r.summary.update})
    return out
