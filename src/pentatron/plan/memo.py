"""Memoisation helpers for the planner's pure functions (the search evaluates ~10^4 layouts that share
most of their terms)."""

from __future__ import annotations

from typing import Any


class Same:
    """A cache-key part that compares by identity, for unhashable values (a `GPUSpec` holds dicts). It
    holds its object, so the id cannot be reused by another while the key is alive in a cache."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj


class Without:
    """A cache-key part standing for a dataclass instance with some fields left out (those the cached
    function does not read): equal for instances that differ only there. It holds the instance it was made
    from, which the cached function reads (any of the equal ones gives the same result). Cheaper than
    building the normalised instance with `dataclasses.replace`."""

    __slots__ = ("obj", "key")

    def __init__(self, obj: Any, drop: frozenset[str]) -> None:
        self.obj = obj
        self.key = (type(obj), *(v for k, v in vars(obj).items() if k not in drop))

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Without) and self.key == other.key
