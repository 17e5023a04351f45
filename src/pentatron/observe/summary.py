"""The end of a run: one summary — loss, throughput, MFU, memory, time and where everything was written —
on the console and in `<run dir>/summary.json`. Every number says what it is (per rank or for the
whole job, which memory)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pentatron.observe.memory import memory_kind
from pentatron.observe.metrics import scalars_of
from pentatron.observe.system import bounded_mfu
from pentatron.plan.flops import MFU_CONVENTION

SUMMARY_FILE = "summary.json"


def finish_run(trainer: Any, records: list[dict[str, Any]], wall_s: float) -> dict[str, Any] | None:
    """Collective (every rank calls it): the peak memory over ranks; rank 0 then writes and prints the
    summary, which it returns (None elsewhere, or when no step ran)."""
    # Peaks since training began (allocated or resident, reserved) and of the set-up before it.
    memory = trainer.observer.memory
    peak = torch.tensor([max((r["peak_mem_bytes"] for r in records), default=0),
                         max((r.get("peak_mem_reserved_bytes") or 0 for r in records), default=0),
                         memory.setup_peak_bytes if memory is not None else 0], dtype=torch.int64,
                        device=trainer.device)
    trainer.comm.all_reduce(peak, "world", op="max")
    if trainer.rank != 0:
        return None
    wandb = getattr(trainer, "wandb", None)
    if not records:
        if wandb is not None:
            wandb.finish([])  # nothing ran: the W&B run ends with nothing to summarise
        print(f"pentatron: nothing to train: the checkpoint is at step {trainer.step} = train.steps; raise "
              "train.steps to continue, or start over with --force-new (or another checkpoint.dir)", flush=True)
        return None
    allocated, reserved, setup = peak.tolist()
    summary = build_summary(trainer, records, wall_s, allocated, reserved or None, setup or None)
    path = Path(trainer.cfg.log.dir) / SUMMARY_FILE
    summary["paths"]["summary"] = str(path)
    path.write_text(json.dumps(summary, indent=1))
    print(format_summary(summary), flush=True)
    if wandb is not None:  # the summary's numbers, flattened as the step scalars are (summary/loss/final, ...)
        wandb.finish(scalars_of(summary, "summary"))
    return summary


def build_summary(trainer: Any, records: list[dict[str, Any]], wall_s: float, peak_mem_bytes: int,
                  peak_reserved_bytes: int | None = None, setup_peak_bytes: int | None = None) -> dict[str, Any]:
    cfg, par = trainer.cfg, trainer.cfg.parallel
    losses = [(r["loss"], r["step"]) for r in records]
    # The first step of a process pays for warm-up (allocations, thread pools): averaged without it.
    timed = records[1:] if len(records) > 1 else records
    mean_tps = sum(r["tokens_per_s"] for r in timed) / len(timed)
    # Against the one peak the summary names: the run's final one, which no step's rate exceeds (a faster
    # step raised it), computed as the trainer did so that the fastest step's is exactly 1 at most.
    mfus = [bounded_mfu(r["tokens_per_s"] * r.get("model_flops_per_token", trainer.flops_per_token)
                        / trainer.world_size, trainer.peak_flops)[0] for r in timed]
    run_dir = Path(cfg.log.dir)
    latest = trainer.store.latest() if trainer.store is not None else None
    memory = trainer.observer.memory
    return {
        "model": {"name": trainer.model_cfg.name, "parameters": trainer.n_params},
        "layout": {"world": trainer.world_size, "dp": trainer.dp, "tp": par.tp, "pp": par.pp, "zero": par.zero,
                   "sp": par.sp, "pp_schedule": par.pp_schedule if par.pp > 1 else None,
                   "cp": par.cp, "cp_mode": par.cp_mode if par.cp > 1 else None, "ep": par.ep,
                   "device": str(trainer.device), "precision": trainer.policy.name},
        "steps": {"first": records[0]["step"], "last": records[-1]["step"],
                  "resumed_from": records[0]["step"] - 1 if records[0]["step"] > 1 else None},
        "loss": {"first": losses[0][0], "final": losses[-1][0], "min": min(losses)[0], "min_step": min(losses)[1]},
        "validation": validation_summary(records),
        "data": data_summary(trainer, records),
        "tokens_per_s": {"mean_all_ranks": mean_tps, "mean_per_rank": mean_tps / trainer.world_size,
                         "steps_averaged": [timed[0]["step"], timed[-1]["step"]]},
        "mfu": {"mean": sum(mfus) / len(mfus) if mfus else None, "max": max(mfus) if mfus else None,
                "peak_flops_per_device": trainer.peak_flops, "peak_source": trainer.peak_source,
                # the numerator's convention (plan/flops.py, the planner's and the run report's words), and
                # under document masking the share of the sample's causal pairs attention computed (rank 0's
                # documents, mean over the steps)
                "convention": MFU_CONVENTION,
                "masked_attention_pairs": _mean_pairs(records)},
        "memory": {"peak_bytes_max_over_ranks": peak_mem_bytes,
                   "peak_reserved_bytes_max_over_ranks": peak_reserved_bytes,
                   "setup_peak_bytes_max_over_ranks": setup_peak_bytes,
                   "kind": memory.kind if memory is not None else memory_kind(trainer.device.type, False),
                   "model_state_per_rank": trainer.memory.describe()},
        "time": {"wall_s": wall_s, "train_steps_s": sum(r["step_time_s"] for r in records)},
        "compile": compiled.summary() if (compiled := getattr(getattr(trainer, "runner", None), "compiled", None))
                   is not None else None,
        "paths": {"run_dir": str(run_dir), "metrics": str(run_dir / "metrics.jsonl"),
                  "tensorboard": str(run_dir / "tensorboard") if cfg.log.tensorboard else None,
                  "wandb": str(run_dir / "wandb") if cfg.log.wandb else None,
                  "checkpoint": str(latest) if latest is not None else None,
                  "dataset": str(trainer.dataset.path),
                  "pp_trace": str(run_dir / "pp_trace") if cfg.log.pp_trace and par.pp > 1 else None},
    }


def _mean_pairs(records: list[dict[str, Any]]) -> float | None:
    shares = [r["documents"]["attention_pairs"] for r in records if "documents" in r]
    return sum(shares) / len(shares) if shares else None


def format_summary(s: dict[str, Any]) -> str:
    lay, loss, tps, mfu, mem, t, paths = (s[k] for k in ("layout", "loss", "tokens_per_s", "mfu", "memory",
                                                        "time", "paths"))
    steps = s["steps"]
    resumed = f" (resumed after step {steps['resumed_from']})" if steps["resumed_from"] else ""
    a, b = tps["steps_averaged"]
    rows = [
        ("model", f"{s['model']['name']}, {s['model']['parameters'] / 1e6:.2f}M parameters, world={lay['world']} "
                  f"(dp={lay['dp']} tp={lay['tp']}{'+sp' if lay.get('sp') else ''} pp={lay['pp']} cp={lay.get('cp', 1)}"
                  + (f" {lay['cp_mode']}" if lay.get("cp", 1) > 1 else "")
                  + f" ep={lay.get('ep', 1)} zero={lay['zero']}) on {lay['device']}"),
        ("steps", f"{steps['first']} … {steps['last']}{resumed}"),
        ("loss", f"final {loss['final']:.4f}, min {loss['min']:.4f} at step {loss['min_step']} "
                 f"(first logged {loss['first']:.4f})"),
        *([("validation", validation_text(s["validation"]))] if s.get("validation") else []),
        *([("data", data_text(s["data"]))] if s.get("data") else []),
        ("throughput", f"{tps['mean_all_ranks']:,.0f} tokens/s for the whole job = {tps['mean_per_rank']:,.0f} "
                       f"per rank (mean of steps {a}–{b})"),
    ]
    if mfu["mean"] is not None:
        rows.append(("MFU", f"{100 * mfu['mean']:.1f} % mean, {100 * mfu['max']:.1f} % best step, against "
                            f"{mfu['peak_flops_per_device'] / 1e12:.4g} TFLOP/s per rank ({mfu['peak_source']})"))
        rows.append(("", mfu["convention"]))
        if mfu.get("masked_attention_pairs") is not None:
            rows.append(("", f"document masking computed {100 * mfu['masked_attention_pairs']:.1f} % of the "
                             "samples' causal pairs (rank 0's documents)"))
    rows += [
        ("peak memory", _peak_text(mem)),
        ("model state", mem["model_state_per_rank"]),
        ("time", f"{t['wall_s']:.1f} s wall clock, of which {t['train_steps_s']:.1f} s in training steps"),
        ("compile", compile_text(s.get("compile"))),
        ("metrics", paths["metrics"]),
    ]
    if paths["tensorboard"]:
        rows.append(("TensorBoard", f"{paths['tensorboard']}  (view: tensorboard --logdir "
                                    f"{Path(paths['run_dir']).parent})"))
    if paths.get("wandb"):
        rows.append(("W&B", paths["wandb"]))
    if paths["pp_trace"]:
        rows.append(("pipeline traces", paths["pp_trace"]))
    rows.append(("checkpoint", paths["checkpoint"] or "none (set checkpoint.dir to save)"))
    rows.append(("dataset", f"{paths['dataset']} (tokenized, cached)"))
    rows.append(("summary", paths.get("summary", "")))
    width = max(len(k) for k, _ in rows)
    return "pentatron: run summary\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def data_summary(trainer: Any, records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A mixture's tokens per source by the last step (with its weight's share) and, when data.on_exhausted =
    "stop" ended the run, why; None for a data.path run that ran to train.steps."""
    stopped = getattr(trainer, "stopped_by", [])
    if "data_tokens" not in records[-1] and not stopped:
        return None
    out: dict[str, Any] = {"stopped": stopped or None}
    if "data_tokens" in records[-1]:
        tokens = records[-1]["data_tokens"]
        weights = dict(zip(trainer.loader.source_names, trainer.loader.weights, strict=True))
        total, wsum = sum(tokens.values()) or 1, sum(weights.values())
        out["sources"] = {n: {"tokens": t, "share": t / total, "weight_share": weights[n] / wsum}
                          for n, t in tokens.items()}
    return out


