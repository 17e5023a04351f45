"""ParallelContext: the parallel degrees → a DeviceMesh, one named process group per dimension, and
rank ↔ coordinate arithmetic. Built once from an initialised default process group and passed
explicitly (no globals).

Rank order (the mesh's dims, outermost first) is ("pp", "dp", "cp", "tp"): tp is innermost so that a
tensor-parallel group sits on consecutive ranks (one node), pp outermost. Expert parallelism borrows
its ranks from dp×cp and so is not a mesh dimension of its own: numbering a dp×cp group's ranks
q = dp·cp_size + cp, "ep" groups are consecutive blocks of ep of them (experts sharded), "edp" (expert
data parallel) the ranks holding the same experts, q ≡ q' (mod ep) — Megatron's order, ep innermost.
HSDP splits the dp group as dp = dp_replicate × dp_shard with the shard ranks innermost (consecutive dp
coordinates, one node): "dp_shard" is the group ZeRO shards over, "dp_replicate" the ranks holding the
same shard (stride dp_shard). Without HSDP "dp_shard" is the dp group and "dp_replicate" has size 1.
Context parallelism in "hybrid" mode
splits its cp group once more, `cp = cp_ring × cp_ulysses` with the Ulysses ranks innermost (adjacent
ranks, one node): the "cp_ulysses" group exchanges heads by all-to-all, the "cp_ring" group passes K/V
blocks around a ring. In "ring" or "ulysses" mode one of them is the whole cp group.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pentatron.distributed.comm import Comm, CommLedger
from pentatron.layout import ParallelLayout

MESH_DIMS: tuple[str, ...] = ("pp", "dp", "cp", "tp")
# groups made of mesh dimensions
DERIVED_DIMS: tuple[str, ...] = ("dp_cp", "cp_ring", "cp_ulysses", "ep", "edp", "dp_shard", "dp_replicate")


def mesh_shape(layout: ParallelLayout) -> tuple[int, ...]:
    """The mesh's sizes in MESH_DIMS order."""
    return tuple(getattr(layout, d) for d in MESH_DIMS)


