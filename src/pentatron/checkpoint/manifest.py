"""A checkpoint's manifest: every file with its size and CRC-32, written last, before `latest` moves.

`write` runs on rank 0 once every rank's DCP files and meta.json are in the `.tmp` directory; only then
is it renamed and pointed to, so a published checkpoint always carries one. Reading every file back is
the cost of a manifest (a 70B model with AdamW state is ~1 TB), so in a synchronous save every rank first
checksums its share of the files (`write_share`: every world-th file) and rank 0 only merges the shares
(and checksums what no share covers: meta.json, or everything after an async save). `verify` names the first
file that is missing, truncated or altered (a flipped bit, an edited meta.json). CRC-32 (zlib) finds
accidental damage at several GB/s; it is not a defence against deliberate tampering. Checkpoints
written before manifests existed (meta.json without `manifest`) are accepted unverified.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

from pentatron.checkpoint.errors import CheckpointError

MANIFEST = "manifest.json"
SHARES_DIR = "manifest.shares"
_CHUNK = 8 << 20


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*")
                  if p.is_file() and p.name != MANIFEST and p.parent.name != SHARES_DIR)


def _record(path: Path) -> dict[str, int]:
    return {"size": path.stat().st_size, "crc32": crc32_of(path)}


def write_share(root: Path, rank: int, world: int) -> None:
    """Every rank, once every rank's files are written: the records of its share of them (every world-th
    file in name order) in `root/manifest.shares/rank<r>.json`, for `write` to merge."""
    share = {str(p.relative_to(root)): _record(p) for p in _files(root)[rank::world]}
    (root / SHARES_DIR).mkdir(exist_ok=True)
    (root / SHARES_DIR / f"rank{rank}.json").write_text(json.dumps(share))


def write(root: Path) -> dict[str, Any]:
    """Record every file under `root` (size, crc32) in `root/manifest.json`, taking the records the ranks'
    shares hold (when the file's size still agrees) and checksumming the rest; returns the manifest."""
    known: dict[str, dict[str, int]] = {}
    for share in sorted((root / SHARES_DIR).glob("rank*.json")):
        known.update(json.loads(share.read_text()))
    shutil.rmtree(root / SHARES_DIR, ignore_errors=True)
    files = {}
    for p in _files(root):
        name = str(p.relative_to(root))
        rec = known.get(name)
        files[name] = rec if rec is not None and rec["size"] == p.stat().st_size else _record(p)
    manifest = {"version": 1, "files": files}
    tmp = root / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)
    return manifest


def verify(root: Path, share: tuple[int, int] = (0, 1)) -> None:
    """Raise `CheckpointError` naming the first damaged, missing or truncated file of checkpoint `root`.
    `share` = (rank, ranks): check only every ranks-th file from the rank-th (the ranks of a resume
    divide the reading); the manifest itself is checked by every share."""
    path = root / MANIFEST
    if not path.is_file():
        meta = root / "meta.json"
        try:
            expected = bool(json.loads(meta.read_text()).get("manifest"))
        except (OSError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{meta}: unreadable ({type(e).__name__}: {e})") from None
        if expected:
            raise CheckpointError(f"{path}: missing (the checkpoint is incomplete or was altered)")
        return  # written before manifests existed
    try:
        files = json.loads(path.read_text())["files"]
        items = [(name, int(rec["size"]), int(rec["crc32"])) for name, rec in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    rank, ranks = share
    for name, size, crc in sorted(items)[rank::ranks]:
        f = root / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (listed in {MANIFEST})")
        actual = f.stat().st_size
        if actual != size:
            raise CheckpointError(f"{f}: {actual} bytes, the manifest says {size} (truncated or overwritten)")
        try:
            same = crc32_of(f) == crc
        except OSError as e:  # e.g. mode 000: the first read of the file, so said here, naming it
            raise CheckpointError(f"{f}: cannot be read ({e.strerror or e}); make the checkpoint readable "
                                  f"(chmod -R u+r {root})") from None
        if not same:
            raise CheckpointError(f"{f}: checksum mismatch (the file was altered or is corrupt)")
