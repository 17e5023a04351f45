"""Count the device→host synchronisations that Pentatron's own code asks for (a CPU proxy for GPU stalls).

On a GPU every `.item()`, `.tolist()`, `.cpu()`, `float(t)`, `int(t)`, `bool(t)`, `.numpy()`, `.to("cpu")`
and every op whose output size depends on the data (`bincount`, `nonzero`, a boolean-mask index) waits for
the device's queue to drain. On CPU ranks nothing stalls, so this counts the calls instead: the methods are
wrapped for the duration of a `with SyncCounter() as c:` block, and a call counts when the frame that made
it is in Pentatron's sources (torch's own uses — e.g. AdamW reading its CPU step counters — are not ours to
remove and are not device tensors on a GPU either). `.to(...)` counts when its target is the CPU and the
calling line names "cpu" (on CPU ranks the run's device *is* the CPU, so `.to(self.device)` must not count).

    with SyncCounter() as c:
        ...
    c.total, c.sites   # {"file:line kind": n}
"""

from __future__ import annotations

import collections
import linecache
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

import pentatron

_OURS = os.path.dirname(os.path.abspath(pentatron.__file__)) + os.sep
# Tensor methods that always move a value to the host.
_TRANSFERS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__index__", "__bool__", "__format__")
# Ops whose output shape depends on the data: the host must learn it (a sync under CUDA).
_DATA_DEPENDENT = ("bincount", "nonzero", "masked_select", "unique")


def _caller(depth: int = 2) -> tuple[str, int] | None:
    f = sys._getframe(depth)
    name = f.f_code.co_filename
    return (name, f.f_lineno) if name.startswith(_OURS) else None


def _targets_cpu(args: tuple, kwargs: dict) -> bool:
    for a in (*args, kwargs.get("device")):
        if isinstance(a, torch.Tensor):
            return a.device.type == "cpu"
        if isinstance(a, (str, torch.device)):
            return torch.device(a).type == "cpu"
    return False


def _bool_index(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class SyncCounter:
    def __init__(self) -> None:
        self.sites: collections.Counter[str] = collections.Counter()
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def _hit(self, kind: str, where: tuple[str, int] | None) -> None:
        if where is not None:
            self.sites[f"{os.path.relpath(where[0], _OURS)}:{where[1]} {kind}"] += 1

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original if name in vars(owner) else None))
        setattr(owner, name, make(original))

    def __enter__(self) -> SyncCounter:
        def counting(kind: str) -> Callable[[Any], Any]:
            def make(original: Any) -> Any:
                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    self._hit(kind, _caller())
                    return original(*args, **kwargs)
                return wrapper
            return make

        def to(original: Any) -> Any:
            def wrapper(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                where = _caller()
                if where is not None and _targets_cpu(args, kwargs) and "cpu" in linecache.getline(*where):
                    self._hit("to(cpu)", where)
                return original(t, *args, **kwargs)
            return wrapper

        def getitem(original: Any) -> Any:
            def wrapper(t: torch.Tensor, index: Any) -> Any:
                if _bool_index(index):
                    self._hit("mask-index", _caller())
                return original(t, index)
            return wrapper

        for name in _TRANSFERS:
            self._patch(torch.Tensor, name, counting(name))
        for name in _DATA_DEPENDENT:
            self._patch(torch.Tensor, name, counting(name))
            self._patch(torch, name, counting(name))
        self._patch(torch.Tensor, "to", to)
        self._patch(torch.Tensor, "__getitem__", getitem)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            if original is None:  # inherited (torch.Tensor's C base): drop the wrapper again
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved.clear()
