"""Which checkpoints belong to which run, so that retention deletes only the run's own old ones.

Every checkpoint's meta.json records `run_id`, the id of its *lineage*: the chain of jobs that continued
one another by resuming. A job resuming the newest checkpoint of a lineage continues that lineage (and
its retention); a fresh run, or a rollback (resuming a checkpoint older than its lineage's newest),
starts a new lineage whose `parent` is the checkpoint it started from — so a rollback never deletes the
abandoned branch, and a new run never deletes an older run's checkpoints.

Retention (`prune`) keeps the newest `keep` complete checkpoints of one lineage, never removes the one
`latest` names, and never touches checkpoints of other lineages or without a recorded lineage.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pentatron.checkpoint.errors import CheckpointError

_NAME = re.compile(r"^step_(\d+)(?:-r(\d+))?$")


@dataclass(frozen=True)
class SavedCheckpoint:
    path: Path
    step: int
    resave: int  # N of a `step_X-rN` directory (the same step written again), 0 otherwise
    run_id: str | None  # None: written before lineages were recorded (never pruned)


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def read_meta(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def complete_checkpoints(root: Path) -> list[SavedCheckpoint]:
    """Every published checkpoint directory under `root` (a readable meta.json), oldest step first."""
    out = []
    for p in root.glob("step_*"):
        m = _NAME.match(p.name)
        if m is None or not p.is_dir():
            continue
        meta = read_meta(p)
        if meta is None:
            continue
        run_id = meta.get("run_id")
        out.append(SavedCheckpoint(p, int(m.group(1)), int(m.group(2) or 0),
                                   run_id if isinstance(run_id, str) else None))
    return sorted(out, key=lambda c: (c.step, c.resave))


def latest_name(root: Path) -> str | None:
    """What `latest` names, or None when it names nothing readable (`read_latest` is the strict reading)."""
    pointer = root / "latest"
    try:
        return pointer.read_text().strip() if pointer.is_file() else None
    except (OSError, ValueError):  # ValueError: not UTF-8
        return None


def read_latest(root: Path) -> str | None:
    """The step directory `root/latest` names (None: there is no pointer); a pointer that is not a small
    text file naming a step directory is a `CheckpointError` (never guessed around)."""
    pointer = root / "latest"
    if not pointer.exists() and not pointer.is_symlink():
        return None
    if not pointer.is_file():
        raise CheckpointError(f"{pointer}: is not the `latest` pointer file (a directory or a dangling link?); "
                              f"{resume_options(root)}")
    try:
        name = pointer.read_bytes()[:4096].decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{pointer}: unreadable ({type(e).__name__}); {resume_options(root)}") from None
    if _NAME.match(name) is None:
        raise CheckpointError(f"{pointer}: names {name[:40]!r}, not a step directory; {resume_options(root)}")
    return name


def resume_options(root: Path) -> str:
    """What a user can do when `root`'s `latest` is missing or unusable."""
    found = complete_checkpoints(root) if root.is_dir() else []
    newest = f" (the newest complete one is {found[-1].path.name})" if found else ""
    step = found[-1].path.name if found else "STEP"
    return (f"resume a step directory with --resume-from {step}{newest}, set checkpoint.fallback=true to resume "
            "the newest one that verifies, or start a new run beside them with --force-new")


def continued_run_id(root: Path, resumed: Path, saved_meta: dict[str, Any]) -> tuple[str, str | None]:
    """(run id, parent) for a job resuming `resumed`: the checkpoint's lineage when it is that lineage's
    newest checkpoint, else a new lineage (a rollback) whose parent is `resumed`."""
    run_id = saved_meta.get("run_id")
    if isinstance(run_id, str):
        mine = [c for c in complete_checkpoints(root) if c.run_id == run_id]
        if mine and mine[-1].path.name == resumed.name:
            return run_id, saved_meta.get("parent")
    return new_run_id(), resumed.name


def prune(root: Path, run_id: str, keep: int) -> list[Path]:
    """Remove all but the newest `keep` checkpoints of lineage `run_id`, never the one `latest` names;
    returns what was removed."""
    protected = latest_name(root)
    mine = [c for c in complete_checkpoints(root) if c.run_id == run_id]
    removed = []
    for c in mine[: max(len(mine) - keep, 0)]:
        if c.path.name == protected:
            continue
        shutil.rmtree(c.path, ignore_errors=True)
        removed.append(c.path)
    return removed


def remove_stale_partials(root: Path) -> list[Path]:
    """Remove `step_*.tmp` directories and a `latest.tmp` left by a job that died while saving (call
    with the directory's lock held, so no running job's save is removed)."""
    removed = []
    for p in root.glob("step_*.tmp"):
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    pointer_tmp = root / "latest.tmp"
    if pointer_tmp.is_file():
        pointer_tmp.unlink(missing_ok=True)
        removed.append(pointer_tmp)
    return removed


def fresh_run_problem(root: Path) -> str | None:
    """A fresh run (checkpoint.resume=false) must not write into a directory that holds another run's
    checkpoints: `latest` would be repointed and the user may have meant to resume."""
    if not root.is_dir():
        return None
    found = complete_checkpoints(root)
    latest = latest_name(root)
    if not found and latest is None:
        return None
    what = f"latest = {latest}" if latest else f"{len(found)} checkpoint(s), newest {found[-1].path.name}"
    return (f"checkpoint.dir {str(root)!r} already holds checkpoints ({what}) and checkpoint.resume=false; "
            "resume them (checkpoint.resume=true), choose another checkpoint.dir, or start a new run "
            "beside them with --force-new (checkpoint.force_new=true; their checkpoints are kept)")
