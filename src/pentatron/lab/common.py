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
    """Side-by-side panels: each {"title", "xlabel", "ylabel", "series": {label: (xs, ys)}, "logy"}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for label, (xs, ys) in panel["series"].items():
            ax.plot(xs, ys, label=label, marker="o" if len(xs) < 12 else None)
        ax.set_title(panel["title"])
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        if panel.get("logy"):
            ax.set_yscale("log")
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
