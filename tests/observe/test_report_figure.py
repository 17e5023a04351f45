"""report.png's figure (observe/report_figure.py) and the report's links to its pictures, from step records
written here (no training): which panels are drawn and what each holds — never pixels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pentatron.observe.report import write_report
from pentatron.observe.report_figure import report_figure, smoothing_window, trailing_mean

PANELS = ["loss", "learning rate", "gradient norm", "throughput (whole job)",
          "peak memory, rank 0 (since training began)", "communication sent per step, rank 0"]


def _records(n: int = 40, resume_at: int = 25, moe: bool = False) -> list[dict]:
    """A run of n steps on 2 ranks, resumed in another layout at `resume_at`, evaluated every 10 steps."""
    out = []
    for s in range(1, n + 1):
        first = s < resume_at
        r = {"step": s, "loss": 8.0 - 0.1 * s + 0.3 * (s % 2), "grad_norm": 1.0 + 1 / s, "lr": 1e-3 * min(s, 5) / 5,
             "tokens_per_s": 1000.0 + s, "step_time_s": 0.5, "mfu": 0.1, "peak_mem_bytes": (300 + s) * 2**20,
             "peak_mem_reserved_bytes": None,
             "comm_bytes": {"dp": {"all_reduce": 4 * 2**20}} if first else {"pp": {"send": 2**20, "recv": 2**20}},
             "layout": "dp2 tp1 pp1" if first else "dp1 tp1 pp2", "start_step": 0 if first else resume_at - 1}
        if s % 10 == 0:
            r["val"] = {"loss": 7.5 - 0.1 * s}
        if moe:
            r["moe"] = {"layers.0.moe": {"tokens_per_expert": [s, 2 * s, 3, 4]}}
        out.append(r)
    return out


INFO = {"config": {"model": {"name": "debug"}, "train": {"clip": 1.0}}, "world_size": 2, "device": "cpu",
        "device_name": "cpu"}


def test_the_figure_draws_every_panel_with_its_series():
    records = _records()
    fig = report_figure(records, INFO)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == PANELS
    loss, lr, gnorm, tps, mem, comm = axes
    # the learning-rate panel draws each step's lr
    line = lr.get_lines()[0]  # (the others: the resume marker)
    assert list(line.get_ydata()) == [r["lr"] for r in records]
    # loss: each step, the trailing mean (its window named), the validation points, the resume
    labels = [t.get_text() for t in loss.get_legend().get_texts()]
    k = smoothing_window(len(records))
    assert labels == ["training, each step", f"training, mean of the last {k} steps", "validation ([eval])",
                      "resumed, new layout"]
    smooth = loss.get_lines()[1].get_ydata()
    assert list(smooth) == pytest.approx(trailing_mean([r["loss"] for r in records], k))
    val = loss.get_lines()[2]
    assert list(val.get_xdata()) == [10, 20, 30, 40] and list(val.get_ydata()) == pytest.approx([6.5, 5.5, 4.5, 3.5])
    # the gradient norm with the run's clip; the comm bytes each dimension sent (receives left out), in MiB
    assert [t.get_text() for t in gnorm.get_legend().get_texts()][:2] == ["‖g‖ before clipping", "clip = 1"]
    assert comm.get_ylabel() == "MiB"
    sent = {ln.get_label(): list(ln.get_ydata()) for ln in comm.get_lines() if ln.get_label() in ("dp", "pp")}
    assert sent["dp"][:24] == [4.0] * 24 and sent["dp"][24:] == [0.0] * 16 and sent["pp"][24:] == [1.0] * 16
    assert mem.get_ylabel() == "MiB" and tps.get_ylabel() == "tokens/s"
    assert fig._suptitle.get_text() == "debug — dp1 tp1 pp2\n2 processes on cpu, steps 1…40"


def test_smoothing_is_a_trailing_mean():
    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smoothing_window(5) == 1 and smoothing_window(40) == 4 and smoothing_window(10_000) == 100


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_report_md_links_the_pictures_it_wrote(tmp_path: Path, moe: bool):
    """report.md shows report.png; an MoE run's expert_load.png is drawn from every step and linked."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(12, 8, moe)))
    md = write_report(tmp_path).read_text()
    assert "![report.png](report.png)" in md and (tmp_path / "report.png").is_file()
    assert ("![expert_load.png](expert_load.png)" in md) == moe == (tmp_path / "expert_load.png").is_file()
