"""Any slice of a parameter's initial value, without ever holding the whole parameter.

A parameter starts from (seed, its name) alone: norm gains at 1, every matrix ~ N(0, std) drawn from a
CPU `torch.Generator` seeded by `param_seed(seed, name)`, in row-major order. `fill_slice` writes any
box of that full tensor (a tensor-parallel shard, an ep rank's experts), or any range of the flattened
box (a ZeRO-3 piece), by drawing the full parameter in chunks of whole rows of dim 0 and keeping only
what falls in the box, so a rank's peak is its own share plus one chunk.

Chunk stability (checked by tests/models/test_param_init.py): torch's CPU normal sampler fills 16
values at a time (Box–Muller on 8 + 8 uniforms) and, when the count is not a multiple of 16, redraws
the last 16 with fresh uniforms; tensors under 16 values take a scalar path. So successive draws from
one generator concatenate to exactly one big draw when every chunk but the last holds a multiple of 16
values and the last at least 16 (or the whole tensor is drawn at once). Chunks are sized to that rule;
a chunk is at most `chunk_numel` values, or one row of dim 0 when a row is larger (one expert's matrix
for stacked expert weights). Rows after the box's last row are never drawn.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

CHUNK_NUMEL = 4 * 2**20  # values per chunk (16 MiB of fp32): the bound on what init holds beyond the share
Box = Sequence[tuple[int, int]]  # (start, length) along each dim of the full tensor


@dataclass(frozen=True)
class ParamInit:
    """How one parameter starts: all ones (norm gains), or N(0, std) from generator seed `seed`."""

    ones: bool
    std: float = 0.0
    seed: int = 0


def param_seed(seed: int, name: str) -> int:
    # A stable per-parameter seed (crc32, not Python's salted hash): a parameter's initial value
    # depends only on (seed, name), whatever else is built, sharded or skipped on this process.
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def chunk_rows(rows: int, row_numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """[start, end) row ranges whose successive draws equal one draw of the whole [rows, …] tensor."""
    if rows * row_numel <= max(chunk_numel, 16):
        return [(0, rows)]
    step = 16 // math.gcd(row_numel, 16)  # rows per chunk must hold a multiple of 16 values
    k = max(step, chunk_numel // row_numel // step * step)
    out, r = [], 0
    while r < rows:
        end = min(rows, r + k)
        if (rows - end) * row_numel < 16:  # a short tail would take the scalar path: draw it now
            end = rows
        out.append((r, end))
        r = end
    return out


@torch.no_grad()
def fill_slice(out: torch.Tensor, init: ParamInit, full_shape: Sequence[int], box: Box | None = None,
               lo: int = 0, hi: int | None = None, chunk_numel: int | None = None) -> None:
    """Write elements [lo, hi) of the flattened `box` of the parameter's full initial value into `out`
    (a flat or box-shaped tensor of hi − lo elements, any device and dtype). `box`: None for the whole
    tensor; [lo, hi) defaults to the whole box; `chunk_numel` defaults to the module's `CHUNK_NUMEL`."""
    full_shape = tuple(full_shape)
    box = tuple(box) if box is not None else tuple((0, s) for s in full_shape)
    box_numel = math.prod(n for _, n in box)
    hi = box_numel if hi is None else hi
    flat = out.view(-1)
    if flat.numel() != hi - lo:
        raise ValueError(f"fill_slice: out holds {flat.numel()} elements, the range [{lo}, {hi}) {hi - lo}")
    if hi <= lo:
        return
    if init.ones:
        flat.fill_(1.0)
        return
    rows, row0 = full_shape[0], box[0][0]
    row_numel = math.prod(full_shape[1:])
    local_row = box_numel // box[0][1]  # elements of one dim-0 row of the box
    first, last = row0 + lo // local_row, row0 + (hi - 1) // local_row + 1  # full rows holding [lo, hi)
    g = torch.Generator(device="cpu").manual_seed(init.seed)
    for start, end in chunk_rows(rows, row_numel, CHUNK_NUMEL if chunk_numel is None else chunk_numel):
        if start >= last:
            break  # nothing after the box's last needed row is drawn
        chunk = torch.randn((end - start, *full_shape[1:]), generator=g, dtype=torch.float32)
        a, z = max(start, first), min(end, last)
        if a >= z:
            continue
        part = chunk[a - start: z - start]
        for d, (s, n) in enumerate(box[1:], start=1):
            part = part.narrow(d, s, n)
        # flat positions of these rows in the box, clipped to [lo, hi)
        p_lo, p_hi = (a - row0) * local_row, (z - row0) * local_row
        c_lo, c_hi = max(p_lo, lo), min(p_hi, hi)
        values = part.reshape(-1)[c_lo - p_lo: c_hi - p_lo].mul(init.std)
        flat[c_lo - lo: c_hi - lo].copy_(values)
