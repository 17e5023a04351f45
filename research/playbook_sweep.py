"""The planner against every job of the Ultra-Scale Playbook's benchmark sweep, not only the best one of
each cell: 1,763 nanotron runs that trained (1B to 405B models on 1 to 64 nodes of 8 H100s, every DP x
TP x PP x ZeRO x micro-batch the sweep tried), each with its tokens/s/GPU and rank 0's peak reserved
memory, and 1,917 that ran out of memory.

    python research/playbook_sweep.py            # about 10 s
    python research/playbook_sweep.py --worst 15 # and the rows furthest off

`playbook_sweep.csv` is derived from nanotron's benchmark CSV as published in eyao600/Rapid-LLM at
9a8d0a1 (`validation_scripts/huggingface_data/bench_final2_mod_add.csv`): its successful and OOM jobs,
with each model's shape read from the job name the sweep generator wrote (nanotron
`scripts/scaling_benchmarks.py`: KV heads = heads unless the name says `_gqaN`, tied embeddings below a
10,000-wide MLP), `Mem Res (GB)` as the memory (what the playbook plots), `Mem Alloc (GB)` beside it (the
optimizer step's live peak, which `nanotron_replay.py` checks) and `Local Params` as rank 0's parameters.
Two jobs whose recorded layout contradicts their name are left out. Each run is evaluated as the
published playbook rows are (`published_runs.toml`'s playbook source: its recipe, network and
`memory_rank = 0`), with nanotron's pipeline split below, torch DDP's bf16 bucket at ZeRO-0 with dp > 1,
and the gathered inputs kept in the first batch of jobs (`FIRST_BATCH_END`). Nothing here feeds back
into the planner.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the product's planner_accuracy
from planner_accuracy import DEFAULT_FILE, Result, build_model, evaluate, percentile, row_from_dict  # noqa: E402

from pentatron.models.config import ModelConfig  # noqa: E402
from pentatron.plan.flops import layer_params  # noqa: E402
from pentatron.plan.memory import optimizer_step_bytes, rank_params, state_precision  # noqa: E402
from pentatron.plan.search import memory_budget  # noqa: E402

DATA = Path(__file__).with_name("playbook_sweep.csv")
PLAYBOOK_BATCH = 256  # sequences of 4,096 tokens: the playbook's 1M-token global batch
# The sweep ran in four batches of SLURM job ids (13.44-13.52M, 13.80-13.85M, 14.02-14.11M, 14.28-14.31M).
# The first one's TP jobs keep the column-parallel linears' gathered inputs, which the benchmark code
# (tp_recompute_allgather, on by default) does not: inferred from their memory, which the replay
# (nanotron_replay.py) reproduces with the gathered inputs kept and not without (its report)
FIRST_BATCH_END = 13_600_000


def first_batch(job_id: str) -> bool:
    return int(job_id.split("#")[0]) < FIRST_BATCH_END


def nanotron_split(cfg: ModelConfig, pp: int, stage0: int | None = None) -> tuple[int, ...]:
    """Decoder layers per pipeline stage as nanotron's build_model places them (models/base.py): blocks in
    order, a decoder layer costing 4 h^2 + 3 h f, the LM head V h, everything else nothing; a stage takes
    blocks until their cumulative cost reaches its share, k/pp of the total, the block that reaches it
    included. `stage0` pins stage 0's count where the job recorded one next to the rule's: at an exact
    tie (the 1B model, whose 10 layers + embedding are half the cost) the jobs disagree, 10 or 11."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    layer, head = 4 * h * h + 3 * h * f, cfg.vocab_size * h
    total = cfg.n_layers * layer + head
    counts = [0] * pp
    stage, cum = 0, 0
    for _ in range(cfg.n_layers):
        cum += layer
        counts[stage] += 1
        full = counts[0] == stage0 if stage == 0 and stage0 is not None else cum * pp >= total * (stage + 1)
        if full and stage < pp - 1:
            stage += 1
    return tuple(counts)


@dataclass(frozen=True)
class Job:
    id: str
    status: str  # "Success" or "OOM"
    after_pp_fix: str  # "True" / "False" / "" (OOM)
    result: Result
    mem_alloc_gib: float = math.nan  # the CSV's Mem Alloc: the optimizer step's live peak (nanotron_replay.py)


def _stage0_layers(cfg: ModelConfig, rank0_params: str, tp: int) -> int | None:
    """Stage 0's decoder layers from the job's recorded rank-0 parameters (3 significant figures)."""
    if not rank0_params:
        return None
    lp = layer_params(cfg)
    per_layer = (lp.attn + lp.mlp_total) / tp
    return round((int(rank0_params) - cfg.vocab_size * cfg.hidden_size / tp) / per_layer)


