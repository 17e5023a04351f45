"""The planner's memory chart (`--chart`): one horizontal stacked bar per ranked layout, labelled with the
layout, the HBM and headroom lines, the legend holding only the components drawn. Artists, not pixels."""

from __future__ import annotations

import dataclasses

import pytest
from matplotlib.patches import Rectangle

from pentatron.hardware.catalogue import GiB, get_gpu
from pentatron.models.registry import get_model_config
from pentatron.plan.layout import Layout, Workload
from pentatron.plan.memory import COMPONENTS
from pentatron.plan.report import memory_chart, memory_figure
from pentatron.plan.search import memory_budget, predict


def test_each_layout_is_a_labelled_horizontal_bar(tmp_path):
    gpu = dataclasses.replace(get_gpu("h100-sxm"), headroom=0.05)
    w = Workload(get_model_config("llama3-8b"), 4096, 64)
    preds = [predict(w, Layout(dp=8, zero=z, micro_batch=1), gpu) for z in (1, 3)] + \
        [predict(w, Layout(dp=2, tp=4, sp=True, micro_batch=1, recompute="full"), gpu)]
    fig = memory_figure(preds, gpu, "llama3-8b on 8 x h100-sxm")
    (ax,) = fig.axes
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [f"#{i} {p.layout.short()}" for i, p in enumerate(preds, 1)]
    assert ax.yaxis_inverted()  # #1 on top, as in the table
    # each row's segments add up to that layout's predicted total; the total is written at the bar's end
    bars = [b for b in ax.patches if isinstance(b, Rectangle)]
    for row, p in enumerate(preds):
        widths = [b.get_width() for b in bars if abs(b.get_y() + b.get_height() / 2 - row) < 1e-9]
        assert sum(widths) == pytest.approx(p.memory.total / GiB)
    assert [t.get_text() for t in ax.texts] == [f" {p.memory.total / GiB:.1f}" for p in preds]
    # vertical lines at the HBM and at the headroom budget; the legend: components drawn, then the lines
    assert [ln.get_xdata()[0] for ln in ax.get_lines()] == pytest.approx([80.0, memory_budget(gpu) / GiB])
    drawn = [c.replace("_", " ") for c in COMPONENTS if any(getattr(p.memory, c) > 0 for p in preds)]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[:len(drawn)] == drawn and legend[len(drawn)].startswith("h100-sxm HBM 80 GiB")
    assert "5 % headroom" in legend[-1]
    assert memory_chart(preds, gpu, tmp_path / "mem.png").read_bytes()[:4] == b"\x89PNG"
