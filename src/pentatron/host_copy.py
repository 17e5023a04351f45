"""Host tensors onto the device without stalling the host.

A copy from pageable host memory is synchronous: on CUDA it waits for the work already queued on the stream
(at a step's start: the last step's optimizer), so the host cannot queue the next forward meanwhile; gpu_check
counted 4 such syncs per step on an H200 (2026-12-04). Through pinned memory the copy is asynchronous: torch's
pinned-memory allocator keeps the pinned buffer until the copy has run."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`: pinned and asynchronous from the host to a CUDA device, a plain move otherwise."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