def load_jobs(path: Path = DATA) -> tuple[list[Job], int]:
    """The jobs, evaluated, and how many were left out because nanotron's split leaves a stage empty."""
    sources = tomllib.loads(DEFAULT_FILE.read_text())["sources"]
    models: dict[str, ModelConfig] = {}
    jobs, skipped = [], 0
    with path.open() as fh:
        for n, c in enumerate(csv.DictReader(fh)):
            key = f"{c['model']}-kv{c['kv_heads']}-v{c['vocab']}"
            if key not in models:
                models[key] = build_model(key, {
                    "arch": "llama", "n_layers": int(c["layers"]), "hidden_size": int(c["hidden"]),
                    "n_heads": int(c["heads"]), "n_kv_heads": int(c["kv_heads"]), "ffn_hidden_size": int(c["ffn"]),
                    "vocab_size": int(c["vocab"]), "tie_embeddings": c["tied"] == "1"})
            dp, tp, pp, zero, mbs = (int(c[k]) for k in ("dp", "tp", "pp", "zero", "mbs"))
            ok = c["status"] == "Success"
            run = {"id": f"{c['job_id']}#{n}", "source": "playbook", "model": key, "gpu": "h100",
                   "gpus": dp * tp * pp, "dp": dp, "tp": tp, "pp": pp, "zero": zero, "micro_batch": mbs,
                   "global_batch": dp * mbs * int(c["acc"]), "seq": int(c["seq"]), "recompute": "none",
                   "precision": "bf16", "metric": "tokens_per_s_per_gpu",
                   "value": float(c["tokens_per_s_per_gpu"]) if ok else math.nan}
            if ok:
                run["memory_gib"] = float(c["mem_reserved_gib"])
            if zero > 0:  # nanotron's ZeRO-1 with fp32 accumulation (the playbook rows' recipe)
                run |= {"dp_overlap": False, "zero1_reduce": "all_reduce", "zero1_gather": "copies"}
            elif dp > 1:  # torch DDP's bf16 bucket beside the fp32 accumulation (the source notes)
                run["grad_precision"] = "bf16+fp32"
            if tp > 1 and first_batch(c["job_id"]):
                run["sp_inputs"] = "gathered"
            if pp > 1:
                cfg = models[key]
                rule = nanotron_split(cfg, pp)
                recorded = _stage0_layers(cfg, c["rank0_params"], tp)
                split = nanotron_split(cfg, pp, recorded) if recorded is not None and abs(recorded - rule[0]) <= 1 \
                    else rule
                if 0 in split:  # nanotron then places the LM head before the last stage: not expressible
                    skipped += 1
                    continue
                run["pp_layers"] = list(split)
            row = row_from_dict(run, models, sources)
            jobs.append(Job(run["id"], c["status"], c["after_pp_fix"], evaluate([row])[0],
                            float(c["mem_alloc_gib"]) if ok else math.nan))
    return jobs, skipped


def step_live_error(j: Job) -> float:
    """The planner's live peak at the optimizer step (model states and the step's buffers) against the job's
    `Mem Alloc`, which nanotron logs for the step alone (nanotron_replay.py says why)."""
    r = j.result
    lay, w = r.row.layout, r.row.workload
    step = optimizer_step_bytes(lay, rank_params(w, lay, r.memory.rank), state_precision(lay), lay.dp * lay.cp)
    return (r.memory.model_state + step) / (j.mem_alloc_gib * 2**30) - 1


def error_stats(errors: list[float]) -> str:
    if not errors:
        return "-"
    a = [abs(e) for e in errors]
    return (f"{len(a):>5} {100 * statistics.median(a):>7.1f}% {100 * percentile(a, 0.9):>7.1f}% "
            f"{100 * statistics.median(errors):>+7.1f}% {sum(x <= 0.10 for x in a):>6}")


PEAK_BANDS = (0.75, 0.85, 0.90, 0.95, 1.00)  # upper edges, as a fraction of the device's memory


def outcome_by_predicted_peak(jobs: list[Job]) -> list[tuple[str, int, int]]:
    """(band, jobs that trained, jobs that ran out of memory) by the planner's `required` (live tensors and
    the CUDA context, what its "fits" verdict compares) over the device's memory, on the fullest rank: how
    far below the device a "fits" is safe for these runs."""
    counts = {b: [0, 0] for b in (*PEAK_BANDS, math.inf)}
    for j in jobs:
        share = j.result.pred.memory.required / memory_budget(j.result.row.gpu)
        counts[next(b for b in counts if share <= b)][j.status != "Success"] += 1
    out, low = [], None
    for b, (ran, oom) in counts.items():
        if low is None:
            label = f"<= {100 * b:.0f} %"
        elif b == math.inf:
            label = f"> {100 * low:.0f} %"
        else:
            label = f"{100 * low:.0f}-{100 * b:.0f} %"
        out.append((label, ran, oom))
        low = b
    return out


