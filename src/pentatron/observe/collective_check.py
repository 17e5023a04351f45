"""Check mode (`distributed.check_collectives = true`): before each collective, the group's ranks exchange a
small descriptor (sequence number, op, dtype, shape, step, micro-batch, call site) and compare.

Why it catches a skipped collective at once: the check exchange is itself the first thing every rank
does before each op, so rank A's check for its k-th op always pairs with rank B's check for *its*
k-th op. If B skipped one, the two descriptors describe different calls (another shape, step or
micro-batch or call site), and both ranks raise `CollectiveMismatch` naming both sides, instead of the real op
silently pairing with the wrong one. (If the calls are indistinguishable in every field, e.g. two
identical all-reduces from one line within one micro-batch, only the watchdog's count at the end
can tell.)

The descriptor exchange calls torch.distributed directly on purpose: it is a debugging side channel,
not training traffic, so it stays out of the communication ledger. It costs one extra small
collective per op: a debug mode, off by default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pentatron.observe.flight_recorder import FlightRecord, format_site

if TYPE_CHECKING:
    from pentatron.distributed.comm import Comm

_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv", "barrier", "all_to_all")
_DTYPES = ("-", "float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8", "bool")
_MAX_DIMS = 4
_SITE_BYTES = 64
# seq, op, dtype, numel, ndim, step, micro, shape…, a spare slot, the call site packed 8 bytes per int
_LEN = 7 + _MAX_DIMS + 1 + _SITE_BYTES // 8


class CollectiveMismatch(RuntimeError):
    """Ranks of one group are about to call different ops (or the same op on different data)."""


def _describe(rec: FlightRecord, tensor_numel: int) -> list[int]:
    shape = list(rec.shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(len(rec.shape), _MAX_DIMS))
    dtype = _DTYPES.index(rec.dtype) if rec.dtype in _DTYPES else len(_DTYPES)
    site = format_site(rec.site).encode()[-_SITE_BYTES:].ljust(_SITE_BYTES, b"\0")
    packed = [int.from_bytes(site[i:i + 8], "little", signed=True) for i in range(0, _SITE_BYTES, 8)]
    return [rec.seq, _OPS.index(rec.op), dtype, tensor_numel, len(rec.shape), rec.step,
            -1 if rec.micro is None else rec.micro, *shape, 0, *packed]


def _decode(row: list[int]) -> dict:
    seq, op, dtype, numel, ndim, step, micro, *rest = row
    shape = [s for s in rest[:_MAX_DIMS] if s >= 0][:ndim]
    site = b"".join(int(v).to_bytes(8, "little", signed=True) for v in rest[_MAX_DIMS + 1:])
    return {"seq": seq, "op": _OPS[op], "dtype": _DTYPES[dtype] if dtype < len(_DTYPES) else "?",
            "numel": numel, "shape": shape, "step": step, "micro": None if micro < 0 else micro,
            "site": site.rstrip(b"\0").decode(errors="replace")}


def _say(rank: int, dim: str, d: dict, peer: str = "") -> str:
    micro = "" if d["micro"] is None else f" micro-batch {d['micro']}"
    return (f"rank {rank} calls {dim} {d['op']}{peer} #{d['seq']} shape {d['shape']} {d['dtype']} "
            f"at step {d['step']}{micro} ({d['site']})")


# The call site too: SPMD code calls a given collective from the same line on every rank, and two
# same-shaped all-reduces of one step (gradient, loss) differ only there.
_COMPARED = ("seq", "op", "dtype", "numel", "shape", "step", "micro", "site")


def _compared(d: dict) -> tuple:
    """What must agree across the group. An all-to-all's ranks each send their own number of rows (MoE
    dispatch: the tokens each routed), so there only the row's shape is compared, not the row count."""
    if d["op"] == "all_to_all":
        return (*(d[k] for k in _COMPARED if k not in ("numel", "shape")), tuple(d["shape"][1:]))
    return tuple(d[k] for k in _COMPARED)


class CollectiveChecker:
    """Verifies each collective against the other ranks of its group.

    Point-to-point messages are not checked here: a pipeline has sends in both directions in flight
    at once, so a symmetric descriptor handshake pairs the wrong messages, and a one-sided one would
    have to block a receive the schedule posts early. Their per-peer sequence numbers are in the
    flight record, so a missing send or receive is named by the watchdog instead."""

    def verify_collective(self, comm: Comm, rec: FlightRecord) -> None:
        group = dist.group.WORLD if rec.dim == "world" else comm.ctx.group(rec.dim)
        n = len(rec.ranks)
        numel = 1
        for s in rec.shape:
            numel *= s
        mine = torch.tensor(_describe(rec, numel), dtype=torch.int64, device=comm.ctx.device)
        rows = torch.empty(n * _LEN, dtype=torch.int64, device=comm.ctx.device)
        dist.all_gather_into_tensor(rows, mine, group=group)
        seen = [_decode(r) for r in rows.view(n, _LEN).tolist()]
        me = seen[rec.ranks.index(comm.ctx.rank)]
        odd = [i for i, d in enumerate(seen) if _compared(d) != _compared(me)]
        if odd:
            lines = [_say(rec.ranks[i], rec.dim, d) for i, d in enumerate(seen)]
            raise CollectiveMismatch(
                f"collective mismatch in {rec.dim} group (ranks {','.join(map(str, rec.ranks))}), "
                f"seen by rank {comm.ctx.rank}:\n  " + "\n  ".join(lines))
