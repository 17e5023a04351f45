"""Which checkpoint a run resumes, verified before any tensor is read.

The candidates are the checkpoint `latest` names, then (for `checkpoint.fallback = true`) the older
complete ones, newest first; `checkpoint convert` may name one step directory instead. For each candidate
in turn every rank checks its share of the files against the manifest (reading a large checkpoint back is
the slow part, so the ranks divide it), the first failing rank's message is shared, and rank 0 checks
meta.json (its step against the directory's name) and the saved model config against this run's, then
tells every rank what to do (`share_text`). A damaged checkpoint is an error naming the file; with
fallback the run instead resumes from the newest older checkpoint that verifies, saying which it skipped.
A checkpoint of another model is always an error (an older one would be too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pentatron.checkpoint import manifest
from pentatron.checkpoint.errors import CheckpointError
from pentatron.checkpoint.lineage import complete_checkpoints, read_latest, resume_options

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


def checked_meta(path: Path) -> dict[str, Any]:
    """The checkpoint's meta.json, its step agreeing with the directory's name; raises `CheckpointError`."""
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


def step_name(resume_from: str) -> str:
    """`checkpoint.resume_from` as a step directory's name ("120" → step_00000120)."""
    return f"{_NAME_PREFIX}{int(resume_from):08d}" if resume_from.isdigit() else resume_from


def candidates(root: Path, resume_from: str = "", fallback: bool = False) -> list[Path]:
    """Rank 0: the checkpoint to resume — `resume_from`, else what `latest` names — then the older complete
    ones, newest first ([]: the directory holds none). Never a guess: step checkpoints without a usable
    `latest` are a `CheckpointError` naming the newest and the options (fallback=true takes the newest)."""
    complete = complete_checkpoints(root) if root.is_dir() else []
    if resume_from:
        name = step_name(resume_from)
        if not (root / name / "meta.json").is_file():
            raise CheckpointError(f"checkpoint.resume_from={resume_from!r}: {root / name} is not a complete "
                                  f"checkpoint; {resume_options(root)}")
    else:
        name = read_latest(root) if root.is_dir() else None
        if name is None:
            if complete and not fallback:
                raise CheckpointError(f"{root} holds step checkpoints but no `latest` pointer, so which one to "
                                      f"resume is not known; {resume_options(root)}")
            return [c.path for c in reversed(complete)]
    return [root / name, *[c.path for c in reversed(complete) if c.path.name != name]]


def resume_target(root: Path, model: dict[str, Any], fallback: bool, comm: Any, rank: int,
                  device: torch.device, resume_from: str = "") -> Path | None:
    """Every rank: the checkpoint of `root` to resume (None: start fresh), verified by all. A rejected
    checkpoint raises `CheckpointError` on every rank (rank 0's message names the file)."""
    listing = ""
    if rank == 0:
        try:
            listing = json.dumps([str(p) for p in candidates(root, resume_from, fallback)])
        except CheckpointError as e:
            listing = json.dumps({"error": str(e)})
    found = json.loads(share_text(comm, rank, device, listing))
    if isinstance(found, dict):
        raise CheckpointError(found["error"])
    return agreed_checkpoint([Path(p) for p in found], model, fallback, comm, rank, device)


def agreed_checkpoint(paths: list[Path], model: dict[str, Any], fallback: bool | None, comm: Any, rank: int,
                      device: torch.device) -> Path | None:
    """Every rank: the first of `paths` (the checkpoint asked for, then older ones to fall back on) that
    verifies, or None when `paths` is empty. `fallback`: None when there is nothing to fall back on."""
    notes: list[str] = []
    for i, path in enumerate(paths):
        damage = _damage(path, comm, rank, device)
        verdict = _judge(paths, i, damage, model, fallback) if rank == 0 else ""
        kind, _, text = share_text(comm, rank, device, verdict).partition(":")
        if kind == "error":
            raise CheckpointError(text)
        if kind == "skip":
            notes.append(text)
        if kind == "ok":
            if rank == 0:
                for note in notes:
                    print(f"pentatron: {note}; resuming from {path.name} (checkpoint.fallback=true)", flush=True)
            return path
    if not paths:
        return None
    raise CheckpointError(f"{paths[0]}: damaged and no older checkpoint in {paths[0].parent} verifies "
                          f"({'; '.join(notes)})")


def _damage(path: Path, comm: Any, rank: int, device: torch.device) -> str | None:
    """Every rank: the first failing rank's message on checking its share of `path`'s files (None: intact)."""
    world = comm.ctx.world_size
    mine = None
    if not path.is_dir():
        mine = f"{path}: missing (named by {path.parent / 'latest'})"
    else:
        try:
            manifest.verify(path, share=(rank, world))
        except CheckpointError as e:
            mine = str(e)
    first = torch.tensor([rank if mine else world], dtype=torch.int64, device=device)
    comm.all_reduce(first, "world", op="min")
    src = int(first.item())
    return None if src == world else share_text(comm, rank, device, mine or "", src=src)


def _judge(paths: list[Path], i: int, damage: str | None, model: dict[str, Any], fallback: bool | None) -> str:
    """Rank 0: what to do with candidate `paths[i]` — "ok:", "next:" (not older than the target), "skip:<note>"
    (damaged, falling back) or "error:<message>"."""
    path, target = paths[i], paths[0]
    problem, meta = damage, None
    if problem is None:
        try:
            meta = checked_meta(path)
        except CheckpointError as e:
            problem = str(e)
    if problem is not None:
        if fallback:
            return f"skip:skipped damaged checkpoint: {problem}"
        if fallback is None:
            return f"error:{problem}"
        alt = f" ({paths[1].name})" if len(paths) > 1 else ""
        return (f"error:{problem}; restore it, or set checkpoint.fallback=true to resume from the previous good "
                f"checkpoint{alt}")
    assert meta is not None
    if i > 0 and meta["step"] >= _step_of(target):
        return "next:"  # fall back only to older states
    mismatch = model_mismatch(path, meta, model)
    return f"error:{mismatch}" if mismatch else "ok:"


def _step_of(path: Path) -> int:
    digits = path.name[len(_NAME_PREFIX):].split("-r")[0]
    return int(digits) if digits.isdigit() else 1 << 62


def share_text(comm: Any, rank: int, device: torch.device, text: str, src: int = 0) -> str:
    """Rank `src`'s `text` on every rank (through the comm layer: a length, then the UTF-8 bytes)."""
    data = torch.tensor(list(text.encode()) if rank == src else [], dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    comm.broadcast(length, "world", src=src)
    if rank != src:
        data = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if data.numel():
        comm.broadcast(data, "world", src=src)
    return bytes(data.cpu().tolist()).decode()
