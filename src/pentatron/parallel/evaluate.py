"""Forward-only loss over given batches in the run's layout (validation), leaving training as it was.

    loss = Evaluator(runner).mean_loss(steps)   # steps: per global batch, this rank's micro-batches

The same forwards as a training step — context-parallel token shards, tensor/sequence-parallel regions,
expert all-to-alls, ZeRO-3 gathers — under `torch.no_grad()`; with pp > 1 through a second pipeline
engine running `schedules.forward_only` (no backward action, no saved activation), the loss taken on the
last stage and broadcast over pp as in training. The mean over every micro-batch of every global batch
is averaged over dp × cp as the step's loss is, so it is the one-process mean cross-entropy.

What a training step carries from forward to the optimizer is left untouched: no gradient is produced
(no_grad: no hook fires, no bucket fills); the MoE layers' load statistics of the step in progress are
set aside and restored, so the aux-free bias update and the `moe` metrics see training's forwards only,
and the balancing losses never enter the loss (they reach training only through backward); the data
loader is not read. ZeRO-3's gathered parameters are freed at the end (`release_gathered`).
With document masking (`documents`: a micro-batch's inputs → its `Documents`) the held-out batches are
scored as training scores its own: attention within each document, positions restarting per document.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from pentatron.models.documents import Documents
from pentatron.models.moe import moe_layers
from pentatron.parallel.pipeline.engine import PipelineEngine
from pentatron.schedules import forward_only

if TYPE_CHECKING:
    from pentatron.parallel.step_runner import StepRunner

Batch = tuple[torch.Tensor, torch.Tensor]


class Evaluator:
    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner
        self._pipelines: dict[int, PipelineEngine] = {}  # by micro-batches per step

    def _pipeline(self, m: int) -> PipelineEngine:
        if m not in self._pipelines:
            r = self.runner
            assert r.pipeline is not None and r.stages
            lay = r.layout
            self._pipelines[m] = PipelineEngine(r.stages, forward_only(lay.pp, m, lay.virtual), r.comm,
                                                r.ctx.local_rank("pp"), r.loss_fn, act_shape=r.pipeline.act_shape,
                                                head_loss=r.head_loss)
        return self._pipelines[m]

    def mean_loss(self, steps: Iterable[Sequence[Batch]],
                  documents: Callable[[torch.Tensor], Documents] | None = None) -> torch.Tensor:
        """The mean loss over every micro-batch of `steps` (each this rank's share of one global batch),
        over all data-parallel replicas: the same 0-dim tensor on every rank (collective)."""
        r = self.runner
        layers = list(moe_layers(r.model).values())
        kept = [m.stats for m in layers]  # the training step's statistics (None between steps)
        total = torch.zeros((), dtype=r.loss_dtype, device=r.device)
        count = 0
        try:
            with torch.no_grad():
                for micro_batches in steps:
                    total += self._step_loss(micro_batches, documents)
                    count += 1
        finally:
            for m, stats in zip(layers, kept, strict=True):
                m.stats = stats
            r.engine.release_gathered()
        if count == 0:
            raise ValueError("no batch to evaluate")
        r.comm.all_reduce(total, "dp" if r.layout.cp == 1 else "dp_cp")
        return total / (count * r.layout.dp * r.layout.cp)

    def _step_loss(self, micro_batches: Sequence[Batch],
                   documents: Callable[[torch.Tensor], Documents] | None) -> torch.Tensor:
        """One global batch's mean loss on this replica (as `StepRunner.forward_backward` takes it)."""
        r = self.runner
        docs = [documents(x) for x, _ in micro_batches] if documents is not None else None
        batches, positions = r.placed(micro_batches, docs)
        if r.pipeline is not None:
            result = self._pipeline(len(batches)).step(batches, positions, docs)
            loss = (result.loss.to(r.loss_dtype) if result.loss is not None
                    else torch.zeros((), dtype=r.loss_dtype, device=r.device))
            r.comm.broadcast(loss, "pp", src=r.layout.pp - 1)
            return loss
        loss = torch.zeros((), dtype=r.loss_dtype, device=r.device)
        for i, (inputs, targets) in enumerate(batches):
            extra = () if docs is None else (docs[i],)  # unmasked: the model called as in training
            step_loss = (r.model(inputs, positions[i], targets, *extra) if r.head_loss
                         else r.loss_fn(r.model(inputs, positions[i], None, *extra), targets))
            loss += step_loss.to(r.loss_dtype)
        return loss / len(batches)
