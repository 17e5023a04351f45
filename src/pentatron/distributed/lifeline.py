"""No rank outlives its launcher.

A signal to `pentatron train --nproc N` (or to an outer torchrun) is handled by torch's elastic agent:
it sends SIGTERM to every rank's process group (each rank runs in its own session), waits, then
SIGKILLs, and the launcher exits 128 + the signal (143 for SIGTERM). What the agent cannot do is act
after it was SIGKILLed (or OOM-killed): its ranks would go on training and writing checkpoints
unsupervised. So each rank started by an elastic agent asks the Linux kernel to SIGKILL it when its
parent dies (`PR_SET_PDEATHSIG`). SIGKILL rather than SIGTERM: nobody is left to report to, and a rank
blocked in a collective would not run a Python handler; a save cut short leaves only a `.tmp`
directory, removed at the next start, and the checkpoint directory's lock dies with rank 0.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """Under a torchelastic agent on Linux: be SIGKILLed when the agent dies. Returns whether it is armed.
    If the agent already died before the request took effect (this process was re-parented), exit now."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent == 1 or os.getppid() != parent:
        os._exit(128 + int(signal.SIGKILL))
    return True
