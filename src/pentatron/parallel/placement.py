"""Where every parameter lives: one `Placement` per parameter, written by the parallel steps, read by all.

Each step of `parallelize` records what it did to a parameter here, instead of leaving attributes on
tensors or flags on engines:

- the pipeline split: which stage holds it, and for a tied embedding held by the first and the last
  stage, the peer pipeline rank whose copy must receive the same gradient (and which copy the global
  norm counts);
- tensor parallelism: the axis it is split along, this rank's shard index and the number of distinct
  shards (a kv head replicated on tp/n_kv ranks: fewer shards than ranks); and, for a replicated weight
  whose gradient each tp rank computes from its share of the work only (the norms and the MoE layers'
  parameters under sequence parallelism, Qwen3's q/k norm gains), that its gradient is partial over tp
  (`tp_partial`): summed over tp once per step, after the data-parallel reduction
  (`tensor.sum_partial_grads`);
- expert parallelism: for an MoE layer's stacked expert weights, which slice of the experts (dim 0)
  this ep rank holds; their gradients are then reduced over the expert-data group ("edp") only;
- data parallelism / ZeRO: the mesh dimensions its gradient is averaged over and, when sharded, the
  ranges of the flattened local tensor this rank owns, with their global offsets in the flat layout.

From these the consumers derive everything: the global gradient norm (each element counted once), the
tied-gradient exchange, the checkpoint keys, gathering full tensors, and — for re-sharding a checkpoint
into another layout — the exact slice of the full tensor that each saved shard covers.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TPShard:
    """How a local tensor relates to the full one over tp. `dim` is the axis split over tp (None: the
    whole tensor on every tp rank); the full tensor is `parts` equal slices along `dim`, this rank
    holding slice `index`; `replicas` tp ranks hold the same slice (tp / parts)."""

    dim: int | None
    index: int = 0
    parts: int = 1
    replicas: int = 1


@dataclass(frozen=True)
class ZeroPiece:
    """A range [lo, hi) of the flattened local (tp-sharded) tensor that this dp rank owns, at global
    offset `glob` of the flat layout (bucket `bucket`)."""

    lo: int
    hi: int
    glob: int
    bucket: int


@dataclass
class Placement:
    name: str  # the full model's parameter name (unchanged by every parallel step)
    local_shape: tuple[int, ...]  # this rank's tensor before ZeRO flattening (tp-sharded)
    tp: TPShard = field(default_factory=lambda: TPShard(None))
    stage: int | None = None  # pipeline stage holding this copy (None without pipeline parallelism)
    tied_peer: int | None = None  # pp rank holding the other copy of a tied weight, which gets the same grad
    counted: bool = True  # counted in the global gradient norm here (False: the tied copy counted by the peer)
    grad_dims: tuple[str, ...] = ("dp",)  # mesh dimensions the gradient is averaged over
    zero: tuple[ZeroPiece, ...] | None = None  # owned ranges when ZeRO shards it over dp (None: not sharded)
    expert: tuple[int, int] | None = None  # (ep rank, ep size): this rank's slice of the experts (dim 0)
    tp_partial: bool = False  # replicated over tp, each rank's gradient a partial sum: the full one is their sum

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.local_shape)
        if self.tp.dim is not None:
            shape[self.tp.dim] *= self.tp.parts
        if self.expert is not None:
            shape[0] *= self.expert[1]
        return tuple(shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n

    def norm_weight(self, tp: int) -> float:
        """This rank's share of the tensor's squared norm: 1 / (tp ranks holding the same tensor), or 0
        for a tied copy that the peer counts."""
        if not self.counted:
            return 0.0
        return 1.0 / (self.tp.replicas if self.tp.dim is not None else tp)

    def checkpoint_key(self) -> str:
        """The tensor's key: the name when every tp rank holds the same tensor, else "<name>|tp<i>/<n>"
        (ranks holding the same replicated kv head share one key, so it is written once)."""
        key = self.name
        if self.expert is not None:
            key += f"|ep{self.expert[0]}/{self.expert[1]}"
        if self.tp.dim is None or self.tp.parts == 1:
            return key
        return f"{key}|tp{self.tp.index}/{self.tp.parts}"

    def piece_key(self, lo: int, hi: int) -> str:
        """Key of an owned ZeRO range [lo, hi) of the flattened tensor: the tensor's key, with the range when
        only part of it is here."""
        key = self.checkpoint_key()
        return key if (lo, hi) == (0, self.numel) else f"{key}[{lo}:{hi}]"
