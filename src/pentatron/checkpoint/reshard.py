"""Resume into another layout: every saved piece described by where it sits in the full tensor.

Saving: each rank writes `pieces/rank<r>.json` beside DCP's files, one entry per tensor it saved: the
parameter's name and full shape, its expert-parallel slice (an MoE layer's stacked experts: which of
ep equal slices of dim 0), its tensor-parallel shard (dim, index, parts) and local shape, the range
[lo, hi) of the flattened local shard the tensor holds (a ZeRO piece, or all of it), and the field (the
parameter, an fp32 master, or AdamW's exp_avg / exp_avg_sq / step). All of it comes from the
parameter's `Placement`, so it covers dp, ZeRO 0–3 (any bucketing), tp (replicated kv heads included),
pp (any schedule and virtual stages: a stage holds whole parameters), cp (a wider ZeRO group) and ep.
The MoE routers' aux-free biases, state but not parameters, are described as whole tensors.

Loading (`load_resharded`): for each tensor this rank's new layout wants, the rank reads — with DCP's
reader, on its own (`no_dist`), only the keys it needs — every saved piece of that parameter and field,
assembles the full tensor (pieces into their shards' flat ranges, tp shards concatenated along the tp
dim, expert slices along dim 0), checks that every element was covered, and cuts its own piece out: the
expert slice, the tp slice, then the flattened range. Pieces are read in batches of `READ_BATCH_BYTES`
(or one tensor, when larger), so beyond the rank's own state the memory is one batch plus the full
tensor being cut — a full parameter, not a full model (a saved piece cannot be read in part: DCP reads
a plain tensor whole). A tied embedding's two pipeline copies (`embed.weight`, `lm_head.weight`) hold
identical values and state, so either may stand for the other.

Why our own reader rather than DCP's resharding planner: DCP reshards rectangular chunks of one global
tensor (DTensor/ShardedTensor), but a ZeRO piece is a range of a flattened tp shard, which is not a
rectangle of the full tensor; describing it by (tp shard, flat range) is exact and needs no change to how
the engines store their state. Same-layout resumes keep DCP's plain collective load.
"""

from __future__ import annotations

import json
import math
import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pentatron.checkpoint.errors import CheckpointError
from pentatron.parallel.placement import Placement

PIECES_DIR = "pieces"
# State that is not a parameter but that every rank holding it holds whole: the MoE routers' aux-free
# selection biases (`StepRunner.state_dict`).
REPLICATED_PARTS = ("moe_bias",)
_TIED = {"embed.weight": "lm_head.weight", "lm_head.weight": "embed.weight"}
READ_BATCH_BYTES = 64 << 20  # what a re-sharding load reads at once (beyond one tensor larger than this)


def _geometry(placements: list[Placement]) -> dict[str, tuple[Placement, int, int]]:
    """Every key a rank's state can use for a parameter: whole (its checkpoint key) or a ZeRO piece."""
    geom: dict[str, tuple[Placement, int, int]] = {}
    for pl in placements:
        geom[pl.checkpoint_key()] = (pl, 0, pl.numel)
        for z in pl.zero or ():
            geom[pl.piece_key(z.lo, z.hi)] = (pl, z.lo, z.hi)
    return geom


