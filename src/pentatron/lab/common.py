"""What every lab experiment shares: the debug model, a learnable synthetic corpus, a verdict, a plot.

The corpus is a random Markov chain over 256 of the vocabulary's tokens, each followed by one of 4
successors with fixed probabilities: a model can learn it in a few dozen steps (from ln 4096 ≈ 8.3
nats down towards its entropy, about 1.2 nats), so a stalled or diverging run is visible at once,
and nothing is read from disk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pentatron.models.llama import Llama, build_model
from pentatron.models.registry import get_model_config

USED_TOKENS = 256
SUCCESSORS = 4


@dataclass
class Verdict:
    """An experiment's outcome: `reproduced` says whether the failure showed as the playbook describes,
    judged from `numbers`; `text` explains it with those numbers."""

    name: str
    reproduced: bool
    text: str
    numbers: dict[str, Any] = field(default_factory=dict)
    plot: Path | None = None

    def report(self) -> str:
        head = "REPRODUCED" if self.reproduced else "NOT REPRODUCED"
        where = f"\n  plot: {self.plot}" if self.plot else ""
        return f"[{self.name}] {head}: {self.text}{where}"


def debug_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> Llama:
    return build_model(get_model_config("debug"), seed=seed, dtype=dtype)


class MarkovCorpus:
    """Batches of (inputs, targets) from a fixed random Markov chain (seeded, so runs are comparable)."""

    def __init__(self, seed: int = 0, stream: int | None = None) -> None:
        """`seed` fixes the chain and, unless `stream` is given, the sample stream: a held-out set of the same
        chain is MarkovCorpus(seed, stream=another)."""
        g = torch.Generator().manual_seed(seed)
        self.next_tokens = torch.randint(0, USED_TOKENS, (USED_TOKENS, SUCCESSORS), generator=g)
        probs = torch.tensor([0.55, 0.25, 0.12, 0.08])
        self.probs = probs
        self.entropy = float(-(probs * probs.log()).sum())
        self._g = torch.Generator().manual_seed(seed + 1 if stream is None else stream)

    def batch(self, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, USED_TOKENS, (batch,), generator=self._g)
        choice = torch.multinomial(self.probs.expand(batch, -1), seq_len, replacement=True, generator=self._g)
        for t in range(seq_len):
            tokens[:, t + 1] = self.next_tokens[tokens[:, t], choice[:, t]]
        return tokens[:, :-1], tokens[:, 1:]


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())


def grad_vector(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().double().flatten() if p.grad is not None
                      else torch.zeros(p.numel(), dtype=torch.float64) for p in model.parameters()])


def finite(x: float) -> bool:
    return math.isfinite(x)


def save_plot(path: Path, title: str, panels: list[dict[str, Any]]) -> Path:
    """`plot_figure(title, panels)` written to `path` (PNG)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    plot_figure(title, panels).savefig(path, dpi=100)
    return path


def plot_figure(title: str, panels: list[dict[str, Any]]) -> Any:
    """Side-by-side panels, one kind each, as the x axis is numeric or not:
    - "line" (the default): {"title", "xlabel", "ylabel", "series": {label: (xs, ys)}, "logx", "logy",
      "expected": [labels of series drawn dashed, as a reference], "lines": {label: y} (optional horizontal
      references)}; xs are numbers (steps, sizes, ratios) — categories go in a bar panel;
    - "bar": {"kind": "bar", "title", "ylabel", "categories": [name, ...], "series": {label: [one value per
      category]}, "lines": {label: y} (optional horizontal references), "logy"}: grouped bars, each value
      written on its bar.
    One Figure on the Agg canvas (no pyplot state: experiments run in one process, one after another)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5 * len(panels), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, panel in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        kind = panel.get("kind", "line")
        if kind == "bar":
            _bars(ax, panel)
        elif kind == "line":
            _lines(ax, panel)
        else:
            raise ValueError(f"panel {panel['title']!r}: kind {kind!r} is neither 'line' nor 'bar'")
        ax.set_title(panel["title"])
        ax.set_ylabel(panel["ylabel"])
        if panel.get("logy"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y" if kind == "bar" else "both")
        if len(panel["series"]) + len(panel.get("lines", {})) > 1:
            ax.legend(fontsize=9)
    fig.suptitle(title)
    return fig


def _lines(ax: Any, panel: dict[str, Any]) -> None:
    for label, (xs, ys) in panel["series"].items():
        if any(isinstance(x, str) for x in xs):
            raise ValueError(f"panel {panel['title']!r}: x values {list(xs)} are categories: use a bar panel")
        if label in panel.get("expected", ()):  # what theory says: dashed, under the measured points
            ax.plot(xs, ys, label=label, ls="--", color="0.35", zorder=1)
        else:
            ax.plot(xs, ys, label=label, marker="o" if len(xs) < 12 else None, zorder=2)
    _references(ax, panel)
    ax.set_xlabel(panel["xlabel"])
    if panel.get("logx"):
        ax.set_xscale("log", base=2)


def _references(ax: Any, panel: dict[str, Any]) -> None:
    """The panel's "lines": {label: y}, horizontal references (a timeout, a baseline) in black, each its style."""
    for j, (label, y) in enumerate(panel.get("lines", {}).items()):
        ax.axhline(y, color="k", ls=("--", ":", "-.")[j % 3], lw=1, label=label)


def _bars(ax: Any, panel: dict[str, Any]) -> None:
    names, series = panel["categories"], panel["series"]
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        if len(values) != len(names):
            raise ValueError(f"panel {panel['title']!r}: {label!r} has {len(values)} values for {len(names)} "
                             "categories")
        xs = [c - 0.4 + width * (i + 0.5) for c in range(len(names))]
        bars = ax.bar(xs, values, width * 0.9, label=label, color=f"C{i}")
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
    _references(ax, panel)
    long = len(names) * max(map(len, names)) > 60  # ~60 characters fit under a panel: beyond, slanted
    ax.set_xticks(range(len(names)), names, rotation=25 if long else 0, ha="right" if long else "center")
    ax.margins(y=0.12)  # room for the values written on the bars