class ParallelContext:
    """Who this rank is in the (pp, dp, cp, tp) grid, the group for each dimension, and the comm layer.

    `group(dim)` is None for a dimension of size 1 or in a single-process run: the comm layer then
    short-circuits (nothing moves, nothing is recorded)."""

    def __init__(self, layout: ParallelLayout, rank: int, device: torch.device,
                 groups: Mapping[str, dist.ProcessGroup | None], mesh: DeviceMesh | None = None,
                 ledger: CommLedger | None = None) -> None:
        self.layout = layout  # the one holder of the degrees (only they matter here)
        self.rank = rank
        self.world_size = layout.world
        self.device = device
        self.mesh = mesh
        self._groups = dict(groups)
        self._released = False
        self.coords = self.coords_of(rank)
        self.comm = Comm(self, ledger or CommLedger())

    # ------------------------------------------------------------------ construction
    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelContext:
        """A 1-process context (no process group needed)."""
        return cls(ParallelLayout(), 0, torch.device(device), {d: None for d in (*MESH_DIMS, *DERIVED_DIMS)})

    @classmethod
    def from_layout(cls, layout: ParallelLayout, device: torch.device | str) -> ParallelContext:
        """Build the mesh and groups of `layout`'s degrees from the initialised default process group (a
        collective call: every rank must make it), after checking them against the live world by the
        layout's own rules. Falls back to `single` when no process group is running."""
        device = torch.device(device)
        world = dist.get_world_size() if dist.is_initialized() else 1
        problems = layout.degree_problems(world)
        if problems:
            raise ValueError("invalid parallel degrees: " + "; ".join(problems))
        if not dist.is_initialized():
            return cls(layout, 0, device, {d: None for d in (*MESH_DIMS, *DERIVED_DIMS)})
        mesh = init_device_mesh(device.type, mesh_shape(layout), mesh_dim_names=MESH_DIMS)
        groups: dict[str, dist.ProcessGroup | None] = {
            d: mesh.get_group(d) if getattr(layout, d) > 1 else None for d in MESH_DIMS}
        groups["dp_cp"] = groups["dp"] if layout.cp == 1 else (
            groups["cp"] if layout.dp == 1 else _flat_group(layout, dist.get_rank()))
        u = layout.cp_ulysses_degree
        if u in (1, layout.cp):  # one kind of context parallelism: its group is the cp group
            groups["cp_ring"] = groups["cp"] if u == 1 else None
            groups["cp_ulysses"] = groups["cp"] if u > 1 else None
        else:
            groups["cp_ring"], groups["cp_ulysses"] = _cp_sub_groups(layout, dist.get_rank())
        groups["ep"], groups["edp"] = (None, groups["dp_cp"]) if layout.ep == 1 else \
            _expert_groups(layout, dist.get_rank())
        groups["dp_shard"], groups["dp_replicate"] = _hsdp_groups(layout, dist.get_rank()) if layout.hsdp \
            else (groups["dp"], None)
        return cls(layout, dist.get_rank(), device, groups, mesh)

    # ------------------------------------------------------------------ coordinates
    def coords_of(self, rank: int) -> dict[str, int]:
        out, rest = {}, rank
        for d in reversed(MESH_DIMS):
            size = getattr(self.layout, d)
            out[d] = rest % size
            rest //= size
        return {d: out[d] for d in MESH_DIMS}

    def rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates; missing dimensions default to this rank's own."""
        unknown = set(coords) - set(MESH_DIMS)
        if unknown:
            raise KeyError(f"unknown mesh dimensions {sorted(unknown)}; known: {MESH_DIMS}")
        rank = 0
        for d in MESH_DIMS:
            c = coords.get(d, self.coords[d])
            rank = rank * getattr(self.layout, d) + c
        return rank

    def group_ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along `dim`, in group-rank order."""
        u, c = self.layout.cp_ulysses_degree, self.coords["cp"]
        if dim == "cp_ring":
            return [self.rank_of(cp=i * u + c % u) for i in range(self.size(dim))]
        if dim == "cp_ulysses":
            return [self.rank_of(cp=(c // u) * u + i) for i in range(self.size(dim))]
        if dim == "dp_cp":  # group rank dp · cp + cp, as `local_rank` numbers it
            return [self.rank_of(dp=i // self.layout.cp, cp=i % self.layout.cp) for i in range(self.size(dim))]
        if dim in ("dp_shard", "dp_replicate"):
            s, d = self.layout.shard_degree, self.coords["dp"]
            return [self.rank_of(dp=(d // s) * s + i if dim == "dp_shard" else i * s + d % s)
                    for i in range(self.size(dim))]
        if dim in ("ep", "edp"):  # carved from dp_cp: ep blocks of consecutive group ranks, edp strides
            flat = self.group_ranks("dp_cp")
            q, ep = self.local_rank("dp_cp"), self.layout.ep
            return flat[q - q % ep: q - q % ep + ep] if dim == "ep" else flat[q % ep:: ep]
        return [self.rank_of(**{dim: i}) for i in range(self.size(dim))]

    # ------------------------------------------------------------------ groups
    def group(self, dim: str) -> dist.ProcessGroup | None:
        if self._released:
            raise RuntimeError(f"{self!r} has released its process groups (its run has ended)")
        if dim not in self._groups:
            raise KeyError(f"unknown parallel dimension {dim!r}; known: {sorted(self._groups)}")
        return self._groups[dim]

    def release(self) -> None:
        """Let go of the process groups and the mesh when the run ends (idempotent; no collective).

        A group's gloo worker threads are joined only when its last reference goes, and a run's objects
        can outlive it (autograd hooks reference them from C++, out of the garbage collector's sight).
        Threads left running into interpreter exit abort the process: a worker still dropping a finished
        collective's Python-owned tensor needs the GIL, which a finalizing interpreter no longer grants
        (SIGABRT, a rank "killed by a signal" right after e.g. a checkpoint verdict all ranks agreed on)."""
        self._groups = {}
        self.mesh = None
        self._released = True

    def size(self, dim: str) -> int:
        if dim == "dp_cp":
            return self.layout.dp * self.layout.cp
        if dim == "cp_ring":
            return self.layout.cp // self.layout.cp_ulysses_degree
        if dim == "cp_ulysses":
            return self.layout.cp_ulysses_degree
        if dim == "edp":
            return self.layout.dp * self.layout.cp // self.layout.ep
        if dim == "dp_shard":
            return self.layout.shard_degree
        if dim == "dp_replicate":
            return self.layout.replicate_degree
        return getattr(self.layout, dim)

    def local_rank(self, dim: str) -> int:
        if dim == "dp_cp":
            return self.coords["dp"] * self.layout.cp + self.coords["cp"]
        if dim == "cp_ring":
            return self.coords["cp"] // self.layout.cp_ulysses_degree
        if dim == "cp_ulysses":
            return self.coords["cp"] % self.layout.cp_ulysses_degree
        if dim == "dp_shard":
            return self.coords["dp"] % self.layout.shard_degree
        if dim == "dp_replicate":
            return self.coords["dp"] // self.layout.shard_degree
        if dim in ("ep", "edp"):
            q = self.local_rank("dp_cp")
            return q % self.layout.ep if dim == "ep" else q // self.layout.ep
        return self.coords[dim]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    def __repr__(self) -> str:
        deg = " ".join(f"{d}={getattr(self.layout, d)}" for d in (*MESH_DIMS, "ep"))
        return f"ParallelContext(rank={self.rank}/{self.world_size}, {deg}, coords={self.coords})"


def _flat_group(layout: ParallelLayout, rank: int) -> dist.ProcessGroup:
    """The dp×cp group of `rank` (for expert parallelism later). `new_group` is collective over the
    whole world, so every rank creates every such group, in the same order."""
    mine = None
    grid = torch.arange(layout.world).view(mesh_shape(layout))  # [pp, dp, cp, tp]
    for pp in range(layout.pp):
        for tp in range(layout.tp):
            ranks = grid[pp, :, :, tp].flatten().tolist()
            g = dist.new_group(ranks)
            if rank in ranks:
                mine = g
    assert mine is not None
    return mine


def _hsdp_groups(layout: ParallelLayout, rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (shard, replicate) groups: dp coordinate = replica index · dp_shard + shard index. Every
    rank creates every group, in the same order (`new_group` is collective)."""
    s, r = layout.shard_degree, layout.replicate_degree
    grid = torch.arange(layout.world).view(mesh_shape(layout))  # [pp, dp, cp, tp]
    shard = rep = None
    for pp in range(layout.pp):
        for cp in range(layout.cp):
            for tp in range(layout.tp):
                dps = grid[pp, :, cp, tp].tolist()
                for i in range(r):
                    ranks = dps[i * s: (i + 1) * s]
                    g = dist.new_group(ranks)
                    shard = g if rank in ranks else shard
                for j in range(s):
                    ranks = dps[j::s]
                    g = dist.new_group(ranks)
                    rep = g if rank in ranks else rep
    assert shard is not None and rep is not None
    return shard, rep


def _cp_sub_groups(layout: ParallelLayout, rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (ring, Ulysses) groups of a hybrid cp group: cp coordinate = ring index · u + Ulysses
    index. Every rank creates every group, in the same order (`new_group` is collective)."""
    u, r = layout.cp_ulysses_degree, layout.cp // layout.cp_ulysses_degree
    grid = torch.arange(layout.world).view(mesh_shape(layout))  # [pp, dp, cp, tp]
    ring = uly = None
    for pp in range(layout.pp):
        for dp in range(layout.dp):
            for tp in range(layout.tp):
                cps = grid[pp, dp, :, tp].tolist()
                for j in range(u):
                    ranks = [cps[i * u + j] for i in range(r)]
                    g = dist.new_group(ranks)
                    ring = g if rank in ranks else ring
                for i in range(r):
                    ranks = cps[i * u: (i + 1) * u]
                    g = dist.new_group(ranks)
                    uly = g if rank in ranks else uly
    assert ring is not None and uly is not None
    return ring, uly


def _expert_groups(layout: ParallelLayout, rank: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's ep and edp groups (None for a group of one). Every rank creates every group (new_group
    is collective over the world), in the same order: per (pp, tp), the ep blocks, then the edp strides."""
    ep, edp = layout.ep, layout.dp * layout.cp // layout.ep
    grid = torch.arange(layout.world).view(mesh_shape(layout))  # [pp, dp, cp, tp]
    mine: dict[str, dist.ProcessGroup | None] = {"ep": None, "edp": None}
    for pp in range(layout.pp):
        for tp in range(layout.tp):
            flat = grid[pp, :, :, tp].flatten().tolist()
            blocks = {"ep": [flat[i: i + ep] for i in range(0, len(flat), ep)] if ep > 1 else [],
                      "edp": [flat[j::ep] for j in range(ep)] if edp > 1 else []}
            for dim, ranks_list in blocks.items():
                for ranks in ranks_list:
                    g = dist.new_group(ranks)
                    if rank in ranks:
                        mine[dim] = g
    return mine["ep"], mine["edp"]
