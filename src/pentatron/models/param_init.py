"""Any slice of a parameter's initial value, drawn in time and memory proportional to the slice.

A parameter starts from (seed, its name) alone: norm gains at 1, every matrix ~ N(0, std). The full
tensor is cut into fixed tiles (`tile_shape`: TILE_ROWS × TILE_COLS over its last two dims, one index
of every earlier dim), and each tile is drawn from its own `torch.Generator`, keyed by (parameter seed,
tile index) through a SplitMix64 hash — a counter-based scheme, so any tile can be drawn without drawing
the ones before it — on the CPU, or on the CUDA device being filled (`draw_device`). `fill_slice` writes
any box of the full tensor (a tensor-parallel shard along any dim, an ep rank's experts) or any range of
the flattened box (a ZeRO-3 piece) by drawing only the tiles that overlap it: a rank's work is its own
share (plus the tiles its edges cut), and its peak beyond the share is one tile. The 1-process build
draws every tile the same way, so every layout starts from bit-identical weights.

The tile shape is part of the scheme (other tiles, other values); tests shrink it through the module
attributes to make a small model span many tiles.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

TILE_ROWS, TILE_COLS = 128, 256  # a tile of a matrix (128 KiB of fp32): shards of real models align to 256 columns
TILE_1D = 65536  # a tile of a vector
Box = Sequence[tuple[int, int]]  # (start, length) along each dim of the full tensor
_MASK64 = 2**64 - 1


@dataclass(frozen=True)
class ParamInit:
    """How one parameter starts: all ones (norm gains), or N(0, std) keyed by `seed`."""

    ones: bool
    std: float = 0.0
    seed: int = 0


def param_seed(seed: int, name: str) -> int:
    # A stable per-parameter seed (crc32, not Python's salted hash): a parameter's initial value
    # depends only on (seed, name), whatever else is built, sharded or skipped on this process.
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def tile_seed(seed: int, index: Sequence[int]) -> int:
    """The generator seed of one tile: the parameter's seed and the tile's index along each dim, hashed
    (nearby tiles get unrelated streams, unlike seed + counter)."""
    h = _splitmix64(seed)
    for i in index:
        h = _splitmix64(h ^ i)
    return h % (2**63)


def tile_shape(full_shape: Sequence[int]) -> tuple[int, ...]:
    """Tile extent along each dim (never more than the dim)."""
    if len(full_shape) == 1:
        return (min(full_shape[0], TILE_1D),)
    lead = tuple(1 for _ in full_shape[:-2])
    return (*lead, min(full_shape[-2], TILE_ROWS), min(full_shape[-1], TILE_COLS))


def draw_device(out: torch.Tensor) -> torch.device:
    """Where tiles for `out` are drawn: on a CUDA device itself (its Philox generator, so start-up is not
    bound by a host generator feeding the GPU), else on the CPU. CUDA draws are not the CPU's values, but
    they are the same on every rank and layout of a run (one GPU model, one torch build)."""
    return out.device if out.device.type == "cuda" else torch.device("cpu")


def draw_tile(init: ParamInit, full_shape: Sequence[int], index: Sequence[int],
              device: torch.device | None = None) -> torch.Tensor:
    """Tile `index` of the parameter's full initial value (fp32 on `device`, CPU by default; edge tiles
    are cut to the tensor)."""
    tile = tile_shape(full_shape)
    shape = [min(t, n - i * t) for t, n, i in zip(tile, full_shape, index, strict=True)]
    device = torch.device("cpu") if device is None else device
    g = torch.Generator(device=device).manual_seed(tile_seed(init.seed, index))
    return torch.randn(shape, generator=g, dtype=torch.float32, device=device).mul_(init.std)


def flat_range_boxes(lengths: Sequence[int], lo: int, hi: int) -> Iterator[tuple[int, tuple[tuple[int, int], ...]]]:
    """Cut elements [lo, hi) of a row-major tensor of `lengths` into boxes, each contiguous in that order:
    yields (offset from lo, box as (start, length) per dim). At most 2·ndim − 1 boxes."""
    if hi <= lo:
        return
    if len(lengths) == 1:
        yield 0, ((lo, hi - lo),)
        return
    inner = math.prod(lengths[1:])
    full_inner = tuple((0, n) for n in lengths[1:])
    r0, r1 = lo // inner, (hi - 1) // inner
    if r0 == r1:  # inside one row: recurse into it
        for off, box in flat_range_boxes(lengths[1:], lo - r0 * inner, hi - r0 * inner):
            yield off, ((r0, 1), *box)
        return
    pos, first_full = lo, r0
    if lo % inner:  # the first row's tail
        yield from ((off, ((r0, 1), *box)) for off, box in flat_range_boxes(lengths[1:], lo % inner, inner))
        pos, first_full = (r0 + 1) * inner, r0 + 1
    last_full = r1 + 1 if hi % inner == 0 else r1  # rows [first_full, last_full) are whole
    if last_full > first_full:
        yield pos - lo, ((first_full, last_full - first_full), *full_inner)
    if hi % inner:  # the last row's head
        yield from ((r1 * inner - lo + off, ((r1, 1), *box)) for off, box in flat_range_boxes(lengths[1:], 0,
                                                                                               hi - r1 * inner))


@torch.no_grad()
def fill_box(out: torch.Tensor, init: ParamInit, full_shape: Sequence[int], box: Box) -> None:
    """Write the `box` of the full initial value into `out` (box-shaped), drawing only overlapping tiles."""
    tile = tile_shape(full_shape)
    ranges = [range(s // t, (s + n - 1) // t + 1) for (s, n), t in zip(box, tile, strict=True)]
    device = draw_device(out)
    for index in itertools.product(*ranges):
        values = draw_tile(init, full_shape, index, device)
        src, dst = [], []
        for (s, n), t, i in zip(box, tile, index, strict=True):
            a, z = max(s, i * t), min(s + n, (i + 1) * t)
            src.append(slice(a - i * t, z - i * t))
            dst.append(slice(a - s, z - s))
        out[tuple(dst)].copy_(values[tuple(src)])


@torch.no_grad()
def fill_slice(out: torch.Tensor, init: ParamInit, full_shape: Sequence[int], box: Box | None = None,
               lo: int = 0, hi: int | None = None) -> None:
    """Write elements [lo, hi) of the flattened `box` of the parameter's full initial value into `out`
    (a flat or box-shaped tensor of hi − lo elements, any device and dtype). `box`: None for the whole
    tensor; [lo, hi) defaults to the whole box."""
    full_shape = tuple(full_shape)
    box = tuple(box) if box is not None else tuple((0, s) for s in full_shape)
    lengths = [n for _, n in box]
    hi = math.prod(lengths) if hi is None else hi
    flat = out.view(-1)
    if flat.numel() != hi - lo:
        raise ValueError(f"fill_slice: out holds {flat.numel()} elements, the range [{lo}, {hi}) {hi - lo}")
    if init.ones:
        flat.fill_(1.0)
        return
    for offset, sub in flat_range_boxes(lengths, lo, hi):
        numel = math.prod(n for _, n in sub)
        target = flat[offset: offset + numel].view([n for _, n in sub])
        fill_box(target, init, full_shape, [(b0 + s, n) for (b0, _), (s, n) in zip(box, sub, strict=True)])
