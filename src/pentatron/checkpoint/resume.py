"""Which checkpoint a run resumes, verified before any tensor is read.

Rank 0 verifies the checkpoint `latest` names (its manifest, meta.json, the step in meta.json against
the directory's name, and the saved model config against this run's), and every rank then loads the one
it chose (`share_from_rank0`). A damaged checkpoint is an error naming the file; with
`checkpoint.fallback = true` the run instead resumes from the newest older checkpoint that verifies,
saying which it skipped. A checkpoint of another model is always an error (an older one would be too).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pentatron.checkpoint import manifest
from pentatron.checkpoint.errors import CheckpointError
from pentatron.checkpoint.lineage import complete_checkpoints, latest_name

_NAME_PREFIX = "step_"


def _read_meta(path: Path) -> dict[str, Any]:
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            raise ValueError("no integer 'step'")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: unreadable ({type(e).__name__}: {e})") from None
    return meta


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's meta.json once its files check out; raises `CheckpointError` naming the file."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: missing (named by {path.parent / 'latest'})")
    manifest.verify(path)
    meta = _read_meta(path)
    digits = path.name[len(_NAME_PREFIX):].split("-r")[0]
    if digits.isdigit() and int(digits) != meta["step"]:
        raise CheckpointError(f"{path / 'meta.json'}: says step {meta['step']} but the directory is step "
                              f"{int(digits)} (edited?)")
    return meta


def model_mismatch(path: Path, meta: dict[str, Any], model: dict[str, Any]) -> str | None:
    """The fields in which the saved model config differs from this run's (None: the same model)."""
    saved = meta.get("model")
    if not isinstance(saved, dict):
        return None  # very old checkpoints did not record it
    current = json.loads(json.dumps(model))  # tuples → lists, as saved
    # The shape decides; the name is a label (an imported Hugging Face model has none of ours).
    changed = sorted(k for k in set(saved) | set(current) if k != "name" and saved.get(k) != current.get(k))
    if not changed:
        return None
    return (f"{path / 'meta.json'}: the checkpoint holds another model "
            f"({', '.join(f'{k}={saved.get(k)!r} vs {current.get(k)!r} here' for k in changed)}); "
            "use the checkpoint's model settings, or another checkpoint.dir")


def select_checkpoint(root: Path, model: dict[str, Any], fallback: bool) -> tuple[Path, list[str]] | None:
    """Rank 0: the checkpoint to resume (None: nothing to resume) and notes on any skipped for damage."""
    name = latest_name(root)
    if name is None:
        return None
    target = root / name
    older = [c.path for c in reversed(complete_checkpoints(root)) if c.path.name != name]
    notes: list[str] = []
    for i, path in enumerate([target, *older]):
        try:
            meta = verify_checkpoint(path)
        except CheckpointError as e:
            if not fallback:
                alt = f" ({older[0].name})" if older else ""
                raise CheckpointError(f"{e}; restore it, or set checkpoint.fallback=true to resume from the "
                                      f"previous good checkpoint{alt}") from None
            notes.append(f"skipped damaged checkpoint: {e}")
            continue
        if i > 0 and meta.get("step", 0) >= _step_of(target):
            continue  # fall back only to older states
        problem = model_mismatch(path, meta, model)
        if problem:
            raise CheckpointError(problem)
        return path, notes
    raise CheckpointError(f"{target}: damaged and no older checkpoint in {root} verifies ({'; '.join(notes)})")


def _step_of(path: Path) -> int:
    digits = path.name[len(_NAME_PREFIX):].split("-r")[0]
    return int(digits) if digits.isdigit() else 1 << 62


def resume_target(root: Path, model: dict[str, Any], fallback: bool, comm: Any, rank: int,
                  device: torch.device) -> Path | None:
    """Every rank: the checkpoint to resume, chosen and verified by rank 0 (None: start fresh). A
    rejected checkpoint raises `CheckpointError` on every rank (rank 0's names the file)."""
    return agreed_checkpoint(lambda: select_checkpoint(root, model, fallback), comm, rank, device)


def select_named(path: Path, model: dict[str, Any]) -> tuple[Path, list[str]]:
    """Rank 0: one checkpoint directory named by the user (`step_XXXXXXXX`), verified like `latest`."""
    meta = verify_checkpoint(path)
    problem = model_mismatch(path, meta, model)
    if problem:
        raise CheckpointError(problem)
    return path, []


def agreed_checkpoint(choose: Callable[[], tuple[Path, list[str]] | None], comm: Any, rank: int,
                      device: torch.device) -> Path | None:
    """Every rank: the checkpoint rank 0's `choose()` picked (with notes on any it skipped), or None."""
    if rank == 0:
        try:
            chosen = choose()
        except CheckpointError as e:
            share_from_rank0(comm, rank, device, f"error:{e}")
            raise
        if chosen is not None:
            for note in chosen[1]:
                print(f"pentatron: {note}; resuming from {chosen[0].name} (checkpoint.fallback=true)", flush=True)
        verdict = share_from_rank0(comm, rank, device, "none:" if chosen is None else f"ok:{chosen[0]}")
    else:
        verdict = share_from_rank0(comm, rank, device, "")
    kind, _, text = verdict.partition(":")
    if kind == "error":
        raise CheckpointError(text)
    return None if kind == "none" else Path(text)


def share_from_rank0(comm: Any, rank: int, device: torch.device, text: str) -> str:
    """Rank 0's `text` on every rank (through the comm layer: a length, then the UTF-8 bytes)."""
    data = torch.tensor(list(text.encode()) if rank == 0 else [], dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    comm.broadcast(length, "world", src=0)
    if rank != 0:
        data = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if data.numel():
        comm.broadcast(data, "world", src=0)
    return bytes(data.cpu().tolist()).decode()
