"""A number a user gave, checked in one place: a real number, finite, and inside its range.

Why one place: a range check written `x <= 0` is false for NaN, so NaN passed every such check and
reached the optimizer (a traceback) or the loss (a "non-finite" stop that blamed train.lr). Here every
comparison is written so that NaN fails it, and non-finite values are refused before any range is read.
Torch-free and import-free: the config loader, the model shapes and the planner all call it.
"""

from __future__ import annotations

import math

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # TOML's integers; torch.manual_seed and numpy take seeds within


def number_problem(path: str, value: object, *, gt: float | None = None, ge: float | None = None,
                   lt: float | None = None, le: float | None = None, finite: bool = True) -> str | None:
    """What is wrong with `value` as the number field `path` (None: nothing): not a number, NaN or infinite
    (unless `finite=False`), or outside the bounds given (gt: >, ge: ≥, lt: <, le: ≤)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{path} must be a number, got {value!r}"
    # Python compares an int with a float exactly (2**63 and 2**63-1 would be one float)
    if isinstance(value, float) and (math.isnan(value) or (finite and math.isinf(value))):
        return f"{path} must be a finite number, got {value!r}"
    if isinstance(value, int) and abs(value) > 10**300:  # beyond any float: an overflow in float(value)
        return f"{path} must be a finite number, got an integer of {len(str(abs(value)))} digits"
    bounds = [(b, op) for b, op in ((gt, ">"), (ge, "≥"), (lt, "<"), (le, "≤")) if b is not None]
    inside = {">": lambda b: value > b, "≥": lambda b: value >= b, "<": lambda b: value < b,
              "≤": lambda b: value <= b}
    if all(inside[op](b) for b, op in bounds):  # NaN fails every one of them
        return None
    shown = repr(value) if len(repr(value)) <= 24 else f"{value:.3g}"
    return f"{path} must be {' and '.join(f'{op} {_show(b)}' for b, op in bounds)}, got {shown}"


def _show(b: float) -> str:
    if b == INT64_MAX:
        return "2**63-1"
    if b == INT64_MIN:
        return "-2**63"
    return f"{b:g}" if isinstance(b, float) else str(b)
