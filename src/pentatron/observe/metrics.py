"""Per-step metrics to JSONL, TensorBoard, Weights & Biases and the console (rank 0 only)."""

from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pentatron.observe.wandb_log import WandbRun

# Printed with the comm table (the ledger's columns, see distributed/comm.py).
COMM_LEGEND = ("(payload = bytes of the tensors this rank hands to the op; wire bytes/rank = bytes it sends "
               "on a ring of n ranks: 2(n-1)/n × payload for all_reduce, (n-1)/n × payload for all_gather, "
               "reduce_scatter and broadcast, the payload for send/recv)")


CONSOLE_WIDTH = 110  # the legends wrap here: a log viewer or an 80-column terminal reads them whole


def wrapped(text: str) -> str:
    """A long console line folded at CONSOLE_WIDTH, its continuation lines indented."""
    return textwrap.fill(text, CONSOLE_WIDTH, subsequent_indent="  ")


class MetricsLogger:
    COLUMNS = ("step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_mem_bytes", "peak_mem_reserved_bytes")
    LEGEND = ("pentatron: columns: loss = mean over the global batch; tokens/s = whole job (all ranks "
              "together); MFU = model FLOP/s ÷ (peak per device × devices); peak mem / reserved = rank 0's "
              "peak since training began, set-up excluded (CUDA: allocated tensors / reserved by the caching "
              "allocator; CPU: process resident set, no reserved figure); ETA = steps left × the mean step time "
              "of this start's last 20 steps (the live bar shows only on a terminal; a log file has this column)")

    def __init__(self, log_dir: Path, total_steps: int, tensorboard: bool, progress: bool,
                 start_step: int = 0, wandb: WandbRun | None = None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        # A resumed run redoes the steps after its checkpoint: drop their old records, so every step
        # appears once. (A fresh run gets a fresh directory from `observe.rundir`.)
        if start_step > 0:
            _keep_steps_up_to(self.path, start_step)
        self._file = self.path.open("a")
        self.tensorboard_dir: Path | None = None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard_dir = log_dir / "tensorboard"
            # purge_step: TensorBoard discards the earlier events of steps ≥ it (the redone ones).
            self._tb = SummaryWriter(log_dir=str(self.tensorboard_dir),
                                     purge_step=start_step + 1 if start_step else None)
        # disable=None: a live bar on a terminal only; piped output keeps just the table rows.
        self._wandb = wandb  # owned by the trainer: it stays open for the run summary
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                         disable=None if progress else True, dynamic_ncols=True, leave=False)
        self._header_done = False
        self._total, self._times = total_steps, []  # this start's step times, for the ETA

    def log(self, record: dict[str, Any], console: bool) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        val = record.get("val")
        # One set of scalars for TensorBoard and W&B: train/<field> (nested: train/numerics/...), val/<field>.
        scalars = [(key, value) for key, value in
                   scalars_of({k: v for k, v in record.items() if k != "val"}, "train") + scalars_of(val, "val")
                   if key != "train/step"]
        if self._tb is not None:
            for key, value in scalars:
                self._tb.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(record["step"], scalars)
        self._bar.update(1)
        if "step_time_s" in record:
            self._times.append(record["step_time_s"])
        self._bar.set_postfix(loss=f"{record['loss']:.4f}")
        if console or not self._header_done:  # the first step is always shown
            if not self._header_done:
                self._bar.write(wrapped(self.LEGEND))
                self._bar.write(self._row(("step", "loss", "grad_norm", "lr", "tokens/s all", "MFU", "peak mem r0",
                                           "reserved r0", "ETA")))
                self._header_done = True
            self._bar.write(self._row((*self._cells(record), eta(self._times, self._total - record["step"]))))
            if "data_tokens" in record:  # a mixture (data.sources): what each source has given so far
                self._bar.write(data_tokens_line(record["step"], record["data_tokens"]))
        if val is not None:  # every evaluation is shown, logged row or not
            self._bar.write(validation_line(record["step"], val))

    @staticmethod
    def _cells(r: dict[str, Any]) -> tuple[str, ...]:
        mfu = "-" if r.get("mfu") is None else f"{100 * r['mfu']:.2f}%"
        reserved = r.get("peak_mem_reserved_bytes")
        return (str(r["step"]), f"{r['loss']:.4f}", f"{r['grad_norm']:.3f}", f"{r['lr']:.2e}",
                f"{r['tokens_per_s']:,.0f}", mfu, f"{r['peak_mem_bytes'] / 2**20:,.0f} MiB",
                "-" if reserved is None else f"{reserved / 2**20:,.0f} MiB")

    @staticmethod
    def _row(cells: tuple[str, ...]) -> str:
        widths = (6, 9, 10, 10, 12, 8, 12, 12, 9)
        return " ".join(c.rjust(w) for c, w in zip(cells, widths))

    def close(self) -> None:
        self._bar.close()
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def eta(step_times: list[float], steps_left: int) -> str:
    """h:mm:ss for `steps_left` steps at the mean of the last 20 step times ("-" before any, or a first step
    alone when more followed: it carries the start-up and compile time)."""
    recent = step_times[-20:] if len(step_times) < 2 or len(step_times) > 20 else step_times[1:]
    if not recent:
        return "-"
    seconds = round(max(0, steps_left) * sum(recent) / len(recent))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def validation_line(step: int, val: dict[str, Any]) -> str:
    return (f"pentatron: validation at step {step}: loss {val['loss']:.4f}, perplexity {val['perplexity']:.2f} "
            f"({val['batches']} batch{'es' if val['batches'] != 1 else ''}, {val['tokens']:,} tokens, "
            f"{val['time_s']:.2f} s)"
            + ("; per source: " + ", ".join(f"{k} {v:.4f}" for k, v in val["sources"].items())
               if val.get("sources") else ""))


def data_tokens_line(step: int, tokens: dict[str, int]) -> str:
    """A mixture's tokens trained per source by `step` (and each one's share of them)."""
    total = sum(tokens.values()) or 1
    return (f"pentatron: data by step {step}: "
            + ", ".join(f"{k} {v:,} tokens ({100 * v / total:.1f} %)" for k, v in tokens.items()))


def _keep_steps_up_to(path: Path, last_step: int) -> None:
    """Rewrite metrics.jsonl with only the records of steps ≤ last_step (atomically)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line from a killed run
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    os.replace(tmp, path)


def scalars_of(value: Any, prefix: str) -> list[tuple[str, float]]:
    """Finite numbers of a record, nested dicts flattened ("numerics/grad_norm/layers.0")."""
    if isinstance(value, dict):
        return [kv for k, v in value.items() for kv in scalars_of(v, f"{prefix}/{k}")]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return [(prefix, float(value))]
    return []
