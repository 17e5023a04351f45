"""The expert-load heatmap of an MoE run: `expert_load.png` in the run directory, one row per MoE layer,
one column per expert, each cell the share of that layer's routed assignments the expert took over
the whole run (a balanced layer is a flat row at 1/E; the row's max/mean is in its label)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def expert_loads(records: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Layer name → assignments per expert summed over the records' steps (from their `moe` field)."""
    out: dict[str, np.ndarray] = {}
    for r in records:
        for name, m in (r.get("moe") or {}).items():
            counts = np.asarray(m["tokens_per_expert"], dtype=np.float64)
            out[name] = out.get(name, 0) + counts
    return out


def write_expert_heatmap(log_dir: Path, records: list[dict[str, Any]]) -> Path | None:
    """Write `<log_dir>/expert_load.png`; None when the run has no MoE metrics."""
    loads = expert_loads(records)
    if not loads:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(loads, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])
    share = np.stack([loads[n] / max(loads[n].sum(), 1) for n in names])
    fig, ax = plt.subplots(figsize=(max(6.5, 3.5 + 0.45 * share.shape[1]), 1.2 + 0.45 * len(names)))
    im = ax.imshow(share, aspect="auto", cmap="viridis")
    ax.set_xticks(range(share.shape[1]))
    ax.set_yticks(range(len(names)), [f"{n} (max/mean {s.max() * s.size:.2f})" for n, s in zip(names, share)])
    ax.set_xlabel("expert")
    ax.set_title(f"share of routed assignments over {len(records)} steps")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    path = Path(log_dir) / "expert_load.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
