"""Draw a pipeline `Timeline` (simulated from a schedule, or recorded by the engine) as a PNG, in the
style of the Ultra-Scale Playbook's diagrams: one row per pipeline rank, one box per action coloured
by kind (forward, backward, or input-/weight-gradient halves) and labelled with its micro-batch,
later chunks of an interleaved schedule in deeper shades, idle time (the bubble) left blank.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.patches import Patch  # noqa: E402

from pentatron.schedules import Kind, Timeline  # noqa: E402

# Per kind, one colour per chunk (a deeper shade for later chunks).
_COLOURS: dict[Kind, tuple[str, ...]] = {
    Kind.F: ("#8ecae6", "#219ebc", "#126782", "#023047"),
    Kind.BW: ("#b5e48c", "#76c893", "#34a0a4", "#1a759f"),
    Kind.B: ("#ffd166", "#f4a261", "#e76f51", "#9c4221"),
    Kind.W: ("#cdb4db", "#a2d2ff", "#bde0fe", "#9d4edd"),
}
_NAMES = {Kind.F: "forward", Kind.BW: "backward", Kind.B: "backward (input grads)", Kind.W: "backward (weight grads)"}


def colour(kind: Kind, chunk: int) -> str:
    shades = _COLOURS[kind]
    return shades[min(chunk, len(shades) - 1)]


def draw_timeline(timeline: Timeline, out: str | Path, *, title: str | None = None, unit: str = "") -> Path:
    """Write `timeline` as a PNG to `out`; returns the path."""
    p = timeline.p
    span = timeline.makespan or 1.0
    n_boxes = max((len(s) for s in timeline.slots), default=1)
    width = min(28.0, max(8.0, 0.28 * n_boxes + 2))
    fig, ax = plt.subplots(figsize=(width, 0.6 * p + 1.6))
    kinds_seen: set[Kind] = set()
    for r, slots in enumerate(timeline.slots):
        y = p - 1 - r  # rank 0 on top, as in the playbook
        for s in slots:
            a = s.action
            kinds_seen.add(a.kind)
            ax.broken_barh([(s.start, s.end - s.start)], (y + 0.08, 0.84), facecolors=colour(a.kind, a.chunk),
                           edgecolors="white", linewidth=0.6)
            # Label only boxes wide enough to hold the text.
            if (s.end - s.start) / span * width > 0.18:
                dark = a.chunk >= 2 or (a.chunk >= 1 and a.kind != Kind.W)
                ax.text((s.start + s.end) / 2, y + 0.5, str(a.microbatch + 1), ha="center", va="center",
                        fontsize=7, color="white" if dark else "black")
    ax.set_xlim(0, span)
    ax.set_ylim(0, p)
    ax.set_yticks([p - 1 - r + 0.5 for r in range(p)], [f"rank {r}" for r in range(p)])
    ax.set_xlabel(f"time{f' ({unit})' if unit else ''}")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    bubble = timeline.bubble_fraction
    ax.set_title(title or f"{timeline.name}: bubble {bubble:.1%} (idle share)", loc="left", fontsize=10)
    handles = [Patch(facecolor=colour(k, 0), label=_NAMES[k]) for k in (Kind.F, Kind.BW, Kind.B, Kind.W)
               if k in kinds_seen]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=4, frameon=False, fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
