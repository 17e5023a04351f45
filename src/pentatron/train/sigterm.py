"""checkpoint.save_on_sigterm: a SIGTERM (or Ctrl-C's SIGINT) ends the run at the next step boundary, with a
checkpoint.

A scheduler's preemption notice, or the launcher's (torchrun's elastic agent forwards a SIGTERM it
receives to every rank, then waits 30 s before SIGKILL), reaches every rank — but not at the same point of
a step. Each rank's handler only records it; at the end of every step the ranks agree (the largest
signal count over the world, one 4-byte all-reduce), so that all of them stop after the same step, save
it together and exit 128 + 15 = 143 (130 after a Ctrl-C). Ctrl-C reaches the launcher and every rank of
the terminal's process group; the agent then forwards a SIGINT again: each is noted, none aborts (the agent
SIGKILLs ranks that have not finished 30 s after its signal). Without the option the default actions stand:
the ranks stop at once and a resume starts from the last periodic checkpoint.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch

EXIT_CODE = 128 + int(signal.SIGTERM)
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Terminated(Exception):  # noqa: N818 - a stop, not an error
    """Every rank stopped after the same step on a SIGTERM or SIGINT (its checkpoint saved when one is due).
    `exit_code`: 128 + this rank's first signal (SIGTERM's for a rank stopped by the others' agreement)."""

    def __init__(self, message: str, exit_code: int = EXIT_CODE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class SigtermWatch:
    def __init__(self) -> None:
        self.first: signal.Signals | None = None  # this rank's first SIGTERM or SIGINT (None: none yet)
        self._previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():  # signals reach only the main thread
            self._previous = {sig: signal.signal(sig, self._note) for sig in SIGNALS}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.first = self.first or signal.Signals(signum)

    def stopped(self, step: int, where: str) -> Terminated:
        """What every rank raises once they agreed to stop after `step`."""
        sig = self.first or signal.SIGTERM
        return Terminated(f"stopped by {sig.name} after step {step}, saved in {where}", 128 + int(sig))

    def agreed(self, comm: Any, world_size: int, device: torch.device) -> bool:
        """Every rank: whether any rank has received a SIGTERM or SIGINT (the same answer everywhere)."""
        if world_size == 1:
            return self.first is not None
        flag = torch.tensor([float(self.first is not None)], device=device)
        comm.all_reduce(flag, "world", op="max")
        return bool(flag.item())

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
