"""While profiling, the comm layer returns only once the backend has let go of an op's CPU tensors.

torch.profiler's memory events come from the thread that allocates or frees: the CPU allocator reports to
the profiler only on a thread that carries its state, and gloo's worker threads do not. gloo runs each
collective on a worker thread that keeps the op's work, and with it the op's tensors, for a moment after
`wait()` has returned on the caller's thread. When the caller drops its last reference first, the buffer is
freed on gloo's thread: the profiler sees its allocation and never its free, and counts it live until the
profile ends. Which thread lets go last is a race, lost more often under CPU load: the profiled tensor peak
of a tp2 run grew by one phantom buffer per lost race (issue 46: 13.7 MB against 12.1 MB predicted at load
11). So while profiling, the use count of each tensor handed to the backend is noted before the op is issued,
and after its wait the caller waits until the count is back: the buffer is then freed on the caller's
thread, where the profiler sees it (but rarely: docs/testing.md, "The profiled tensor peak").

CPU tensors only: on CUDA, NCCL keeps a collective's tensors until the GPU has run it and its watchdog thread
drops them; waiting for that would synchronise the host with the GPU (not done).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

Held = list[tuple[torch.Tensor, int]]

# The backend drops its references microseconds after the wait returns (or once its worker thread is
# scheduled again on a busy machine); a reference still held after this long is not the backend's.
RELEASE_TIMEOUT_S = 1.0


def note(tensors: Iterable[torch.Tensor | None]) -> Held:
    """The op's CPU tensors with their use counts before the backend gets them."""
    return [(t, t._use_count()) for t in tensors if t is not None and t.device.type == "cpu"]


def wait_released(held: Held, timeout_s: float = RELEASE_TIMEOUT_S) -> bool:
    """Wait until no tensor of `held` has more references than before the op was issued; False when one
    still had more after `timeout_s` (something other than the backend took a reference meanwhile)."""
    deadline = None
    for t, count in held:
        while t._use_count() > count:
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout_s
            elif now > deadline:
                return False
            time.sleep(1e-5)  # give the core to the backend's worker thread (a spin would compete with it)
    return True
