"""Drawing schedules (planned and recorded) as PNGs, and the `pentatron schedule` command."""

from __future__ import annotations

import argparse

import matplotlib.image as mpimg
import pytest

from pentatron.parallel.pipeline.cli import add_schedule_parser
from pentatron.parallel.pipeline.draw import colour, draw_timeline
from pentatron.parallel.pipeline.trace import recorded_timeline, write_chrome_trace
from pentatron.schedules import Action, Kind, Slot, make_schedule, simulate


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pentatron")
    add_schedule_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["schedule", *argv])


def _image(path):
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 400
    return img


@pytest.mark.parametrize("name, v", [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)])
def test_draws_every_schedule(tmp_path, name, v):
    tl = simulate(make_schedule(name, 4, 8, v))
    img = _image(draw_timeline(tl, tmp_path / f"{name}.png"))
    # Boxes are drawn in the kind's colour: the picture is not blank.
    assert (img[..., :3] < 0.95).any(axis=-1).mean() > 0.05


def test_chunk_and_kind_colours_differ():
    assert colour(Kind.F, 0) != colour(Kind.F, 1) != colour(Kind.BW, 1)
    assert len({colour(k, 0) for k in Kind}) == 4


def test_cli_planned_and_recorded(tmp_path, capsys):
    args = _parse("--schedule", "interleaved", "--pp", "4", "--microbatches", "8", "--virtual", "2",
                  "--out", str(tmp_path / "il.png"))
    assert args.func(args) == 0
    # the idle share (p-1)/(v·m+p-1) = 3/19 (issue 46: the title printed the ratio (p-1)/(v·m) = 3/16)
    assert "bubble 15.8% (idle share)" in capsys.readouterr().out
    _image(tmp_path / "il.png")

    slots = [[Slot(0, Action(Kind.F, 0), 0.0, 1.0), Slot(0, Action(Kind.BW, 0), 3.0, 5.0)],
             [Slot(1, Action(Kind.F, 0), 1.0, 2.0), Slot(1, Action(Kind.BW, 0), 2.0, 4.0)]]
    trace = write_chrome_trace(tmp_path / "trace.json", recorded_timeline(slots, "1f1b"))
    args = _parse("--from-trace", str(trace), "--out", str(tmp_path / "rec.png"))
    assert args.func(args) == 0
    assert "recorded 1f1b: p=2" in capsys.readouterr().out
    _image(tmp_path / "rec.png")


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "interleaved", "--pp", "4", "--microbatches", "3", "--virtual", "2"], "at least the pipeline"),
    (["--schedule", "nope"], "unknown pipeline schedule"),
    (["--schedule", "1f1b", "--virtual", "2"], "only 'interleaved' uses v"),
])
def test_cli_bad_requests_exit_2(tmp_path, capsys, argv, message):
    args = _parse(*argv, "--out", str(tmp_path / "x.png"))
    assert args.func(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_cli_missing_trace_exits_2(tmp_path, capsys):
    args = _parse("--from-trace", str(tmp_path / "missing.json"), "--out", str(tmp_path / "x.png"))
    assert args.func(args) == 2
    assert "cannot read trace" in capsys.readouterr().err
