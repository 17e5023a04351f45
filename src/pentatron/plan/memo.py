"""Memoisation helpers for the planner's pure functions (the search evaluates ~10^4 layouts that share
most of their terms)."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from functools import lru_cache
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
    function does not read): equal for instances that differ only there. It holds the instance it was made
    from, which the cached function reads (any of the equal ones gives the same result). Cheaper than
    building the normalised instance with `dataclasses.replace`."""

    __slots__ = ("obj", "key")

    def __init__(self, obj: Any, drop: frozenset[str]) -> None:
        self.obj = obj
        values = vars(obj)
        if tuple(values) == _field_names(type(obj)):  # a dataclass's __dict__: its fields, in order
            key = list(values.values())
            for i in _positions(type(obj), drop):
                key[i] = None
            for i in _nested(type(obj), drop):  # a held dataclass with dropped fields (Layout.par's zero)
                key[i] = Without(key[i], drop)
            self.key: tuple = (type(obj), *key)
        else:
            self.key = (type(obj), *(v for k, v in values.items() if k not in drop))

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Without) and self.key == other.key


@lru_cache(maxsize=64)
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


@lru_cache(maxsize=64)
def _positions(cls: type, drop: frozenset[str]) -> tuple[int, ...]:
    return tuple(i for i, name in enumerate(_field_names(cls)) if name in drop)


@lru_cache(maxsize=64)
def _nested(cls: type, drop: frozenset[str]) -> tuple[int, ...]:
    """Positions of fields typed as a dataclass that has some of the `drop` fields."""
    hints = get_type_hints(cls)
    out = []
    for i, name in enumerate(_field_names(cls)):
        t = hints.get(name)
        if isinstance(t, type) and is_dataclass(t) and set(_field_names(t)) & drop:
            out.append(i)
    return tuple(out)
