"""Tensor parallelism (Megatron-style) and sequence parallelism, applied to a plain model in place.

The layers and the styles are generic; which module gets which style is the model's table
(`models/llama_tp_plan.py` for the Llama). For the Llama, a decoder block becomes two tensor-parallel
regions, each entered once and left once:

    attention: [enter] → q/k/v column-parallel (local heads) → RoPE, SDPA on local heads → o row-parallel [leave]
    MLP:       [enter] → gate/up column-parallel → SwiGLU → down row-parallel [leave]

Without sequence parallelism (SP) *enter* is f (identity; all-reduce of the input grad) and *leave* is
g (all-reduce of the partial outputs): 2 all-reduces of s·b·h forward and 2 backward per layer. With
SP the residual stream, the norms and the residual adds run on a 1/tp slice of the sequence; *enter*
all-gathers the sequence and *leave* reduce-scatters it (the same bytes on the wire as the
all-reduce). Entering is a forward pre-hook on the `Attention`/`MLP` module, not a step of each
column linear, because q, k and v (gate and up) share one input: one gather, not three.

The embedding is vocab-parallel (rows sharded; its partial lookups are summed, or reduce-scattered
along the sequence under SP), the LM head is column-parallel over the vocabulary (sharing the
embedding's Parameter when tied), and `vocab_parallel_cross_entropy` computes the loss from the
vocab-sharded logits with three all-reduces of b·s numbers, never materialising the full logits.

Some replicated parameters get a gradient that is partial per rank: the norm weights under SP (each
rank saw only its sequence slice) and Qwen3's q/k norm weights (SP or not: each rank normalised its own
heads with the shared gain); under SP `parallel/moe_tokens.py` adds the MoE layers' parameters (each tp
rank routed its sequence shard). They are not hooked: the plan lists them (`partial`, copied into each
one's `Placement.tp_partial`) and the step runner sums them over tp once per step, after the
data-parallel reduction and before the gradient norm — the owned pieces of all of them concatenated
into ONE all-reduce (per 25 MiB: `sum_partial_grads`; Megatron-Core's deferred layernorm all-reduce in
`finalize_model_grads`). Summing after the dp reduction is exact in math (sums commute), and every
tp rank of a dp rank owns the same pieces (equal local shapes give equal flat layouts). A hook per
weight would cost 2 latency-bound all-reduces of h numbers per layer per micro-batch, each one waited
for by backward.
The k/v projections of a kv head replicated on tp/n_kv ranks (each rank used it for its own query
heads only) keep a gradient hook (`_sum_over_replicas`): their sum runs over a subset of tp. A plain
tensor-parallel model trained without the step runner calls `sum_partial_param_grads(model)` after
its backward passes. The plan returned records, per parameter name, a `TPShard` saying how the local
tensor relates to the full one; `parallelize` copies it into each parameter's `Placement`.

The model code needs no change: attention derives its local head count from the projection widths.
Initialisation: on a meta model (the runtime's way) the shards stay meta and `parallel/materialize.py`
later fills each rank's shard with its slice of the 1-process model's initial values; on a materialised
model the shard is cut from it. Either way a TP run starts from exactly the unsharded model.
The model has no dropout; if one is added, dropout inside a region (local heads/ffn columns) needs a
per-tp-rank seed and dropout on the SP residual stream a per-tp-rank seed too, while the non-SP
residual stream needs the same seed on every tp rank.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from pentatron.config import ParallelConfig
from pentatron.distributed.comm import Comm
from pentatron.distributed.context import ParallelContext
from pentatron.distributed.functional import (
    copy_to_parallel,
    gather_sequence,
    reduce_from_parallel,
    scatter_sequence,
)
from pentatron.layout import tensor_parallel_problems, tensor_parallel_warnings
from pentatron.models.llama_tp_plan import LLAMA_TP_PLAN
from pentatron.models.loss import DEFAULT_CHUNK_TOKENS, linear_cross_entropy
from pentatron.parallel.placement import TPShard

TP = "tp"


_Made = dict[nn.Parameter, TPShard]  # the shards `apply_tensor_parallel` created, recorded in its plan


def _shard_param(full: torch.Tensor, dim: int, index: int, parts: int, tp: int, made: _Made) -> nn.Parameter:
    """Slice `index` of `parts` equal slices of `full` along `dim` (parts < tp: slices replicated)."""
    length = full.shape[dim] // parts
    local = nn.Parameter(full.detach().narrow(dim, index * length, length).clone(), requires_grad=full.requires_grad)
    made[local] = TPShard(dim, index, parts, tp // parts)
    return local


# ---------------------------------------------------------------------------------------- layers
def _enter(x: torch.Tensor, comm: Comm, sequence_parallel: bool) -> torch.Tensor:
    return gather_sequence(x, comm, TP) if sequence_parallel else copy_to_parallel(x, comm, TP)


def _leave(x: torch.Tensor, comm: Comm, sequence_parallel: bool) -> torch.Tensor:
    return scatter_sequence(x, comm, TP) if sequence_parallel else reduce_from_parallel(x, comm, TP)


class ColumnParallelLinear(nn.Linear):
    """y_local = x · W_localᵀ with W split along its output features; the output stays split.

    With `communicate_input`, the layer enters the parallel region itself (f, or the sequence
    all-gather under SP); inside a block the region's pre-hook does it once for q/k/v instead.
    `gemm` is the local product (train.fp8 puts an FP8 one here: parallel/fp8.py)."""

    gemm = staticmethod(F.linear)

    def __init__(self, weight: nn.Parameter, comm: Comm, *, sequence_parallel: bool = False,
                 communicate_input: bool = True) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", None)
        self.comm, self.sequence_parallel, self.communicate_input = comm, sequence_parallel, communicate_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.communicate_input:
            x = _enter(x, self.comm, self.sequence_parallel)
        return self.gemm(x, self.weight)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out_local={self.out_features}, sp={self.sequence_parallel}, "
                f"communicate_input={self.communicate_input}")


@dataclass(frozen=True)
class _TPVocab:
    """A vocab-parallel head's vocabulary slice and the tp reductions of the chunked loss."""

    vocab_start: int
    comm: Comm

    def all_reduce_max(self, t: torch.Tensor) -> None:
        self.comm.all_reduce(t, TP, op="max")

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        self.comm.all_reduce(t, TP)


