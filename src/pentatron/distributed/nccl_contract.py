"""NCCL's contract, emulated on gloo at the `torch.distributed` boundary (strict mode).

`Comm` (distributed/comm.py) is the only caller of `torch.distributed`; in strict mode
(PENTATRON_STRICT_COMM=1, the tests' mode) it goes through these functions, so that code above the
comm layer meets, on gloo, the API shapes and rules it will meet on NCCL, and cannot tell the two apart:

a. One work per batch. `dist.batch_isend_irecv` runs an NCCL batch under `_coalescing_manager` and
   returns one work for the whole batch (`cm.works`); gloo returns one per op. `one_work` gives NCCL's
   shape on every backend (a `BatchWork` that waits on every gloo work of the batch), so `Comm.batch_p2p`
   hands its callers one handle per batch in every mode, not only in strict mode.
b. Issue order. Per communicator, NCCL completes batches and collectives in issue order, and a send
   completes only once the peer's receive runs. `Comm.batch_p2p` waits for its batch before returning
   in strict mode, so nothing is issued behind an unfinished batch, and gloo's sends (done only once
   the peer has posted the receive) then block as NCCL's may: a p2p order that would deadlock on NCCL
   hangs here too. Collectives are issued in the same order on every rank (the flight recorder's check
   mode verifies it), so gloo's out-of-order completion of async collectives changes nothing.
c. No CPU tensors. An NCCL group has no CPU backend: `Comm._check_device` refuses a tensor that is
   not on the run's device (`CommDeviceError`).
d. Communicator init is collective. NCCL creates a group's communicator lazily, at its first op, and
   every rank of the group must take part (torch's `batch_isend_irecv` docs: a batch that is a group's
   first op must involve all its ranks). `first_use` makes a group's first op on this rank a
   monitored barrier over the group, so a group first used by only some of its ranks fails, naming the
   missing ranks, instead of passing on gloo's lazily connected pairs. Stricter than torch's NCCL
   backend in one case, which the contract leaves undefined: a p2p batch as a group's first op (torch
   then opens a two-rank communicator for the pair). Only real gloo groups are joined: NCCL does it itself.
e. Asynchronous completion: not emulated. On NCCL `wait()` only orders the current stream after the
   op and returns at once; completion is seen by a later synchronising read (`.item()`, an event).
   On gloo `wait()` returns once the op is done. Deferring it would let the CPU compute on buffers not
   yet received (gloo has no stream to order them), and reads of a CPU tensor cannot be intercepted.
   What depends on it is tested on its own: the flight recorder marks an op done only when a device
   event recorded after the wait completes (tests/observe/test_device_truth.py, with a stand-in event),
   so the watchdog sees a collective hung on the GPU; the engine's timers use CUDA events on CUDA.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# How long a group's first op waits for every rank of the group to reach its own first op (d). Strict
# mode is the tests' mode, whose ranks start together: a longer lag is a rank that never comes, and
# this names it before the test harness's timeout (180 s) reports an anonymous hang.
FIRST_USE_TIMEOUT_S = 120.0


class CommFirstUseError(RuntimeError):
    """A group's first op was not joined by every rank of the group (strict mode, rule d)."""


class BatchWork:
    """One work for a whole batch (NCCL's shape), over the backend's works for its ops."""

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def one_work(works: Sequence[Any]) -> Any | None:
    """A single handle on a batch's works, whichever shape the backend returned them in."""
    if not works:
        return None
    return works[0] if len(works) == 1 else BatchWork(works)


# Groups this process has joined (weak: a released group is forgotten with it).
_joined: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


def first_use(group: Any, op: str, dim: str) -> None:
    """Rule d: this rank's first op on `group` waits until every rank of the group reaches its own."""
    if not isinstance(group, dist.ProcessGroup) or group in _joined:
        return  # not a real group (a test's stand-in), or joined already
    if dist.get_backend(group) != dist.Backend.GLOO:
        _joined.add(group)  # NCCL's own init does it
        return
    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=FIRST_USE_TIMEOUT_S), wait_all_ranks=True)
    except RuntimeError as e:
        ranks = dist.get_process_group_ranks(group)
        raise CommFirstUseError(
            f"{op} over {dim!r} is this rank's first op on the group of ranks {ranks}, and not every rank "
            f"of the group reached its own first op on it within {FIRST_USE_TIMEOUT_S:.0f}s: under NCCL "
            f"its communicator's creation, which every rank joins, would hang ({e})") from e
    _joined.add(group)
