"""The training loop: micro-batches, gradient accumulation, clipping, optimizer step, metrics, checkpoints."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pentatron.checkpoint.store import CheckpointStore
from pentatron.config import Config, resolved_dp
from pentatron.data.loader import TokenDataset, TokenLoader
from pentatron.data.tokenize import ensure_default_dataset
from pentatron.distributed.context import ParallelContext, resolve_degrees
from pentatron.distributed.launch import local_device
from pentatron.models.llama import build_model
from pentatron.observe.metrics import MetricsLogger
from pentatron.observe.system import peak_flops, peak_memory_bytes
from pentatron.parallel.parallelize import parallelize
from pentatron.parallel.pipeline.engine import PipelineEngine, measured_bubble
from pentatron.parallel.pipeline.schedules import make_schedule
from pentatron.parallel.pipeline.stages import sync_tied_grads
from pentatron.parallel.pipeline.trace import write_rank_trace
from pentatron.parallel.tensor import vocab_parallel_cross_entropy
from pentatron.plan.flops import model_flops_per_token
from pentatron.precision import resolve_precision
from pentatron.train.lr_schedule import lr_at


def resolve_dataset(cfg: Config, vocab_size: int) -> Path:
    if cfg.data.path:
        return Path(cfg.data.path)
    return ensure_default_dataset(Path(cfg.data.cache_dir), vocab_size=vocab_size,
                                  max_bytes=cfg.data.default_corpus_bytes)


class Trainer:
    def __init__(self, cfg: Config, dataset_dir: Path | None = None) -> None:
        self.cfg = cfg
        tr = cfg.train
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.device = local_device(tr.device)
        par = cfg.parallel
        degrees = resolve_degrees(world_size, dp=resolved_dp(cfg, world_size), tp=par.tp, pp=par.pp,
                                  cp=par.cp, ep=par.ep)
        self.ctx = ParallelContext.from_degrees(degrees, self.device)
        self.rank, self.world_size = self.ctx.rank, self.ctx.world_size
        self.dp, self.dp_rank = self.ctx.dp_size, self.ctx.dp_rank
        self.comm = self.ctx.comm
        self.policy = resolve_precision(tr.precision, self.device)
        torch.manual_seed(tr.seed)

        self.model_cfg = cfg.model_config()
        model = build_model(self.model_cfg, seed=tr.seed, device=self.device, dtype=self.policy.param_dtype)
        self.n_params = sum(p.numel() for p in model.parameters())
        # Pipeline stages, TP, recompute, then data parallel / ZeRO: the engine owns gradient sync and
        # the optimizer. With pp > 1 only this rank's stages remain (`self.model` is a LocalStages).
        self.engine = parallelize(model, self.ctx, cfg, self.policy)
        self.model = self.engine.model
        self.pp, self.pp_rank = self.ctx.size("pp"), self.ctx.local_rank("pp")
        self.pipeline = self._pipeline_engine() if self.pp > 1 else None
        self.last_pipeline = None
        self.params = self.engine.params
        self.names = self.engine.names
        self.optimizer = self.engine.optimizer
        self.memory = self.engine.memory()

        if dataset_dir is None:
            # Rank 0 tokenizes the default corpus once; the others wait rather than race on the cache.
            if self.rank == 0:
                dataset_dir = resolve_dataset(cfg, self.model_cfg.vocab_size)
            self.comm.barrier()
            dataset_dir = dataset_dir or resolve_dataset(cfg, self.model_cfg.vocab_size)
        self.dataset = TokenDataset(dataset_dir)
        self.dataset.check_vocab(self.model_cfg.vocab_size)
        self.loader = TokenLoader(self.dataset, seq_len=tr.seq_len, micro_batch=tr.micro_batch,
                                  global_batch=tr.global_batch, dp_rank=self.dp_rank, dp_size=self.dp,
                                  seed=tr.seed)
        self.step = 0
        self.store = CheckpointStore(Path(cfg.checkpoint.dir), keep=cfg.checkpoint.keep, barrier=self.comm.barrier) \
            if cfg.checkpoint.dir else None
        if self.store is not None and cfg.checkpoint.resume:
            self._resume()

        self.tokens_per_step = tr.global_batch * tr.seq_len
        self.flops_per_token = model_flops_per_token(self.model_cfg, tr.seq_len)
        self.peak_flops, self.peak_source = peak_flops(self.device, self.policy.param_dtype, tr.peak_tflops)

    # ------------------------------------------------------------------ one optimizer step
    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.ctx.size("tp") > 1:
            # The model returns this rank's vocabulary slice of the logits; never gather them.
            return vocab_parallel_cross_entropy(logits.float(), targets, self.comm)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def _pipeline_engine(self) -> PipelineEngine:
        par, tr = self.cfg.parallel, self.cfg.train
        v = par.pp_virtual if par.pp_schedule == "interleaved" else 1
        m = tr.global_batch // (self.dp * tr.micro_batch)
        schedule = make_schedule(par.pp_schedule, self.pp, m, v)
        tp = self.ctx.size("tp")
        shards = tp if par.sp else 1  # sequence parallelism: stages exchange [b, s/tp, h] slices
        hidden = self.model_cfg.hidden_size
        return PipelineEngine(self.model.stages, schedule, self.comm, self.pp_rank, self.loss_fn,
                              act_shape=lambda x: torch.Size((x.shape[0], x.shape[1] // shards, hidden)))

    def _forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Every micro-batch's forward and backward (gradients accumulate, each loss divided by their
        number); returns this rank's mean loss over them."""
        if self.pipeline is not None:
            # Gradients are synchronised after the whole schedule (the backward order interleaves
            # micro-batches), so no backward is "the last" one.
            self.engine.micro_step(last=False)
            result = self.pipeline.step([(x.to(self.device), y.to(self.device)) for x, y in micro_batches])
            self.last_pipeline = result
            # Only the last stage computes the loss: every pipeline rank logs the same number.
            loss = result.loss.detach().float() if result.loss is not None else torch.zeros((), device=self.device)
            self.comm.broadcast(loss, "pp", src=self.pp - 1)
            # The tied embedding's gradient is summed over its two stages before any dp reduction
            # (ZeRO shards the first and the last rank's gradients with different layouts).
            sync_tied_grads(self.model.stages, self.comm, self.pp_rank, self.pp)
            return loss
        loss_sum = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            # Only the last micro-step's backward synchronises gradients (DDP, ZeRO-1).
            self.engine.micro_step(last=i == len(micro_batches) - 1)
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            loss = self.loss_fn(self.model(inputs), targets)
            # Mean over the rank's micro-batches; the data-parallel reduction averages over ranks.
            (loss / len(micro_batches)).backward()
            loss_sum += loss.detach()
        return loss_sum / len(micro_batches)

    def train_step(self) -> dict[str, Any]:
        self.comm.ledger.begin_step()
        micro_batches = self.loader.next_step()
        self.engine.zero_grad()
        loss = self._forward_backward(micro_batches)
        self.engine.finish_grad_sync()
        norm = self.engine.clip_grads(self.cfg.train.clip)
        lr = lr_at(self.step, self.cfg.train)
        self.engine.step(lr)
        # The logged loss is the mean over dp ranks (each rank saw an equal share of the batch).
        self.comm.all_reduce(loss, "dp")
        loss = loss / self.dp
        self.step += 1
        extra: dict[str, Any] = {}
        if self.last_pipeline is not None:
            extra["bubble"] = measured_bubble(self.last_pipeline, self.comm)
            extra["pp_peak_in_flight"] = self.last_pipeline.peak_in_flight
            self._write_pp_trace()
        self.last_comm = comm = self.comm.ledger.end_step()
        return {"step": self.step, "loss": float(loss), "grad_norm": float(norm), "lr": lr,
                "comm_bytes": comm.bytes_map(), "comm_calls": comm.calls_map(), **extra}

    def _write_pp_trace(self) -> None:
        """log.pp_trace: one Chrome trace file per pipeline rank (from dp/tp rank 0) for each logged step;
        `pentatron schedule` / `trace.read_chrome_trace` merge a step's files into one timeline."""
        cfg = self.cfg
        if not cfg.log.pp_trace or self.last_pipeline is None or self.dp_rank != 0 or self.ctx.local_rank("tp"):
            return
        if self.step % cfg.log.every and self.step != cfg.train.steps:
            return
        path = Path(cfg.log.dir) / "pp_trace" / f"step{self.step:06d}.rank{self.pp_rank}.json"
        write_rank_trace(path, self.last_pipeline.slots, self.pp_rank, self.pp, cfg.parallel.pp_schedule)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        is_main = self.rank == 0
        logger = MetricsLogger(Path(cfg.log.dir), cfg.train.steps, cfg.log.tensorboard,
                               cfg.log.progress, start_step=self.step) if is_main else None
        if is_main:
            print(f"pentatron: {self.model_cfg.name} ({self.n_params / 1e6:.2f}M parameters), "
                  f"world={self.world_size} dp={self.dp} tp={cfg.parallel.tp}{' +sp' if cfg.parallel.sp else ''} "
                  f"pp={self.pp}{f' ({cfg.parallel.pp_schedule})' if self.pp > 1 else ''} "
                  f"zero={cfg.parallel.zero}, device={self.device}, "
                  f"precision={self.policy.name}, recompute={cfg.train.recompute}, "
                  f"{len(self.dataset):,} tokens in dataset, "
                  f"peak {self.peak_flops / 1e12:.2f} TFLOP/s ({self.peak_source})", flush=True)
            print(f"pentatron: model state per rank (ZeRO-{cfg.parallel.zero}, dp={self.dp}): "
                  f"{self.memory.describe()}", flush=True)
        records = []
        last_table = None
        try:
            while self.step < cfg.train.steps:
                start = time.perf_counter()
                record = self.train_step()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - start
                tokens_per_s = self.tokens_per_step / elapsed
                record.update(
                    tokens_per_s=tokens_per_s,
                    mfu=tokens_per_s * self.flops_per_token / (self.peak_flops * self.world_size),
                    peak_mem_bytes=peak_memory_bytes(self.device),
                    step_time_s=elapsed,
                )
                if not records:  # the first record of a run carries the per-rank memory accounting
                    record["memory"] = self.engine.memory().to_dict()
                if not math.isfinite(record["loss"]):
                    raise FloatingPointError(f"loss became {record['loss']} at step {self.step}")
                records.append(record)
                if logger is not None:
                    console = self.step % cfg.log.every == 0 or self.step == cfg.train.steps
                    logger.log(record, console=console)
                    # The comm table: on the first step, and again whenever the pattern changes.
                    table = self.last_comm.table()
                    if console and table != last_table:
                        print(f"pentatron: communication per rank, step {self.step}:\n{table}", flush=True)
                        last_table = table
                if self.store is not None and self._checkpoint_due():
                    self.save_checkpoint()
        finally:
            if logger is not None:
                logger.close()
        return records

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_due(self) -> bool:
        every = self.cfg.checkpoint.every
        return self.step == self.cfg.train.steps or (every > 0 and self.step % every == 0)

    def state_dict(self) -> dict[str, Any]:
        """Tensors keyed by parameter name: whole tensors when replicated (DCP writes one copy),
        "<name>|tp<i>/<n>" for tensor-parallel shard i of n, and "<key>[lo:hi]" ranges of the flattened
        local parameter for ZeRO shards (each rank writes its own). Pipeline ranks hold disjoint names."""
        return self.engine.state_dict()

    def save_checkpoint(self) -> Path:
        assert self.store is not None
        meta = {"step": self.step, "loader": self.loader.state_dict(), "model": self.model_cfg.to_dict(),
                "layout": self.layout_meta()}
        return self.store.save(self.step, self.state_dict(), meta)

    def layout_meta(self) -> dict[str, Any]:
        """What the checkpoint's tensor keys and shapes depend on, identical on every rank (so each rank
        reaches the same resume decision): the degrees, the ZeRO stage, and the bucketing (the padded
        bucket sizes themselves when pp = 1; with pp > 1 they differ per stage, so bucket_mb), plus the
        pipeline schedule that decides which layers a rank holds."""
        par = self.cfg.parallel
        meta = self.engine.layout_meta()
        meta.update(tp=self.ctx.size("tp"), pp=self.pp)
        if self.pp > 1:
            meta.pop("buckets", None)
            meta.update(bucket_mb=par.bucket_mb, pp_schedule=par.pp_schedule,
                        pp_virtual=par.pp_virtual if par.pp_schedule == "interleaved" else 1)
        return meta

    @staticmethod
    def layout_differences(saved: dict[str, Any], mine: dict[str, Any]) -> list[str]:
        """The layout fields in which a checkpoint and this run differ (empty: it can be resumed).
        Checkpoints written before tp/pp were recorded were tp = pp = 1. Replicated state (ZeRO-0) is
        keyed independently of dp and bucketing, so those may change."""
        saved = {"tp": 1, "pp": 1, **saved}
        keys = sorted(set(saved) | set(mine))
        diff = [k for k in keys if saved.get(k) != mine.get(k)
                and (k in saved and k in mine or k in ("tp", "pp", "pp_schedule", "pp_virtual"))]
        if saved.get("zero") == 0 and mine.get("zero") == 0:
            diff = [k for k in diff if k not in ("dp", "buckets", "bucket_mb")]
        return diff

    def _resume(self) -> None:
        assert self.store is not None
        latest = self.store.latest()
        if latest is None:
            return
        saved = json.loads((latest / "meta.json").read_text()).get("layout", {"zero": 0})
        mine = self.layout_meta()
        diff = self.layout_differences(saved, mine)
        if diff:
            # Shards are keyed by tp coordinates and ranges of the flat layout; re-sharding is not
            # implemented yet. Every rank sees the same two layouts, so every rank raises.
            raise RuntimeError(f"checkpoint {latest} was written with layout {saved}, this run has layout {mine} "
                               f"(they differ in {', '.join(diff)}); resuming into another layout is not "
                               "supported yet: resume with the same parallel.dp, tp, pp, zero, bucket_mb, "
                               "pp_schedule and pp_virtual")
        state = self.state_dict()
        meta = self.store.load(latest, state)
        self.engine.after_load()
        self.step = meta["step"]
        self.loader.load_state_dict(meta["loader"])
        if self.rank == 0:
            print(f"pentatron: resumed from {latest} at step {self.step}", flush=True)