def describe_state(state: dict[str, dict[str, torch.Tensor]], placements: list[Placement]) -> dict[str, Any]:
    """{"<part>/<key>": description} for every tensor of a rank's checkpoint state."""
    geom = _geometry(placements)
    out = {}
    for part, tensors in state.items():
        for key, t in tensors.items():
            if part in REPLICATED_PARTS and isinstance(t, torch.Tensor):  # whole on every rank that holds it
                out[f"{part}/{key}"] = {
                    "part": part, "key": key, "name": key, "field": part, "full_shape": list(t.shape),
                    "local_shape": list(t.shape), "tp_dim": None, "tp_index": 0, "tp_parts": 1, "ep_index": 0,
                    "ep_parts": 1, "lo": 0, "hi": t.numel(), "shape": list(t.shape),
                    "dtype": str(t.dtype).removeprefix("torch.")}
                continue
            if part == "optim":
                base, field = key.rsplit(".", 1)
            else:
                base, field = key, "param"
            if base not in geom or not isinstance(t, torch.Tensor):
                # Not a parameter's piece: left undescribed; a re-sharded resume refuses it.
                out[f"{part}/{key}"] = {"part": part, "key": key, "undescribed": True}
                continue
            pl, lo, hi = geom[base]
            ep_index, ep_parts = pl.expert or (0, 1)
            out[f"{part}/{key}"] = {
                "part": part, "key": key, "name": pl.name, "field": field, "full_shape": list(pl.full_shape),
                "local_shape": list(pl.local_shape), "tp_dim": pl.tp.dim, "tp_index": pl.tp.index,
                "tp_parts": pl.tp.parts, "ep_index": ep_index, "ep_parts": ep_parts, "lo": lo, "hi": hi,
                "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    return out


def write_pieces(directory: Path, rank: int, described: dict[str, Any]) -> None:
    (directory / PIECES_DIR).mkdir(exist_ok=True)
    (directory / PIECES_DIR / f"rank{rank}.json").write_text(json.dumps(described))


def has_pieces(directory: Path) -> bool:
    return (directory / PIECES_DIR).is_dir()


def read_pieces(directory: Path) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Saved pieces by (parameter name, field), each key once (replicated keys are listed by several ranks)."""
    merged: dict[str, dict[str, Any]] = {}
    for f in sorted((directory / PIECES_DIR).glob("rank*.json")):
        try:
            merged.update(json.loads(f.read_text()))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from None
    by_name: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for d in merged.values():
        problem = _piece_problem(d)
        if problem:
            raise CheckpointError(f"{directory / PIECES_DIR}: {problem} (edited or not written by pentatron train)")
        if d.get("undescribed"):
            raise CheckpointError(f"{directory}: {d['part']}/{d['key']} was saved without a description of its "
                                  "place in the full tensor, so it cannot be re-sharded: resume in the layout "
                                  "it was written in")
        by_name[(d["name"], d["field"])].append(d)
    return by_name


_INT_FIELDS = ("tp_index", "tp_parts", "ep_index", "ep_parts", "lo", "hi")
_SHAPE_FIELDS = ("full_shape", "local_shape", "shape")


def _piece_problem(d: Any) -> str | None:
    """Why a pieces record is not one `describe_state` writes (None: it is): typed fields, a real dtype."""
    if not isinstance(d, dict) or not all(isinstance(d.get(k), str) for k in ("part", "key")):
        return "a record without part/key"
    if d.get("undescribed"):
        return None
    if not all(isinstance(d.get(k), str) for k in ("name", "field", "dtype")):
        return f"{d['part']}/{d['key']}: name, field or dtype missing"
    if not isinstance(getattr(torch, d["dtype"], None), torch.dtype):
        return f"{d['part']}/{d['key']}: {d['dtype']!r} is not a dtype"
    for k in _SHAPE_FIELDS:
        if not (isinstance(d.get(k), list) and all(isinstance(v, int) and v >= 0 for v in d[k])):
            return f"{d['part']}/{d['key']}: {k} is not a shape"
    for k in _INT_FIELDS:
        if not (isinstance(d.get(k), int) and d[k] >= 0):
            return f"{d['part']}/{d['key']}: {k} is not a non-negative integer"
    if d.get("tp_dim") is not None and not isinstance(d["tp_dim"], int):
        return f"{d['part']}/{d['key']}: tp_dim is not an integer"
    return _geometry_problem(d)


def _geometry_problem(d: dict[str, Any]) -> str | None:
    """Fields that type-check but cannot describe one piece of one tensor (an edited record): a range outside
    the local tensor or of another size than the piece, an index beyond its parts, a tp_dim beyond the shape."""
    what = f"{d['part']}/{d['key']}"
    if d["field"] == "step":  # AdamW's step count: a 0-d tensor, described by its parameter's geometry
        return None
    n_local = math.prod(d["local_shape"])
    if not d["lo"] <= d["hi"] <= n_local:
        return f"{what}: range [{d['lo']}, {d['hi']}) is outside its local tensor of {n_local} elements"
    if d["hi"] - d["lo"] != math.prod(d["shape"]):
        return f"{what}: range [{d['lo']}, {d['hi']}) does not hold its shape {d['shape']}"
    if d["tp_index"] >= max(1, d["tp_parts"]) or d["ep_index"] >= max(1, d["ep_parts"]):
        return f"{what}: tp_index/ep_index beyond tp_parts/ep_parts"
    if d.get("tp_dim") is not None and not 0 <= d["tp_dim"] < len(d["full_shape"]):
        return f"{what}: tp_dim {d['tp_dim']} is not a dimension of {d['full_shape']}"
    return None


def _read(directory: Path, pieces: list[dict[str, Any]]) -> list[torch.Tensor]:
    """The saved tensors of `pieces`, read by this rank alone, in one DCP load."""
    import torch.distributed.checkpoint as dcp  # here: a run that never reads a checkpoint skips the import

    from pentatron.checkpoint.safe_metadata import SafeReader

    state: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for d in pieces:
        state[d["part"]][d["key"]] = torch.empty(d["shape"], dtype=getattr(torch, d["dtype"]))
    reader = SafeReader(directory)  # a refused index is its own one-line error
    try:
        with warnings.catch_warnings():  # reading alone is intended: DCP's notice about it is muted
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(dict(state), storage_reader=reader, no_dist=True)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        names = sorted({d["name"] for d in pieces})
        what = names[0] if len(names) == 1 else f"{names[0]} (or one of {len(names) - 1} other tensors read with it)"
        raise CheckpointError(f"{directory}: cannot read {what} ({type(e).__name__})") from None
    return [state[d["part"]][d["key"]] for d in pieces]


def assembled(directory: Path, wanted: list[list[dict[str, Any]]]) -> Iterator[torch.Tensor]:
    """The full tensor of each list of saved pieces in `wanted`, in order. DCP re-reads the checkpoint's
    metadata on every load (30 ms for a 135M model, which has ~1,100 tensors with AdamW state), so pieces
    are read in batches of up to `READ_BATCH_BYTES`, not one tensor at a time."""
    batch: list[list[dict[str, Any]]] = []
    size = 0
    for pieces in wanted:
        nbytes = sum(math.prod(d["shape"]) * getattr(torch, d["dtype"]).itemsize for d in pieces)
        if batch and size + nbytes > READ_BATCH_BYTES:
            yield from _join_batch(directory, batch)
            batch, size = [], 0
        batch.append(pieces)
        size += nbytes
    if batch:
        yield from _join_batch(directory, batch)


def _join_batch(directory: Path, batch: list[list[dict[str, Any]]]) -> Iterator[torch.Tensor]:
    tensors = _read(directory, [d for pieces in batch for d in pieces])
    start = 0
    for pieces in batch:
        yield _join(directory, pieces, tensors[start: start + len(pieces)])
        start += len(pieces)


def _join(directory: Path, pieces: list[dict[str, Any]], tensors: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from its saved pieces and their values (a 0-d tensor for AdamW's step count)."""
    first = pieces[0]
    if first["field"] == "step":
        return torch.stack([t.reshape(()) for t in tensors]).max()
    n_local = math.prod(first["local_shape"])
    if len(pieces) == 1 and (first["lo"], first["hi"]) == (0, n_local) and first["tp_dim"] is None \
            and first.get("ep_parts", 1) == 1:
        return tensors[0].view(first["local_shape"])  # saved whole (a 1-process checkpoint): no copy
    flats: dict[tuple[int, int], torch.Tensor] = {}  # by (ep index, tp index)
    covered: dict[tuple[int, int], torch.Tensor] = {}
    for d, t in zip(pieces, tensors, strict=True):
        at = (d.get("ep_index", 0), d["tp_index"])
        flat = flats.setdefault(at, torch.zeros(n_local, dtype=t.dtype))
        seen = covered.setdefault(at, torch.zeros(n_local, dtype=torch.bool))
        flat[d["lo"]: d["hi"]] = t.reshape(-1)
        seen[d["lo"]: d["hi"]] = True
    tp = first["tp_parts"] if first["tp_dim"] is not None else 1
    ep = first.get("ep_parts", 1)
    whole = all(bool(c.all()) for c in covered.values())
    if sorted(flats) != [(e, i) for e in range(ep) for i in range(tp)] or not whole:
        raise CheckpointError(f"{directory}: the saved pieces of {first['name']} ({first['field']}) do not cover "
                              "the whole tensor (a rank's files are missing?)")

    def expert_slice(e: int) -> torch.Tensor:  # this ep slice of the experts, its tp shards joined
        local = [flats[(e, i)].view(first["local_shape"]) for i in range(tp)]
        return local[0] if first["tp_dim"] is None else torch.cat(local, dim=first["tp_dim"])

    return expert_slice(0) if ep == 1 else torch.cat([expert_slice(e) for e in range(ep)], dim=0)


def cut(full: torch.Tensor, d: dict[str, Any]) -> torch.Tensor:
    """A described piece out of the full tensor: the ep slice of the experts (dim 0), the tp shard, then
    the range of the flattened local tensor."""
    local = full
    if d.get("ep_parts", 1) > 1:
        size = full.shape[0] // d["ep_parts"]
        local = local.narrow(0, d["ep_index"] * size, size)
    if d["tp_dim"] is not None:
        size = d["full_shape"][d["tp_dim"]] // d["tp_parts"]
        local = local.narrow(d["tp_dim"], d["tp_index"] * size, size)
    return local.reshape(-1)[d["lo"]: d["hi"]]


def source_pieces(saved: dict[tuple[str, str], list[dict[str, Any]]], name: str, field: str
            ) -> list[dict[str, Any]] | None:
    """The saved pieces for (name, field): a tied copy stands for the other; a missing fp32 master is the
    (fp32) parameter, and a parameter is best restored from its master when one was saved."""
    for n in (name, _TIED.get(name)):
        if n is None:
            continue
        if field == "param" and (n, "master") in saved:
            return saved[(n, "master")]
        if (n, field) in saved:
            return saved[(n, field)]
        if field == "master" and (n, "param") in saved:
            return saved[(n, "param")]
    return None


@torch.no_grad()
def load_resharded(directory: Path, state: dict[str, dict[str, torch.Tensor]], placements: list[Placement]) -> None:
    """Fill this rank's `state` (its live tensors, in its own layout) from a checkpoint of any layout."""
    saved = read_pieces(directory)
    wanted: dict[tuple[str, str], list[tuple[dict[str, Any], torch.Tensor]]] = defaultdict(list)
    for path, d in describe_state(state, placements).items():
        part, key = path.split("/", 1)
        if d.get("undescribed"):
            raise CheckpointError(f"{directory}: this run's {path} has no description of its place in the full "
                                  "tensor, so it cannot be re-sharded into: resume in the checkpoint's layout")
        wanted[(d["name"], d["field"])].append((d, state[part][key]))
    sources = []
    for name, field in wanted:
        pieces = source_pieces(saved, name, field)
        if pieces is None:
            raise CheckpointError(f"{directory}: holds no {field} for parameter {name} (another model?)")
        sources.append(pieces)
    try:
        for ((name, field), targets), full in zip(wanted.items(), assembled(directory, sources), strict=True):
            for d, target in targets:
                if field == "step":
                    target.copy_(full)
                    continue
                if list(full.shape) != d["full_shape"]:
                    raise CheckpointError(f"{directory}: {name} was saved with shape {list(full.shape)}, this model "
                                          f"has {d['full_shape']}")
                target.copy_(cut(full, d).view(target.shape))
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, IndexError) as e:  # pieces that type-check yet do not fit together
        raise CheckpointError(f"{directory / PIECES_DIR}: the saved pieces do not fit their tensors "
                              f"({str(e).splitlines()[0][:200]}): edited or not written by pentatron train") from None
