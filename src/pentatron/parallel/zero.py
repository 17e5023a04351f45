"""ZeRO-1/2/3: optimizer state, then gradients, then parameters sharded over the dp ranks.

All three use one `FlatLayout`: buckets padded to a multiple of dp, rank r owning the r-th equal
slice of every bucket (so a bucket is reduce-scattered or all-gathered with one collective, and a
shard is a set of global offsets). Each rank's optimizer steps only its `Piece`s of the parameters.

- ZeRO-1: full fp32 gradient buffer (accumulation as in DDP, no communication until the last
  micro-step); each bucket is reduce-scattered in place as soon as it is complete; after the step
  every bucket is all-gathered in place from the owners' updated slices.
- ZeRO-2: gradient buckets are transient: a bucket is reduce-scattered as soon as it is complete, on
  *every* micro-step (keeping only the shard is the point, so accumulation cannot wait), its shard
  added into the persistent fp32 gradient shard, and the bucket freed. Parameters as ZeRO-1.
- ZeRO-1/2 parameter gather (`overlap_param_gather`, Megatron's overlapped param gather idea): the
  gradient buckets are grouped, in forward order, into gather buckets sized for the *parameter* dtype
  (`bucket_mb` of parameters: a bf16 gather bucket spans two fp32 gradient buckets). After the step every
  gather bucket's all-gathers are issued asynchronously, in forward order, and nothing waits; a forward
  pre-hook on each top-level module (each decoder layer, the embedding, the final norm, the head: never
  inside a compiled region) waits the gather buckets holding its parameters that are still in flight. So
  only the first bucket's gather is exposed; the rest run behind the forward of the modules before theirs.
  The waits happen once per step (the first micro-batch; later forwards find nothing in flight), and
  anything that reads the weights outside a forward waits first (`wait_param_gather`: checkpoint state,
  full parameters, the next step's gradient sync for a module that never ran, `close`). Off: all gathers
  waited at the end of `after_optimizer_step` (exposed).
- ZeRO-3: one bucket per unit (each decoder layer; embedding, final norm and head as units of their
  own, a tied head sharing the embedding's unit). Each rank keeps only its parameter shard; a unit is
  all-gathered before its forward and again before its backward and freed after each, the next unit's
  all-gather is prefetched (issued asynchronously) while the current one computes, and gradients are
  reduce-scattered per unit as soon as the unit's backward is done. A unit gathers into a flat buffer of
  its own, kept from its first gather on; freeing resizes the buffer's storage to 0 bytes and the next
  gather back (FSDP's scheme), because the views of the weights that eager ops save for backward
  (`weight.t()` of `F.linear`) would otherwise keep the gathered weights alive until the backward.
Communication per step for Ψ parameters and N ranks (ring): ZeRO-1/2 (N−1)/N·Ψ reduce-scatter +
(N−1)/N·Ψ all-gather ≈ 2Ψ; ZeRO-3 adds the second all-gather ≈ 3Ψ (times the micro-steps for the
parts that run per micro-step).

HSDP (`parallel.dp_shard` < dp): the engine shards over the "dp_shard" group (consecutive dp ranks, one
node) instead of all of dp, every reduce-scatter and all-gather above running there; the dp / dp_shard
shard groups are replicas. Each rank's reduced gradient shard is then all-reduced over "dp_replicate" (the
ranks holding the same shard, across nodes) once per step in `finish_grad_sync`, after the last
reduce-scatter — once per step, not per micro-step, because ZeRO-2/3 accumulate into the shard — and
divided by all of dp. The same choice serves ZeRO-1/2 (optimizer state, and gradients, sharded within a
node and replicated across: DeepSpeed's hierarchical partitioning idea) and ZeRO-3.

Checkpoints: optimizer state (and ZeRO-3's parameters) are saved per piece, keyed
"<param key>[lo:hi]" (a range of the flattened local parameter; just "<param key>" when a rank holds all
of it; the key is the name, or "<name>|tp<i>/<n>" for a tensor-parallel shard), so each rank writes only
what it owns and a resume in the same layout reads it back. Each rank also describes where its pieces sit
in the full tensors (`checkpoint/reshard.py`), so a resume into another dp, ZeRO stage, stage split or
bucket size (any layout) assembles the pieces it wants from the overlapping saved ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pentatron.distributed.comm import Work
from pentatron.distributed.context import ParallelContext
from pentatron.optim import AdamW, Slot
from pentatron.parallel.data import DataParallelBase
from pentatron.parallel.grad_buffer import Bucket, FlatLayout, GradBuffer, Piece
from pentatron.parallel.materialize import LocalInit, give_storage
from pentatron.parallel.memory import MemoryReport
from pentatron.parallel.placement import Placement, ZeroPiece
from pentatron.precision import PrecisionPolicy

_MAX_IN_FLIGHT = 2  # reduce-scatters in flight before the oldest is waited on (bounds transient memory)


def _needs(init: LocalInit | None) -> LocalInit:
    if init is None:
        raise ValueError("a meta parameter needs a LocalInit to be materialised (parallel/materialize.py)")
    return init


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class _ShardedBase(DataParallelBase):
    """What ZeRO-1/2/3 share: the sharded optimizer over this rank's pieces, norm over the shard."""

    sharded_grads = True

    def __init__(self, model: nn.Module, ctx: ParallelContext, policy: PrecisionPolicy, bucket_mb: float,
                 placements: dict[str, Placement] | None = None, only: Collection[str] | None = None) -> None:
        super().__init__(model, ctx, policy, bucket_mb, placements, only)
        # HSDP: shard within the "dp_shard" group, all-reduce the shards across "dp_replicate". The gradient
        # is still averaged over all of dp (`grad_divisor`, set from the whole group above).
        self.replicate_dim: str | None = None
        if self.reduce_dim == "dp" and ctx.size("dp_shard") < ctx.size("dp"):
            self.shard_dim, self.replicate_dim = "dp_shard", "dp_replicate"
            self.dp, self.dp_rank = ctx.size("dp_shard"), ctx.local_rank("dp_shard")

    def _reduce_replicas(self) -> None:
        """HSDP: sum each reduced gradient shard over the replicas holding the same shard."""
        if self.replicate_dim is None:
            return
        works = [self.comm.all_reduce(g, self.replicate_dim, async_op=True) for g in self.owned_grads()]
        for w in works:
            w.wait()

    def _broadcast_replicas(self, t: torch.Tensor) -> None:
        """Make `t` identical on every rank of the (whole) data-parallel group, from its rank 0."""
        self.comm.broadcast(t, self.shard_dim, src=0)
        if self.replicate_dim is not None:
            self.comm.broadcast(t, self.replicate_dim, src=0)

    def _build_slots(self, param_store: torch.Tensor, store_is_global: bool, grad_of: Any) -> None:
        """`param_store`: where the model's copy of each piece lives (indexed by global offset when
        `store_is_global`, else by local offset); `grad_of(piece)`: the piece's fp32 gradient."""
        self.pieces = self.layout.pieces(self.dp_rank)
        owned: dict[nn.Parameter, list[ZeroPiece]] = {p: [] for p in self.params}
        for pc in self.pieces:
            owned[pc.param].append(ZeroPiece(pc.lo, pc.hi, pc.glob, self.layout.bucket_of[pc.param].index))
        for p, pieces in owned.items():  # the placement records which elements this rank owns
            self.place[p].zero = tuple(pieces)
        own = param_store.dtype == self.policy.master_dtype  # the model's copy is the master: none apart
        self.master_shard = None if own else torch.zeros(self.layout.shard_numel, dtype=self.policy.master_dtype,
                                                          device=param_store.device)
        slots = []
        for pc in self.pieces:
            at = pc.glob if store_is_global else pc.local
            model = param_store[at: at + pc.numel]
            master = model if own else self.master_shard[pc.local: pc.local + pc.numel]
            if not own:
                master.copy_(model)
            slots.append(Slot(self._key(pc), master, grad_of(pc), None if own else model,
                              len(self.layout.shapes[pc.param]) >= 2))
        self.slots = slots

    def owned_param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        # One optimizer slot per owned piece, in the same order, holding that piece's gradient.
        return [(pc.param, slot.grad) for pc, slot in zip(self.pieces, self.slots, strict=True)]

    def _key(self, pc: Piece) -> str:
        """A checkpoint key: the parameter's key (name, tp shard), with the flattened range when only part
        is here."""
        return self.place[pc.param].piece_key(pc.lo, pc.hi)

    def layout_meta(self) -> dict[str, Any]:
        meta = {"zero": self.stage, "dp": self.dp, "buckets": [b.padded for b in self.layout.buckets]}
        if self.replicate_dim is not None:
            meta["replicas"] = self.ctx.size(self.replicate_dim)
        return meta

    def _optim_memory(self, optimizer: AdamW) -> tuple[int, int]:
        return optimizer.state_bytes(), _nbytes(self.master_shard)


