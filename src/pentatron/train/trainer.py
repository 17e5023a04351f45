"""The training loop: micro-batches, gradient accumulation, clipping, optimizer step, metrics, checkpoints."""

from __future__ import annotations

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
from pentatron.distributed.launch import local_device
from pentatron.models.llama import build_model
from pentatron.observe.metrics import MetricsLogger
from pentatron.observe.system import peak_flops, peak_memory_bytes
from pentatron.plan.flops import model_flops_per_token
from pentatron.train.grad_buffer import GradBuffer
from pentatron.train.optim import MixedPrecisionAdamW, clip_by_total_norm, grad_norm_squared, lr_at
from pentatron.train.precision import resolve_precision
from pentatron.train.recompute import apply_recompute


def resolve_dataset(cfg: Config, vocab_size: int) -> Path:
    if cfg.data.path:
        return Path(cfg.data.path)
    return ensure_default_dataset(Path(cfg.data.cache_dir), vocab_size=vocab_size,
                                  max_bytes=cfg.data.default_corpus_bytes)


class Trainer:
    def __init__(self, cfg: Config, dataset_dir: Path | None = None) -> None:
        self.cfg = cfg
        tr = cfg.train
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.dp = resolved_dp(cfg, self.world_size)
        self.dp_rank = self.rank % self.dp
        self.device = local_device(tr.device)
        self.policy = resolve_precision(tr.precision, self.device)
        torch.manual_seed(tr.seed)

        self.model_cfg = cfg.model_config()
        self.model = build_model(self.model_cfg, seed=tr.seed, device=self.device, dtype=self.policy.param_dtype)
        apply_recompute(self.model, tr.recompute)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.names = {p: n for n, p in self.model.named_parameters()}
        self.grads = GradBuffer(self.params, dtype=self.policy.grad_dtype)
        self.optimizer = MixedPrecisionAdamW(self.params, tr, self.policy.master_dtype)

        if dataset_dir is None:
            # Rank 0 tokenizes the default corpus once; the others wait rather than race on the cache.
            if self.rank == 0:
                dataset_dir = resolve_dataset(cfg, self.model_cfg.vocab_size)
            if dist.is_initialized():
                dist.barrier()
            dataset_dir = dataset_dir or resolve_dataset(cfg, self.model_cfg.vocab_size)
        self.dataset = TokenDataset(dataset_dir)
        self.dataset.check_vocab(self.model_cfg.vocab_size)
        self.loader = TokenLoader(self.dataset, seq_len=tr.seq_len, micro_batch=tr.micro_batch,
                                  global_batch=tr.global_batch, dp_rank=self.dp_rank, dp_size=self.dp,
                                  seed=tr.seed)
        self.step = 0
        self.store = CheckpointStore(Path(cfg.checkpoint.dir), keep=cfg.checkpoint.keep) \
            if cfg.checkpoint.dir else None
        if self.store is not None and cfg.checkpoint.resume:
            self._resume()

        self.tokens_per_step = tr.global_batch * tr.seq_len
        self.flops_per_token = model_flops_per_token(self.model_cfg, tr.seq_len)
        self.peak_flops, self.peak_source = peak_flops(self.device, self.policy.param_dtype, tr.peak_tflops)

    # ------------------------------------------------------------------ one optimizer step
    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def train_step(self) -> dict[str, Any]:
        micro_batches = self.loader.next_step()
        self.grads.zero()
        loss_sum = torch.zeros((), device=self.device)
        for inputs, targets in micro_batches:
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            loss = self.loss_fn(self.model(inputs), targets)
            # Mean over the rank's micro-batches; the data-parallel reduction averages over ranks.
            (loss / len(micro_batches)).backward()
            loss_sum += loss.detach()
        loss = loss_sum / len(micro_batches)

        grads = [p.main_grad for p in self.params]
        norm = grad_norm_squared(grads).sqrt()
        clip_by_total_norm(grads, norm, self.cfg.train.clip)
        lr = lr_at(self.step, self.cfg.train)
        self.optimizer.step(lr)
        self.step += 1
        return {"step": self.step, "loss": float(loss), "grad_norm": float(norm), "lr": lr}

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        is_main = self.rank == 0
        logger = MetricsLogger(Path(cfg.log.dir), cfg.train.steps, cfg.log.tensorboard,
                               cfg.log.progress, start_step=self.step) if is_main else None
        if is_main:
            n = sum(p.numel() for p in self.params)
            print(f"pentatron: {self.model_cfg.name} ({n / 1e6:.2f}M parameters), world={self.world_size} "
                  f"dp={self.dp}, device={self.device}, precision={self.policy.name}, "
                  f"recompute={cfg.train.recompute}, {len(self.dataset):,} tokens in dataset, "
                  f"peak {self.peak_flops / 1e12:.2f} TFLOP/s ({self.peak_source})", flush=True)
        records = []
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
                    comm_bytes={},
                )
                if not math.isfinite(record["loss"]):
                    raise FloatingPointError(f"loss became {record['loss']} at step {self.step}")
                records.append(record)
                if logger is not None:
                    console = self.step % cfg.log.every == 0 or self.step == cfg.train.steps
                    logger.log(record, console=console)
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
        return {"model": {self.names[p]: p for p in self.params},
                "optim": self.optimizer.named_state([self.names[p] for p in self.params])}

    def save_checkpoint(self) -> Path:
        assert self.store is not None
        meta = {"step": self.step, "loader": self.loader.state_dict(), "model": self.model_cfg.to_dict()}
        return self.store.save(self.step, self.state_dict(), meta)

    def _resume(self) -> None:
        assert self.store is not None
        latest = self.store.latest()
        if latest is None:
            return
        state = self.state_dict()
        meta = self.store.load(latest, state)
        self.optimizer.load_named_state(state["optim"], [self.names[p] for p in self.params])
        self.step = meta["step"]
        self.loader.load_state_dict(meta["loader"])
        if self.rank == 0:
            print(f"pentatron: resumed from {latest} at step {self.step}", flush=True)
