"""A frozen dataclass's hash computed once and kept on the instance: the planner's memoised terms hash the
model config, the workload and the recipe in every cache key (~10^5 times a search), and a dataclass's own
`__hash__` rehashes all fields on each call.

The kept hash is left out of the pickled state: a str's hash differs between interpreters (hash
randomisation), so an instance sent to another process computes its own there."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

_KEY = "_kept_hash"


def kept_hash(obj: Any, values: Callable[[Any], tuple]) -> int:
    """hash(values(obj)), computed on the first call and kept in `obj.__dict__` (past a frozen
    dataclass's __setattr__)."""
    d = obj.__dict__
    h = d.get(_KEY)
    if h is None:
        h = d[_KEY] = hash(values(obj))
    return h


def state_without_kept_hash(obj: Any) -> dict[str, Any]:
    """`__getstate__` for a class using `kept_hash`: its fields, without the hash."""
    return {k: v for k, v in obj.__dict__.items() if k != _KEY}


def compared_fields(obj: Any) -> tuple:
    """The values of a dataclass's compared fields, in order: what its generated `__hash__` hashes."""
    return tuple(getattr(obj, f.name) for f in fields(obj) if f.compare)
