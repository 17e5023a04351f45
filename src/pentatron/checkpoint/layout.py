"""Which checkpoint a run may resume: the layout a checkpoint was written in, and the comparison with
the layout of the run that wants to load it.

A checkpoint's tensor keys and shapes depend on the layout: tensor-parallel shards are keyed
"<name>|tp<i>/<n>", ZeRO pieces "<key>[lo:hi]" (ranges of the flat layout's buckets), and a pipeline
rank holds only its stages' names. Each parameter's `Placement` is a pure function of the model config,
the `ParallelLayout` and the rank's coordinates, so recording the layout (and the bucketing that decides
ZeRO ranges) is enough to know where every saved element came from. A checkpoint in another layout is
re-sharded (`reshard.py`, from the pieces each rank described when saving); one written before pieces
were described is refused with a message naming both layouts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pentatron.checkpoint.errors import CheckpointError
from pentatron.layout import ParallelLayout

_ALWAYS_COMPARED = ("tp", "pp", "ep", "pp_schedule", "pp_virtual", "pp_layers")


def layout_record(layout: ParallelLayout, engine_meta: dict[str, Any], bucket_mb: float) -> dict[str, Any]:
    """What the checkpoint's keys and shapes depend on, identical on every rank (so that every rank
    reaches the same resume decision): the degrees, the ZeRO stage and the bucketing (the padded bucket
    sizes when pp = 1; with pp > 1 they differ per stage, so bucket_mb), plus the pipeline schedule that
    decides which layers a rank holds."""
    meta = dict(engine_meta)
    meta.update(tp=layout.tp, pp=layout.pp, ep=layout.ep)  # ep: expert weights keyed "<name>|ep<i>/<n>"
    if layout.pp > 1:
        meta.pop("buckets", None)
        meta.update(bucket_mb=bucket_mb, pp_schedule=layout.pp_schedule, pp_virtual=layout.virtual)
        if layout.pp_layers is not None:  # an explicit split: which layers each rank holds
            meta["pp_layers"] = list(layout.pp_layers)
    return meta


def layout_differences(saved: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """The layout fields in which a checkpoint and this run differ (empty: it can be resumed).
    Checkpoints written before tp/pp/ep were recorded were tp = pp = ep = 1. Replicated state (ZeRO-0) is keyed
    independently of dp and bucketing, so those may change."""
    saved = {"tp": 1, "pp": 1, "ep": 1, **saved}
    keys = sorted(set(saved) | set(mine))
    diff = [k for k in keys if saved.get(k) != mine.get(k) and (k in saved and k in mine or k in _ALWAYS_COMPARED)]
    if saved.get("zero") == 0 and mine.get("zero") == 0:
        diff = [k for k in diff if k not in ("dp", "buckets", "bucket_mb")]
    return diff


def check_resumable(path: Path, saved: dict[str, Any], mine: dict[str, Any]) -> None:
    """Raise when the checkpoint at `path` (written in layout `saved`) cannot be loaded by this run."""
    diff = layout_differences(saved, mine)
    if diff:
        # Every rank sees the same two layouts, so every rank raises (none is left in a collective).
        raise CheckpointError(f"checkpoint {path} was written with layout {saved}, this run has layout {mine} "
                              f"(they differ in {', '.join(diff)}); it was saved before checkpoints described "
                              "their pieces, so it cannot be re-sharded: resume with the same parallel.dp, tp, pp, "
                              "ep, zero, bucket_mb, pp_schedule, pp_virtual and pp_layers")
