"""The training loop: micro-batches, gradient accumulation, clipping, optimizer step, metrics, checkpoints."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from pentatron.checkpoint.async_save import AsyncCheckpointer
from pentatron.checkpoint.errors import CheckpointWriteError
from pentatron.checkpoint.resume import resume_target
from pentatron.checkpoint.store import CheckpointStore
from pentatron.config import Config
from pentatron.data.errors import DataError
from pentatron.data.eval_split import eval_set, eval_sets, training_tokens
from pentatron.data.loader import TokenDataset, TokenLoader
from pentatron.data.mixture import MixtureLoader, exhaustion, mixture_problems
from pentatron.data.tokenize import ensure_default_dataset
from pentatron.device_clock import wait_for_compute
from pentatron.models.documents import documents_record
from pentatron.observe.metrics import COMM_LEGEND, MetricsLogger, wrapped
from pentatron.observe.report import layout_key
from pentatron.observe.run_observer import RunObserver
from pentatron.observe.system import bounded_mfu, peak_flops
from pentatron.observe.wandb_log import WandbRun
from pentatron.parallel.compile import eager_fp8_linears
from pentatron.parallel.pipeline.trace import write_rank_trace
from pentatron.parallel.step_runner import host_scalars
from pentatron.plan.flops import DocumentLengths, model_flops_per_token
from pentatron.plan.unmeasured import EAGER_FP8_ON_GPU
from pentatron.schedules import idle_warning
from pentatron.train.lr_schedule import LrSchedule, resumed_schedule
from pentatron.train.model_state import ModelState
from pentatron.train.nonfinite import NonFiniteGuard, NonFiniteStop
from pentatron.train.sigterm import SigtermWatch
from pentatron.train.validation import Validation


def resolve_dataset(cfg: Config, vocab_size: int) -> Path:
    if cfg.data.path:
        return Path(cfg.data.path)
    return ensure_default_dataset(Path(cfg.data.cache_dir), vocab_size=vocab_size,
                                  max_bytes=cfg.data.default_corpus_bytes)


class Trainer:
    def __init__(self, cfg: Config, dataset_dir: Path | None = None) -> None:
        """`dataset_dir`: data.path's directory when already resolved (tests); a mixture reads data.sources."""
        if dataset_dir is not None and cfg.data.sources:
            raise ValueError("Trainer(dataset_dir=...) is data.path's directory; this config trains on data.sources")
        self.cfg = cfg
        tr = cfg.train
        self.state = ModelState(cfg)
        with self.state.closed_on_error():  # e.g. a damaged checkpoint at resume: every rank raises
            self.ctx, self.device, self.watchdog = self.state.ctx, self.state.device, self.state.watchdog
            self.rank, self.world_size = self.ctx.rank, self.ctx.world_size
            self.dp, self.dp_rank = self.ctx.dp_size, self.ctx.dp_rank
            self.comm = self.ctx.comm
            self.policy, self.model_cfg, self.n_params = self.state.policy, self.state.model_cfg, self.state.n_params
            self.runner = self.state.runner
            self.engine = self.runner.engine
            self.model = self.runner.model  # with pp > 1: this rank's stages (a LocalStages)
            self.pp, self.pp_rank = self.ctx.size("pp"), self.ctx.local_rank("pp")
            self.params = self.engine.params
            self.names = self.engine.names
            self.optimizer = self.runner.optimizer
            self.memory = self.runner.memory()

            self.loader, sets = self._data(dataset_dir)
            self.validation = Validation(cfg.eval, tr, sets, self.runner, self.dp_rank, self.dp,
                                         cfg.data.document_mask) if cfg.eval.every > 0 else None
            self.stopped_by: list[str] = []  # data.on_exhausted = "stop": the lines that ended the run early
            self.step = 0
            self.lr_schedule = LrSchedule(tr)  # a resume may re-shape it (`_resume`)
            self.guard = NonFiniteGuard(tr.nonfinite)
            self.store = CheckpointStore(Path(cfg.checkpoint.dir), keep=cfg.checkpoint.keep, barrier=self.comm.barrier,
                                         watch=self.comm.outside) if cfg.checkpoint.dir else None
            if self.store is not None:
                self.store.clean_stale()
                if cfg.checkpoint.resume:
                    self._resume()
            self.async_saver = AsyncCheckpointer(self.store) if self.store and cfg.checkpoint.async_save else None
            self.sigterm = SigtermWatch() if cfg.checkpoint.save_on_sigterm else None
            self.save_blocked_s: list[float] = []  # training time each save blocked (staging only when async)

            self.tokens_per_step = tr.global_batch * tr.seq_len
            self.flops_per_token = model_flops_per_token(self.model_cfg, tr.seq_len)
            self.peak_flops, self.peak_source = peak_flops(self.device, self.policy.param_dtype, tr.peak_tflops)
            self._stated_peak = ""  # the peak as stated, once a faster step has raised it (`_raise_peak`)
            self.observer = RunObserver(cfg, self.ctx, self.model, self.engine, self.loader, self.watchdog,
                                        model_state=lambda: self.runner.memory().total)
            self.wandb: WandbRun | None = None  # log.wandb: rank 0's W&B run, opened by fit, finished by the summary


    def _data(self, dataset_dir: Path | None) -> tuple[TokenLoader | MixtureLoader, Any]:
        """The training loader and the validation data: data.path's (or the built-in corpus) or data.sources'.
        A holdout ([eval]) is never trained on (data/eval_split.py): per source for a mixture."""
        cfg, tr, vocab = self.cfg, self.cfg.train, self.model_cfg.vocab_size
        shape = dict(seq_len=tr.seq_len, micro_batch=tr.micro_batch, global_batch=tr.global_batch,
                     dp_rank=self.dp_rank, dp_size=self.dp, seed=tr.seed)
        if cfg.data.sources:
            datasets = [TokenDataset(Path(s.path)) for s in cfg.data.sources]
            names, weights = [s.label() for s in cfg.data.sources], [s.weight for s in cfg.data.sources]
            for ds in datasets:
                ds.check_vocab(vocab)
            if problems := mixture_problems(datasets, names):
                raise DataError("; ".join(problems))
            self.dataset = datasets[0]  # its tokenizer is the run's (`pentatron generate`)
            loader = MixtureLoader(datasets, names, weights, **shape,
                                   train_tokens=[training_tokens(cfg.eval, len(d)) for d in datasets])
            return loader, eval_sets(cfg.eval, datasets, names, weights, tr.seq_len, vocab)
        if dataset_dir is None:
            # Rank 0 tokenizes the default corpus once; the others wait rather than race on the cache.
            if self.rank == 0:
                dataset_dir = resolve_dataset(cfg, vocab)
            self.comm.barrier()
            dataset_dir = dataset_dir or resolve_dataset(cfg, vocab)
        self.dataset = TokenDataset(dataset_dir)
        self.dataset.check_vocab(vocab)
        loader = TokenLoader(self.dataset, **shape, train_tokens=training_tokens(cfg.eval, len(self.dataset)))
        return loader, eval_set(cfg.eval, self.dataset, tr.seq_len, vocab)

    def data_tokens(self) -> dict[str, int]:
        """Tokens trained per source so far (a mixture's accounting; restored with the loader at a resume)."""
        counts = self.loader.source_samples(self.loader.consumed_samples)
        return {n: int(c) * self.cfg.train.seq_len for n, c in zip(self.loader.source_names, counts, strict=True)}

    def close(self) -> None:
        """The run is over on this rank (after its summary): see `ModelState.close`."""
        if self.wandb is not None:  # still open: the run did not reach its summary
            self.wandb.finish(None)
        self.state.close()

    # ------------------------------------------------------------------ one optimizer step
    def train_step(self) -> dict[str, Any]:
        self.comm.ledger.begin_step()
        self.observer.begin_step(self.step + 1)
        batches = self.loader.next_step()
        documents = [self.loader.documents(x) for x, _ in batches] if self.cfg.data.document_mask else None
        loss = self.runner.forward_backward(batches, on_micro_batch=self.observer.micro, documents=documents)
        self.observer.after_backward()
        norm = self.runner.clip_grads(self.cfg.train.clip)
        lr = self.lr_schedule.at(self.step)
        # Loss and norm are the same on every rank: every rank takes the same decision. One host copy.
        loss_value, norm_value = host_scalars(loss, norm)
        problem = self.guard.check(self.step + 1, loss_value, norm_value)
        if problem is None:
            self.runner.step(lr)
            if self.observer.numerics is not None and self.observer.numerics.active:
                self.runner.wait_param_gather()  # ‖Δw‖ reads the weights their all-gathers still write
        self.observer.after_optimizer()
        self.step += 1
        extra = self.runner.step_stats()
        self._write_pp_trace()
        self.last_comm = comm = self.comm.ledger.end_step()
        if documents is not None:  # what masked attention computed; the MFU numerator follows it
            extra["documents"] = documents_record(documents)
        if isinstance(self.loader, MixtureLoader):
            extra["data_tokens"] = self.data_tokens()
        return {"step": self.step, "loss": loss_value, "grad_norm": norm_value, "lr": lr,
                "comm_bytes": comm.bytes_map(), "comm_calls": comm.calls_map(), **extra,
                "skipped_steps": self.guard.skipped, **({"nonfinite": problem} if problem else {})}

    def _flops_per_token(self, record: dict[str, Any]) -> float:
        """The MFU numerator of this step (`plan.flops.MFU_CONVENTION`): under document masking attention is
        counted over each document's square, from this rank's documents of the step (rank 0's on rank 0,
        which logs); otherwise the run's constant."""
        docs = record.get("documents")
        if docs is None:
            return self.flops_per_token
        return model_flops_per_token(self.model_cfg, self.cfg.train.seq_len,
                                     documents=DocumentLengths(docs["mean_tokens"], docs["mean_sq_tokens"]))

    def _raise_peak(self, achieved: float) -> None:
        """This step did more model FLOP/s per rank than the peak MFU divides by: that peak was low, and the
        fastest step's rate is the peak from now on (`observe.system.bounded_mfu`); said on the first raise."""
        if not self._stated_peak:
            self._stated_peak = f"{self.peak_flops / 1e12:.4g} TFLOP/s ({self.peak_source})"
            if self.rank == 0:
                print(f"pentatron: warning: step {self.step} did {achieved / 1e12:.4g} TFLOP/s of model FLOPs per "
                      f"rank, above the peak {self._stated_peak}: MFU is taken against the fastest step's rate "
                      "from now on", file=sys.stderr, flush=True)
        self.peak_flops = achieved
        self.peak_source = f"raised to step {self.step}'s rate, above the stated {self._stated_peak}"

    def _write_pp_trace(self) -> None:
        """log.pp_trace: one Chrome trace file per pipeline rank (from dp/tp rank 0) for each logged step;
        `pentatron schedule` / `trace.read_chrome_trace` merge a step's files into one timeline."""
        cfg = self.cfg
        result = self.runner.last_pipeline
        if not cfg.log.pp_trace or result is None or self.dp_rank != 0 or self.ctx.local_rank("tp"):
            return
        if self.step % cfg.log.every and self.step != cfg.train.steps:
            return
        path = Path(cfg.log.dir) / "pp_trace" / f"step{self.step:06d}.rank{self.pp_rank}.json"
        write_rank_trace(path, result.slots, self.pp_rank, self.pp, cfg.parallel.pp_schedule)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        is_main = self.rank == 0
        if is_main and cfg.log.wandb and self.wandb is None:
            self.wandb = WandbRun(Path(cfg.log.dir), cfg.log.wandb_project, cfg.log.wandb_name, cfg.log.wandb_mode,
                                  cfg.resolved_dict(self.world_size))
        logger = MetricsLogger(Path(cfg.log.dir), cfg.train.steps, cfg.log.tensorboard,
                               cfg.log.progress, start_step=self.step, wandb=self.wandb) if is_main else None
        if is_main:
            print(f"pentatron: {self.model_cfg.name} ({self.n_params / 1e6:.2f}M parameters), "
                  f"world={self.world_size} dp={self.dp} tp={cfg.parallel.tp}{' +sp' if cfg.parallel.sp else ''} "
                  f"pp={self.pp}{f' ({cfg.parallel.pp_schedule})' if self.pp > 1 else ''} "
                  + f"cp={cfg.parallel.cp}{f' ({cfg.parallel.cp_mode})' if cfg.parallel.cp > 1 else ''} "
                  f"ep={cfg.parallel.ep} zero={cfg.parallel.zero}, device={self.device}, "
                  f"precision={self.policy.name}, recompute={cfg.train.recompute}", flush=True)
            data = (f"{sum(len(s.dataset) for s in self.loader.sources):,} tokens in {len(self.loader.sources)} data "
                    "sources" if isinstance(self.loader, MixtureLoader) else f"{len(self.dataset):,} tokens in dataset")
            print(wrapped(f"pentatron: {data}; peak {self.peak_flops / 1e12:.2f} TFLOP/s ({self.peak_source})"),
                  flush=True)
            print(f"pentatron: model state per rank (ZeRO-{cfg.parallel.zero}, dp={self.dp}): "
                  f"{self.memory.describe()}", flush=True)
            lay = cfg.layout(self.world_size)
            if idle := idle_warning(lay.pp_schedule, lay.pp, lay.microbatches, lay.virtual, lay.dp, lay.micro_batch):
                print(f"pentatron: {idle}", flush=True)
            if cfg.train.fp8 != "off" and self.device.type == "cuda" and (eager := eager_fp8_linears(self.model)):
                print(wrapped(f"pentatron: warning: {len(eager)} FP8 linears (e.g. {eager[0]}) run outside compiled "
                              f"regions: {EAGER_FP8_ON_GPU}"), flush=True)
        records = []
        last_table = None
        # every record names its layout and where this start began: the report compares a prediction
        # only with the steps run in the layout it predicts (a run may resume in another)
        segment = {"layout": layout_key(cfg, self.world_size), "start_step": self.step}
        try:
            while self.step < cfg.train.steps:
                if not records:  # this start's first step (later ones are asked at the end of the step before)
                    self._say(self._ran_out(first=True), is_main)
                start = time.perf_counter()
                record = self.train_step()
                wait_for_compute(self.device)  # not the parameter all-gathers in flight: they overlap the next step
                elapsed = time.perf_counter() - start
                tokens_per_s = self.tokens_per_step / elapsed
                flops_per_token = self._flops_per_token(record)
                mfu, peak = bounded_mfu(tokens_per_s * flops_per_token / self.world_size, self.peak_flops)
                if peak > self.peak_flops:
                    self._raise_peak(peak)
                record.update(
                    tokens_per_s=tokens_per_s,
                    mfu=mfu,
                    model_flops_per_token=flops_per_token,
                    step_time_s=elapsed,
                    **self.observer.peak_memory(),  # since training began (set-up excluded)
                    **segment,
                )
                if not records:  # the first record of a run carries the per-rank memory accounting
                    record["memory"] = self.runner.memory().to_dict()
                record.update(self.observer.end_step(record))
                stopping = "nonfinite" in record and self.guard.action == "stop"
                # data.on_exhausted: the next step would start a source's new epoch — said after this step's
                # row; with "stop" this step is the run's last (validated and saved as the last one is)
                ran_out = self._ran_out(first=False) if self.step < cfg.train.steps else []
                ending = bool(self.stopped_by)
                if self.validation is not None and (self.validation.due(self.step) or ending) and not stopping:
                    record["val"] = self.validation.run()  # after the step's timing: not in tokens/s or MFU
                records.append(record)
                if logger is not None:
                    console = self.step % cfg.log.every == 0 or self.step == cfg.train.steps or ending
                    logger.log(record, console=console)
                    # The comm table: on the first step, and again whenever the pattern changes.
                    table = self.last_comm.table()
                    # (the pattern of ops and calls: an uneven all-to-all's bytes differ every step)
                    if console and self.last_comm.calls_map() != last_table:
                        head = f"pentatron: communication per rank, step {self.step} {COMM_LEGEND}:"
                        print(wrapped(head) + f"\n{table}", flush=True)
                        last_table = self.last_comm.calls_map()
                if "nonfinite" in record and self.guard.action == "stop":  # after logging: the record shows it
                    raise NonFiniteStop(self.guard.stop_message(record["nonfinite"]))
                if self.step == cfg.train.steps and self.guard.never_updated:  # 'skip' skipped every step
                    raise NonFiniteStop(self.guard.never_updated_message(self.step - segment["start_step"]))
                self._say(ran_out, is_main)
                stop = self.sigterm is not None and self.sigterm.agreed(self.comm, self.world_size, self.device)
                # a periodic save waits for the job's first update: until then the model is what it started from
                if self.store is not None and (((self._checkpoint_due() or ending) and not self.guard.never_updated)
                                               or stop):
                    self.save_checkpoint()
                if stop:
                    raise self.sigterm.stopped(self.step, self.cfg.checkpoint.dir)
                if ending:
                    break
            self.runner.wait_param_gather()  # no ZeRO-1/2 parameter all-gather left in flight after the last step
        finally:
            if self.sigterm is not None:
                self.sigterm.close()
            if self.async_saver is not None:
                self.async_saver.wait()  # the last save in flight is published (or reported) before exit
            if logger is not None:
                logger.close()
            self.observer.close(records)
        if self.async_saver is not None and self.async_saver.last_failed:  # a run never ends on a lost save
            raise CheckpointWriteError(f"the run's last {self.async_saver.failed[-1]}")
        return records

    def _ran_out(self, first: bool) -> list[str]:
        """data.on_exhausted: the lines for sources (or data.path) that run out within the next step; with "stop"
        `stopped_by` keeps them (the run ends before that step) — at this start's first step nothing was trained,
        so that is an error instead."""
        lines, stop = exhaustion(self.loader, self.step + 1, self.cfg.data.on_exhausted)
        if stop and first:
            raise DataError(f"{lines[0]}: no step can be trained; add data, lower train.global_batch or set "
                            "data.on_exhausted = \"wrap\"")
        self.stopped_by = lines if stop else []
        return lines

    @staticmethod
    def _say(lines: list[str], is_main: bool) -> None:
        if is_main:
            for line in lines:
                print(f"pentatron: {line}", flush=True)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_due(self) -> bool:
        every = self.cfg.checkpoint.every
        return self.step == self.cfg.train.steps or (every > 0 and self.step % every == 0)

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def save_checkpoint(self) -> Path | None:
        """Save (every rank); the published directory, or None while an async save is still writing."""
        assert self.store is not None
        start = time.perf_counter()
        state, meta, pieces = self.state.checkpoint(self.step, self.loader.state_dict())
        meta["schedule"] = self.lr_schedule.record(self.step)  # what a resume compares its settings with
        if self.async_saver is not None:
            path = None
            self.async_saver.save(self.step, state, meta, pieces)
        else:
            path = self.store.save(self.step, state, meta, pieces)
        self.save_blocked_s.append(time.perf_counter() - start)
        if self.rank == 0:
            kind = "async: staging" if path is None else "sync"
            print(f"pentatron: checkpoint of step {self.step} blocked training {self.save_blocked_s[-1]:.3f} s "
                  f"({kind})", flush=True)
        return path

    def layout_meta(self) -> dict[str, Any]:
        return self.state.layout_meta()

    def _resume(self) -> None:
        assert self.store is not None
        ck = self.cfg.checkpoint
        latest = resume_target(self.store.root, self.model_cfg.to_dict(), ck.fallback, self.comm, self.rank,
                               self.device, ck.resume_from)
        if latest is None:
            return
        meta = self.state.load(latest, self.store)
        self.store.continue_lineage(latest, meta)
        self.step = meta["step"]
        if meta.get("loader") is not None:  # None: imported weights (`checkpoint import-hf`), no data read yet
            self.loader.load_state_dict(meta["loader"])
        self.lr_schedule, change = resumed_schedule(self.cfg.train, meta.get("schedule"), self.step)
        if self.rank == 0:
            print(f"pentatron: resumed from {latest} at step {self.step}", flush=True)
            if change:
                print(f"pentatron: {change}", flush=True)
