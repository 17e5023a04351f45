"""`pentatron schedule`: draw a pipeline schedule, planned (simulated from the schedule data) or recorded
(a Chrome trace written by the engine), as a PNG, and print its bubble: the share of the ranks' time
spent idle, idle / (busy + idle), in [0, 1].

    pentatron schedule --schedule 1f1b --pp 4 --microbatches 8 --out 1f1b.png
    pentatron schedule --schedule interleaved --pp 4 --microbatches 8 --virtual 2 --out il.png
    pentatron schedule --from-trace runs/x/pipeline_trace_rank*.json --out recorded.png
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pentatron.schedules import SCHEDULES, ScheduleError, make_schedule, simulate


def add_schedule_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `schedule` on an argparse subparsers object; sets `func=run_schedule`."""
    p = subparsers.add_parser("schedule", help="draw a pipeline schedule (planned or recorded) as a PNG",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)} (default 1f1b)")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks p (default 4)")
    p.add_argument("--microbatches", "-m", type=int, default=8, help="micro-batches per step m (default 8)")
    p.add_argument("--virtual", "-v", type=int, default=1, help="chunks per rank v (interleaved only)")
    p.add_argument("--cost-f", type=float, default=1.0, help="forward time per chunk (planned; default 1)")
    p.add_argument("--cost-b", type=float, default=1.0,
                   help="input-gradient backward time per chunk (planned; a full backward costs b + w)")
    p.add_argument("--cost-w", type=float, default=1.0, help="weight-gradient backward time per chunk (planned)")
    p.add_argument("--from-trace", nargs="+", metavar="FILE",
                   help="draw a recorded step from Chrome trace file(s) instead of planning one")
    p.add_argument("--out", required=True, help="output PNG path")
    p.set_defaults(func=run_schedule)
    return p


def run_schedule(args: argparse.Namespace) -> int:
    """Exit 0 on success, 2 on a bad request (message on stderr, no traceback)."""
    # Imported here: matplotlib costs ~0.5 s and the rest of the CLI does not need it.
    from pentatron.parallel.pipeline.draw import draw_timeline
    from pentatron.parallel.pipeline.trace import read_chrome_trace

    try:
        if args.from_trace:
            timeline = read_chrome_trace(args.from_trace)
            unit = "s"
            title = f"recorded {timeline.name}: p={timeline.p}, bubble {timeline.bubble_fraction:.1%} (idle share)"
        else:
            schedule = make_schedule(args.schedule, args.pp, args.microbatches, args.virtual)
            timeline = simulate(schedule, args.cost_f, args.cost_b, args.cost_w)
            unit = "forward = 1" if args.cost_f == 1.0 else ""
            v = f" v={schedule.v}" if schedule.v > 1 else ""
            title = (f"{schedule.name}: p={schedule.p} m={schedule.m}{v}, "
                     f"bubble {timeline.bubble_fraction:.1%} (idle share)")
        out = draw_timeline(timeline, args.out, title=title, unit=unit)
    except (ScheduleError, ValueError, OSError) as e:
        print(f"pentatron schedule: {e}", file=sys.stderr)
        return 2
    print(f"{title} -> {out}")
    return 0
