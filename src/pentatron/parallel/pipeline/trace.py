"""Recorded pipeline timelines: the engine's per-rank action timestamps → a `schedules.Timeline` (the same
object the planner's simulation produces, so bubble fraction and drawing are one code path), and to
and from Chrome/Perfetto trace JSON (open in ui.perfetto.dev or chrome://tracing).

Times inside a `Timeline` are seconds from the earliest action of the step on any rank. The engine's
stamps are `time.perf_counter()`, a system-wide monotonic clock on Linux, so stamps from processes on
one host line up; across hosts each rank's clock differs and the picture is only as aligned as they.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pentatron.schedules import Action, Kind, Slot, Timeline, busy_window


def recorded_timeline(slots_by_rank: Sequence[Sequence[Slot]], name: str = "recorded", *,
                      rebase: bool = True) -> Timeline:
    """A Timeline from the engine's slots (one list per pipeline rank, absolute times), re-based to the
    step's first action unless `rebase=False` (a rank writing its own trace file keeps the absolute
    clock, so that files from several ranks can be merged by `read_chrome_trace`)."""
    starts = [s.start for slots in slots_by_rank for s in slots]
    t0 = min(starts) if starts and rebase else 0.0
    rel = [[Slot(r, s.action, s.start - t0, s.end - t0) for s in slots] for r, slots in enumerate(slots_by_rank)]
    makespan = max((s.end for slots in rel for s in slots), default=0.0) - (0.0 if rebase else min(starts, default=0.0))
    busy = [busy_window(slots)[0] for slots in rel]  # overlaps counted once: never more than the rank's span
    return Timeline(len(rel), rel, makespan, busy, name)


def chrome_trace(timeline: Timeline, *, schedule: str = "", stage_of: dict[int, list[int]] | None = None,
                 pid_offset: int = 0) -> dict[str, Any]:
    """Trace-event JSON: one process per pipeline rank, one complete ("X") event per action, in µs.
    `stage_of[rank][chunk]` adds the global stage to each event's args when known."""
    events: list[dict[str, Any]] = []
    for r, slots in enumerate(timeline.slots):
        pid = r + pid_offset
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"pp rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        for s in slots:
            a = s.action
            args: dict[str, Any] = {"kind": a.kind.value, "microbatch": a.microbatch, "chunk": a.chunk, "rank": r}
            if stage_of is not None:
                args["stage"] = stage_of[r][a.chunk]
            events.append({"ph": "X", "name": str(a), "cat": a.kind.value, "pid": pid, "tid": 0,
                           "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": schedule or timeline.name, "bubble_fraction": timeline.bubble_fraction,
                          "pipeline_ranks": timeline.p}}


def write_rank_trace(path: str | Path, slots: Sequence[Slot], rank: int, p: int, schedule: str = "") -> Path:
    """One rank's trace file for one step, on the absolute clock (the trainer writes one per pp rank)."""
    by_rank: list[Sequence[Slot]] = [[] for _ in range(p)]
    by_rank[rank] = slots
    return write_chrome_trace(path, recorded_timeline(by_rank, schedule, rebase=False), schedule=schedule)


def write_chrome_trace(path: str | Path, timeline: Timeline, **kw: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(timeline, **kw)))
    return path


def read_chrome_trace(paths: str | Path | Sequence[str | Path]) -> Timeline:
    """A Timeline from one or more trace files written by `write_chrome_trace` (e.g. one per rank, each
    holding only its own rank's events): events are grouped by their `rank` arg."""
    if isinstance(paths, str | Path):
        paths = [paths]
    by_rank: dict[int, list[Slot]] = {}
    name = ""
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read trace {path}: {e}") from e
        name = name or data.get("otherData", {}).get("schedule", "")
        for ev in data.get("traceEvents", []) if isinstance(data, dict) else data:
            if ev.get("ph") != "X" or "kind" not in ev.get("args", {}):
                continue
            a = ev["args"]
            rank = int(a.get("rank", ev.get("pid", 0)))
            action = Action(Kind(a["kind"]), int(a["microbatch"]), int(a.get("chunk", 0)))
            start = ev["ts"] / 1e6
            by_rank.setdefault(rank, []).append(Slot(rank, action, start, start + ev["dur"] / 1e6))
    if not by_rank:
        raise ValueError(f"no pipeline actions found in {', '.join(map(str, paths))}")
    p = max(by_rank) + 1
    slots = [sorted(by_rank.get(r, []), key=lambda s: s.start) for r in range(p)]
    return recorded_timeline(slots, name or "recorded")
