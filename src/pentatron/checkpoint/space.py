"""Will the checkpoints fit? The predicted size of one checkpoint, and the checkpoint directory's
writability and free space, checked before any step (preflight) instead of at the first save; and when a
save did not fit after all, its one-line message (`write_failure`).

A checkpoint holds, per parameter, the model's copy (fp32, or bf16 with an fp32 master beside it) and
AdamW's two fp32 moments; each rank writes its part, so the total does not depend on the layout (a
tied embedding held by two pipeline stages is written twice, which the margin absorbs). DCP metadata,
meta.json and the manifest are small.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from pentatron.checkpoint.lineage import latest_name

PROBE_PREFIX = ".pentatron-write-probe-"  # a writability probe's directory, there for a moment
_MARGIN = 1.05  # metadata, a duplicated tied embedding, file-system blocks


def predicted_checkpoint_bytes(num_params: int, param_dtype: torch.dtype) -> int:
    state = 8 if param_dtype == torch.float64 else 4  # fp32 state; fp64 in an fp64 run
    per_param = 3 * state  # the values (model or master) and AdamW's exp_avg, exp_avg_sq
    if param_dtype not in (torch.float32, torch.float64):
        per_param += torch.finfo(param_dtype).bits // 8  # the low-precision model copy beside the master
    return int(num_params * per_param * _MARGIN)


def existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def writable_problem(root: Path, what: str = "checkpoint.dir") -> str | None:
    """Try what a save does (create a directory and a file in it); root ignores permission bits, so
    `os.access` is not enough. `what`: the setting named in the message."""
    base = root if root.is_dir() else existing_ancestor(root)
    probe = base / f"{PROBE_PREFIX}{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        (probe / "f").write_bytes(b"x")
    except OSError as e:
        return (f"{what} {str(root)!r} is not writable ({e.strerror} at {base}); fix its permissions or "
                f"choose another {what}")
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None


def space_problem(root: Path, keep: int, checkpoint_bytes: int, slots: int | None = None) -> str | None:
    """(keep + 1) checkpoints must fit: `keep` kept plus the one being written before the oldest goes;
    `slots`: how many of those still need room (fewer when a resumed run's checkpoints are there)."""
    base = root if root.is_dir() else existing_ancestor(root)
    free = shutil.disk_usage(base).free
    need = (keep + 1 if slots is None else max(slots, 1)) * checkpoint_bytes
    if free >= need:
        return None
    return (f"checkpoint.dir {str(root)!r} has {_gb(free)} free but {_gb(need)} is needed: (checkpoint.keep + 1) "
            f"checkpoints of {_gb(checkpoint_bytes)} (predicted for this model); free space, lower "
            "checkpoint.keep, or choose another checkpoint.dir")


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def directory_problems(root: Path, keep: int, checkpoint_bytes: int, slots: int | None = None) -> list[str]:
    problem = writable_problem(root)
    if problem is None:
        problem = space_problem(root, keep, checkpoint_bytes, slots)
    return [problem] if problem else []


def state_bytes(state: dict[str, Any]) -> int:
    """This rank's bytes of a save's tensors (`state`: part → key → tensor)."""
    return sum(t.numel() * t.element_size() for part in state.values() for t in part.values()
               if isinstance(t, torch.Tensor))


def write_failure(directory: Path, step: int, e: BaseException, rank_bytes: int) -> str:
    """One line for a failed save of `step` into `directory`: the root cause found in DCP's per-rank
    failures and exception chains, with the free space when the disk is (or looks) full."""
    cause = _root_cause(e)
    stays = latest_name(directory.parent) or ("unreadable" if (directory.parent / "latest").exists() else "none")
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    except OSError:
        free = None
    err = getattr(cause, "errno", None)
    if err == errno.ENOSPC or err == errno.EDQUOT or (free is not None and free < rank_bytes):
        what = "quota exceeded" if err == errno.EDQUOT else "no space left"
        have = f"{free / 2**20:,.0f} MiB free" if free is not None else "free space unknown"
        why = f"{what}: {have}, this rank's part of the checkpoint needs ≈ {rank_bytes / 2**20:,.1f} MiB"
    elif err in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = f"{os.strerror(err).lower()} (fix the directory's permissions or choose another checkpoint.dir)"
    else:
        why = f"{type(cause).__name__}: {cause}".splitlines()[0]
    return f"checkpoint of step {step} not saved in {directory.parent} ({why}); latest stays {stays}"


def _root_cause(e: BaseException) -> BaseException:
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        e = sorted(failures.items())[0][1][0]
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        nxt = e.__cause__ or e.__context__
        if nxt is None:
            break
        e = nxt
    return e
