"""The one verification every reader of a checkpoint goes through (`generate`, `checkpoint export-hf`, and
through `resume.agreed_checkpoint` also resume and `checkpoint convert`): the step directory a path names
(never guessed: a checkpoint.dir's `latest` read strictly), every file against the manifest's sizes and
CRC-32s, meta.json against the directory's name and holding a model config; the tensors' finiteness is
checked once they are read (`nonfinite_names`), so nothing non-finite is used or written onwards.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from pentatron.checkpoint import manifest
from pentatron.checkpoint.errors import CheckpointError
from pentatron.checkpoint.lineage import complete_checkpoints, read_latest
from pentatron.checkpoint.resume import checked_meta


def step_dir_of(path: Path) -> Path:
    """`path` itself when it is a step directory, else the one its `latest` names."""
    if (path / "meta.json").is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint: no such directory")
    name = read_latest(path)
    if name is None:
        found = complete_checkpoints(path)
        hint = f"; give one of its step directories, e.g. {found[-1].path}" if found else ""
        raise CheckpointError(f"{path} is not a checkpoint: expected a step directory with meta.json, or a "
                              "checkpoint.dir holding a `latest` pointer (written by `pentatron train` with "
                              f"checkpoint.dir set){hint}")
    step = path / name
    if not (step / "meta.json").is_file():
        raise CheckpointError(f"{path / 'latest'} names {step}, which is not a complete checkpoint")
    return step


def verified_step_dir(path: Path) -> Path:
    """The step directory `path` names, its files and meta.json verified; raises `CheckpointError`."""
    step = step_dir_of(path)
    manifest.verify(step)
    meta = checked_meta(step)
    if not isinstance(meta.get("model"), dict):
        raise CheckpointError(f"{step / 'meta.json'}: holds no model config (\"model\"); not a checkpoint of "
                              "`pentatron train`, or edited")
    return step


def nonfinite_names(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors of `named` that hold a NaN or an infinity."""
    return [n for n, t in named if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def refuse_nonfinite(where: Path, named: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """A `CheckpointError` naming the first non-finite tensors of `named` (read from `where`)."""
    bad = nonfinite_names(named)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise CheckpointError(f"{where}: {', '.join(bad[:3])}{more} {'holds' if len(bad) == 1 else 'hold'} NaN or "
                              f"infinite values; {what}")