def data_text(d: dict[str, Any]) -> str:
    parts = [f"{n} {v['tokens']:,} tokens ({100 * v['share']:.1f} %, weight {100 * v['weight_share']:.1f} %)"
             for n, v in (d.get("sources") or {}).items()]
    if d.get("stopped"):
        parts.append("stopped early: " + "; ".join(d["stopped"]))
    return ", ".join(parts)


def validation_summary(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The evaluations of this start ([eval]): final and best validation loss, each with its step."""
    vals = [(r["val"]["loss"], r["step"], r["val"]["perplexity"]) for r in records if "val" in r]
    if not vals:
        return None
    best = min(vals)
    return {"final": vals[-1][0], "final_step": vals[-1][1], "final_perplexity": vals[-1][2], "min": best[0],
            "min_step": best[1], "evaluations": len(vals), "tokens": next(r["val"]["tokens"] for r in records
                                                                         if "val" in r)}


def validation_text(v: dict[str, Any]) -> str:
    return (f"loss final {v['final']:.4f} (perplexity {v['final_perplexity']:.2f}) at step {v['final_step']}, "
            f"min {v['min']:.4f} at step {v['min_step']} ({v['evaluations']} evaluations of {v['tokens']:,} tokens)")


def compile_text(c: dict[str, Any] | None) -> str:
    if c is None:
        return "off (train.compile)"
    failed = f", {len(c['failed'])} failed (eager)" if c["failed"] else ""
    return (f"{c['backend']}: {c['regions']} regions, {c['graphs']} graphs ({c.get('recompiles', 0)} recompiles), "
            f"{c['compile_s']:.1f} s compiling (rank 0, inside the first steps){failed}")


def _peak_text(mem: dict[str, Any]) -> str:
    mib = 2**20
    reserved = mem.get("peak_reserved_bytes_max_over_ranks")
    text = f"{mem['peak_bytes_max_over_ranks'] / mib:,.0f} MiB"
    if reserved is not None:
        text += f" allocated / {reserved / mib:,.0f} MiB reserved"
    text += f" on the busiest rank ({mem['kind']})"
    if mem.get("setup_peak_bytes_max_over_ranks") is not None:
        text += f"; set-up before training peaked at {mem['setup_peak_bytes_max_over_ranks'] / mib:,.0f} MiB"
    return text
