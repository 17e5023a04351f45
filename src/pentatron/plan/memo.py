"""Memoisation helpers for the planner's pure functions (the search evaluates ~10^4 layouts that share
most of their terms)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, is_dataclass
from functools import lru_cache
from operator import attrgetter
from typing import Any, get_type_hints


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
    function does not read): equal for instances that differ only there, also inside a held dataclass
    (`Layout.par`'s zero). It holds the instance it was made from, which the cached function reads (any of
    the equal ones gives the same result). Cheaper than building the normalised instance with
    `dataclasses.replace`: the kept fields are read by one `attrgetter` (nested ones by dotted path) and
    the key's hash is computed once, as a cache lookup hashes it and compares it on a hit."""

    __slots__ = ("obj", "key", "_hash")

    def __init__(self, obj: Any, drop: frozenset[str]) -> None:
        self.obj = obj
        self.key: tuple = (type(obj), *_kept(type(obj), drop)(obj))
        self._hash = hash(self.key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Without) and self._hash == other._hash and self.key == other.key


@lru_cache(maxsize=64)
def _kept(cls: type, drop: frozenset[str]) -> Callable[[Any], tuple]:
    """Reads the fields of `cls` not in `drop` as one tuple: a field typed as a dataclass that has some of
    the `drop` fields is read field by field (dotted paths), without those."""
    hints = get_type_hints(cls)
    paths: list[str] = []
    for f in fields(cls):
        if f.name in drop:
            continue
        t = hints.get(f.name)
        if isinstance(t, type) and is_dataclass(t) and {g.name for g in fields(t)} & drop:
            paths += [f"{f.name}.{g.name}" for g in fields(t) if g.name not in drop]
        else:
            paths.append(f.name)
    get = attrgetter(*paths)
    return get if len(paths) > 1 else lambda obj: (get(obj),)
