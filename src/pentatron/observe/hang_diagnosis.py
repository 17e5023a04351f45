"""From the flight-recorder dumps of every rank, decide who is stuck and say it on one screen.

A rank *waits* on its oldest op not yet completed. For a collective, every other member of the group
should have entered the same op (same per-group sequence number); for a send or receive, the peer
should have entered the matching receive or send. A member that has not is what the waiting rank
waits on. The stuck ranks (the culprits) are those that others wait on and that do not wait
themselves, plus ranks that did not answer the dump request (stopped, killed, or blocked outside
Python), whose last periodic heartbeat is shown instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pentatron.observe.flight_recorder import seq_key

MAX_RANK_LINES = 12


@dataclass
class Diagnosis:
    culprits: list[int]
    text: str


def _op(rec: dict[str, Any]) -> str:
    peer = "" if rec["peer"] is None else (f" to rank {rec['peer']}" if rec["op"] == "send"
                                            else f" from rank {rec['peer']}")
    return f"{rec['dim']} {rec['op']}{peer} #{rec['seq']}"


def _where(rec: dict[str, Any]) -> str:
    micro = "" if rec["micro"] is None else f" micro-batch {rec['micro']}"
    return f"step {rec['step']}{micro}, {rec['site']}"


def _last(d: dict[str, Any]) -> str:
    if not d["records"]:
        return "no op recorded"
    rec = d["records"][-1]
    state = "completed" if rec["done"] else "not completed"
    return f"{_op(rec)} {rec['shape']} {rec['dtype']} ({_where(rec)}), {state}"


def _oldest_pending(d: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in d["records"] if not r["done"]), None)


def _waits_on(rank: int, rec: dict[str, Any], known: dict[int, dict[str, Any] | None]) -> list[int]:
    """The ranks that have not entered the op `rank` waits in (unknown ranks count as not entered)."""
    if rec["peer"] is None:
        others = [(m, rec["dim"]) for m in rec["ranks"] if m != rank]
    else:
        others = [(rec["peer"], seq_key(rec["dim"], "recv" if rec["op"] == "send" else "send", rank))]
    behind = []
    for m, key in others:
        d = known.get(m)
        if d is None or d["entered"].get(key, 0) < rec["seq"]:
            behind.append(m)
    return behind


def diagnose(dumps: dict[int, dict[str, Any]], heartbeats: dict[int, dict[str, Any]], world_size: int,
             timeout_s: float, by_rank: int, dump_dir: str) -> Diagnosis:
    """`dumps`: ranks that answered; `heartbeats`: the last periodic snapshot of any rank."""
    silent = [r for r in range(world_size) if r not in dumps]
    known: dict[int, dict[str, Any] | None] = {r: dumps.get(r) or heartbeats.get(r) for r in range(world_size)}
    waits = {r: rec for r, d in dumps.items() if (rec := _oldest_pending(d)) is not None}
    edges = {r: _waits_on(r, rec, known) for r, rec in waits.items()}

    suspects = sorted({m for ms in edges.values() for m in ms})
    culprits = [m for m in suspects if m not in waits]  # waited on, not waiting themselves
    culprits += [r for r in silent if r not in culprits and (not culprits or r in suspects)]
    cycle = not culprits and bool(suspects)
    if cycle:  # everyone waits on someone who waits: ops were entered in different orders
        culprits = suspects
    culprits.sort()

    lines = [f"pentatron: HANG: no progress for {timeout_s:g} s (diagnosis by rank {by_rank}; "
             f"dumps in {dump_dir})"]
    for m in culprits:
        waiting = sorted(r for r, ms in edges.items() if m in ms)
        if waiting:
            rec = waits[waiting[0]]
            lines.append(f"rank {m} has not entered {_op(_counterpart(rec, waiting[0]))}; "
                         f"rank{'s' if len(waiting) > 1 else ''} {','.join(map(str, waiting))} "
                         f"wait{'' if len(waiting) > 1 else 's'} there "
                         f"({_where(rec)})")
        d = known[m]
        if m in silent:
            age = "" if d is None else f", last heartbeat {max(0.0, _now(dumps) - d['time']):.1f} s before the dumps"
            lines.append(f"rank {m} did not answer the dump request (stopped, killed, or blocked outside "
                         f"Python){age}")
        if d is not None:
            lines.append(f"rank {m}'s last op: {_last(d)}")
            if d.get("main_stack"):
                lines.append(f"rank {m}'s main thread: {d['main_stack'][-1]}")
    if cycle:
        lines.append("every rank named above waits for another one: they entered ops in different orders "
                     "(rerun with distributed.check_collectives = true to see the first mismatch)")
    if not culprits:
        lines.append("all ranks entered the op they wait in, but it did not complete (mismatched shapes or "
                     "a backend failure?); rerun with distributed.check_collectives = true")
    lines.append("per rank:")
    for r in range(min(world_size, MAX_RANK_LINES)):
        if r in waits:
            d = dumps[r]
            lines.append(f"  rank {r}: waits in {_op(waits[r])} for {d['stalled_s']:.1f} s ({_where(waits[r])})")
        elif r in dumps:
            lines.append(f"  rank {r}: not in a collective; last op {_last(dumps[r])}")
        else:
            lines.append(f"  rank {r}: no answer")
    if world_size > MAX_RANK_LINES:
        lines.append(f"  … {world_size - MAX_RANK_LINES} more ranks in the dumps")
    lines.append(f"stuck rank{'s' if len(culprits) != 1 else ''}: "
                 f"{', '.join(map(str, culprits)) if culprits else 'unknown'}")
    return Diagnosis(culprits, "\n".join(lines))


def _counterpart(rec: dict[str, Any], waiting: int) -> dict[str, Any]:
    """The op another rank should enter to match `waiting`'s `rec`: the same collective, or the other
    side of the message (whose peer is the waiting rank)."""
    if rec["peer"] is None:
        return rec
    return {**rec, "op": "recv" if rec["op"] == "send" else "send", "peer": waiting}


def _now(dumps: dict[int, dict[str, Any]]) -> float:
    return max((d["time"] for d in dumps.values()), default=0.0)
