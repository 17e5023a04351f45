"""The lab's plots (lab/common.py): numeric x as lines, categories as bars — checked on the figure's artists,
never on pixels."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.patches import Rectangle

from pentatron.lab.common import plot_figure, save_plot


def test_categories_are_bars_and_numbers_are_lines(tmp_path: Path):
    panels = [{"title": "curve", "xlabel": "m", "ylabel": "ratio", "logx": True, "expected": ["= m"],
               "series": {"measured": ([1, 2, 4], [1.0, 2.1, 3.9]), "= m": ([1, 2, 4], [1.0, 2.0, 4.0])}},
              {"kind": "bar", "title": "runs", "ylabel": "seconds", "categories": ["check mode", "watchdog"],
               "series": {"wall": [0.2, 3.0], "cpu": [0.1, 0.5]}, "lines": {"timeout": 2.0}}]
    fig = plot_figure("title", panels)
    line_ax, bar_ax = fig.axes
    assert [ln.get_label() for ln in line_ax.get_lines()] == ["measured", "= m"]
    assert line_ax.get_lines()[1].get_linestyle() == "--" and line_ax.get_xscale() == "log"
    # two series × two categories = four bars, each with its value written on it, at category positions
    bars = [p for p in bar_ax.patches if isinstance(p, Rectangle)]
    assert sorted(b.get_height() for b in bars) == [0.1, 0.2, 0.5, 3.0]
    assert [t.get_text() for t in bar_ax.get_xticklabels()] == ["check mode", "watchdog"]
    assert sorted(t.get_text() for t in bar_ax.texts) == ["0.1", "0.2", "0.5", "3"]
    assert [t.get_text() for t in bar_ax.get_legend().get_texts()] == ["timeout", "wall", "cpu"]
    assert list(bar_ax.get_xticks()) == [0, 1]  # no 0–1 axis of fractional "positions"
    path = save_plot(tmp_path / "sub" / "p.png", "title", panels)
    assert path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("panel,error", [
    ({"title": "t", "xlabel": "", "ylabel": "", "series": {"a": (["fp32", "bf16"], [1.0, 2.0])}}, "bar panel"),
    ({"kind": "bar", "title": "t", "ylabel": "", "categories": ["a", "b"], "series": {"s": [1.0]}}, "1 values"),
    ({"kind": "pie", "title": "t", "ylabel": "", "series": {}}, "neither"),
])
def test_a_panel_of_the_wrong_kind_is_refused(panel: dict, error: str):
    with pytest.raises(ValueError, match=error):
        plot_figure("t", [panel])
