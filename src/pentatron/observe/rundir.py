"""One directory per run: `<log.dir>/<YYYYmmdd-HHMMSS>` (metrics.jsonl, tensorboard/, summary.json,
config.json), so that two runs of one config never mix their logs; `<log.dir>/latest` links the newest.

A run that resumes from a checkpoint continues in the directory of the run that wrote it (recorded in
`<checkpoint.dir>/run.json`), and its logs continue without repeating steps (see MetricsLogger).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pentatron.config import Config

RUN_INFO = "run.json"  # in checkpoint.dir: which run directory and dataset its checkpoints belong to


@dataclass(frozen=True)
class RunDir:
    path: Path
    resumed: bool  # continues the logs of the run whose checkpoint it resumes


def resolve_run_dir(cfg: Config) -> RunDir:
    """The directory this run logs to, created; called once per run (by the launcher or rank 0)."""
    ck = cfg.checkpoint
    if ck.dir and ck.resume and (Path(ck.dir) / "latest").is_file():
        info = read_run_info(Path(ck.dir))
        if info is not None and Path(info.get("run_dir", "")).is_dir():
            return RunDir(Path(info["run_dir"]), resumed=True)
    base = Path(cfg.log.dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = base / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir(parents=True)  # never exist_ok: two runs started in the same second differ
        except FileExistsError:
            continue
        return RunDir(path, resumed=False)
    raise RuntimeError(f"could not create a fresh run directory under {base}")


def read_run_info(checkpoint_dir: Path) -> dict[str, Any] | None:
    path = Path(checkpoint_dir) / RUN_INFO
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def record_run(cfg: Config, run_dir: RunDir, dataset_dir: Path | None, world_size: int) -> None:
    """Rank 0, before training: the resolved config in the run directory (`Config.resolved_dict`: no
    model field left null), `<log.dir>/latest`, and the checkpoint directory's pointer back to this run
    (for resume and `pentatron generate`)."""
    path = run_dir.path
    (path / "config.json").write_text(json.dumps(cfg.resolved_dict(world_size), indent=1))
    _link_latest(path)
    if cfg.checkpoint.dir:
        ck = Path(cfg.checkpoint.dir)
        ck.mkdir(parents=True, exist_ok=True)
        info = {"run_dir": str(path.resolve()), "dataset": str(Path(dataset_dir).resolve()) if dataset_dir else None,
                "model": cfg.model_config().to_dict()}
        tmp = ck / (RUN_INFO + ".tmp")
        tmp.write_text(json.dumps(info, indent=1))
        os.replace(tmp, ck / RUN_INFO)


def _link_latest(path: Path) -> None:
    link, tmp = path.parent / "latest", path.parent / ".latest.tmp"
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(path.name, target_is_directory=True)
        os.replace(tmp, link)
    except OSError:
        pass  # a convenience only (e.g. no symlinks on this file system)
