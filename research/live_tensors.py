"""The bytes of tensor storage a process holds, followed op by op, and what was live at the peak.

A CPU allocator keeps no statistics, and the profiler's allocation events also count what gloo
allocates on its own threads (its reduce-scatter works through a full-size temporary, which NCCL does
not), so this follows the storages the process's own ops create: every aten op's outputs (a DTensor
by its local tensor) through a TorchDispatchMode, each storage until it is garbage, and storage
`resize_`, with which FSDP2 frees and re-allocates its unsharded parameters in place. At each new peak
it records what is live, grouped by the op that first produced each storage, the code that called it
and the step it ran in.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_CALLERS = ("torch/distributed/", "torch/optim/", "torch/utils/checkpoint", "pentatron/")


def _caller() -> str:
    """The innermost frame in torch.distributed, torch.optim, checkpointing or our model code: who asked."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        for root in _CALLERS:
            if root in path:
                return f"{root}{path.split(root, 1)[1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class LiveTensors(TorchDispatchMode):
    _active: LiveTensors | None = None

    def __init__(self, already_counted: list[torch.Tensor] | tuple = ()) -> None:
        """`already_counted`: tensors whose storages the caller counts itself (a model's parameters):
        an op that returns one of them or a view of one adds nothing."""
        super().__init__()
        self._live: dict[int, list[Any]] = {}  # id(storage) -> [nbytes, label, weakref]
        self.current = self.peak = 0
        self.at_peak: Counter[str] = Counter()
        self.step = 0
        for t in already_counted:
            st = getattr(t, "_local_tensor", t).untyped_storage()
            self._live[id(st)] = [0, "counted by the caller", weakref.ref(st)]

    def _track(self, st: torch.UntypedStorage, label: str) -> None:
        key = id(st)
        if key in self._live or st.nbytes() == 0:
            return
        self._live[key] = [st.nbytes(), label, weakref.ref(st, lambda _, k=key: self._gone(k))]
        self._grow(st.nbytes())

    def _gone(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]

    def _grow(self, nbytes: int) -> None:
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
            self.at_peak = Counter()
            for size, label, _ in self._live.values():
                self.at_peak[label] += size

    def resized(self, st: torch.UntypedStorage, before: int) -> None:
        entry = self._live.get(id(st))
        if entry is None:
            self._track(st, f"resize_ in {_caller()} (step {self.step})")
            return
        entry[0] += st.nbytes() - before
        self._grow(st.nbytes() - before)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            t = getattr(t, "_local_tensor", t)
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                if id(st) not in self._live:
                    self._track(st, f"{func.__name__} in {_caller()} (step {self.step})")
        return out

    def __enter__(self) -> LiveTensors:
        # FSDP2 frees its unsharded parameters with storage.resize_(0) and re-allocates them the same
        # way, which dispatches no op: followed by wrapping resize_ while a tracker is active
        LiveTensors._active = self
        torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        LiveTensors._active = None
        torch.UntypedStorage.resize_ = _original_resize  # type: ignore[method-assign]
        return super().__exit__(*exc)


_original_resize = torch.UntypedStorage.resize_


def _resize(self: torch.UntypedStorage, size: int) -> Any:
    before = self.nbytes()
    result = _original_resize(self, size)
    if LiveTensors._active is not None:
        LiveTensors._active.resized(self, before)
    return result

