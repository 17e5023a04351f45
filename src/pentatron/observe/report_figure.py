"""`report.png`: a run's curves in one figure, a grid of readable panels — loss (each step faint, a
trailing mean over it, the validation points under [eval]), learning rate, gradient norm (with the clip),
throughput, peak memory and the communication rank 0 sent per step by dimension — titled with the run's
model and layout. Drawn at the end of every training run, so it is one `Figure` on the Agg canvas: no
pyplot, no global state, nothing left open.

A resume is marked on every panel by a dotted vertical line at its first step (records carry
`start_step`), "new layout" when the run went on in another one (records' `layout`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLUMNS = 3
PANEL_IN = (4.5, 3.0)  # inches per panel (width, height)
DPI = 120              # 4.5 in × 120 = 540 px per panel: sharp lines and labels, ~1.6k px wide in all
RAW_ALPHA = 0.3


def comm_sent_series(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per step, the bytes rank 0 sent by dimension under the planner's names (receives left out): what the
    report table's measured comm rows average, drawn in the PNG."""
    from pentatron.plan.comm import report_dim

    dims = sorted({report_dim(d) for r in records for d in r.get("comm_bytes", {})})
    out: dict[str, list[float]] = {d: [0.0] * len(records) for d in dims}
    for i, r in enumerate(records):
        for dim, ops in r.get("comm_bytes", {}).items():
            out[report_dim(dim)][i] += sum(b for op, b in ops.items() if op != "recv")
    return out


def smoothing_window(n: int) -> int:
    """Steps in the loss's trailing mean: a tenth of the run, 2 … 100 (1: too few steps to smooth)."""
    return 1 if n < 6 else max(2, min(100, n // 10))


def trailing_mean(ys: list[float], k: int) -> list[float]:
    """Each point the mean of itself and the k − 1 before it (fewer at the start): no look-ahead, so the
    curve's last point is what the run's last k steps did."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= k:
            total -= ys[i - k]
        out.append(total / min(i + 1, k))
    return out


def _bytes_unit(largest: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= 2 * scale:
            return unit, scale
    return "B", 1.0


def _resumes(records: list[dict[str, Any]]) -> list[tuple[float, str]]:
    """(x, label) of each start after the first: where a record's start_step changes."""
    out = []
    for prev, r in zip(records, records[1:]):
        if r.get("start_step", 0) != prev.get("start_step", 0):
            new_layout = r.get("layout") != prev.get("layout")
            out.append((r["step"] - 0.5, "resumed, new layout" if new_layout else "resumed"))
    return out


def title_lines(records: list[dict[str, Any]], info: dict[str, Any] | None) -> str:
    """The figure's title: model and layout (the last step's, as the record names it), then where it ran."""
    layout = records[-1].get("layout") or "layout not recorded"
    steps = f"steps {records[0]['step']}…{records[-1]['step']}"
    if info is None:
        return f"{layout}\n{steps}"
    model = info["config"]["model"].get("name") or "custom model"
    world = info.get("world_size", 1)
    device, name = info.get("device", "?"), info.get("device_name", "?")
    where = name if name == device else f"{name} ({device})"
    return f"{model} — {layout}\n{world} process{'es' if world != 1 else ''} on {where}, {steps}"


def report_figure(records: list[dict[str, Any]], info: dict[str, Any] | None) -> Any:
    """The run's curves as one matplotlib Figure (Agg canvas attached), from its step records (`load_records`)
    and run.json (`info`, None for a run without one)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [r["step"] for r in records]
    panels = 6
    rows = -(-panels // COLUMNS)
    fig = Figure(figsize=(PANEL_IN[0] * COLUMNS, PANEL_IN[1] * rows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, COLUMNS, squeeze=False).flatten()
    resumes = _resumes(records)

    # loss: every step faint, the trailing mean bold, the validation points
    ax = axes[0]
    k = smoothing_window(len(records))
    _raw_and_mean(ax, steps, [r["loss"] for r in records], k, "C0", "training, ")
    vals = [r for r in records if "val" in r]
    if vals:
        ax.plot([r["step"] for r in vals], [r["val"]["loss"] for r in vals], "o-", color="C3", ms=4,
                label="validation ([eval])")
    _finish(ax, "loss", "nats per token", resumes, legend=True)

    ax = axes[1]
    ax.plot(steps, [r.get("lr", float("nan")) for r in records], color="C2")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    _finish(ax, "learning rate", "lr", resumes)

    ax = axes[2]
    norms = [r["grad_norm"] for r in records]
    ax.plot(steps, norms, color="C1", lw=1, label="‖g‖ before clipping")
    clip = (info or {}).get("config", {}).get("train", {}).get("clip")
    if clip:
        ax.axhline(clip, color="k", ls="--", lw=1, label=f"clip = {clip:g}")
    positive = [g for g in norms if g > 0]
    if positive and max(positive) > 50 * min(positive):
        ax.set_yscale("log")
    _finish(ax, "gradient norm", "‖g‖ (global)", resumes, legend=bool(clip))

    ax = axes[3]
    _raw_and_mean(ax, steps, [r["tokens_per_s"] for r in records], k, "C4", "")
    _finish(ax, "throughput (whole job)", "tokens/s", resumes, legend=k > 1)

    ax = axes[4]
    cpu = (info or {}).get("device") == "cpu"
    mem = {"resident set" if cpu else "allocated": [r["peak_mem_bytes"] for r in records]}
    reserved = [r.get("peak_mem_reserved_bytes") for r in records]
    if all(b is not None for b in reserved):
        mem["reserved"] = reserved
    unit, scale = _bytes_unit(max(max(ys) for ys in mem.values()))
    for i, (label, ys) in enumerate(mem.items()):
        ax.plot(steps, [b / scale for b in ys], color=f"C{5 + i}", label=label)
    _finish(ax, "peak memory, rank 0 (since training began)", unit, resumes, legend=len(mem) > 1)

    ax = axes[5]
    comm = comm_sent_series(records)
    if comm:
        unit, scale = _bytes_unit(max(max(ys) for ys in comm.values()))
        for d, ys in comm.items():
            ax.plot(steps, [b / scale for b in ys], label=d)
        _finish(ax, "communication sent per step, rank 0", unit, resumes, legend=True)
    else:
        ax.text(0.5, 0.5, "no collectives\n(one process)", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title("communication sent per step, rank 0", fontsize=10)
    for extra in axes[panels:]:
        extra.set_visible(False)
    fig.suptitle(title_lines(records, info), fontsize=11)
    return fig


def _raw_and_mean(ax: Any, steps: list[int], ys: list[float], k: int, color: str, prefix: str) -> None:
    """Each step's value (faint when smoothed) and, with k > 1, its trailing mean over k steps (bold)."""
    ax.plot(steps, ys, color=color, alpha=RAW_ALPHA if k > 1 else 1.0, lw=1, label=f"{prefix}each step")
    if k > 1:
        ax.plot(steps, trailing_mean(ys, k), color=color, lw=2, label=f"{prefix}mean of the last {k} steps")


def _finish(ax: Any, title: str, ylabel: str, resumes: list[tuple[float, str]], legend: bool = False) -> None:
    for i, (x, label) in enumerate(resumes):
        ax.axvline(x, color="0.4", ls=":", lw=1, label=label if legend and i == 0 else None)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8)


def write_report_png(run_dir: Path, records: list[dict[str, Any]], info: dict[str, Any] | None) -> Path:
    path = Path(run_dir) / "report.png"
    report_figure(records, info).savefig(path, dpi=DPI)
    return path