class ZeroDataParallel(_ShardedBase):
    """ZeRO-1 (stage=1) and ZeRO-2 (stage=2): replicated parameters, sharded optimizer (and grads)."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, policy: PrecisionPolicy,
                 bucket_mb: float, stage: int, placements: dict[str, Placement] | None = None,
                 only: Collection[str] | None = None, init: LocalInit | None = None,
                 overlap_param_gather: bool = True) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel implements ZeRO-1 and ZeRO-2, got stage {stage}")
        super().__init__(model, ctx, policy, bucket_mb, placements, only)
        self.stage = stage
        self.layout = FlatLayout.by_size(list(reversed(self.params)), self.bucket_numel, shards=self.dp,
                                         isolate=self.isolated)
        # Parameters become views of one flat buffer, so each bucket is all-gathered in place. A meta
        # parameter (sharded init) is initialised straight into its view: the flat buffer is its only copy.
        self.param_flat = torch.zeros(self.layout.total, dtype=policy.param_dtype, device=ctx.device)
        any_meta = False
        with torch.no_grad():
            for p in self.params:
                view = _alias(self.param_flat, self.layout.offset(p), p.shape)
                if p.is_meta:
                    _needs(init).fill(self.place[p], view)
                    any_meta = True
                else:
                    view.copy_(p)
                give_storage(p, view)
            if any_meta:  # replicas are identical by construction; the broadcast makes it a guarantee
                self._broadcast_replicas(self.param_flat)
        self.grads = GradBuffer(self.params, policy.grad_dtype, self._grad_ready, self.layout,
                                persistent=stage == 1)
        self.grad_shard = None if stage == 1 else torch.zeros(self.layout.shard_numel, dtype=policy.grad_dtype,
                                                              device=ctx.device)
        self._build_slots(self.param_flat, True, self._piece_grad)
        self._in_flight: deque[tuple[Bucket, torch.Tensor, Work]] = deque()
        self._works: list[Work] = []
        self._transient_peak = 0
        self._reset_counts(self.layout)
        self.overlap_param_gather = overlap_param_gather
        self.gather_buckets = _gather_buckets(self.layout.buckets,
                                              max(1, int(bucket_mb * 2**20) // policy.param_dtype.itemsize))
        self._gathers: dict[int, list[Work]] = {}  # gather bucket index -> its all-gathers still in flight
        self._hooks = (_wait_hooks(model, self.gather_buckets, self.layout, self._wait_gathers)
                       if overlap_param_gather else [])
        self.on_gather_event: Any = None  # tests: called with ("issue" | "wait", gather bucket index)

    def _piece_grad(self, pc: Piece) -> torch.Tensor:
        if self.grad_shard is None:
            return self.grads.data[pc.glob: pc.glob + pc.numel]
        return self.grad_shard[pc.local: pc.local + pc.numel]

    def _own(self, b: Bucket) -> slice:
        """This rank's shard of bucket b, as a slice of the bucket's own storage."""
        lo, hi = self.layout.shard_range(b, self.dp_rank)
        return slice(lo - b.start, hi - b.start)

    # ------------------------------------------------------------------ gradients
    def _grad_ready(self, p: nn.Parameter) -> None:
        if self.stage == 1 and not self._last_micro:
            return
        b = self._count(self.layout, p)
        if b is None:
            return
        if self.stage == 1:
            self._scatter_persistent(b)
        else:
            self._reduce_transient(b)
            self._remaining[b.index] = len(b.params)  # the next micro-step refills a fresh bucket

    def _scatter_persistent(self, b: Bucket) -> None:
        """ZeRO-1: reduce-scatter bucket b in place in the persistent buffer (asynchronously)."""
        self._launched.add(b.index)
        data = self.grads.bucket_data(b)
        self._works.append(self.comm.reduce_scatter(data[self._own(b)], data, self.shard_dim, async_op=True))

    def _reduce_transient(self, b: Bucket) -> None:
        data = self.grads.bucket_data(b)
        self.grads.release(b)  # the next gradients of this bucket go to a fresh buffer
        work = self.comm.reduce_scatter(data[self._own(b)], data, self.shard_dim, async_op=True)
        self._in_flight.append((b, data, work))
        self._transient_peak = max(self._transient_peak, self.grads.transient_bytes
                                   + sum(_nbytes(d) for _, d, _ in self._in_flight))
        self._drain(_MAX_IN_FLIGHT)

    def _drain(self, keep: int) -> None:
        while len(self._in_flight) > keep:
            b, data, work = self._in_flight.popleft()
            work.wait()
            lo, hi = self.layout.local_range(b)
            self.grad_shard[lo:hi].add_(data[self._own(b)])

    def zero_grad(self) -> None:
        if self.grad_shard is None:
            self.grads.zero()
        else:
            self.grad_shard.zero_()

    def finish_grad_sync(self) -> None:
        self.wait_param_gather()  # a module that did not run this step: its gather ends before the optimizer
        if self.stage == 1:
            for b in self.layout.buckets:
                if b.index not in self._launched:
                    self._scatter_persistent(b)
            for w in self._works:
                w.wait()
            self._works.clear()
            self._reduce_replicas()
            if self.grad_divisor > 1:
                for g in self.owned_grads():
                    g.div_(self.grad_divisor)
        else:
            for b in self.layout.buckets:  # partially filled (a parameter without gradient)
                if self._remaining[b.index] != len(b.params):
                    self._reduce_transient(b)
            self._drain(0)
            self._reduce_replicas()
            if self.grad_divisor > 1:
                self.grad_shard.div_(self.grad_divisor)
        self._reset_counts(self.layout)

    def owned_grads(self) -> list[torch.Tensor]:
        if self.grad_shard is not None:
            return [self.grad_shard]
        return [self.grads.data[slice(*self.layout.shard_range(b, self.dp_rank))] for b in self.layout.buckets]

    # ------------------------------------------------------------------ parameters
    def _issue(self, b: Bucket) -> Work:
        full = self.param_flat[b.start: b.end]
        return self.comm.all_gather(full, full[self._own(b)], self.shard_dim, async_op=True)

    def after_optimizer_step(self) -> None:
        if not self.overlap_param_gather:  # every bucket gathered and waited here: exposed
            works = [self._issue(b) for b in self.layout.buckets]
            for w in works:
                w.wait()
            return
        self.wait_param_gather()  # (none left normally: the forward waited them all)
        for g, buckets in enumerate(self.gather_buckets):  # forward order: the first needed is issued first
            self._gathers[g] = [self._issue(b) for b in buckets]
            if self.on_gather_event is not None:
                self.on_gather_event("issue", g)

    def _wait_gathers(self, groups: Collection[int]) -> None:
        """Wait the gather buckets `groups` still in flight (a module's forward pre-hook)."""
        if not self._gathers:  # the usual case after the first micro-batch: one test per module call
            return
        for g in sorted(groups):
            works = self._gathers.pop(g, None)
            if works is None:
                continue
            for w in works:
                w.wait()
            if self.on_gather_event is not None:
                self.on_gather_event("wait", g)

    def wait_param_gather(self) -> None:
        self._wait_gathers(list(self._gathers))

    def model_state(self) -> dict[str, torch.Tensor]:
        self.wait_param_gather()  # a checkpoint (save or load) reads / writes complete parameters
        return super().model_state()

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        self.wait_param_gather()
        return super().full_parameters()

    def memory(self, optimizer: AdamW) -> MemoryReport:
        optim, master = self._optim_memory(optimizer)
        grads = _nbytes(self.grads.data) + _nbytes(self.grad_shard)
        return MemoryReport(_nbytes(self.param_flat), grads, optim, master, self._transient_peak)

    def close(self) -> None:
        self.wait_param_gather()  # no gather left in flight at teardown
        self.grads.remove_hooks()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _alias(flat: torch.Tensor, offset: int, shape: torch.Size) -> torch.Tensor:
    """`flat[offset:].view(shape)` as a tensor of its own on the same storage, not an autograd view: with a
    version counter of its own. A view would share `flat`'s, and gloo's gather threads bump that counter
    when they finish writing a bucket, so a gather finishing during the forward (overlapped) would fail the
    version check of weights other modules already saved for backward."""
    return torch.empty(0, dtype=flat.dtype, device=flat.device).set_(
        flat.untyped_storage(), flat.storage_offset() + offset, shape)


def _gather_buckets(buckets: list[Bucket], numel: int) -> list[list[Bucket]]:
    """Consecutive gradient buckets, in forward order (the layout is in backward order), grouped until a
    group holds at least `numel` elements: `bucket_mb` of parameters rather than of fp32 gradients. Each
    gradient bucket stays one in-place all-gather (its shards are where the optimizer wrote them); a group
    is issued and waited together."""
    groups: list[list[Bucket]] = [[]]
    filled = 0
    for b in reversed(buckets):
        if filled >= numel:
            groups.append([])
            filled = 0
        groups[-1].append(b)
        filled += b.padded
    return [g for g in groups if g]


def _hook_modules(model: nn.Module) -> list[nn.Module]:
    """Where the gather waits hook: each decoder layer and every other top-level child (the units ZeRO-3
    hooks too, outside any compiled region)."""
    out: list[nn.Module] = []
    for name, child in model.named_children():
        if name == "layers":  # a ModuleList, or a pipeline rank's ModuleDict keyed by global index
            out += list(child.values()) if isinstance(child, nn.ModuleDict) else list(child)
        else:
            out.append(child)
    return out


def _wait_hooks(model: nn.Module, groups: list[list[Bucket]], layout: FlatLayout, wait: Any) -> list[Any]:
    """Forward pre-hooks: each module waits the gather buckets holding any of its parameters; the root
    waits those of parameters no child holds."""
    group_of = {p: g for g, buckets in enumerate(groups) for b in buckets for p in b.params}
    hooks, covered = [], set()
    for m in _hook_modules(model):
        params = [p for p in m.parameters() if p in group_of]
        covered.update(params)
        if params:
            mine = frozenset(group_of[p] for p in params)
            hooks.append(m.register_forward_pre_hook(lambda _m, _a, g=mine: wait(g)))
    rest = frozenset(group_of[p] for p in layout.params if p not in covered)
    if rest:
        hooks.append(model.register_forward_pre_hook(lambda _m, _a, g=rest: wait(g)))
    return hooks


class _Unit:
    """A group of parameters gathered and freed together (one ZeRO-3 bucket) and the modules using them."""

    def __init__(self, bucket: Bucket, modules: list[nn.Module], chunk: int) -> None:
        self.bucket = bucket
        self.modules = modules
        self.chunk = chunk  # the pipeline chunk (0 without pp) whose actions use this unit
        # The gathered parameters (bucket-sized), allocated at the first gather and kept: releasing the unit
        # resizes its storage to 0 bytes and the next gather back (see FullyShardedDataParallel._free).
        self.full: torch.Tensor | None = None
        self.held = False  # `full` has its bytes (gathered, or its all-gather in flight)
        self.work: Work | None = None  # the all-gather filling `full`, while in flight
        self.forward_pending: set[int] = set()  # modules of the current forward not yet run
        self.backwards_due = 0  # forwards (with grad) whose backward has not completed yet
        self.grads_pending = False  # gradients accumulated in its bucket, not yet reduce-scattered


def zero3_units(model: nn.Module, keep: set[nn.Parameter] | None = None
                ) -> list[tuple[list[nn.Module], list[nn.Parameter]]]:
    """(modules, parameters) per ZeRO-3 unit, in forward order: each of `model.layers`, then every
    other top-level child with parameters. A child whose parameters already belong to a unit (a tied
    LM head) joins that unit. `keep`: only these parameters (an engine of one gradient group)."""
    units: list[tuple[list[nn.Module], list[nn.Parameter]]] = []
    owner: dict[nn.Parameter, int] = {}
    if any(True for _ in model.named_parameters(recurse=False)):
        raise NotImplementedError("ZeRO-3 wraps child modules; parameters on the root module are not supported")
    for name, child in model.named_children():
        if name == "layers":  # a ModuleList, or a pipeline rank's ModuleDict keyed by global index
            blocks = list(child.values()) if isinstance(child, nn.ModuleDict) else list(child)
        else:
            blocks = [child]
        for m in blocks:
            params = [p for p in m.parameters() if p.requires_grad and (keep is None or p in keep)]
            if not params:
                continue
            shared = {owner[p] for p in params if p in owner}
            if shared:
                if len(shared) > 1 or any(p not in owner for p in params):
                    raise NotImplementedError(f"module {name} shares parameters with several units")
                units[shared.pop()][0].append(m)
                continue
            for p in params:
                owner[p] = len(units)
            units.append(([m], params))
    return units


class FullyShardedDataParallel(_ShardedBase):
    """ZeRO-3: parameters, gradients and optimizer state sharded; units gathered on demand.

    Without pipeline parallelism a unit is gathered for its forward and again for its backward, freed
    after each, and its gradients are reduce-scattered after every backward (so only the shard is kept
    between micro-batches). With pp > 1 (`chunks` = this rank's pipeline chunks) forwards and backwards
    of different micro-batches interleave, so each unit counts the backwards it still owes, and:
    - `gather="micro_batch"`: gathered per forward and per backward as above (2m all-gathers of the
      stage's parameters per step, the least memory), or `gather="step"`: gathered at its first use
      and kept until the step ends (1 all-gather per step, the whole stage's parameters held);
    - gradients accumulate unsharded in the unit's bucket and are reduce-scattered once per step, as
      soon as the chunk's last backward is done (overlapping the backwards of the other chunks).
    """

    stage = 3

    def __init__(self, model: nn.Module, ctx: ParallelContext, policy: PrecisionPolicy,
                 bucket_mb: float, placements: dict[str, Placement] | None = None,
                 chunks: list[nn.Module] | None = None, gather: str = "micro_batch",
                 only: Collection[str] | None = None, init: LocalInit | None = None) -> None:
        super().__init__(model, ctx, policy, bucket_mb, placements, only)
        if gather not in ("micro_batch", "step"):
            raise ValueError(f"gather must be 'micro_batch' or 'step', got {gather!r}")
        spec = zero3_units(model, set(self.params))
        self.layout = FlatLayout([params for _, params in spec], shards=self.dp)
        chunk_of = {id(m): c for c, ch in enumerate(chunks or [model]) for m in ch.modules()}
        self.units = [_Unit(b, mods, chunk_of[id(mods[0])]) for b, (mods, _) in zip(self.layout.buckets, spec)]
        self.unit_of = {b.index: u for b, u in zip(self.layout.buckets, self.units)}
        self.pipelined = chunks is not None
        self.keep_gathered = self.pipelined and gather == "step"
        # This rank's parameter shard is the only persistent copy of the weights. A meta parameter
        # (sharded init) has only this rank's pieces initialised, straight into the shard.
        self.param_shard = torch.zeros(self.layout.shard_numel, dtype=policy.param_dtype, device=ctx.device)
        with torch.no_grad():
            for pc in self.layout.pieces(self.dp_rank):
                dst = self.param_shard[pc.local: pc.local + pc.numel]
                if pc.param.is_meta:
                    _needs(init).fill(self.place[pc.param], dst, pc.lo, pc.hi)
                else:
                    dst.copy_(pc.param.detach().flatten()[pc.lo: pc.hi])
        self._empty = torch.empty(0, dtype=policy.param_dtype, device=ctx.device)
        for p in self.params:
            give_storage(p, self._empty)
        self.grads = GradBuffer(self.params, policy.grad_dtype, self._grad_ready, self.layout, persistent=False)
        self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=policy.grad_dtype, device=ctx.device)
        self._build_slots(self.param_shard, False, lambda pc: self.grad_shard[pc.local: pc.local + pc.numel])
        # Module call order (registration order) within each chunk, for prefetching the next unit.
        events = sorted(((m, u) for u in self.units for m in u.modules), key=lambda e: self._registration_index(e[0]))
        self.events: list[tuple[nn.Module, _Unit]] = events
        self._in_flight: deque[tuple[Bucket, torch.Tensor, Work]] = deque()
        self._transient_peak = 0
        self.gathered_peak = 0  # most bytes of gathered parameters held at once (measured on the buffers)
        self._hooks = []
        for i, (m, u) in enumerate(self.events):
            self._hooks.append(m.register_forward_pre_hook(self._make_pre_forward(i, u)))
            self._hooks.append(m.register_forward_hook(self._make_post_forward(i, u, m)))
        self._reset_counts(self.layout)

    def _registration_index(self, module: nn.Module) -> int:
        return next(i for i, m in enumerate(self.model.modules()) if m is module)

    def _neighbour(self, i: int, step: int) -> _Unit | None:
        """The unit of the nearest event before (step=-1) or after (+1) event i, in the same chunk."""
        u = self.events[i][1]
        j = i + step
        while 0 <= j < len(self.events):
            other = self.events[j][1]
            if other.chunk == u.chunk and other is not u:
                return other
            j += step
        return None

    # ------------------------------------------------------------------ gather / free
    def _gather(self, u: _Unit) -> None:
        """Issue u's all-gather (asynchronously) unless u is already held or in flight."""
        if u.held:
            return
        if u.full is None:
            u.full = torch.empty(u.bucket.padded, dtype=self.param_shard.dtype, device=self.param_shard.device)
        else:  # the same storage, so the views autograd saved of the last gather see this one's data
            u.full.untyped_storage().resize_(u.full.numel() * u.full.element_size())
        u.held = True
        lo, hi = self.layout.local_range(u.bucket)
        u.work = self.comm.all_gather(u.full, self.param_shard[lo:hi], self.shard_dim, async_op=True)
        self._note_transient()

    def _ensure(self, u: _Unit) -> None:
        """Make u's parameters usable: gather (or finish the prefetch) and point them at the result."""
        self._gather(u)
        if u.work is not None:
            u.work.wait()
            u.work = None
            b = u.bucket
            for p in b.params:
                off = b.offsets[p] - b.start
                p.data = u.full[off: off + self.layout.shapes[p].numel()].view(self.layout.shapes[p])

    def _free(self, u: _Unit) -> None:
        """Drop u's gathered parameters. Dropping the tensor would not free them: autograd keeps what eager
        ops saved for backward (`F.linear` saves `weight.t()`, `_grouped_mm` `weight.transpose(-2, -1)`),
        views of this storage, alive until the backward. So the storage itself is resized to 0 bytes (as
        FSDP does); u's backward gathers into it again before the saved views are read."""
        if u.work is not None:
            u.work.wait()
            u.work = None
        for p in u.bucket.params:
            p.data = self._empty
        if u.held:
            u.full.untyped_storage().resize_(0)
            u.held = False

    def _release(self, u: _Unit) -> None:
        """Free u after a use, unless the step keeps it gathered."""
        if not self.keep_gathered:
            self._free(u)

    def gathered_bytes(self) -> int:
        """Bytes of gathered parameters this engine holds now."""
        return sum(u.full.untyped_storage().nbytes() for u in self.units if u.full is not None)

    def _note_transient(self) -> None:
        held = self.gathered_bytes()
        grads = self.grads.transient_bytes + sum(_nbytes(d) for _, d, _ in self._in_flight)
        self.gathered_peak = max(self.gathered_peak, held)
        self._transient_peak = max(self._transient_peak, held + grads)

    # ------------------------------------------------------------------ hooks
    def _make_pre_forward(self, i: int, u: _Unit):  # noqa: ANN202 - a hook
        def hook(module: nn.Module, args: Any) -> None:
            if not u.forward_pending:  # a new forward of this unit
                u.forward_pending = {id(m) for m in u.modules}
                if torch.is_grad_enabled():
                    u.backwards_due += 1
            self._ensure(u)
            nxt = self._neighbour(i, +1)
            if nxt is not None:
                self._gather(nxt)  # prefetch: overlaps this module's compute
        return hook

    def _make_post_forward(self, i: int, u: _Unit, module: nn.Module):  # noqa: ANN202 - a hook
        def hook(mod: nn.Module, args: Any, output: Any) -> Any:
            u.forward_pending.discard(id(module))
            if not u.forward_pending:
                self._release(u)
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                for t in tensors:
                    t.register_hook(self._make_pre_backward(i, u))
            return output
        return hook

    def _make_pre_backward(self, i: int, u: _Unit):  # noqa: ANN202 - a hook
        def hook(grad: torch.Tensor) -> None:
            if not u.backwards_due:
                return
            self._ensure(u)
            prev = self._neighbour(i, -1)  # the unit whose backward comes next
            if prev is not None and prev.backwards_due:
                self._gather(prev)
        return hook

    def before_backward(self, chunk: int, last: bool, weights_only: bool = False) -> None:
        super().before_backward(chunk, last, weights_only)
        if weights_only:
            # The W half of a split backward re-enters the graph below the modules' outputs, so no
            # pre-backward hook gathers for it: gather the chunk's units that still owe a backward.
            for u in self.units:
                if u.chunk == chunk and u.backwards_due:
                    self._ensure(u)

    def after_backward(self, chunk: int) -> None:
        # The B half of a split backward uses the weights without producing their gradients: free them.
        for u in self.units:
            if u.chunk == chunk and u.held:
                self._release(u)

    def _grad_ready(self, p: nn.Parameter) -> None:
        b = self._count(self.layout, p)
        if b is None:
            return
        u = self.unit_of[b.index]
        u.backwards_due = max(0, u.backwards_due - 1)
        u.grads_pending = True
        self._remaining[b.index] = len(b.params)
        if not self.pipelined or self._last_micro:
            self._reduce_unit(u)
        self._release(u)

    def _reduce_unit(self, u: _Unit) -> None:
        b = u.bucket
        data = self.grads.bucket_data(b)
        self.grads.release(b)
        lo, hi = self.layout.shard_range(b, self.dp_rank)
        work = self.comm.reduce_scatter(data[lo - b.start: hi - b.start], data, self.shard_dim, async_op=True)
        self._in_flight.append((b, data, work))
        self._note_transient()
        u.grads_pending = False
        self._drain(_MAX_IN_FLIGHT)

    def _drain(self, keep: int) -> None:
        while len(self._in_flight) > keep:
            b, data, work = self._in_flight.popleft()
            work.wait()
            lo, hi = self.layout.shard_range(b, self.dp_rank)
            llo, lhi = self.layout.local_range(b)
            self.grad_shard[llo:lhi].add_(data[lo - b.start: hi - b.start])

    # ------------------------------------------------------------------ the step
    def zero_grad(self) -> None:
        self.grad_shard.zero_()

    def finish_grad_sync(self) -> None:
        for u in self.units:
            b = u.bucket
            # Gradients not reduced yet: a parameter that got no gradient in some backward.
            if u.grads_pending or self._remaining[b.index] != len(b.params):
                self._reduce_unit(u)
            self._free(u)
            u.backwards_due = 0
            u.forward_pending = set()
        self._drain(0)
        self._reduce_replicas()
        if self.grad_divisor > 1:
            self.grad_shard.div_(self.grad_divisor)
        self._reset_counts(self.layout)

    def release_gathered(self) -> None:
        # A no_grad forward counted no backward (`_make_pre_forward`); under zero3_gather="step" it kept
        # the stage gathered, which only a step's end frees: free every unit now.
        for u in self.units:
            self._free(u)
            u.forward_pending = set()

    def owned_grads(self) -> list[torch.Tensor]:
        return [self.grad_shard]

    def _count(self, layout: FlatLayout, p: nn.Parameter) -> Bucket | None:
        # Counted on every backward: a unit's gradients are complete once per backward.
        b = layout.bucket_of[p]
        self._remaining[b.index] -= 1
        return b if self._remaining[b.index] == 0 else None

    def model_state(self) -> dict[str, torch.Tensor]:
        return {self._key(pc): self.param_shard[pc.local: pc.local + pc.numel] for pc in self.pieces}

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        out = {}
        for u in self.units:
            self._ensure(u)
            for p in u.bucket.params:
                out[self.names[p]] = p.detach().clone()
            self._free(u)
        return out

    def memory(self, optimizer: AdamW) -> MemoryReport:
        optim, master = self._optim_memory(optimizer)
        return MemoryReport(_nbytes(self.param_shard), _nbytes(self.grad_shard), optim, master,
                            self._transient_peak)

    def close(self) -> None:
        self.grads.remove_hooks()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
