"""The expert-load heatmap of an MoE run: `expert_load.png` in the run directory, one row per MoE layer,
one column per expert, each cell the share of that layer's routed assignments the expert took over
the whole run (every step of metrics.jsonl: the run report draws it and links it from report.md).
A balanced layer is a flat row at 1/E; the row's max/mean is in its label."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

HEATMAP = "expert_load.png"


def expert_loads(records: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Layer name → assignments per expert summed over the records' steps (from their `moe` field)."""
    out: dict[str, np.ndarray] = {}
    for r in records:
        for name, m in (r.get("moe") or {}).items():
            counts = np.asarray(m["tokens_per_expert"], dtype=np.float64)
            out[name] = out.get(name, 0) + counts
    return out


def write_expert_heatmap(run_dir: Path, records: list[dict[str, Any]]) -> Path | None:
    """Write `<run_dir>/expert_load.png` (the run report does, from every step of metrics.jsonl, and links it
    from report.md); None when the run has no MoE metrics. One Figure on the Agg canvas: no pyplot state."""
    loads = expert_loads(records)
    if not loads:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = sorted(loads, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])
    share = np.stack([loads[n] / max(loads[n].sum(), 1) for n in names])
    fig = Figure(figsize=(max(6.5, 3.5 + 0.45 * share.shape[1]), 1.2 + 0.45 * len(names)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = ax.imshow(share, aspect="auto", cmap="viridis")
    ax.set_xticks(range(share.shape[1]))
    ax.set_yticks(range(len(names)), [f"{n} (max/mean {s.max() * s.size:.2f})" for n, s in zip(names, share)])
    ax.set_xlabel("expert")
    ax.set_title(f"share of routed assignments over {len(records)} steps")
    fig.colorbar(im, ax=ax)
    path = Path(run_dir) / HEATMAP
    fig.savefig(path, dpi=100)
    return path
