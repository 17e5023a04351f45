"""Weights & Biases (optional: `pip install 'pentatron[wandb]'`, `log.wandb = true`): rank 0 sends W&B what it
writes to TensorBoard — the same flattened scalars of each step's record (`metrics.MetricsLogger`), validation
included — plus the resolved config at start and the run summary's numbers at the end.

The W&B run lives in `<run dir>/wandb` and its id is derived from the run directory, so a run resumed from its
checkpoint (which continues in the same run directory) continues the same W&B run online (offline, each start
writes its own offline-run directory under that id). Steps a resume redoes after its checkpoint were already
sent, with the same values (resume is exact): W&B keeps the first copy.
`WANDB_MODE=offline` (or `log.wandb_mode = "offline"`) writes the run to disk only; `wandb sync` uploads it later.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'pentatron[wandb]'"


def wandb_problem(enabled: bool) -> str | None:
    """The preflight check: W&B asked for but not installed (found without importing it: ~2 s)."""
    if enabled and importlib.util.find_spec("wandb") is None:
        return (f"log.wandb = true but the wandb package is not installed: {INSTALL_HINT} "
                "(or set log.wandb = false)")
    return None


def run_id(run_dir: Path) -> str:
    """A W&B run id per run directory (W&B ids: letters and digits)."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


class WandbSetupError(RuntimeError):
    """W&B refused to start the run (no login for an online run, ...): one line, exit 2."""


class WandbRun:
    """Rank 0's W&B run: `log` each step's scalars, `finish` with the summary (or as failed)."""

    def __init__(self, run_dir: Path, project: str, name: str, mode: str, config: dict[str, Any]) -> None:
        import wandb

        try:
            self._run = wandb.init(
                project=project, name=name or Path(run_dir).name, dir=str(run_dir), id=run_id(run_dir),
                resume="allow", mode=mode or None, config=config,
                # the trainer's console is its own (rows, bars, the summary): W&B does not wrap stdout
                settings=wandb.Settings(console="off"))
        except wandb.errors.Error as e:  # e.g. online without a login: W&B says so before any upload
            raise WandbSetupError(
                f"log.wandb: W&B could not start the run ({type(e).__name__}: {e}); run `wandb login` or set "
                "WANDB_API_KEY, or log offline (log.wandb_mode = \"offline\" or WANDB_MODE=offline; `wandb sync` "
                "uploads the run later)") from None
        # The next step W&B accepts: on a resumed W&B run, after the last one it holds.
        self._next = self._run.step

    @property
    def directory(self) -> str:
        return str(self._run.dir)

    def log(self, step: int, scalars: list[tuple[str, float]]) -> None:
        if step < self._next or not scalars:
            return  # a step redone after a resume: W&B already has it (the same values)
        self._run.log(dict(scalars), step=step)
        self._next = step + 1

    def finish(self, summary: list[tuple[str, float]] | None) -> None:
        """End the run: with the run summary's numbers when it completed, else marked failed (exit code 1)."""
        if self._run is None:
            return
        if summary is not None:
            self._run.summary.update(dict(summary))
        import wandb

        run, self._run = self._run, None
        code = 0 if summary is not None else 1
        run.finish(exit_code=code)
        # finish() leaves the writing to W&B's service process: wait for it, so that the run is complete on disk
        # (offline) or uploaded when the trainer's process ends (its atexit hook is unreliable under launchers)
        wandb.teardown(exit_code=code)
