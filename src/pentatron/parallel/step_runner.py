"""The step runner: one optimizer step's forward and backward, whatever the layout.

`parallelize` returns it. It owns the plain micro-batch loop or the pipeline engine (built from the
layout's schedule), the (vocabulary-parallel) loss, the loss's broadcast from the last pipeline stage
and its average over data-parallel ranks, the gradient synchronisation (including the tied-embedding
exchange between the first and last stage), clipping and the optimizer step — so the trainer has no
branch on any parallel dimension:

    loss = runner.forward_backward(micro_batches)   # gradients reduced (and summed over tp where partial);
                                                     # loss averaged over the replicas
    norm = runner.clip_grads(max_norm)
    loss, norm = host_scalars(loss, norm)            # the step's one device→host copy of the two
    runner.step(lr)

Loss and norm stay on the device until the trainer reads them; the only other host syncs of a step are
one per MoE layer per micro-batch (its split sizes, models/moe.py) and one copy of the MoE statistics
after the step (`finish_step`), counted by tests/parallel/test_host_syncs.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pentatron.config import DataConfig, TrainConfig
from pentatron.distributed.context import ParallelContext
from pentatron.host_copy import to_device
from pentatron.layout import ParallelLayout
from pentatron.models.documents import Documents
from pentatron.models.moe import finish_step, moe_layers, set_aux_loss_scale
from pentatron.optim import AdamW
from pentatron.parallel.compile import CompileReport
from pentatron.parallel.context import ContextShard
from pentatron.parallel.data import DataParallelBase
from pentatron.parallel.expert import gather_experts
from pentatron.parallel.memory import MemoryReport
from pentatron.parallel.pipeline.engine import PipelineEngine, PipelineStepResult, measured_bubble
from pentatron.parallel.pipeline.stages import PipelineStage
from pentatron.parallel.placement import Placement
from pentatron.parallel.tensor import gather_full_tensor, sum_partial_grads
from pentatron.precision import wide, wide_dtype
from pentatron.schedules import make_schedule

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor]


def host_scalars(*scalars: torch.Tensor) -> list[float]:
    """0-dim device tensors (the loss, the norm) as Python floats with ONE device→host copy (through
    float64, which holds any of their dtypes' values exactly: the same numbers as `float(t)` each)."""
    return torch.stack([t.detach().double().reshape(()) for t in scalars]).tolist()


class StepRunner:
    def __init__(self, model: nn.Module, engine: DataParallelBase, ctx: ParallelContext, layout: ParallelLayout,
                 loss_fn: LossFn, stages: Sequence[PipelineStage] | None, hidden: int, train: TrainConfig,
                 data: DataConfig | None = None) -> None:
        self.model, self.engine, self.ctx, self.layout, self.loss_fn = model, engine, ctx, layout, loss_fn
        # Document masking (micro-batches come with their `Documents`): RoPE positions restart per document.
        self.restart_positions = data is not None and data.document_mask and data.document_positions
        # train.loss_chunk_tokens > 0: the LM head computes the loss in chunks from the targets (the full
        # logits never exist); 0: the model returns logits and `loss_fn` takes them.
        self.head_loss = train.loss_chunk_tokens > 0
        # The optimizer is its own object, over the elements this rank owns (whole parameters, or ZeRO
        # pieces), fed by the engine's reduced gradient shards.
        self.optimizer = AdamW(engine.slots, train)
        self.comm, self.device = ctx.comm, ctx.device
        self.loss_dtype = wide_dtype(engine.policy.grad_dtype)  # the logged loss: fp32, fp64 in an fp64 run
        self.stages = list(stages) if stages else None
        # Context parallelism: this rank keeps its share of every sequence, with the tokens' positions.
        self.shard = ContextShard(self.comm, layout) if layout.cp > 1 else None
        self.pipeline: PipelineEngine | None = None
        self.compiled: CompileReport | None = None  # the compiled regions (parallelize sets it)
        self.last_pipeline: PipelineStepResult | None = None
        # MoE layers: their balancing losses are scaled like each micro-batch's loss; after the step
        # their loads are summed over the data-parallel replicas (biases, metrics).
        self.has_moe = bool(moe_layers(model))
        self.has_partial = any(pl.tp_partial for pl in engine.placements.values())
        self.moe_metrics: dict[str, Any] = {}
        set_aux_loss_scale(model, 1 / layout.microbatches)
        if self.stages:
            schedule = make_schedule(layout.pp_schedule, layout.pp, layout.microbatches, layout.virtual)
            shards = layout.tp if layout.sp else 1  # sequence parallelism: stages exchange [b, s/tp, h]
            self.pipeline = PipelineEngine(
                self.stages, schedule, self.comm, ctx.local_rank("pp"), loss_fn, listener=engine,
                act_shape=lambda x: torch.Size((x.shape[0], x.shape[1] // shards, hidden)), head_loss=self.head_loss)

    @property
    def placements(self) -> dict[str, Placement]:
        return self.engine.placements

    # ------------------------------------------------------------------ one step
    def placed(self, micro_batches: Sequence[Batch], documents: Sequence[Documents] | None = None
               ) -> tuple[list[Batch], list[torch.Tensor | None]]:
        """The micro-batches on this rank's device, cut to its context-parallel share of each sequence, and
        each one's RoPE positions (`positions`)."""
        if documents is not None and len(documents) != len(micro_batches):
            raise ValueError(f"{len(documents)} Documents for {len(micro_batches)} micro-batches")
        batches = [(to_device(x, self.device), to_device(y, self.device)) for x, y in micro_batches]
        if self.shard is not None:
            batches = [(self.shard.take(x), self.shard.take(y)) for x, y in batches]
        return batches, self.positions(documents, len(batches))

    def forward_backward(self, micro_batches: Sequence[Batch],
                         on_micro_batch: Callable[[int], None] | None = None,
                         documents: Sequence[Documents] | None = None) -> torch.Tensor:
        """Every micro-batch's forward and backward (each loss divided by their number), gradients
        reduced over their data-parallel groups and tied copies summed; returns the step's mean loss over
        all micro-batches of all data-parallel replicas (the same number on every rank).
        `on_micro_batch(i)` is called before micro-batch i (without pp; diagnostics number them).
        `documents[i]`: where micro-batch i's documents start (of its whole sequences): attention stays
        inside each, on every layout (the context-parallel cores and every pipeline stage get them)."""
        self.engine.zero_grad()
        batches, positions = self.placed(micro_batches, documents)
        if self.pipeline is not None:
            result = self.pipeline.step(batches, positions, documents)
            self.last_pipeline = result
            # Only the last stage computes the loss: every pipeline rank logs the same number.
            loss = (wide(result.loss.detach()) if result.loss is not None
                    else torch.zeros((), dtype=self.loss_dtype, device=self.device))
            self.comm.broadcast(loss, "pp", src=self.layout.pp - 1)
        else:
            loss = torch.zeros((), dtype=self.loss_dtype, device=self.device)
            for i, (inputs, targets) in enumerate(batches):
                if on_micro_batch is not None:
                    on_micro_batch(i)
                # Only the last micro-step's backward synchronises gradients (DDP, ZeRO-1).
                self.engine.before_backward(0, last=i == len(batches) - 1)
                docs = () if documents is None else (documents[i],)  # unmasked: the model called as before
                step_loss = (self.model(inputs, positions[i], targets, *docs) if self.head_loss
                             else self.loss_fn(self.model(inputs, positions[i], None, *docs), targets))
                (step_loss / len(batches)).backward()
                self.engine.after_backward(0)
                loss += step_loss.detach()
            loss = loss / len(batches)
        self.engine.finish_grad_sync()
        self.engine.sync_tied_grads()
        self.sum_partial_grads()
        # Each data-parallel replica saw an equal share of the batch, and each cp rank an equal share of
        # every sequence: their mean is the step's loss.
        self.comm.all_reduce(loss, "dp" if self.layout.cp == 1 else "dp_cp")
        return loss / (self.layout.dp * self.layout.cp)

    def sum_partial_grads(self) -> None:
        """Sum the reduced gradients of the `Placement.tp_partial` parameters (the norms and MoE layers under
        SP, Qwen3's q/k norms) over tp: this rank's owned pieces of all of them in one all-reduce (per 25 MiB),
        once per step, before the gradient norm (which counts each of them 1/tp per tp rank)."""
        if self.has_partial:
            place = self.engine.place
            sum_partial_grads([g for p, g in self.engine.owned_param_grads() if place[p].tp_partial], self.comm)

    def positions(self, documents: Sequence[Documents] | None, n: int) -> list[torch.Tensor | None]:
        """Each micro-batch's RoPE positions of the tokens this rank holds: None (0..s−1), this cp rank's
        shard of them, or per sample [b, s_local] when positions restart at each document."""
        held = self.shard.positions if self.shard is not None else None
        if documents is None or not self.restart_positions:
            return [held] * n
        out: list[torch.Tensor | None] = []
        for docs in documents:
            p = docs.positions(self.device)
            out.append(p if held is None else p[:, held])
        return out

    def clip_grads(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm of the full gradient; returns the norm before clipping."""
        return self.engine.clip_grads(max_norm)

    def step(self, lr: float) -> None:
        self.optimizer.step(lr)
        self.engine.after_optimizer_step()
        if self.has_moe:
            self.moe_metrics = finish_step(self.model, self._sum_over_replicas)

    def wait_param_gather(self) -> None:
        """Wait ZeRO-1/2's parameter all-gathers still in flight after `step` (the next forward waits them
        module by module): before reading the weights outside a forward, and at the end of training."""
        self.engine.wait_param_gather()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Checkpoint tensors: the model's (keyed by name, tp shard and ZeRO range) and the optimizer's;
        loading in place into them and calling `after_load` restores the run."""
        out = {"model": self.engine.model_state(), "optim": self.optimizer.named_state()}
        if self.has_moe:  # the aux-free selection biases: state, though not parameters
            out["moe_bias"] = {f"{n}.router.expert_bias": m.router.expert_bias
                               for n, m in moe_layers(self.model).items()}
        return out

    def after_load(self) -> None:
        self.optimizer.load_named_state()

    def memory(self) -> MemoryReport:
        """This rank's model-state memory: parameters, gradients, optimizer state, fp32 masters."""
        return self.engine.memory(self.optimizer)

    def _sum_over_replicas(self, t: torch.Tensor) -> torch.Tensor:
        self.comm.all_reduce(t, self.engine.reduce_dim)  # the dense gradients' replicas (t on the device)
        if self.layout.sp and self.layout.tp > 1:  # each tp rank's MoE layers saw its sequence shard
            self.comm.all_reduce(t, "tp")
        return t

    def step_stats(self) -> dict[str, Any]:
        """Per-step figures: of the pipeline (a collective over pp: measured bubble, peak in flight), and
        per MoE layer of this rank's stages (`moe`: expert loads, imbalance, drops, balancing losses)."""
        out: dict[str, Any] = {"moe": self.moe_metrics} if self.moe_metrics else {}
        if self.last_pipeline is None:
            return out
        return {**out, "bubble": measured_bubble(self.last_pipeline, self.comm),
                "pp_peak_in_flight": self.last_pipeline.peak_in_flight}

    # ------------------------------------------------------------------ whole tensors (tests, exports)
    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This pipeline rank's parameters at their full shape, by name (collective over dp and tp)."""
        local = self.engine.full_parameters()
        return {n: gather_experts(gather_full_tensor(t, self.placements[n].tp, self.comm),
                                  self.placements[n].expert, self.comm) for n, t in local.items()}

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """This pipeline rank's reduced gradients at full shape, by name, assembled from the owned
        pieces each placement records (collective over dp and tp): call after `forward_backward`."""
        engine = self.engine
        flat = {p: torch.zeros(engine.place[p].numel, dtype=engine.policy.grad_dtype, device=self.device)
                for p in engine.params}
        pieces: dict[nn.Parameter, list[torch.Tensor]] = {}
        for p, g in engine.owned_param_grads():
            pieces.setdefault(p, []).append(g)
        for p, grads in pieces.items():
            pl = engine.place[p]
            if pl.zero is None:  # replicated over dp: every rank holds the whole reduced gradient
                flat[p].copy_(grads[0].reshape(-1))
            else:
                for piece, g in zip(pl.zero, grads, strict=True):
                    flat[p][piece.lo: piece.hi].copy_(g.reshape(-1))
        out = {}
        for p, f in flat.items():
            pl = engine.place[p]
            if pl.zero is not None:  # pieces are disjoint over the group ZeRO shards over: the sum assembles it
                # ("dp_shard" is that group under dp: all of dp, or HSDP's shard group)
                self.comm.all_reduce(f, "dp_shard" if pl.grad_dims == ("dp",) else "_".join(pl.grad_dims))
            out[pl.name] = gather_experts(gather_full_tensor(f.view(pl.local_shape), pl.tp, self.comm),
                                          pl.expert, self.comm)
        return out