class VocabParallelHead(ColumnParallelLinear):
    """The LM head split over the vocabulary (`ColumnParallelLinear`, entering the region itself): the
    logits of this rank's slice, or with targets the mean cross-entropy from the chunked vocab-parallel
    loss (models/loss.py; `vocab_parallel_cross_entropy`'s collectives, never the full logits)."""

    def __init__(self, weight: nn.Parameter, comm: Comm, *, sequence_parallel: bool, chunk_tokens: int) -> None:
        super().__init__(weight, comm, sequence_parallel=sequence_parallel, communicate_input=True)
        self.chunk_tokens = chunk_tokens

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        x = _enter(x, self.comm, self.sequence_parallel)
        shards = _TPVocab(self.comm.ctx.local_rank(TP) * self.weight.shape[0], self.comm)
        return linear_cross_entropy(x, self.weight, targets, self.chunk_tokens, shards)


class RowParallelLinear(nn.Linear):
    """y = Σ_ranks x_local · W_localᵀ with W split along its input features: the input is the split
    output of a column-parallel layer; the partial products are all-reduced (g) or, under SP,
    reduce-scattered along the sequence. `gemm`: the local product, as ColumnParallelLinear's."""

    gemm = staticmethod(F.linear)

    def __init__(self, weight: nn.Parameter, comm: Comm, *, sequence_parallel: bool = False) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", None)
        self.comm, self.sequence_parallel = comm, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _leave(self.gemm(x, self.weight), self.comm, self.sequence_parallel)

    def extra_repr(self) -> str:
        return f"in_local={self.in_features}, out={self.out_features}, sp={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + V/tp) of the table on each rank. Tokens outside the slice
    look up zeros, so summing over tp (or reduce-scattering along the sequence under SP) gives the
    full lookup."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, comm: Comm, *,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_start = vocab_start
        self.comm, self.sequence_parallel = comm, sequence_parallel

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return _leave(out, self.comm, self.sequence_parallel)

    def extra_repr(self) -> str:
        return f"vocab=[{self.vocab_start}, {self.vocab_start + self.weight.shape[0]}), dim={self.weight.shape[1]}"


