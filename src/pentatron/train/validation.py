"""Validation in the training loop ([eval]): when it is due, and one evaluation's record.

Every `eval.every` optimizer steps and after the last one the trainer asks `Validation.run`, which
reads the same `eval.batches` global batches of held-out data (data/eval_split.py) and returns

    {"loss": mean cross-entropy, "perplexity": exp(loss), "tokens": targets scored, "batches": M,
     "time_s": wall seconds}

— the step record's `val` (metrics.jsonl, TensorBoard `val/*`, the console, the summary, the report).
It runs after the step's timing is taken, so tokens/s and MFU are training's alone, and changes
nothing training reads next (parallel/evaluate.py). A mixture's per-source holdouts (data.sources) add
"sources": {name: that source's loss}, and "loss" is their mean weighted as data.sources weighs them.
"""

from __future__ import annotations

import math
import time
from typing import Any

from pentatron.config import EvalConfig, TrainConfig
from pentatron.data.documents import find_documents
from pentatron.data.eval_split import EvalSet
from pentatron.parallel.evaluate import Evaluator
from pentatron.parallel.step_runner import StepRunner, host_scalars


def perplexity(loss: float) -> float:
    """exp(loss), inf past float range (a diverged model), never an OverflowError."""
    return math.exp(loss) if loss < 709.0 else math.inf


class Validation:
    def __init__(self, ev: EvalConfig, train: TrainConfig, data: EvalSet | list[tuple[str, float, EvalSet]],
                 runner: StepRunner, dp_rank: int, dp_size: int, document_mask: bool = False) -> None:
        """`data`: one set, or (name, weight, set) per source of a mixture (data/eval_split.py `eval_sets`)."""
        self.ev, self.train = ev, train
        self.sets = data if isinstance(data, list) else [("", 1.0, data)]
        eos = self.sets[0][2].dataset.eos_id  # the held-out data's own tokenizer (eval.path may be another dataset)
        self.documents = (lambda x: find_documents(x, eos)) if document_mask else None
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.evaluator = Evaluator(runner)

    def due(self, step: int) -> bool:
        return step % self.ev.every == 0 or step == self.train.steps

    def run(self) -> dict[str, Any]:
        """One evaluation (collective: every rank calls it at the same step)."""
        start = time.perf_counter()
        tr = self.train
        losses = {}
        for name, _, data in self.sets:
            steps = data.steps(self.ev.batches, tr.global_batch, tr.micro_batch, self.dp_rank, self.dp_size)
            (losses[name],) = host_scalars(self.evaluator.mean_loss(steps, self.documents))
        total = sum(w for _, w, _ in self.sets)
        loss = sum(w * losses[n] for n, w, _ in self.sets) / total if len(self.sets) > 1 else losses[self.sets[0][0]]
        out = {"loss": loss, "perplexity": perplexity(loss),
               "tokens": len(self.sets) * self.ev.batches * tr.global_batch * tr.seq_len,
               "batches": self.ev.batches, "time_s": time.perf_counter() - start}
        if len(self.sets) > 1:
            out["sources"] = losses
        return out