def cells(jobs: list[Job]) -> dict[tuple[str, int], list[Job]]:
    """The jobs that trained, by the playbook's plot cells: (model, nodes of 8 GPUs), at its global batch of
    256 sequences (11 jobs ran others); pipeline jobs logged before nanotron's PP fix (the CSV's
    `after_pp_fix`) left out, their throughput predating the fix."""
    out: dict[tuple[str, int], list[Job]] = {}
    for j in jobs:
        row = j.result.row
        if (j.status == "Success" and row.workload.global_batch == PLAYBOOK_BATCH
                and not (row.layout.pp > 1 and j.after_pp_fix == "False")):
            out.setdefault((j.result.row.workload.cfg.name.split("-")[0], j.result.row.layout.world // 8), []).append(j)
    return out


def planners_pick(js: list[Job]) -> Job:
    """Of one cell's configurations, the one the planner ranks first among those it predicts to fit."""
    return max((j for j in js if j.result.pred.fits), key=lambda j: j.result.pred.rate.tokens_per_s_per_gpu)


def report(jobs: list[Job], worst: int = 0) -> str:
    ran = [j for j in jobs if j.status == "Success"]
    ooms = [j for j in jobs if j.status == "OOM"]
    by_cell = cells(jobs)
    near = [j for js in by_cell.values() for j in js
            if j.result.row.published_tps >= 0.8 * max(k.result.row.published_tps for k in js)]
    head = f"{'':<40} {'n':>5} {'med|err|':>8} {'p90|err|':>8} {'signed':>8} {'<=10%':>6}"
    groups: dict[str, list[Job]] = {"all": ran}
    for j in ran:
        lay = j.result.row.layout
        groups.setdefault(f"model {j.result.row.workload.cfg.name.split('-')[0]}", []).append(j)
        groups.setdefault("pp 1" if lay.pp == 1 else f"pp > 1, after nanotron's PP fix: {j.after_pp_fix}",
                          []).append(j)
    lines = ["tokens/s/GPU", head,
             f"  {'within 80 % of its cell best (*)':<38} {error_stats([j.result.error for j in near])}"]
    lines += [f"  {name:<38} {error_stats([j.result.error for j in js])}" for name, js in groups.items()]
    picks = {cell: planners_pick(js).result.row.published_tps / max(j.result.row.published_tps for j in js)
             for cell, js in by_cell.items()}
    lines.append("(*) the playbook's global batch (256 sequences) only; pipeline jobs logged before nanotron's PP "
                 "fix left out\n"
                 f"the planner's pick in each (model, nodes) cell (*), measured tokens/s/GPU over the cell's best: "
                 f"median {statistics.median(picks.values()):.2f}, below 0.9 in {sum(p < 0.9 for p in picks.values())}"
                 f" of {len(picks)} cells: " + ", ".join(f"{m} x {n} nodes {p:.2f}"
                                                        for (m, n), p in sorted(picks.items()) if p < 0.9))
    lines += ["memory of rank 0 (the caching allocator's reserved peak)", head]
    lines += [f"  {name:<38} {error_stats([j.result.memory_error for j in js])}" for name, js in groups.items()]
    lines += ["the optimizer step's live peak (model states and the step's buffers) against Mem Alloc; at tp > 1 "
              "nanotron also keeps\nits two TP gather buffers (micro-batch x sequence x hidden each) for the run, "
              "which the planner holds only in the forward/backward pass", head]
    by_tp = {"all": ran, "tp 1": [j for j in ran if j.result.row.layout.tp == 1],
             "tp > 1": [j for j in ran if j.result.row.layout.tp > 1]}
    lines += [f"  {name:<38} {error_stats([step_live_error(j) for j in js])}" for name, js in by_tp.items()]
    not_fit = [j for j in ran if not j.result.pred.fits]
    lines.append(f"trained but predicted 'does not fit': {len(not_fit)} of {len(ran)}"
                 + "".join(f"\n  {j.id} {j.result.pred.layout.short()} {j.result.pred.memory.required / 2**30:.1f} GiB"
                           f" required (published {j.result.row.published_memory / 2**30:.1f})" for j in not_fit))
    fit = sum(j.result.pred.fits and not j.result.pred.tight for j in ooms)
    tight = sum(j.result.pred.tight for j in ooms)
    lines.append(f"ran out of memory: {len(ooms)} jobs; predicted 'does not fit' {len(ooms) - fit - tight}, "
                 f"'tight' {tight}, 'fits' {fit}")
    lines.append("trained | ran out of memory, by the planner's required memory (fullest rank) over the device's")
    lines += [f"  {label:<14} {ran:>5} | {oom:>5}" for label, ran, oom in outcome_by_predicted_peak(jobs)]
    for attr in ("error", "memory_error") if worst else ():
        lines.append(f"furthest off ({attr}):")
        for j in sorted(ran, key=lambda j: -abs(getattr(j.result, attr)))[:worst]:
            r = j.result
            lines.append(f"  {j.id:<16} {r.pred.layout.short()[:60]:<60} {100 * getattr(r, attr):+6.0f}%"
                         f"  (after PP fix: {j.after_pp_fix})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, default=DATA)
    ap.add_argument("--worst", type=int, default=0, help="also list this many rows furthest off")
    args = ap.parse_args(argv)
    jobs, skipped = load_jobs(args.file)
    print(f"{len(jobs)} jobs evaluated; {skipped} left out: nanotron's split leaves a pipeline stage without "
          "decoder layers (more stages than the LM head's cost share allows), the LM head then off the last "
          "stage, which the planner cannot express")
    print(report(jobs, args.worst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