# ---------------------------------------------------------------------------------------- loss
class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, comm: Comm, ignore_index: int
                ) -> torch.Tensor:
        # logits: [N, V/tp] float, this rank's vocabulary slice; targets: [N] global ids.
        v_local = logits.shape[-1]
        start = comm.ctx.local_rank(TP) * v_local
        logits_max = logits.detach().amax(dim=-1)
        comm.all_reduce(logits_max, TP, op="max")  # any shift is exact; the global max avoids overflow
        shifted = logits - logits_max.unsqueeze(-1)

        local_t = targets - start
        mine = (local_t >= 0) & (local_t < v_local)
        local_t = local_t.masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([target_logit, sum_exp])  # one all-reduce for the two sums
        comm.all_reduce(both, TP)
        target_logit, sum_exp = both[0], both[1]

        valid = targets != ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, mine & valid, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_t, hit, valid = ctx.saved_tensors
        # d loss_i / d logit_ij = softmax_ij − [j is the target]; zero for ignored rows.
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= hit.to(grad.dtype)
        grad.mul_((grad_loss * valid.to(grad_loss.dtype)).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, comm: Comm,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """`F.cross_entropy(full_logits, targets)` from this rank's vocabulary slice of the logits.

    local_logits: [..., V/tp] (rank r holds vocabulary ids [r·V/tp, (r+1)·V/tp)); targets: [...].
    Communication: one max all-reduce and one all-reduce of two sums, each of b·s numbers."""
    loss = _VocabParallelCrossEntropy.apply(local_logits.reshape(-1, local_logits.shape[-1]),
                                            targets.reshape(-1), comm, ignore_index)
    if reduction == "none":
        return loss.view(targets.shape)
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (targets != ignore_index).sum().clamp(min=1)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


# ---------------------------------------------------------------------------------------- apply
@dataclass(frozen=True)
class TensorParallelPlan:
    """What `apply_tensor_parallel` did; kept on the model as `model.tensor_parallel`."""

    tp: int
    rank: int
    sequence_parallel: bool
    kv_replicas: int  # tp ranks sharing one kv head (1: kv heads are split, not replicated)
    comm: Comm
    shards: dict[str, TPShard]  # by parameter name: how each local tensor relates to the full one
    # replicated parameters whose gradient is partial per tp rank, by name: summed over tp once per step
    partial: frozenset[str] = frozenset()


TP_STYLES = ("region", "colwise", "colwise_heads", "rowwise", "sequence_norm", "head_norm", "vocab_embedding",
             "vocab_head")


def apply_tensor_parallel(model: nn.Module, ctx: ParallelContext, comm: Comm | None = None, sp: bool = False,
                          plan: Mapping[str, str] = LLAMA_TP_PLAN, node_size: int | None = None) -> nn.Module:
    """Shard a model in place over ctx's tp dimension as its `plan` says (module path pattern → style,
    see `models/llama_tp_plan.py`); modules the plan does not name stay replicated. Parameter names
    are unchanged. Works on a whole model or on a pipeline stage (whatever modules it holds). Returns
    the model; its forward now returns this rank's vocabulary slice of the logits, to be fed to
    `vocab_parallel_cross_entropy`. `node_size` (devices per node, when known) only adds a warning."""
    comm = comm or ctx.comm
    tp, rank = ctx.size(TP), ctx.local_rank(TP)
    if hasattr(model, "tensor_parallel"):
        raise ValueError("apply_tensor_parallel: this model is already tensor-parallel")
    unknown = sorted({style for style in plan.values() if style not in TP_STYLES})
    if unknown:
        raise ValueError(f"unknown tensor-parallel styles {unknown}; known: {', '.join(TP_STYLES)}")
    if node_size is None and ctx.device.type == "cuda":
        node_size = torch.cuda.device_count()
    for w in tensor_parallel_warnings(tp, node_size):
        warnings.warn(w, stacklevel=2)
    problems = tensor_parallel_problems(model.cfg, tp, sp)
    if problems:
        raise ValueError("cannot apply tensor parallelism: " + "; ".join(problems))
    if tp == 1:
        return model

    handles: list[Any] = []
    grad_hooks: list[tuple[nn.Parameter, Any]] = []  # registered once the parameters have storage
    partial: list[nn.Parameter] = []  # gradients summed over tp once per step (`sum_partial_grads`)
    made: _Made = {}
    new_of: dict[nn.Parameter, nn.Parameter] = {}  # full parameter → this rank's shard (ties follow)
    kv_replicas = 1
    for name, module in list(model.named_modules()):  # parents before children
        style = next((st for pattern, st in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None:
            continue
        if style == "region":
            handles.append(module.register_forward_pre_hook(_region_entry(comm, sp)))
            continue
        if style == "sequence_norm":
            if sp:  # under SP each rank's grad covers its sequence slice only: the full grad is their sum
                partial.append(module.weight)
            continue
        if style == "head_norm":  # one gain over head_dim shared by all heads; each rank saw its heads only
            partial.append(module.weight)
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        full = module.weight
        if style == "colwise_heads":
            n = full.shape[0] // parent.head_dim
            replicas = 1 if n % tp == 0 else tp // n  # tp > n heads: ranks r·(tp/n)… share head r
            kv_replicas = max(kv_replicas, replicas)
            shard = _shard_param(full, 0, rank // replicas, tp // replicas, tp, made)
            if replicas > 1:
                grad_hooks.append((shard, _sum_over_replicas(comm, tp, rank, replicas)))
            new = ColumnParallelLinear(shard, comm, sequence_parallel=sp, communicate_input=False)
        elif style == "colwise":
            shard = _shard_param(full, 0, rank, tp, tp, made)
            new = ColumnParallelLinear(shard, comm, sequence_parallel=sp, communicate_input=False)
        elif style == "rowwise":
            shard = _shard_param(full, 1, rank, tp, tp, made)
            new = RowParallelLinear(shard, comm, sequence_parallel=sp)
        elif style == "vocab_embedding":
            shard = _shard_param(full, 0, rank, tp, tp, made)
            new = VocabParallelEmbedding(shard, rank * shard.shape[0], comm, sequence_parallel=sp)
        else:  # vocab_head: a tied head uses the embedding's shard, so its gradient sums both uses
            shard = new_of[full] if full in new_of else _shard_param(full, 0, rank, tp, tp, made)
            new = VocabParallelHead(shard, comm, sequence_parallel=sp,
                                    chunk_tokens=getattr(module, "chunk_tokens", DEFAULT_CHUNK_TOKENS))
        new_of[full] = shard
        setattr(parent, attr, new)
    # Anything not sharded above is replicated over tp (and kept in sync).
    shards = {n: made.get(p, TPShard(None, 0, 1, tp)) for n, p in model.named_parameters()}
    partial_names = frozenset(n for n, p in model.named_parameters() if any(p is q for q in partial))
    model.tensor_parallel = TensorParallelPlan(tp, rank, sp, kv_replicas, comm, shards, partial_names)
    model._tensor_parallel_hooks = handles
    model._tensor_parallel_grad_hooks = grad_hooks
    if not any(p.is_meta for p, _ in grad_hooks):
        register_grad_hooks(model)
    return model


def register_grad_hooks(model: nn.Module) -> None:
    """Register the gradient hooks `apply_tensor_parallel` left pending. On a meta model they wait until
    the parameters have storage (`parallel/materialize.py`: giving a meta parameter storage drops its
    hooks); idempotent."""
    pending = getattr(model, "_tensor_parallel_grad_hooks", [])
    if any(p.is_meta for p, _ in pending):
        raise RuntimeError("register_grad_hooks: parameters are still on the meta device")
    for p, hook in pending:
        model._tensor_parallel_hooks.append(p.register_hook(hook))
    model._tensor_parallel_grad_hooks = []


def _region_entry(comm: Comm, sp: bool) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (_enter(args[0], comm, sp), *args[1:])

    return hook


# The most bytes `sum_partial_grads` concatenates into one buffer (the default DP bucket, parallel.bucket_mb):
# the MoE layers' partial gradients under SP are large, so one concatenation of them all would be a transient
# copy of every owned expert gradient; the norms' all fit in one.
PARTIAL_CHUNK_BYTES = int(ParallelConfig.bucket_mb * 2**20)


@torch.no_grad()
def sum_partial_grads(grads: Sequence[torch.Tensor], comm: Comm, chunk_bytes: int = PARTIAL_CHUNK_BYTES) -> None:
    """Sum `grads` over tp in place: consecutive tensors concatenated into one all-reduce of at most
    `chunk_bytes` (one call when they all fit, as the norms' do), a larger tensor all-reduced alone in
    place. Every tp rank must pass tensors of the same sizes in the same order: the owned pieces of the
    `Placement.tp_partial` parameters, which sit at the same offsets on every tp rank of a dp rank."""
    group: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if group and size + nbytes > chunk_bytes:
            _all_reduce_together(group, comm)
            group, size = [], 0
        group.append(g)
        size += nbytes
    if group:
        _all_reduce_together(group, comm)


def _all_reduce_together(grads: list[torch.Tensor], comm: Comm) -> None:
    """One all-reduce over tp of `grads`: in place when it is one contiguous tensor, else concatenated."""
    if len(grads) == 1 and grads[0].is_contiguous():
        comm.all_reduce(grads[0], TP)
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, TP)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def sum_partial_param_grads(model: nn.Module) -> None:
    """A plain tensor-parallel model trained without the step runner (tests, benchmarks): sum the `.grad`
    of its partial-gradient parameters over tp, once after the step's backward passes. Nothing to do on
    a model that is not tensor-parallel."""
    plan = getattr(model, "tensor_parallel", None)
    if plan is None:
        return
    grads = [p.grad for n, p in model.named_parameters() if n in plan.partial and p.grad is not None]
    sum_partial_grads(grads, plan.comm)


def _sum_over_replicas(comm: Comm, tp: int, rank: int, replicas: int) -> Any:
    """Sum a replicated kv head's grad over the ranks sharing it. The comm layer has groups per mesh
    dimension only, so each rank writes its grad into its head's slot of a [n_kv, …] buffer and the
    buffer is all-reduced over tp (n_kv·d·h numbers: the size of the full projection)."""
    n_kv, head = tp // replicas, rank // replicas

    def hook(g: torch.Tensor) -> torch.Tensor:
        buf = g.new_zeros((n_kv, *g.shape))
        buf[head] = g
        comm.all_reduce(buf, TP)
        return buf[head].clone()

    return hook


# ---------------------------------------------------------------------------------------- helpers
@torch.no_grad()
def gather_full_tensor(local: torch.Tensor, shard: TPShard, comm: Comm) -> torch.Tensor:
    """The full tensor from every tp rank's local one (a collective over tp when it is split)."""
    if shard.dim is None or shard.parts == 1:
        return local.detach().clone()
    tp = comm.ctx.size(TP)
    local = local.detach().movedim(shard.dim, 0).contiguous()
    full = torch.empty((tp * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    comm.all_gather(full, local, TP)
    chunks = full.chunk(tp)[:: shard.replicas]  # one copy of each replicated kv head
    return torch.cat(chunks).movedim(0, shard.dim).contiguous()


@torch.no_grad()
def gather_full_params(model: nn.Module, comm: Comm, tensors: dict[str, torch.Tensor] | None = None
                       ) -> dict[str, torch.Tensor]:
    """Every parameter of a model (tensor-parallel or not) at its full shape, by name — identical on all
    tp ranks (a collective: every tp rank must call it). `tensors` (name → this rank's local tensor, e.g.
    the parameters a ZeRO engine gathered over dp) replaces the model's own parameter data."""
    plan = getattr(model, "tensor_parallel", None)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        local = tensors[name] if tensors is not None else p
        shard = plan.shards[name] if plan is not None else TPShard(None)
        out[name] = gather_full_tensor(local, shard, comm)
    return out
