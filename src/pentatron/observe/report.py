"""The run report — predict, then measure: `report.md`, `report.json` and `report.png` (the curves:
`observe/report_figure.py`), for an MoE run `expert_load.png` (`observe/moe_heatmap.py`) linked from
report.md, in the run directory, written at the end of every run (rank 0) and by `pentatron report RUN_DIR`.

Measured numbers come from `metrics.jsonl` (rank 0's records): the communication bytes are the
ledger's own per-step numbers, copied, not recomputed. The prediction is the planner's
(`plan.search.predict`) for this exact layout and workload, on the hardware of a `pentatron bench`
profile when one is given (`--hardware-profile`), else the datasheet of the GPU the run used, else for
a CPU run the CPU itself: bench's profile of it when one is where bench writes it (`hardware-profile.toml`
in the working directory), else the built-in CPU calibration (the measured peak MFU uses,
`observe/peak.py`, with nominal memory and gloo figures). Only a GPU without a datasheet entry is
predicted on a reference GPU, labelled so; bytes, bubble and model-state memory do not depend on it.
The bubble, measured (`engine.measured_bubble`) and predicted (`schedules.Timeline.bubble_fraction` of the
planner's simulation), is one definition: the pipeline ranks' idle share of the step's pipeline time,
idle / (busy + idle), in [0, 1].
On a CPU the measured peak memory is the resident set, so the prediction it is set against is the
planner's tensors plus what preflight adds per CPU process (RoPE tables, interpreter and torch).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from pentatron.observe.moe_heatmap import HEATMAP, write_expert_heatmap
from pentatron.observe.report_figure import comm_sent_series, write_report_png
from pentatron.plan.flops import MFU_CONVENTION

RUN_INFO = "run.json"
REFERENCE_GPU = "h100-sxm"
BENCH_PROFILE = Path("hardware-profile.toml")  # where `pentatron bench` writes by default
# The built-in CPU profile's figures beside its measured peak (nominal: `pentatron bench` measures them).
CPU_MEMORY_GB_S, CPU_GLOO_GB_S, CPU_GLOO_LATENCY_US = 10.0, 2.0, 50.0


class ReportError(ValueError):
    """The run directory lacks what a report needs (a user error: exit code 2)."""


def write_run_info(run_dir: Path, cfg_dict: dict[str, Any], world_size: int, device: str, device_name: str) -> None:
    """At the start of a run (rank 0): what `pentatron report` needs to predict this layout later."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_INFO).write_text(json.dumps({"config": cfg_dict, "world_size": world_size, "device": device,
                                                "device_name": device_name}, indent=1))


def layout_key(cfg: Any, world_size: int) -> str:
    """What a step record names its layout by (`layout`): the degrees and everything else the prediction
    depends on. A run resumed in another layout appends records under another key, and the report
    compares the prediction (for the layout of run.json, the last start's) with that layout's steps only."""
    tr = cfg.train
    fp8 = getattr(tr, "fp8", "off")  # named only when on: the keys of runs without it are unchanged
    return (f"{cfg.layout(world_size).short()} mb{tr.micro_batch} gb{tr.global_batch} seq{tr.seq_len} "
            f"rc:{tr.recompute} {tr.precision}{f' fp8:{fp8}' if fp8 != 'off' else ''} compile:{tr.compile}")


