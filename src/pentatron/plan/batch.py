"""`pentatron plan --batch FILE`: evaluate many fixed layouts of one workload in one process.

FILE is TOML with one `[[layout]]` table per layout, holding any `ParallelLayout` field (dp, tp, pp, cp,
ep, zero, sp, pp_schedule, pp_virtual, micro_batch, zero3_gather, cp_mode, cp_ulysses, and pp_layers: a
list of decoder layers per pipeline chunk), our knobs (recompute, precision, fp8_scaling, attention),
`recipe` (a preset of plan/recipes.py, default pentatron) and any `Recipe` field overriding it
(grad_precision, sp_inputs, pp_p2p, ...); the model, sequence, batch and
hardware come from the command line. Each layout is evaluated as given (`problems` refuse only what cannot
exist; warnings and "training cannot run this yet" are notes), so a sweep costs one import plus the
arithmetic per layout.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pentatron.hardware.catalogue import GPUSpec
from pentatron.layout import ParallelLayout
from pentatron.plan.layout import KNOBS, Layout, Workload, problems
from pentatron.plan.recipes import PENTATRON, RECIPE_FIELDS, RecipeError, get_recipe
from pentatron.plan.search import Prediction, predict
from pentatron.user_files import UnreadableFile, read_toml

_FIELDS = {*(f.name for f in dataclasses.fields(ParallelLayout)), *KNOBS, "recipe", *RECIPE_FIELDS} - {
    "global_batch", "seq_len"}


class BatchError(ValueError):
    """The batch file cannot be read (one message naming the entry)."""


def load_layouts(path: str | Path, defaults: dict[str, Any] | None = None) -> list[Layout]:
    p = Path(path)
    try:
        data = read_toml(p, "--batch")
    except UnreadableFile as e:  # missing, unreadable, not UTF-8, not TOML
        raise BatchError(str(e)) from None
    entries = data.get("layout")
    if not isinstance(entries, list) or not entries:
        raise BatchError(f"--batch {str(p)!r}: needs one or more [[layout]] tables")
    out = []
    for i, e in enumerate(entries, 1):
        unknown = sorted(set(e) - _FIELDS)
        if unknown:
            raise BatchError(f"--batch {str(p)!r}: layout {i}: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(_FIELDS))}")
        out.append(layout_from_toml({**(defaults or {}), **e}, f"--batch {str(p)!r}: layout {i}"))
    return out


def layout_from_toml(fields: dict[str, Any], where: str) -> Layout:
    """A `Layout` from a TOML table of its fields: `recipe` names a preset (default pentatron) and the
    recipe's own fields override it (`plan/recipes.py`); sp defaults to tp > 1, and `pp_layers` (a TOML
    array) becomes the tuple the layout keeps (hashable)."""
    kw = dict(fields)
    kw.setdefault("sp", kw.get("tp", 1) > 1)
    if "pp_layers" in kw:
        if not isinstance(kw["pp_layers"], list) or not all(type(c) is int for c in kw["pp_layers"]):
            raise BatchError(f"{where}: pp_layers must be a list of integers (decoder layers per pipeline chunk)")
        kw["pp_layers"] = tuple(kw["pp_layers"])
    over = {k: kw.pop(k) for k in RECIPE_FIELDS if k in kw}
    try:
        kw["recipe"] = get_recipe(kw.pop("recipe", PENTATRON.name), over)
    except RecipeError as e:
        raise BatchError(f"{where}: {e}") from None
    return Layout(**kw)


@dataclasses.dataclass(frozen=True)
class BatchRow:
    layout: Layout
    prediction: Prediction | None
    problems: tuple[str, ...]


def evaluate_batch(w: Workload, gpu: GPUSpec, layouts: list[Layout], gpus: int | None = None, *,
                   kernels: str | None = None) -> list[BatchRow]:
    rows = []
    for lay in layouts:
        why = problems(w, lay, gpu, gpus if gpus is not None else lay.world)
        rows.append(BatchRow(lay, None if why else predict(w, lay, gpu, kernels=kernels), tuple(why)))
    return rows
