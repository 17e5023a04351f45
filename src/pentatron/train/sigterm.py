"""checkpoint.save_on_sigterm: a SIGTERM ends the run at the next step boundary, with a checkpoint.

A scheduler's preemption notice, or the launcher's (torchrun's elastic agent forwards a SIGTERM it
receives to every rank, then waits 30 s before SIGKILL), reaches every rank — but not at the same point of
a step. Each rank's handler only records it; at the end of every step the ranks agree (the largest
signal count over the world, one 4-byte all-reduce), so that all of them stop after the same step, save
it together and exit 128 + 15 = 143. Without the option the default action stands: the ranks stop at
once and a resume starts from the last periodic checkpoint.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch

EXIT_CODE = 128 + int(signal.SIGTERM)


class Terminated(Exception):  # noqa: N818 - a stop, not an error
    """Every rank stopped after the same step on a SIGTERM (its checkpoint saved when one is due)."""


class SigtermWatch:
    def __init__(self) -> None:
        self.received = 0
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():  # signals reach only the main thread
            self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1

    def agreed(self, comm: Any, world_size: int, device: torch.device) -> bool:
        """Every rank: whether any rank has received a SIGTERM (the same answer everywhere)."""
        if world_size == 1:
            return self.received > 0
        flag = torch.tensor([float(self.received > 0)], device=device)
        comm.all_reduce(flag, "world", op="max")
        return bool(flag.item())

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