def compared_records(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the records of the layout the last step ran in, those of them measured: each start's first step
    — allocations, first collectives — left out, unless nothing else is left). Records older than the
    `layout` and `start_step` fields are one layout, started at step 0."""
    key = records[-1].get("layout")
    same = [r for r in records if r.get("layout") == key]
    steady = [r for r in same if r["step"] != r.get("start_step", 0) + 1] or same
    return same, steady


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{run_dir} has no metrics.jsonl: is it a training run's log.dir?")
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            by_step[r["step"]] = r  # a resumed run appends: the newest record of a step wins
    if not by_step:
        raise ReportError(f"{path} is empty: the run did not finish a step")
    return [by_step[s] for s in sorted(by_step)]


# ---------------------------------------------------------------- measured
def measured(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and means over the steps run in the last step's layout (`compared_records`): a run resumed
    in another layout is compared with the prediction for the layout it ends in, not with steps of another."""
    same, steady = compared_records(records)
    comm: dict[str, float] = defaultdict(float)
    for r in steady:
        for dim, ops in r.get("comm_bytes", {}).items():
            comm[dim] += sum(ops.values()) / len(steady)
    # what the planner predicts: sends, under its dim names (the PNG draws the same series)
    sent = {d: sum(ys) / len(steady) for d, ys in comm_sent_series(steady).items()}
    # the memory accounting is on each start's first record: the last one of this layout
    mem = next((r["memory"] for r in reversed(same) if "memory" in r), {})
    vals = [r for r in records if "val" in r]
    out = {"steps": records[-1]["step"], "final_loss": records[-1]["loss"],
           "final_val_loss": vals[-1]["val"]["loss"] if vals else None,
           "compared_steps": _step_ranges([r["step"] for r in steady]), "compared_layout": same[-1].get("layout"),
           "step_time_s": statistics.median(r["step_time_s"] for r in steady),
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
           "peak_mem_bytes": max(r["peak_mem_bytes"] for r in same),
           "model_state_bytes": sum(mem.get(k, 0) for k in ("params", "grads", "optimizer", "master")),
           "comm_bytes_per_step": dict(comm), "comm_sent_per_step": dict(sent),
           "comm_bytes_last_step": records[-1].get("comm_bytes", {})}
    bubbles = [r["bubble"] for r in steady if "bubble" in r]
    if bubbles:
        out["bubble"] = statistics.median(bubbles)
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    out["mfu"] = statistics.median(mfus) if mfus else None
    docs = [r["documents"] for r in steady if "documents" in r]
    if docs:  # document masking: the lengths rank 0 trained on (mean over the steps), which the prediction uses
        out["documents"] = {k: statistics.fmean(d[k] for d in docs) for k in ("mean_tokens", "mean_sq_tokens")}
    return out


def _step_ranges(steps: list[int]) -> str:
    """[2, 3, 4, 152, 153] → "2..4, 152..153"."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in runs)


def profiled_tensor_peak(run_dir: Path) -> dict[str, int]:
    """Rank 0's peak of tensor memory over the steps `log.profile` traced (its own summary, written before
    the report): the model state live before them plus the most allocated during them at once."""
    from pentatron.observe.profiler import summary_tensor_peak

    path = Path(run_dir) / "profile" / "rank0.summary.json"
    peak = summary_tensor_peak(json.loads(path.read_text())) if path.is_file() else None
    return {} if peak is None else {"tensor_peak_bytes_rank0": peak}


# ---------------------------------------------------------------- predicted
def layout_and_workload(cfg: dict[str, Any], world_size: int, device: str) -> tuple[Any, Any]:
    """The planner's Layout and Workload for a run's config (as saved in run.json)."""
    from pentatron.config import config_from_dict

    return planner_layout(config_from_dict(cfg, world_size), world_size, device)


def planner_layout(c: Any, world_size: int, device: str) -> tuple[Any, Any]:
    """The planner's Layout and Workload for a `Config` on `world_size` ranks of `device` ("cuda"/"cpu").

    The planner holds the run's own `ParallelLayout` (`Config.layout`, the one holder of the degrees), so
    every parallel field the run trains with (cp_mode, cp_ulysses, zero3_gather, ...) reaches the
    prediction: none is copied by hand. Only our knobs and the recipe are added here."""
    from pentatron.plan.layout import Layout, Workload
    from pentatron.plan.recipes import training_recipe

    tr = c.train
    precision = tr.precision if tr.precision != "auto" else ("bf16" if device == "cuda" else "fp32")
    if precision == "fp64":  # the parity tests' mode: an fp64 run is never priced as a 2-byte one
        raise ReportError("the planner models bf16, fp32 and fp8 training; train.precision='fp64' (the exact "
                          "parity mode) is not predicted")
    fp8 = getattr(tr, "fp8", "off")
    if fp8 != "off" and device == "cuda":  # the planner's FP8 GEMMs and casts (its model is a GPU's; on CPU the
        precision = "fp8"                  # FP8 casts are priced as the run's precision: no FP8 units to model)
    lay = Layout(c.layout(world_size), recompute=tr.recompute, precision=precision,
                 fp8_scaling=fp8 if fp8 != "off" else "tensorwise", recipe=training_recipe(tr.loss_chunk_tokens))
    return lay, Workload(c.model_config(), tr.seq_len, tr.global_batch)


def _hardware(info: dict[str, Any], profile: Path | None) -> tuple[Any, str, bool]:
    """(GPUSpec, where it came from, whether it describes this run's machine)."""
    from pentatron.hardware.catalogue import detect_gpu, get_gpu, load_hardware_toml

    if profile is not None:
        if not profile.is_file():
            raise ReportError(f"hardware profile {profile} does not exist (write one with `pentatron bench`)")
        return load_hardware_toml(profile), f"profile {profile}", True  # TOML or JSON
    if info.get("device") == "cuda":
        spec = detect_gpu(info.get("device_name", ""))
        if spec is not None:
            return spec, f"datasheet of {spec.name}", True
    if info.get("device") == "cpu":
        if BENCH_PROFILE.is_file():
            spec = load_hardware_toml(BENCH_PROFILE)
            if spec.name == "bench-cpu":
                return spec, f"CPU profile {BENCH_PROFILE.resolve()} (`pentatron bench`)", True
        return builtin_cpu(info)
    return get_gpu(REFERENCE_GPU), (f"reference GPU {REFERENCE_GPU}, not this run's device "
                                    f"({info.get('device_name')}): give --hardware-profile for its times"), False


def builtin_cpu(info: dict[str, Any]) -> tuple[Any, str, bool]:
    """This CPU as the planner's hardware: the calibrated peak MFU divides by (`observe/peak.py`; each of
    the host's ranks gets its share), nominal memory and gloo bandwidths."""
    import torch

    from pentatron.hardware.catalogue import hardware_from_dict
    from pentatron.observe.peak import cpu_calibration

    ranks = max(1, int(info.get("world_size", 1)))
    fp32 = cpu_calibration(torch.float32, refresh=False)
    peak = {"fp32": fp32.flops / ranks / 1e12,
            "bf16": cpu_calibration(torch.bfloat16, refresh=False).flops / ranks / 1e12}
    spec = hardware_from_dict({
        "name": "cpu", "source": "built-in CPU calibration", "peak_tflops": peak, "matmul_efficiency": 1.0,
        "sm_count": 1, "hbm_gib": 1024, "hbm_bandwidth_gb_s": CPU_MEMORY_GB_S / ranks, "gpus_per_node": ranks,
        "intra_node_bandwidth_gb_s": CPU_GLOO_GB_S, "inter_node_bandwidth_gb_s": CPU_GLOO_GB_S,
        "intra_node_latency_us": CPU_GLOO_LATENCY_US, "collective_efficiency": 1.0}, where="built-in CPU")
    return spec, (f"{info.get('device_name', 'this CPU')}: built-in CPU calibration (peak "
                  f"{fp32.flops / 1e12:.3f} TFLOP/s fp32 measured, {fp32.describe()}, ÷ {ranks} ranks; memory "
                  f"and gloo nominal; `pentatron bench` writes a measured profile)"), True


def predicted(info: dict[str, Any], profile: Path | None, documents: dict[str, float] | None = None
              ) -> dict[str, Any]:
    """The planner's numbers for the run's layout (with the document lengths the run measured, under
    document masking), or {"error": why} when it cannot evaluate it."""
    from dataclasses import replace

    from pentatron.config import config_from_dict
    from pentatron.plan.comm import bytes_by_dim
    from pentatron.plan.flops import DocumentLengths
    from pentatron.plan.memory import memory_for_rank
    from pentatron.plan.recipes import kernels_for_compile
    from pentatron.plan.search import predict

    gpu, source, same_machine = _hardware(info, profile)
    device = info.get("device", "cpu")
    try:
        cfg = config_from_dict(info["config"], info.get("world_size", 1))  # the saved config, defaults filled
        lay, w = planner_layout(cfg, info.get("world_size", 1), device)
        if documents is not None:
            w = replace(w, documents=DocumentLengths(documents["mean_tokens"], documents["mean_sq_tokens"]))
        kernels = kernels_for_compile(cfg.train.compile, device)  # the kernels the run used
        p = predict(w, lay, gpu, kernels=kernels)
        rank0 = memory_for_rank(w, lay, gpu, 0, kernels)
    except Exception as e:  # noqa: BLE001 - the planner may not model every layout: say so in the report
        return {"error": f"{type(e).__name__}: {e}", "hardware": source}
    mem = p.memory
    out = {"hardware": source, "same_machine": same_machine, "layout": lay.short(), "dp": lay.dp,
           "step_time_s": p.step.step, "bubble": p.step.bubble_fraction, "memory_bytes": mem.total,
           "model_state_bytes": mem.model_state,
           "tensor_bytes_rank0": rank0.tensors,
           "comm_bytes_per_step": bytes_by_dim(list(p.step.collectives))}
    if info.get("device") == "cpu":  # the measured peak is rank 0's resident set: what preflight adds to it
        from pentatron.rank_memory import CPU_PROCESS_BYTES, rope_table_bytes

        out["resident_bytes_rank0"] = rank0.tensors + rope_table_bytes(cfg) + CPU_PROCESS_BYTES
    return out


# ---------------------------------------------------------------- the report
def _err(pred: float | None, meas: float | None) -> str:
    if pred is None or meas is None:
        return "-"
    if meas == 0:
        return "exact" if pred == 0 else "∞"
    return f"{100 * (pred - meas) / meas:+.1f}%"


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def comparison_rows(meas: dict[str, Any], pred: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(quantity, predicted, measured, error) for the markdown table."""
    rows: list[tuple[str, str, str, str]] = []
    if "error" in pred:
        return rows
    t_note = "" if pred["same_machine"] else " (other hardware)"
    rows.append((f"step time{t_note}", f"{pred['step_time_s']:.4f} s", f"{meas['step_time_s']:.4f} s",
                 _err(pred["step_time_s"], meas["step_time_s"]) if pred["same_machine"] else "n/a"))
    rows.append(("model states per rank (params, grads, master, optimizer)", _size(pred["model_state_bytes"]),
                 _size(meas["model_state_bytes"]), _err(pred["model_state_bytes"], meas["model_state_bytes"] or None)))
    if "resident_bytes_rank0" in pred:  # CPU: the resident set, against tensors + RoPE + the process itself
        rows.append(("peak resident set, rank 0 (planner tensors + RoPE + CPU process)",
                     _size(pred["resident_bytes_rank0"]), _size(meas["peak_mem_bytes"]),
                     _err(pred["resident_bytes_rank0"], meas["peak_mem_bytes"])))
    else:
        rows.append(("peak memory per rank", _size(pred["memory_bytes"]), _size(meas["peak_mem_bytes"]),
                     _err(pred["memory_bytes"], meas["peak_mem_bytes"]) if pred["same_machine"] else "n/a"))
    if "tensor_peak_bytes_rank0" in meas:
        rows.append(("tensor memory at its peak, rank 0 (profiled steps: model state + allocations)",
                     _size(pred["tensor_bytes_rank0"]), _size(meas["tensor_peak_bytes_rank0"]),
                     _err(pred["tensor_bytes_rank0"], meas["tensor_peak_bytes_rank0"])))
    dims = sorted(set(pred["comm_bytes_per_step"]) | set(meas["comm_sent_per_step"]))
    for d in dims:
        p, m = pred["comm_bytes_per_step"].get(d, 0.0), meas["comm_sent_per_step"].get(d, 0.0)
        rows.append((f"comm bytes per step, {d}", _size(p), _size(m), _err(p, m)))
    if "bubble" in meas or pred["bubble"] > 0:  # both the idle share of the pipeline ranks' time, in [0, 1]
        m = meas.get("bubble")
        rows.append(("pipeline bubble (idle / (busy + idle) of the pp ranks)", f"{100 * pred['bubble']:.1f}%",
                     "-" if m is None else f"{100 * m:.1f}%", _err(pred["bubble"], m)))
    return rows


def _plots(run_dir: Path, records: list[dict[str, Any]], info: dict[str, Any] | None) -> list[str]:
    """The report's pictures, written beside it: report.png (the curves), and for an MoE run
    expert_load.png (each layer's load per expert over the whole run: every step in metrics.jsonl)."""
    pictures = [write_report_png(run_dir, records, info).name]
    heatmap = write_expert_heatmap(run_dir, records)
    return pictures + ([heatmap.name] if heatmap is not None else [])


def write_report(run_dir: Path, hardware_profile: Path | None = None) -> Path:
    """report.md, report.json and report.png in `run_dir`; returns the path of report.md."""
    run_dir = Path(run_dir)
    records = load_records(run_dir)
    info_path = run_dir / RUN_INFO
    info = json.loads(info_path.read_text()) if info_path.is_file() else None
    meas = measured(records)
    meas.update(profiled_tensor_peak(run_dir))
    pred = (predicted(info, hardware_profile, meas.get("documents")) if info else
            {"error": f"no {RUN_INFO} in {run_dir} (run older than the report): nothing to predict from"})
    plots = _plots(run_dir, records, info)
    (run_dir / "report.json").write_text(json.dumps({"measured": meas, "predicted": pred}, indent=1))
    lines = [f"# Run report: {run_dir}", ""]
    if info:
        par = info["config"]["parallel"]
        dp = pred.get("dp") or par["dp"] or info["world_size"] // (par["tp"] * par["pp"] * par.get("cp", 1))
        lines.append(f"{info['world_size']} process(es) on {info['device_name']} ({info.get('device', '?')}); model "
                     f"{info['config']['model']['name']}; dp={dp} tp={par['tp']}{'+sp' if par.get('sp') else ''} "
                     f"pp={par['pp']} "
                     f"cp={par.get('cp', 1)} ep={par.get('ep', 1)} "
                     f"zero={par['zero']}; {meas['steps']} steps, final loss {meas['final_loss']:.4f}"
                     + (f", final validation loss {meas['final_val_loss']:.4f}" if meas["final_val_loss"] is not None
                        else "") + "; median "
                     f"step {meas['step_time_s']:.4f} s, {meas['tokens_per_s']:,.0f} tokens/s.")
        lines.append("")
    if meas["mfu"] is not None:
        lines += [f"MFU: median {100 * meas['mfu']:.1f} % over steps {meas['compared_steps']}; {MFU_CONVENTION}.", ""]
    if (docs := meas.get("documents")) is not None:
        lines += [f"Documents (masked; rank 0's, mean over those steps): mean {docs['mean_tokens']:,.1f} tokens, "
                  f"mean square {docs['mean_sq_tokens']:,.1f}; the prediction uses them.", ""]
    lines += ["## Predicted vs measured", ""]
    if "error" in pred:
        lines.append(f"The planner could not evaluate this run: {pred['error']}.")
    else:
        lines.append(f"Planner: `plan.search.predict` for layout `{pred['layout']}` on {pred['hardware']}. "
                     f"Measured: medians over steps {meas['compared_steps']}, those run in this layout (the "
                     "first step of each start warms up and is left out); comm bytes are the ledger's "
                     "(rank 0, what it sends per step).")
        lines += ["", "| quantity | predicted | measured | error |", "|---|---|---|---|"]
        lines += [f"| {q} | {p} | {m} | {e} |" for q, p, m, e in comparison_rows(meas, pred)]
    lines += ["", "## Communication per step (ledger, rank 0, last step)", "",
              "| dim | op | bytes |", "|---|---|---|"]
    last = meas["comm_bytes_last_step"]
    lines += [f"| {d} | {o} | {b:,} |" for d in sorted(last) for o, b in sorted(last[d].items())] or ["| - | - | 0 |"]
    lines += ["", "## Curves", "", f"![{plots[0]}]({plots[0]})"]
    if HEATMAP in plots:
        lines += ["", "## Expert load", "", "Each MoE layer's share of its routed assignments per expert, summed "
                  "over every step of the run (a balanced layer is a flat row at 1/experts).", "",
                  f"![{HEATMAP}]({HEATMAP})"]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def add_report_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("report", help="write report.md (+ PNGs) for a finished run directory",
                              description="Predicted vs measured for a run: reads RUN_DIR/metrics.jsonl and "
                                          "run.json, writes report.md, report.json and report.png there.")
    p.add_argument("run_dir", help="a run's directory (<log.dir>/<YYYYmmdd-HHMMSS>), or log.dir itself for its newest "
                                   "run (the `latest` link)")
    p.add_argument("--hardware-profile", default=None,
                   help="a `pentatron bench` profile of the machine the run used (for the time prediction)")
    p.set_defaults(func=run_report)


def run_report(args: Any) -> int:
    import sys

    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file() and (run_dir / "latest" / "metrics.jsonl").is_file():
        run_dir = (run_dir / "latest").resolve()  # log.dir given: its newest run
    try:
        path = write_report(run_dir, Path(args.hardware_profile) if args.hardware_profile else None)
    except ReportError as e:
        print(f"pentatron: error: {e}", file=sys.stderr)
        return 2
    print(f"pentatron: wrote {path}")
    return 0
